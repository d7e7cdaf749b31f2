"""python -m tilewire.bench_block: one training step (forward and backward) of the example block
(tilewire.example_block), side by side in one run at worlds 2, 4 and 8 on virtual ranks of one
GPU:

    tilewire     TilewireBlock on every virtual rank (tilewire.for_each_rank): the q/k/v and
                 gate/up projections AllGather + GEMM, the output and down projections GEMM +
                 ReduceScatter, each one fused kernel a rank
    tilewire-cp  (with --cp) TilewireBlock(context_parallel=True): each rank's zigzag shard of
                 the tokens, the attention tilewire.nn.RingAttention over every head between
                 replicated q/k/v and output projections (torch matmuls), the MLP as tilewire's
    torch-tp     the same tensor-parallel block as plain PyTorch runs it, every rank's shard in
                 turn in one process: the same weights per rank, torch.matmul and torch's
                 attention, the collectives as the copies and sums NCCL makes (the all-gather a
                 torch.cat, the reduce-scatter a sum in fp32 and a chunk). It has no
                 context-parallel form here (the unfused ring, per-step K/V copies and lse
                 merges, is bench_ring's baseline, not rebuilt in this block), so tilewire-cp
                 is compared with torch only
    torch        the plain block in bf16 on every token, one device: the same FLOPs with no
                 parallelism, which on one GPU is the ideal

    python -m tilewire.bench_block                            # worlds 2 4 8, the shapes below
    python -m tilewire.bench_block --world 4 --tokens 8192 --hidden 4096 --ffn 11008
    python -m tilewire.bench_block --moe --json block.json
    python -m tilewire.bench_block --cp                       # also the context-parallel block
    python -m tilewire.bench_block --plot block.json docs/plots/block-steps.png

On one GPU NCCL cannot join ranks that share a device and torch's async-TP needs a process per
GPU, so the PyTorch baseline here is torch-tp: its kernels are PyTorch's own, its collectives
local copies. The ranks share the GPU's SMs and HBM, so tilewire's row measures what fusing
costs or saves on one GPU, not what it does over NVLink. --moe: the MLP is an 8-expert top-2
MoE (tilewire.nn.ExpertParallelMoE against tilewire.nn.TorchMoE on every token; no torch-tp
row). --cp: also the tilewire-cp row (on the same comms as tilewire's), which needs head_dim
(hidden / heads) of 64 or 128 and tokens a multiple of 2 x world (two zigzag chunks a rank).
Times: CUDA events around the step of every rank (the gradients dropped first), the median of
--repeats after --warmup. Before timing, each row's loss is compared with the plain block's
(relative 5e-2; the weights are the same bf16 values). Exit status: 0, 1 a check failed, 2 no
torch or no Hopper GPU.
"""

import argparse
import json
import sys
import time

from ._comm import set_shared_gpu_env
from .bench_attention import _time, hopper_torch

DEFAULTS = {"tokens": 4096, "hidden": 2048, "heads": 16, "ffn": 8192}
VARIANTS = ("tilewire", "tilewire-cp", "torch-tp", "torch")  # the rows' order
TILEWIRE = ("tilewire", "tilewire-cp")  # the rows whose speedups the others' show


class TorchTPBlock:
    """The example block's tensor-parallel form in plain PyTorch, every rank's shard in one
    process (module comment): rank r holds TilewireBlock's weights for rank r."""

    def __init__(self, torch, block, world, device):
        from .example_block import RMSNorm, _interleave

        bf16 = torch.bfloat16
        self.torch, self.world = torch, world
        self.heads, self.d = block.heads // world, block.hidden // block.heads

        def shards(w, dim):
            return [p.detach().to(device, bf16).contiguous().requires_grad_()
                    for p in w.chunk(world, dim=dim)]

        self.wqkv = shards(_interleave(block.qkv.weight.chunk(3), world), 0)
        self.wo = shards(block.o.weight, 1)
        self.wgu = shards(_interleave(block.gate_up.weight.chunk(2), world), 0)
        self.wdown = shards(block.down.weight, 1)
        self.norms = []
        for _ in range(world):
            pair = [RMSNorm(block.hidden), RMSNorm(block.hidden)]
            pair[0].load_state_dict(block.norm1.state_dict())
            pair[1].load_state_dict(block.norm2.state_dict())
            self.norms.append([n.to(device) for n in pair])

    def parameters(self):
        for n1, n2 in self.norms:
            yield from n1.parameters()
            yield from n2.parameters()
        yield from self.wqkv + self.wo + self.wgu + self.wdown

    def _reduce_scatter(self, parts):
        total = parts[0].float()
        for p in parts[1:]:
            total = total + p.float()
        return list(total.to(parts[0].dtype).chunk(self.world))

    def _attend(self, qkv):
        F = self.torch.nn.functional
        t = qkv.shape[0]
        q, k, v = qkv.view(t, 3, self.heads, self.d).unbind(1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True)
        return a.transpose(0, 1).reshape(t, self.heads * self.d)

    def forward(self, xs):
        F, W = self.torch.nn.functional, self.world
        gathered = self.torch.cat([self.norms[r][0](xs[r]) for r in range(W)])  # all-gather
        parts = [self._attend(gathered @ self.wqkv[r].t()) @ self.wo[r].t() for r in range(W)]
        x1 = [x + b for x, b in zip(xs, self._reduce_scatter(parts))]
        gathered = self.torch.cat([self.norms[r][1](x1[r]) for r in range(W)])
        parts = []
        for r in range(W):
            g, u = (gathered @ self.wgu[r].t()).chunk(2, dim=-1)
            parts.append((F.silu(g) * u) @ self.wdown[r].t())
        return [x + b for x, b in zip(x1, self._reduce_scatter(parts))]


