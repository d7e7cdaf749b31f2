"""tilewire.gemm against torch on a Hopper GPU: shapes with tails, strides, fp32 output,
split-K, CUDA graph capture, torch.compile, autograd. Skipped without torch or without a
Hopper GPU."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import TOL, bf16, gemm_inputs, ref_product, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]


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
    a, b = gemm_inputs(*shape)
    out = tilewire.gemm(a, b, out_dtype=out_dtype)
    assert out.shape == (shape[0], shape[1]) and out.dtype == out_dtype
    assert out.device == a.device
    assert rel_err(out, ref_product(a, b)) < TOL[out_dtype]


def test_gemm_strided_operands_and_out():
    m, n, k = 300, 136, 200
    a_big = torch.randn(m, k + 16, device="cuda", dtype=bf16)
    b_big = torch.randn(n, k + 8, device="cuda", dtype=bf16)
    out_big = torch.full((m, n + 8), float("nan"), device="cuda", dtype=torch.float32)
    a, b, out = a_big[:, :k], b_big[:, :k], out_big[:, :n]
    result = tilewire.gemm(a, b, out=out)
    assert result is out
    assert rel_err(out, ref_product(a, b)) < TOL[torch.float32]
    assert torch.isnan(out_big[:, n:]).all(), "wrote outside out"


def test_gemm_sm_count_and_determinism():
    a, b = gemm_inputs(512, 512, 512, seed=1)
    first = tilewire.gemm(a, b, sm_count=16)
    again = tilewire.gemm(a, b, sm_count=16)
    assert torch.equal(first, again)
    assert rel_err(first, ref_product(a, b)) < TOL[bf16]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(tilewire.InvalidArgumentError, match="sm_count"):
        tilewire.gemm(a, b, sm_count=sms + 1)


@pytest.mark.parametrize("split_k", [-1, 2, 4, 8])
def test_gemm_split_k(split_k):
    """K slices (decode: 8 tiles of 128 x 128 over K=8192): against the float reference, the
    same bits on every run and under half the SMs (the split depends on the shape alone), and
    through torch.compile's op and out="""
    a, b = gemm_inputs(64, 1024, 8192, seed=5)
    first = tilewire.gemm(a, b, split_k=split_k)
    assert rel_err(first, ref_product(a, b)) < TOL[bf16]
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
        a, b = gemm_inputs(m, 1024, 8192, seed=11 + m)
        for dtype in (bf16, torch.float32):
            ws = tilewire.gemm(a, b, out_dtype=dtype, split_k=-1)
            tree = tilewire.gemm(a, b, out_dtype=dtype, split_k=8)
            assert torch.equal(ws, tree), "M=%d %s" % (m, dtype)
            assert torch.equal(tilewire.gemm(a, b, out_dtype=dtype, split_k=-1), ws)


def test_gemm_split_k_refused_values():
    a, b = gemm_inputs(64, 64, 64)
    with pytest.raises(ValueError, match="split_k"):
        tilewire.gemm(a, b, split_k=3)


def test_gemm_zero_sizes():
    a, b = gemm_inputs(0, 64, 32)
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
    a, b = gemm_inputs(2048, 2048, 2048, seed=2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = tilewire.gemm(a, b)
        check = out.float().sum()  # same stream: must see the finished product
    torch.cuda.current_stream().wait_stream(s)
    assert torch.allclose(check, ref_product(a, b).sum(), rtol=1e-2, atol=1.0)


def test_gemm_cuda_graph_capture():
    a, b = gemm_inputs(256, 512, 128, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
        tilewire.gemm(a, b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tilewire.gemm(a, b)
    for seed in (4, 5):
        new_a, new_b = gemm_inputs(256, 512, 128, seed=seed)
        a.copy_(new_a)
        b.copy_(new_b)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_product(new_a, new_b)) < TOL[bf16]


def test_gemm_torch_compile_fullgraph():
    def f(a, b):
        return tilewire.gemm(a, b) * 2 + 1

    compiled = torch.compile(f, fullgraph=True)
    a, b = gemm_inputs(192, 256, 128, seed=6)
    out = compiled(a, b)
    assert rel_err(out, ref_product(a, b) * 2 + 1) < 2 * TOL[bf16]


def test_gemm_out_torch_compile_fullgraph():
    def f(a, b, out):
        tilewire.gemm(a, b, out=out)
        return out.sum()

    compiled = torch.compile(f, fullgraph=True)
    a, b = gemm_inputs(64, 128, 64, seed=7)
    out = torch.empty(64, 128, device="cuda", dtype=torch.float32)
    total = compiled(a, b, out)
    assert rel_err(out, ref_product(a, b)) < TOL[torch.float32]
    assert torch.allclose(total, out.sum())


def test_gemm_opcheck():
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    a, b = gemm_inputs(128, 64, 64, seed=8)
    # split_k defaults to 0 in the schema, so calls written before it existed still bind
    torch.library.opcheck(torch.ops.tilewire.gemm.default, (a, b, bf16, 0))
    a, b = gemm_inputs(64, 128, 4096, seed=8)
    torch.library.opcheck(torch.ops.tilewire.gemm.default, (a, b, bf16, 0, 4))


def test_gemm_autograd():
    a, b = gemm_inputs(64, 128, 64, seed=9)
    a.requires_grad_(True)
    b.requires_grad_(True)
    tilewire.gemm(a, b, out_dtype=torch.float32).sum().backward()
    ra, rb = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    (ra.float() @ rb.float().t()).sum().backward()
    assert rel_err(a.grad, ra.grad.float()) < TOL[bf16]
    assert rel_err(b.grad, rb.grad.float()) < TOL[bf16]
