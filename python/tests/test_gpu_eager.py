"""The eager paths of the torch front end on a Hopper GPU: the direct path without the
dispatcher and the fast lane give what the dispatcher gives, and are taken only where they
may be. Skipped without torch or without a Hopper GPU."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import (  # noqa: E402
    ag_inputs,
    assert_clean,
    bf16,
    close_all,
    gemm_inputs,
    rank_ordered_sum,
    reduce_case,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]


# ---- the eager path without the dispatcher ------------------------------------------------


def test_direct_eager_path_is_taken_only_where_it_may_be():
    from tilewire import _eager

    if not _eager._FAST_EAGER:
        pytest.skip("this torch lacks what the direct path checks (it always dispatches)")
    a, b = gemm_inputs(128, 256, 64)
    assert _eager._direct_ok((a, b, None), ())
    w = a.clone().requires_grad_()
    assert not _eager._direct_ok((w, b), ())  # autograd to record: the dispatcher
    with torch.no_grad():
        assert _eager._direct_ok((w, b), ())
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert not _eager._direct_ok((a, b), ())
    with torch.inference_mode():
        inf = torch.empty(4, device="cuda")
    assert not _eager._direct_ok((a, b, inf), (inf,))  # the dispatcher raises for these
    with torch.inference_mode():
        assert _eager._direct_ok((a, b, inf), (inf,))


def _poisoned_outs(world, m, n, m_local_ag, n_ag):
    """NaN-filled outputs of every op per rank: gemm_rs [m / world, n], gemm_ar and gemm
    [m, n], ag_gemm [world * m_local_ag, n_ag]."""
    def nan(rows, cols):
        return [torch.full((rows, cols), float("nan"), device="cuda", dtype=bf16)
                for _ in range(world)]
    return {"rs": nan(m // world, n), "ar": nan(m, n), "ag": nan(world * m_local_ag, n_ag),
            "gemm": nan(m, n)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_direct_eager_path_matches_the_dispatcher(world, monkeypatch):
    """Every op, eager, with and without the dispatcher: the same bits, and the written
    tensors' version counters bumped alike."""
    from tilewire import _eager

    m, n, a, b = reduce_case(world, m_per_rank=128, n=264, k=136)
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        gathered, sh, bg = ag_inputs(comms, 128, 264)
        results = {}
        for fast in (True, False):
            monkeypatch.setattr(_eager, "_FAST_EAGER", fast and _eager._FAST_EAGER)
            outs = _poisoned_outs(world, m, n, 128, 264)
            versions = {k: [t._version for t in v] for k, v in outs.items()}
            tilewire.for_each_rank(comms, lambda c: (
                tilewire.gemm_rs(c, a[c.rank], b[c.rank], ws[c.rank], out=outs["rs"][c.rank]),
                tilewire.gemm_ar(c, a[c.rank], b[c.rank], ws[c.rank], out=outs["ar"][c.rank]),
                tilewire.ag_gemm(c, sh[c.rank], bg, gathered[c.rank], out=outs["ag"][c.rank]),
                tilewire.gemm(a[c.rank], b[c.rank], out=outs["gemm"][c.rank])))
            torch.cuda.synchronize()
            for k, v in outs.items():
                for r, t in enumerate(v):
                    assert t._version > versions[k][r], "%s rank %d: version not bumped" % (k, r)
            results[fast] = outs
        for k in results[True]:
            for r in range(world):
                assert torch.equal(results[True][k][r], results[False][k][r]), "%s rank %d" % (
                    k, r)
        exact = rank_ordered_sum(a, b).to(bf16)
        assert torch.equal(results[True]["ar"][0], exact)
        for c in comms:
            assert c.async_error() is None
        ws.clear()
        gathered.clear()
    finally:
        close_all(comms)


def test_direct_eager_path_takes_parameters():
    """nn.Parameter (a model's weights) takes the direct path; other subclasses dispatch."""
    from tilewire import _eager

    if not _eager._FAST_EAGER:
        pytest.skip("this torch lacks what the direct path checks (it always dispatches)")
    a, b = gemm_inputs(128, 256, 64)
    w = torch.nn.Parameter(b.clone())
    assert not _eager._direct_ok((a, w), ())  # requires grad, grad mode on: autograd records
    with torch.no_grad():
        assert _eager._direct_ok((a, w), ())

    class Sub(torch.Tensor):
        pass

    assert not _eager._direct_ok((a, b.as_subclass(Sub)), ())


# ---- the eager fast lane ----------------------------------------------------------------------


