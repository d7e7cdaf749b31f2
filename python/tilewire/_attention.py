"""tilewire.attention (tw_attention, single-GPU attention) and tilewire.ring_attention
(tw_ring_attention) over torch tensors laid out (batch, seq, heads, head_dim), with their
backward passes (tw_attention_backward, tw_ring_attention_backward: _attention_grad).

Each is a public function that checks its arguments (TypeError / ValueError naming the
argument, metadata only, so it also runs on torch.compile's fake tensors), allocates o (and
lse) and calls a mutating custom op (torch.ops.tilewire.attention / ring_attention /
ring_attention_staged, writing o and lse) that launches on torch's current CUDA stream without
host synchronisation: traceable by torch.compile and capturable into CUDA graphs. An lse the
caller did not ask for travels as an empty tensor (the kernel then writes none).

When q, k or v requires grad, the call goes through a torch.autograd.Function instead: its
forward runs the same custom op with lse always computed (the backward reads it) and saves
q, k, v, o and lse; its backward calls torch.ops.tilewire.attention_backward /
ring_attention_backward on the stream autograd runs it on (the forward's). lse is returned
non-differentiable.
"""

import ctypes
import math

import torch

from . import _lib
from ._attention_grad import (
    _LAYOUTS,
    _attention_backward_impl,
    _grads,
    _bf16_dout,
    _check_grad_buffers,
    _dq_accum,
    _gathered_ptr,
    ring_attention_reserve,
    _ring_backward_impl,
    _stage,
    _workspace,
    ring_attention_grad_buffers,
)
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

__all__ = ["attention", "ring_attention", "ring_attention_grad_buffers", "ring_attention_reserve"]

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


def _needs_grad(*tensors):
    """Whether autograd records a call on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def attention(q, k, v, causal=False, softmax_scale=None, q_offset=0, kv_offset=0,
              return_lse=False, deterministic=True):
    """Attention (tw_attention) on q's GPU:
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
    Runs on torch's current CUDA stream; no host synchronisation.

    Differentiable in q, k and v (when any requires grad): the forward then also computes lse
    and keeps q, k, v, o and lse for the backward, which is tw_attention_backward (dq, dk, dv
    in bf16, fp32 sums, the same bits on every call; a kv head's dk and dv summed over its
    group's q heads) on the stream autograd runs it on, with no host synchronisation: eager,
    under torch.compile and in CUDA graphs. lse is not differentiable (returned detached).
    deterministic=False takes the one-pass backward (dq's sums in the kernel of dk and dv, added
    into an fp32 scratch in no fixed order: faster, dq within the same tolerance but not the
    same bits on every call; dk and dv still are); it is ignored while
    torch.use_deterministic_algorithms is on.
    """
    _check_attention(q, k, v, causal, softmax_scale, q_offset, kv_offset)
    _check_cuda(q, "q", _OP, None)
    scale = float(softmax_scale or 0.0)
    if _needs_grad(q, k, v):
        deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
        o, lse = _AttentionFunction.apply(q, k, v, causal, scale, q_offset, kv_offset,
                                          bool(deterministic))
        return (o, lse) if return_lse else o
    o, lse = _outputs(q, return_lse)
    _attention_run(q, k, v, o, lse, causal, scale, q_offset, kv_offset)
    return (o, lse) if return_lse else o


def _attention_run(q, k, v, o, lse, causal, softmax_scale, q_offset, kv_offset):
    _call_mutating(lambda *a: torch.ops.tilewire.attention(*a), _attention_impl,
                   (q, k, v, o, lse), (o, lse), q, k, v, o, lse, causal, softmax_scale,
                   q_offset, kv_offset)


class _AttentionFunction(torch.autograd.Function):
    """(o, lse) = attention(q, k, v); backward: tilewire::attention_backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, q_offset, kv_offset, deterministic):
        o, lse = _outputs(q, True)
        _attention_run(q, k, v, o, lse, causal, softmax_scale, q_offset, kv_offset)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        ctx.q_offset, ctx.kv_offset = q_offset, kv_offset
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dout = _bf16_dout(dout)
        (dq, dk, dv), workspace = _grads(q, k), _workspace(q)
        dq_accum = _dq_accum(q, ctx.deterministic)
        _call_mutating(lambda *a: torch.ops.tilewire.attention_backward(*a),
                       _attention_backward_impl,
                       (q, k, v, o, dout, lse, dq, dk, dv, workspace, dq_accum),
                       (dq, dk, dv, workspace, dq_accum), q, k, v, o, dout, lse, dq, dk, dv,
                       workspace, dq_accum, ctx.causal, ctx.softmax_scale, ctx.q_offset,
                       ctx.kv_offset)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                None, None, None, None, None)


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
                   return_lse=False, *, grad_buffers=None):
    """Ring (context-parallel) attention (tw_ring_attention), collective over comm: every rank
    passes its shard q, k, v (batch, seq_local, heads, head_dim), bf16, contiguous; k and v
    from comm.empty (symmetric: the kernel reads the node's peers' in place). Across nodes the
    other nodes' shards are gathered first into the comm's scratch, which
    tilewire.ring_attention_reserve makes (collectively, once).
    layout 'contiguous': rank r holds positions [r S, (r + 1) S); 'zigzag' (S even): chunks r
    and 2W - 1 - r of S / 2 positions. Returns this rank's queries' attention over the whole
    sequence (causal by global position), and with return_lse the lse
    (batch, heads_q, seq_local) float32. Runs on torch's current stream.

    Differentiable in q, k and v (when any requires grad): the backward is
    tw_ring_attention_backward, collective as the forward (every rank runs its backward:
    with virtual ranks inside tilewire.for_each_rank), each rank's dq, dk and dv the gradients
    of its shard over the whole sequence. Its kernels read the peers' q, dout and lse in place,
    so they are copied into symmetric buffers first: grad_buffers, from
    tilewire.ring_attention_grad_buffers(comm, batch, seq_local, heads_q, head_dim), needed
    then (made once, collectively, and reusable by every call of that shape); k and v are read
    where they are (keep them unmodified until the backward: autograd checks). lse is not
    differentiable.
    """
    _check_ring(comm, q, k, v, causal, layout, softmax_scale)
    _check_cuda(q, "q", _RING_OP, None)
    return _ring_call(comm, q, k, v, None, causal, layout, softmax_scale, return_lse,
                      grad_buffers)


