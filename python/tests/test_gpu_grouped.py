"""tilewire.grouped_gemm on a Hopper GPU: every group's rows bitwise tilewire.gemm of them and
near the float reference, rows past offsets[groups] untouched, fp32 output, strided operands,
CUDA graph replays reading new offsets, torch.compile, bad arguments, and torch._grouped_mm
where this torch has it. Skipped without torch or without a Hopper GPU."""

import ctypes
import random

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
import tilewire._torch  # noqa: E402 - registers the custom ops, torch.ops.tilewire.*
from _gpu import TOL, bf16, ref_product, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]

TILE = 128  # each group's rows are padded to a multiple of this (tilewire.h)


def _counts(groups, seed):
    """Random group sizes, multiples of 128 rows (0 to 512), one group empty and another not."""
    rng = random.Random(seed)
    counts = [TILE * rng.choice([0, 0, 1, 1, 2, 3, 4]) for _ in range(groups)]
    empty = rng.randrange(groups)
    counts[empty] = 0
    if groups > 1:
        counts[(empty + 1 + rng.randrange(groups - 1)) % groups] = TILE * rng.randint(1, 4)
    return counts


def _offsets(counts, device="cuda"):
    """int32 [groups + 1]: 0, then the running sums of counts."""
    ends = [0]
    for c in counts:
        ends.append(ends[-1] + c)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _inputs(groups, n, k, m, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=bf16, generator=g)
    b = torch.randn(groups, n, k, device="cuda", dtype=bf16, generator=g)
    return a, b


def _spans(offsets):
    """[(g, start, end)] of the groups, from the host's copy of offsets."""
    ends = offsets.tolist()
    return [(g, ends[g], ends[g + 1]) for g in range(len(ends) - 1)]


def _assert_groups(out, a, b, offsets, dtype):
    """Every group's rows bitwise tilewire.gemm of them (the same core, the same accumulation
    order) and within the dtype's tolerance of the float reference."""
    for g, s, e in _spans(offsets):
        if s == e:
            continue
        want = tilewire.gemm(a[s:e], b[g], out_dtype=dtype)
        assert torch.equal(out[s:e], want), "group %d, rows [%d, %d): not tw_gemm's bits" % (
            g, s, e)
        assert rel_err(out[s:e], ref_product(a[s:e], b[g])) < TOL[dtype], "group %d" % g


# (groups, N, K): N with a tail past the 128-wide tiles, K not a multiple of 64, many groups
SHAPES = [(4, 256, 512), (7, 264, 72), (16, 1024, 1024), (3, 8, 8), (64, 128, 256)]


