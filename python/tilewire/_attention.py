"""tilewire.attention (tw_attention, single-GPU forward attention) and tilewire.ring_attention
(tw_ring_attention) over torch tensors laid out (batch, seq, heads, head_dim).

Each is a public function that checks its arguments (TypeError / ValueError naming the
argument, metadata only, so it also runs on torch.compile's fake tensors), allocates o (and
lse) and calls a mutating custom op (torch.ops.tilewire.attention / ring_attention, writing o
and lse) that launches on torch's current CUDA stream without host synchronisation: traceable
by torch.compile and capturable into CUDA graphs. An lse the caller did not ask for travels as
an empty tensor (the kernel then writes none).
"""

import ctypes
import math

import torch

from . import _lib
from ._eager import _call_mutating
from ._glue import (
    _check_aligned,
    _check_cuda,
    _check_dtype,
    _check_tensor,
    _custom_op,
    _on_device,
    _register_fake,
    _stream,
)

_OP = "tilewire.attention"
_HEAD_DIMS = (64, 128)


def _check_attention(q, k, v, causal, softmax_scale, q_offset, kv_offset):
    """The checks that need no GPU; returns (batch, seq_q, heads_q, seq_kv, heads_kv, d)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name, _OP)
        _check_dtype(t, name, _OP, (torch.bfloat16,))
        if t.dim() != 4:
            raise ValueError("%s: %s must be 4-D (batch, seq, heads, head_dim), got shape %s"
                             % (_OP, name, tuple(t.shape)))
        if not t.is_contiguous():
            raise ValueError("%s: %s must be contiguous (batch, seq, heads, head_dim)"
                             % (_OP, name))
    batch, seq_q, heads_q, d = q.shape
    _, seq_kv, heads_kv, _ = k.shape
    if k.shape != v.shape:
        raise ValueError("%s: k %s and v %s must have the same shape"
                         % (_OP, tuple(k.shape), tuple(v.shape)))
    if k.shape[0] != batch or k.shape[3] != d:
        raise ValueError("%s: k %s must match q %s in batch and head_dim"
                         % (_OP, tuple(k.shape), tuple(q.shape)))
    if d not in _HEAD_DIMS:
        raise ValueError("%s: head_dim is %d; expected 64 or 128" % (_OP, d))
    if min(batch, seq_q, heads_q, seq_kv, heads_kv) < 1:
        raise ValueError("%s: empty q %s or k %s" % (_OP, tuple(q.shape), tuple(k.shape)))
    if heads_q % heads_kv:
        raise ValueError("%s: heads_q (%d) must be a multiple of heads_kv (%d)"
                         % (_OP, heads_q, heads_kv))
    if q.device != k.device or q.device != v.device:
        raise ValueError("%s: q, k and v must be on one device (%s, %s, %s)"
                         % (_OP, q.device, k.device, v.device))
    if not isinstance(causal, bool):
        raise TypeError("%s: causal must be a bool, got %s" % (_OP, type(causal).__name__))
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError("%s: softmax_scale must be a float or None, got %s"
                            % (_OP, type(softmax_scale).__name__))
        if not (softmax_scale > 0 and math.isfinite(softmax_scale)):
            raise ValueError("%s: softmax_scale is %r; expected > 0 (or None: 1 / sqrt(head_dim))"
                             % (_OP, softmax_scale))
    for value, name in ((q_offset, "q_offset"), (kv_offset, "kv_offset")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("%s: %s must be an int, got %s" % (_OP, name, type(value).__name__))
        if value < 0 or value > 1 << 62:
            raise ValueError("%s: %s is %d; expected 0 .. 2^62" % (_OP, name, value))
    return batch, seq_q, heads_q, seq_kv, heads_kv, d


def attention(q, k, v, causal=False, softmax_scale=None, q_offset=0, kv_offset=0,
              return_lse=False):
    """Forward attention (tw_attention) on q's GPU:
    ``o[b, i, h] = softmax_j(scale * q[b, i, h] . k[b, j, h // g]) @ v[b, :, h // g]`` with
    g = heads_q // heads_kv (GQA / MQA).

    q: (batch, seq_q, heads_q, head_dim), k and v: (batch, seq_kv, heads_kv, head_dim), all
    contiguous bfloat16 CUDA tensors on one device; head_dim 64 or 128; heads_q a multiple of
    heads_kv. causal: key j is visible to query i iff kv_offset + j <= q_offset + i (the
    offsets: global positions of the shards' first rows; 0 and 0 for a whole sequence, where
    this is SDPA's is_causal with seq_q == seq_kv). softmax_scale: None for 1 / sqrt(head_dim).
    A row no key reaches gets zeros (and lse -inf).

    Returns o (batch, seq_q, heads_q, head_dim) bfloat16, and with return_lse also lse
    (batch, heads_q, seq_q) float32, the natural-log sum of exp of each row's scaled scores.
    Runs on torch's current CUDA stream; no host synchronisation. Not differentiable yet.
    """
    _check_attention(q, k, v, causal, softmax_scale, q_offset, kv_offset)
    _check_cuda(q, "q", _OP, None)
    o, lse = _outputs(q, return_lse)
    scale = float(softmax_scale or 0.0)
    _call_mutating(lambda *a: torch.ops.tilewire.attention(*a), _attention_impl,
                   (q, k, v, o, lse), (o, lse), q, k, v, o, lse, causal, scale, q_offset,
                   kv_offset)
    return (o, lse) if return_lse else o


def _outputs(q, return_lse):
    """o like q, and lse (batch, heads_q, seq) fp32, or an empty tensor where the caller did not
    ask for it (the kernel then writes none)."""
    batch, seq, heads_q, _ = q.shape
    lse = torch.empty((batch, heads_q, seq) if return_lse else (0,), dtype=torch.float32,
                      device=q.device)
    return torch.empty_like(q), lse


def _launch_fields(op, q, k, v, o, lse, causal, softmax_scale):
    """The args fields tw_attention and tw_ring_attention share, from real tensors: their data
    pointers (alignment checked here, at launch) and shapes."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_aligned(t, name, op)
    return dict(causal=int(causal), q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(),
                o=o.data_ptr(), lse=lse.data_ptr() if lse.numel() else None, batch=q.shape[0],
                heads_q=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3],
                softmax_scale=softmax_scale)


def _attention_impl(q, k, v, o, lse, causal, softmax_scale, q_offset, kv_offset):
    args = _lib.AttentionArgs(seq_q=q.shape[1], seq_kv=k.shape[1], q_offset=q_offset,
                              kv_offset=kv_offset,
                              **_launch_fields(_OP, q, k, v, o, lse, causal, softmax_scale))
    with _on_device(q.device.index):  # tw_attention runs on the current device
        _lib.call("tw_attention", ctypes.byref(args), _stream(q.device))


@_custom_op("tilewire::attention", mutates_args=("o", "lse"))
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, causal: bool, softmax_scale: float, q_offset: int,
                  kv_offset: int) -> None:
    _attention_impl(q, k, v, o, lse, causal, softmax_scale, q_offset, kv_offset)


@_register_fake(_attention_op)
def _attention_fake(q, k, v, o, lse, causal, softmax_scale, q_offset, kv_offset):
    return None


_RING_OP = "tilewire.ring_attention"
_LAYOUTS = {"contiguous": _lib.TW_RING_CONTIGUOUS, "zigzag": _lib.TW_RING_ZIGZAG}


def _check_ring(comm, q, k, v, causal, layout, softmax_scale):
    """The checks that need no GPU (beyond tilewire.attention's: the comm, the layout, zigzag's
    even shard); returns (batch, seq_local, heads_q, heads_kv, d)."""
    from ._glue import _check_comm

    _check_comm(comm, _RING_OP)
    batch, seq_q, heads_q, seq_kv, heads_kv, d = _check_attention(
        q, k, v, causal, softmax_scale, 0, 0)
    if seq_q != seq_kv:
        raise ValueError("%s: q's seq_local (%d) and k's (%d) must be equal (each rank's shard)"
                         % (_RING_OP, seq_q, seq_kv))
    if layout not in _LAYOUTS:
        raise ValueError("%s: layout is %r; expected 'zigzag' or 'contiguous'"
                         % (_RING_OP, layout))
    if layout == "zigzag" and seq_q % 2:
        raise ValueError("%s: seq_local is %d; layout='zigzag' needs it even (two chunks)"
                         % (_RING_OP, seq_q))
    return batch, seq_q, heads_q, heads_kv, d


def ring_attention(comm, q, k, v, causal=False, layout="zigzag", softmax_scale=None,
                   return_lse=False):
    """Ring (context-parallel) attention inside one node (tw_ring_attention), collective over
    comm: every rank passes its shard q, k, v (batch, seq_local, heads, head_dim), bf16,
    contiguous; k and v from comm.empty (symmetric: the kernel reads the peers' in place).
    layout 'contiguous': rank r holds positions [r S, (r + 1) S); 'zigzag' (S even): chunks r
    and 2W - 1 - r of S / 2 positions. Returns this rank's queries' attention over the whole
    sequence (causal by global position), and with return_lse the lse
    (batch, heads_q, seq_local) float32. Runs on torch's current stream; not differentiable."""
    _check_ring(comm, q, k, v, causal, layout, softmax_scale)
    _check_cuda(q, "q", _RING_OP, None)
    o, lse = _outputs(q, return_lse)
    scale = float(softmax_scale or 0.0)
    _call_mutating(lambda *a: torch.ops.tilewire.ring_attention(*a), _ring_impl,
                   (q, k, v, o, lse), (o, lse), comm.id, q, k, v, o, lse, causal, layout, scale)
    return (o, lse) if return_lse else o


def _ring_impl(comm_id, q, k, v, o, lse, causal, layout, softmax_scale):
    from ._comm import comm_by_id

    args = _lib.RingAttentionArgs(
        seq_local=q.shape[1], layout=_LAYOUTS[layout],
        **_launch_fields(_RING_OP, q, k, v, o, lse, causal, softmax_scale))
    _lib.call("tw_ring_attention", comm_by_id(comm_id).handle, ctypes.byref(args),
              _stream(q.device))


@_custom_op("tilewire::ring_attention", mutates_args=("o", "lse"))
def _ring_op(comm_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, causal: bool, layout: str, softmax_scale: float) -> None:
    _ring_impl(comm_id, q, k, v, o, lse, causal, layout, softmax_scale)


@_register_fake(_ring_op)
def _ring_fake(comm_id, q, k, v, o, lse, causal, layout, softmax_scale):
    return None
