"""The backward passes of tilewire.attention and tilewire.ring_attention (tilewire.h:
tw_attention_backward, tw_ring_attention_backward), as mutating custom ops on torch's current
stream with no host synchronisation, and the symmetric buffers the ring's backward stages its
operands in.

    tilewire::attention_backward       writes dq, dk, dv and the fp32 workspace (dsum), and
                                       with a dq_accum the one-pass backward's fp32 dq sums
    tilewire::ring_attention_backward  copies q, dout and lse into symmetric buffers (and k,
                                       v into the buffers the forward staged them in, where it
                                       did), then writes dq, dk, dv and the symmetric fp32
                                       workspace

The copies happen inside the ring's op, so that torch.compile hands the op the symmetric
buffers themselves (a copy_ traced before the op would be functionalized, and inductor would
pass the copy's source, which the library refuses as not symmetric). The autograd Functions
that call these ops are in _attention.
"""

import ctypes
from typing import Optional

import torch

from . import _lib
from ._glue import (
    _check_aligned,
    _custom_op,
    _on_device,
    _register_fake,
    _stream,
)

_BF16 = torch.bfloat16
_FP32 = torch.float32
_LAYOUTS = {"contiguous": _lib.TW_RING_CONTIGUOUS, "zigzag": _lib.TW_RING_ZIGZAG}


def _backward_fields(op, q, k, v, o, dout, lse, dq, dk, dv, workspace, causal, softmax_scale):
    """The fields tw_attention_backward_args_t and tw_ring_attention_backward_args_t share, from
    real tensors: their data pointers (alignment checked here, at launch) and shapes."""
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (dout, "dout"), (dq, "dq"),
                    (dk, "dk"), (dv, "dv")):
        _check_aligned(t, name, op)
    return dict(causal=int(causal), q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(),
                o=o.data_ptr(), dout=dout.data_ptr(), lse=lse.data_ptr(), dq=dq.data_ptr(),
                dk=dk.data_ptr(), dv=dv.data_ptr(), workspace=workspace.data_ptr(),
                batch=q.shape[0], heads_q=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3],
                softmax_scale=softmax_scale)


def _grads(q, k):
    """dq (q's shape), dk and dv (k's shape): contiguous bf16 on q's device, as the kernels
    write them (autograd casts them to k's and v's dtype where those differ)."""
    dev = q.device
    return (torch.empty(q.shape, dtype=_BF16, device=dev),
            torch.empty(k.shape, dtype=_BF16, device=dev),
            torch.empty(k.shape, dtype=_BF16, device=dev))


def _workspace(q):
    """tw_attention_backward's fp32 dsum workspace [batch, heads_q, seq_q]."""
    batch, seq, heads_q, _ = q.shape
    return torch.empty((batch, heads_q, seq), dtype=_FP32, device=q.device)


def _bf16_dout(dout):
    """The gradient of o as the kernels read it: bf16, contiguous (autograd may hand over an
    expanded or strided tensor)."""
    return (dout if dout.dtype == _BF16 else dout.to(_BF16)).contiguous()


# ---- tilewire::attention_backward ---------------------------------------------------------

_OP = "tilewire.attention (backward)"


def _dq_accum(q, deterministic):
    """The one-pass backward's fp32 scratch (batch x heads_q x round_up(seq_q, 128) x head_dim),
    or, deterministic, an empty tensor (the default three-kernel backward, bitwise repeatable)."""
    batch, seq, heads_q, head_dim = q.shape
    n = 0 if deterministic else batch * heads_q * ((seq + 127) // 128 * 128) * head_dim
    return torch.empty((n,), dtype=_FP32, device=q.device)


def _attention_backward_impl(q, k, v, o, dout, lse, dq, dk, dv, workspace, dq_accum, causal,
                             softmax_scale, q_offset, kv_offset):
    args = _lib.AttentionBackwardArgs(
        seq_q=q.shape[1], seq_kv=k.shape[1], q_offset=q_offset, kv_offset=kv_offset,
        dq_accum=dq_accum.data_ptr() if dq_accum.numel() else None,
        **_backward_fields(_OP, q, k, v, o, dout, lse, dq, dk, dv, workspace, causal,
                           softmax_scale))
    with _on_device(q.device.index):  # tw_attention_backward runs on the current device
        _lib.call("tw_attention_backward", ctypes.byref(args), _stream(q.device))


@_custom_op("tilewire::attention_backward",
            mutates_args=("dq", "dk", "dv", "workspace", "dq_accum"))
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                           dout: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor,
                           dk: torch.Tensor, dv: torch.Tensor, workspace: torch.Tensor,
                           dq_accum: torch.Tensor, causal: bool, softmax_scale: float,
                           q_offset: int, kv_offset: int) -> None:
    _attention_backward_impl(q, k, v, o, dout, lse, dq, dk, dv, workspace, dq_accum, causal,
                             softmax_scale, q_offset, kv_offset)


