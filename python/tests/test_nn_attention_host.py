"""tilewire.nn.RingAttention on the host: construction, its refusals (layout, causal, q, k and v
types and shapes), an empty state_dict, and forward through a stand-in of the ring call: the
K/V shards handed over with the module's buffers (which are made once per shape), and, for
inputs that require grad, the backward's buffers (made once per q shape, or by
reserve(grad=True))."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from tilewire import _nn_attention  # noqa: E402
from _host import FakeComm  # noqa: E402

bf16 = torch.bfloat16


class _StandIn:
    """_ring_staged's stand-in: k and v copied into the buffers as the op does, then q plus the
    buffers' means; records the buffers it was handed."""

    def __init__(self):
        self.calls = []

    def __call__(self, comm, q, k, v, k_buf, v_buf, causal, layout, softmax_scale, grad):
        self.calls.append((k_buf, v_buf, grad, causal, layout))
        with torch.no_grad():  # the op's copies: no autograd history on the buffers
            k_buf.copy_(k)
            v_buf.copy_(v)
        return q + k_buf.float().mean().to(q.dtype) + v_buf.float().mean().to(q.dtype)


def test_refusals():
    comm = FakeComm(rank=0, size=2)
    with pytest.raises(ValueError, match="layout"):
        tilewire.nn.RingAttention(comm, layout="ring")
    with pytest.raises(TypeError, match="causal"):
        tilewire.nn.RingAttention(comm, causal=1)
    m = tilewire.nn.RingAttention(comm)
    assert m.state_dict() == {}
    x = torch.zeros(1, 4, 2, 64, dtype=bf16)
    with pytest.raises(ValueError, match="same shape"):
        m(x, x, x[:, :2])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        m(None, x, x)
    with pytest.raises(ValueError, match="v must be 4-D"):
        m(x, x, x[0])
    with pytest.raises(ValueError, match="one device"):
        m(x, x.to("meta"), x)
    assert comm.allocs == []  # refused before any buffer is made


def test_forward_hands_the_shards_and_its_buffers_over(monkeypatch):
    ring = _StandIn()
    monkeypatch.setattr(_nn_attention, "_ring_staged", ring)
    comm = FakeComm(rank=1, size=2)
    m = tilewire.nn.RingAttention(comm, causal=False, layout="contiguous")
    q = torch.ones(1, 4, 2, 64, dtype=bf16)
    k = torch.full_like(q, 2.0)
    v = torch.full_like(q, 3.0)
    assert torch.all(m(q, k, v) == 6.0)
    assert torch.all(m(q, k, v) == 6.0)
    assert comm.allocs == [(1, 4, 2, 64)] * 2  # k and v, once for the shape
    for k_buf, v_buf, grad, causal, layout in ring.calls:
        assert k_buf is m._kv[0] and v_buf is m._kv[1]
        assert grad is None and (causal, layout) == (False, "contiguous")
    m.reserve(1, 8, 2, 64)
    assert comm.allocs[2:] == [(1, 8, 2, 64)] * 2


def test_inputs_that_require_grad_get_the_backward_buffers(monkeypatch):
    ring = _StandIn()
    monkeypatch.setattr(_nn_attention, "_ring_staged", ring)
    comm = FakeComm(rank=0, size=2)
    m = tilewire.nn.RingAttention(comm)
    q = torch.ones(1, 4, 8, 64, dtype=bf16)
    k = torch.ones(1, 4, 2, 64, dtype=bf16, requires_grad=True)
    m(q, k, k.detach())
    m(q, k, k.detach())
    # K/V, then the backward's q, dout (heads_q 8) and lse, workspace: once for the shape
    assert comm.allocs == [(1, 4, 2, 64)] * 2 + [(1, 4, 8, 64)] * 2 + [(1, 8, 4)] * 2
    grad = ring.calls[-1][2]
    assert grad is m._grad and grad.shape == (1, 4, 8, 64)
    with torch.no_grad():
        m(q, k, k.detach())
    assert ring.calls[-1][2] is None
    m.release_buffers()
    assert m._kv is None and m._grad is None


def test_reserve_with_grad():
    comm = FakeComm(rank=0, size=2)
    m = tilewire.nn.RingAttention(comm)
    m.reserve(2, 16, 2, 128, heads_q=8, grad=True)
    assert comm.allocs == [(2, 16, 2, 128)] * 2 + [(2, 16, 8, 128)] * 2 + [(2, 8, 16)] * 2
    assert m._grad.shape == (2, 16, 8, 128)
    m.reserve(2, 16, 2, 128, heads_q=8, grad=True)  # the same shapes: nothing new
    assert len(comm.allocs) == 6
    m.reserve(1, 8, 4, 64, grad=True)  # heads_q defaults to heads_kv
    assert comm.allocs[6:] == [(1, 8, 4, 64)] * 4 + [(1, 4, 8)] * 2