def mse_sum(torch, ys, targets, n):
    """The example block's loss over every rank's tokens: the mean squared error (fp32)."""
    total = None
    for y, t in zip(ys, targets):
        part = ((y.float() - t) ** 2).sum()
        total = part if total is None else total + part
    return total / n


def _drop(params):
    for p in params:
        p.grad = None


def _tw_step(tw, comms, blocks, xs, targets, n):
    """One step of the ranks' blocks (each on its tokens xs[r]): returns the loss."""
    def step():
        for b in blocks:
            _drop(b.parameters())
        parts = tw.for_each_rank(comms, lambda c: ((blocks[c.rank](xs[c.rank]).float() -
                                                    targets[c.rank]) ** 2).sum() / n)
        tw.for_each_rank(comms, lambda c: parts[c.rank].backward())
        total = parts[0].detach()
        for p in parts[1:]:
            total = total + p.detach()
        return total
    return step


def steps(torch, tw, ref, world, x, target, moe, device, cp=False):
    """({variant: a function running one step and returning its loss}, the comms). tw: the
    tilewire module (init_virtual, for_each_rank), or a stand-in of both. cp: also the
    context-parallel block (tilewire-cp), on the same comms."""
    import copy

    from .example_block import TilewireBlock, token_shards

    bf16 = torch.bfloat16
    n = target.numel()
    xs = [t.to(bf16).contiguous() for t in x.chunk(world)]
    targets = list(target.chunk(world))
    plain = copy.deepcopy(ref).to(device, bf16)

    def torch_step():
        _drop(plain.parameters())
        loss = mse_sum(torch, [plain(x.to(bf16))], [target], n)
        loss.backward()
        return loss

    out = {"torch": torch_step}
    if not moe:
        tp = TorchTPBlock(torch, ref, world, device)

        def tp_step():
            _drop(tp.parameters())
            loss = mse_sum(torch, tp.forward(xs), targets, n)
            loss.backward()
            return loss

        out["torch-tp"] = tp_step
    comms = tw.init_virtual(world)
    tokens = x.shape[0] // world
    blocks = [TilewireBlock(ref, c, max_tokens=tokens, device=device) for c in comms]
    for b in blocks:  # before the ranks' loop (TilewireBlock.reserve says why)
        b.reserve(tokens)
    out["tilewire"] = _tw_step(tw, comms, blocks, xs, targets, n)
    if cp:
        cp_blocks = [TilewireBlock(ref, c, max_tokens=tokens, device=device,
                                   context_parallel=True) for c in comms]
        for b in cp_blocks:
            b.reserve(tokens)
        out["tilewire-cp"] = _tw_step(
            tw, comms, cp_blocks, [t.to(bf16).contiguous() for t in token_shards(x, world, True)],
            token_shards(target, world, True), n)
    return out, comms


def run_world(torch, tw, args, world, device="cuda", timer=_time):
    """One world's rows: [(variant, seconds, loss, relative loss difference to torch's)] and
    whether every loss agreed."""
    from .example_block import TorchBlock, bf16_values

    experts = 8 if args.moe else 0
    ref = bf16_values(TorchBlock(args.hidden, args.heads, args.ffn, experts=experts,
                                 seed=world).to(device))
    g = torch.Generator(device=device).manual_seed(world)
    x = torch.randn(args.tokens, args.hidden, device=device, generator=g).to(torch.bfloat16)
    target = torch.randn(args.tokens, args.hidden, device=device, generator=g)
    fns, comms = steps(torch, tw, ref, world, x.float(), target, args.moe, device, args.cp)
    rows, ok = [], True
    try:
        losses = {name: float(fn().detach()) for name, fn in fns.items()}  # also every first call
        if device == "cuda":
            torch.cuda.synchronize()
        base = losses["torch"]
        for name in [v for v in VARIANTS if v in fns]:
            diff = abs(losses[name] - base) / max(abs(base), 1e-12)
            ok = ok and diff <= 5e-2
            rows.append((name, timer(torch, fns[name], args.warmup, args.repeats),
                         losses[name], diff))
    finally:  # the blocks' symmetric buffers go before their comms
        if device == "cuda":
            torch.cuda.synchronize()
        fns = None
        import gc

        gc.collect()
        for c in comms:
            c.close()
    return rows, ok