@_register_fake(_attention_backward_op)
def _attention_backward_fake(q, k, v, o, dout, lse, dq, dk, dv, workspace, dq_accum, causal,
                             softmax_scale, q_offset, kv_offset):
    return None


# ---- the ring's symmetric buffers ---------------------------------------------------------


class RingAttentionGradBuffers:
    """The symmetric buffers of comm that tilewire.ring_attention's backward stages its
    operands in (the backward kernels read the peers' in place): q and dout, bf16
    [batch, seq_local, heads_q, head_dim]; lse and workspace (dsum), fp32
    [batch, heads_q, seq_local]. Made by tilewire.ring_attention_grad_buffers (collective).

    The backward copies into them at its start and, when it returns in stream order, every
    peer has finished reading them, so one set may serve every ring_attention call of its
    shape whose backward runs in stream order after the others' (the layers of a model)."""

    def __init__(self, comm, batch, seq_local, heads_q, head_dim):
        self.comm = comm
        q_shape, rows = (batch, seq_local, heads_q, head_dim), (batch, heads_q, seq_local)
        self.q, self.dout = comm.empty(q_shape, _BF16), comm.empty(q_shape, _BF16)
        self.lse, self.workspace = comm.empty(rows, _FP32), comm.empty(rows, _FP32)

    @property
    def shape(self):
        """(batch, seq_local, heads_q, head_dim): the q the buffers are for."""
        return tuple(self.q.shape)

    def warm(self):
        """Copies zeros into dout through the strided bf16 copy kernel a non-contiguous dout
        takes, so that with CUDA's lazy module loading the backward's first such copy does not
        load that kernel's code: loading may wait for the device to go idle, which on virtual
        ranks it never does while a rank's collective kernel waits for the next rank's launch
        (tilewire.for_each_rank)."""
        zero = torch.zeros((), dtype=_BF16, device=self.dout.device)
        self.dout.copy_(zero.expand(self.dout.shape))

    def tensors(self):
        """(q, dout, lse, workspace), in the backward op's argument order."""
        return self.q, self.dout, self.lse, self.workspace


