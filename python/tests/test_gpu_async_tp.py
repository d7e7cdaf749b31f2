"""tilewire.fused_all_gather_matmul and fused_matmul_reduce_scatter on virtual ranks sharing
one Hopper GPU (each rank's Comm as the group), against torch's formula of the same call over
every rank's inputs (the all-gather then matmul; matmul then the reduce-scatter), in fp32.
Skipped without torch or without a Hopper GPU."""

import contextlib
import gc

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import bf16, close_all, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]


@contextlib.contextmanager
def _virtual(world):
    """world virtual ranks; at the end no rank's error, then their buffers and comms freed."""
    comms = tilewire.init_virtual(world)
    try:
        yield comms
        torch.cuda.synchronize()
        for c in comms:
            assert c.async_error() is None
    finally:
        torch.cuda.synchronize()
        for c in comms:
            tilewire.release_async_tp_buffers(c)
        gc.collect()
        close_all(comms)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape, dim", [((128, 256), 0), ((2, 64, 256), 1)])
def test_all_gather_matmul(world, shape, dim):
    with _virtual(world) as comms:
        shards = [torch.randn(shape, device="cuda").to(bf16) for _ in range(world)]
        bs = [torch.randn(256, 384, device="cuda").to(bf16),
              torch.randn(256, 128, device="cuda").to(bf16)]
        outs = tilewire.for_each_rank(
            comms, lambda c: tilewire.fused_all_gather_matmul(shards[c.rank], bs, dim, c))
        torch.cuda.synchronize()
        want_A = torch.cat([s.float() for s in shards], dim=dim)
        for A, res in outs:
            assert torch.equal(A.float(), want_A)
            for b, r in zip(bs, res):
                assert rel_err(r, want_A @ b.float()) < 1e-2
        outs = None


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape, dim", [((256, 512), 0), ((4, 128, 512), 1)])
def test_matmul_reduce_scatter(world, shape, dim):
    with _virtual(world) as comms:
        As = [torch.randn(shape, device="cuda").to(bf16) for _ in range(world)]
        B = [torch.randn(512, 256, device="cuda").to(bf16) for _ in range(world)]
        outs = tilewire.for_each_rank(
            comms, lambda c: tilewire.fused_matmul_reduce_scatter(As[c.rank], B[c.rank], "sum",
                                                                  dim, c))
        torch.cuda.synchronize()
        total = sum(a.float() @ b.float() for a, b in zip(As, B))
        for r, got in enumerate(outs):
            want = total.chunk(world, dim=dim)[r]
            assert got.shape == want.shape and rel_err(got, want) < 1e-2
        outs = None
