"""python -m tilewire.example_block: a Llama-style transformer block trained for a few steps on
random data, as plain PyTorch on one device and with tilewire's tensor-parallel layers on
virtual ranks of one GPU (sequence parallelism: each rank holds a slice of the tokens), the
losses side by side.

    python -m tilewire.example_block                  # world 2, 4 steps
    python -m tilewire.example_block --world 4 --tokens 512 --steps 8 --moe

The block: RMSNorm, causal self-attention (fused q/k/v projection, scaled dot-product
attention, output projection), residual; RMSNorm, a SwiGLU MLP (gate, up, down; or with --moe
an expert-parallel MoE layer), residual. The tilewire block: the q/k/v and gate/up projections
are ColumnParallelLinear (AllGather + GEMM: each rank gets every token of its heads' or its
columns' share), the output and down projections RowParallelLinear (GEMM + ReduceScatter:
each rank gets its tokens back, summed); the norms and the attention itself run on each rank's
share (its tokens, or its heads of every token); the MoE layer is tilewire.nn.ExpertParallelMoE
on each rank's tokens. Both blocks start from the same weights (bf16 values), train with SGD
on the mean squared error to a random target, and print the loss per step. Not yet: ring
attention (context parallelism) in the tilewire block, and a step-time benchmark against torch
async-TP.
"""

import argparse
import sys

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


class TilewireBlock(nn.Module):
    """One rank's tensor- (and with MoE expert-) parallel block: its tokens in, its tokens
    out; every rank calls it with the same number of tokens (a multiple of the world)."""

    def __init__(self, block, comm, *, max_tokens=None, device=None):
        super().__init__()
        from . import nn as twnn

        world = comm.size
        self.comm, self.world, self.hidden, self.ffn = comm, world, block.hidden, block.ffn
        if block.heads % world:
            raise ValueError("tilewire.example_block: heads=%d must be a multiple of world=%d"
                             % (block.heads, world))
        self.heads = block.heads // world  # this rank's heads
        kw = {"comm": comm, "device": device}
        self.norm1, self.norm2 = RMSNorm(block.hidden), RMSNorm(block.hidden)
        self.norm1.load_state_dict(block.norm1.state_dict())
        self.norm2.load_state_dict(block.norm2.state_dict())
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
        if device is not None:
            self.norm1.to(device), self.norm2.to(device)

    def reserve(self, tokens, grad=True):
        """Prepares this rank's block for calls of up to `tokens` tokens of this rank: the
        layers' symmetric buffers (collective: every rank's block, in rank order, while no
        collective is in flight), and one forward and backward of the attention core on zeros
        at this rank's shapes. The first call of a torch kernel or library (cuDNN's attention,
        cuBLAS) may load code or make a handle, which waits for the device; on virtual ranks
        one thread launches every rank's kernels and a rank's collective waits until the next
        rank launches its own, so such a wait inside the ranks' loop would never end."""
        world = self.world
        self.qkv.reserve(tokens, grad=grad)
        self.o.reserve(world * tokens, grad=grad)
        if self.moe is not None:
            self.moe.reserve(grad=grad, tokens=tokens)
        else:
            self.gate_up.reserve(tokens, grad=grad)
            self.down.reserve(world * tokens, grad=grad)
        # the attention core exactly as forward calls it (a library may key its plans on the
        # strides too), and a matmul as the layers' weight gradients run it
        qkv = torch.zeros(world * tokens, self.qkv.weight.shape[0], dtype=_BF16,
                          device=self.qkv.weight.device, requires_grad=grad)
        a = self._attend(qkv)
        if grad:
            (a.float().sum() + torch.matmul(qkv.t(), qkv).float().sum()).backward()

    def _attend(self, qkv):  # [world * tokens, 3 * hidden / world] -> [tokens, heads, d]
        t, d = qkv.shape[0], self.hidden // (self.heads * self.world)
        q, k, v = qkv.view(t, 3, self.heads, d).unbind(1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True)
        return a.transpose(0, 1).reshape(t, self.heads * d)

    def attention(self, x):  # x: this rank's tokens; every token of this rank's heads inside
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
    token), with the replicated parameters' gradients (the norms, the router) summed over the
    ranks before each step, as a data-parallel all-reduce would."""
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
        for name in ("norm1.weight", "norm2.weight", "moe.gate.weight"):
            ps = [dict(b.named_parameters()).get(name) for b in blocks]
            if ps[0] is None or ps[0].grad is None:
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("example_block: needs a CUDA GPU", file=sys.stderr)
        return 2
    import tilewire

    experts = 8 if args.moe else 0
    ref = bf16_values(TorchBlock(args.hidden, args.heads, args.ffn, experts=experts).cuda())
    comms = tilewire.init_virtual(args.world)
    blocks = [TilewireBlock(ref, c, max_tokens=args.tokens, device="cuda") for c in comms]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, device="cuda", generator=g).to(_BF16).float()
    target = torch.randn(args.tokens, args.hidden, device="cuda", generator=g)
    xs = [t.to(_BF16).contiguous() for t in x.chunk(args.world)]
    targets = list(target.chunk(args.world))
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
