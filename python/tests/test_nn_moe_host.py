"""tilewire.nn.ExpertParallelMoE without a GPU: validation, initialisation, the experts'
shards and state_dicts against tilewire.nn.TorchMoE, on CPU with a fake comm (construction
calls no library function); forward of world 1 through a CPU stand-in of moe_ffn, against
TorchMoE. Skipped where torch is not installed."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _host import FakeComm, forbid_library  # noqa: E402
from tilewire import _nn_moe  # noqa: E402
from tilewire import nn as twnn  # noqa: E402

EP, TM = twnn.ExpertParallelMoE, twnn.TorchMoE
H, I, E, K = 16, 24, 8, 2


@pytest.fixture(autouse=True)
def no_library(monkeypatch):
    forbid_library(monkeypatch)


def _layers(world, **kwargs):
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("max_tokens", 32)
    return [EP(H, I, E, K, comm=FakeComm(r, world), **kwargs) for r in range(world)]


def test_exported():
    assert tilewire.ExpertParallelMoE is EP and tilewire.TorchMoE is TM
    assert "ExpertParallelMoE" in tilewire.nn.__all__


@pytest.mark.parametrize("kwargs, needle", [
    ({"experts": 6}, "divisible by world"),
    ({"top_k": 9}, "at most experts"),
    ({"inter": 20}, "inter=20 must be a multiple of 8"),
    ({"hidden": 12}, "hidden=12"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_validation(kwargs, needle):
    args = {"hidden": H, "inter": I, "experts": E, "top_k": K, "max_tokens": 8}
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        EP(args["hidden"], args["inter"], args["experts"], args["top_k"], comm=FakeComm(0, 4),
           max_tokens=args["max_tokens"], device="cpu")
    with pytest.raises(TypeError, match="tilewire.Comm"):
        EP(H, I, E, K, comm=object(), max_tokens=8, device="cpu")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_init_matches_torch_moe(world):
    layers = _layers(world, dtype=torch.float32, init_seed=7)
    ref = TM(H, I, E, K, init_seed=7)
    full = EP.full_state_dict(layers)
    want = ref.state_dict()
    assert set(full) == set(want)
    for key in want:
        assert torch.equal(full[key], want[key]), key
    assert all(not m.comm.allocs for m in layers)  # construction allocates nothing
    other = TM(H, I, E, K, init_seed=8)
    assert not torch.equal(other.gate.weight, ref.gate.weight)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_state_dict_round_trip(world):
    ref = TM(H, I, E, K, init_seed=3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p))
    comms = [FakeComm(r, world) for r in range(world)]
    layers = [EP.from_torch(ref, c, max_tokens=16, device="cpu", dtype=torch.float32)
              for c in comms]
    local = E // world
    for r, m in enumerate(layers):
        for j in range(local):
            e = r * local + j
            assert torch.equal(m.w13[j, :I], ref.experts[e].gate_proj.weight)
            assert torch.equal(m.w13[j, I:], ref.experts[e].up_proj.weight)
            assert torch.equal(m.w2[j], ref.experts[e].down_proj.weight)
        assert torch.equal(m.gate.weight, ref.gate.weight)
    back = EP.to_torch(layers)
    for key, value in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    # a shard's own state_dict loads strictly into a fresh layer of its rank
    fresh = EP(H, I, E, K, comm=comms[0], max_tokens=16, device="cpu", dtype=torch.float32)
    fresh.load_state_dict(layers[0].state_dict())
    assert torch.equal(fresh.w13, layers[0].w13)
    # a TorchMoE's state_dict that lacks an expert is named
    partial = ref.state_dict()
    del partial["experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match="experts.5.up_proj.weight"):
        fresh.load_state_dict(partial)


def _cpu_moe_ffn(comm, x, topk_idx, topk_weights, w13, w2, *, workspace, recv, expert_out,
                 max_tokens, experts, out=None, h=None, act=None, stream=None, grad_buffer=None):
    """moe_ffn's math at world 1, in fp32 on the CPU (the op's contract, not its bits)."""
    inter = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            hh = w13[e].float() @ x[t].float()
            a = torch.nn.functional.silu(hh[:inter]) * hh[inter:]
            y[t] += topk_weights[t, j] * (w2[e].float() @ a)
    return y.to(torch.bfloat16)


def test_forward_world_1(monkeypatch):
    monkeypatch.setattr(_nn_moe, "moe_ffn", _cpu_moe_ffn)
    monkeypatch.setattr(_nn_moe, "moe_workspace",
                        lambda comm, *a, **k: comm.empty((64,), torch.uint8))
    ref = TM(H, I, E, K, init_seed=5, dtype=torch.bfloat16)
    layer = EP.from_torch(ref, FakeComm(0, 1), max_tokens=12, device="cpu")
    x = torch.randn(3, 4, H).to(torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
        want = ref(x)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 3e-2, err
    assert layer.comm.allocs  # the buffers came on the first forward
    with pytest.raises(ValueError, match="max_tokens=12"):
        layer(torch.randn(13, H).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[tokens, \.\.\., 16\]"):
        layer(torch.randn(3, H + 8).to(torch.bfloat16))


def test_torch_moe_routing():
    ref = TM(H, I, E, K, init_seed=1)
    x = torch.randn(5, H)
    idx, w = _nn_moe._route(x, ref.gate.weight, K, True)
    assert idx.dtype == torch.int32 and idx.shape == (5, K)
    assert torch.allclose(w.sum(-1), torch.ones(5))
    y = ref(x)  # against a per-token loop
    for t in range(5):
        acc = torch.zeros(H)
        for j in range(K):
            acc += w[t, j] * ref.experts[int(idx[t, j])](x[t])
        assert torch.allclose(y[t], acc, atol=1e-5)