@pytest.mark.parametrize("dtype", [bf16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_groups_are_tw_gemm_and_the_tail_is_untouched(shape, dtype):
    groups, n, k = shape
    counts = _counts(groups, seed=groups * 31 + n)
    offsets = _offsets(counts)
    end = sum(counts)
    m = end + 200  # the bound past the live rows, not a multiple of the tile
    a, b = _inputs(groups, n, k, m, seed=n + k)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    assert tilewire.grouped_gemm(a, b, offsets, out=out) is out
    _assert_groups(out, a, b, offsets, dtype)
    assert torch.isnan(out[end:]).all(), "wrote a row past offsets[groups]"
    fresh = tilewire.grouped_gemm(a, b, offsets, out_dtype=dtype)
    assert fresh.shape == (m, n) and fresh.dtype == dtype and fresh.device == a.device
    assert torch.equal(fresh[:end], out[:end])


def test_default_out_is_bf16_and_all_groups_empty_writes_nothing():
    a, b = _inputs(3, 64, 64, 256, seed=1)
    offsets = _offsets([128, 0, 128])
    out = tilewire.grouped_gemm(a, b, offsets)
    assert out.dtype == bf16 and out.shape == (256, 64)
    _assert_groups(out, a, b, offsets, bf16)
    poisoned = torch.full((256, 64), float("nan"), device="cuda", dtype=bf16)
    tilewire.grouped_gemm(a, b, _offsets([0, 0, 0]), out=poisoned)
    assert torch.isnan(poisoned).all()


def test_one_group_is_tw_gemm():
    a, b = _inputs(1, 512, 384, 1024, seed=2)
    out = tilewire.grouped_gemm(a, b, _offsets([1024]))
    assert torch.equal(out, tilewire.gemm(a, b[0]))


def test_strided_operands_and_out():
    groups, n, k = 5, 136, 200
    counts = [256, 0, 128, 384, 128]
    offsets, end = _offsets(counts), sum(counts)
    m = end + 128
    g = torch.Generator(device="cuda").manual_seed(3)
    a_big = torch.randn(m, k + 16, device="cuda", dtype=bf16, generator=g)
    b_rows = torch.randn(groups * n, k + 8, device="cuda", dtype=bf16, generator=g)
    a = a_big[:, :k]  # rows of stride k + 16
    b = b_rows.view(groups, n, k + 8)[:, :, :k]  # rows of stride k + 8, groups n rows apart
    out_big = torch.full((m, n + 8), float("nan"), device="cuda", dtype=torch.float32)
    out = out_big[:, :n]
    tilewire.grouped_gemm(a, b, offsets, out=out)
    _assert_groups(out, a, b, offsets, torch.float32)
    assert torch.isnan(out_big[:, n:]).all(), "wrote outside out's columns"
    assert torch.isnan(out[end:]).all(), "wrote a row past offsets[groups]"


def test_k_zero_zeroes_the_groups_rows_only():
    a = torch.empty(384, 0, device="cuda", dtype=bf16)
    b = torch.empty(2, 64, 0, device="cuda", dtype=bf16)
    out = torch.full((384, 64), float("nan"), device="cuda", dtype=bf16)
    tilewire.grouped_gemm(a, b, _offsets([128, 128]), out=out)
    assert torch.equal(out[:256], torch.zeros(256, 64, device="cuda", dtype=bf16))
    assert torch.isnan(out[256:]).all()


def test_side_stream_orders_with_it():
    a, b = _inputs(4, 512, 512, 2048, seed=4)
    offsets = _offsets([512, 1024, 0, 512])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = tilewire.grouped_gemm(a, b, offsets)
        first = out[:512].float().sum()  # the same stream: sees the finished product
    torch.cuda.current_stream().wait_stream(s)
    assert torch.allclose(first, ref_product(a[:512], b[0]).sum(), rtol=1e-2, atol=1.0)


def test_fast_lane_calls_match():
    a, b = _inputs(4, 256, 256, 1024, seed=5)
    offsets = _offsets([256, 0, 512, 128])
    out = torch.empty(1024, 256, device="cuda", dtype=bf16)
    for seed in (6, 7, 8):  # the first call goes the whole way, the others may take the lane
        a2, b2 = _inputs(4, 256, 256, 1024, seed=seed)
        tilewire.grouped_gemm(a2, b2, offsets, out=out)
        _assert_groups(out, a2, b2, offsets, bf16)
        fresh = tilewire.grouped_gemm(a2, b2, offsets)
        assert torch.equal(fresh[:896], out[:896])


def test_cuda_graph_replays_read_new_offsets():
    """The graph captures the offsets' address, not their values: new offsets copied in before
    a replay give the new grouping (no host synchronisation in the captured call)."""
    groups, n, k, m = 6, 256, 192, 1536
    a, b = _inputs(groups, n, k, m, seed=9)
    offsets = _offsets([256, 128, 0, 384, 128, 0])
    out = torch.empty(m, n, device="cuda", dtype=bf16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
        tilewire.grouped_gemm(a, b, offsets, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tilewire.grouped_gemm(a, b, offsets, out=out)
    for counts in ([256, 128, 0, 384, 128, 0], [0, 0, 1536, 0, 0, 0],
                   [128, 256, 128, 0, 0, 640], [0] * 6, [128] * 6):
        offsets.copy_(_offsets(counts))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_groups(out, a, b, offsets, bf16)
        assert torch.isnan(out[sum(counts):]).all(), counts


def test_cuda_graph_offsets_written_inside_the_graph():
    """A kernel before it in the same graph writes the offsets (a router's counts, summed on
    the device), as an MoE layer's dispatch does."""
    groups, n, k, m = 4, 128, 128, 1024
    a, b = _inputs(groups, n, k, m, seed=10)
    counts = torch.tensor([128, 256, 0, 128], dtype=torch.int32, device="cuda")
    offsets = torch.zeros(groups + 1, dtype=torch.int32, device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=bf16)

    def step():
        offsets[1:] = torch.cumsum(counts, 0, dtype=torch.int32)
        tilewire.grouped_gemm(a, b, offsets, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new in ([128, 256, 0, 128], [512, 0, 384, 128], [0, 0, 0, 256]):
        counts.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert offsets.tolist() == _offsets(new).tolist()
        _assert_groups(out, a, b, offsets, bf16)
        assert torch.isnan(out[sum(new):]).all(), new


def test_matches_torch_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    groups, n, k = 8, 512, 1024
    counts = _counts(groups, seed=11)
    offsets, end = _offsets(counts), sum(counts)
    a, b = _inputs(groups, n, k, end + 256, seed=12)
    ours = tilewire.grouped_gemm(a, b, offsets)
    ends = offsets[1:].to(torch.int32)
    theirs = torch._grouped_mm(a, b.transpose(-2, -1), offs=ends)
    assert theirs.shape[-1] == n
    # the same products in bf16, each summed in its own order: close, not bitwise
    assert rel_err(ours[:end], theirs[:end].float()) < TOL[bf16]


def test_torch_compile_fullgraph():
    def f(a, b, offsets):
        return tilewire.grouped_gemm(a, b, offsets) * 2

    compiled = torch.compile(f, fullgraph=True)
    a, b = _inputs(3, 256, 128, 512, seed=13)
    offsets = _offsets([128, 0, 384])  # every row live: no uninitialised rows to compare
    out = compiled(a, b, offsets)
    assert torch.equal(out, tilewire.grouped_gemm(a, b, offsets) * 2)


def test_opcheck():
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    a, b = _inputs(3, 128, 64, 384, seed=14)
    offsets = _offsets([128, 0, 256])  # every row live, so every run gives the same bytes
    torch.library.opcheck(torch.ops.tilewire.grouped_gemm.default, (a, b, offsets, bf16))
    torch.library.opcheck(torch.ops.tilewire.grouped_gemm.default,
                          (a, b, offsets, torch.float32))


# ---- bad arguments ------------------------------------------------------------------------


def _front_end(call, cls, *needles):
    """Refused by the front end's own checks (the library is not called)."""
    with pytest.raises(cls) as info:
        call()
    assert not isinstance(info.value, tilewire.TilewireError), str(info.value)
    for needle in needles:
        assert needle in str(info.value), "%r not in %r" % (needle, str(info.value))


def _library(call, *needles):
    """Refused by tw_grouped_gemm: InvalidArgumentError with the library's message."""
    with pytest.raises(tilewire.InvalidArgumentError) as info:
        call()
    assert info.value.function == "tw_grouped_gemm", str(info.value)
    for needle in needles:
        assert needle in info.value.message, "%r not in %r" % (needle, info.value.message)


def test_bad_arguments_are_refused():
    groups, n, k, m = 3, 128, 128, 512
    a, b = _inputs(groups, n, k, m, seed=15)
    offsets = _offsets([128, 0, 256])
    a_was, b_was = a.clone(), b.clone()
    gg = tilewire.grouped_gemm
    _front_end(lambda: gg(a, b, offsets.cpu()), ValueError,
               "tilewire.grouped_gemm: offsets is on cpu; tilewire needs CUDA tensors")
    _front_end(lambda: gg(a, b, offsets.long()), TypeError,
               "tilewire.grouped_gemm: offsets must be torch.int32")
    _front_end(lambda: gg(a, b, offsets[:groups]), ValueError, "offsets must be 1-D [groups + 1=4]")
    _front_end(lambda: gg(a.cpu(), b, offsets), ValueError, "a is on cpu")
    _front_end(lambda: gg(a, b.float(), offsets), TypeError, "b must be torch.bfloat16")
    _front_end(lambda: gg(a, b[0], offsets), ValueError, "b must be 3-D [groups, N, K]")
    _front_end(lambda: gg(a, b[:, :, :64], offsets), ValueError, "K differ")
    _front_end(lambda: gg(a, b.transpose(1, 2), offsets), ValueError,
               "b must be row-major with unit stride")
    _front_end(lambda: gg(a, b[:, :64], offsets), ValueError,
               "b's groups must follow each other")
    _front_end(lambda: gg(a, b, offsets, out=torch.empty(m, n - 8, device="cuda", dtype=bf16)),
               ValueError, "out must be [M=%d, N=%d]" % (m, n))
    _front_end(lambda: gg(a, b, offsets, out=torch.empty(m, n, device="cuda",
                                                         dtype=torch.float16)),
               TypeError, "out must be torch.bfloat16 or torch.float32")
    _front_end(lambda: gg(a, b, offsets, out_dtype=torch.float16), TypeError, "out_dtype")
    _front_end(lambda: gg(a, b, offsets, out=torch.empty(m, n, device="cuda", dtype=bf16),
                          out_dtype=torch.float32), TypeError, "out is torch.bfloat16")
    base = torch.randn(m * k + 8, device="cuda", dtype=bf16)
    _front_end(lambda: gg(base[1:1 + m * k].view(m, k), b, offsets), ValueError,
               "16-byte aligned")
    # below the front end's checks: the library's
    _library(lambda: gg(a, b, offsets, out=a), "tw_grouped_gemm: out", "overlaps a")
    many = torch.zeros(65537, 8, 8, device="cuda", dtype=bf16)
    _library(lambda: gg(a[:, :8], many, torch.zeros(65538, dtype=torch.int32, device="cuda")),
             "tw_grouped_gemm: groups is 65537")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(m, n, device="cuda", dtype=bf16)
    args = tilewire.GroupedGemmArgs(a=a.data_ptr(), b=b.data_ptr(), out=out.data_ptr(),
                                    offsets=offsets.data_ptr(), m=m, n=n, k=k, groups=groups,
                                    sm_count=sms + 1)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _library(lambda: tilewire._lib.call("tw_grouped_gemm", ctypes.byref(args), stream),
             "tw_grouped_gemm: sm_count is %d" % (sms + 1))
    # nothing was written, and a valid call still works
    assert torch.equal(a, a_was) and torch.equal(b, b_was)
    _assert_groups(gg(a, b, offsets), a, b, offsets, bf16)
