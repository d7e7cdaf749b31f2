"""Helpers of the GPU tests (test_gpu_*.py): torch references, inputs, and the
virtual-rank cases the op tests share. Imported after pytest.importorskip("torch")."""

import gc
import os

import torch

import tilewire

bf16 = torch.bfloat16


def ref_product(a, b):
    return a.float() @ b.float().t()


def rel_err(x, ref):
    """Largest error relative to the largest reference value."""
    return ((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


TOL = {bf16: 1e-2, torch.float32: 1e-4}


def gemm_inputs(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=bf16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=bf16, generator=g)
    return a, b


def close_all(comms):
    gc.collect()
    for c in comms:
        c.close()


def captured_graph(step):
    """step() run once eagerly (it creates the per-rank streams), then captured: the graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def ag_inputs(comms, m_local=256, n=512, k=384):
    """A symmetric a_gathered, a shard per rank and a shared b for ag_gemm tests."""
    world = len(comms)
    gathered = tilewire.symmetric_empty(comms, (world * m_local, k), bf16)
    a = [torch.randn(m_local, k, device="cuda", dtype=bf16) for _ in range(world)]
    b = torch.randn(n, k, device="cuda", dtype=bf16)
    return gathered, a, b


def reduce_case(world, m_per_rank=128, n=256, k=192):
    m = m_per_rank * world
    a = [torch.randn(m, k, device="cuda", dtype=bf16) for _ in range(world)]
    b = [torch.randn(n, k, device="cuda", dtype=bf16) for _ in range(world)]
    return m, n, a, b


def rs_and_ar(comms, a, b, m, n, partials):
    """gemm_rs, then gemm_ar, of every rank's a @ b.T, each rank through a workspace of its
    own; waits for both. Returns (workspaces, rs outs, ar outs)."""
    ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
    rs = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_rs(
        c, a[c.rank], b[c.rank], ws[c.rank], partials=partials))
    ar = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_ar(
        c, a[c.rank], b[c.rank], ws[c.rank], partials=partials))
    torch.cuda.synchronize()
    return ws, rs, ar


def rank_ordered_sum(a, b, partials="fp32"):
    """The header's contract: tw_gemm (fp32 out; bf16 out with bf16 partials) per rank,
    summed in rank order in fp32."""
    dtype = torch.float32 if partials == "fp32" else bf16
    total = tilewire.gemm(a[0], b[0], out_dtype=dtype).float()
    for r in range(1, len(a)):
        total = total + tilewire.gemm(a[r], b[r], out_dtype=dtype).float()
    return total


def assert_clean(comms, *buffers):
    """No rank reported an asynchronous error; the symmetric buffers are dropped (before
    the comms close)."""
    for c in comms:
        assert c.async_error() is None
    for buf in buffers:
        buf.clear()


NICS = {"ib": "mlx5:8", "efa": "efa:16"}  # the verbs double's NICs: a ConnectX-7 node, a p5 node


def init_nodes(nodes, per_node, backend):
    """Virtual ranks in `nodes` virtual nodes of per_node, joined through the verbs test double
    (TW_IBVERBS_LIB) with `backend`'s NICs."""
    saved = {k: os.environ.get(k) for k in ("TW_NET", "TW_VD_NICS")}
    os.environ["TW_NET"], os.environ["TW_VD_NICS"] = backend, NICS[backend]
    try:
        return tilewire.init_virtual(nodes * per_node,
                                     config=tilewire.Config(ranks_per_node=per_node))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
