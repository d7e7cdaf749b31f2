"""tilewire.bench_ring's host pieces: the shards' positions and the fp32 merge of partial
attentions (what the unfused ring computes), on the CPU."""

import math

import pytest

torch = pytest.importorskip("torch")

from tilewire import bench_ring  # noqa: E402


def test_positions_cover_the_sequence():
    for layout in ("contiguous", "zigzag"):
        for world in (1, 2, 3, 4):
            seen = sorted(p for r in range(world)
                          for p in bench_ring.positions(layout, world, 6, r))
            assert seen == list(range(world * 6)), (layout, world)
    assert bench_ring.positions("zigzag", 2, 4, 0) == [0, 1, 6, 7]
    assert bench_ring.positions("zigzag", 2, 4, 1) == [2, 3, 4, 5]


def _attend(q, k, v, mask=None):
    """o (B, S, H, D) and lse (B, H, S) of softmax(q k^T / sqrt(d)) v in fp64."""
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)), nan=0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


def test_merge_of_two_key_halves_is_the_whole():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    whole, _ = _attend(q, k, v)
    acc = bench_ring.merge(torch, None, _attend(q, k[:, :4], v[:, :4]))
    o, _ = bench_ring.merge(torch, acc, _attend(q, k[:, 4:], v[:, 4:]))
    assert torch.allclose(o.double(), whole, atol=1e-6)


def test_merge_keeps_dead_rows_zero():
    q, k, v = (torch.ones(1, 2, 1, 4, dtype=torch.float64) for _ in range(3))
    dead = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    acc = bench_ring.merge(torch, None, _attend(q, k, v, dead))
    o, lse = bench_ring.merge(torch, acc, _attend(q, k, v, dead))
    assert torch.all(o == 0) and torch.all(torch.isinf(lse))