def ring_attention_grad_buffers(comm, batch, seq_local, heads_q, head_dim):
    """The symmetric buffers the backward of tilewire.ring_attention needs when q, k or v
    require grad (a RingAttentionGradBuffers; pass it as ring_attention's grad_buffers):
    collective like comm.empty (every rank, in the same order, while no collective is in
    flight: with virtual ranks before tilewire.for_each_rank, not inside it). Make them once
    and reuse them."""
    op = "tilewire.ring_attention_grad_buffers"
    for value, name in ((batch, "batch"), (seq_local, "seq_local"), (heads_q, "heads_q"),
                        (head_dim, "head_dim")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("%s: %s must be a positive int, got %r" % (op, name, value))
    buffers = RingAttentionGradBuffers(comm, batch, seq_local, heads_q, head_dim)
    buffers.warm()
    return buffers


def _check_grad_buffers(op, comm, buffers, q):
    """grad_buffers of a ring_attention call whose inputs require grad (metadata only)."""
    if buffers is None:
        raise ValueError(
            "%s: q, k or v requires grad, and the backward stages its operands in symmetric "
            "memory: pass grad_buffers=tilewire.ring_attention_grad_buffers(comm, %d, %d, %d, "
            "%d) (collective; made once and reused)" % ((op,) + tuple(q.shape)))
    if not isinstance(buffers, RingAttentionGradBuffers):
        raise TypeError("%s: grad_buffers must come from tilewire.ring_attention_grad_buffers, "
                        "got %s" % (op, type(buffers).__name__))
    if buffers.comm is not comm:
        raise ValueError("%s: grad_buffers belong to another comm" % op)
    if buffers.shape != tuple(q.shape):
        raise ValueError("%s: grad_buffers are for q of shape %s, but q is %s"
                         % (op, buffers.shape, tuple(q.shape)))


# ---- tilewire::ring_attention_backward ----------------------------------------------------

_RING_OP = "tilewire.ring_attention (backward)"


def _stage(dst, src):
    """dst.copy_(src), unless src is dst (a staging buffer handed over as the source)."""
    if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride() \
            or src.dtype != dst.dtype:
        dst.copy_(src)


def _gathered_bytes(comm, batch, seq_local, heads_q, heads_kv, head_dim):
    """The bytes of the gathered scratch that ring calls (forward and backward) of this shard
    shape need on comm across nodes, asked of the library once a shape and kept on the comm."""
    key = (batch, seq_local, heads_q, heads_kv, head_dim)
    known = comm.__dict__.setdefault("_ring_gathered_bytes", {})
    if key not in known:
        size = ctypes.c_size_t(0)
        _lib.call("tw_ring_attention_backward_gathered_bytes", comm.handle, batch, heads_q,
                  heads_kv, seq_local, head_dim, ctypes.byref(size))
        forward = 2 * comm.size * batch * seq_local * heads_kv * head_dim * 2
        known[key] = max(size.value, forward)
    return known[key]


def ring_attention_reserve(comm, batch, seq_local, heads_q, heads_kv, head_dim):
    """Across nodes (comm.nodes > 1): makes the comm's symmetric scratch that tilewire.
    ring_attention and its backward gather the other nodes' shards into (tw_ring_attention's
    and tw_ring_attention_backward's `gathered`) for shards of up to this shape; collective
    like comm.empty (every rank, in the same order, while no collective is in flight: with
    virtual ranks before tilewire.for_each_rank). Inside one node it makes nothing. Every ring
    call of the comm shares the scratch: each call's gather starts only once every rank has
    entered it, after its earlier calls' reads."""
    if getattr(comm, "nodes", 1) == 1:
        return
    for value, name in ((batch, "batch"), (seq_local, "seq_local"), (heads_q, "heads_q"),
                        (heads_kv, "heads_kv"), (head_dim, "head_dim")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("tilewire.ring_attention_reserve: %s must be an int >= 1, got %r"
                             % (name, value))
    need = _gathered_bytes(comm, batch, seq_local, heads_q, heads_kv, head_dim)
    have = getattr(comm, "_ring_gathered", None)
    if have is None or have.numel() < need:
        comm._ring_gathered = comm.empty((need,), torch.uint8)


def _gathered_ptr(comm, q, k, op):
    """Across nodes the data pointer of the comm's gathered scratch (ring_attention_reserve),
    checked against what a ring call of these shards needs; inside one node None."""
    if getattr(comm, "nodes", 1) == 1:
        return None
    buf = getattr(comm, "_ring_gathered", None)
    batch, seq, heads_q, d = q.shape
    heads_kv = k.shape[2]
    if buf is None or buf.numel() < _gathered_bytes(comm, batch, seq, heads_q, heads_kv, d):
        raise ValueError(
            "%s: the comm spans %d nodes: reserve its gathered scratch first, collectively: "
            "tilewire.ring_attention_reserve(comm, batch=%d, seq_local=%d, heads_q=%d, "
            "heads_kv=%d, head_dim=%d)" % (op, comm.nodes, batch, seq, heads_q, heads_kv, d))
    return buf.data_ptr()


def _ring_backward_impl(comm_id, q, k, v, o, dout, lse, q_buf, k_buf, v_buf, dout_buf,
                        lse_buf, workspace, dq, dk, dv, causal, layout, softmax_scale):
    from ._comm import comm_by_id

    _stage(q_buf, q)
    _stage(dout_buf, dout)
    _stage(lse_buf, lse)
    if k_buf is not None:
        _stage(k_buf, k)
        k = k_buf
    if v_buf is not None:
        _stage(v_buf, v)
        v = v_buf
    comm = comm_by_id(comm_id)
    args = _lib.RingAttentionBackwardArgs(
        seq_local=q.shape[1], layout=_LAYOUTS[layout],
        gathered=_gathered_ptr(comm, q_buf, k, _RING_OP),
        **_backward_fields(_RING_OP, q_buf, k, v, o, dout_buf, lse_buf, dq, dk, dv, workspace,
                           causal, softmax_scale))
    _lib.call("tw_ring_attention_backward", comm.handle, ctypes.byref(args), _stream(q.device))


@_custom_op("tilewire::ring_attention_backward",
            mutates_args=("q_buf", "k_buf", "v_buf", "dout_buf", "lse_buf", "workspace", "dq",
                          "dk", "dv"))
def _ring_backward_op(comm_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      o: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                      q_buf: torch.Tensor, k_buf: Optional[torch.Tensor],
                      v_buf: Optional[torch.Tensor], dout_buf: torch.Tensor,
                      lse_buf: torch.Tensor, workspace: torch.Tensor, dq: torch.Tensor,
                      dk: torch.Tensor, dv: torch.Tensor, causal: bool, layout: str,
                      softmax_scale: float) -> None:
    _ring_backward_impl(comm_id, q, k, v, o, dout, lse, q_buf, k_buf, v_buf, dout_buf, lse_buf,
                        workspace, dq, dk, dv, causal, layout, softmax_scale)


@_register_fake(_ring_backward_op)
def _ring_backward_fake(comm_id, q, k, v, o, dout, lse, q_buf, k_buf, v_buf, dout_buf, lse_buf,
                        workspace, dq, dk, dv, causal, layout, softmax_scale):
    return None
