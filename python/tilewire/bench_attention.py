"""python -m tilewire.bench_attention: tilewire.attention against torch SDPA (the cuDNN and the
flash backends, through torch.nn.attention.sdpa_kernel) on one GPU, side by side, forward and
backward.

    python -m tilewire.bench_attention                         # the shapes below, causal and not
    python -m tilewire.bench_attention --shape 4,16,4096,128 --repeats 200 --pass backward

A shape is B,H,S,D (batch, heads, sequence, head_dim; heads_kv = heads, seq_q = seq_kv). The
default shapes: 4,16,4096,128, 4,16,12288,128 and 4,16,8192,64, each non-causal and causal.
Inputs: fresh randn bf16 q, k, v (B, S, H, D); SDPA gets their (B, H, S, D) transposed views
(the layout SDPA's kernels take without a copy). Times: CUDA events around each call after
--warmup calls, the median of --repeats calls.

--pass forward (fwd rows): the forward call alone. --pass backward (bwd rows): the backward
alone, torch.autograd.grad of one forward's output (kept, retain_graph) with a fixed bf16
dout, for q, k and v (SDPA: their transposed views, so no transpose's backward is timed); each
SDPA backend's backward is the one its forward under sdpa_kernel recorded; a bwd1 row follows,
tilewire's one-pass backward (tilewire.attention(..., deterministic=False)) against the same
backends' times. Default: both, a fwd, a bwd and a bwd1 row per shape.

TFLOP/s: the forward's 4 B H S^2 D (halved for causal) over the median; the backward's 2.5
times that (FlashAttention's convention: five matmuls against the forward's two). ratio:
tilewire's TFLOP/s over each backend's. A backend this torch or GPU cannot run prints "n/a".
Unless --no-check, tilewire's output (fwd: max abs error below 2e-2) or its dq, dk, dv (bwd:
each one's max error below 2.5e-2 of its largest magnitude) is compared with the first backend
that ran. Exit status: 0, 1 a check failed, 2 no torch or no GPU.
"""

import argparse
import statistics
import sys

DEFAULT_SHAPES = [(4, 16, 4096, 128), (4, 16, 12288, 128), (4, 16, 8192, 64)]
BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's (FlashAttention's convention)
FWD_TOL, GRAD_TOL = 2e-2, 2.5e-2


def parse_shape(text):
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError("shape %r: expected B,H,S,D (e.g. 4,16,4096,128)" % text)
    return tuple(int(p) for p in parts)


def flops(b, h, s, d, causal, backward=False):
    """The FLOPs of one forward (4 B H S^2 D, halved for causal) or, with backward, of its
    backward (BACKWARD_FLOPS times that)."""
    f = 4.0 * b * h * s * s * d
    f = f / 2 if causal else f
    return f * BACKWARD_FLOPS if backward else f


def rel_error(got, want):
    """The largest of max |g - w| / max |w| over the pairs (each gradient against its own
    largest magnitude)."""
    worst = 0.0
    for g, w in zip(got, want):
        scale = w.float().abs().max().item()
        worst = max(worst, (g.float() - w.float()).abs().max().item() / max(scale, 1e-30))
    return worst


def side_by_side(label, f, ours_s, theirs):
    """One row: label, tilewire's TFLOP/s (f FLOPs in ours_s seconds), then per backend
    (name, seconds or None where it cannot run) its TFLOP/s and tilewire's ratio over it."""
    ours = f / ours_s / 1e12
    row = "%s tilewire %7.1f TFLOP/s" % (label, ours)
    for name, t in theirs:
        if t is None:
            row += " | %s n/a" % name
        else:
            theirs_tflops = f / t / 1e12
            row += " | %s %7.1f TFLOP/s, ratio %.2f" % (name, theirs_tflops, ours / theirs_tflops)
    return row


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


def _inputs(torch, shape, grad):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(b * 1000 + s + d)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, dout


def _label(shape, causal, direction):
    return "B%d H%d S%d D%d %-6s %s" % (shape + ("causal" if causal else "full", direction))


def run_shape(torch, tilewire, shape, causal, args):
    """The forward row of one shape."""
    q, k, v, _ = _inputs(torch, shape, False)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ours_t = _time(torch, lambda: tilewire.attention(q, k, v, causal=causal), args.warmup,
                   args.repeats)
    theirs, ref = [], None
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name, ctx in _backends(torch):

        def call(ctx=ctx):
            with ctx():
                return sdpa(qt, kt, vt, is_causal=causal)

        try:
            out = call()
        except RuntimeError:
            theirs.append((name, None))
            continue
        if ref is None:
            ref = out.transpose(1, 2)
        theirs.append((name, _time(torch, call, args.warmup, args.repeats)))
    row = side_by_side(_label(shape, causal, "fwd"), flops(*shape, causal), ours_t, theirs)
    ok = True
    if not args.no_check and ref is not None:
        err = (tilewire.attention(q, k, v, causal=causal).float() - ref.float()).abs().max().item()
        ok = err < FWD_TOL
        row += " | max err %.3g%s" % (err, "" if ok else " FAILED")
    print(row, flush=True)
    return ok


def run_shape_backward(torch, tilewire, shape, causal, args):
    """The backward rows of one shape (the default backward's, the one pass's):
    torch.autograd.grad of a kept forward output."""
    q, k, v, dout = _inputs(torch, shape, True)
    o = tilewire.attention(q, k, v, causal=causal)
    o1 = tilewire.attention(q, k, v, causal=causal, deterministic=False)

    def ours(out=o):
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    ours_t = _time(torch, ours, args.warmup, args.repeats)
    one_t = _time(torch, lambda: ours(o1), args.warmup, args.repeats)
    theirs, ref = [], None
    sdpa = torch.nn.functional.scaled_dot_product_attention
    views = tuple(x.transpose(1, 2) for x in (q, k, v))
    dout_t = dout.transpose(1, 2)
    for name, ctx in _backends(torch):
        try:
            with ctx():
                out = sdpa(*views, is_causal=causal)
            grads = torch.autograd.grad(out, views, dout_t, retain_graph=True)
        except RuntimeError:
            theirs.append((name, None))
            continue
        if ref is None:
            ref = [g.transpose(1, 2) for g in grads]

        def call(out=out):
            return torch.autograd.grad(out, views, dout_t, retain_graph=True)

        theirs.append((name, _time(torch, call, args.warmup, args.repeats)))
        out = grads = None
    ok = True
    for direction, t, out in (("bwd", ours_t, o), ("bwd1", one_t, o1)):
        row = side_by_side(_label(shape, causal, direction),
                           flops(*shape, causal, backward=True), t, theirs)
        if not args.no_check and ref is not None:
            err = rel_error(ours(out), ref)
            ok &= err < GRAD_TOL
            row += " | max rel err %.3g%s" % (err, "" if err < GRAD_TOL else " FAILED")
        print(row, flush=True)
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tilewire.bench_attention",
                                description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=parse_shape, action="append",
                   help="B,H,S,D (repeatable; default: %s)"
                   % " ".join("%d,%d,%d,%d" % s for s in DEFAULT_SHAPES))
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--pass", dest="direction", choices=("both", "forward", "backward"),
                   default="both", help="which rows: the forward's, the backward's, or both")
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
    runs = {"both": (run_shape, run_shape_backward), "forward": (run_shape,),
            "backward": (run_shape_backward,)}[args.direction]
    ok = True
    for shape in args.shape or DEFAULT_SHAPES:
        for causal in modes:
            for run in runs:
                ok &= run(torch, tilewire, shape, causal, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
