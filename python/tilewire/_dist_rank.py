"""One rank of python -m tilewire.bench_dist: its own GPU, torch.distributed (NCCL) and a
tilewire comm; times the fused ops against torch's pipelines and reports rows as
tilewire.bench reads them. Imports torch when a rank starts."""

import ctypes
import datetime
import json
import os
import socket
import sys
import time

from ._dist_sweep import (
    EXIT_FAILED,
    EXIT_NO_GPU,
    OPS,
    PROFILE_CALLS,
    _device_intervals,
    _one_shape,
    _stats,
    _tensor_map_encoder,
    check_shape,
    format_profiles,
    make_rows,
    profile_summary,
    shape_label,
    shapes,
    timed_calls,
)


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
        tilewire.gemm (tilewire's GEMM core)."""
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

    def time(self, fn, capturable=True):
        """(median, p10, p90) ms of the slowest rank, per call (--graph: per captured call;
        a fn that is not capturable, one reading values on the host, is timed eagerly)."""
        torch, dist, args = self.torch, self.dist, self.args
        for _ in range(max(0, args.warmup)):
            fn()
        per = 1
        if args.graph > 0 and capturable:
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

    def moe(self, shape):
        """The moe op's variants (bench_dist's docstring), routing uniform top-k per rank
        (seeded), alike for every pipeline."""
        torch, dist, tw, world, rank = self.torch, self.dist, self.tw, self.world, self.rank
        _, tokens, n_out, hidden, experts, top_k = shape
        local = experts // world
        x = self.rand((tokens, hidden), 500 + rank)
        weights = self.rand((local, n_out, hidden), 600 + rank)
        idx = moe_routing(tokens, experts, top_k, 700 + rank, self.device)
        rows = tw.moe_recv_rows(world, tokens, experts, top_k)
        ws_f, ws_u = (tw.moe_workspace(self.comm, max_tokens=tokens, experts=experts,
                                       top_k=top_k) for _ in range(2))
        recv_f, recv_u = (self.comm.empty((rows, hidden), torch.bfloat16) for _ in range(2))
        for t in (recv_f, recv_u):
            t.zero_()  # finite padding rows, which the grouped GEMM also computes
        eout_f, eout_u = (torch.zeros((rows, n_out), device=self.device, dtype=torch.bfloat16)
                          for _ in range(2))
        offs_f, offs_u = (torch.zeros(local + 1, device=self.device, dtype=torch.int32)
                          for _ in range(2))

        def fused():
            tw.moe_dispatch_gemm(self.comm, x, idx, weights, recv_f, eout_f, offs_f, ws_f,
                                 tokens, experts=experts)

        def dispatch():
            tw.moe_dispatch(self.comm, x, idx, recv_u, offs_u, ws_u, tokens, experts=experts)

        def grouped():
            tw.grouped_gemm(recv_u, weights, offs_u, out=eout_u)

        def unfused():
            dispatch()
            grouped()

        def pipeline():
            torch_moe(dist, x, idx, weights, world)

        ok = {}
        if not self.args.no_check:
            fused()
            unfused()
            torch.cuda.synchronize()
            ok["fused"], ok["torch"] = self._moe_check(
                x, idx, weights, (recv_f, eout_f, offs_f), (recv_u, eout_u, offs_u))
        unfused()  # grouped-gemm's recv and offsets
        st = torch_moe(dist, x, idx, weights, world)  # the pieces' inputs
        w_t = weights.transpose(1, 2)
        got_counts = torch.empty_like(st["counts"])

        def gemm_alone():
            torch._grouped_mm(st["grouped"], w_t, offs=st["offs"])

        def alltoall():  # the pipeline's two exchanges and its host read of the splits
            dist.all_to_all_single(got_counts, st["counts"])
            splits = torch.cat((st["send_splits"], got_counts.view(world, local).sum(1)))
            splits = splits.tolist()
            dist.all_to_all_single(st["got"], st["send"], splits[world:], splits[:world])

        t = {"torch": self.time(pipeline, capturable=False), "gemm-alone": self.time(gemm_alone),
             "nccl-alltoall": self.time(alltoall, capturable=False),
             "unfused": self.time(unfused), "grouped-gemm": self.time(grouped),
             "dispatch": self.time(dispatch), "fused": self.time(fused)}
        if self.args.profile:
            self.kernel_profile(shape_label("moe", shape, world), {
                "torch": pipeline, "unfused": unfused, "fused": fused})
        return t, ok, 2.0 * tokens * top_k * n_out * hidden

    def _moe_check(self, x, idx, weights, fused, unfused):
        """(fused ok, torch ok), alike on every rank: the fused recv, offsets and expert_out's
        live rows bitwise the unfused ones, the offsets those of tilewire.h's layout; torch's
        grouped rows, found per (token, slot) by an exchange of their ids, bitwise recv's rows
        of the same (token, slot) and its expert outputs within bf16 tolerance of the fused
        ones."""
        torch, dist, world, rank = self.torch, self.dist, self.world, self.rank
        (recv_f, eout_f, offs_f), (recv_u, eout_u, offs_u) = fused, unfused
        tokens, top_k = idx.shape
        local = weights.shape[0]
        every = torch.empty((world * tokens, top_k), device=self.device, dtype=idx.dtype)
        dist.all_gather_into_tensor(every, idx)
        rows, ids, counts = tw_slot_rows(every.view(world, tokens, top_k), rank, local, offs_f)
        want = torch.zeros(local + 1, device=self.device, dtype=torch.int64)
        want[1:] = ((counts + 127) // 128 * 128).cumsum(0)
        good = (torch.equal(offs_f, offs_u) and torch.equal(offs_f.long(), want)
                and torch.equal(recv_f[rows], recv_u[rows])
                and torch.equal(eout_f[rows], eout_u[rows])
                and bool(torch.isfinite(eout_f[rows].float()).all()))
        mine = (rank * tokens + torch.arange(tokens, device=self.device)) * top_k
        ref = torch_moe(dist, x, idx, weights, world,
                        ids=(mine.unsqueeze(1) + torch.arange(top_k, device=self.device))
                        .reshape(-1))
        at = torch.full((world * tokens * top_k,), -1, device=self.device, dtype=torch.int64)
        held = (ref["ids"] >= 0).nonzero(as_tuple=True)[0]
        at[ref["ids"][held]] = held
        t_rows = at[ids]
        same = held.numel() == ids.numel() and bool((t_rows >= 0).all())
        if same and ids.numel():
            same = (torch.equal(ref["grouped"][t_rows], recv_f[rows])
                    and self.rel_err(ref["out"][t_rows], eout_f[rows]) < 1e-2)
        return self.all_ok(good), self.all_ok(same)

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

        def whole_way(fn):  # the same call with the fast lane off (tilewire/_eager.py)
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
            for shape in shapes(op, args.quick, _one_shape(args), args.experts, args.top_k):
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
                elif op == "moe":
                    t, ok, flops = self.moe(shape)
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


# ---- the moe op's routing and PyTorch's pipeline (module level: host-tested on the CPU) -----

# torch._grouped_mm's groups start 16-byte aligned along M in bf16 (its weight gradient
# contracts over M): every local expert's rows padded to a multiple of 8, as torchtitan's
# expert-parallel layer pads them
GROUP_ALIGN = 8


def moe_routing(tokens, experts, top_k, seed, device):
    """topk_idx int32 [tokens, top_k]: top_k distinct experts per token, uniform (the first
    top_k of a random permutation of the experts), from `seed`."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand((tokens, experts), generator=g, device=device)
    return scores.argsort(dim=1)[:, :top_k].to(torch.int32).contiguous()


def moe_send(x, topk_idx, experts):
    """The sending half of PyTorch's dispatch: (send, counts, order). order: the (token,
    slot) pairs sorted by expert, stably (so by destination rank, each expert's pairs in token
    order); send = x's row of each, in that order; counts int64 [experts]: the pairs of each
    expert. Every slot names an expert (no -1)."""
    import torch

    flat = topk_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    return x.index_select(0, order // topk_idx.shape[1]), counts, order


def moe_group(got_counts, world, local, rows):
    """The receiving half's layout: the rows that arrived (every source's in rank order, each
    source's sorted by expert; got_counts [world * local]: source s's rows of local expert e
    at s * local + e) regrouped expert-major, inside an expert by source. Returns (dest, offs,
    cap): dest int64 [rows], each arrived row's row in the grouped tensor; offs int32 [local],
    each expert's end there (torch._grouped_mm's offs), its rows padded to GROUP_ALIGN; cap,
    the grouped tensor's rows, more than offs[-1]."""
    import torch

    c = got_counts.view(world, local)
    padded = (c.sum(0) + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = padded.cumsum(0)
    chunks = c.reshape(-1)
    base = ((ends - padded).unsqueeze(0) + c.cumsum(0) - c).reshape(-1) \
        - (chunks.cumsum(0) - chunks)
    dest = torch.repeat_interleave(base, chunks, output_size=rows) \
        + torch.arange(rows, device=got_counts.device)
    return dest, ends.to(torch.int32), rows + GROUP_ALIGN * local


def torch_moe(dist, x, topk_idx, weights, world, ids=None):
    """PyTorch's MoE dispatch and expert GEMM without DeepEP, as an expert-parallel layer runs
    it: the per-expert counts exchanged (dist.all_to_all_single), the splits read on the host,
    x's rows sorted by destination rank exchanged (dist.all_to_all_single), regrouped by local
    expert (moe_group; padding rows zero) and torch._grouped_mm over them with weights
    [local, n_out, hidden]. ids (int64, one per (token, slot), the check's): exchanged and
    regrouped alike. Returns {"out", "grouped", "offs", "ids" (-1 on padding rows; None
    without ids), "counts", "send", "send_splits", "got"}."""
    import torch

    local, hidden = weights.shape[0], x.shape[1]
    send, counts, order = moe_send(x, topk_idx, local * world)
    got_counts = torch.empty_like(counts)
    dist.all_to_all_single(got_counts, counts)
    send_splits = counts.view(world, local).sum(1)
    splits = torch.cat((send_splits, got_counts.view(world, local).sum(1))).tolist()
    rows = sum(splits[world:])
    got = x.new_empty((rows, hidden))
    dist.all_to_all_single(got, send, splits[world:], splits[:world])
    dest, offs, cap = moe_group(got_counts, world, local, rows)
    grouped = x.new_zeros((cap, hidden))
    grouped.index_copy_(0, dest, got)
    out = torch._grouped_mm(grouped, weights.transpose(1, 2), offs=offs)
    grouped_ids = None
    if ids is not None:
        got_ids = ids.new_empty(rows)
        dist.all_to_all_single(got_ids, ids[order], splits[world:], splits[:world])
        grouped_ids = ids.new_full((cap,), -1)
        grouped_ids.index_copy_(0, dest, got_ids)
    return {"out": out, "grouped": grouped, "offs": offs, "ids": grouped_ids,
            "counts": counts, "send": send, "send_splits": send_splits, "got": got}


def tw_slot_rows(every_idx, rank, local, offsets):
    """Where tilewire's dispatch puts the (token, slot) pairs routed to `rank` (tilewire.h:
    expert-major from offsets[e], inside an expert by source rank, inside a source in token
    order). every_idx: every rank's topk_idx [world, tokens, top_k]; offsets: the dispatch's.
    Returns (rows, ids, counts) int64: the recv row and the id (source * tokens + token) *
    top_k + slot of each pair, in row order, and each local expert's pairs."""
    import torch

    world, tokens, top_k = every_idx.shape
    dev = every_idx.device
    el = every_idx.reshape(-1).long() - rank * local
    ids = torch.arange(el.numel(), device=dev)
    mine = (el >= 0) & (el < local)
    ids, el = ids[mine], el[mine]
    src, tok = ids // (tokens * top_k), ids // top_k % tokens
    # the keys are distinct: a token's slots name distinct experts
    order = torch.argsort((el * world + src) * tokens + tok)
    ids, el = ids[order], el[order]
    counts = torch.bincount(el, minlength=local)
    first = counts.cumsum(0) - counts
    rows = offsets.long()[el] + torch.arange(el.numel(), device=dev) - first[el]
    return rows, ids, counts


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
