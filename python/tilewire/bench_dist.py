"""python -m tilewire.bench_dist: the fused ops against PyTorch's own pipeline, one process per
GPU as torchrun runs a tensor-parallel job (issue 7's one-process-per-GPU benchmark).

    torchrun --nproc-per-node 8 -m tilewire.bench_dist          # under torchrun
    python -m tilewire.bench_dist --nproc 2 --quick               # launches the ranks itself
    python -m tilewire.bench_dist --nproc 2 --op gemm_rs --m 4096 --n 12288 --k 6144
    python -m tilewire.bench_dist --nproc 2 --host     # host time per Python call of each op
    python -m tilewire.bench_dist --nproc 2 --profile  # + each call's busy / idle GPU time

Every rank holds its own inputs on its own GPU. Per op and shape, side by side (the names of
tw-bench's rows, so tilewire.bench reads the JSON):
  ag_gemm   fused (tilewire.ag_gemm, gathered A kept), fused-inplace (the same with the shard
            already in its slot of a_gathered: nothing copied for it; checked bitwise against
            fused), nccl+torch (all_gather_into_tensor then
            torch.matmul), gemm-alone (torch.matmul on the gathered A), nccl-allgather, bound
  gemm_rs   tilewire / tilewire-bf16p (fp32 / bf16 partials), nccl+torch (the GEMM with fp32
  gemm_ar   output, then reduce_scatter_tensor / all_reduce in fp32, then bf16: the same math
            as tilewire's fp32 partials), nccl-bf16+torch (torch.matmul in bf16, then the bf16
            collective: what a PyTorch row-parallel layer runs), gemm-alone, nccl-reduce,
            nccl-bf16-reduce, bound, bound-bf16
Times: CUDA events around each call on every rank, no barrier between calls (the collectives
and the fused ops synchronise the ranks themselves), after the warm-up calls and about
--warm-ms of calls (a power-capped card settles its clock; every rank makes the same number of
calls, each being collective); each figure is the slowest rank's median over --repeats calls,
or over as many as fill --min-ms where calls are short (eager decode calls are host-bound and
jittery; at most 2000). speedup: over the
fp32 pipeline (bf16p rows over the bf16 one); overlap: max(t_gemm, t_comm) / t_fused; bound
rows: (t_gemm + t_comm) / max(t_gemm, t_comm) in the speedup column.
Rank 0 prints tilewire.bench's table and the yardstick (speedup / bound) and writes --json.
Results are checked (unless --no-check) against the NCCL pipeline's: relative error below 1e-2
(2e-2 with bf16 partials), and the gathered A bitwise. NCCL_NVLS_ENABLE defaults to 0.
Exit status: 0 all rows passed, 1 a check or a rank failed, 2 no GPU / torch, 64 bad usage.
"""

import argparse
import ctypes
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

EXIT_FAILED, EXIT_NO_GPU, EXIT_USAGE = 1, 2, 64
PROFILE_CALLS = 20  # --profile: back-to-back calls per variant
OPS = ("ag_gemm", "gemm_rs", "gemm_ar")

# ---- shapes and rows (no torch: host-tested) -----------------------------------------------


def shapes(op, quick=False, one=None):
    """[(name, m, n, k)]: ag_gemm m = total rows, n = columns per rank, k = K; gemm_rs /
    gemm_ar m = rows of the product, n = columns, k = K per rank. The issues' sweeps: Flux's
    TP=8 layers and M in {4096, 8192, 16384} (ag_gemm K=M, N=M/8; gemm_rs/ar N=M, K=M/8), and
    for gemm_rs / gemm_ar a decode shape (M=64, N=8192, K 1024 per rank)."""
    if one is not None:
        return [("",) + tuple(one)]
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
    name, m, n, k = shape
    if op == "ag_gemm":
        return "M=%d N=%d/rank K=%d w=%d procs%s" % (m, n, k, world, " " + name if name else "")
    return "%sM=%d N=%d K/rank=%d world=%d procs" % (name + " " if name else "", m, n, k, world)


