"""tilewire.nn's expert-parallel MoE layer over tilewire.moe_ffn, and the plain PyTorch layer
its state_dict loads into and from (module docstrings below)."""

import math

import torch
from torch import nn
from torch.nn import functional as F

from ._glue import _positive_int, _world_and_rank
from ._moe import moe_ffn, moe_recv_rows, moe_workspace

__all__ = ["ExpertParallelMoE", "TorchMoE", "full_moe_init"]

_BF16 = torch.bfloat16


def _check_shape(op, hidden, inter, experts, top_k):
    for value, name in ((hidden, "hidden"), (inter, "inter"), (experts, "experts"),
                        (top_k, "top_k")):
        _positive_int(value, name, op)
    for value, name in ((hidden, "hidden"), (inter, "inter")):
        if value % 8:
            raise ValueError("%s: %s=%d must be a multiple of 8 (the kernels move 16-byte "
                             "vectors)" % (op, name, value))
    if top_k > experts or top_k > 16:
        raise ValueError("%s: top_k=%d must be at most experts (%d) and 16"
                         % (op, top_k, experts))
    if experts > 1024:
        raise ValueError("%s: experts=%d; at most 1024" % (op, experts))


def full_moe_init(hidden, inter, experts, init_seed=0):
    """The full fp32 CPU tensors of an MoE layer that both layers' reset_parameters take:
    the router [experts, hidden], then per expert gate_proj [inter, hidden], up_proj [inter,
    hidden] and down_proj [hidden, inter], each drawn as torch.nn.Linear(bias=False) draws its
    weight (kaiming_uniform_(a=sqrt(5))), in that order, from one torch.Generator seeded with
    init_seed. Returns (router, gate [E, I, H], up [E, I, H], down [E, H, I])."""
    gen = torch.Generator().manual_seed(int(init_seed))

    def draw(rows, cols):
        w = torch.empty(rows, cols)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
        return w

    router = draw(experts, hidden)
    gate, up, down = [], [], []
    for _ in range(experts):
        gate.append(draw(inter, hidden))
        up.append(draw(inter, hidden))
        down.append(draw(hidden, inter))
    return router, torch.stack(gate), torch.stack(up), torch.stack(down)


def _route(x, router_weight, top_k, norm_topk_prob):
    """Each token's top_k experts (int32 [tokens, top_k]) and their weights (fp32): the
    softmax of the router's logits (fp32), renormalised over the chosen ones when
    norm_topk_prob. Shared by both layers, so they route alike."""
    logits = F.linear(x.float(), router_weight.float())
    probs = torch.softmax(logits, dim=-1)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx.to(torch.int32).contiguous(), weights.contiguous()


