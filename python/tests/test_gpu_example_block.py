"""tilewire.example_block on virtual ranks of one Hopper GPU: the tensor-parallel block (and
with the MoE layer) trains for a few steps with losses within a few percent of the plain
PyTorch block's. Skipped without torch or without a Hopper GPU."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from tilewire import example_block  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]


# Known defect: at world 4 with the MoE layer, and at hidden 512 (head_dim 64), the ranks' loop
# on virtual ranks times out in the backward (a rank's fused kernel entered but its peer's
# chunks never came); the cause is not found yet. Kept visible as an expected failure.
_OPEN = pytest.mark.xfail(reason="virtual-rank backward deadlock of the MoE block at world 4 "
                                 "(open)", strict=False)


@pytest.mark.parametrize("world,experts", [(2, 0), (4, 0), (2, 8),
                                           pytest.param(4, 8, marks=_OPEN)])
def test_block_trains_like_plain_pytorch(world, experts):
    ref = example_block.bf16_values(
        example_block.TorchBlock(256, 8, 512, experts=experts, seed=world).cuda())
    comms = tilewire.init_virtual(world)
    try:
        blocks = [example_block.TilewireBlock(ref, c, max_tokens=256, device="cuda")
                  for c in comms]
        g = torch.Generator(device="cuda").manual_seed(2)
        x = torch.randn(256, 256, device="cuda", generator=g).to(torch.bfloat16).float()
        target = torch.randn(256, 256, device="cuda", generator=g)
        xs = [t.to(torch.bfloat16).contiguous() for t in x.chunk(world)]
        plain = example_block.train_torch(ref, x, target, 3, 0.05)  # first, as main() does
        tw = example_block.train_tilewire(blocks, comms, xs, list(target.chunk(world)), 3, 0.05,
                                          tilewire.for_each_rank)
        for a, b in zip(plain, tw):
            assert abs(a - b) <= 5e-2 * abs(a), (plain, tw)
        for c in comms:
            assert c.async_error() is None
        blocks = None
    finally:
        torch.cuda.synchronize()
        import gc
        gc.collect()
        for c in comms:
            c.close()