def _ring_staged(comm, q, k, v, k_buf, v_buf, causal, layout, softmax_scale, grad_buffers):
    """tilewire.ring_attention of k and v copied into the symmetric k_buf and v_buf inside the
    op (tilewire.nn.RingAttention's forward), checked as ring_attention checks its k and v."""
    _check_ring(comm, q, k_buf, v_buf, causal, layout, softmax_scale)
    _check_cuda(q, "q", _RING_OP, None)
    return _ring_call(comm, q, k, v, (k_buf, v_buf), causal, layout, softmax_scale, False,
                      grad_buffers)


def _ring_call(comm, q, k, v, staging, causal, layout, softmax_scale, return_lse, grad_buffers):
    """staging: None (k and v are symmetric, read in place) or the symmetric (k_buf, v_buf)
    that the op copies k and v into first."""
    scale = float(softmax_scale or 0.0)
    if _needs_grad(q, k, v):
        _check_grad_buffers(_RING_OP, comm, grad_buffers, q)
        spec = _RingSpec(comm.id, staging, grad_buffers, causal, layout, scale)
        o, lse = _RingAttentionFunction.apply(q, k, v, spec)
    else:
        o, lse = _outputs(q, return_lse)
        _ring_run(comm.id, q, k, v, staging, o, lse, causal, layout, scale)
    return (o, lse) if return_lse else o


def _ring_run(comm_id, q, k, v, staging, o, lse, causal, layout, softmax_scale):
    if staging is None:
        _call_mutating(lambda *a: torch.ops.tilewire.ring_attention(*a), _ring_impl,
                       (q, k, v, o, lse), (o, lse), comm_id, q, k, v, o, lse, causal, layout,
                       softmax_scale)
        return
    k_buf, v_buf = staging
    _call_mutating(lambda *a: torch.ops.tilewire.ring_attention_staged(*a), _ring_staged_impl,
                   (q, k, v, k_buf, v_buf, o, lse), (k_buf, v_buf, o, lse), comm_id, q, k, v,
                   k_buf, v_buf, o, lse, causal, layout, softmax_scale)


