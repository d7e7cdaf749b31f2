"""The fused ops (ag_gemm, gemm_rs, gemm_ar) on virtual ranks sharing one Hopper GPU, against
torch references, and their backward passes. Skipped without torch or without a Hopper
GPU."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import (  # noqa: E402
    TOL,
    ag_inputs,
    assert_clean,
    bf16,
    close_all,
    rank_ordered_sum,
    reduce_case,
    ref_product,
    rel_err,
    rs_and_ar,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]


# ---- ag_gemm ------------------------------------------------------------------------------


def _ag_gemm_checked(comms, gathered, a, b):
    """One ag_gemm on every rank: each rank's a_gathered holds every shard and its product is
    within bf16 tolerance of the float reference; returns the products."""
    outs = tilewire.for_each_rank(
        comms, lambda c: tilewire.ag_gemm(c, a[c.rank], b, gathered[c.rank]))
    torch.cuda.synchronize()
    full = torch.cat(a)
    ref = ref_product(full, b)
    for r in range(len(comms)):
        assert outs[r].shape == (full.shape[0], b.shape[0])
        assert torch.equal(gathered[r], full), "rank %d's a_gathered" % r
        assert rel_err(outs[r], ref) < TOL[bf16], "rank %d" % r
    return outs


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ag_gemm_virtual_ranks(world):
    m_local, n = 256, 512
    comms = tilewire.init_virtual(world)
    try:
        gathered, a, b = ag_inputs(comms, m_local, n)
        _ag_gemm_checked(comms, gathered, a, b)
        for c in comms:
            assert c.async_error() is None
        gathered.clear()
    finally:
        close_all(comms)


@pytest.mark.parametrize("world", [2, 4])
def test_ag_gemm_without_gathered_out(world):
    """gathered_out=False: the same product (bitwise), only the own slice of a_gathered kept."""
    m_local = 256
    comms = tilewire.init_virtual(world)
    try:
        gathered, a, b = ag_inputs(comms, m_local)
        with_gather = tilewire.for_each_rank(
            comms, lambda c: tilewire.ag_gemm(c, a[c.rank], b, gathered[c.rank]))
        torch.cuda.synchronize()
        for _ in range(3):  # back to back, inputs in place in the own slice
            without = tilewire.for_each_rank(
                comms, lambda c: tilewire.ag_gemm(
                    c, gathered[c.rank][c.rank * m_local:(c.rank + 1) * m_local], b,
                    gathered[c.rank], gathered_out=False))
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(without[r], with_gather[r]), "rank %d" % r
            assert torch.equal(gathered[r][r * m_local:(r + 1) * m_local], a[r])
        for c in comms:
            assert c.async_error() is None
        with pytest.raises(TypeError, match="gathered_out"):
            tilewire.ag_gemm(comms[0], a[0], b, gathered[0], gathered_out=1)
        gathered.clear()
    finally:
        close_all(comms)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ag_gemm_decode_shape(world):
    """Few output tiles over a long K (M=64 in all, N=1024, K=8192): the op runs tw_allgather
    then a split-K tw_gemm; against the float reference, the gathered A complete, and the same
    bits again in place (the shard in its slot) and back to back."""
    m_local, n, k = 64 // world, 1024, 8192
    comms = tilewire.init_virtual(world)
    try:
        gathered, a, b = ag_inputs(comms, m_local, n, k)
        first = _ag_gemm_checked(comms, gathered, a, b)
        for _ in range(3):
            again = tilewire.for_each_rank(comms, lambda c: tilewire.ag_gemm(
                c, gathered[c.rank][c.rank * m_local:(c.rank + 1) * m_local], b,
                gathered[c.rank]))
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(again[r], first[r]), "rank %d: in place" % r
        for c in comms:
            assert c.async_error() is None
        gathered.clear()
    finally:
        close_all(comms)


# ---- gemm_rs / gemm_ar --------------------------------------------------------------------


@pytest.mark.parametrize("world,partials", [(1, "fp32"), (2, "fp32"), (4, "fp32"),
                                            (2, "bf16"), (3, "bf16")])
def test_gemm_rs_and_ar_virtual_ranks(world, partials):
    m, n, a, b = reduce_case(world)
    comms = tilewire.init_virtual(world)
    try:
        ws, rs, ar = rs_and_ar(comms, a, b, m, n, partials)
        ref = sum(ref_product(a[r], b[r]) for r in range(world))
        exact = rank_ordered_sum(a, b, partials).to(bf16)
        rows = m // world
        for r in range(world):
            assert rs[r].shape == (rows, n) and ar[r].shape == (m, n)
            assert rel_err(rs[r], ref[r * rows:(r + 1) * rows]) < TOL[bf16], "rs rank %d" % r
            assert rel_err(ar[r], ref) < TOL[bf16], "ar rank %d" % r
            # Fixed, rank-ordered fp32 reduction: bitwise the unfused composition.
            assert torch.equal(rs[r], exact[r * rows:(r + 1) * rows]), "rs rank %d bits" % r
            assert torch.equal(ar[r], exact), "ar rank %d bits" % r
        for c in comms:
            assert c.async_error() is None
        ws.clear()
    finally:
        close_all(comms)


@pytest.mark.parametrize("world,partials", [(2, "fp32"), (3, "bf16")])
def test_gemm_ar_symmetric_out(world, partials):
    """out_symmetric=True: the owners write every rank's symmetric out; the same bits as the
    rank-ordered composition."""
    m, n, a, b = reduce_case(world, m_per_rank=256, n=520, k=264)
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        outs = tilewire.symmetric_empty(comms, (m, n), bf16)
        for o in outs:
            o.fill_(float("nan"))
        ar = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_ar(
            c, a[c.rank], b[c.rank], ws[c.rank], out=outs[c.rank], partials=partials,
            out_symmetric=True))
        torch.cuda.synchronize()
        exact = rank_ordered_sum(a, b, partials).to(bf16)
        for r in range(world):
            assert ar[r].data_ptr() == outs[r].data_ptr()
            assert torch.equal(ar[r], exact), "ar rank %d bits" % r
        for c in comms:
            assert c.async_error() is None
        plain = torch.empty(m, n, device="cuda", dtype=bf16)
        with pytest.raises(ValueError, match="out_symmetric=True needs out"):
            tilewire.gemm_ar(comms[0], a[0], b[0], ws[0], out=plain, out_symmetric=True)
        ws.clear()
        outs.clear()
    finally:
        close_all(comms)


def test_gemm_rs_argument_errors_on_gpu():
    comms = tilewire.init_virtual(2)
    try:
        a = torch.randn(6, 64, device="cuda", dtype=bf16)
        b = torch.randn(16, 64, device="cuda", dtype=bf16)
        with pytest.raises(ValueError, match="workspace is needed"):
            tilewire.gemm_rs(comms[0], a[:4], b, None)
        with pytest.raises(ValueError, match="multiple of world=2"):
            tilewire.gemm_rs(comms[0], a[:5], b, None)
        plain = torch.empty(1 << 20, device="cuda", dtype=torch.uint8)
        with pytest.raises(ValueError, match="not symmetric"):
            tilewire.gemm_ar(comms[0], a[:4], b, plain)
        with pytest.raises(ValueError, match="partials must be 'fp32' or 'bf16'"):
            tilewire.gemm_rs(comms[0], a[:4], b, plain, partials="fp16")
    finally:
        close_all(comms)


# ---- autograd of the fused ops --------------------------------------------------------------


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ag_gemm_backward_is_a_gemm_rs(world):
    """d/da and d/db of ag_gemm against the float reference: a's gradient is the
    reduce-scatter of grad_out @ b over ranks, b's grad_out.T @ the gathered a."""
    m_local, n, k = 128, 264, 136
    comms = tilewire.init_virtual(world)
    try:
        gathered = tilewire.symmetric_empty(comms, (world * m_local, k), bf16)
        gws = [tilewire.gemm_rs_workspace(c, world * m_local, k) for c in comms]
        a = _leaves([torch.randn(m_local, k, device="cuda", dtype=bf16) for _ in comms])
        b = _leaves([torch.randn(n, k, device="cuda", dtype=bf16) for _ in comms])
        g = [torch.randn(world * m_local, n, device="cuda", dtype=bf16) for _ in comms]
        outs = tilewire.for_each_rank(comms, lambda c: tilewire.ag_gemm(
            c, a[c.rank], b[c.rank], gathered[c.rank], grad_workspace=gws[c.rank]))
        assert all(o.grad_fn is not None for o in outs)
        tilewire.for_each_rank(comms, lambda c: outs[c.rank].backward(g[c.rank]))
        torch.cuda.synchronize()
        full = torch.cat([t.detach() for t in a]).float()
        d_full = sum(g[s].float() @ b[s].detach().float() for s in range(world))
        for r in range(world):
            assert rel_err(outs[r], full @ b[r].detach().float().t()) < TOL[bf16]
            want_a = d_full[r * m_local:(r + 1) * m_local]
            assert rel_err(a[r].grad, want_a) < 2e-2, "rank %d: d/da" % r
            assert rel_err(b[r].grad, g[r].float().t() @ full) < 2e-2, "rank %d: d/db" % r
        assert_clean(comms, gathered, gws)
    finally:
        close_all(comms)


