"""python -m tilewire.example_block: a Llama-style transformer block trained for a few steps on
random data, as plain PyTorch on one device and with tilewire's tensor-parallel layers on
virtual ranks of one GPU (sequence parallelism: each rank holds a slice of the tokens), or with
--cp context-parallel attention, the losses side by side.

    python -m tilewire.example_block                  # world 2, 4 steps
    python -m tilewire.example_block --world 4 --tokens 512 --steps 8 --moe
    python -m tilewire.example_block --world 4 --heads 4 --cp

The block: RMSNorm, causal self-attention (fused q/k/v projection, scaled dot-product
attention, output projection), residual; RMSNorm, a SwiGLU MLP (gate, up, down; or with --moe
an expert-parallel MoE layer), residual. The tilewire block: the q/k/v and gate/up projections
are ColumnParallelLinear (AllGather + GEMM: each rank gets every token of its heads' or its
columns' share), the output and down projections RowParallelLinear (GEMM + ReduceScatter:
each rank gets its tokens back, summed); the norms and the attention itself run on each rank's
share (its tokens, or its heads of every token); the MoE layer is tilewire.nn.ExpertParallelMoE
on each rank's tokens. Both blocks start from the same weights (bf16 values), train with SGD
on the mean squared error to a random target, and print the loss per step.

--cp (context parallelism): each rank holds a zigzag shard of the sequence (chunks r and
2W - 1 - r of the 2W chunks of the tokens, tilewire.ring_attention's layout="zigzag"; tokens a
multiple of 2W) and the attention is tilewire.nn.RingAttention over every head of the rank's
tokens, the q/k/v and output projections replicated plain bf16 nn.Linear (their gradients
summed over the ranks, as the norms' are); head_dim (hidden / heads) must be 64 or 128. The
MLP stays tensor-parallel over the same comm (per-token math: the zigzag order of the tokens
does not matter to it), so one comm carries both. Not yet: a step-time benchmark against torch
async-TP.
"""

import argparse
import contextlib
import sys

if __name__ == "__main__":  # the virtual ranks share GPU 0: set before torch starts CUDA
    from tilewire._comm import set_shared_gpu_env

    set_shared_gpu_env()

import torch
from torch import nn
from torch.nn import functional as F

_BF16 = torch.bfloat16


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) *
                self.weight.float()).to(x.dtype)


class TorchBlock(nn.Module):
    """The plain block on one device (fp32 by default)."""

    def __init__(self, hidden, heads, ffn, *, experts=0, top_k=2, seed=0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.hidden, self.heads, self.ffn = hidden, heads, ffn
            self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
            self.o = nn.Linear(hidden, hidden, bias=False)
            if experts:
                from ._nn_moe import TorchMoE

                self.moe = TorchMoE(hidden, ffn, experts, top_k, init_seed=seed)
                self.gate_up = self.down = None
            else:
                self.moe = None
                self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
                self.down = nn.Linear(ffn, hidden, bias=False)

    def attention(self, x):
        t, d = x.shape[0], self.hidden // self.heads
        q, k, v = self.qkv(x).view(t, 3, self.heads, d).unbind(1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True)
        return self.o(a.transpose(0, 1).reshape(t, self.hidden))

    def mlp(self, x):
        if self.moe is not None:
            return self.moe(x)
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)

    def forward(self, x):  # x: [tokens, hidden]
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _interleave(rows, world):
    """The rows of a fused weight [n parts x k rows] reordered so that each rank's contiguous
    shard holds its share of every part: part 0's r-th share, part 1's r-th share, ..."""
    parts = [p.chunk(world, dim=0) for p in rows]
    return torch.cat([torch.cat([p[r] for p in parts]) for r in range(world)])


def zigzag_shards(t, world):
    """Every rank's zigzag shard of t's rows (tilewire.ring_attention's layout="zigzag"): of the
    2 x world equal chunks of the rows, rank r holds chunks r and 2 world - 1 - r, in that
    order. The rows must be a multiple of 2 x world."""
    if t.shape[0] % (2 * world):
        raise ValueError("tilewire.example_block.zigzag_shards: rows=%d must be a multiple of "
                         "2 x world=%d" % (t.shape[0], 2 * world))
    c = t.chunk(2 * world)
    return [torch.cat((c[r], c[2 * world - 1 - r])) for r in range(world)]


def token_shards(t, world, context_parallel=False):
    """Every rank's tokens (rows of t) as the tilewire block takes them: the zigzag shards with
    context parallelism, else the world contiguous chunks (sequence parallelism)."""
    return zigzag_shards(t, world) if context_parallel else list(t.chunk(world))