def check_shape(op, shape, world):
    """None, or why the shape cannot run on `world` ranks."""
    _, m, n, k = shape
    if min(m, n, k) < 1:
        return "M, N and K must be positive"
    if n % 8 or k % 8:
        return "N and K must be multiples of 8"
    if m % world:
        return "M=%d must be a multiple of world=%d" % (m, world)
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
    for one shape. Speedups over the fp32 pipeline (bf16p over the bf16 one), overlap and the
    bound rows as the module doc says."""
    rows = []
    fp32_base = "nccl+torch"
    pieces = {"fp32": ("gemm-alone", "nccl-allgather" if op == "ag_gemm" else "nccl-reduce"),
              "bf16": ("gemm-alone", "nccl-bf16-reduce")}

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
            "tflops": flops / (ms * 1e-3) / 1e12 if ms > 0 and variant not in (
                "nccl-allgather", "nccl-reduce", "nccl-bf16-reduce") else 0.0,
            "gbps": 0.0,
            "speedup": base[0] / ms if base and ms > 0 else 0.0,
            "overlap": t_max / ms if fused and t_max and ms > 0 else 0.0,
            "ok": bool(ok.get(variant, True)),
        })
    for kind, name in (("fp32", "bound"), ("bf16", "bound-bf16")):
        if op == "ag_gemm" and kind == "bf16":
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


def launch_env(base, rank, world, port):
    """The environment torchrun gives rank `rank` of a single-node job."""
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def _parser():
    p = argparse.ArgumentParser(prog="python -m tilewire.bench_dist",
                                description="tilewire's fused ops against torch.matmul + "
                                "torch.distributed (NCCL), one process per GPU")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch this many ranks (one per GPU) instead of running under torchrun")
    p.add_argument("--op", action="append", choices=OPS, help="op(s) to run (default: all)")
    p.add_argument("--quick", action="store_true", help="the small sweep")
    p.add_argument("--m", type=int)
    p.add_argument("--n", type=int)
    p.add_argument("--k", type=int)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--warm-ms", type=float, default=100.0)
    p.add_argument("--min-ms", type=float, default=20.0,
                   help="time at least this many ms of calls: more than --repeats where calls "
                   "are short (at most 2000 calls; 0: exactly --repeats)")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also profile each op's fused and pipeline calls with torch.profiler "
                   "(CUDA activity: per call the kernels' busy time and the idle time between "
                   "calls; rank 0 prints it after the table)")
    p.add_argument("--host", action="store_true",
                   help="instead of the sweep: the host time of one Python call of each op and "
                   "of its torch counterpart at a tiny shape (us per call; rank 0 also prints "
                   "a cProfile of tilewire.gemm_rs)")
    p.add_argument("--graph", type=int, default=0, metavar="CALLS",
                   help="time each variant as replays of a CUDA graph of CALLS back-to-back "
                   "calls (per call: a replay's time / CALLS), as a server replaying captured "
                   "decode steps runs them: no host time per call (default 0: eager calls)")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the rows here")
    p.add_argument("--timeout", type=float, default=900.0, help="launcher: seconds per run")
    return p


def _one_shape(args):
    given = [v for v in (args.m, args.n, args.k) if v is not None]
    if not given:
        return None
    first = given[0]
    return (args.m or first, args.n or first, args.k or first)


# ---- the launcher ----------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv, nproc, timeout):
    """Runs `nproc` ranks of this module as torchrun would; rank 0's output goes to ours, the
    others' is printed only when they fail. Returns the worst exit status."""
    port = _free_port()
    rest = []
    skip = False
    for a in argv:  # the ranks get every argument but --nproc
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        rest.append(a)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in range(nproc):
        env = launch_env(os.environ, rank, nproc, port)
        env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
        procs.append(subprocess.Popen([sys.executable, "-m", "tilewire.bench_dist"] + rest,
                                      env=env, stdout=None if rank == 0 else subprocess.PIPE,
                                      stderr=None if rank == 0 else subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outputs = [""] * nproc
    status = 0
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs[rank] = out or ""
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print("tilewire.bench_dist: rank %d did not finish in %.0f s" % (rank, timeout),
                  file=sys.stderr)
            return EXIT_FAILED
        status = max(status, p.returncode if p.returncode >= 0 else EXIT_FAILED)
    for rank in range(1, nproc):
        if procs[rank].returncode:
            sys.stderr.write("---- rank %d (exit %d)\n%s" % (rank, procs[rank].returncode,
                                                              outputs[rank]))
    return status


# ---- one rank (torch) ------------------------------------------------------------------------


class _Rank:
    def __init__(self, args):
        import torch
        import torch.distributed as dist

        import tilewire

        self.torch, self.dist, self.tw = torch, dist, tilewire
        self.args = args
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", self.world)):
            raise SystemExit("tilewire.bench_dist: one process per GPU: %d ranks on this node, "
                             "%d GPUs visible (NCCL needs distinct GPUs)"
                             % (int(os.environ.get("LOCAL_WORLD_SIZE", self.world)),
                                torch.cuda.device_count()))
        self.device = torch.device("cuda", local)
        torch.cuda.set_device(self.device)
        dist.init_process_group("nccl", device_id=self.device,
                                timeout=datetime.timedelta(seconds=300))
        self.comm = tilewire.init()
        self._mm32 = None
        self._graphs = []  # --graph: the captured graphs, released at close()
        self.profiles = []  # --profile: (label, variant, summary), rank 0

    # -- helpers

    def rand(self, shape, seed):
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(shape, device=self.device, dtype=torch.bfloat16, generator=g)

    def quiesce(self):
        """Every rank's queued work finished and every rank past this point (before a timed
        or profiled stretch)."""
        self.torch.cuda.synchronize()
        self.dist.barrier()
        self.torch.cuda.synchronize()

    def mm32(self, a, b):
        """a @ b.T with fp32 output: torch.mm(out_dtype=...) where this torch has it, else
        tilewire.gemm (our GEMM core, at cuBLAS parity)."""
        torch = self.torch
        if self._mm32 is None:
            try:
                torch.mm(a[:8], b[:8].t(), out_dtype=torch.float32)
                self._mm32 = "torch"
            except (TypeError, RuntimeError):
                self._mm32 = "tilewire"
        if self._mm32 == "torch":
            return torch.mm(a, b.t(), out_dtype=torch.float32)
        return self.tw.gemm(a, b, out_dtype=torch.float32)

    def graphed(self, fn, calls):
        """A function replaying a CUDA graph of `calls` back-to-back calls of fn (captured on
        every rank in the same order: NCCL's and tilewire's collectives are captured alike).
        fn has run eagerly before (warm-up), as torch's capture recipe asks."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.quiesce()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        self.quiesce()
        self._graphs.append(graph)  # kept alive with its memory pool until close()
        return graph.replay

    def time(self, fn):
        """(median, p10, p90) ms of the slowest rank, per call (--graph: per captured call)."""
        torch, dist, args = self.torch, self.dist, self.args
        for _ in range(max(0, args.warmup)):
            fn()
        per = 1
        if args.graph > 0:
            fn, per = self.graphed(fn, args.graph), args.graph
        # At least warm_ms of calls, the same count on every rank (each call is collective):
        # the count comes from a timed probe, the largest any rank needs.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        per_call = max((time.perf_counter() - t0) * 1e3 / 2, 1e-3)
        # and the timed count (timed_calls), alike on every rank
        calls = torch.tensor([min(100000, int(args.warm_ms / per_call) + 1),
                              timed_calls(args.repeats, args.min_ms, per_call)], device=self.device)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
        warm, n = (int(x) for x in calls.tolist())
        for _ in range(warm):
            fn()
        self.quiesce()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        med, p10, p90 = _stats([s.elapsed_time(e) / per for s, e in zip(starts, ends)])
        v = torch.tensor([med, p10, p90], device=self.device, dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return tuple(float(x) for x in v.tolist())

    def all_ok(self, ok):
        v = self.torch.tensor([0.0 if ok else 1.0], device=self.device)
        self.dist.all_reduce(v, op=self.dist.ReduceOp.MAX)
        return v.item() == 0.0

    @staticmethod
    def rel_err(got, want):
        d = (got.float() - want.float()).abs().max().item()
        r = want.float().abs().max().item()
        return d / r if r > 0 else d

    # -- the ops

    def ag_gemm(self, shape):
        torch, dist, tw, world = self.torch, self.dist, self.tw, self.world
        _, m, n, k = shape
        m_local = m // world
        a = self.rand((m_local, k), 100 + self.rank)
        b = self.rand((n, k), 200 + self.rank)
        gathered_sym = self.comm.empty((m, k), torch.bfloat16)
        gathered = torch.empty((m, k), device=self.device, dtype=torch.bfloat16)
        out = torch.empty((m, n), device=self.device, dtype=torch.bfloat16)
        ref = torch.empty((m, n), device=self.device, dtype=torch.bfloat16)
        # fused-inplace: the shard already in its slot of a_gathered (where a layer can write
        # its output directly), so the op copies nothing for it
        gathered_in = self.comm.empty((m, k), torch.bfloat16)
        own = gathered_in[self.rank * m_local:(self.rank + 1) * m_local]
        own.copy_(a)
        out_in = torch.empty((m, n), device=self.device, dtype=torch.bfloat16)

        def fused():
            tw.ag_gemm(self.comm, a, b, gathered_sym, out=out)

        def fused_inplace():
            tw.ag_gemm(self.comm, own, b, gathered_in, out=out_in)

        def pipeline():
            dist.all_gather_into_tensor(gathered, a)
            torch.matmul(gathered, b.t(), out=ref)

        def gemm_alone():
            torch.matmul(gathered, b.t(), out=ref)

        def allgather():
            dist.all_gather_into_tensor(gathered, a)

        ok = {}
        if not self.args.no_check:
            fused()
            fused_inplace()
            pipeline()
            torch.cuda.synchronize()
            good = torch.equal(gathered_sym, gathered) and self.rel_err(out, ref) < 1e-2
            ok["fused"] = self.all_ok(good)
            ok["fused-inplace"] = self.all_ok(torch.equal(gathered_in, gathered)
                                              and torch.equal(out_in, out))
        t = {"nccl+torch": self.time(pipeline), "gemm-alone": self.time(gemm_alone),
             "nccl-allgather": self.time(allgather), "fused": self.time(fused),
             "fused-inplace": self.time(fused_inplace)}
        if self.args.profile:
            self.kernel_profile(shape_label("ag_gemm", shape, world), {
                "nccl+torch": pipeline, "fused": fused, "fused-inplace": fused_inplace})
        return t, ok, 2.0 * m * n * k

    def _gemm_reduce(self, op, shape):
        torch, dist, tw, world = self.torch, self.dist, self.tw, self.world
        _, m, n, k = shape
        scatter = op == "gemm_rs"
        rows = m // world if scatter else m
        a = self.rand((m, k), 300 + self.rank)
        b = self.rand((n, k), 400 + self.rank)
        ws = tw.gemm_rs_workspace(self.comm, m, n)
        out = torch.empty((rows, n), device=self.device, dtype=torch.bfloat16)
        out16 = torch.empty((rows, n), device=self.device, dtype=torch.bfloat16)
        part16 = torch.empty((m, n), device=self.device, dtype=torch.bfloat16)
        red32 = torch.empty((rows, n), device=self.device, dtype=torch.float32)
        ref = torch.empty((rows, n), device=self.device, dtype=torch.bfloat16)
        ref16 = torch.empty((rows, n), device=self.device, dtype=torch.bfloat16)
        fused_fn = tw.gemm_rs if scatter else tw.gemm_ar
        holder = {}  # reduce32's fp32 partial, made once (all_reduce sums it in place: values
        # grow from call to call, which does not change NCCL's time)

        def fused():
            fused_fn(self.comm, a, b, ws, out=out)

        def fused16():
            fused_fn(self.comm, a, b, ws, out=out16, partials="bf16")

        def pipeline():
            p = self.mm32(a, b)
            if scatter:
                dist.reduce_scatter_tensor(red32, p)
                ref.copy_(red32)
            else:
                dist.all_reduce(p)
                ref.copy_(p)

        def pipeline16():
            torch.matmul(a, b.t(), out=part16)
            if scatter:
                dist.reduce_scatter_tensor(ref16, part16)
            else:
                dist.all_reduce(part16)
                ref16.copy_(part16)

        def gemm_alone():
            torch.matmul(a, b.t(), out=part16)

        def reduce32():
            p = holder.get("p32")
            if p is None:
                p = holder["p32"] = self.mm32(a, b)
            if scatter:
                dist.reduce_scatter_tensor(red32, p)
            else:
                dist.all_reduce(p)

        def reduce16():
            if scatter:
                dist.reduce_scatter_tensor(ref16, part16)
            else:
                dist.all_reduce(part16)

        ok = {}
        if not self.args.no_check:
            fused()
            fused16()
            pipeline()
            pipeline16()
            torch.cuda.synchronize()
            ok["tilewire"] = self.all_ok(self.rel_err(out, ref) < 1e-2)
            ok["tilewire-bf16p"] = self.all_ok(self.rel_err(out16, ref16) < 2e-2)
        t = {"nccl+torch": self.time(pipeline), "nccl-bf16+torch": self.time(pipeline16),
             "gemm-alone": self.time(gemm_alone), "nccl-reduce": self.time(reduce32),
             "nccl-bf16-reduce": self.time(reduce16), "tilewire": self.time(fused),
             "tilewire-bf16p": self.time(fused16)}
        if self.args.profile:
            self.kernel_profile(shape_label(op, shape, world), {
                "nccl+torch": pipeline, "nccl-bf16+torch": pipeline16, "tilewire": fused,
                "tilewire-bf16p": fused16})
        return t, ok, 2.0 * m * n * k

    def kernel_profile(self, label, fns, calls=PROFILE_CALLS):
        """--profile: per variant, `calls` back-to-back calls under torch.profiler's CUDA
        activity (CUPTI: every kernel, memcpy and memset of this process, ours included).
        Appends to self.profiles (label, variant, summary) where summary has the period (span of
        all GPU activity / calls), busy (the union of the activity's intervals / calls), idle
        (period - busy) in us and, per kernel name, its count and median duration: the idle
        time between calls shows without TW_TRACE's own cost. Rank 0's view."""
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile

        for variant, fn in fns.items():
            for _ in range(5):
                fn()
            self.quiesce()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            if self.rank == 0:
                self.profiles.append((label, variant, profile_summary(
                    _device_intervals(prof.events()), calls)))

    def host_costs(self, calls=2000):
        """{name: (host us per call, wall us per call)}: a tiny shape (the GPU's share a few
        us), `calls` back-to-back calls without a sync timed on the host, then the sync. The
        host figure is what one call costs the Python thread that issues it; where it exceeds
        the kernel's time, it is the op's time."""
        torch, dist, tw, world = self.torch, self.dist, self.tw, self.world
        from . import _eager, _glue, _lib

        m, n, k = 128 * world, 256, 64
        a = self.rand((m, k), 1)
        b = self.rand((n, k), 2)
        shard = self.rand((m // world, k), 3)
        ws = tw.gemm_rs_workspace(self.comm, m, n)
        gathered_sym = self.comm.empty((m, k), torch.bfloat16)
        gathered = torch.empty((m, k), device=self.device, dtype=torch.bfloat16)
        out_rs = torch.empty((m // world, n), device=self.device, dtype=torch.bfloat16)
        out_ar = torch.empty((m, n), device=self.device, dtype=torch.bfloat16)
        part = torch.empty((m, n), device=self.device, dtype=torch.bfloat16)
        args = _lib.GemmRsArgs(
            out_dtype=_lib.DType.BF16, a=a.data_ptr(), b=b.data_ptr(), out=out_rs.data_ptr(),
            workspace=ws.data_ptr(), m=m, n=n, k=k, lda=k, ldb=k, ldo=n)
        c_fn = _lib.function("tw_gemm_rs")
        handle = self.comm.handle
        stream = _glue._stream(self.device)
        # the C calls alone (ctypes, args made once): the plain GEMM's path, the fused ops',
        # and one tensor map encode (the fused calls make one per operand and per peer slot)
        ar_args = _lib.GemmRsArgs(
            out_dtype=_lib.DType.BF16, a=a.data_ptr(), b=b.data_ptr(), out=out_ar.data_ptr(),
            workspace=ws.data_ptr(), m=m, n=n, k=k, lda=k, ldb=k, ldo=n)
        ag_args = _lib.AgGemmArgs(
            c_dtype=_lib.DType.BF16, a=shard.data_ptr(), b=b.data_ptr(), c=out_ar.data_ptr(),
            a_gathered=gathered_sym.data_ptr(), m_local=m // world, n=n, k=k, ldb=k, ldc=n)
        gemm_args = _lib.GemmArgs(c_dtype=_lib.DType.BF16, a=a.data_ptr(), b=b.data_ptr(),
                                  c=part.data_ptr(), m=m, n=n, k=k, lda=k, ldb=k, ldc=n)
        c_ar, c_ag, c_gemm = (_lib.function(f) for f in ("tw_gemm_ar", "tw_ag_gemm", "tw_gemm"))
        encode = _tensor_map_encoder(a.data_ptr(), m, k)
        lane = _eager._LANE_ON

        def whole_way(fn):  # the same call with the fast lane off (docs/ARCHITECTURE.md)
            def run():
                _eager._LANE_ON = False
                try:
                    fn()
                finally:
                    _eager._LANE_ON = lane
            return run

        weight = torch.nn.Parameter(b.clone(), requires_grad=False)
        fns = [
            ("torch.matmul", lambda: torch.matmul(a, b.t(), out=part)),
            ("nccl reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(out_rs, part)),
            ("nccl all_gather_into_tensor", lambda: dist.all_gather_into_tensor(gathered, shard)),
            ("tilewire.gemm", lambda: tw.gemm(a, b, out=part)),
            ("tilewire.gemm_rs", lambda: tw.gemm_rs(self.comm, a, b, ws, out=out_rs)),
            ("tilewire.gemm_ar", lambda: tw.gemm_ar(self.comm, a, b, ws, out=out_ar)),
            ("tilewire.ag_gemm", lambda: tw.ag_gemm(self.comm, shard, b, gathered_sym,
                                                    out=out_ar)),
            ("tilewire.gemm, b an nn.Parameter", lambda: tw.gemm(a, weight, out=part)),
            ("tilewire.gemm, fast lane off", whole_way(lambda: tw.gemm(a, b, out=part))),
            ("tilewire.gemm_rs, fast lane off",
             whole_way(lambda: tw.gemm_rs(self.comm, a, b, ws, out=out_rs))),
            ("tilewire.ag_gemm, fast lane off",
             whole_way(lambda: tw.ag_gemm(self.comm, shard, b, gathered_sym, out=out_ar))),
            ("tw_gemm_rs (ctypes, args made once)",
             lambda: c_fn(handle, ctypes.byref(args), stream)),
            ("tw_gemm_ar (ctypes, args made once)",
             lambda: c_ar(handle, ctypes.byref(ar_args), stream)),
            ("tw_ag_gemm (ctypes, args made once)",
             lambda: c_ag(handle, ctypes.byref(ag_args), stream)),
            ("tw_gemm (ctypes, args made once)",
             lambda: c_gemm(ctypes.byref(gemm_args), stream)),
        ]
        if encode is not None:
            fns.append(("cuTensorMapEncodeTiled (ctypes)", encode))
        res = {}
        for name, fn in fns:
            for _ in range(50):
                fn()
            self.quiesce()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            v = torch.tensor([(t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6],
                             device=self.device, dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            res[name] = tuple(float(x) for x in v.tolist())
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile() if self.rank == 0 else None
        self.quiesce()
        if prof:
            prof.enable()
        for _ in range(500):
            tw.gemm_rs(self.comm, a, b, ws, out=out_rs)
        if prof:
            prof.disable()
        torch.cuda.synchronize()
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            print("cProfile of 500 tilewire.gemm_rs calls (rank 0), by own time:\n"
                  + s.getvalue())
        return res

    def run(self):
        args = self.args
        rows = []
        ops = args.op or list(OPS)
        for op in ops:
            for shape in shapes(op, args.quick, _one_shape(args)):
                why = check_shape(op, shape, self.world)
                label = shape_label(op, shape, self.world)
                if why:
                    if self.rank == 0:
                        print("[%s] %s: skipped: %s" % (op, label, why), file=sys.stderr)
                    continue
                if self.rank == 0:
                    print("[%s] %s ..." % (op, label), file=sys.stderr, flush=True)
                if op == "ag_gemm":
                    t, ok, flops = self.ag_gemm(shape)
                else:
                    t, ok, flops = self._gemm_reduce(op, shape)
                rows += make_rows(op, label, flops, t, ok)
                self.quiesce()
        err = self.comm.async_error()
        if err is not None:
            raise RuntimeError("tilewire: %s" % err)
        return rows

    def meta(self, argv):
        torch = self.torch
        props = torch.cuda.get_device_properties(self.device)
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - informational
            nccl = "?"
        return {"tool": "tilewire.bench_dist",
                "date": datetime.datetime.now(datetime.timezone.utc).strftime(
                    "%Y-%m-%d %H:%M:%S +0000"),
                "command": "python -m tilewire.bench_dist " + " ".join(argv),
                "host": socket.gethostname(), "gpu": props.name, "gpu_count": self.world,
                "sm_count": props.multi_processor_count,
                "compute_capability": "%d.%d" % (props.major, props.minor),
                "torch": torch.__version__, "nccl": nccl, "fp32_gemm": self._mm32 or "-",
                "tilewire": self.tw.__version__, "repeats": self.args.repeats,
                "graph_calls": self.args.graph,
                "warmup": self.args.warmup, "warm_ms": self.args.warm_ms,
                "min_ms": self.args.min_ms,
                "world": self.world, "processes": self.world}

    def close(self):
        if self._graphs:  # their replays are done; free their pools before the comm goes
            self.torch.cuda.synchronize()
            self._graphs.clear()
        self.comm.close()
        self.dist.destroy_process_group()


def run_rank(args, argv):
    try:
        import torch
    except ImportError:
        print("tilewire.bench_dist: needs torch", file=sys.stderr)
        return EXIT_NO_GPU
    if not torch.cuda.is_available():
        print("tilewire.bench_dist: no CUDA GPU", file=sys.stderr)
        return EXIT_NO_GPU
    from . import bench

    r = _Rank(args)
    if args.host:
        res = r.host_costs()
        if r.rank == 0:
            print("host time per call, world %d, tiny shape (us; slowest rank):" % r.world)
            print("%-40s %10s %10s" % ("call", "host", "wall"))
            for name, (host, wall) in res.items():
                print("%-40s %10.1f %10.1f" % (name, host, wall))
        r.close()
        return 0
    rows = r.run()
    doc = {"meta": r.meta(argv), "rows": rows}
    if r.rank == 0:
        sys.stdout.write("\n" + bench.format_table(doc))
        yard = bench.format_bound_table(doc)
        if yard:
            sys.stdout.write("\n" + yard)
        prof = format_profiles(r.profiles)
        if prof:
            sys.stdout.write("\n" + prof)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")
        sys.stdout.flush()
    r.close()
    return 0 if all(row.get("ok", True) for row in rows) else EXIT_FAILED


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.nproc is not None:
        if args.nproc < 1:
            print("tilewire.bench_dist: --nproc must be positive", file=sys.stderr)
            return EXIT_USAGE
        return launch(argv, args.nproc, args.timeout)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("tilewire.bench_dist: run it under torchrun, or give --nproc N", file=sys.stderr)
        return EXIT_USAGE
    return run_rank(args, argv)


if __name__ == "__main__":
    sys.exit(main())
