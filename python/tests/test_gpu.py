"""GPU tests of the torch front end against torch references: gemm (shapes with tails,
strides, fp32 output, CUDA graph capture, torch.compile, autograd), allgather and ag_gemm on
virtual ranks sharing one GPU, and symmetric-tensor lifetime. Skipped without torch or
without a Hopper GPU."""

import gc
import warnings

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402

pytestmark = pytest.mark.gpu
bf16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _need_hopper(hopper):
    yield
    torch.cuda.synchronize()


def _ref(a, b):
    return a.float() @ b.float().t()


def _rel_err(x, ref):
    """Largest error relative to the largest reference value."""
    return ((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


TOL = {bf16: 1e-2, torch.float32: 1e-4}


def _inputs(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=bf16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=bf16, generator=g)
    return a, b


# ---- gemm ---------------------------------------------------------------------------------

GEMM_SHAPES = [
    (128, 256, 64),
    (1, 8, 8),
    (129, 264, 72),  # tails in M and N
    (1000, 1032, 520),
    (8, 8, 4096),
    (4096, 4096, 4096),
    (16, 8192, 1024),  # decode: swap-AB tiles of 16 rows (TW_GEMM_SWAP)
    (33, 1000, 520),  # 64-row swap tiles, m and n tails
]


@pytest.mark.parametrize("out_dtype", [bf16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_matches_torch(shape, out_dtype):
    a, b = _inputs(*shape)
    out = tilewire.gemm(a, b, out_dtype=out_dtype)
    assert out.shape == (shape[0], shape[1]) and out.dtype == out_dtype
    assert out.device == a.device
    assert _rel_err(out, _ref(a, b)) < TOL[out_dtype]


def test_gemm_strided_operands_and_out():
    m, n, k = 300, 136, 200
    a_big = torch.randn(m, k + 16, device="cuda", dtype=bf16)
    b_big = torch.randn(n, k + 8, device="cuda", dtype=bf16)
    out_big = torch.full((m, n + 8), float("nan"), device="cuda", dtype=torch.float32)
    a, b, out = a_big[:, :k], b_big[:, :k], out_big[:, :n]
    result = tilewire.gemm(a, b, out=out)
    assert result is out
    assert _rel_err(out, _ref(a, b)) < TOL[torch.float32]
    assert torch.isnan(out_big[:, n:]).all(), "wrote outside out"


def test_gemm_sm_count_and_determinism():
    a, b = _inputs(512, 512, 512, seed=1)
    first = tilewire.gemm(a, b, sm_count=16)
    again = tilewire.gemm(a, b, sm_count=16)
    assert torch.equal(first, again)
    assert _rel_err(first, _ref(a, b)) < TOL[bf16]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(tilewire.InvalidArgumentError, match="sm_count"):
        tilewire.gemm(a, b, sm_count=sms + 1)


@pytest.mark.parametrize("split_k", [-1, 2, 4, 8])
def test_gemm_split_k(split_k):
    """K slices (decode: 8 tiles of 128 x 128 over K=8192): against the float reference, the
    same bits on every run and under half the SMs (the split depends on the shape alone), and
    through torch.compile's op and out="""
    a, b = _inputs(64, 1024, 8192, seed=5)
    first = tilewire.gemm(a, b, split_k=split_k)
    assert _rel_err(first, _ref(a, b)) < TOL[bf16]
    again = tilewire.gemm(a, b, split_k=split_k, sm_count=66)
    assert torch.equal(first, again)
    out = torch.full((64, 1024), float("nan"), device="cuda", dtype=bf16)
    assert tilewire.gemm(a, b, out=out, split_k=split_k) is out
    assert torch.equal(out, first)
    assert torch.equal(torch.ops.tilewire.gemm(a, b, bf16, 0, split_k), first)


def test_gemm_split_k_workspace_bits():
    """split_k -1 runs a decode product's slices through a per-stream workspace as single CTAs
    (tw_gemm_args_t.workspace); the library's 8 slices there, given explicitly, sum through a
    cluster: the same bits, bf16 and fp32 out, swapped (M=16, 64) and not (M=128)"""
    for m in (16, 64, 128):
        a, b = _inputs(m, 1024, 8192, seed=11 + m)
        for dtype in (bf16, torch.float32):
            ws = tilewire.gemm(a, b, out_dtype=dtype, split_k=-1)
            tree = tilewire.gemm(a, b, out_dtype=dtype, split_k=8)
            assert torch.equal(ws, tree), "M=%d %s" % (m, dtype)
            assert torch.equal(tilewire.gemm(a, b, out_dtype=dtype, split_k=-1), ws)


def test_gemm_split_k_refused_values():
    a, b = _inputs(64, 64, 64)
    with pytest.raises(ValueError, match="split_k"):
        tilewire.gemm(a, b, split_k=3)


def test_gemm_zero_sizes():
    a, b = _inputs(0, 64, 32)
    assert tilewire.gemm(a, b).shape == (0, 64)
    a = torch.empty(16, 0, device="cuda", dtype=bf16)
    b = torch.empty(8, 0, device="cuda", dtype=bf16)
    assert torch.equal(tilewire.gemm(a, b), torch.zeros(16, 8, device="cuda", dtype=bf16))


def test_gemm_misaligned_pointer_is_refused():
    base = torch.randn(64 * 64 + 8, device="cuda", dtype=bf16)
    a = base[1:1 + 64 * 64].view(64, 64)  # 2 bytes past an aligned address
    b = torch.randn(64, 64, device="cuda", dtype=bf16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tilewire.gemm(a, b)


def test_gemm_on_a_side_stream_orders_with_it():
    a, b = _inputs(2048, 2048, 2048, seed=2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = tilewire.gemm(a, b)
        check = out.float().sum()  # same stream: must see the finished product
    torch.cuda.current_stream().wait_stream(s)
    assert torch.allclose(check, _ref(a, b).sum(), rtol=1e-2, atol=1.0)


def test_gemm_cuda_graph_capture():
    a, b = _inputs(256, 512, 128, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
        tilewire.gemm(a, b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tilewire.gemm(a, b)
    for seed in (4, 5):
        new_a, new_b = _inputs(256, 512, 128, seed=seed)
        a.copy_(new_a)
        b.copy_(new_b)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, _ref(new_a, new_b)) < TOL[bf16]


def test_gemm_torch_compile_fullgraph():
    def f(a, b):
        return tilewire.gemm(a, b) * 2 + 1

    compiled = torch.compile(f, fullgraph=True)
    a, b = _inputs(192, 256, 128, seed=6)
    out = compiled(a, b)
    assert _rel_err(out, _ref(a, b) * 2 + 1) < 2 * TOL[bf16]


def test_gemm_out_torch_compile_fullgraph():
    def f(a, b, out):
        tilewire.gemm(a, b, out=out)
        return out.sum()

    compiled = torch.compile(f, fullgraph=True)
    a, b = _inputs(64, 128, 64, seed=7)
    out = torch.empty(64, 128, device="cuda", dtype=torch.float32)
    total = compiled(a, b, out)
    assert _rel_err(out, _ref(a, b)) < TOL[torch.float32]
    assert torch.allclose(total, out.sum())


def test_gemm_opcheck():
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    a, b = _inputs(128, 64, 64, seed=8)
    # split_k defaults to 0 in the schema, so calls written before it existed still bind
    torch.library.opcheck(torch.ops.tilewire.gemm.default, (a, b, bf16, 0))
    a, b = _inputs(64, 128, 4096, seed=8)
    torch.library.opcheck(torch.ops.tilewire.gemm.default, (a, b, bf16, 0, 4))


def test_gemm_autograd():
    a, b = _inputs(64, 128, 64, seed=9)
    a.requires_grad_(True)
    b.requires_grad_(True)
    tilewire.gemm(a, b, out_dtype=torch.float32).sum().backward()
    ra, rb = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    (ra.float() @ rb.float().t()).sum().backward()
    assert _rel_err(a.grad, ra.grad.float()) < TOL[bf16]
    assert _rel_err(b.grad, rb.grad.float()) < TOL[bf16]


# ---- comms and symmetric tensors ----------------------------------------------------------


def _close(comms):
    gc.collect()
    for c in comms:
        c.close()


def test_virtual_comm_properties():
    comms = tilewire.init_virtual(4, config=tilewire.Config(ranks_per_node=2))
    try:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for r, c in enumerate(comms):
            assert (c.rank, c.size, c.device) == (r, 4, 0)
            assert (c.node, c.nodes, c.local_rank, c.local_size) == (r // 2, 2, r % 2, 2)
            assert 0 < c.sm_budget <= sms // 4
            assert c.async_error() is None
            assert "rank %d of 4" % r in repr(c)
    finally:
        _close(comms)
    assert comms[0].closed


def test_symmetric_tensors_are_freed_with_their_last_view():
    comms = tilewire.init_virtual(2)
    try:
        ts = tilewire.symmetric_empty(comms, (4, 256), torch.float32)
        assert ts[0].shape == (4, 256) and ts[0].dtype == torch.float32
        assert ts[0].device == torch.device("cuda", 0)
        assert ts[0].data_ptr() != ts[1].data_ptr()
        assert all(tilewire.is_symmetric(c, t) for c, t in zip(comms, ts))
        view = ts[0][1:]
        ts[0].fill_(3.0)
        del ts
        gc.collect()
        assert len(comms[0].live_allocations()) == 1  # the view keeps rank 0's alive
        assert comms[1].live_allocations() == []
        assert view.sum().item() == 3.0 * 3 * 256
        del view
        gc.collect()
        assert comms[0].live_allocations() == []
    finally:
        _close(comms)


def test_close_with_a_live_symmetric_tensor_warns():
    comms = tilewire.init_virtual(1)
    t = comms[0].empty((64,))
    with pytest.warns(RuntimeWarning, match="still referenced"):
        comms[0].close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del t  # its deleter must not free again after close
        gc.collect()


# ---- allgather ----------------------------------------------------------------------------


@pytest.mark.parametrize("elements", [8, 4096, 1 << 21])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_allgather_virtual_ranks(world, elements):
    comms = tilewire.init_virtual(world)
    try:
        outs = tilewire.symmetric_empty(comms, (world * elements,), bf16)
        for it in range(3):  # epochs advance: repeated calls must keep working
            xs = [torch.randn(elements, device="cuda", dtype=bf16) + 10 * r + it
                  for r in range(world)]
            results = tilewire.for_each_rank(
                comms, lambda c: tilewire.allgather(c, xs[c.rank], outs[c.rank]))
            torch.cuda.synchronize()
            ref = torch.cat(xs)
            for r in range(world):
                assert results[r] is outs[r]
                assert torch.equal(outs[r], ref), "rank %d, iteration %d" % (r, it)
        for c in comms:
            assert c.async_error() is None
        outs.clear()
    finally:
        _close(comms)


def test_allgather_2d_in_place():
    world, m, k = 4, 32, 64
    comms = tilewire.init_virtual(world)
    try:
        outs = tilewire.symmetric_empty(comms, (world * m, k), bf16)
        shards = [outs[r][r * m:(r + 1) * m] for r in range(world)]
        for r in range(world):
            shards[r].copy_(torch.full((m, k), float(r + 1), device="cuda", dtype=bf16))
        expected = torch.cat([s.clone() for s in shards])
        tilewire.for_each_rank(comms, lambda c: tilewire.allgather(c, shards[c.rank],
                                                                   outs[c.rank]))
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(outs[r], expected)
        shards.clear()
        outs.clear()
    finally:
        _close(comms)


def _captured(step):
    """step() run once eagerly (it creates the per-rank streams), then captured: the graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_allgather_cuda_graph_capture():
    world, n = 2, 1 << 16
    comms = tilewire.init_virtual(world)
    try:
        outs = tilewire.symmetric_empty(comms, (world * n,), bf16)
        xs = [torch.zeros(n, device="cuda", dtype=bf16) for _ in range(world)]

        def step():
            tilewire.for_each_rank(comms, lambda c: tilewire.allgather(c, xs[c.rank],
                                                                       outs[c.rank]))

        graph = _captured(step)
        for it in range(3):
            for r in range(world):
                xs[r].copy_(torch.randn(n, device="cuda", dtype=bf16))
            graph.replay()
            torch.cuda.synchronize()
            ref = torch.cat(xs)
            for r in range(world):
                assert torch.equal(outs[r], ref), "replay %d, rank %d" % (it, r)
        for c in comms:
            assert c.async_error() is None
        del graph
        outs.clear()
    finally:
        _close(comms)


def test_fused_ops_cuda_graph_capture():
    """gemm_rs, gemm_ar and ag_gemm captured once (eager calls take the direct path, which
    capture must record like the dispatcher's), replayed with new inputs: every replay equals
    the eager calls' bits."""
    world, m, n, k = 2, 256, 264, 136
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        gathered = tilewire.symmetric_empty(comms, (m, k), bf16)
        a = [torch.zeros(m, k, device="cuda", dtype=bf16) for _ in comms]
        b = [torch.zeros(n, k, device="cuda", dtype=bf16) for _ in comms]
        sh = [torch.zeros(m // world, k, device="cuda", dtype=bf16) for _ in comms]
        rs = [torch.empty(m // world, n, device="cuda", dtype=bf16) for _ in comms]
        ar = [torch.empty(m, n, device="cuda", dtype=bf16) for _ in comms]
        ag = [torch.empty(m, n, device="cuda", dtype=bf16) for _ in comms]

        def step():
            tilewire.for_each_rank(comms, lambda c: (
                tilewire.gemm_rs(c, a[c.rank], b[c.rank], ws[c.rank], out=rs[c.rank]),
                tilewire.gemm_ar(c, a[c.rank], b[c.rank], ws[c.rank], out=ar[c.rank]),
                tilewire.ag_gemm(c, sh[c.rank], b[c.rank], gathered[c.rank], out=ag[c.rank])))

        graph = _captured(step)
        for it in range(3):
            for r in range(world):
                a[r].copy_(torch.randn(m, k, device="cuda", dtype=bf16))
                b[r].copy_(torch.randn(n, k, device="cuda", dtype=bf16))
                sh[r].copy_(torch.randn(m // world, k, device="cuda", dtype=bf16))
            graph.replay()
            torch.cuda.synchronize()
            replayed = [[t.clone() for t in outs] for outs in (rs, ar, ag)]
            step()
            torch.cuda.synchronize()
            for name, got, eager in zip(("rs", "ar", "ag"), replayed, (rs, ar, ag)):
                for r in range(world):
                    assert torch.equal(got[r], eager[r]), "%s replay %d rank %d" % (name, it, r)
            exact = _rank_ordered_sum(a, b).to(bf16)
            assert torch.equal(ar[0], exact), "replay %d: gemm_ar bits" % it
        for c in comms:
            assert c.async_error() is None
        del graph
        ws.clear()
        gathered.clear()
    finally:
        _close(comms)


def test_allgather_argument_errors_on_gpu():
    comms = tilewire.init_virtual(2)
    try:
        outs = tilewire.symmetric_empty(comms, (2 * 64,), bf16)
        x = torch.randn(64, device="cuda", dtype=bf16)
        plain = torch.empty(2 * 64, device="cuda", dtype=bf16)
        with pytest.raises(ValueError, match="symmetric"):
            tilewire.allgather(comms[0], x, plain)
        with pytest.raises(ValueError, match="world \\* x.numel"):
            tilewire.allgather(comms[0], x[:32], outs[0])
        with pytest.raises(TypeError, match="out is torch.bfloat16 but x is torch.float32"):
            tilewire.allgather(comms[0], x.float(), outs[0])
        with pytest.raises(ValueError, match="multiple of 16"):
            tilewire.allgather(comms[0], x[:3], outs[0][:6])
        with pytest.raises(ValueError, match="on cpu"):
            tilewire.allgather(comms[0], x.cpu(), outs[0])
        outs.clear()
    finally:
        _close(comms)


# ---- ag_gemm ------------------------------------------------------------------------------


def _ag_inputs(comms, m_local=256, n=512, k=384):
    """A symmetric a_gathered, a shard per rank and a shared b for ag_gemm tests."""
    world = len(comms)
    gathered = tilewire.symmetric_empty(comms, (world * m_local, k), bf16)
    a = [torch.randn(m_local, k, device="cuda", dtype=bf16) for _ in range(world)]
    b = torch.randn(n, k, device="cuda", dtype=bf16)
    return gathered, a, b


def _ag_gemm_checked(comms, gathered, a, b):
    """One ag_gemm on every rank: each rank's a_gathered holds every shard and its product is
    within bf16 tolerance of the float reference; returns the products."""
    outs = tilewire.for_each_rank(
        comms, lambda c: tilewire.ag_gemm(c, a[c.rank], b, gathered[c.rank]))
    torch.cuda.synchronize()
    full = torch.cat(a)
    ref = _ref(full, b)
    for r in range(len(comms)):
        assert outs[r].shape == (full.shape[0], b.shape[0])
        assert torch.equal(gathered[r], full), "rank %d's a_gathered" % r
        assert _rel_err(outs[r], ref) < TOL[bf16], "rank %d" % r
    return outs


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ag_gemm_virtual_ranks(world):
    m_local, n = 256, 512
    comms = tilewire.init_virtual(world)
    try:
        gathered, a, b = _ag_inputs(comms, m_local, n)
        _ag_gemm_checked(comms, gathered, a, b)
        for c in comms:
            assert c.async_error() is None
        gathered.clear()
    finally:
        _close(comms)


@pytest.mark.parametrize("world", [2, 4])
def test_ag_gemm_without_gathered_out(world):
    """gathered_out=False: the same product (bitwise), only the own slice of a_gathered kept."""
    m_local = 256
    comms = tilewire.init_virtual(world)
    try:
        gathered, a, b = _ag_inputs(comms, m_local)
        with_gather = tilewire.for_each_rank(
            comms, lambda c: tilewire.ag_gemm(c, a[c.rank], b, gathered[c.rank]))
        torch.cuda.synchronize()
        for _ in range(3):  # back to back, inputs in place in the own slice
            without = tilewire.for_each_rank(
                comms, lambda c: tilewire.ag_gemm(
                    c, gathered[c.rank][c.rank * m_local:(c.rank + 1) * m_local], b,
                    gathered[c.rank], gathered_out=False))
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(without[r], with_gather[r]), "rank %d" % r
            assert torch.equal(gathered[r][r * m_local:(r + 1) * m_local], a[r])
        for c in comms:
            assert c.async_error() is None
        with pytest.raises(TypeError, match="gathered_out"):
            tilewire.ag_gemm(comms[0], a[0], b, gathered[0], gathered_out=1)
        gathered.clear()
    finally:
        _close(comms)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ag_gemm_decode_shape(world):
    """Few output tiles over a long K (M=64 in all, N=1024, K=8192): the op runs tw_allgather
    then a split-K tw_gemm; against the float reference, the gathered A complete, and the same
    bits again in place (the shard in its slot) and back to back."""
    m_local, n, k = 64 // world, 1024, 8192
    comms = tilewire.init_virtual(world)
    try:
        gathered, a, b = _ag_inputs(comms, m_local, n, k)
        first = _ag_gemm_checked(comms, gathered, a, b)
        for _ in range(3):
            again = tilewire.for_each_rank(comms, lambda c: tilewire.ag_gemm(
                c, gathered[c.rank][c.rank * m_local:(c.rank + 1) * m_local], b,
                gathered[c.rank]))
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(again[r], first[r]), "rank %d: in place" % r
        for c in comms:
            assert c.async_error() is None
        gathered.clear()
    finally:
        _close(comms)


# ---- gemm_rs / gemm_ar --------------------------------------------------------------------


def _reduce_case(world, m_per_rank=128, n=256, k=192):
    m = m_per_rank * world
    a = [torch.randn(m, k, device="cuda", dtype=bf16) for _ in range(world)]
    b = [torch.randn(n, k, device="cuda", dtype=bf16) for _ in range(world)]
    return m, n, a, b


def _rank_ordered_sum(a, b, partials="fp32"):
    """The header's contract: tw_gemm (fp32 out; bf16 out with bf16 partials) per rank,
    summed in rank order in fp32."""
    dtype = torch.float32 if partials == "fp32" else bf16
    total = tilewire.gemm(a[0], b[0], out_dtype=dtype).float()
    for r in range(1, len(a)):
        total = total + tilewire.gemm(a[r], b[r], out_dtype=dtype).float()
    return total


@pytest.mark.parametrize("world,partials", [(1, "fp32"), (2, "fp32"), (4, "fp32"),
                                            (2, "bf16"), (3, "bf16")])
def test_gemm_rs_and_ar_virtual_ranks(world, partials):
    m, n, a, b = _reduce_case(world)
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        rs = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_rs(
            c, a[c.rank], b[c.rank], ws[c.rank], partials=partials))
        ar = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_ar(
            c, a[c.rank], b[c.rank], ws[c.rank], partials=partials))
        torch.cuda.synchronize()
        ref = sum(_ref(a[r], b[r]) for r in range(world))
        exact = _rank_ordered_sum(a, b, partials).to(bf16)
        rows = m // world
        for r in range(world):
            assert rs[r].shape == (rows, n) and ar[r].shape == (m, n)
            assert _rel_err(rs[r], ref[r * rows:(r + 1) * rows]) < TOL[bf16], "rs rank %d" % r
            assert _rel_err(ar[r], ref) < TOL[bf16], "ar rank %d" % r
            # Fixed, rank-ordered fp32 reduction: bitwise the unfused composition.
            assert torch.equal(rs[r], exact[r * rows:(r + 1) * rows]), "rs rank %d bits" % r
            assert torch.equal(ar[r], exact), "ar rank %d bits" % r
        for c in comms:
            assert c.async_error() is None
        ws.clear()
    finally:
        _close(comms)


@pytest.mark.parametrize("world,partials", [(2, "fp32"), (3, "bf16")])
def test_gemm_ar_symmetric_out(world, partials):
    """out_symmetric=True: the owners write every rank's symmetric out; the same bits as the
    rank-ordered composition."""
    m, n, a, b = _reduce_case(world, m_per_rank=256, n=520, k=264)
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        outs = tilewire.symmetric_empty(comms, (m, n), bf16)
        for o in outs:
            o.fill_(float("nan"))
        ar = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_ar(
            c, a[c.rank], b[c.rank], ws[c.rank], out=outs[c.rank], partials=partials,
            out_symmetric=True))
        torch.cuda.synchronize()
        exact = _rank_ordered_sum(a, b, partials).to(bf16)
        for r in range(world):
            assert ar[r].data_ptr() == outs[r].data_ptr()
            assert torch.equal(ar[r], exact), "ar rank %d bits" % r
        for c in comms:
            assert c.async_error() is None
        plain = torch.empty(m, n, device="cuda", dtype=bf16)
        with pytest.raises(ValueError, match="out_symmetric=True needs out"):
            tilewire.gemm_ar(comms[0], a[0], b[0], ws[0], out=plain, out_symmetric=True)
        ws.clear()
        outs.clear()
    finally:
        _close(comms)


def test_gemm_rs_argument_errors_on_gpu():
    comms = tilewire.init_virtual(2)
    try:
        a = torch.randn(6, 64, device="cuda", dtype=bf16)
        b = torch.randn(16, 64, device="cuda", dtype=bf16)
        with pytest.raises(ValueError, match="workspace is needed"):
            tilewire.gemm_rs(comms[0], a[:4], b, None)
        with pytest.raises(ValueError, match="multiple of world=2"):
            tilewire.gemm_rs(comms[0], a[:5], b, None)
        plain = torch.empty(1 << 20, device="cuda", dtype=torch.uint8)
        with pytest.raises(ValueError, match="not symmetric"):
            tilewire.gemm_ar(comms[0], a[:4], b, plain)
        with pytest.raises(ValueError, match="partials must be 'fp32' or 'bf16'"):
            tilewire.gemm_rs(comms[0], a[:4], b, plain, partials="fp16")
    finally:
        _close(comms)


# ---- the eager path without the dispatcher ------------------------------------------------


def test_direct_eager_path_is_taken_only_where_it_may_be():
    from tilewire import _torch

    if not _torch._FAST_EAGER:
        pytest.skip("this torch lacks what the direct path checks (it always dispatches)")
    a, b = _inputs(128, 256, 64)
    assert _torch._direct_ok((a, b, None), ())
    w = a.clone().requires_grad_()
    assert not _torch._direct_ok((w, b), ())  # autograd to record: the dispatcher
    with torch.no_grad():
        assert _torch._direct_ok((w, b), ())
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert not _torch._direct_ok((a, b), ())
    with torch.inference_mode():
        inf = torch.empty(4, device="cuda")
    assert not _torch._direct_ok((a, b, inf), (inf,))  # the dispatcher raises for these
    with torch.inference_mode():
        assert _torch._direct_ok((a, b, inf), (inf,))


def _poisoned_outs(world, m, n, m_local_ag, n_ag):
    """NaN-filled outputs of every op per rank: gemm_rs [m / world, n], gemm_ar and gemm
    [m, n], ag_gemm [world * m_local_ag, n_ag]."""
    def nan(rows, cols):
        return [torch.full((rows, cols), float("nan"), device="cuda", dtype=bf16)
                for _ in range(world)]
    return {"rs": nan(m // world, n), "ar": nan(m, n), "ag": nan(world * m_local_ag, n_ag),
            "gemm": nan(m, n)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_direct_eager_path_matches_the_dispatcher(world, monkeypatch):
    """Every op, eager, with and without the dispatcher: the same bits, and the written
    tensors' version counters bumped alike."""
    from tilewire import _torch

    m, n, a, b = _reduce_case(world, m_per_rank=128, n=264, k=136)
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        gathered, sh, bg = _ag_inputs(comms, 128, 264)
        results = {}
        for fast in (True, False):
            monkeypatch.setattr(_torch, "_FAST_EAGER", fast and _torch._FAST_EAGER)
            outs = _poisoned_outs(world, m, n, 128, 264)
            versions = {k: [t._version for t in v] for k, v in outs.items()}
            tilewire.for_each_rank(comms, lambda c: (
                tilewire.gemm_rs(c, a[c.rank], b[c.rank], ws[c.rank], out=outs["rs"][c.rank]),
                tilewire.gemm_ar(c, a[c.rank], b[c.rank], ws[c.rank], out=outs["ar"][c.rank]),
                tilewire.ag_gemm(c, sh[c.rank], bg, gathered[c.rank], out=outs["ag"][c.rank]),
                tilewire.gemm(a[c.rank], b[c.rank], out=outs["gemm"][c.rank])))
            torch.cuda.synchronize()
            for k, v in outs.items():
                for r, t in enumerate(v):
                    assert t._version > versions[k][r], "%s rank %d: version not bumped" % (k, r)
            results[fast] = outs
        for k in results[True]:
            for r in range(world):
                assert torch.equal(results[True][k][r], results[False][k][r]), "%s rank %d" % (
                    k, r)
        exact = _rank_ordered_sum(a, b).to(bf16)
        assert torch.equal(results[True]["ar"][0], exact)
        for c in comms:
            assert c.async_error() is None
        ws.clear()
        gathered.clear()
    finally:
        _close(comms)


def test_direct_eager_path_takes_parameters():
    """nn.Parameter (a model's weights) takes the direct path; other subclasses dispatch."""
    from tilewire import _torch

    if not _torch._FAST_EAGER:
        pytest.skip("this torch lacks what the direct path checks (it always dispatches)")
    a, b = _inputs(128, 256, 64)
    w = torch.nn.Parameter(b.clone())
    assert not _torch._direct_ok((a, w), ())  # requires grad, grad mode on: autograd records
    with torch.no_grad():
        assert _torch._direct_ok((a, w), ())

    class Sub(torch.Tensor):
        pass

    assert not _torch._direct_ok((a, b.as_subclass(Sub)), ())


# ---- the eager fast lane ----------------------------------------------------------------------


def _lane_calls(comms, a, b, ws, sh, bg, gathered, outs):
    """Every op once on every rank (out given where outs has it, else allocated)."""
    def one(c):
        r = c.rank
        return (tilewire.gemm_rs(c, a[r], b[r], ws[r], out=outs["rs"][r] if outs else None),
                tilewire.gemm_ar(c, a[r], b[r], ws[r], out=outs["ar"][r] if outs else None),
                tilewire.ag_gemm(c, sh[r], bg, gathered[r],
                                 out=outs["ag"][r] if outs else None),
                tilewire.gemm(a[r], b[r], out=outs["gemm"][r] if outs else None),
                tilewire.gemm(a[r], b[r], out_dtype=torch.float32, split_k=-1))
    res = tilewire.for_each_rank(comms, one)
    torch.cuda.synchronize()
    return res


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fast_lane_matches_the_whole_way(world, monkeypatch):
    """Repeated calls with one signature take the fast lane (a copied args struct, new data
    pointers): with fresh data in the same tensors and in new ones, every op gives the bits
    the whole way gives (the lane off), and what the checks refuse is still refused."""
    from tilewire import _torch

    if not (_torch._LANE_ON and _torch._FAST_EAGER):
        pytest.skip("the fast lane is off (TILEWIRE_FAST_LANE=0, or no direct eager path)")
    m, n, a, b = _reduce_case(world, m_per_rank=128, n=264, k=136)
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        gathered, sh, bg = _ag_inputs(comms, 128, 264)
        bg = torch.nn.Parameter(bg, requires_grad=False)  # a weight: the direct path too
        _torch._lane.clear()
        got = {}
        for lane in (False, True):
            monkeypatch.setattr(_torch, "_LANE_ON", lane)
            torch.manual_seed(5)
            for t in a + b + sh:
                t.copy_(torch.randn_like(t))
            outs = _poisoned_outs(world, m, n, 128, 264)
            runs = []
            for i in range(3):  # with the lane: the first call fills it, the others hit
                if i == 2:  # fresh data in the same tensors
                    for t in a + b + sh:
                        t.copy_(torch.randn_like(t))
                versions = [t._version for v in outs.values() for t in v]
                fresh = _lane_calls(comms, a, b, ws, sh, bg, gathered, None)
                given = _lane_calls(comms, a, b, ws, sh, bg, gathered, outs)
                assert all(t._version > v for t, v in zip(
                    [t for v in outs.values() for t in v], versions)), "version not bumped"
                runs.append(([[x.clone() for x in r] for r in fresh],
                             [[x.clone() for x in r] for r in given]))
            got[lane] = runs
            if lane:
                assert len(_torch._lane) >= 5 * world, "the lane kept no entries"
        for i in range(3):
            for part in (0, 1):
                for r in range(world):
                    for j, (x, y) in enumerate(zip(got[True][i][part][r], got[False][i][part][r])):
                        assert torch.equal(x, y), "call %d %s rank %d op %d" % (
                            i, ("fresh", "given")[part], r, j)
        # what the whole way refuses, the lane refuses too
        c = comms[0]
        bad = torch.empty(m * n + 8, device="cuda", dtype=bf16)[1:1 + m * n].view(m, n)
        with pytest.raises(ValueError, match="not 16-byte aligned"):
            tilewire.gemm(a[0], b[0], out=bad)
        if world > 1:
            with pytest.raises(ValueError, match="multiple of world"):
                tilewire.gemm_rs(c, a[0][:m - 1], b[0], ws[0])
        _assert_clean(comms, ws, gathered)
    finally:
        _close(comms)


def test_fast_lane_forgets_a_freed_symmetric_tensor():
    """A symmetric workspace freed after calls that filled the lane is refused again."""
    from tilewire import _torch

    if not (_torch._LANE_ON and _torch._FAST_EAGER):
        pytest.skip("the fast lane is off")
    m, n = 128, 256
    comms = tilewire.init_virtual(2)
    try:
        c = comms[0]
        ws = c.empty((c.gemm_rs_workspace_size(2 * m, n),), torch.uint8)
        plain = torch.empty_like(ws)
        wss = [ws, comms[1].empty((ws.numel(),), torch.uint8)]
        a2 = [torch.randn(2 * m, 64, device="cuda", dtype=bf16) for _ in comms]
        b2 = [torch.randn(n, 64, device="cuda", dtype=bf16) for _ in comms]
        for _ in range(2):
            tilewire.for_each_rank(comms, lambda cc: tilewire.gemm_rs(
                cc, a2[cc.rank], b2[cc.rank], wss[cc.rank]))
        torch.cuda.synchronize()
        gen = c.alloc_generation
        with pytest.raises(ValueError, match="not symmetric"):
            tilewire.gemm_rs(c, a2[0], b2[0], plain)
        for cc, t in zip(comms, wss):  # collective; the tensors still view the memory
            cc.free(t.data_ptr())
        assert c.alloc_generation > gen
        with pytest.raises(ValueError, match="not symmetric"):
            tilewire.gemm_rs(c, a2[0], b2[0], ws)
        for cc in comms:
            assert cc.async_error() is None
        wss.clear()
        del ws
    finally:
        _close(comms)


# ---- autograd of the fused ops --------------------------------------------------------------


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _assert_clean(comms, *buffers):
    """No rank reported an asynchronous error; the symmetric buffers are dropped (before
    the comms close)."""
    for c in comms:
        assert c.async_error() is None
    for buf in buffers:
        buf.clear()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ag_gemm_backward_is_a_gemm_rs(world):
    """d/da and d/db of ag_gemm against the float reference: a's gradient is the
    reduce-scatter of grad_out @ b over ranks, b's grad_out.T @ the gathered a."""
    m_local, n, k = 128, 264, 136
    comms = tilewire.init_virtual(world)
    try:
        gathered = tilewire.symmetric_empty(comms, (world * m_local, k), bf16)
        gws = [tilewire.gemm_rs_workspace(c, world * m_local, k) for c in comms]
        a = _leaves([torch.randn(m_local, k, device="cuda", dtype=bf16) for _ in comms])
        b = _leaves([torch.randn(n, k, device="cuda", dtype=bf16) for _ in comms])
        g = [torch.randn(world * m_local, n, device="cuda", dtype=bf16) for _ in comms]
        outs = tilewire.for_each_rank(comms, lambda c: tilewire.ag_gemm(
            c, a[c.rank], b[c.rank], gathered[c.rank], grad_workspace=gws[c.rank]))
        assert all(o.grad_fn is not None for o in outs)
        tilewire.for_each_rank(comms, lambda c: outs[c.rank].backward(g[c.rank]))
        torch.cuda.synchronize()
        full = torch.cat([t.detach() for t in a]).float()
        d_full = sum(g[s].float() @ b[s].detach().float() for s in range(world))
        for r in range(world):
            assert _rel_err(outs[r], full @ b[r].detach().float().t()) < TOL[bf16]
            want_a = d_full[r * m_local:(r + 1) * m_local]
            assert _rel_err(a[r].grad, want_a) < 2e-2, "rank %d: d/da" % r
            assert _rel_err(b[r].grad, g[r].float().t() @ full) < 2e-2, "rank %d: d/db" % r
        _assert_clean(comms, gathered, gws)
    finally:
        _close(comms)


@pytest.mark.parametrize("world,partials", [(1, "fp32"), (2, "fp32"), (3, "bf16")])
def test_gemm_rs_backward_is_an_ag_gemm(world, partials):
    m, n, k = 128 * world, 264, 136
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        a = _leaves([torch.randn(m, k, device="cuda", dtype=bf16) for _ in comms])
        b = _leaves([torch.randn(n, k, device="cuda", dtype=bf16) for _ in comms])
        g = [torch.randn(m // world, n, device="cuda", dtype=bf16) for _ in comms]
        outs = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_rs(
            c, a[c.rank], b[c.rank], ws[c.rank], partials=partials))
        tilewire.for_each_rank(comms, lambda c: outs[c.rank].backward(g[c.rank]))
        torch.cuda.synchronize()
        g_full = torch.cat(g).float()
        for r in range(world):
            assert _rel_err(a[r].grad, g_full @ b[r].detach().float()) < 2e-2, "rank %d" % r
            assert _rel_err(b[r].grad, g_full.t() @ a[r].detach().float()) < 2e-2, "rank %d" % r
        _assert_clean(comms, ws)
    finally:
        _close(comms)


def test_gemm_ar_backward_is_local_and_errors_name_the_argument():
    world, m, n, k = 2, 256, 264, 136
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, n) for c in comms]
        a = _leaves([torch.randn(m, k, device="cuda", dtype=bf16) for _ in comms])
        b = _leaves([torch.randn(n, k, device="cuda", dtype=bf16) for _ in comms])
        g = torch.randn(m, n, device="cuda", dtype=bf16)  # a replicated loss: the same on all
        outs = tilewire.for_each_rank(comms, lambda c: tilewire.gemm_ar(
            c, a[c.rank], b[c.rank], ws[c.rank]))
        tilewire.for_each_rank(comms, lambda c: outs[c.rank].backward(g))
        torch.cuda.synchronize()
        for r in range(world):
            assert _rel_err(a[r].grad, g.float() @ b[r].detach().float()) < 2e-2
            assert _rel_err(b[r].grad, g.float().t() @ a[r].detach().float()) < 2e-2
        # ag_gemm: a requiring grad needs grad_workspace; b's grad needs the gathered a
        gathered = tilewire.symmetric_empty(comms, (world * 128, k), bf16)
        shard = torch.randn(128, k, device="cuda", dtype=bf16, requires_grad=True)
        with pytest.raises(ValueError, match="grad_workspace"):
            tilewire.ag_gemm(comms[0], shard, b[0].detach(), gathered[0])
        with pytest.raises(ValueError, match="gathered_out=True"):
            tilewire.ag_gemm(comms[0], shard.detach(), b[0], gathered[0], gathered_out=False)
        _assert_clean(comms, ws, gathered)
    finally:
        _close(comms)