def _ring_impl(comm_id, q, k, v, o, lse, causal, layout, softmax_scale):
    from ._comm import comm_by_id

    comm = comm_by_id(comm_id)
    args = _lib.RingAttentionArgs(
        seq_local=q.shape[1], layout=_LAYOUTS[layout], gathered=_gathered_ptr(comm, q, k, _RING_OP),
        **_launch_fields(_RING_OP, q, k, v, o, lse, causal, softmax_scale))
    _lib.call("tw_ring_attention", comm.handle, ctypes.byref(args), _stream(q.device))


@_custom_op("tilewire::ring_attention", mutates_args=("o", "lse"))
def _ring_op(comm_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, causal: bool, layout: str, softmax_scale: float) -> None:
    _ring_impl(comm_id, q, k, v, o, lse, causal, layout, softmax_scale)


@_register_fake(_ring_op)
def _ring_fake(comm_id, q, k, v, o, lse, causal, layout, softmax_scale):
    return None


def _ring_staged_impl(comm_id, q, k, v, k_buf, v_buf, o, lse, causal, layout, softmax_scale):
    _stage(k_buf, k)
    _stage(v_buf, v)
    _ring_impl(comm_id, q, k_buf, v_buf, o, lse, causal, layout, softmax_scale)


# The copies into k_buf and v_buf are inside the op, whose mutated arguments the buffers are:
# under torch.compile a copy_ traced before tilewire::ring_attention is functionalized, and
# inductor then hands the op the copy's source (not symmetric memory); a buffer the op mutates
# is passed as itself (inductor re-inplaces a mutated graph input).
@_custom_op("tilewire::ring_attention_staged", mutates_args=("k_buf", "v_buf", "o", "lse"))
def _ring_staged_op(comm_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_buf: torch.Tensor, v_buf: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, causal: bool, layout: str, softmax_scale: float) -> None:
    _ring_staged_impl(comm_id, q, k, v, k_buf, v_buf, o, lse, causal, layout, softmax_scale)


@_register_fake(_ring_staged_op)
def _ring_staged_fake(comm_id, q, k, v, k_buf, v_buf, o, lse, causal, layout, softmax_scale):
    return None


class _RingSpec:
    """What a ring attention autograd node keeps of its call besides q, k and v."""

    def __init__(self, comm_id, staging, grad_buffers, causal, layout, softmax_scale):
        self.comm_id, self.staging, self.grad_buffers = comm_id, staging, grad_buffers
        self.causal, self.layout, self.softmax_scale = causal, layout, softmax_scale


class _RingAttentionFunction(torch.autograd.Function):
    """(o, lse) = ring_attention(q, k, v); backward: tilewire::ring_attention_backward, which
    copies q, dout and lse into spec.grad_buffers, and k and v into spec.staging's buffers
    where the forward staged them (their content may have changed since: another forward of
    the module), before its kernels read every rank's."""

    @staticmethod
    def forward(ctx, q, k, v, spec):
        o, lse = _outputs(q, True)
        _ring_run(spec.comm_id, q, k, v, spec.staging, o, lse, spec.causal, spec.layout,
                  spec.softmax_scale)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        s, g = ctx.spec, ctx.spec.grad_buffers
        k_buf, v_buf = s.staging or (None, None)
        dq, dk, dv = _grads(q, k)
        bufs = (g.q, k_buf, v_buf, g.dout, g.lse, g.workspace)
        mutated = tuple(t for t in bufs if t is not None) + (dq, dk, dv)
        _call_mutating(lambda *a: torch.ops.tilewire.ring_attention_backward(*a),
                       _ring_backward_impl, (q, k, v, o, dout, lse) + bufs + (dq, dk, dv),
                       mutated, s.comm_id, q, k, v, o, dout, lse, *bufs, dq, dk, dv, s.causal,
                       s.layout, s.softmax_scale)
        need = ctx.needs_input_grad
        return dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None
