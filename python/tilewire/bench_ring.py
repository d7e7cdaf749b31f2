"""python -m tilewire.bench_ring: tilewire.ring_attention on virtual ranks of one GPU against the
unfused ring (what ring-flash-attention runs: per ring step the peer's K/V chunk copied, one
attention call per pair of segments through the same core, tilewire.attention, returning its
lse, and the partial outputs merged in fp32) and against whole-sequence attention on one rank
(tilewire.attention and cuDNN SDPA over the gathered sequence), side by side.

    python -m tilewire.bench_ring                                   # the shapes below
    python -m tilewire.bench_ring --world 4 --shape 1,16,2048,128 --layout contiguous

A shape is B,H,S,D with S the tokens per rank (heads_kv = heads); the whole sequence is world x S
tokens. The default shapes are mKernel's B4 H16 D128 at 768, 3072 and 12288 tokens a rank,
world 4, causal zigzag and non-causal contiguous. On one GPU the ranks share its SMs (each its
budget), so the ring's ideal time is the whole-sequence attention's: efficiency = t_whole /
t_ring (tilewire.attention over the gathered sequence, the same core). Times: CUDA events
around every rank's call (one round), after --warmup rounds, the median of --repeats rounds.
TFLOP/s: 4 B H (world S)^2 D / median (halved for causal). Unless --no-check, each rank's
ring and unfused outputs are compared with the whole-sequence output at its positions (max abs
error below 2e-2). --devices distinct puts rank r on GPU r (real NVLink; the whole sequence
stays on GPU 0, and the ideal ring is then its time over the GPUs). Exit status: 0, 1 a check
failed, 2 no torch or no Hopper GPU.
"""

import argparse
import sys

from ._comm import set_shared_gpu_env
from .bench_attention import _time, hopper_torch

DEFAULT_SHAPES = [(4, 16, 768, 128), (4, 16, 3072, 128), (4, 16, 12288, 128)]


def parse_shape(text):
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError("shape %r: expected B,H,S,D (e.g. 4,16,768,128)" % text)
    return tuple(int(p) for p in parts)


def segments(layout, world, s, rank):
    """Rank `rank`'s shard as (local row, rows, global position) runs."""
    if layout == "contiguous":
        return [(0, s, rank * s)]
    c = s // 2
    return [(0, c, rank * c), (c, c, (2 * world - 1 - rank) * c)]


def positions(layout, world, s, rank):
    return [p + i for _, rows, p in segments(layout, world, s, rank) for i in range(rows)]


def merge(torch, acc, part):
    """(o fp32 [B, S, H, D], lse [B, H, S]) of two partial attentions over disjoint keys, merged;
    rows no key reached on either side (lse -inf) stay 0 / -inf."""
    if acc is None:
        return part[0].float(), part[1]
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)
    w1 = torch.nan_to_num(torch.exp(l1 - lse), nan=0.0).transpose(1, 2).unsqueeze(-1)
    w2 = torch.nan_to_num(torch.exp(l2 - lse), nan=0.0).transpose(1, 2).unsqueeze(-1)
    return o1 * w1 + o2.float() * w2, lse


def unfused_rank(torch, tw, r, world, layout, causal, qs, ks, vs):
    """Rank r's unfused ring: W steps, each the chunk of rank (r - step) mod W copied (the
    ring's send; onto rank r's GPU where the ranks have their own) and attended segment by
    segment; the merged output in bf16."""
    s = qs[r].shape[1]
    dev = qs[r].device
    out = torch.empty_like(qs[r])
    for q0, q_rows, q_pos in segments(layout, world, s, r):
        q = qs[r][:, q0:q0 + q_rows].contiguous()
        acc = None
        for step in range(world):
            src = (r - step) % world
            k_chunk, v_chunk = ks[src].to(dev, copy=True), vs[src].to(dev, copy=True)
            for k0, k_rows, k_pos in segments(layout, world, s, src):
                if causal and k_pos > q_pos + q_rows - 1:
                    continue  # no key of this segment is visible to any row
                part = tw.attention(q, k_chunk[:, k0:k0 + k_rows].contiguous(),
                                    v_chunk[:, k0:k0 + k_rows].contiguous(), causal=causal,
                                    q_offset=q_pos, kv_offset=k_pos, return_lse=True)
                acc = merge(torch, acc, part)
        out[:, q0:q0 + q_rows] = acc[0].to(torch.bfloat16)
    return out


def time_rounds(torch, fn, warmup, repeats):
    """Milliseconds: bench_attention's median of CUDA-event times around fn."""
    return _time(torch, fn, warmup, repeats) * 1e3


def join_devices(torch, devices):
    """The current stream of GPU 0 (where the timing events are) waits for the current stream of
    each other GPU in `devices`."""
    main = torch.cuda.current_stream(0)
    for dev in devices:
        if dev != 0:
            main.wait_stream(torch.cuda.current_stream(dev))