@pytest.mark.parametrize("world,partials", [(1, "fp32"), (2, "fp32"), (3, "bf16")])
def test_gemm_rs_backward_is_an_ag_gemm(world, partials):
    m, n, k = 128 * world, 264, 136
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        a = _leaves([torch.randn(m, k, device="cuda", dtype=bf16) for _ in comms])
        b = _leaves([torch.randn(n, k, device="cuda", dtype=bf16) for _ in comms])
        g = [torch.randn(m // world, n, device="cuda", dtype=bf16) for _ in comms]
        outs = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_rs(
            c, a[c.rank], b[c.rank], ws[c.rank], partials=partials))
        tilewire.for_each_rank(comms, lambda c: outs[c.rank].backward(g[c.rank]))
        torch.cuda.synchronize()
        g_full = torch.cat(g).float()
        for r in range(world):
            assert rel_err(a[r].grad, g_full @ b[r].detach().float()) < 2e-2, "rank %d" % r
            assert rel_err(b[r].grad, g_full.t() @ a[r].detach().float()) < 2e-2, "rank %d" % r
        assert_clean(comms, ws)
    finally:
        close_all(comms)


def test_gemm_ar_backward_is_local_and_errors_name_the_argument():
    world, m, n, k = 2, 256, 264, 136
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        a = _leaves([torch.randn(m, k, device="cuda", dtype=bf16) for _ in comms])
        b = _leaves([torch.randn(n, k, device="cuda", dtype=bf16) for _ in comms])
        g = torch.randn(m, n, device="cuda", dtype=bf16)  # a replicated loss: the same on all
        outs = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_ar(
            c, a[c.rank], b[c.rank], ws[c.rank]))
        tilewire.for_each_rank(comms, lambda c: outs[c.rank].backward(g))
        torch.cuda.synchronize()
        for r in range(world):
            assert rel_err(a[r].grad, g.float() @ b[r].detach().float()) < 2e-2
            assert rel_err(b[r].grad, g.float().t() @ a[r].detach().float()) < 2e-2
        # ag_gemm: a requiring grad needs grad_workspace; b's grad needs the gathered a
        gathered = tilewire.symmetric_empty(comms, (world * 128, k), bf16)
        shard = torch.randn(128, k, device="cuda", dtype=bf16, requires_grad=True)
        with pytest.raises(ValueError, match="grad_workspace"):
            tilewire.ag_gemm(comms[0], shard, b[0].detach(), gathered[0])
        with pytest.raises(ValueError, match="gathered_out=True"):
            tilewire.ag_gemm(comms[0], shard.detach(), b[0], gathered[0], gathered_out=False)
        assert_clean(comms, ws, gathered)
    finally:
        close_all(comms)
