"""tilewire.example_block without a GPU: the tensor-parallel block at world 1 through CPU
stand-ins of the ops (the layers' wiring, the fused weights' per-rank order, the loss and the
replicated gradients) trains like the plain block; and the per-rank interleave of fused
weights. Skipped without torch."""

import pytest

torch = pytest.importorskip("torch")

from _host import FakeComm, forbid_library  # noqa: E402
from tilewire import _nn_attention, _nn_moe, example_block  # noqa: E402
from tilewire import nn as twnn  # noqa: E402

bf16 = torch.bfloat16


def _product(comm, a, b, buf, grad_workspace=None):
    return (a.float() @ b.float().t()).to(bf16)  # world 1: every op is the product


def _cpu_moe_ffn(comm, x, topk_idx, topk_weights, w13, w2, **kwargs):
    inter = w13.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            h = w13[e].float() @ x[t].float()
            acc = acc + topk_weights[t, j] * (w2[e].float() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
        rows.append(acc)
    return torch.stack(rows).to(bf16)


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    forbid_library(monkeypatch)
    for name in ("ag_gemm", "gemm_rs", "gemm_ar"):
        monkeypatch.setattr(twnn, name, _product)
    monkeypatch.setattr(twnn, "gemm_rs_workspace", lambda comm, m, n: None)
    monkeypatch.setattr(_nn_moe, "moe_ffn", _cpu_moe_ffn)
    monkeypatch.setattr(_nn_moe, "moe_workspace", lambda comm, *a, **k: torch.zeros(64, dtype=torch.uint8))


def test_interleave():
    a = torch.arange(8).view(8, 1)
    b = torch.arange(8, 16).view(8, 1)
    got = example_block._interleave((a, b), 2).flatten().tolist()
    assert got == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


@pytest.mark.parametrize("experts", [0, 4])
def test_world_1_trains_like_the_plain_block(experts):
    ref = example_block.bf16_values(example_block.TorchBlock(32, 4, 48, experts=experts, seed=3))
    comm = FakeComm()
    block = example_block.TilewireBlock(ref, comm, max_tokens=16, device="cpu")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 32, generator=g).to(bf16).float()
    target = torch.randn(16, 32, generator=g)
    tw = example_block.train_tilewire([block], [comm], [x.to(bf16)], [target], 3, 0.05,
                                      lambda comms, fn: [fn(c) for c in comms])
    plain = example_block.train_torch(ref, x, target, 3, 0.05)
    for a, b in zip(plain, tw):
        assert abs(a - b) <= 5e-2 * abs(a), (plain, tw)
    assert tw[-1] < tw[0]  # it learns


# ---- context parallelism (TilewireBlock(context_parallel=True)) ----------------------------


def _cpu_ring(comm, q, k, v, k_buf, v_buf, causal, layout, softmax_scale, grad):
    """_nn_attention._ring_staged's stand-in at world 1, where the zigzag shard is the whole
    sequence in order: k and v staged as the op does, then causal attention (fp32, autograd)."""
    assert comm.size == 1 and causal and layout == "zigzag"
    with torch.no_grad():
        k_buf.copy_(k)
        v_buf.copy_(v)
    o = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return o.transpose(1, 2).to(bf16)


def _positions(world, rows, r):  # the zigzag layout's positions of rank r (rows per rank)
    h = rows // 2
    return list(range(r * h, (r + 1) * h)) + list(range((2 * world - 1 - r) * h,
                                                        (2 * world - r) * h))


