"""tilewire.nn.RingAttention: context-parallel attention over tilewire.ring_attention (one
persistent kernel a rank, the peers' K/V shards read in place over NVLink).

Every rank holds its shard of the sequence (layout "zigzag": chunks r and 2W-1-r of 2W, so
causal work is balanced; "contiguous": positions [r S, (r + 1) S)) and calls forward(q, k, v)
with its shards, (batch, seq_local, heads, head_dim) bf16; it returns its queries' attention
over the whole sequence. The module holds no parameters (its state_dict is empty, as a torch
attention core's) and owns the symmetric buffers the kernels read from the peers: the K/V
buffers the forward copies k and v into (inside the op: tilewire::ring_attention_staged), and,
for inputs that require grad, the backward's (tilewire.ring_attention_grad_buffers: q, dout,
lse, workspace). They are made collectively on the first forward that needs them or by
``reserve(batch, seq_local, heads_kv, head_dim, heads_q=..., grad=...)`` (call it first for
CUDA graphs and on virtual ranks), and reallocated for another shape. Across nodes the comm's
gathered scratch (tilewire.ring_attention_reserve) is made with them.

Differentiable in q, k and v: the backward (tw_ring_attention_backward) is collective as the
forward, every rank running its own (with virtual ranks inside tilewire.for_each_rank). It
copies k and v into the K/V buffers again, so further forwards of the module before the
backward (micro-batches) are fine. Every copy into a symmetric buffer happens inside the op
that reads it, so torch.compile hands the ops the buffers themselves; with the buffers
reserved, forward and backward also capture into CUDA graphs."""

import torch
from torch import nn

from ._attention import (
    _needs_grad,
    _ring_staged,
    ring_attention_grad_buffers,
    ring_attention_reserve,
)

_BF16 = torch.bfloat16


class RingAttention(nn.Module):
    def __init__(self, comm, *, causal=True, layout="zigzag", softmax_scale=None):
        super().__init__()
        if layout not in ("zigzag", "contiguous"):
            raise ValueError("tilewire.nn.RingAttention: layout is %r; expected 'zigzag' or "
                             "'contiguous'" % (layout,))
        if not isinstance(causal, bool):
            raise TypeError("tilewire.nn.RingAttention: causal must be a bool, got %s"
                            % type(causal).__name__)
        self.comm, self.causal, self.layout = comm, causal, layout
        self.softmax_scale = softmax_scale
        self._kv = None  # the symmetric k and v buffers (collective)
        self._grad = None  # the backward's symmetric buffers (RingAttentionGradBuffers)

    def extra_repr(self):
        return "world=%d, rank=%d, causal=%s, layout=%r" % (
            self.comm.size, self.comm.rank, self.causal, self.layout)

    def reserve(self, batch, seq_local, heads_kv, head_dim, *, heads_q=None, grad=False):
        """Makes the K/V buffers for shards of this shape and, with grad=True, the backward's
        buffers for q of (batch, seq_local, heads_q, head_dim) (heads_q None: heads_kv); those
        also run the copy kernel a strided dout takes once, here, so that no backward inside
        the virtual ranks' loop loads its code (RingAttentionGradBuffers.warm). Collective:
        every rank, in the same order, while no collective is in flight."""
        self._buffers_for((batch, seq_local, heads_kv, head_dim))
        ring_attention_reserve(self.comm, int(batch), int(seq_local),
                               int(heads_kv if heads_q is None else heads_q), int(heads_kv),
                               int(head_dim))
        if grad:
            self._grad_buffers_for((batch, seq_local, heads_kv if heads_q is None else heads_q,
                                    head_dim))

    def release_buffers(self):
        """Drops the module's buffers (collective, as their allocation; a backward still
        pending keeps the ones it needs)."""
        self._kv = self._grad = None

    def _buffers_for(self, shape):
        shape = tuple(int(x) for x in shape)
        if self._kv is None or self._kv[0].shape != shape:
            self._kv = (self.comm.empty(shape, _BF16), self.comm.empty(shape, _BF16))
        return self._kv

    def _grad_buffers_for(self, q_shape):
        q_shape = tuple(int(x) for x in q_shape)
        if self._grad is None or self._grad.shape != q_shape:
            self._grad = ring_attention_grad_buffers(self.comm, *q_shape)
        return self._grad

    def forward(self, q, k, v):
        op = "tilewire.nn.RingAttention"
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            if not isinstance(t, torch.Tensor):
                raise TypeError("%s: %s must be a torch.Tensor, got %s"
                                % (op, name, type(t).__name__))
            if t.dim() != 4:
                raise ValueError("%s: %s must be 4-D (batch, seq_local, heads, head_dim), got "
                                 "shape %s" % (op, name, tuple(t.shape)))
        if k.shape != v.shape:
            raise ValueError("%s: k %s and v %s must have the same shape"
                             % (op, tuple(k.shape), tuple(v.shape)))
        if k.device != q.device or v.device != q.device:
            raise ValueError("%s: q, k and v must be on one device (%s, %s, %s)"
                             % (op, q.device, k.device, v.device))
        kb, vb = self._buffers_for(k.shape)
        if getattr(self.comm, "nodes", 1) > 1:  # the scratch the other nodes' shards are gathered into
            ring_attention_reserve(self.comm, *q.shape[:3], k.shape[2], q.shape[3])
        q = q.contiguous()
        grad = self._grad_buffers_for(q.shape) if _needs_grad(q, k, v) else None
        return _ring_staged(self.comm, q, k, v, kb, vb, self.causal, self.layout,
                            self.softmax_scale, grad)
