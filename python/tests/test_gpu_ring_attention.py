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


@pytest.mark.parametrize("world", [2, 3])
def test_module_matches_the_function(world):
    """tilewire.nn.RingAttention (its own symmetric K/V buffers, the shards copied in) gives
    bitwise tilewire.ring_attention's output."""
    b, s, h, d = 2, 256, 4, 128
    comms = tilewire.init_virtual(world)
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        qs = [torch.randn(b, s, h, d, device="cuda", generator=g).bfloat16() for _ in comms]
        ks = [c.empty((b, s, h, d), torch.bfloat16) for c in comms]
        vs = [c.empty((b, s, h, d), torch.bfloat16) for c in comms]
        for k, v in zip(ks, vs):
            k.normal_(generator=g), v.normal_(generator=g)
        mods = [tilewire.nn.RingAttention(c, causal=True, layout="zigzag") for c in comms]
        for m in mods:
            m.reserve(b, s, h, d)
        torch.cuda.synchronize()
        with torch.no_grad():
            got = tilewire.for_each_rank(
                comms, lambda c: mods[c.rank](qs[c.rank], ks[c.rank], vs[c.rank]))
        want = tilewire.for_each_rank(
            comms, lambda c: tilewire.ring_attention(c, qs[c.rank], ks[c.rank], vs[c.rank],
                                                     causal=True, layout="zigzag"))
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(got[r], want[r]), "rank %d" % r
        mods = None
    finally:
        torch.cuda.synchronize()
        for c in comms:
            c.close()


def _module_case(world, seed):
    b, s, h, d = 1, 256, 4, 64
    comms = tilewire.init_virtual(world)
    g = torch.Generator(device="cuda").manual_seed(seed)
    qs = [torch.randn(b, s, h, d, device="cuda", generator=g).bfloat16() for _ in comms]
    ks = [torch.randn(b, s, h, d, device="cuda", generator=g).bfloat16() for _ in comms]
    vs = [torch.randn(b, s, h, d, device="cuda", generator=g).bfloat16() for _ in comms]
    mods = [tilewire.nn.RingAttention(c, causal=True, layout="zigzag") for c in comms]
    for m in mods:
        m.reserve(b, s, h, d)
    torch.cuda.synchronize()
    return comms, mods, qs, ks, vs


def test_module_cuda_graph_replays():
    """With its buffers reserved, every rank's RingAttention forward is captured into one CUDA
    graph, and replays on new shards bitwise as the eager calls."""
    world = 2
    comms, mods, qs, ks, vs = _module_case(world, 11)
    try:
        outs = {}

        def step():
            outs["o"] = tilewire.for_each_rank(
                comms, lambda c: mods[c.rank](qs[c.rank], ks[c.rank], vs[c.rank]))

        with torch.no_grad():
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            g = torch.Generator(device="cuda").manual_seed(12)
            for t in qs + ks + vs:
                t.copy_(torch.randn(t.shape, device="cuda", generator=g).bfloat16())
            graph.replay()
            torch.cuda.synchronize()
            replayed = [o.clone() for o in outs["o"]]
            step()
            torch.cuda.synchronize()
            for r in range(world):
                assert torch.equal(replayed[r], outs["o"][r]), "rank %d" % r
        graph = None
        outs.clear()
    finally:
        mods = None
        torch.cuda.synchronize()
        for c in comms:
            c.close()


def test_module_under_torch_compile():
    """RingAttention's forward (a custom op) under torch.compile(fullgraph=True) at world 1
    gives the eager call's bits."""
    comms, mods, qs, ks, vs = _module_case(1, 13)
    try:
        fn = torch.compile(lambda q, k, v: mods[0](q, k, v), fullgraph=True)
        with torch.no_grad():
            got = tilewire.for_each_rank(comms, lambda c: fn(qs[0], ks[0], vs[0]))[0]
            want = tilewire.for_each_rank(comms, lambda c: mods[0](qs[0], ks[0], vs[0]))[0]
            torch.cuda.synchronize()
        assert torch.equal(got, want)
    finally:
        mods = None
        torch.cuda.synchronize()
        for c in comms:
            c.close()
