"""python -m tilewire.bench_dist: the fused ops against PyTorch's own pipeline, one process per
GPU as torchrun runs a tensor-parallel job.

    torchrun --nproc-per-node 8 -m tilewire.bench_dist          # under torchrun
    python -m tilewire.bench_dist --nproc 2 --quick               # launches the ranks itself
    python -m tilewire.bench_dist --nproc 2 --op gemm_rs --m 4096 --n 12288 --k 6144
    python -m tilewire.bench_dist --nproc 1 --op moe --quick     # the MoE rows on one GPU
    python -m tilewire.bench_dist --nproc 8 --op moe --m 512 --n 4096 --k 7168 --experts 256 \
        --top-k 8                                     # moe: m = tokens per rank, n = N, k = H
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
  moe       an MoE layer's token dispatch and its experts' first GEMM (expert parallelism, rank r
            holding experts [r E / world, (r + 1) E / world)); shape: T tokens per rank, hidden
            H, n_out N, E experts, top-k; routing uniform top-k per rank (seeded), the same for
            every pipeline. torch (PyTorch's pipeline, without DeepEP: the per-expert counts
            exchanged with all_to_all_single, the splits read on the host, x's rows sorted by
            destination rank exchanged with all_to_all_single, regrouped by local expert with
            each expert padded to 8 rows, torch._grouped_mm), gemm-alone (its torch._grouped_mm
            alone), nccl-alltoall (its two exchanges alone), unfused (tilewire.moe_dispatch
            then tilewire.grouped_gemm), grouped-gemm and dispatch (those two alone; tw-bench
            moe's rows), fused (tilewire.moe_dispatch_gemm), bound. TFLOP/s over the live rows
            (2 T top-k N H per rank; tilewire's GEMMs also compute each expert's padding up to
            128 rows). Under --graph torch and nccl-alltoall run eagerly (their splits are read
            on the host)
Times: CUDA events around each call on every rank, no barrier between calls (the collectives
and the fused ops synchronise the ranks themselves), after the warm-up calls and about
--warm-ms of calls (a power-capped card settles its clock; every rank makes the same number of
calls, each being collective); each figure is the slowest rank's median over --repeats calls,
or over as many as fill --min-ms where calls are short (eager decode calls are host-bound and
jittery; at most 2000). speedup: over the
fp32 pipeline (bf16p rows over the bf16 one; moe: over torch); overlap: max(t_gemm, t_comm) /
t_fused; bound rows: (t_gemm + t_comm) / max(t_gemm, t_comm) in the speedup column (t_gemm =
gemm-alone, t_comm = the NCCL row: nccl-allgather, nccl-reduce, nccl-bf16-reduce or
nccl-alltoall).
Rank 0 prints tilewire.bench's table and the yardstick (speedup / bound) and writes --json.
Results are checked (unless --no-check) against the NCCL pipeline's: relative error below 1e-2
(2e-2 with bf16 partials), and the gathered A bitwise. moe: the fused recv, offsets and
expert_out's live rows bitwise the unfused ones (fused's ok), the offsets tilewire.h's layout
of the routing, and torch's rows, matched per (token, slot) through an exchange of their ids,
bitwise tilewire's recv rows with expert outputs within 1e-2 of the fused ones (torch's ok).
NCCL_NVLS_ENABLE defaults to 0.
Exit status: 0 all rows passed, 1 a check or a rank failed, 2 no GPU / torch, 64 bad usage.
"""

import argparse
import os
import socket
import subprocess
import sys
import time

from ._dist_rank import run_rank
from ._dist_sweep import (
    EXIT_FAILED,
    EXIT_NO_GPU,
    EXIT_USAGE,
    MOE_EXPERTS,
    MOE_TOP_K,
    OPS,
    PROFILE_CALLS,
    check_shape,
    format_profiles,
    make_rows,
    profile_summary,
    shape_label,
    shapes,
    timed_calls,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_NO_GPU",
    "EXIT_USAGE",
    "OPS",
    "PROFILE_CALLS",
    "check_shape",
    "format_profiles",
    "launch",
    "launch_env",
    "main",
    "make_rows",
    "profile_summary",
    "run_rank",
    "shape_label",
    "shapes",
    "timed_calls",
]


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
    p.add_argument("--experts", type=int, default=MOE_EXPERTS,
                   help="moe with --m/--n/--k (m = tokens per rank, n = n_out, k = hidden): "
                   "the experts (default %(default)s)")
    p.add_argument("--top-k", type=int, default=MOE_TOP_K,
                   help="moe with --m/--n/--k: experts per token (default %(default)s)")
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
