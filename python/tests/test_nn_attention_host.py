"""tilewire.nn.RingAttention on the host: construction, its refusals (layout, causal, inputs
that require grad, k and v shapes), an empty state_dict, and forward through a stand-in of
ring_attention (the K/V shards copied into the module's buffers, which are made once per
shape)."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from tilewire import _nn_attention  # noqa: E402
from _host import FakeComm  # noqa: E402


def _stand_in(comm, q, k, v, causal, layout, softmax_scale):
    return q + k.to(q.dtype) + v.to(q.dtype)


def test_refusals():
    comm = FakeComm(rank=0, size=2)
    with pytest.raises(ValueError, match="layout"):
        tilewire.nn.RingAttention(comm, layout="ring")
    with pytest.raises(TypeError, match="causal"):
        tilewire.nn.RingAttention(comm, causal=1)
    m = tilewire.nn.RingAttention(comm)
    assert m.state_dict() == {}
    x = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no backward"):
        m(x, x, x)
    with pytest.raises(ValueError, match="same shape"):
        with torch.no_grad():
            m(x, x, x[:, :2])


def test_forward_copies_shards_into_its_buffers(monkeypatch):
    monkeypatch.setattr(_nn_attention, "ring_attention", _stand_in)
    comm = FakeComm(rank=1, size=2)
    m = tilewire.nn.RingAttention(comm, causal=False, layout="contiguous")
    q = torch.ones(1, 4, 2, 64, dtype=torch.bfloat16)
    k = torch.full_like(q, 2.0)
    v = torch.full_like(q, 3.0)
    assert torch.all(m(q, k, v) == 6.0)
    assert torch.all(m(q, k, v) == 6.0)
    assert comm.allocs == [(1, 4, 2, 64)] * 2  # k and v, once for the shape
    m.reserve(1, 8, 2, 64)
    assert comm.allocs[2:] == [(1, 8, 2, 64)] * 2