class _Expert(nn.Module):
    def __init__(self, hidden, inter, dtype, device):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden, inter, bias=False, **factory)
        self.up_proj = nn.Linear(hidden, inter, bias=False, **factory)
        self.down_proj = nn.Linear(inter, hidden, bias=False, **factory)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TorchMoE(nn.Module):
    """The plain PyTorch MoE layer (one device, no tilewire): a router ``gate`` (a
    torch.nn.Linear(hidden, experts, bias=False)), each token's top_k experts by the softmax of
    its logits (fp32; renormalised over the chosen ones when norm_topk_prob), and experts
    ``experts[e]`` of SwiGLU FFNs with ``gate_proj``, ``up_proj`` (hidden -> inter) and
    ``down_proj`` (inter -> hidden), no biases: the DeepSeek-V3 / Qwen-MoE layout without
    shared experts. out[t] = sum over t's experts e of weight x down_proj(silu(gate_proj(x)) *
    up_proj(x)). Its state_dict is what ExpertParallelMoE loads and gives back whole
    (``ExpertParallelMoE.to_torch``); reset_parameters draws full_moe_init(init_seed)."""

    def __init__(self, hidden, inter, experts, top_k, *, norm_topk_prob=True, dtype=torch.float32,
                 device=None, init_seed=0):
        super().__init__()
        _check_shape("tilewire.nn.TorchMoE", hidden, inter, experts, top_k)
        self.hidden, self.inter, self.num_experts, self.top_k = hidden, inter, experts, top_k
        self.norm_topk_prob, self.init_seed = bool(norm_topk_prob), int(init_seed)
        self.gate = nn.Linear(hidden, experts, bias=False, dtype=dtype, device=device)
        self.experts = nn.ModuleList(_Expert(hidden, inter, dtype, device) for _ in range(experts))
        self.reset_parameters()

    def reset_parameters(self):
        if self.gate.weight.is_meta:
            return
        router, gate, up, down = full_moe_init(self.hidden, self.inter, self.num_experts,
                                               self.init_seed)
        with torch.no_grad():
            self.gate.weight.copy_(router)
            for e, ex in enumerate(self.experts):
                ex.gate_proj.weight.copy_(gate[e])
                ex.up_proj.weight.copy_(up[e])
                ex.down_proj.weight.copy_(down[e])

    def forward(self, x):
        flat = x.reshape(-1, self.hidden)
        idx, weights = _route(flat, self.gate.weight, self.top_k, self.norm_topk_prob)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        for e, ex in enumerate(self.experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                y = ex(flat[rows]).float() * weights[rows, slot].unsqueeze(1)
                out.index_add_(0, rows, y)
        return out.to(x.dtype).view_as(x)

    def extra_repr(self):
        return "hidden=%d, inter=%d, experts=%d, top_k=%d, norm_topk_prob=%s" % (
            self.hidden, self.inter, self.num_experts, self.top_k, self.norm_topk_prob)


class ExpertParallelMoE(nn.Module):
    """Expert-parallel MoE layer over tilewire.moe_ffn: TorchMoE's routing and experts, with
    the experts placed in contiguous blocks over the comm's ranks (rank r holds experts
    [r * experts / world, (r + 1) * experts / world)) and the whole FFN, dispatch to combine,
    in one persistent kernel a call.

    Holds the router ``gate.weight`` [experts, hidden] (the same on every rank) and this
    rank's experts as ``w13`` [local, 2 inter, hidden] (each expert's gate_proj rows then its
    up_proj rows) and ``w2`` [local, hidden, inter] (down_proj). forward(x): x is this rank's
    tokens [tokens, ..., hidden], at most max_tokens of them; returns their outputs, the same
    shape (bf16). Collective: every rank calls it (with its own tokens, any number up to
    max_tokens). Autograd: x, the router and both weights get gradients through moe_ffn's
    backward on tilewire's kernels.

    state_dict: this rank's tensors under the keys above; load_state_dict also takes a
    TorchMoE's (the full layer: this rank keeps its experts, told by the keys). from_torch
    makes a rank's layer from a TorchMoE, full_state_dict / to_torch rebuild the TorchMoE from
    every rank's layer. Initialisation: full_moe_init(init_seed), every rank its experts.

    Buffers: the layer owns the symmetric buffers moe_ffn needs (workspace, recv, expert_out,
    and grad_buffer in training) and h, act: allocated collectively on the first forward
    (sized for max_tokens) and kept; reserve() allocates them first, for CUDA graph capture
    and torch.compile. A forward's buffers serve its backward: a second forward of the same
    layer before the backward overwrites them (run the backward first).
    """

    def __init__(self, hidden, inter, experts, top_k, *, comm, max_tokens, norm_topk_prob=True,
                 dtype=_BF16, device=None, init_seed=0):
        super().__init__()
        op = "tilewire.nn.ExpertParallelMoE"
        _check_shape(op, hidden, inter, experts, top_k)
        _positive_int(max_tokens, "max_tokens", op)
        size, rank = _world_and_rank(comm, op)
        if experts % size:
            raise ValueError("%s: experts=%d must be divisible by world=%d (each rank holds "
                             "experts / world of them)" % (op, experts, size))
        self.comm, self.world, self.rank = comm, size, rank
        self.hidden, self.inter, self.num_experts, self.top_k = hidden, inter, experts, top_k
        self.local = experts // size
        self.max_tokens, self.norm_topk_prob = max_tokens, bool(norm_topk_prob)
        self.init_seed = int(init_seed)
        if device is None:
            device = torch.device("cuda", getattr(comm, "device", 0))
        factory = {"dtype": dtype, "device": device}
        self.gate = nn.Linear(hidden, experts, bias=False, **factory)
        self.w13 = nn.Parameter(torch.empty(self.local, 2 * inter, hidden, **factory))
        self.w2 = nn.Parameter(torch.empty(self.local, hidden, inter, **factory))
        self._tw = None  # moe_ffn's buffers, made on first use
        self.reset_parameters()

    # ---- parameters -------------------------------------------------------------------

    def _first(self):
        return self.rank * self.local

    def reset_parameters(self):
        """full_moe_init(init_seed) (the same on every rank), of which this rank keeps the
        router and its experts."""
        if self.w13.is_meta:
            return
        router, gate, up, down = full_moe_init(self.hidden, self.inter, self.num_experts,
                                               self.init_seed)
        e0, e1 = self._first(), self._first() + self.local
        with torch.no_grad():
            self.gate.weight.copy_(router)
            self.w13.copy_(torch.cat([gate[e0:e1], up[e0:e1]], dim=1))
            self.w2.copy_(down[e0:e1])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Takes a TorchMoE's tensors (experts.{e}.{gate,up,down}_proj.weight of every expert):
        this rank's experts become w13 and w2, the others' keys are consumed."""
        key = prefix + "experts.%d.%s.weight"
        if prefix + "w13" not in state_dict and (key % (0, "gate_proj")) in state_dict:
            gates, ups, downs = [], [], []
            for e in range(self.num_experts):
                names = [key % (e, n) for n in ("gate_proj", "up_proj", "down_proj")]
                missing = [n for n in names if n not in state_dict]
                if missing:
                    raise ValueError("tilewire.nn.ExpertParallelMoE: a TorchMoE's state_dict "
                                     "of %d experts lacks %s" % (self.num_experts, missing[0]))
                g, u, d = (state_dict.pop(n) for n in names)
                if self._first() <= e < self._first() + self.local:
                    gates.append(g), ups.append(u), downs.append(d)
            state_dict[prefix + "w13"] = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
            state_dict[prefix + "w2"] = torch.stack(downs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    @classmethod
    def from_torch(cls, moe, comm, *, max_tokens, **kwargs):
        """This rank's layer of a TorchMoE (its router and this rank's experts, cast to dtype,
        torch.bfloat16 by default). kwargs: the constructor's."""
        if not isinstance(moe, TorchMoE):
            raise TypeError("%s.from_torch: expected a tilewire.nn.TorchMoE, got %s"
                            % (cls.__name__, type(moe).__name__))
        device = kwargs.pop("device", None)
        if device is None:
            device = torch.device("cuda", getattr(comm, "device", 0))
        layer = cls(moe.hidden, moe.inter, moe.num_experts, moe.top_k, comm=comm,
                    max_tokens=max_tokens, norm_topk_prob=moe.norm_topk_prob, device="meta",
                    **kwargs)
        layer = layer.to_empty(device=device)
        layer.load_state_dict(moe.state_dict())
        return layer

    @classmethod
    def full_state_dict(cls, shards):
        """A TorchMoE's state_dict from every rank's layer or its state_dict, in rank order:
        rank 0's router, every rank's experts split back into their projections."""
        dicts = []
        for r, s in enumerate(list(shards)):
            if isinstance(s, nn.Module):
                if not isinstance(s, cls) or s.rank != r:
                    raise ValueError("%s.full_state_dict: shard %d is not rank %d's layer; pass "
                                     "every rank's layer in rank order" % (cls.__name__, r, r))
                s = s.state_dict()
            dicts.append(s)
        if not dicts:
            raise ValueError("%s.full_state_dict: no shards" % cls.__name__)
        out = {"gate.weight": dicts[0]["gate.weight"].detach().clone()}
        e = 0
        for d in dicts:
            w13, w2 = d["w13"].detach(), d["w2"].detach()
            inter = w13.shape[1] // 2
            for j in range(w13.shape[0]):
                out["experts.%d.gate_proj.weight" % e] = w13[j, :inter].clone()
                out["experts.%d.up_proj.weight" % e] = w13[j, inter:].clone()
                out["experts.%d.down_proj.weight" % e] = w2[j].clone()
                e += 1
        return out

    @classmethod
    def to_torch(cls, shards, top_k=None, norm_topk_prob=True):
        """The TorchMoE (dtype and device of the shards) from every rank's layer, in rank
        order (or their state_dicts, with top_k given)."""
        shards = list(shards)
        if top_k is None:
            if not shards or not isinstance(shards[0], cls):
                raise ValueError("%s.to_torch: pass top_k with state_dicts" % cls.__name__)
            top_k, norm_topk_prob = shards[0].top_k, shards[0].norm_topk_prob
        state = cls.full_state_dict(shards)
        router = state["gate.weight"]
        experts, hidden = router.shape
        inter = state["experts.0.gate_proj.weight"].shape[0]
        moe = TorchMoE(hidden, inter, experts, top_k, norm_topk_prob=norm_topk_prob,
                       dtype=router.dtype, device="meta")
        moe = moe.to_empty(device=router.device)
        moe.load_state_dict(state)
        return moe

    def extra_repr(self):
        return ("hidden=%d, inter=%d, experts=%d, top_k=%d, max_tokens=%d, world=%d, rank=%d"
                % (self.hidden, self.inter, self.num_experts, self.top_k, self.max_tokens,
                   self.world, self.rank))

    # ---- buffers ----------------------------------------------------------------------

    def _buffers_for(self, grad):
        """moe_ffn's buffers for max_tokens tokens a rank (collective the first time, and the
        first time a forward needs gradients)."""
        if self._tw is None:
            rows = moe_recv_rows(self.world, self.max_tokens, self.num_experts, self.top_k)
            c, dev = self.comm, self.w13.device
            self._tw = {
                "workspace": moe_workspace(c, self.max_tokens, self.num_experts, self.top_k,
                                           hidden=self.hidden),
                "recv": c.empty((rows, self.hidden), _BF16),
                "expert_out": c.empty((rows, self.hidden), _BF16),
                "h": torch.zeros((rows, 2 * self.inter), dtype=_BF16, device=dev),
                "act": torch.zeros((rows, self.inter), dtype=_BF16, device=dev),
                "grad_buffer": None,
            }
            self._tw["recv"].zero_()  # finite rows everywhere (moe_ffn's backward sums them)
        if grad and self._tw["grad_buffer"] is None:
            self._tw["grad_buffer"] = self.comm.empty(tuple(self._tw["recv"].shape), _BF16)
        return self._tw

    def reserve(self, grad=False, tokens=None):
        """Allocates (collectively) the buffers forward needs; grad=True: the backward's too,
        and the router's forward and backward made once at `tokens` tokens of this rank
        (default max_tokens): on virtual ranks a first cuBLAS call inside the ranks' loop could
        wait forever (tilewire's layers' warm_backward)."""
        self._buffers_for(grad)
        if not grad:
            return
        t = self.max_tokens if tokens is None else _positive_int(tokens, "tokens",
                                                                 "ExpertParallelMoE.reserve")
        dev = self.gate.weight.device
        x = torch.zeros(t, self.hidden, dtype=_BF16, device=dev, requires_grad=True)
        w = self.gate.weight.detach().clone().requires_grad_(True)
        _route(x, w, self.top_k, self.norm_topk_prob)[1].sum().backward()

    def release_buffers(self):
        """Drops the buffers (collective: every rank, where no collective is in flight)."""
        self._tw = None

    # ---- forward ----------------------------------------------------------------------

    def forward(self, x):
        op = "tilewire.nn.ExpertParallelMoE"
        if self.w13.dtype != _BF16:
            raise TypeError("%s: the fused MoE needs torch.bfloat16 experts, this layer's are %s"
                            % (op, self.w13.dtype))
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden:
            raise ValueError("%s: the input must be a tensor [tokens, ..., %d], got %s"
                             % (op, self.hidden, tuple(x.shape) if isinstance(x, torch.Tensor)
                                else type(x).__name__))
        flat = x.reshape(-1, self.hidden).to(_BF16).contiguous()
        if flat.shape[0] > self.max_tokens:
            raise ValueError("%s: %d tokens; the layer was built for max_tokens=%d"
                             % (op, flat.shape[0], self.max_tokens))
        idx, weights = _route(flat, self.gate.weight, self.top_k, self.norm_topk_prob)
        grad = torch.is_grad_enabled() and (flat.requires_grad or self.w13.requires_grad or
                                            self.gate.weight.requires_grad)
        b = self._buffers_for(grad)
        out = moe_ffn(self.comm, flat, idx, weights, self.w13, self.w2,
                      workspace=b["workspace"], recv=b["recv"], expert_out=b["expert_out"],
                      max_tokens=self.max_tokens, experts=self.num_experts, h=b["h"],
                      act=b["act"], grad_buffer=b["grad_buffer"] if grad else None)
        return out.view(x.shape)
