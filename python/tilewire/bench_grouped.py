"""python -m tilewire.bench_grouped: tilewire.grouped_gemm against torch._grouped_mm and one dense
torch matmul of the same FLOPs, on one GPU, side by side.

    python -m tilewire.bench_grouped                       # the MoE shapes below
    python -m tilewire.bench_grouped --shape 64x256,7168,2048 --repeats 200
    python -m tilewire.bench_grouped --json grouped.json   # and the rows, for tilewire.bench

A shape is EXPERTSxROWS,K,N: EXPERTS groups of ROWS rows each (a balanced router; ROWS a
multiple of 128, the grouped GEMM's contract), K and N multiples of 8. The default shapes:
32x1024,7168,4096 and 32x1024,2048,7168 (expert GEMMs of hidden 7168 and expert width 2048,
gate and up fused, then down, 32 experts a GPU), 8x4096,4096,14336 (8 experts of 4096 ->
14336), and 32x128,7168,4096 (few rows per expert). Per shape, fresh inputs: a
[EXPERTS * ROWS, K] and b [EXPERTS, N, K] bf16 (randn), the offsets an int32 device tensor;
every variant writes bf16:
  tilewire           tilewire.grouped_gemm(a, b, offsets, out=out)
  torch._grouped_mm  torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets[1:]) (left out
                     where this torch has none)
  dense-mm           torch.mm(a, b[0].t(), out=dense): one [EXPERTS * ROWS, K] x [K, N]
                     product, the same FLOPs (the rate a grouped GEMM aims at)
Times: CUDA events around each call after --warmup calls; the median (p10, p90) of --repeats
calls. TFLOP/s: 2 * EXPERTS * ROWS * N * K / median; ours/grouped_mm and ours/dense: tilewire's
TFLOP/s over theirs. Unless --no-check, the first 128 rows of every expert of tilewire's and
torch._grouped_mm's outputs are checked against an fp32 reference (relative error below 1e-2).
--json writes the rows as tilewire.bench reads them (``python -m tilewire.bench --plot FILE``
draws them; speedup: over torch._grouped_mm). Exit status: 0 all rows passed, 1 a check
failed, 2 no torch or no CUDA GPU, 64 bad command line.
"""

import argparse
import datetime
import json
import re
import socket
import sys

from ._dist_sweep import _stats

EXIT_FAILED, EXIT_NO_GPU, EXIT_USAGE = 1, 2, 64
OP = "grouped_gemm"
TILE = 128  # rows per expert must be a multiple of this (tw_grouped_gemm's offsets)
VARIANTS = ("tilewire", "torch._grouped_mm", "dense-mm")
BASELINE = "torch._grouped_mm"
# (experts, rows per expert, K, N)
DEFAULT_SHAPES = [(32, 1024, 7168, 4096), (32, 1024, 2048, 7168), (8, 4096, 4096, 14336),
                  (32, 128, 7168, 4096)]

# ---- shapes and rows (no torch: host-tested) -----------------------------------------------


def parse_shape(text):
    """(experts, rows, k, n) from "EXPERTSxROWS,K,N"; ValueError saying what is wrong."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not m:
        raise ValueError("shape %r: expected EXPERTSxROWS,K,N (e.g. 32x1024,7168,4096)" % text)
    shape = tuple(int(g) for g in m.groups())
    why = check_shape(shape)
    if why:
        raise ValueError("shape %r: %s" % (text, why))
    return shape


def check_shape(shape):
    """None, or why tilewire.grouped_gemm cannot run the shape."""
    experts, rows, k, n = shape
    if min(shape) < 1:
        return "every figure must be positive"
    if experts > 65536:
        return "at most 65536 experts"
    if rows % TILE:
        return "rows per expert (%d) must be a multiple of %d" % (rows, TILE)
    if k % 8 or n % 8:
        return "K and N must be multiples of 8"
    return None


def shape_label(shape):
    experts, rows, k, n = shape
    return "%dx%d K=%d N=%d" % (experts, rows, k, n)


def flops(shape):
    experts, rows, k, n = shape
    return 2.0 * experts * rows * n * k


def make_rows(label, flop_count, t, ok):
    """tilewire.bench's rows for one shape from `t` {variant: (median, p10, p90) ms} and `ok`
    {variant: bool}: TFLOP/s, and the speedup over torch._grouped_mm (0 where it was not
    timed)."""
    base = t.get(BASELINE)
    rows = []
    for variant in VARIANTS:
        if variant not in t:
            continue
        ms, p10, p90 = t[variant]
        good = ms > 0
        rows.append({"op": OP, "shape": label, "variant": variant, "ms": ms, "ms_p10": p10,
                     "ms_p90": p90, "tflops": flop_count / (ms * 1e-3) / 1e12 if good else 0.0,
                     "gbps": 0.0, "speedup": base[0] / ms if base and good else 0.0,
                     "overlap": 0.0, "ok": bool(ok.get(variant, True))})
    return rows


def _ratio(ours, theirs):
    if not ours or not theirs:
        return "-"
    return "%.2fx" % (ours / theirs)


def format_table(doc):
    """The short table: per shape each variant's TFLOP/s and tilewire's over the others'."""
    by_shape = {}
    for r in doc.get("rows", []):
        by_shape.setdefault(r.get("shape"), {})[r.get("variant")] = r
    titles = ("shape (experts x rows)", "tilewire", BASELINE, "dense-mm", "ours/grouped_mm",
              "ours/dense", "check")
    cells = []
    for label, rows in by_shape.items():
        rate = {v: rows[v]["tflops"] if v in rows else 0.0 for v in VARIANTS}
        cells.append([str(label)] + ["%.1f" % rate[v] if rate[v] else "-" for v in VARIANTS] + [
            _ratio(rate["tilewire"], rate[BASELINE]), _ratio(rate["tilewire"], rate["dense-mm"]),
            "ok" if all(r.get("ok", True) for r in rows.values()) else "FAIL"])
    width = [max([len(t)] + [len(c[i]) for c in cells]) for i, t in enumerate(titles)]

    def line(row):
        return "  ".join(c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, width))).rstrip()

    meta = doc.get("meta", {})
    head = ["tilewire.bench_grouped %s" % meta.get("date", "")]
    for key, fmt in (("gpu", "%s"), ("torch", "torch %s"), ("tilewire", "tilewire %s")):
        if meta.get(key):
            head.append(fmt % meta[key])
    text = [" | ".join(head), "", line(titles), "-" * (sum(width) + 2 * (len(width) - 1))]
    text += [line(c) for c in cells] or ["(no rows)"]
    text += ["", "TFLOP/s: 2 * experts * rows * N * K / median time; ours/X: tilewire's TFLOP/s "
             "over X's."]
    return "\n".join(text) + "\n"