def _staged(t):
    """t copied into a new contiguous buffer, as the ring op copies an operand into its
    symmetric staging buffer."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


class _LocalRing(torch.autograd.Function):
    """TilewireBlock.reserve's local stand-in of RingAttention's call (no peer is read, nothing
    is collective): the torch work the ring op and its backward do around their kernels (the
    forward stages k and v from their strided views; the backward q, dout, k and v) and
    outputs and gradients of their shapes (contiguous bf16), so that the projections around it
    run forward and backward exactly as around the real attention."""

    @staticmethod
    def forward(ctx, q, k, v):
        _staged(k), _staged(v)
        ctx.save_for_backward(q, k, v)
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        for t in (q, dout, k, v):
            _staged(t)
        return (torch.zeros(q.shape, dtype=_BF16, device=q.device),
                torch.zeros(k.shape, dtype=_BF16, device=k.device),
                torch.zeros(v.shape, dtype=_BF16, device=v.device))


class TilewireBlock(nn.Module):
    """One rank's tensor- (and with MoE expert-) parallel block: its tokens in, its tokens
    out; every rank calls it with the same number of tokens (a multiple of the world).

    context_parallel=True: the attention is context-parallel (module docstring): the rank's
    tokens are its zigzag shard (token_shards), an even number of them; q/k/v and the output
    projection are replicated bf16 nn.Linear, tilewire.nn.RingAttention (causal, zigzag) runs
    every head over the rank's tokens; the MLP (or MoE layer) is the tensor-parallel one."""

    def __init__(self, block, comm, *, max_tokens=None, device=None, context_parallel=False):
        super().__init__()
        from . import nn as twnn

        if not isinstance(context_parallel, bool):
            raise TypeError("tilewire.example_block: context_parallel must be a bool, got %s"
                            % type(context_parallel).__name__)
        world = comm.size
        if device is None:  # the layers' default: the comm's CUDA device
            device = torch.device("cuda", getattr(comm, "device", 0))
        self.comm, self.world, self.hidden, self.ffn = comm, world, block.hidden, block.ffn
        self.context_parallel = context_parallel
        self.head_dim = block.hidden // block.heads
        if context_parallel:
            if self.head_dim not in (64, 128):
                raise ValueError("tilewire.example_block: context_parallel needs head_dim "
                                 "(hidden / heads = %d / %d) of 64 or 128 (tilewire.nn."
                                 "RingAttention's), got %d" % (block.hidden, block.heads,
                                                               self.head_dim))
            self.heads = block.heads  # every head, on this rank's tokens
        elif block.heads % world:
            raise ValueError("tilewire.example_block: heads=%d must be a multiple of world=%d"
                             % (block.heads, world))
        else:
            self.heads = block.heads // world  # this rank's heads
        kw = {"comm": comm, "device": device}
        self.norm1, self.norm2 = RMSNorm(block.hidden), RMSNorm(block.hidden)
        self.norm1.load_state_dict(block.norm1.state_dict())
        self.norm2.load_state_dict(block.norm2.state_dict())
        if context_parallel:
            self.qkv = nn.Linear(block.hidden, 3 * block.hidden, bias=False, device=device,
                                 dtype=_BF16)
            self.o = nn.Linear(block.hidden, block.hidden, bias=False, device=device,
                               dtype=_BF16)
            self.qkv.load_state_dict(block.qkv.state_dict())
            self.o.load_state_dict(block.o.state_dict())
            self.ring = twnn.RingAttention(comm, causal=True, layout="zigzag")
        else:
            qkv = nn.Linear(block.hidden, 3 * block.hidden, bias=False)
            with torch.no_grad():
                qkv.weight.copy_(_interleave(block.qkv.weight.chunk(3), world))
            self.qkv = twnn.ColumnParallelLinear.from_linear(qkv, **kw)
            self.o = twnn.RowParallelLinear.from_linear(block.o, **kw)
        self.moe = None
        if block.moe is not None:
            self.moe = twnn.ExpertParallelMoE.from_torch(block.moe, comm,
                                                         max_tokens=max_tokens or 4096,
                                                         device=device)
        else:
            gate_up = nn.Linear(block.hidden, 2 * block.ffn, bias=False)
            with torch.no_grad():
                gate_up.weight.copy_(_interleave(block.gate_up.weight.chunk(2), world))
            self.gate_up = twnn.ColumnParallelLinear.from_linear(gate_up, **kw)
            self.down = twnn.RowParallelLinear.from_linear(block.down, **kw)
        self.norm1.to(device), self.norm2.to(device)

    def replicated_parameters(self):
        """The names (named_parameters' keys) of the parameters every rank holds whole, with
        the same values: the norms, with MoE the router, with context parallelism the q/k/v
        and output projections. A rank's gradient of one covers only its tokens, so a step
        sums them over the ranks first (train_tilewire, as a data-parallel all-reduce would);
        the other parameters are this rank's shards, their gradients its own."""
        names = ["norm1.weight", "norm2.weight"]
        if self.context_parallel:
            names += ["qkv.weight", "o.weight"]
        if self.moe is not None:
            names.append("moe.gate.weight")
        return names

    def reserve(self, tokens, grad=True):
        """Prepares this rank's block for calls of up to `tokens` tokens of this rank (with
        context parallelism exactly `tokens`: the ring's buffers are made for one shape, and
        another shape would make them again, collectively, inside the ranks' loop): the
        layers' symmetric buffers (collective: every rank's block, in rank order, while no
        collective is in flight), and one forward and backward of the attention core on zeros
        at this rank's shapes (with context parallelism, of the attention's torch work around
        the ring, not the ring itself: _warm_ring_attention). The first call of a torch kernel
        or library (cuDNN's attention, cuBLAS) may load code or make a handle, which waits for
        the device; on virtual ranks one thread launches every rank's kernels and a rank's
        collective waits until the next rank launches its own, so such a wait inside the
        ranks' loop would never end."""
        world = self.world
        if self.context_parallel:
            self.ring.reserve(1, tokens, self.heads, self.head_dim, heads_q=self.heads,
                              grad=grad)
        else:
            self.qkv.reserve(tokens, grad=grad)
            self.o.reserve(world * tokens, grad=grad)
        if self.moe is not None:
            self.moe.reserve(grad=grad, tokens=tokens)
        else:
            self.gate_up.reserve(tokens, grad=grad)
            self.down.reserve(world * tokens, grad=grad)
        if self.context_parallel:
            self._warm_ring_attention(tokens, grad)
            return
        # the attention core exactly as forward calls it (a library may key its plans on the
        # strides too), and a matmul as the layers' weight gradients run it
        qkv = torch.zeros(world * tokens, self.qkv.weight.shape[0], dtype=_BF16,
                          device=self.qkv.weight.device, requires_grad=grad)
        a = self._attend(qkv)
        if grad:
            (a.float().sum() + torch.matmul(qkv.t(), qkv).float().sum()).backward()

    def _warm_ring_attention(self, tokens, grad):
        """The context-parallel attention once on zeros of this rank's shapes, with the ring
        replaced by _LocalRing (local: the ring itself is collective): the projections'
        matmuls forward and, with grad, backward (on the autograd engine's thread, as
        training's), the strided copies of q, k and v, the gradients' stack. On the rank's own
        stream where the comm has one (virtual ranks), as for_each_rank runs forward: cuBLAS
        keeps a workspace per stream, made by the stream's first matmul. Not collective. The
        weights go in detached, so that the parameters get no gradient."""
        dev = self.qkv.weight.device
        x = torch.zeros(tokens, self.hidden, dtype=_BF16, device=dev, requires_grad=grad)
        weights = [p.detach().requires_grad_(grad) for p in (self.qkv.weight, self.o.weight)]
        stream = getattr(self.comm, "stream", None) if dev.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            with torch.set_grad_enabled(grad):
                y = self._ring_attention(x, _LocalRing.apply, *weights)
                if grad:
                    y.backward(torch.zeros_like(y))  # dense, as the residual's gradient is

    def _attend(self, qkv):  # [world * tokens, 3 * hidden / world] -> [tokens, heads, d]
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.view(t, 3, self.heads, d).unbind(1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True)
        return a.transpose(0, 1).reshape(t, self.heads * d)

    def _ring_attention(self, x, ring, qkv_weight, o_weight):
        """Context-parallel attention of this rank's tokens x [tokens, hidden]: q, k and v of
        them (1, tokens, heads, head_dim), ring(q, k, v) over every rank's (self.ring, or
        reserve's stand-in), the output projection; [tokens, hidden]."""
        t = x.shape[0]
        q, k, v = F.linear(x, qkv_weight).view(1, t, 3, self.heads, self.head_dim).unbind(2)
        a = ring(q.contiguous(), k, v)  # k, v: strided views, staged into the ring's buffers
        return F.linear(a.reshape(t, self.hidden), o_weight)

    def attention(self, x):  # x: this rank's tokens
        if self.context_parallel:
            return self._ring_attention(x, self.ring, self.qkv.weight, self.o.weight)
        qkv = self.qkv(x)  # [world * tokens, 3 * hidden / world]: this rank's q, k, v columns
        return self.o(self._attend(qkv))  # back to this rank's tokens

    def mlp(self, x):
        if self.moe is not None:
            return self.moe(x)
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def bf16_values(block):
    """The block's parameters rounded to bf16 (what the tilewire layers hold), kept in fp32."""
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(p.to(_BF16).float())
    return block


