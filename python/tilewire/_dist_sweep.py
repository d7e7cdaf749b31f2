"""The sweep of python -m tilewire.bench_dist without torch (host-tested): its shapes, the
rows it reports, timing statistics, profile summaries, and the driver's tensor-map
encoder that --host times."""

import ctypes
import statistics

EXIT_FAILED, EXIT_NO_GPU, EXIT_USAGE = 1, 2, 64
PROFILE_CALLS = 20  # --profile: back-to-back calls per variant
OPS = ("ag_gemm", "gemm_rs", "gemm_ar", "moe")
MOE_EXPERTS, MOE_TOP_K = 256, 8  # moe with --m/--n/--k: --experts and --top-k's defaults
_MOE_MAX_EXPERTS, _MOE_MAX_TOP_K = 1024, 16  # tilewire.h's MoE bounds
_GROUPED_MM_MAX_GROUPS = 1023  # torch._grouped_mm refuses 1024 groups or more
# The comm pieces (t_comm of the bound rows): no TFLOP/s of their own
_COMM_VARIANTS = ("nccl-allgather", "nccl-reduce", "nccl-bf16-reduce", "nccl-alltoall",
                  "dispatch")

# ---- shapes and rows (no torch: host-tested) -----------------------------------------------


def shapes(op, quick=False, one=None, experts=MOE_EXPERTS, top_k=MOE_TOP_K):
    """[(name, m, n, k)]: ag_gemm m = total rows, n = columns per rank, k = K; gemm_rs /
    gemm_ar m = rows of the product, n = columns, k = K per rank. The sweeps: Flux's
    TP=8 layers and M in {4096, 8192, 16384} (ag_gemm K=M, N=M/8; gemm_rs/ar N=M, K=M/8), and
    for gemm_rs / gemm_ar a decode shape (M=64, N=8192, K 1024 per rank).

    moe: [(name, m, n, k, experts, top_k)] with m = tokens per rank T, n = the experts' output
    columns N, k = hidden H (tw-bench moe's order), experts and top_k from `experts` / `top_k`
    for a shape given as `one`. The sweep: DeepSeek-V3's gate+up (H=7168, N=4096 = 2 x 2048,
    E=256, top-8) at T = 64, 512 and 4096, and Mixtral 8x7B's w1+w3 (H=4096, N=28672 = 2 x
    14336, E=8, top-2) at T=1024."""
    if one is not None:
        return [("",) + tuple(one) + ((experts, top_k) if op == "moe" else ())]
    if op == "moe":
        if quick:
            return [("", 256, 1024, 2048, 64, 8), ("", 512, 2048, 1024, 16, 2)]
        return [("decode", 64, 4096, 7168, 256, 8), ("dsv3-gate-up", 512, 4096, 7168, 256, 8),
                ("dsv3-gate-up", 4096, 4096, 7168, 256, 8),
                ("mixtral", 1024, 28672, 4096, 8, 2)]
    if op == "ag_gemm":
        if quick:
            return [("", 2048, 512, 2048), ("", 4096, 512, 4096)]
        return [("flux-tp8", 4096, 49152 // 8, 12288)] + [("", m, m // 8, m)
                                                           for m in (4096, 8192, 16384)]
    full = [("flux-tp8", 4096, 12288, 49152 // 8)] + [("", m, m, m // 8)
                                                       for m in (4096, 8192, 16384)]
    quick_set = [("", 2048, 2048, 512), ("", 4096, 4096, 512)]
    # 64 tokens of decode through a TP=8 Llama-70B attention-out projection (hidden 8192)
    full.append(("decode", 64, 8192, 1024))
    if op == "gemm_ar":
        full.append(("small-m", 1024, 8192, 2048))
        quick_set.append(("small-m", 1024, 8192, 2048))
    return quick_set if quick else full


def shape_label(op, shape, world):
    if op == "moe":  # tw-bench moe's label, without its SM budget
        name, t, n, h, experts, top_k = shape
        return "T=%d/rank H=%d N=%d E=%d top%d w=%d procs%s" % (
            t, h, n, experts, top_k, world, " " + name if name else "")
    name, m, n, k = shape
    if op == "ag_gemm":
        return "M=%d N=%d/rank K=%d w=%d procs%s" % (m, n, k, world, " " + name if name else "")
    return "%sM=%d N=%d K/rank=%d world=%d procs" % (name + " " if name else "", m, n, k, world)


def check_shape(op, shape, world):
    """None, or why the shape cannot run on `world` ranks."""
    if op == "moe":
        return _check_moe_shape(shape, world)
    _, m, n, k = shape
    if min(m, n, k) < 1:
        return "M, N and K must be positive"
    if n % 8 or k % 8:
        return "N and K must be multiples of 8"
    if m % world:
        return "M=%d must be a multiple of world=%d" % (m, world)
    return None


def _check_moe_shape(shape, world):
    """The MoE calls' contract (tilewire.h) and torch._grouped_mm's group bound."""
    _, t, n, h, experts, top_k = shape
    if t < 1:
        return "T (tokens per rank) must be positive"
    if min(n, h) < 8 or n % 8 or h % 8:
        return "N and H must be positive multiples of 8"
    if not 1 <= experts <= _MOE_MAX_EXPERTS or experts % world:
        return "E=%d must be 1 .. %d and a multiple of world=%d" % (experts, _MOE_MAX_EXPERTS,
                                                                    world)
    if not 1 <= top_k <= min(_MOE_MAX_TOP_K, experts):
        return "top-k=%d must be 1 .. %d and at most E=%d" % (top_k, _MOE_MAX_TOP_K, experts)
    if experts // world > _GROUPED_MM_MAX_GROUPS:
        return "E / world = %d local experts: torch._grouped_mm takes at most %d groups" % (
            experts // world, _GROUPED_MM_MAX_GROUPS)
    return None


def _stats(ts):
    """median, p10, p90 of a list of ms."""
    s = sorted(ts)
    if not s:
        return float("nan"), float("nan"), float("nan")

    def q(f):
        return s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]

    return statistics.median(s), q(0.1), q(0.9)


def make_rows(op, label, flops, t, ok):
    """tw-bench-style rows from `t` {variant: (median, p10, p90) ms} and `ok` {variant: bool}
    for one shape. Speedups over the fp32 pipeline (bf16p over the bf16 one; moe: over torch's
    pipeline), overlap and the bound rows as the module doc says."""
    rows = []
    fp32_base = "torch" if op == "moe" else "nccl+torch"
    comm = {"ag_gemm": "nccl-allgather", "moe": "nccl-alltoall"}.get(op, "nccl-reduce")
    pieces = {"fp32": ("gemm-alone", comm), "bf16": ("gemm-alone", "nccl-bf16-reduce")}

    def piece_max(kind):
        g, c = pieces[kind]
        if g in t and c in t:
            return max(t[g][0], t[c][0]), t[g][0] + t[c][0]
        return None, None

    for variant, (ms, p10, p90) in t.items():
        bf16 = variant == "tilewire-bf16p"  # the fused bf16 row: against the bf16 pipeline
        base = t.get("nccl-bf16+torch" if bf16 and "nccl-bf16+torch" in t else fp32_base)
        fused = variant in ("fused", "fused-inplace", "tilewire", "tilewire-bf16p")
        t_max, _ = piece_max("bf16" if bf16 else "fp32")
        rows.append({
            "op": op, "shape": label, "variant": variant, "ms": ms, "ms_p10": p10, "ms_p90": p90,
            "tflops": flops / (ms * 1e-3) / 1e12 if ms > 0 and variant not in _COMM_VARIANTS
            else 0.0,
            "gbps": 0.0,
            "speedup": base[0] / ms if base and ms > 0 else 0.0,
            "overlap": t_max / ms if fused and t_max and ms > 0 else 0.0,
            "ok": bool(ok.get(variant, True)),
        })
    for kind, name in (("fp32", "bound"), ("bf16", "bound-bf16")):
        if op in ("ag_gemm", "moe") and kind == "bf16":
            continue
        t_max, t_sum = piece_max(kind)
        if t_max:
            rows.append({"op": op, "shape": label, "variant": name, "ms": t_max, "ms_p10": t_max,
                         "ms_p90": t_max, "tflops": 0.0, "gbps": 0.0, "speedup": t_sum / t_max,
                         "overlap": 0.0, "ok": True})
    return rows


def timed_calls(repeats, min_ms, per_call_ms, cap=2000):
    """How many calls a row times: `repeats`, or more where they would take under min_ms
    (short eager calls are host-bound and jittery, so their median needs more samples), at most
    `cap` (never fewer than `repeats`)."""
    n = max(1, int(repeats))
    if min_ms > 0 and per_call_ms > 0:
        n = max(n, min(cap, int(-(-min_ms // per_call_ms))))
    return n


def profile_summary(intervals, calls):
    """{period_us, busy_us, idle_us, kernels: {name: (count, median us)}} from device activity
    intervals [(start_us, end_us, name)] of `calls` calls (see _Rank.kernel_profile)."""
    if not intervals or calls < 1:
        return {"period_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "kernels": {}}
    iv = sorted(intervals)
    busy, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
    for s, e, _ in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e, _ in iv) - iv[0][0]
    by_name = {}
    for s, e, name in iv:
        by_name.setdefault(name, []).append(e - s)
    period = span / calls
    return {"period_us": period, "busy_us": busy / calls, "idle_us": period - busy / calls,
            "kernels": {n: (len(d), statistics.median(d)) for n, d in by_name.items()}}


def format_profiles(profiles, calls=PROFILE_CALLS):
    """The --profile table (rank 0)."""
    if not profiles:
        return ""
    lines = ["GPU activity per call (torch.profiler, rank 0, %d back-to-back calls; period = "
             "span / calls, busy = union of kernels, memcpys and memsets, idle = period - busy):"
             % calls,
             "%-52s %-16s %9s %9s %9s  %s" % ("shape", "variant", "period", "busy", "idle",
                                               "kernels: count x median us")]
    for label, variant, p in profiles:
        ks = sorted(p["kernels"].items(), key=lambda kv: -kv[1][0] * kv[1][1])[:3]
        lines.append("%-52s %-16s %9.1f %9.1f %9.1f  %s" % (
            label[:52], variant, p["period_us"], p["busy_us"], p["idle_us"],
            "; ".join("%s %d x %.1f" % (n[:40], c, d) for n, (c, d) in ks)))
    return "\n".join(lines) + "\n"


def _device_intervals(events):
    """[(start_us, end_us, name)] of a torch.profiler event list's device (CUDA) events."""
    out = []
    for e in events:
        kind = str(getattr(e, "device_type", ""))
        if "CUDA" not in kind:
            continue
        tr = e.time_range
        out.append((float(tr.start), float(tr.end), str(e.name)))
    return out


def _tensor_map_encoder(ptr, rows, cols):
    """A function encoding a bf16 [rows, cols] tensor map at `ptr` as the GEMM core's A operand
    (128 x 64 boxes, 128-byte swizzle) through the driver's cuTensorMapEncodeTiled, or None
    where the driver or the call is unavailable."""
    try:
        encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    encode.restype = ctypes.c_int
    buf = (ctypes.c_uint8 * 256)()
    dst = ctypes.c_void_p((ctypes.addressof(buf) + 63) & ~63)  # CUtensorMap: 64-byte aligned
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols * 2)
    box = (ctypes.c_uint32 * 2)(64, 128)
    steps = (ctypes.c_uint32 * 2)(1, 1)
    bf16, swizzle_128b, l2_128b = 9, 3, 2  # cuda.h's enum values

    def call():
        return encode(dst, bf16, 2, ctypes.c_void_p(ptr), dims, strides, box, steps, 0,
                      swizzle_128b, l2_128b, 0)

    if call() != 0:
        return None
    call.keep = buf  # the map's buffer lives as long as the function
    return call


def _one_shape(args):
    given = [v for v in (args.m, args.n, args.k) if v is not None]
    if not given:
        return None
    first = given[0]
    return (args.m or first, args.n or first, args.k or first)
