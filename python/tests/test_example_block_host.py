"""tilewire.example_block without a GPU: the tensor-parallel block at world 1 through CPU
stand-ins of the ops (the layers' wiring, the fused weights' per-rank order, the loss and the
replicated gradients) trains like the plain block; and the per-rank interleave of fused
weights. Skipped without torch."""

import pytest

torch = pytest.importorskip("torch")

from _host import FakeComm, forbid_library  # noqa: E402
from tilewire import _nn_moe, example_block  # noqa: E402
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
