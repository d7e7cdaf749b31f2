"""tilewire.nn.RingAttention: context-parallel attention over tilewire.ring_attention (one
persistent kernel a rank, the peers' K/V shards read in place over NVLink).

Every rank holds its shard of the sequence (layout "zigzag": chunks r and 2W-1-r of 2W, so
causal work is balanced; "contiguous": positions [r S, (r + 1) S)) and calls forward(q, k, v)
with its shards, (batch, seq_local, heads, head_dim) bf16; it returns its queries' attention
over the whole sequence. The module holds no parameters (its state_dict is empty, as a torch
attention core's) and owns the symmetric K/V buffers the kernel reads from the peers: made
collectively on the first forward or by ``reserve(batch, seq_local, heads_kv, head_dim)``
(call it first for CUDA graphs and on virtual ranks), reallocated for a larger shape.
Forward only: tilewire has no attention backward yet, so forward refuses inputs that require
grad (use it under torch.no_grad() or for inference)."""

import torch
from torch import nn

from ._attention import ring_attention

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

    def extra_repr(self):
        return "world=%d, rank=%d, causal=%s, layout=%r" % (
            self.comm.size, self.comm.rank, self.causal, self.layout)

    def reserve(self, batch, seq_local, heads_kv, head_dim):
        """Makes the K/V buffers for shards of up to this shape (collective: every rank, in the
        same order, while no collective is in flight)."""
        self._buffers_for((batch, seq_local, heads_kv, head_dim))

    def release_buffers(self):
        """Drops the K/V buffers (collective, as their allocation)."""
        self._kv = None

    def _buffers_for(self, shape):
        shape = tuple(int(x) for x in shape)
        if self._kv is None or self._kv[0].shape != shape:
            self._kv = (self.comm.empty(shape, _BF16), self.comm.empty(shape, _BF16))
        return self._kv

    def forward(self, q, k, v):
        op = "tilewire.nn.RingAttention"
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError(
                "%s: no backward yet (tilewire has no attention backward); call it under "
                "torch.no_grad(), or on inputs that do not require grad" % op)
        for t, name in ((k, "k"), (v, "v")):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError("%s: %s must be a 4-D tensor (batch, seq_local, heads_kv, "
                                 "head_dim)" % (op, name))
        if k.shape != v.shape:
            raise ValueError("%s: k %s and v %s must have the same shape"
                             % (op, tuple(k.shape), tuple(v.shape)))
        kb, vb = self._buffers_for(k.shape)
        kb.copy_(k)
        vb.copy_(v)
        return ring_attention(self.comm, q.contiguous(), kb, vb, causal=self.causal,
                              layout=self.layout, softmax_scale=self.softmax_scale)
