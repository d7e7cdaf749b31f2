"""Comms, symmetric tensors and allgather on virtual ranks sharing one Hopper GPU, and the
ops under CUDA graph capture. Skipped without torch or without a Hopper GPU."""

import gc
import warnings

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import bf16, captured_graph, close_all, rank_ordered_sum  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]


# ---- comms and symmetric tensors ----------------------------------------------------------


def test_virtual_comm_properties():
    comms = tilewire.init_virtual(4, config=tilewire.Config(ranks_per_node=2))
    try:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for r, c in enumerate(comms):
            assert (c.rank, c.size, c.device) == (r, 4, 0)
            assert (c.node, c.nodes, c.local_rank, c.local_size) == (r // 2, 2, r % 2, 2)
            assert 0 < c.sm_budget <= sms // 4
            assert c.async_error() is None
            assert "rank %d of 4" % r in repr(c)
    finally:
        close_all(comms)
    assert comms[0].closed


def test_symmetric_tensors_are_freed_with_their_last_view():
    comms = tilewire.init_virtual(2)
    try:
        ts = tilewire.symmetric_empty(comms, (4, 256), torch.float32)
        assert ts[0].shape == (4, 256) and ts[0].dtype == torch.float32
        assert ts[0].device == torch.device("cuda", 0)
        assert ts[0].data_ptr() != ts[1].data_ptr()
        assert all(tilewire.is_symmetric(c, t) for c, t in zip(comms, ts))
        view = ts[0][1:]
        ts[0].fill_(3.0)
        del ts
        gc.collect()
        assert len(comms[0].live_allocations()) == 1  # the view keeps rank 0's alive
        assert comms[1].live_allocations() == []
        assert view.sum().item() == 3.0 * 3 * 256
        del view
        gc.collect()
        assert comms[0].live_allocations() == []
    finally:
        close_all(comms)


def test_close_with_a_live_symmetric_tensor_warns():
    comms = tilewire.init_virtual(1)
    t = comms[0].empty((64,))
    with pytest.warns(RuntimeWarning, match="still referenced"):
        comms[0].close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del t  # its deleter must not free again after close
        gc.collect()


# ---- allgather ----------------------------------------------------------------------------


@pytest.mark.parametrize("elements", [8, 4096, 1 << 21])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_allgather_virtual_ranks(world, elements):
    comms = tilewire.init_virtual(world)
    try:
        outs = tilewire.symmetric_empty(comms, (world * elements,), bf16)
        for it in range(3):  # epochs advance: repeated calls must keep working
            xs = [torch.randn(elements, device="cuda", dtype=bf16) + 10 * r + it
                  for r in range(world)]
            results = tilewire.for_each_rank(
                comms, lambda c: tilewire.allgather(c, xs[c.rank], outs[c.rank]))
            torch.cuda.synchronize()
            ref = torch.cat(xs)
            for r in range(world):
                assert results[r] is outs[r]
                assert torch.equal(outs[r], ref), "rank %d, iteration %d" % (r, it)
        for c in comms:
            assert c.async_error() is None
        outs.clear()
    finally:
        close_all(comms)


def test_allgather_2d_in_place():
    world, m, k = 4, 32, 64
    comms = tilewire.init_virtual(world)
    try:
        outs = tilewire.symmetric_empty(comms, (world * m, k), bf16)
        shards = [outs[r][r * m:(r + 1) * m] for r in range(world)]
        for r in range(world):
            shards[r].copy_(torch.full((m, k), float(r + 1), device="cuda", dtype=bf16))
        expected = torch.cat([s.clone() for s in shards])
        tilewire.for_each_rank(comms, lambda c: tilewire.allgather(c, shards[c.rank],
                                                                   outs[c.rank]))
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(outs[r], expected)
        shards.clear()
        outs.clear()
    finally:
        close_all(comms)


def test_allgather_cuda_graph_capture():
    world, n = 2, 1 << 16
    comms = tilewire.init_virtual(world)
    try:
        outs = tilewire.symmetric_empty(comms, (world * n,), bf16)
        xs = [torch.zeros(n, device="cuda", dtype=bf16) for _ in range(world)]

        def step():
            tilewire.for_each_rank(comms, lambda c: tilewire.allgather(c, xs[c.rank],
                                                                       outs[c.rank]))

        graph = captured_graph(step)
        for it in range(3):
            for r in range(world):
                xs[r].copy_(torch.randn(n, device="cuda", dtype=bf16))
            graph.replay()
            torch.cuda.synchronize()
            ref = torch.cat(xs)
            for r in range(world):
                assert torch.equal(outs[r], ref), "replay %d, rank %d" % (it, r)
        for c in comms:
            assert c.async_error() is None
        del graph
        outs.clear()
    finally:
        close_all(comms)


def test_fused_ops_cuda_graph_capture():
    """gemm_rs, gemm_ar and ag_gemm captured once (eager calls take the direct path, which
    capture must record like the dispatcher's), replayed with new inputs: every replay equals
    the eager calls' bits."""
    world, m, n, k = 2, 256, 264, 136
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        gathered = tilewire.symmetric_empty(comms, (m, k), bf16)
        a = [torch.zeros(m, k, device="cuda", dtype=bf16) for _ in comms]
        b = [torch.zeros(n, k, device="cuda", dtype=bf16) for _ in comms]
        sh = [torch.zeros(m // world, k, device="cuda", dtype=bf16) for _ in comms]
        rs = [torch.empty(m // world, n, device="cuda", dtype=bf16) for _ in comms]
        ar = [torch.empty(m, n, device="cuda", dtype=bf16) for _ in comms]
        ag = [torch.empty(m, n, device="cuda", dtype=bf16) for _ in comms]

        def step():
            tilewire.for_each_rank(comms, lambda c: (
                tilewire.gemm_rs(c, a[c.rank], b[c.rank], ws[c.rank], out=rs[c.rank]),
                tilewire.gemm_ar(c, a[c.rank], b[c.rank], ws[c.rank], out=ar[c.rank]),
                tilewire.ag_gemm(c, sh[c.rank], b[c.rank], gathered[c.rank], out=ag[c.rank])))

        graph = captured_graph(step)
        for it in range(3):
            for r in range(world):
                a[r].copy_(torch.randn(m, k, device="cuda", dtype=bf16))
                b[r].copy_(torch.randn(n, k, device="cuda", dtype=bf16))
                sh[r].copy_(torch.randn(m // world, k, device="cuda", dtype=bf16))
            graph.replay()
            torch.cuda.synchronize()
            replayed = [[t.clone() for t in outs] for outs in (rs, ar, ag)]
            step()
            torch.cuda.synchronize()
            for name, got, eager in zip(("rs", "ar", "ag"), replayed, (rs, ar, ag)):
                for r in range(world):
                    assert torch.equal(got[r], eager[r]), "%s replay %d rank %d" % (name, it, r)
            exact = rank_ordered_sum(a, b).to(bf16)
            assert torch.equal(ar[0], exact), "replay %d: gemm_ar bits" % it
        for c in comms:
            assert c.async_error() is None
        del graph
        ws.clear()
        gathered.clear()
    finally:
        close_all(comms)


def test_allgather_argument_errors_on_gpu():
    comms = tilewire.init_virtual(2)
    try:
        outs = tilewire.symmetric_empty(comms, (2 * 64,), bf16)
        x = torch.randn(64, device="cuda", dtype=bf16)
        plain = torch.empty(2 * 64, device="cuda", dtype=bf16)
        with pytest.raises(ValueError, match="symmetric"):
            tilewire.allgather(comms[0], x, plain)
        with pytest.raises(ValueError, match="world \\* x.numel"):
            tilewire.allgather(comms[0], x[:32], outs[0])
        with pytest.raises(TypeError, match="out is torch.bfloat16 but x is torch.float32"):
            tilewire.allgather(comms[0], x.float(), outs[0])
        with pytest.raises(ValueError, match="multiple of 16"):
            tilewire.allgather(comms[0], x[:3], outs[0][:6])
        with pytest.raises(ValueError, match="on cpu"):
            tilewire.allgather(comms[0], x.cpu(), outs[0])
        outs.clear()
    finally:
        close_all(comms)
