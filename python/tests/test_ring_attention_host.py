"""tilewire.ring_attention's argument checks, which need torch but no GPU (CPU tensors): each bad
argument raises TypeError / ValueError naming it before anything reaches the library."""

import ctypes

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from tilewire import _attention  # noqa: E402
from tilewire._comm import Comm  # noqa: E402

bf16 = torch.bfloat16


def _comm():
    c = Comm.__new__(Comm)  # a stand-in: the checks only ask whether it is an open Comm
    c._handle = ctypes.c_void_p(1)
    return c


def _qkv(b=1, s=200, hq=8, hk=2, d=64):
    q = torch.zeros(b, s, hq, d, dtype=bf16)
    k = torch.zeros(b, s, hk, d, dtype=bf16)
    return q, k, torch.zeros_like(k)


def _check(q, k, v, comm=None, causal=False, layout="zigzag", softmax_scale=None):
    return _attention._check_ring(comm if comm is not None else _comm(), q, k, v, causal, layout,
                                  softmax_scale)


def test_exported():
    assert tilewire.ring_attention is _attention.ring_attention
    assert "ring_attention" in tilewire.__all__


def test_good_shapes_pass():
    assert _check(*_qkv()) == (1, 200, 8, 2, 64)
    assert _check(*_qkv(s=77, d=128), layout="contiguous", causal=True) == (1, 77, 8, 2, 128)


def test_bad_arguments():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="comm"):
        _attention._check_ring(object(), q, k, v, False, "zigzag", None)
    with pytest.raises(ValueError, match="seq_local"):
        _check(*_qkv(s=77))
    with pytest.raises(ValueError, match="layout"):
        _check(q, k, v, layout="ring")
    with pytest.raises(ValueError, match="head_dim"):
        _check(*_qkv(d=96))
    with pytest.raises(ValueError, match="heads_q"):
        _check(*_qkv(hq=3))
    with pytest.raises(ValueError, match="seq_local"):
        _check(q, k[:, :100].contiguous(), v[:, :100].contiguous())
    with pytest.raises(TypeError, match="causal"):
        _check(q, k, v, causal=1)
    with pytest.raises(ValueError, match="softmax_scale"):
        _check(q, k, v, softmax_scale=-1.0)


def test_reserve_is_a_no_op_inside_one_node():
    """Inside one node ring_attention_reserve makes nothing (the kernels read the peers in place)
    and asks the library nothing; across nodes it names a bad size."""
    c = _comm()
    c.nodes, c.size = 1, 2
    assert tilewire.ring_attention_reserve(c, 1, 128, 8, 2, 64) is None
    assert getattr(c, "_ring_gathered", None) is None
    assert "ring_attention_reserve" in tilewire.__all__
    c.nodes = 2
    for args, name in (((0, 128, 8, 2, 64), "batch"), ((1, 128, 8, 2, True), "head_dim"),
                       ((1, 1.5, 8, 2, 64), "seq_local")):
        with pytest.raises(ValueError, match=name):
            tilewire.ring_attention_reserve(c, *args)


def test_gathered_scratch_required_across_nodes():
    """Across nodes a ring call without the comm's scratch is refused before the library,
    naming ring_attention_reserve and the shapes to give it."""
    c = _comm()
    c.nodes, c.size = 2, 4
    q, k, _ = _qkv()
    assert _attention._gathered_ptr(_comm_one_node(), q, k, "op") is None
    with pytest.raises(ValueError, match=r"ring_attention_reserve\(comm, batch=1, seq_local=200, "
                                         r"heads_q=8, heads_kv=2, head_dim=64\)"):
        _attention._gathered_ptr(c, q, k, "tilewire.ring_attention")


def _comm_one_node():
    c = _comm()
    c.nodes, c.size = 1, 2
    return c


def test_gathered_bytes_asked_once_a_shape(monkeypatch):
    """The scratch's size for a shard shape comes from the library once (a forward of the module
    across nodes checks it every call): the larger of the backward's and the forward's."""
    from tilewire import _attention_grad

    calls = []

    def fake_call(name, handle, b, hq, hk, s, d, size_ref):
        calls.append(name)
        size_ref._obj.value = 12345

    monkeypatch.setattr(_attention_grad._lib, "call", fake_call)
    c = _comm()
    c.nodes, c.size = 2, 4
    for _ in range(3):
        assert _attention_grad._gathered_bytes(c, 1, 1, 1, 1, 64) == max(12345, 2 * 4 * 64 * 2)
    assert _attention_grad._gathered_bytes(c, 1, 128, 8, 2, 64) == 2 * 4 * 128 * 2 * 64 * 2
    assert calls == ["tw_ring_attention_backward_gathered_bytes"] * 2