def run_shape(torch, tw, comms, shape, layout, causal, args, devices):
    """One shape's rows; returns (rows, ok). devices[r]: rank r's GPU (all 0: virtual ranks);
    the whole sequence lives on GPU 0."""
    b, h, s, d = shape
    world = len(comms)
    g = torch.Generator(device="cuda:0").manual_seed(1)
    full = [torch.randn(b, world * s, h, d, device="cuda:0", generator=g).bfloat16()
            for _ in range(3)]
    qs, ks, vs = [], [], []
    for c in comms:
        pos = torch.tensor(positions(layout, world, s, c.rank), device="cuda:0")
        dev = torch.device("cuda", devices[c.rank])
        k, v = c.empty((b, s, h, d), torch.bfloat16), c.empty((b, s, h, d), torch.bfloat16)
        k.copy_(full[1][:, pos]), v.copy_(full[2][:, pos])
        qs.append(full[0][:, pos].to(dev).contiguous()), ks.append(k), vs.append(v)
    for dev in set(devices):
        torch.cuda.synchronize(dev)
    outs = {}

    def ring():
        outs["ring"] = tw.for_each_rank(comms, lambda c: tw.ring_attention(
            c, qs[c.rank], ks[c.rank], vs[c.rank], causal=causal, layout=layout))

    def unfused():
        res = []
        for c in comms:
            with torch.cuda.device(devices[c.rank]):
                res.append(unfused_rank(torch, tw, c.rank, world, layout, causal, qs, ks, vs))
        join_devices(torch, devices)
        outs["unfused"] = res

    def whole():
        outs["whole"] = tw.attention(full[0], full[1], full[2], causal=causal)

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(
                full[0].transpose(1, 2), full[1].transpose(1, 2), full[2].transpose(1, 2),
                is_causal=causal)

    flops = 4.0 * b * h * (world * s) ** 2 * d / (2 if causal else 1)
    times = {}
    for name, fn in (("ring", ring), ("unfused-ring", unfused), ("whole-tilewire", whole),
                     ("whole-cudnn", cudnn)):
        try:
            times[name] = time_rounds(torch, fn, args.warmup, args.repeats)
        except RuntimeError as e:  # a backend this torch or GPU lacks
            times[name] = None
            print("  %s: n/a (%s)" % (name, str(e).splitlines()[0][:80]), file=sys.stderr)
    ok = True
    err = {}
    if not args.no_check:
        for name in ("ring", "unfused"):
            worst = 0.0
            for c in comms:
                pos = torch.tensor(positions(layout, world, s, c.rank), device="cuda:0")
                want = outs["whole"][:, pos].float()
                got = outs[name][c.rank].to(want.device).float()
                worst = max(worst, (got - want).abs().max().item())
            err[name] = worst
            ok = ok and worst < 2e-2
    label = "B%d H%d S%dx%d D%d %s %s" % (b, h, world, s, d, "causal" if causal else "full",
                                          layout)
    rows = []
    for name, t in times.items():
        if t is None:
            rows.append("%-40s %-15s %9s" % (label, name, "n/a"))
            continue
        # the ideal ring: the whole sequence's time shared by the GPUs the ranks have
        whole_t = times.get("whole-tilewire")
        eff = whole_t / (len(set(devices)) * t) if whole_t else float("nan")
        rows.append("%-40s %-15s %9.3f ms %7.1f TFLOP/s  t_whole/t = %.2f" % (
            label, name, t, flops / t / 1e9, eff))
    if err:
        rows.append("%-40s max |err| vs whole: ring %.2e, unfused %.2e" % (
            label, err["ring"], err["unfused"]))
    return rows, ok


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tilewire.bench_ring",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--shape", type=parse_shape, action="append")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"))
    parser.add_argument("--causal", choices=("yes", "no"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--devices", choices=("shared", "distinct"), default="shared",
                        help="shared: virtual ranks on GPU 0; distinct: rank r on GPU r")
    args = parser.parse_args(argv)
    if args.devices == "shared":
        set_shared_gpu_env()  # virtual ranks share GPU 0: before torch starts CUDA
    torch = hopper_torch("bench_ring")
    if torch is None:
        return 2
    import tilewire as tw

    if args.world < 1 or args.world > 8:
        parser.error("--world must be 1 .. 8")
    cases = []
    for shape in args.shape or DEFAULT_SHAPES:
        for causal, layout in ((True, "zigzag"), (False, "contiguous")):
            if args.causal is not None and causal != (args.causal == "yes"):
                continue
            cases.append((shape, args.layout or layout, causal))
    devices = [0] * args.world
    if args.devices == "distinct":
        if torch.cuda.device_count() < args.world:
            parser.error("--devices distinct: %d GPUs for --world %d"
                         % (torch.cuda.device_count(), args.world))
        devices = list(range(args.world))
    comms = tw.init_virtual(args.world, devices=devices)
    ok = True
    try:
        for i, (shape, layout, causal) in enumerate(cases):
            print("[%d/%d] %s %s %s" % (i + 1, len(cases), shape, layout,
                                        "causal" if causal else "full"), file=sys.stderr)
            rows, good = run_shape(torch, tw, comms, shape, layout, causal, args, devices)
            ok = ok and good
            print("\n".join(rows), flush=True)
    finally:
        for dev in set(devices):
            torch.cuda.synchronize(dev)
        for c in comms:
            c.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
