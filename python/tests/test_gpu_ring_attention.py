"""tilewire.ring_attention on virtual ranks of one GPU (worlds 1-4, both layouts, causal and
not): every rank's output against torch SDPA over the whole sequence in fp32, and its gradients
(tw_ring_attention_backward) against the whole sequence's (tilewire.attention's backward and
fp32 SDPA's); tilewire.nn.RingAttention against the function, in CUDA graphs, under
torch.compile, and across virtual nodes against one node."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import init_nodes  # noqa: E402

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


# ---- the backward (tw_ring_attention_backward) ----------------------------------------------

GRAD_TOL_SDPA = 2.5e-2  # relative to each gradient's largest magnitude
GRAD_TOL_WHOLE = 1e-2  # against tilewire.attention's backward: the same math, other sum orders


def _rel(x, ref):
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _whole_sequence_grads(full_q, full_k, full_v, full_dout, causal):
    """(tilewire.attention's dq, dk, dv, fp32 SDPA's dq, dk, dv) over the whole sequence in
    global order."""
    leaves = [t.detach().clone().requires_grad_() for t in (full_q, full_k, full_v)]
    o = tilewire.attention(*leaves, causal=causal)
    ours = torch.autograd.grad(o, leaves, full_dout)
    hq, hk = full_q.shape[2], full_k.shape[2]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (full_q, full_k, full_v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qf.transpose(1, 2), kf.repeat_interleave(hq // hk, dim=2).transpose(1, 2),
        vf.repeat_interleave(hq // hk, dim=2).transpose(1, 2), is_causal=causal)
    ref.transpose(1, 2).backward(full_dout.float())
    return ours, (qf.grad, kf.grad, vf.grad)


def _ring_grad_case(comms, layout, b, s, hq, hk, d, seed):
    """The whole sequence's q, k, v, dout and each rank's shard: (positions, q leaf, symmetric
    k and v leaves, dout, grad buffers)."""
    world = len(comms)
    g = torch.Generator(device="cuda").manual_seed(seed)
    full = [torch.randn(b, world * s, h, d, device="cuda", generator=g).bfloat16()
            for h in (hq, hk, hk, hq)]
    shards = []
    for r, comm in enumerate(comms):
        pos = torch.tensor(_positions(layout, world, s, r), device="cuda")
        k, v = comm.empty((b, s, hk, d), torch.bfloat16), comm.empty((b, s, hk, d), torch.bfloat16)
        k.copy_(full[1][:, pos]), v.copy_(full[2][:, pos])
        buffers = tilewire.ring_attention_grad_buffers(comm, b, s, hq, d)
        shards.append((pos, full[0][:, pos].contiguous().requires_grad_(), k.requires_grad_(),
                       v.requires_grad_(), full[3][:, pos].contiguous(), buffers))
    torch.cuda.synchronize()
    return full, shards


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_backward_matches_the_whole_sequence(world, layout, causal):
    """Every rank's dq, dk, dv (GQA 4) against the gradients of its positions over the whole
    sequence: tilewire.attention's backward and fp32 SDPA's; a second backward gives the same
    bits."""
    b, s, hq, hk, d = 1, 200, 8, 2, 64
    comms = tilewire.init_virtual(world)
    try:
        full, shards = _ring_grad_case(comms, layout, b, s, hq, hk, d, seed=31 + world)

        def forward(c):
            pos, q, k, v, _, buffers = shards[c.rank]
            return tilewire.ring_attention(c, q, k, v, causal=causal, layout=layout,
                                           grad_buffers=buffers)

        def backward(c):
            _, q, k, v, dout, _ = shards[c.rank]
            return torch.autograd.grad(outs[c.rank], (q, k, v), dout, retain_graph=True)

        outs = tilewire.for_each_rank(comms, forward)
        grads = tilewire.for_each_rank(comms, backward)
        again = tilewire.for_each_rank(comms, backward)
        torch.cuda.synchronize()
        ours, ref = _whole_sequence_grads(*full, causal)
        for r in range(world):
            pos = shards[r][0]
            for i, name in enumerate("qkv"):
                got = grads[r][i]
                assert got.shape == shards[r][1 + i].shape and torch.isfinite(got).all()
                err = _rel(got, ours[i][:, pos])
                assert err <= GRAD_TOL_WHOLE, "rank %d d%s vs tilewire.attention: %.3g" % (
                    r, name, err)
                err = _rel(got, ref[i][:, pos])
                assert err <= GRAD_TOL_SDPA, "rank %d d%s vs SDPA: %.3g" % (r, name, err)
                assert torch.equal(got, again[r][i]), "rank %d d%s: not repeatable" % (r, name)
        for c in comms:
            assert c.async_error() is None
        outs = grads = again = shards = None
    finally:
        torch.cuda.synchronize()
        for c in comms:
            c.close()


@pytest.mark.parametrize("world", [2, 3])
def test_module_backward_matches_the_function(world):
    """tilewire.nn.RingAttention's gradients (k and v staged into its buffers again by the
    backward, after a second forward has overwritten them) are bitwise tilewire.ring_attention's
    on symmetric k and v."""
    b, s, hq, hk, d = 1, 256, 8, 2, 128
    comms = tilewire.init_virtual(world)
    try:
        full, shards = _ring_grad_case(comms, "zigzag", b, s, hq, hk, d, seed=41)
        mods = [tilewire.nn.RingAttention(c, causal=True) for c in comms]
        for m in mods:
            m.reserve(b, s, hk, d, heads_q=hq, grad=True)
        plain = [tuple(t.detach().clone().requires_grad_() for t in sh[1:4]) for sh in shards]
        zeros = [tuple(torch.zeros_like(t) for t in p) for p in plain]  # made before the loop
        torch.cuda.synchronize()

        def function(c):
            _, q, k, v, dout, buffers = shards[c.rank]
            o = tilewire.ring_attention(c, q, k, v, causal=True, grad_buffers=buffers)
            return torch.autograd.grad(o, (q, k, v), dout)

        def module(c):
            q, k, v = plain[c.rank]
            o = mods[c.rank](q, k, v)
            mods[c.rank](*zeros[c.rank])  # overwrites the module's K/V buffers
            return torch.autograd.grad(o, (q, k, v), shards[c.rank][4])

        want = tilewire.for_each_rank(comms, function)
        got = tilewire.for_each_rank(comms, module)
        torch.cuda.synchronize()
        for r in range(world):
            for i, name in enumerate("qkv"):
                assert torch.equal(got[r][i], want[r][i]), "rank %d d%s" % (r, name)
        mods = shards = want = got = None
    finally:
        torch.cuda.synchronize()
        for c in comms:
            c.close()


def test_module_backward_cuda_graph_replays():
    """With its buffers reserved (grad=True), every rank's RingAttention forward and backward
    are captured into one CUDA graph, and replay on new shards bitwise as the eager calls."""
    world, b, s, h, d = 2, 1, 256, 4, 64
    comms, mods, qs, ks, vs = _module_case(world, 19)
    try:
        for m in mods:
            m.reserve(b, s, h, d, grad=True)
        g = torch.Generator(device="cuda").manual_seed(20)
        douts = [torch.randn(b, s, h, d, device="cuda", generator=g).bfloat16() for _ in comms]
        for t in qs + ks + vs:
            t.requires_grad_()
        torch.cuda.synchronize()
        outs = {}

        def step():
            outs["g"] = tilewire.for_each_rank(comms, lambda c: torch.autograd.grad(
                mods[c.rank](qs[c.rank], ks[c.rank], vs[c.rank]),
                (qs[c.rank], ks[c.rank], vs[c.rank]), douts[c.rank]))

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        with torch.no_grad():
            for t in qs + ks + vs + douts:
                t.copy_(torch.randn(t.shape, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        replayed = [[x.clone() for x in grads] for grads in outs["g"]]
        step()
        torch.cuda.synchronize()
        for r in range(world):
            for i, name in enumerate("qkv"):
                assert torch.equal(replayed[r][i], outs["g"][r][i]), "rank %d d%s" % (r, name)
        graph = None
        outs.clear()
    finally:
        mods = None
        torch.cuda.synchronize()
        for c in comms:
            c.close()


def test_module_backward_under_torch_compile():
    """A loss through RingAttention under torch.compile(fullgraph=True) at world 1: the eager
    gradients' bits (the compiled graphs hand the staging and backward ops the module's own
    symmetric buffers; the library refuses anything else)."""
    b, s, h, d = 1, 256, 4, 64
    comms, mods, qs, ks, vs = _module_case(1, 23)
    try:
        mods[0].reserve(b, s, h, d, grad=True)
        q, k, v = (t.requires_grad_() for t in (qs[0], ks[0], vs[0]))
        torch.cuda.synchronize()

        def loss(q, k, v):
            return (mods[0](q, k, v).float() ** 2).sum()

        fn = torch.compile(loss, fullgraph=True)
        want = tilewire.for_each_rank(comms, lambda c: torch.autograd.grad(loss(q, k, v),
                                                                           (q, k, v)))[0]
        got = tilewire.for_each_rank(comms, lambda c: torch.autograd.grad(fn(q, k, v),
                                                                          (q, k, v)))[0]
        torch.cuda.synchronize()
        for name, g, w in zip("qkv", got, want):
            assert torch.equal(g, w), "d%s" % name
    finally:
        mods = None
        torch.cuda.synchronize()
        for c in comms:
            c.close()


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (2, 2)])
def test_module_across_nodes_matches_one_node(nodes, per_node):
    """Across virtual nodes (the verbs test double), tilewire.nn.RingAttention's output and
    gradients (the other nodes' shards gathered into the comm's scratch first) are bitwise the
    same module's on one node of the same world."""
    world, b, s, hq, hk, d = nodes * per_node, 1, 128, 8, 2, 64
    g = torch.Generator(device="cuda").manual_seed(53)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).bfloat16()

    inputs = [(rand(b, s, hq, d), rand(b, s, hk, d), rand(b, s, hk, d), rand(b, s, hq, d))
              for _ in range(world)]
    results = []
    for comms in (tilewire.init_virtual(world), init_nodes(nodes, per_node, "ib")):
        try:
            mods = [tilewire.nn.RingAttention(c, causal=True) for c in comms]
            for m in mods:
                m.reserve(b, s, hk, d, heads_q=hq, grad=True)
            leaves = [tuple(t.clone().requires_grad_() for t in x[:3]) for x in inputs]
            torch.cuda.synchronize()

            def step(c):
                q, k, v = leaves[c.rank]
                o = mods[c.rank](q, k, v)
                return (o.detach(),) + torch.autograd.grad(o, (q, k, v), inputs[c.rank][3])

            results.append(tilewire.for_each_rank(comms, step))
            torch.cuda.synchronize()
            mods = leaves = None
        finally:
            torch.cuda.synchronize()
            for c in comms:
                c.close()
    one, many = results
    for r in range(world):
        for i, name in enumerate(("o", "dq", "dk", "dv")):
            assert torch.equal(many[r][i], one[r][i]), "rank %d %s" % (r, name)