def format_rows(world, args, rows):
    """The table lines of one world: time, TFLOP/s over the whole step (6 x parameters x
    tokens for the projections, attention's 4 x tokens^2 x hidden x 3 / 2 causal; the same
    for the context-parallel block), the speedup of each tilewire row over each other row
    (tilewire-cp only over torch: torch-tp is no context-parallel block)."""
    flops = step_flops(args)
    by = {name: t for name, t, _, _ in rows}
    out = []
    for name, t, loss, diff in rows:
        ratios = []
        if name not in TILEWIRE:
            ratios = ["%s %.2fx" % (v, t / by[v]) for v in TILEWIRE
                      if v in by and not (v == "tilewire-cp" and name == "torch-tp")]
        ratio = ", ".join(ratios)
        out.append("world %d  %-11s %9.3f ms %7.1f TFLOP/s  loss %.5f (%.1e)  %s" % (
            world, name, t * 1e3, flops / t * 1e-12, loss, diff, ratio))
    return out


def step_flops(args):
    """FLOPs of one step of the dense block (forward + backward = 3 x forward): the four
    projections 2 T H (3H + H + 3F) and causal attention 2 x 2 T^2 H / 2."""
    T, H, F = args.tokens, args.hidden, args.ffn
    forward = 2 * T * H * (3 * H + H + 3 * F) + 2 * T * T * H
    if args.moe:  # top-2 of the experts: two FFNs of F a token, gate/up and down
        forward = 2 * T * H * 4 * H + 2 * T * T * H + 2 * 2 * T * H * 3 * F
    return 3 * forward


def plot(doc, path):
    """Draws a bench_block JSON document as grouped bars (step time per world, one bar per
    variant, tilewire's speedup over torch-tp above its bar) into the PNG `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    worlds = sorted({r["world"] for r in rows})
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    ms = {(r["world"], r["variant"]): r["seconds"] * 1e3 for r in rows}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [w + (i - (len(variants) - 1) / 2) * width for w in range(len(worlds))]
        ys = [ms.get((w, v), 0.0) for w in worlds]
        ax.bar(xs, ys, width, label=v)
        for x, w, y in zip(xs, worlds, ys):
            if v == "tilewire" and (w, "torch-tp") in ms and y:
                ax.annotate("%.2fx" % (ms[(w, "torch-tp")] / y), (x, y), ha="center",
                            va="bottom", fontsize=8)
    a = doc.get("args", {})
    ax.set_xticks(range(len(worlds)))
    ax.set_xticklabels(["world %d" % w for w in worlds])
    ax.set_ylabel("step (forward + backward), ms")
    ax.set_title("example block, %s tokens, hidden %s, ffn %s%s: %s, %s" % (
        a.get("tokens"), a.get("hidden"), a.get("ffn"), ", MoE" if a.get("moe") else "",
        doc.get("gpu", "GPU"), doc.get("date", "")), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m tilewire.bench_block",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    for name, value in DEFAULTS.items():
        parser.add_argument("--" + name, type=int, default=value)
    parser.add_argument("--moe", action="store_true", help="an 8-expert top-2 MoE as the MLP")
    parser.add_argument("--cp", action="store_true",
                        help="also the context-parallel block (tilewire-cp: ring attention)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"),
                        help="draw a --json file as a PNG (no benchmark runs)")
    args = parser.parse_args(argv)
    if args.plot:
        return args
    for w in args.world:
        if w < 1 or w > 8 or args.heads % w or args.tokens % w:
            parser.error("--world %d: 1 .. 8, dividing --heads (%d) and --tokens (%d)"
                         % (w, args.heads, args.tokens))
    if args.hidden % args.heads or args.hidden % 8 or args.ffn % 8:
        parser.error("--hidden must be a multiple of --heads and of 8, --ffn of 8")
    if args.cp:
        if args.hidden // args.heads not in (64, 128):
            parser.error("--cp: the ring attention needs head_dim = --hidden / --heads of 64 or "
                         "128, got %d / %d" % (args.hidden, args.heads))
        for w in args.world:
            if args.tokens % (2 * w):
                parser.error("--cp: --tokens (%d) must be a multiple of 2 x --world (%d): two "
                             "zigzag chunks a rank" % (args.tokens, 2 * w))
    return args


def main(argv=None):
    args = parse(argv)
    if args.plot:
        with open(args.plot[0]) as f:
            plot(json.load(f), args.plot[1])
        return 0
    set_shared_gpu_env()  # virtual ranks share GPU 0: before torch starts CUDA
    torch = hopper_torch("bench_block")
    if torch is None:
        return 2
    import tilewire as tw

    results, ok = [], True
    for i, world in enumerate(args.world):
        print("[%d/%d] world %d" % (i + 1, len(args.world), world), file=sys.stderr, flush=True)
        rows, good = run_world(torch, tw, args, world)
        ok = ok and good
        print("\n".join(format_rows(world, args, rows)), flush=True)
        results += [{"world": world, "variant": n, "seconds": t, "loss": loss,
                     "loss_rel_diff": d} for n, t, loss, d in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                       "args": vars(args), "step_flops": step_flops(args), "rows": results},
                      f, indent=1)
    if not ok:
        print("bench_block: a loss differs from the plain block's by more than 5e-2",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
