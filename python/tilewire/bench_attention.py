"""python -m tilewire.bench_attention: tilewire.attention against torch SDPA (the cuDNN and the
flash backends, through torch.nn.attention.sdpa_kernel) on one GPU, side by side.

    python -m tilewire.bench_attention                         # the shapes below, causal and not
    python -m tilewire.bench_attention --shape 4,16,4096,128 --repeats 200

A shape is B,H,S,D (batch, heads, sequence, head_dim; heads_kv = heads, seq_q = seq_kv). The
default shapes: 4,16,4096,128, 4,16,12288,128 and 4,16,8192,64, each non-causal and causal.
Inputs: fresh randn bf16 q, k, v (B, S, H, D); SDPA gets their (B, H, S, D) transposed views
(the layout SDPA's kernels take without a copy). Times: CUDA events around each call after
--warmup calls, the median of --repeats calls. TFLOP/s: 4 B H S^2 D / median (halved for
causal); ratio: tilewire's TFLOP/s over each backend's. A backend this torch or GPU cannot
run prints "n/a". Unless --no-check, tilewire's output is compared with the first backend's
that ran (max abs error below 2e-2). Exit status: 0, 1 a check failed, 2 no torch or no GPU.
"""

import argparse
import statistics
import sys

DEFAULT_SHAPES = [(4, 16, 4096, 128), (4, 16, 12288, 128), (4, 16, 8192, 64)]


def parse_shape(text):
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError("shape %r: expected B,H,S,D (e.g. 4,16,4096,128)" % text)
    return tuple(int(p) for p in parts)


def flops(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def hopper_torch(prog):
    """torch, where it imports and sees a Hopper GPU; else None, the reason printed as prog's."""
    try:
        import torch
    except ImportError:
        print("%s: needs torch" % prog, file=sys.stderr)
        return None
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("%s: needs a Hopper GPU" % prog, file=sys.stderr)
        return None
    return torch


def _time(torch, fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def _backends(torch):
    """(name, context factory) of the SDPA backends to compare with."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    out = []
    for name, attr in (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION")):
        if hasattr(SDPBackend, attr):
            out.append((name, lambda a=attr: sdpa_kernel(getattr(SDPBackend, a))))
    return out


def run_shape(torch, tilewire, shape, causal, args):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(b * 1000 + s + d)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    f = flops(b, h, s, d, causal)
    ours_t = _time(torch, lambda: tilewire.attention(q, k, v, causal=causal), args.warmup,
                   args.repeats)
    ours = f / ours_t / 1e12
    row = "B%d H%d S%d D%d %-7s tilewire %7.1f TFLOP/s" % (b, h, s, d,
                                                           "causal" if causal else "full", ours)
    ok = True
    ref = None
    for name, ctx in _backends(torch):
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def call():
            with ctx():
                return sdpa(qt, kt, vt, is_causal=causal)

        try:
            out = call()
        except RuntimeError:
            row += " | %s n/a" % name
            continue
        if ref is None:
            ref = out.transpose(1, 2)
        t = _time(torch, call, args.warmup, args.repeats)
        theirs = f / t / 1e12
        row += " | %s %7.1f TFLOP/s, ratio %.2f" % (name, theirs, ours / theirs)
    if not args.no_check and ref is not None:
        err = (tilewire.attention(q, k, v, causal=causal).float() - ref.float()).abs().max().item()
        ok = err < 2e-2
        row += " | max err %.3g%s" % (err, "" if ok else " FAILED")
    print(row, flush=True)
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tilewire.bench_attention",
                                description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=parse_shape, action="append",
                   help="B,H,S,D (repeatable; default: %s)"
                   % " ".join("%d,%d,%d,%d" % s for s in DEFAULT_SHAPES))
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args(argv)
    try:
        import torch

        import tilewire
    except ImportError as e:
        print("bench_attention: needs torch (%s)" % e, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU", file=sys.stderr)
        return 2
    modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    ok = True
    for shape in args.shape or DEFAULT_SHAPES:
        for causal in modes:
            ok &= run_shape(torch, tilewire, shape, causal, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
