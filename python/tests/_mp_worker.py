"""One rank of test_mp.py, launched like torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT in the environment). argv[1] picks how the unique id travels:
"env" (tilewire.init's own TCP store) or "torch.distributed" (a gloo process group first).
Exit 0 when this rank's results match the torch reference. Each stage prints a line with the
seconds since the process started (test_mp shows them when a launch fails or times out), and a
rank still running TW_MP_STACK_S seconds after its start dumps every thread's stack."""

import faulthandler
import os
import sys
import time

T0 = time.monotonic()
if os.environ.get("TW_MP_STACK_S"):
    faulthandler.dump_traceback_later(float(os.environ["TW_MP_STACK_S"]), exit=False)

import torch  # noqa: E402

import tilewire  # noqa: E402


def stage(what):
    print("rank %s: %6.1f s %s" % (os.environ.get("RANK", "?"), time.monotonic() - T0, what),
          flush=True)


def shard(rank, iteration, n):
    g = torch.Generator(device="cuda").manual_seed(1000 * iteration + rank)
    return torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)


def main():
    mode = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stage("torch and tilewire imported")
    # the device tilewire.init picks (LOCAL_RANK modulo the visible GPUs), so no rank also makes
    # a context on GPU 0
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    stage("CUDA context up")
    if mode == "torch.distributed":
        torch.distributed.init_process_group("gloo")
        stage("gloo process group up")
    comm = tilewire.init()
    stage("tilewire.init done")
    assert (comm.rank, comm.size) == (rank, world), comm
    assert comm.local_size == world and comm.nodes == 1, comm

    n = 1 << 16
    out = comm.empty((world * n,), torch.bfloat16)
    for it in range(3):
        x = shard(rank, it, n)
        tilewire.allgather(comm, x, out)
        torch.cuda.synchronize()
        ref = torch.cat([shard(r, it, n) for r in range(world)])
        assert torch.equal(out, ref), "rank %d iteration %d: allgather differs" % (rank, it)
    tilewire.barrier(comm)
    torch.cuda.synchronize()
    err = comm.async_error()
    assert err is None, err
    stage("allgather checked")

    # The fused op, when the library has it: gather(a) @ b.T against torch.
    m_local, k, n_cols = 128, 256, 384
    gathered = comm.empty((world * m_local, k), torch.bfloat16)
    a = shard(rank, 7, m_local * k).view(m_local, k)
    b = shard(world, 8, n_cols * k).view(n_cols, k)
    c = tilewire.ag_gemm(comm, a, b, gathered)
    torch.cuda.synchronize()
    full = torch.cat([shard(r, 7, m_local * k).view(m_local, k) for r in range(world)])
    assert torch.equal(gathered, full), "rank %d: a_gathered differs" % rank
    ref = full.float() @ b.float().t()
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, "rank %d: ag_gemm relative error %g" % (rank, err)
    stage("ag_gemm checked")

    # GEMM + ReduceScatter / AllReduce: sum over ranks of a_r @ b_r.T.
    m, n_cols, k = 64 * world, 256, 128
    a = shard(rank, 9, m * k).view(m, k)
    b = shard(rank, 10, n_cols * k).view(n_cols, k)
    workspace = tilewire.gemm_rs_workspace(comm, m, n_cols)
    rs = tilewire.gemm_rs(comm, a, b, workspace)
    ar = tilewire.gemm_ar(comm, a, b, workspace)
    torch.cuda.synchronize()
    ref = sum(shard(r, 9, m * k).view(m, k).float() @ shard(r, 10, n_cols * k).view(n_cols, k)
              .float().t() for r in range(world))
    rows = m // world
    for name, got, want in (("gemm_rs", rs, ref[rank * rows:(rank + 1) * rows]),
                            ("gemm_ar", ar, ref)):
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, "rank %d: %s relative error %g" % (rank, name, err)
    stage("gemm_rs and gemm_ar checked")

    # Autograd: ag_gemm's backward (a gemm_rs) and gemm_rs's (an ag_gemm), one process per
    # rank; every rank rebuilds every rank's inputs for the float reference.
    def leaf(r, seed, rows, cols):
        return shard(r, seed, rows * cols).view(rows, cols).clone().requires_grad_()

    def ref(r, seed, rows, cols):
        return shard(r, seed, rows * cols).view(rows, cols).float()

    def close(got, want, what):
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, "rank %d: %s relative error %g" % (rank, what, err)

    m_local, k, n_cols = 128, 136, 264
    m = world * m_local
    gathered2 = comm.empty((m, k), torch.bfloat16)
    grad_ws = tilewire.gemm_rs_workspace(comm, m, k)
    a, b = leaf(rank, 11, m_local, k), leaf(rank, 12, n_cols, k)
    tilewire.ag_gemm(comm, a, b, gathered2, grad_workspace=grad_ws).backward(
        ref(rank, 13, m, n_cols).to(torch.bfloat16))
    torch.cuda.synchronize()
    full = torch.cat([ref(r, 11, m_local, k) for r in range(world)])
    d_full = sum(ref(s, 13, m, n_cols) @ ref(s, 12, n_cols, k) for s in range(world))
    close(a.grad, d_full[rank * m_local:(rank + 1) * m_local], "ag_gemm d/da")
    close(b.grad, ref(rank, 13, m, n_cols).t() @ full, "ag_gemm d/db")
    stage("ag_gemm backward checked")

    m, n_cols, k = 64 * world, 264, 136
    ws2 = tilewire.gemm_rs_workspace(comm, m, n_cols)
    a, b = leaf(rank, 14, m, k), leaf(rank, 15, n_cols, k)
    tilewire.gemm_rs(comm, a, b, ws2).backward(
        ref(rank, 16, m // world, n_cols).to(torch.bfloat16))
    torch.cuda.synchronize()
    g_full = torch.cat([ref(r, 16, m // world, n_cols) for r in range(world)])
    close(a.grad, g_full @ ref(rank, 15, n_cols, k), "gemm_rs d/da")
    close(b.grad, g_full.t() @ ref(rank, 14, m, k), "gemm_rs d/db")
    assert comm.async_error() is None

    del out, gathered, workspace, gathered2, grad_ws, ws2
    comm.close()
    if mode == "torch.distributed":
        torch.distributed.destroy_process_group()
    stage("closed")
    print("rank %d of %d: ok" % (rank, world), flush=True)


if __name__ == "__main__":
    main()