def sgd(params, lr):
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(lr * p.grad.to(p.dtype))
                p.grad = None


def train_torch(block, x, target, steps, lr):
    """Losses of the plain block over `steps` SGD steps (mean squared error)."""
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(block(x).float(), target)
        loss.backward()
        sgd(block.parameters(), lr)
        losses.append(loss.item())
    return losses


def train_tilewire(blocks, comms, xs, targets, steps, lr, for_each_rank):
    """Losses of the ranks' blocks (each on its tokens; the loss is the mean over every
    token), with the replicated parameters' gradients (the blocks' replicated_parameters(): the
    norms, the router, with context parallelism the q/k/v and output projections) summed over
    the ranks before each step, as a data-parallel all-reduce would."""
    n = sum(t.numel() for t in targets)
    for b, x in zip(blocks, xs):
        b.reserve(x.shape[0])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    losses = []
    for _ in range(steps):
        parts = for_each_rank(comms, lambda c: ((blocks[c.rank](xs[c.rank]).float() -
                                                  targets[c.rank]) ** 2).sum() / n)
        for_each_rank(comms, lambda c: parts[c.rank].backward())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for name in blocks[0].replicated_parameters():
            ps = [dict(b.named_parameters())[name] for b in blocks]
            if ps[0].grad is None:
                continue
            total = sum(p.grad.float() for p in ps)
            for p in ps:
                p.grad = total.to(p.dtype)
        for b in blocks:
            sgd(b.parameters(), lr)
        losses.append(sum(p.item() for p in parts))
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tilewire.example_block",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="tokens in all")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--moe", action="store_true", help="an 8-expert top-2 MoE as the MLP")
    parser.add_argument("--cp", action="store_true",
                        help="context-parallel attention (tilewire.nn.RingAttention, zigzag)")
    args = parser.parse_args(argv)
    if args.cp and args.hidden // args.heads not in (64, 128):
        hint = " (--heads %d: 64)" % (args.hidden // 64) if args.hidden % 64 == 0 else ""
        parser.error("--cp: the ring attention needs head_dim = --hidden / --heads of 64 or 128, "
                     "got %d / %d%s" % (args.hidden, args.heads, hint))
    if args.cp and args.tokens % (2 * args.world):
        parser.error("--cp: --tokens (%d) must be a multiple of 2 x --world (%d): the zigzag "
                     "shards are two chunks a rank" % (args.tokens, 2 * args.world))
    if not torch.cuda.is_available():
        print("example_block: needs a CUDA GPU", file=sys.stderr)
        return 2
    import tilewire

    experts = 8 if args.moe else 0
    ref = bf16_values(TorchBlock(args.hidden, args.heads, args.ffn, experts=experts).cuda())
    comms = tilewire.init_virtual(args.world)
    blocks = [TilewireBlock(ref, c, max_tokens=args.tokens, device="cuda",
                            context_parallel=args.cp) for c in comms]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, device="cuda", generator=g).to(_BF16).float()
    target = torch.randn(args.tokens, args.hidden, device="cuda", generator=g)
    # the ranks' tokens, and their targets alike: the loss is a sum over tokens, in any order
    xs = [t.to(_BF16).contiguous() for t in token_shards(x, args.world, args.cp)]
    targets = token_shards(target, args.world, args.cp)
    # the plain block first: it also loads every torch kernel and library the ranks' loop calls
    # (TilewireBlock.reserve says why that matters on virtual ranks)
    torch_losses = train_torch(ref, x, target, args.steps, args.lr)
    tw_losses = train_tilewire(blocks, comms, xs, targets, args.steps, args.lr,
                               tilewire.for_each_rank)
    print("step  torch        tilewire     rel. diff")
    for i, (a, b) in enumerate(zip(torch_losses, tw_losses)):
        print("%4d  %.6f  %.6f  %.2e" % (i, a, b, abs(a - b) / max(abs(a), 1e-12)))
    for c in comms:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
