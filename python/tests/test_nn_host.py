"""tilewire.nn's layers without a GPU: shards, initialisation, state_dicts and the buffer
policy, on CPU with a fake comm (construction calls no library function); forward of world 1
through CPU stand-ins of the ops. Skipped where torch is not installed."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _host import FakeComm, forbid_library  # noqa: E402
from tilewire import nn as twnn  # noqa: E402

bf16 = torch.bfloat16
Col, Row = twnn.ColumnParallelLinear, twnn.RowParallelLinear


@pytest.fixture(autouse=True)
def no_library(monkeypatch):
    forbid_library(monkeypatch)


def _layers(cls, world, *args, **kwargs):
    kwargs.setdefault("device", "cpu")
    return [cls(*args, comm=FakeComm(r, world), **kwargs) for r in range(world)]


def _reference(in_features, out_features, bias=True, seed=0):
    """torch.nn.Linear's own initialisation after torch.manual_seed(seed): what the layers'
    reset_parameters gives (fp32), the global RNG left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Linear(in_features, out_features, bias=bias)


def test_exported():
    assert tilewire.nn is twnn
    assert tilewire.ColumnParallelLinear is Col and tilewire.RowParallelLinear is Row
    assert "nn" in dir(tilewire) and "RowParallelLinear" in tilewire.__all__


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_shapes(world):
    for c in _layers(Col, world, 24, 48):
        assert c.weight.shape == (48 // world, 24) and c.bias.shape == (48 // world,)
        assert c.weight.dtype == bf16 and c.weight.device.type == "cpu"
        assert c.comm.allocs == [] and list(c.state_dict()) == ["weight", "bias"]
    for r in _layers(Row, world, 24, 48):
        assert r.weight.shape == (48, 24 // world) and r.bias.shape == (48,)
        assert r.comm.allocs == []
    assert _layers(Col, world, 24, 48, bias=False)[0].bias is None
    assert list(_layers(Row, world, 24, 48, bias=False)[0].state_dict()) == ["weight"]


def test_divisibility_and_argument_errors():
    with pytest.raises(ValueError, match="out_features=20 must be divisible by world=3"):
        Col(24, 20, comm=FakeComm(0, 3), device="cpu")
    with pytest.raises(ValueError, match="in_features=20 must be divisible by world=3"):
        Row(20, 24, comm=FakeComm(0, 3), device="cpu")
    Col(20, 24, comm=FakeComm(0, 3), device="cpu")  # in_features is not split
    Row(24, 20, comm=FakeComm(0, 3), device="cpu")  # nor out_features here
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        Col(0, 24, comm=FakeComm(0, 1), device="cpu")
    with pytest.raises(TypeError, match="comm must be a tilewire.Comm"):
        Col(24, 24, comm=object(), device="cpu")
    with pytest.raises(NotImplementedError, match="gather_output=True"):
        Col(24, 24, comm=FakeComm(0, 2), device="cpu", gather_output=True)
    with pytest.raises(NotImplementedError, match="input_is_parallel=False"):
        Row(24, 24, comm=FakeComm(0, 2), device="cpu", input_is_parallel=False)
    with pytest.raises(ValueError, match="reduce must be 'scatter'"):
        Row(24, 24, comm=FakeComm(0, 2), device="cpu", reduce="sum")


def test_full_linear_init_is_torch_nn_linear_after_manual_seed():
    ref = _reference(24, 48, seed=5)
    w, b = twnn.full_linear_init(24, 48, init_seed=5)
    assert torch.equal(w, ref.weight) and torch.equal(b, ref.bias)
    assert twnn.full_linear_init(24, 48, bias=False, init_seed=5)[1] is None


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, bf16])
def test_reset_parameters_is_the_same_full_matrix_on_every_rank(world, dtype):
    """Every rank (built under a different global RNG state) keeps its shard of one full
    matrix: torch.nn.Linear's, initialised after torch.manual_seed(init_seed)."""
    ref = _reference(24, 48, seed=7)
    cols, rows = [], []
    for r in range(world):
        torch.manual_seed(1000 + r)  # the global RNG plays no part
        cols.append(Col(24, 48, comm=FakeComm(r, world), device="cpu", dtype=dtype,
                        init_seed=7))
        rows.append(Row(48, 24, comm=FakeComm(r, world), device="cpu", dtype=dtype,
                        init_seed=7))
    assert torch.equal(torch.cat([c.weight for c in cols]), ref.weight.to(dtype))
    assert torch.equal(torch.cat([c.bias for c in cols]), ref.bias.to(dtype))
    ref_row = _reference(48, 24, seed=7)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), ref_row.weight.to(dtype))
    for r in rows:
        assert torch.equal(r.bias, ref_row.bias.to(dtype))
    with torch.no_grad():
        cols[0].weight.zero_()
    cols[0].reset_parameters()
    assert torch.equal(cols[0].weight, ref.weight.to(dtype)[:48 // world])
    other = Col(24, 48, comm=FakeComm(0, world), device="cpu", dtype=dtype, init_seed=8)
    assert not torch.equal(other.weight, cols[0].weight)


@pytest.mark.parametrize("cls", [Col, Row])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_to_linear_round_trip(cls, world, bias):
    linear = torch.nn.Linear(32, 64, bias=bias)
    exact = [cls.from_linear(linear, FakeComm(r, world), device="cpu", dtype=torch.float32)
             for r in range(world)]
    assert all(m.comm.allocs == [] for m in exact)
    back = cls.to_linear(exact)
    assert isinstance(back, torch.nn.Linear) and back.weight.dtype == torch.float32
    assert back.in_features == 32 and back.out_features == 64
    want = linear.state_dict()
    got = back.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    for key, value in cls.full_state_dict([m.state_dict() for m in exact]).items():
        assert torch.equal(value, want[key]), key
    shards = [cls.from_linear(linear, FakeComm(r, world), device="cpu") for r in range(world)]
    assert shards[0].weight.dtype == bf16  # the default dtype
    for key, value in cls.to_linear(shards).state_dict().items():
        assert torch.equal(value, want[key].to(bf16)), key


def test_full_state_dict_wants_every_rank_in_order():
    linear = torch.nn.Linear(32, 64)
    mods = [Col.from_linear(linear, FakeComm(r, 2), device="cpu") for r in range(2)]
    with pytest.raises(ValueError, match="rank order"):
        Col.full_state_dict(mods[::-1])
    with pytest.raises(ValueError, match="rank order"):
        Col.full_state_dict(mods[:1])
    with pytest.raises(TypeError, match="shard 0 is a RowParallelLinear"):
        Col.full_state_dict([Row.from_linear(linear, FakeComm(0, 1), device="cpu")])
    with pytest.raises(TypeError, match="expected a torch.nn.Linear"):
        Col.from_linear(mods[0], FakeComm(0, 2))


@pytest.mark.parametrize("cls", [Col, Row])
def test_load_full_and_shard_state_dicts(cls):
    world, linear = 4, torch.nn.Linear(32, 64)
    layers = _layers(cls, world, 32, 64, dtype=torch.float32)
    for m in layers:
        m.load_state_dict(linear.state_dict())
    for key, value in cls.full_state_dict(layers).items():
        assert torch.equal(value, linear.state_dict()[key]), key
    again = _layers(cls, world, 32, 64, dtype=torch.float32, init_seed=3)
    for m, src in zip(again, layers):
        m.load_state_dict(src.state_dict())
        assert torch.equal(m.weight, src.weight) and torch.equal(m.bias, src.bias)
    # nested, under a prefix
    model = torch.nn.Sequential(_layers(cls, world, 32, 64, dtype=torch.float32)[1])
    model.load_state_dict({"0." + k: v for k, v in linear.state_dict().items()})
    assert torch.equal(model[0].weight, layers[1].weight)


def test_wrong_shape_state_dict_names_the_key():
    col = Col(32, 64, comm=FakeComm(1, 2), device="cpu")
    sd = torch.nn.Linear(32, 48).state_dict()
    with pytest.raises(ValueError, match=r"key 'weight' has shape \(48, 32\); expected this "
                                         r"rank's shard \(32, 32\) or the full .* \(64, 32\)"):
        col.load_state_dict(sd)
    model = torch.nn.Sequential(torch.nn.Identity(), Row(32, 64, comm=FakeComm(0, 2),
                                                         device="cpu"))
    sd = {"1.weight": torch.zeros(64, 8), "1.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="key '1.weight' has shape"):
        model.load_state_dict(sd)
    sd = {"1.weight": torch.zeros(64, 16), "1.bias": torch.zeros(32)}
    with pytest.raises(ValueError, match="key '1.bias' has shape"):
        model.load_state_dict(sd)


def test_extra_repr():
    col = Col(32, 64, comm=FakeComm(1, 2), device="cpu")
    assert repr(col) == ("ColumnParallelLinear(in_features=32, out_features=64, bias=True, "
                         "world=2, rank=1)")
    row = Row(32, 64, bias=False, comm=FakeComm(0, 4), device="cpu", reduce="all")
    assert repr(row) == ("RowParallelLinear(in_features=32, out_features=64, bias=False, "
                         "world=4, rank=0, reduce='all')")


# ---- forward, through CPU stand-ins of the ops ----------------------------------------------


class FakeOps:
    """ag_gemm / gemm_rs / gemm_ar for a comm of world 1 (the product; for world > 1 zeros
    of the output's shape), recording the buffers they were given."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("ag_gemm", "gemm_rs", "gemm_ar"):
            monkeypatch.setattr(twnn, name, self._op(name))

    def _op(self, name):
        def op(comm, a, b, buf, grad_workspace=None):
            self.calls.append((name, buf, grad_workspace))
            world = comm.size
            if name == "ag_gemm":
                assert buf.numel() >= world * a.shape[0] * a.shape[1]
                rows = world * a.shape[0]
            else:
                assert world == 1 and buf is None or buf.numel() >= 4 * a.shape[0] * b.shape[0]
                rows = a.shape[0] // world if name == "gemm_rs" else a.shape[0]
            if world == 1:
                return (a.float() @ b.float().t()).to(bf16)
            return torch.zeros(rows, b.shape[0], dtype=bf16)
        return op


def test_forward_world_1_is_the_linear(monkeypatch):
    FakeOps(monkeypatch)
    l1, l2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)
    comm = FakeComm(0, 1)
    col = Col.from_linear(l1, comm, device="cpu")
    rows = {red: Row.from_linear(l2, comm, device="cpu", reduce=red) for red in ("scatter", "all")}
    x = torch.randn(2, 4, 32).to(bf16)
    w1, b1, w2, b2 = (p.detach().to(bf16).float() for p in (l1.weight, l1.bias, l2.weight,
                                                            l2.bias))
    want_h = torch.nn.functional.linear(x.float(), w1, b1)
    ref = torch.nn.functional.linear(torch.nn.functional.gelu(want_h), w2, b2)
    h = col(x)
    assert h.shape == (2, 4, 64) and h.dtype == bf16
    assert (h.float() - want_h).abs().max() < 3e-2 * want_h.abs().max()
    for red, row in rows.items():
        y = row(torch.nn.functional.gelu(h))
        assert y.shape == (2, 4, 16), red
        assert (y.float() - ref).abs().max() < 3e-2 * ref.abs().max(), red
    with pytest.raises(ValueError, match=r"input must be a tensor \[rows, ..., 32\]"):
        col(torch.zeros(4, 16, dtype=bf16))
    with pytest.raises(TypeError, match="need torch.bfloat16 weights"):
        Col(32, 64, comm=comm, device="cpu", dtype=torch.float32)(x)


def test_buffers_grow_and_are_kept_until_released(monkeypatch):
    ops = FakeOps(monkeypatch)
    comm = FakeComm(1, 2)
    col = Col(32, 64, comm=comm, device="cpu")
    col(torch.zeros(8, 32, dtype=bf16))
    assert comm.allocs == [(16, 32)] and ops.calls[-1][2] is None  # no grad: no workspace
    col(torch.zeros(4, 32, dtype=bf16))  # smaller: the same buffer
    assert comm.allocs == [(16, 32)] and ops.calls[-1][1] is ops.calls[0][1]
    first = ops.calls[0][1]
    y = col(torch.zeros(2, 8, 32, dtype=bf16, requires_grad=True))  # 16 rows: grows
    assert y.shape == (4, 8, 32)
    assert comm.allocs == [(16, 32), (32, 32), (4 * 32 * 32,)]
    assert col._tw_retired == [first]
    col.reserve(8, grad=True)  # already there
    assert len(comm.allocs) == 3
    col.release_buffers()
    assert col._tw_gathered is None and col._tw_grad_workspace is None and not col._tw_retired
    row = Row(32, 64, comm=comm, device="cpu")
    row.reserve(16)
    assert comm.allocs[-1] == (4 * 16 * 64,)
    assert row(torch.zeros(8, 16, dtype=bf16)).shape == (4, 64)
    assert len(comm.allocs) == 4
    with pytest.raises(ValueError, match=r"x.shape\[0\]=3 must be a multiple of world=2"):
        row(torch.zeros(3, 16, dtype=bf16))
    allr = Row(32, 64, comm=comm, device="cpu", reduce="all")
    assert allr(torch.zeros(8, 16, dtype=bf16)).shape == (8, 64)
    assert ops.calls[-1][0] == "gemm_ar"