def _lane_calls(comms, a, b, ws, sh, bg, gathered, outs):
    """Every op once on every rank (out given where outs has it, else allocated)."""
    def one(c):
        r = c.rank
        return (tilewire.gemm_rs(c, a[r], b[r], ws[r], out=outs["rs"][r] if outs else None),
                tilewire.gemm_ar(c, a[r], b[r], ws[r], out=outs["ar"][r] if outs else None),
                tilewire.ag_gemm(c, sh[r], bg, gathered[r],
                                 out=outs["ag"][r] if outs else None),
                tilewire.gemm(a[r], b[r], out=outs["gemm"][r] if outs else None),
                tilewire.gemm(a[r], b[r], out_dtype=torch.float32, split_k=-1))
    res = tilewire.for_each_rank(comms, one)
    torch.cuda.synchronize()
    return res


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fast_lane_matches_the_whole_way(world, monkeypatch):
    """Repeated calls with one signature take the fast lane (a copied args struct, new data
    pointers): with fresh data in the same tensors and in new ones, every op gives the bits
    the whole way gives (the lane off), and what the checks refuse is still refused."""
    from tilewire import _eager

    if not (_eager._LANE_ON and _eager._FAST_EAGER):
        pytest.skip("the fast lane is off (TILEWIRE_FAST_LANE=0, or no direct eager path)")
    m, n, a, b = reduce_case(world, m_per_rank=128, n=264, k=136)
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        gathered, sh, bg = ag_inputs(comms, 128, 264)
        bg = torch.nn.Parameter(bg, requires_grad=False)  # a weight: the direct path too
        _eager._lane.clear()
        got = {}
        for lane in (False, True):
            monkeypatch.setattr(_eager, "_LANE_ON", lane)
            torch.manual_seed(5)
            for t in a + b + sh:
                t.copy_(torch.randn_like(t))
            outs = _poisoned_outs(world, m, n, 128, 264)
            runs = []
            for i in range(3):  # with the lane: the first call fills it, the others hit
                if i == 2:  # fresh data in the same tensors
                    for t in a + b + sh:
                        t.copy_(torch.randn_like(t))
                versions = [t._version for v in outs.values() for t in v]
                fresh = _lane_calls(comms, a, b, ws, sh, bg, gathered, None)
                given = _lane_calls(comms, a, b, ws, sh, bg, gathered, outs)
                assert all(t._version > v for t, v in zip(
                    [t for v in outs.values() for t in v], versions)), "version not bumped"
                runs.append(([[x.clone() for x in r] for r in fresh],
                             [[x.clone() for x in r] for r in given]))
            got[lane] = runs
            if lane:
                assert len(_eager._lane) >= 5 * world, "the lane kept no entries"
        for i in range(3):
            for part in (0, 1):
                for r in range(world):
                    for j, (x, y) in enumerate(zip(got[True][i][part][r], got[False][i][part][r])):
                        assert torch.equal(x, y), "call %d %s rank %d op %d" % (
                            i, ("fresh", "given")[part], r, j)
        # what the whole way refuses, the lane refuses too
        c = comms[0]
        bad = torch.empty(m * n + 8, device="cuda", dtype=bf16)[1:1 + m * n].view(m, n)
        with pytest.raises(ValueError, match="not 16-byte aligned"):
            tilewire.gemm(a[0], b[0], out=bad)
        if world > 1:
            with pytest.raises(ValueError, match="multiple of world"):
                tilewire.gemm_rs(c, a[0][:m - 1], b[0], ws[0])
        assert_clean(comms, ws, gathered)
    finally:
        close_all(comms)


def test_fast_lane_forgets_a_freed_symmetric_tensor():
    """A symmetric workspace freed after calls that filled the lane is refused again."""
    from tilewire import _eager

    if not (_eager._LANE_ON and _eager._FAST_EAGER):
        pytest.skip("the fast lane is off")
    m, n = 128, 256
    comms = tilewire.init_virtual(2)
    try:
        c = comms[0]
        ws = c.empty((c.gemm_rs_workspace_size(2 * m, n),), torch.uint8)
        plain = torch.empty_like(ws)
        wss = [ws, comms[1].empty((ws.numel(),), torch.uint8)]
        a2 = [torch.randn(2 * m, 64, device="cuda", dtype=bf16) for _ in comms]
        b2 = [torch.randn(n, 64, device="cuda", dtype=bf16) for _ in comms]
        for _ in range(2):
            tilewire.for_each_rank(comms, lambda cc: tilewire.gemm_rs(
                cc, a2[cc.rank], b2[cc.rank], wss[cc.rank]))
        torch.cuda.synchronize()
        gen = c.alloc_generation
        with pytest.raises(ValueError, match="not symmetric"):
            tilewire.gemm_rs(c, a2[0], b2[0], plain)
        for cc, t in zip(comms, wss):  # collective; the tensors still view the memory
            cc.free(t.data_ptr())
        assert c.alloc_generation > gen
        with pytest.raises(ValueError, match="not symmetric"):
            tilewire.gemm_rs(c, a2[0], b2[0], ws)
        for cc in comms:
            assert cc.async_error() is None
        wss.clear()
        del ws
    finally:
        close_all(comms)