# ---- the run (torch and a GPU) --------------------------------------------------------------


def _time(torch, fn, warmup, repeats):
    """(median, p10, p90) ms of fn, CUDA events around each call."""
    for _ in range(max(0, warmup)):
        fn()
    torch.cuda.synchronize()
    n = max(1, repeats)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return _stats([s.elapsed_time(e) for s, e in zip(starts, ends)])


def _sample_ok(torch, got, a, b, rows):
    """The first 128 rows of every expert of `got` against the fp32 reference."""
    for e in range(b.shape[0]):
        s = e * rows
        want = a[s:s + TILE].float() @ b[e].float().t()
        err = (got[s:s + TILE].float() - want).abs().max() / want.abs().max().clamp_min(1e-30)
        if not err.item() < 1e-2:
            return False
    return True


def run_shape(torch, tw, shape, args):
    """({variant: (median, p10, p90)}, {variant: ok}) for one shape."""
    experts, rows, k, n = shape
    m = experts * rows
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    offsets = torch.arange(0, m + 1, rows, device="cuda", dtype=torch.int32)
    ends = offsets[1:].contiguous()
    b_t = b.transpose(-2, -1)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    dense = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fns = {"tilewire": lambda: tw.grouped_gemm(a, b, offsets, out=out),
           "dense-mm": lambda: torch.mm(a, b[0].t(), out=dense)}
    if hasattr(torch, "_grouped_mm"):
        try:
            torch._grouped_mm(a, b_t, offs=ends)
            fns[BASELINE] = lambda: torch._grouped_mm(a, b_t, offs=ends)
        except RuntimeError as e:  # a build without the kernel for this GPU
            print("tilewire.bench_grouped: torch._grouped_mm failed (%s); its row is left out"
                  % str(e).splitlines()[0], file=sys.stderr)
    ok = {}
    if not args.no_check:
        fns["tilewire"]()
        ok["tilewire"] = _sample_ok(torch, out, a, b, rows)
        if BASELINE in fns:
            ok[BASELINE] = _sample_ok(torch, torch._grouped_mm(a, b_t, offs=ends), a, b, rows)
    t = {v: _time(torch, fns[v], args.warmup, args.repeats) for v in VARIANTS if v in fns}
    return t, ok


def _meta(torch, tw, args, argv):
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"tool": "tilewire.bench_grouped",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S +0000"),
            "command": "python -m tilewire.bench_grouped " + " ".join(argv),
            "host": socket.gethostname(), "gpu": props.name, "gpu_count": 1,
            "sm_count": props.multi_processor_count,
            "compute_capability": "%d.%d" % (props.major, props.minor),
            "torch": torch.__version__, "tilewire": tw.__version__,
            "grouped_mm": hasattr(torch, "_grouped_mm"), "repeats": args.repeats,
            "warmup": args.warmup}


# ---- command line -------------------------------------------------------------------------


def _parser():
    p = argparse.ArgumentParser(prog="python -m tilewire.bench_grouped",
                                description="tilewire.grouped_gemm against torch._grouped_mm "
                                "and a dense torch.mm of the same FLOPs, on one GPU")
    p.add_argument("--shape", action="append", metavar="EXPERTSxROWS,K,N",
                   help="a shape instead of the defaults (repeatable), e.g. 32x1024,7168,4096")
    p.add_argument("--repeats", type=int, default=100, help="timed calls per variant")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first")
    p.add_argument("--no-check", action="store_true", help="skip verifying results")
    p.add_argument("--json", metavar="FILE", help="write the rows here")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shape] if args.shape else list(DEFAULT_SHAPES)
    except ValueError as e:
        print("tilewire.bench_grouped: %s" % e, file=sys.stderr)
        return EXIT_USAGE
    if args.repeats < 1 or args.warmup < 0:
        print("tilewire.bench_grouped: --repeats must be positive and --warmup >= 0",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        import torch
    except ImportError:
        print("tilewire.bench_grouped: needs torch", file=sys.stderr)
        return EXIT_NO_GPU
    if not torch.cuda.is_available():
        print("tilewire.bench_grouped: no CUDA GPU", file=sys.stderr)
        return EXIT_NO_GPU
    import tilewire as tw

    rows = []
    for i, shape in enumerate(shapes):
        label = shape_label(shape)
        print("[%s %d/%d] %s ..." % (OP, i + 1, len(shapes), label), file=sys.stderr, flush=True)
        t, ok = run_shape(torch, tw, shape, args)
        rows += make_rows(label, flops(shape), t, ok)
        torch.cuda.empty_cache()  # the next shape's fresh inputs
    doc = {"meta": _meta(torch, tw, args, argv), "rows": rows}
    sys.stdout.write("\n" + format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0 if all(r.get("ok", True) for r in rows) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
