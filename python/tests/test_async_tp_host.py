"""tilewire.fused_all_gather_matmul and fused_matmul_reduce_scatter without a GPU: their
signatures against torch's, the group lookup and argument checks, and the placement of the
gathered and scattered dims, on CPU with a fake comm and stand-ins of ag_gemm / gemm_rs that
act for a whole world (rank q's shard is the caller's plus q). Skipped without torch."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _host import FakeComm, forbid_library  # noqa: E402
from tilewire import _async_tp  # noqa: E402

bf16 = torch.bfloat16


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    forbid_library(monkeypatch)

    def ag_gemm(comm, a, b, a_gathered, **kwargs):
        full = torch.cat([a.float() + q for q in range(comm.size)])  # rank q's shard: a + q
        a_gathered[:full.shape[0]].copy_(full.to(bf16))
        return (full @ b.float().t()).to(bf16)

    def gemm_rs(comm, a, b, workspace, **kwargs):
        total = sum((a.float() + q) @ b.float().t() for q in range(comm.size))
        m = a.shape[0] // comm.size
        return total[comm.rank * m:(comm.rank + 1) * m].to(bf16)

    monkeypatch.setattr(_async_tp, "ag_gemm", ag_gemm)
    monkeypatch.setattr(_async_tp, "gemm_rs", gemm_rs)
    monkeypatch.setattr(_async_tp, "gemm_rs_workspace", lambda comm, m, n: torch.zeros(1))


def _torch_signature(name):
    sm = pytest.importorskip("torch.distributed._symmetric_memory")
    fallback = getattr(sm, "_%s_fallback" % name, None)
    if fallback is None:
        pytest.skip("this torch has no %s fallback to compare with" % name)
    return inspect.signature(fallback)


@pytest.mark.parametrize("name", ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"])
def test_signature_matches_torch(name):
    ours = inspect.signature(getattr(tilewire, name))
    theirs = _torch_signature(name)
    assert list(ours.parameters) == list(theirs.parameters)
    for p in ours.parameters.values():
        q = theirs.parameters[p.name]
        assert p.kind == q.kind and p.default == q.default, p.name


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(bf16)  # exact in bf16 sums


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("shape, dim", [((6, 16), 0), ((3, 4, 16), 0), ((3, 4, 16), 1),
                                        ((2, 3, 5, 16), -2)])
def test_all_gather_matmul_placement(world, shape, dim):
    comm = FakeComm(1 % world, world)
    a = _values(shape, 1)
    bs = [_values((16, 8), 2), _values((16, 24), 3)]
    A, res = tilewire.fused_all_gather_matmul(a, bs, dim, comm)
    want_A = torch.cat([a.float() + q for q in range(world)], dim=dim)
    assert torch.equal(A.float(), want_A)
    for b, r in zip(bs, res):
        assert torch.equal(r.float(), want_A @ b.float())
    A2, _ = tilewire.fused_all_gather_matmul(a, bs, dim, comm, return_A=False)
    assert A2 is None
    assert len(comm.allocs) == 1  # the gathered buffer is made once for a shape


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("shape, dim", [((8, 16), 0), ((4, 6, 16), 0), ((3, 8, 16), 1)])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter_placement(world, shape, dim, reduce_op):
    rank = world - 1
    comm = FakeComm(rank, world)
    a, b = _values(shape, 4), _values((16, 8), 5)
    got = tilewire.fused_matmul_reduce_scatter(a, b, reduce_op, dim, comm)
    total = sum((a.float() + q) @ b.float() for q in range(world))
    if reduce_op == "avg":
        total = total / world
    want = total.chunk(world, dim=dim)[rank]
    assert got.shape == want.shape
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)


def test_groups_and_checks():
    comm = FakeComm(0, 2)
    a, b = _values((4, 16), 1), _values((16, 8), 2)
    with pytest.raises(ValueError, match="no tilewire comm for group 'tp'"):
        tilewire.fused_all_gather_matmul(a, [b], 0, "tp")
    tilewire.register_group("tp", comm)
    assert tilewire.comm_for_group("tp") is comm
    tilewire.fused_all_gather_matmul(a, [b], 0, "tp")
    with pytest.raises(ValueError, match="last"):
        tilewire.fused_all_gather_matmul(a, [b], 1, comm)
    with pytest.raises(TypeError, match="bfloat16"):
        tilewire.fused_all_gather_matmul(a.float(), [b], 0, comm)
    with pytest.raises(ValueError, match=r"expected \[K=16, N\]"):
        tilewire.fused_all_gather_matmul(a, [b.t()], 0, comm)
    with pytest.raises(ValueError, match="reduce_op"):
        tilewire.fused_matmul_reduce_scatter(a, b, "max", 0, comm)
    with pytest.raises(ValueError, match="multiple of world"):
        tilewire.fused_matmul_reduce_scatter(_values((3, 16), 1), b, "sum", 0, comm)


class FakeMesh:
    mesh_dim_names = ("dp", "tp", "ep")

    def get_group(self, name):
        return "group-" + name


def test_init_mesh(monkeypatch):
    from tilewire import _torchrun

    made = []
    monkeypatch.setattr(_torchrun, "init", lambda group, **kw: made.append((group, kw)) or group)
    comms = tilewire.init_mesh(FakeMesh(), dims=("ep", "tp"), sm_budget=16)
    assert comms == {"tp": "group-tp", "ep": "group-ep"}
    assert made == [("group-tp", {"sm_budget": 16}), ("group-ep", {"sm_budget": 16})]  # mesh order
    with pytest.raises(ValueError, match="not the mesh's"):
        tilewire.init_mesh(FakeMesh(), dims=("cp",))
    with pytest.raises(TypeError, match="group="):
        tilewire.init_mesh(FakeMesh(), group="g")
