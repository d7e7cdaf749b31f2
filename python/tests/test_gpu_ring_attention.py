"""tilewire.ring_attention on virtual ranks of one GPU (worlds 1-4, both layouts, causal and
not): every rank's output against torch SDPA over the whole sequence in fp32."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]


def _positions(layout, world, s, r):
    if layout == "contiguous":
        return list(range(r * s, (r + 1) * s))
    h = s // 2
    return list(range(r * h, (r + 1) * h)) + list(range((2 * world - 1 - r) * h,
                                                        (2 * world - r) * h))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_matches_sdpa(world, layout, causal):
    b, s, hq, hk, d = 1, 200, 8, 2, 64
    comms = tilewire.init_virtual(world)
    try:
        g = torch.Generator(device="cuda").manual_seed(7 + world)
        full_q = torch.randn(b, world * s, hq, d, device="cuda", generator=g).bfloat16()
        full_k = torch.randn(b, world * s, hk, d, device="cuda", generator=g).bfloat16()
        full_v = torch.randn(b, world * s, hk, d, device="cuda", generator=g).bfloat16()
        shards = []
        for r, comm in enumerate(comms):
            pos = torch.tensor(_positions(layout, world, s, r), device="cuda")
            k = comm.empty((b, s, hk, d), torch.bfloat16)
            v = comm.empty((b, s, hk, d), torch.bfloat16)
            k.copy_(full_k[:, pos]), v.copy_(full_v[:, pos])
            shards.append((pos, full_q[:, pos].contiguous(), k, v))
        torch.cuda.synchronize()
        outs = tilewire.for_each_rank(
            comms, lambda c: tilewire.ring_attention(c, shards[c.rank][1], shards[c.rank][2],
                                                     shards[c.rank][3], causal=causal,
                                                     layout=layout))
        torch.cuda.synchronize()
        qf = full_q.float().transpose(1, 2)
        kf = full_k.float().repeat_interleave(hq // hk, dim=2).transpose(1, 2)
        vf = full_v.float().repeat_interleave(hq // hk, dim=2).transpose(1, 2)
        ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
        ref = ref.transpose(1, 2)
        for r in range(world):
            want = ref[:, shards[r][0]]
            err = ((outs[r].float() - want).abs() / want.abs().clamp(min=1.0)).max().item()
            assert err <= 2e-2, "rank %d: %.3g" % (r, err)
    finally:
        for c in comms:
            c.close()