def test_zigzag_shards():
    t = torch.arange(16)
    assert [s.tolist() for s in example_block.zigzag_shards(t, 2)] == [
        [0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert example_block.zigzag_shards(t, 1)[0].tolist() == t.tolist()
    rows = torch.arange(48).view(24, 2)
    for r, s in enumerate(example_block.token_shards(rows, 4, context_parallel=True)):
        assert s[:, 0].tolist() == [2 * p for p in _positions(4, 6, r)]
    plain = example_block.token_shards(rows, 4)
    assert [s[:, 0].tolist() for s in plain] == [list(range(12 * r, 12 * r + 12, 2))
                                                 for r in range(4)]
    with pytest.raises(ValueError, match="rows=12 must be a multiple of 2 x world=8"):
        example_block.zigzag_shards(torch.zeros(12, 3), 4)


@pytest.mark.parametrize("context_parallel", [False, True])
@pytest.mark.parametrize("experts", [0, 4])
def test_replicated_parameters_are_those_every_rank_holds_whole(context_parallel, experts):
    ref = example_block.bf16_values(example_block.TorchBlock(128, 2, 64, experts=experts,
                                                             seed=4))
    blocks = [example_block.TilewireBlock(ref, FakeComm(rank=r, size=2), max_tokens=16,
                                          device="cpu", context_parallel=context_parallel)
              for r in range(2)]
    names = blocks[0].replicated_parameters()
    want = ["norm1.weight", "norm2.weight"] + (["qkv.weight", "o.weight"] if context_parallel
                                               else []) + (["moe.gate.weight"] if experts else [])
    assert names == want
    ps = [dict(b.named_parameters()) for b in blocks]
    for name in ps[0]:  # replicated: the same whole tensor on both ranks; else a rank's shard
        same = torch.equal(ps[0][name], ps[1][name])
        assert same == (name in names), name
    if context_parallel:
        assert ps[0]["qkv.weight"].shape == (3 * 128, 128) and ps[0]["o.weight"].dtype == bf16
        assert torch.equal(ps[0]["qkv.weight"].float(), ref.qkv.weight)


class _Part(torch.nn.Module):
    """A stand-in block: `shared` replicated, `own` not."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Parameter(torch.ones(2))
        self.own = torch.nn.Parameter(torch.ones(2))

    def reserve(self, tokens):
        pass

    def replicated_parameters(self):
        return ["shared"]

    def forward(self, x):
        return x * self.shared * self.own


def test_train_tilewire_sums_exactly_the_replicated_gradients():
    blocks = [_Part(), _Part()]
    xs = [torch.full((3, 2), 1.0), torch.full((3, 2), 2.0)]
    targets = [torch.zeros(3, 2), torch.zeros(3, 2)]
    example_block.train_tilewire(blocks, [FakeComm(0, 2), FakeComm(1, 2)], xs, targets, 1, 0.1,
                                 lambda comms, fn: [fn(c) for c in comms])
    # d/dp sum((x p)^2) / 12 at p = 1: 2 x^2 x 3 / 12 a element; rank 0: 0.5, rank 1: 2
    assert torch.allclose(blocks[0].shared, torch.full((2,), 1 - 0.1 * 2.5))
    assert torch.equal(blocks[0].shared, blocks[1].shared)
    assert torch.allclose(blocks[0].own, torch.full((2,), 1 - 0.1 * 0.5))
    assert torch.allclose(blocks[1].own, torch.full((2,), 1 - 0.1 * 2.0))


@pytest.mark.parametrize("experts", [0, 4])
def test_world_1_context_parallel_trains_like_the_plain_block(monkeypatch, experts):
    monkeypatch.setattr(_nn_attention, "_ring_staged", _cpu_ring)
    ref = example_block.bf16_values(example_block.TorchBlock(128, 2, 96, experts=experts,
                                                             seed=6))
    comm = FakeComm()
    block = example_block.TilewireBlock(ref, comm, max_tokens=16, device="cpu",
                                        context_parallel=True)
    assert isinstance(block.qkv, torch.nn.Linear) and block.ring.layout == "zigzag"
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 128, generator=g).to(bf16).float()
    target = torch.randn(16, 128, generator=g)
    xs = [t.to(bf16) for t in example_block.token_shards(x, 1, True)]
    tw = example_block.train_tilewire([block], [comm], xs,
                                      example_block.token_shards(target, 1, True), 3, 0.05,
                                      lambda comms, fn: [fn(c) for c in comms])
    plain = example_block.train_torch(ref, x, target, 3, 0.05)
    for a, b in zip(plain, tw):
        assert abs(a - b) <= 5e-2 * abs(a), (plain, tw)
    assert tw[-1] < tw[0]  # it learns


def test_context_parallel_reserve(monkeypatch):
    """reserve() makes the ring's buffers (K/V, the backward's q, dout, lse, workspace) and runs
    the attention's torch work forward and backward through the local stand-in of the ring,
    leaving the parameters without gradients."""
    calls = []
    local = example_block._LocalRing

    class Counting(local):
        @staticmethod
        def forward(ctx, q, k, v):
            calls.append(("forward", tuple(q.shape), q.is_contiguous(), k.is_contiguous()))
            return local.forward(ctx, q, k, v)

        @staticmethod
        def backward(ctx, dout):
            calls.append(("backward", tuple(dout.shape)))
            return local.backward(ctx, dout)

    monkeypatch.setattr(example_block, "_LocalRing", Counting)
    ref = example_block.bf16_values(example_block.TorchBlock(128, 2, 96, seed=8))
    comm = FakeComm()
    block = example_block.TilewireBlock(ref, comm, max_tokens=16, device="cpu",
                                        context_parallel=True)
    block.reserve(16)
    assert comm.allocs[:6] == [(1, 16, 2, 64)] * 4 + [(1, 2, 16)] * 2
    assert calls == [("forward", (1, 16, 2, 64), True, False), ("backward", (1, 16, 2, 64))]
    assert all(p.grad is None for p in block.parameters())


def test_context_parallel_refusals():
    ref = example_block.TorchBlock(256, 8, 64, seed=1)  # head_dim 32
    with pytest.raises(ValueError, match="head_dim .*256 / 8.* 64 or 128"):
        example_block.TilewireBlock(ref, FakeComm(), device="cpu", context_parallel=True)
    with pytest.raises(TypeError, match="context_parallel must be a bool"):
        example_block.TilewireBlock(ref, FakeComm(), device="cpu", context_parallel=1)
    for argv in (["--cp"], ["--cp", "--heads", "4", "--world", "4", "--tokens", "100"]):
        with pytest.raises(SystemExit) as e:  # head_dim 32; 100 tokens: no 8 equal chunks
            example_block.main(argv)
        assert e.value.code == 2
