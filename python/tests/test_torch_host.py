"""The torch front end's argument checks, which need torch but no GPU (CPU and meta tensors).
Skipped where torch is not installed."""

import ctypes
import re

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from tilewire import _eager, _lib, _ops, _torch  # noqa: E402

bf16 = torch.bfloat16


def _cpu(*shape, dtype=bf16):
    return torch.zeros(*shape, dtype=dtype)


def test_ops_are_registered():
    assert hasattr(torch.ops.tilewire, "gemm")
    assert hasattr(torch.ops.tilewire, "gemm_out")
    assert hasattr(torch.ops.tilewire, "allgather")
    assert hasattr(torch.ops.tilewire, "ag_gemm")
    assert hasattr(torch.ops.tilewire, "gemm_rs")
    assert hasattr(torch.ops.tilewire, "gemm_ar")
    assert hasattr(torch.ops.tilewire, "grouped_gemm")
    assert hasattr(torch.ops.tilewire, "grouped_gemm_out")
    schema = str(torch.ops.tilewire.grouped_gemm_out.default._schema)
    assert re.search(r"Tensor\(a\d*!\) out", schema), schema
    assert "Tensor(a" not in str(torch.ops.tilewire.grouped_gemm.default._schema)
    assert tilewire.grouped_gemm is _torch.grouped_gemm
    schema = str(torch.ops.tilewire.allgather.default._schema)
    # torch numbers the alias sets (a!, a2!, ...); what matters is that `out` is mutated.
    assert re.search(r"Tensor\(a\d*!\) out", schema), schema
    assert tilewire.gemm is _torch.gemm
    for op in (torch.ops.tilewire.gemm, torch.ops.tilewire.gemm_out):
        schema = str(op.default._schema)
        assert "split_k=0" in schema, schema


def test_gemm_fake_gives_the_output_shape():
    a = torch.empty(100, 64, dtype=bf16, device="meta")
    b = torch.empty(48, 64, dtype=bf16, device="meta")
    out = _ops._gemm_fake(a, b, torch.float32, 0)
    assert out.shape == (100, 48) and out.dtype == torch.float32
    out = _ops._gemm_fake(a, b, torch.bfloat16, 0, 8)
    assert out.shape == (100, 48) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "a, b, kwargs, exc, pattern",
    [
        (_cpu(16, 64, dtype=torch.float32), _cpu(8, 64), {}, TypeError, "a must be torch.bfloat16"),
        (_cpu(16, 64), _cpu(8, 64, dtype=torch.float16), {}, TypeError, "b must be torch.bfloat16"),
        ("nope", _cpu(8, 64), {}, TypeError, "a must be a torch.Tensor"),
        (_cpu(2, 16, 64), _cpu(8, 64), {}, ValueError, "a must be 2-D"),
        (_cpu(16, 64), _cpu(8, 32), {}, ValueError, "K differ"),
        (_cpu(16, 12), _cpu(8, 12), {}, ValueError, "K=12 .* multiple of 8"),
        (_cpu(16, 64), _cpu(12, 64), {}, ValueError, "N=12 .* multiple of 8"),
        (_cpu(64, 16).t(), _cpu(8, 64), {}, ValueError, "a must be row-major with unit stride"),
        (_cpu(16, 68)[:, :64], _cpu(8, 64), {}, ValueError, "a's row stride is 68"),
        (_cpu(16, 64), _cpu(8, 64), {"out_dtype": torch.float16}, TypeError, "out_dtype"),
        (_cpu(16, 64), _cpu(8, 64), {"sm_count": -1}, ValueError, "sm_count"),
        (_cpu(16, 64), _cpu(8, 64), {"sm_count": "4"}, TypeError, "sm_count"),
        (_cpu(16, 64), _cpu(8, 64), {"split_k": 3}, ValueError, "split_k"),
        (_cpu(16, 64), _cpu(8, 64), {"split_k": 2.0}, TypeError, "split_k"),
        (_cpu(16, 64), _cpu(8, 64), {}, ValueError, "a is on cpu; tilewire needs CUDA"),
    ],
)
def test_gemm_argument_errors(a, b, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        tilewire.gemm(a, b, **kwargs)


def test_grouped_gemm_fake_gives_the_output_shape():
    a = torch.empty(512, 64, dtype=bf16, device="meta")
    b = torch.empty(4, 48, 64, dtype=bf16, device="meta")
    offsets = torch.empty(5, dtype=torch.int32, device="meta")
    out = _ops._grouped_gemm_fake(a, b, offsets, torch.float32)
    assert out.shape == (512, 48) and out.dtype == torch.float32
    assert _ops._grouped_gemm_out_fake(a, b, offsets, out) is None


def _offs(n, dtype=torch.int32):
    return torch.zeros(n, dtype=dtype)


@pytest.mark.parametrize(
    "a, b, offsets, kwargs, exc, pattern",
    [
        (_cpu(16, 64, dtype=torch.float32), _cpu(2, 8, 64), _offs(3), {}, TypeError,
         "a must be torch.bfloat16"),
        (_cpu(16, 64), _cpu(2, 8, 64, dtype=torch.float16), _offs(3), {}, TypeError,
         "b must be torch.bfloat16"),
        ("nope", _cpu(2, 8, 64), _offs(3), {}, TypeError, "a must be a torch.Tensor"),
        (_cpu(16, 64), _cpu(2, 8, 64), [0, 0, 0], {}, TypeError,
         "offsets must be a torch.Tensor"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(3, torch.int64), {}, TypeError,
         "offsets must be torch.int32"),
        (_cpu(2, 16, 64), _cpu(2, 8, 64), _offs(3), {}, ValueError, "a must be 2-D"),
        (_cpu(16, 64), _cpu(8, 64), _offs(3), {}, ValueError, r"b must be 3-D \[groups, N, K\]"),
        (_cpu(16, 64), _cpu(2, 8, 32), _offs(3), {}, ValueError, "K differ"),
        (_cpu(16, 12), _cpu(2, 8, 12), _offs(3), {}, ValueError, "K=12 .* multiple of 8"),
        (_cpu(16, 64), _cpu(2, 12, 64), _offs(3), {}, ValueError, "N=12 .* multiple of 8"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(2), {}, ValueError,
         r"offsets must be 1-D \[groups \+ 1=3\], got shape \(2,\)"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(3).view(3, 1), {}, ValueError,
         "offsets must be 1-D"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(6)[::2], {}, ValueError,
         "offsets must be contiguous"),
        (_cpu(64, 16).t(), _cpu(2, 8, 64), _offs(3), {}, ValueError,
         "a must be row-major with unit stride"),
        (_cpu(16, 68)[:, :64], _cpu(2, 8, 64), _offs(3), {}, ValueError,
         "a's row stride is 68"),
        (_cpu(16, 64), _cpu(2, 64, 8).transpose(1, 2), _offs(3), {}, ValueError,
         "b must be row-major with unit stride"),
        (_cpu(16, 64), _cpu(2, 12, 64)[:, :8], _offs(3), {}, ValueError,
         "b's groups must follow each other"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(3), {"out_dtype": torch.float16}, TypeError,
         "out_dtype"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(3), {"out": _cpu(16, 8, dtype=torch.float16)},
         TypeError, "out must be torch.bfloat16 or torch.float32"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(3), {"out": _cpu(16, 16)}, ValueError,
         r"out must be \[M=16, N=8\], got shape \(16, 16\)"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(3),
         {"out": _cpu(16, 8), "out_dtype": torch.float32}, TypeError,
         "out is torch.bfloat16 but out_dtype is torch.float32"),
        (_cpu(16, 64), _cpu(2, 8, 64), _offs(3), {}, ValueError,
         "a is on cpu; tilewire needs CUDA"),
    ],
)
def test_grouped_gemm_argument_errors(a, b, offsets, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        tilewire.grouped_gemm(a, b, offsets, **kwargs)


def test_grouped_gemm_checks_run_on_meta_tensors():
    a = torch.empty(256, 64, dtype=bf16, device="meta")
    b = torch.empty(2, 8, 64, dtype=bf16, device="meta")
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    # meta tensors (torch.compile's fake ones alike) pass every check up to the device one,
    # which names the argument
    with pytest.raises(ValueError, match="tilewire.grouped_gemm: a is on meta"):
        tilewire.grouped_gemm(a, b, offsets)
    with pytest.raises(ValueError, match="out must be"):
        _ops._check_grouped_gemm(a, b, offsets, torch.empty(256, 16, dtype=bf16, device="meta"),
                                 None)


def test_gemm_out_errors():
    a, b = torch.empty(16, 64, dtype=bf16, device="meta"), torch.empty(8, 64, dtype=bf16,
                                                                       device="meta")
    # meta tensors pass every check up to the device one, which names the argument.
    with pytest.raises(ValueError, match="a is on meta"):
        tilewire.gemm(a, b)
    with pytest.raises(TypeError, match="out must be torch.bfloat16 or torch.float32"):
        _ops._check_gemm(a, b, torch.empty(16, 8, dtype=torch.float16, device="meta"), None, 0)


def test_allgather_argument_errors():
    x = _cpu(8)
    with pytest.raises(TypeError, match="comm must be a tilewire.Comm"):
        tilewire.allgather("comm", x, x)
    with pytest.raises(TypeError, match="comm must be a tilewire.Comm"):
        tilewire.ag_gemm(None, x, x, x)
    with pytest.raises(TypeError, match="comm must be a tilewire.Comm"):
        tilewire.barrier(0)
    with pytest.raises(TypeError, match="comm must be a tilewire.Comm"):
        tilewire.gemm_rs(None, x, x, None)
    with pytest.raises(TypeError, match="comm must be a tilewire.Comm"):
        tilewire.gemm_ar(None, x, x, None)


def test_init_without_a_way_to_share_the_id(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is initialised")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present (the device would be set first)")
    with pytest.raises(RuntimeError, match="no way to receive the unique id"):
        tilewire.init()


def test_init_waits_are_bounded_and_named(monkeypatch):
    """A rank whose peers never come (rank 0 failed before init) gives up after the timeout
    with what it waited for, both through a given store and through MASTER_ADDR's."""
    import datetime
    import socket

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is initialised")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    short = datetime.timedelta(seconds=1)
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 gave up after 0:00:01 waiting for "
                       r"rank 0's unique id \(store key tilewire/unique_id/"):
        tilewire.init(store=torch.distributed.HashStore(), timeout=short)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(RuntimeError, match="rank 1 of 2 gave up after 0:00:01 waiting for "
                       "rank 0's store at 127.0.0.1:%d" % port):
        tilewire.init(timeout=short)


def test_init_single_process_without_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(tilewire.TilewireError) as info:
        tilewire.init()
    assert info.value.status in (tilewire.Status.ERR_NO_DEVICE, tilewire.Status.ERR_CUDA)


# ---- the eager fast lane, with the library call stubbed (CPU tensors) -----------------------


@pytest.fixture
def stubbed_gemm(monkeypatch):
    """tilewire.gemm and tilewire.grouped_gemm on CPU tensors with the C call recorded instead
    of made: returns the list of (function, args struct copy) calls. The device checks, stream
    and device queries are stubbed; everything else (the checks, the lane) is the real code."""
    if not (_eager._FAST_EAGER and _eager._LANE_ON):
        pytest.skip("the fast lane is off (TILEWIRE_FAST_LANE=0, or no direct eager path)")
    import contextlib
    import ctypes

    calls = []

    structs = {"tw_gemm": _lib.GemmArgs, "tw_grouped_gemm": _lib.GroupedGemmArgs}

    def fake_call(name, *args, comm=None):
        cls = structs[name]
        struct = ctypes.cast(args[0], ctypes.POINTER(cls)).contents
        calls.append((name, cls.from_buffer_copy(struct)))

    monkeypatch.setattr(_lib, "call", fake_call)
    # tilewire.gemm's module reads these by its own names (imported from _glue)
    monkeypatch.setattr(_ops, "_check_cuda", lambda *a, **k: None)
    monkeypatch.setattr(_ops, "_stream", lambda device: ctypes.c_void_p(0))
    monkeypatch.setattr(_ops, "_current_device", lambda: None)  # CPU tensors: index None
    monkeypatch.setattr(_ops, "_on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_eager, "_lane", {})
    return calls


def test_fast_lane_reuses_checked_arguments(stubbed_gemm):
    calls = stubbed_gemm
    a, b = torch.randn(16, 64).to(bf16), torch.randn(24, 64).to(bf16)
    out = torch.empty(16, 24, dtype=bf16)
    tilewire.gemm(a, b, out=out)  # the whole way: fills the lane
    assert len(_eager._lane) == 1 and len(calls) == 1
    first = calls[-1][1]
    a2 = torch.randn(16, 64).to(bf16)  # new data pointer, same signature: a hit
    v = out._version
    tilewire.gemm(a2, b, out=out)
    assert len(_eager._lane) == 1 and len(calls) == 2
    hit = calls[-1][1]
    assert hit.a == a2.data_ptr() and hit.b == b.data_ptr() and hit.c == out.data_ptr()
    assert out._version == v + 1  # written: bumped as the dispatcher would
    for f in ("m", "n", "k", "lda", "ldb", "ldc", "c_dtype", "sm_count", "split_k", "size",
              "version"):
        assert getattr(hit, f) == getattr(first, f), f
    fresh = tilewire.gemm(a2, b)  # out allocated: its own signature, then hits
    fresh2 = tilewire.gemm(a, b)
    assert len(_eager._lane) == 2 and calls[-1][1].c == fresh2.data_ptr()
    assert fresh.shape == (16, 24) and fresh.dtype == bf16
    # a weight that is an nn.Parameter takes the direct path and the lane
    w = torch.nn.Parameter(b.clone(), requires_grad=False)
    tilewire.gemm(a, w, out=out)
    tilewire.gemm(a, w, out=out)
    assert calls[-1][1].b == w.data_ptr()


def test_fast_lane_never_skips_a_check(stubbed_gemm):
    calls = stubbed_gemm
    a, b = torch.randn(16, 64).to(bf16), torch.randn(24, 64).to(bf16)
    out = torch.empty(16, 24, dtype=bf16)
    tilewire.gemm(a, b, out=out, sm_count=1)
    tilewire.gemm(a, b, out=out, sm_count=1)
    n = len(calls)
    # True == 1 and hashes alike: the signature carries the type, so the check still runs
    with pytest.raises(TypeError, match="sm_count must be an int"):
        tilewire.gemm(a, b, out=out, sm_count=True)
    # same shape, strides and dtype, but a data pointer off 16 bytes: the whole way refuses it
    bad = torch.empty(16 * 24 + 8, dtype=bf16)[1:1 + 16 * 24].view(16, 24)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        tilewire.gemm(a, b, out=bad, sm_count=1)
    with pytest.raises(TypeError, match="out_dtype"):  # unhashable: no signature at all
        tilewire.gemm(a, b, out_dtype=[bf16])
    assert len(calls) == n  # none of them reached the library
    # a tensor subclass goes through the dispatcher (no CPU kernel for the op here), not the
    # lane
    class Sub(torch.Tensor):
        pass

    with pytest.raises(NotImplementedError):
        tilewire.gemm(a.as_subclass(Sub), b, out=out, sm_count=1)
    assert len(calls) == n


def test_fast_lane_is_off_while_the_direct_path_is(stubbed_gemm, monkeypatch):
    calls = stubbed_gemm
    a, b = torch.randn(16, 64).to(bf16), torch.randn(24, 64).to(bf16)
    out = torch.empty(16, 24, dtype=bf16)
    tilewire.gemm(a, b, out=out)
    tilewire.gemm(a, b, out=out)  # a hit
    n = len(calls)
    assert n == 2 and len(_eager._lane) == 1
    # autograd to record, or TILEWIRE_EAGER_DISPATCH=1's state: the dispatcher (which has no
    # CPU kernel for the op: NotImplementedError), never the lane
    w = b.clone().requires_grad_()
    with pytest.raises(NotImplementedError):
        tilewire.gemm(a, w, out=out)
    monkeypatch.setattr(_eager, "_FAST_EAGER", False)
    with pytest.raises(NotImplementedError):
        tilewire.gemm(a, b, out=out)
    assert len(calls) == n


def test_grouped_gemm_fills_the_args_and_the_lane_reuses_them(stubbed_gemm):
    calls = stubbed_gemm
    a, b = torch.randn(512, 64).to(bf16), torch.randn(3, 24, 64).to(bf16)
    offsets = torch.tensor([0, 128, 128, 384], dtype=torch.int32)
    out = torch.empty(512, 24, dtype=bf16)
    assert tilewire.grouped_gemm(a, b, offsets, out=out) is out  # the whole way: fills the lane
    assert [c[0] for c in calls] == ["tw_grouped_gemm"]
    first = calls[-1][1]
    assert (first.m, first.n, first.k, first.groups) == (512, 24, 64, 3)
    assert (first.lda, first.ldb, first.ldo, first.sm_count) == (64, 64, 24, 0)
    assert first.c_dtype == _lib.DType.BF16
    assert (first.a, first.b, first.out, first.offsets) == (
        a.data_ptr(), b.data_ptr(), out.data_ptr(), offsets.data_ptr())
    assert first.size == ctypes.sizeof(_lib.GroupedGemmArgs) and first.version == 1
    a2, offsets2 = torch.randn(512, 64).to(bf16), offsets.clone()
    v = out._version
    tilewire.grouped_gemm(a2, b, offsets2, out=out)  # the same signature: a hit
    hit = calls[-1][1]
    assert len(calls) == 2 and len(_eager._lane) == 1
    assert hit.a == a2.data_ptr() and hit.offsets == offsets2.data_ptr()
    assert out._version == v + 1  # written: bumped as the dispatcher would
    for f in ("m", "n", "k", "groups", "lda", "ldb", "ldo", "c_dtype", "size", "version"):
        assert getattr(hit, f) == getattr(first, f), f
    # strided rows of a and out, fp32 out allocated here
    a_big = torch.randn(512, 72).to(bf16)
    fresh = tilewire.grouped_gemm(a_big[:, :64], b, offsets, out_dtype=torch.float32)
    assert fresh.shape == (512, 24) and fresh.dtype == torch.float32
    last = calls[-1][1]
    assert last.lda == 72 and last.c_dtype == _lib.DType.FP32 and last.out == fresh.data_ptr()


def test_grouped_gemm_refusals_and_k_zero_never_reach_the_library(stubbed_gemm):
    calls = stubbed_gemm
    a, b = torch.randn(256, 64).to(bf16), torch.randn(2, 8, 64).to(bf16)
    offsets = torch.tensor([0, 128, 256], dtype=torch.int32)
    tilewire.grouped_gemm(a, b, offsets)
    tilewire.grouped_gemm(a, b, offsets)
    n = len(calls)
    with pytest.raises(TypeError, match="offsets must be torch.int32"):
        tilewire.grouped_gemm(a, b, offsets.long())
    bad = torch.empty(256 * 8 + 8, dtype=bf16)[1:1 + 256 * 8].view(256, 8)
    with pytest.raises(ValueError, match="out's data pointer .* not 16-byte aligned"):
        tilewire.grouped_gemm(a, b, offsets, out=bad)
    with pytest.raises(TypeError, match="out_dtype"):  # unhashable: no signature at all
        tilewire.grouped_gemm(a, b, offsets, out_dtype=[bf16])
    # K = 0: the groups' rows are zero, the rest untouched, with no call of the library
    out = torch.full((384, 8), float("nan"), dtype=bf16)
    tilewire.grouped_gemm(torch.empty(384, 0, dtype=bf16), torch.empty(2, 8, 0, dtype=bf16),
                          offsets, out=out)
    assert torch.equal(out[:256], torch.zeros(256, 8, dtype=bf16))
    assert torch.isnan(out[256:]).all()
    # no group at all, or no row: nothing to do
    empty = torch.empty(0, 8, dtype=bf16)
    assert tilewire.grouped_gemm(a[:0], b, torch.zeros(3, dtype=torch.int32), out=empty) is empty
    assert len(calls) == n


# ---- MoE: the argument checks, and the args struct, on a comm whose C calls are recorded ----


class _MoeLibrary:
    """Stands in for _lib.call: a comm of `world` ranks, the MoE workspace size, and the MoE
    calls recorded as (function, args struct copy)."""

    WORKSPACE = 4096

    def __init__(self, world):
        self.world = world
        self.calls = []

    def __call__(self, name, *args, comm=None):
        if name in ("tw_comm_rank", "tw_comm_local_rank", "tw_comm_node", "tw_comm_device"):
            args[1]._obj.value = 0
        elif name in ("tw_comm_size", "tw_comm_local_size"):
            args[1]._obj.value = self.world
        elif name == "tw_comm_nodes":
            args[1]._obj.value = 1
        elif name == "tw_comm_sm_budget":
            args[1]._obj.value = 132
        elif name == "tw_moe_workspace_size":
            args[5]._obj.value = self.WORKSPACE
        elif name.startswith("tw_moe_"):
            struct = ctypes.cast(args[1], ctypes.POINTER(_lib.MoeArgs)).contents
            self.calls.append((name, _lib.MoeArgs.from_buffer_copy(struct)))


@pytest.fixture
def moe_comm(monkeypatch):
    """A comm of 2 ranks on no device (the C calls recorded): (comm, recorder)."""
    from tilewire import _comm

    lib = _MoeLibrary(2)
    monkeypatch.setattr(_lib, "call", lib)
    monkeypatch.setattr(_comm, "_capturing", lambda: False)
    comm = tilewire.Comm(0x1234)
    yield comm, lib
    comm.close()


def _moe_inputs(tokens=6, hidden=64, n_out=32, top_k=2, local=4, rows=512):
    """CPU tensors of a dispatch, combine and dispatch_gemm (world 2, 8 experts)."""
    return dict(
        x=_cpu(tokens, hidden), idx=torch.zeros(tokens, top_k, dtype=torch.int32),
        recv=_cpu(rows, hidden), offsets=torch.zeros(local + 1, dtype=torch.int32),
        ws=torch.zeros(_MoeLibrary.WORKSPACE, dtype=torch.uint8),
        eout=_cpu(rows, n_out), w=torch.ones(tokens, top_k),
        weights=_cpu(local, n_out, hidden), out=_cpu(tokens, n_out))


def test_moe_ops_are_registered():
    for name in ("moe_dispatch", "moe_combine", "moe_dispatch_gemm"):
        assert hasattr(torch.ops.tilewire, name)
        assert getattr(tilewire, name) is getattr(_torch, name)
    schema = str(torch.ops.tilewire.moe_dispatch.default._schema)
    for arg in ("recv", "offsets", "workspace"):
        assert re.search(r"Tensor\(a\d*!\) %s" % arg, schema), schema
    schema = str(torch.ops.tilewire.moe_combine.default._schema)
    assert re.search(r"Tensor\(a\d*!\) out", schema), schema
    assert "Tensor(a" not in schema.split("out")[0], schema


def test_moe_recv_rows():
    # max_tokens * world * min(top_k, local) + 127 * local, rounded up to 128
    assert tilewire.moe_recv_rows(1, 200, 8, 2) == 1536  # 400 + 1016 = 1416
    assert tilewire.moe_recv_rows(4, 200, 8, 2) == 1920  # 1600 + 254 = 1854
    assert tilewire.moe_recv_rows(4, 150, 32, 8) == 5888  # 4800 + 1016 = 5816
    assert tilewire.moe_recv_rows(8, 100, 8, 4) == 1024  # one local expert: 800 + 127 = 927
    assert tilewire.moe_recv_rows(2, 0, 8, 2) == 512  # no tokens: the padding alone, 508
    with pytest.raises(ValueError, match="experts=6 must be at most 1024 and a multiple of the "
                       "world"):
        tilewire.moe_recv_rows(4, 16, 6, 2)
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        tilewire.moe_recv_rows(2, 16.0, 8, 2)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        tilewire.moe_recv_rows(2, 16, 8, 0)


def _dispatch(comm, i, **kw):
    args = dict(x=i["x"], topk_idx=i["idx"], recv=i["recv"], offsets=i["offsets"],
                workspace=i["ws"], max_tokens=16, experts=8)
    args.update(kw)
    return tilewire.moe_dispatch(comm, **args)


def _combine(comm, i, **kw):
    args = dict(expert_out=i["eout"], topk_idx=i["idx"], topk_weights=i["w"], workspace=i["ws"],
                max_tokens=16, experts=8, out=i["out"])
    args.update(kw)
    return tilewire.moe_combine(comm, **args)


def _dispatch_gemm(comm, i, **kw):
    args = dict(x=i["x"], topk_idx=i["idx"], weights=i["weights"], recv=i["recv"],
                expert_out=i["eout"], offsets=i["offsets"], workspace=i["ws"], max_tokens=16,
                experts=8)
    args.update(kw)
    return tilewire.moe_dispatch_gemm(comm, **args)


_I = _moe_inputs()


@pytest.mark.parametrize("kw, exc, pattern", [
    ({"x": _I["x"].float()}, TypeError, "x must be torch.bfloat16"),
    ({"x": "x"}, TypeError, "x must be a torch.Tensor"),
    ({"x": _cpu(5, 64)}, ValueError, r"x must be 2-D \[tokens=6 \(topk_idx's rows\), hidden\]"),
    ({"x": _cpu(64, 6).t()}, ValueError, "x must be contiguous"),
    ({"x": _cpu(6, 60), "recv": _cpu(512, 60)}, ValueError, "hidden=60 .* multiple of 8"),
    ({"topk_idx": _I["idx"].short()}, TypeError, "topk_idx must be torch.int32 or torch.int64"),
    ({"topk_idx": torch.zeros(12, dtype=torch.int32)}, ValueError, "topk_idx must be 2-D"),
    ({"topk_idx": torch.zeros(2, 6, dtype=torch.int32).t()}, ValueError,
     "topk_idx must be contiguous"),
    ({"topk_idx": torch.zeros(6, 17, dtype=torch.int32)}, ValueError, "top_k=17"),
    ({"max_tokens": 4}, ValueError, "topk_idx has 6 tokens .* more than max_tokens=4"),
    ({"max_tokens": -1}, ValueError, "max_tokens must be >= 0"),
    ({"max_tokens": True}, TypeError, "max_tokens must be an int"),
    ({"experts": 7}, ValueError, "experts=7 must be .* a multiple of the world \\(2\\)"),
    ({"experts": 2048}, ValueError, "experts=2048 must be at most 1024"),
    ({"experts": "8"}, TypeError, "experts must be an int"),
    ({"recv": _cpu(512, 32)}, ValueError, r"recv must be 2-D \[recv_rows, hidden=64\]"),
    ({"recv": _I["recv"].half()}, TypeError, "recv must be torch.bfloat16"),
    ({"recv": _cpu(0, 64)}, ValueError, "recv has no rows"),
    ({"recv": _cpu(64, 512).t()}, ValueError, "recv must be contiguous"),
    ({"offsets": torch.zeros(4, dtype=torch.int32)}, ValueError,
     r"offsets must be 1-D \[local experts \+ 1=5\]"),
    ({"offsets": torch.zeros(5, dtype=torch.int64)}, TypeError, "offsets must be torch.int32"),
    ({"workspace": None}, TypeError, "workspace must be a torch.Tensor"),
    ({"workspace": torch.zeros(100, dtype=torch.uint8)}, ValueError,
     r"workspace has 100 bytes; it needs 4096 \(tilewire.moe_workspace\(comm, 16, 8, 2\)\)"),
    ({}, ValueError, "x is on cpu; tilewire needs CUDA tensors"),
])
def test_moe_dispatch_argument_errors(moe_comm, kw, exc, pattern):
    comm, lib = moe_comm
    with pytest.raises(exc, match=pattern) as info:
        _dispatch(comm, _I, **kw)
    assert str(info.value).startswith("tilewire.moe_dispatch: ")
    with pytest.raises(exc, match=pattern) as info:  # the same checks, first
        _dispatch_gemm(comm, _I, **kw)
    assert str(info.value).startswith("tilewire.moe_dispatch_gemm: ")
    assert lib.calls == []


@pytest.mark.parametrize("kw, exc, pattern", [
    ({"weights": None}, TypeError, "weights must be a torch.Tensor"),
    ({"weights": _cpu(3, 32, 64)}, ValueError,
     r"weights must be 3-D \[local experts=4, n_out, hidden=64\]"),
    ({"weights": _cpu(4, 32, 32)}, ValueError, "weights must be 3-D"),
    ({"weights": _cpu(4, 64, 32).transpose(1, 2)}, ValueError, "weights must be contiguous"),
    ({"weights": _cpu(4, 12, 64), "expert_out": _cpu(512, 12)}, ValueError,
     "n_out=12 .* multiple of 8"),
    ({"expert_out": _cpu(256, 32)}, ValueError,
     r"expert_out must be 2-D \[recv_rows=512 \(recv's rows\), n_out=32\]"),
    ({"expert_out": None}, TypeError, "expert_out must be a torch.Tensor"),
    ({}, ValueError, "x is on cpu"),
])
def test_moe_dispatch_gemm_argument_errors(moe_comm, kw, exc, pattern):
    comm, lib = moe_comm
    with pytest.raises(exc, match=pattern):
        _dispatch_gemm(comm, _I, **kw)
    assert lib.calls == []


@pytest.mark.parametrize("kw, exc, pattern", [
    ({"expert_out": _I["eout"].float()}, TypeError, "expert_out must be torch.bfloat16"),
    ({"expert_out": _cpu(512)}, ValueError, "expert_out must be 2-D"),
    ({"expert_out": _cpu(0, 32)}, ValueError, "expert_out has no rows"),
    ({"expert_out": _cpu(512, 12), "out": _cpu(6, 12)}, ValueError, "n_out=12 .* multiple of 8"),
    ({"topk_weights": torch.ones(6, 2, dtype=torch.float64)}, TypeError,
     "topk_weights must be torch.float32"),
    ({"topk_weights": torch.ones(6, 3)}, ValueError,
     r"topk_weights must be 2-D \[tokens=6, top_k=2\]"),
    ({"topk_weights": torch.ones(2, 6).t()}, ValueError, "topk_weights must be contiguous"),
    ({"out": _cpu(6, 16)}, ValueError, r"out must be 2-D \[tokens=6, n_out=32\]"),
    ({"out": _cpu(6, 32, dtype=torch.float32)}, TypeError, "out must be torch.bfloat16"),
    ({"out": _cpu(32, 6).t()}, ValueError, "out must be contiguous"),
    ({"topk_idx": _I["idx"].float()}, TypeError, "topk_idx must be torch.int32 or torch.int64"),
    ({"workspace": torch.zeros(8, dtype=torch.uint8)}, ValueError, "workspace has 8 bytes"),
    ({"experts": 9}, ValueError, "experts=9"),
    ({}, ValueError, "expert_out is on cpu; tilewire needs CUDA tensors"),
])
def test_moe_combine_argument_errors(moe_comm, kw, exc, pattern):
    comm, lib = moe_comm
    with pytest.raises(exc, match=pattern) as info:
        _combine(comm, _I, **kw)
    assert str(info.value).startswith("tilewire.moe_combine: ")
    assert lib.calls == []


def test_moe_checks_name_the_comm_and_the_keywords(moe_comm):
    comm, _ = moe_comm
    i = _I
    with pytest.raises(TypeError, match="tilewire.moe_dispatch: comm must be a tilewire.Comm"):
        tilewire.moe_dispatch(None, i["x"], i["idx"], i["recv"], None, i["ws"], 16, experts=8)
    with pytest.raises(TypeError, match="tilewire.moe_combine: comm must be a tilewire.Comm"):
        tilewire.moe_combine("c", i["eout"], i["idx"], i["w"], i["ws"], 16, experts=8)
    with pytest.raises(TypeError, match="moe_workspace: comm must be a tilewire.Comm"):
        tilewire.moe_workspace(None, 16, 8, 2)
    with pytest.raises(TypeError, match="experts"):  # a required keyword
        tilewire.moe_dispatch(comm, i["x"], i["idx"], i["recv"], None, i["ws"], 16)
    with pytest.raises(TypeError):  # not positional
        tilewire.moe_dispatch(comm, i["x"], i["idx"], i["recv"], None, i["ws"], 16, 8)
    with pytest.raises(ValueError, match="moe_workspace: experts=3"):
        tilewire.moe_workspace(comm, 16, 3, 2)
    # meta tensors pass every check up to the device one
    meta = {k: v.to("meta") for k, v in i.items()}
    with pytest.raises(ValueError, match="x is on meta"):
        _dispatch(comm, meta)
    with pytest.raises(ValueError, match="expert_out is on meta"):
        _combine(comm, meta)


@pytest.fixture
def moe_stubbed(moe_comm, monkeypatch):
    """moe_comm with the device checks, the stream and the symmetry check stubbed: CPU tensors
    reach the (recorded) library call."""
    from tilewire import _moe, _moe_launch

    if not _eager._FAST_EAGER:
        pytest.skip("no direct eager path (TILEWIRE_EAGER_DISPATCH=1, or an old torch)")
    monkeypatch.setattr(_moe, "_check_cuda", lambda *a, **k: None)
    monkeypatch.setattr(_moe_launch, "_stream", lambda device: ctypes.c_void_p(0))
    monkeypatch.setattr(_moe_launch, "is_symmetric", lambda comm, t: True)
    return moe_comm


def test_moe_calls_fill_the_args(moe_stubbed):
    comm, lib = moe_stubbed
    i = _moe_inputs()
    idx64 = i["idx"].long()
    recv, offsets = _dispatch(comm, i, topk_idx=idx64, offsets=None)
    assert recv is i["recv"] and offsets.shape == (5,) and offsets.dtype == torch.int32
    name, a = lib.calls[-1]
    assert name == "tw_moe_dispatch"
    assert (a.index_bits, a.tokens, a.max_tokens, a.hidden, a.experts, a.top_k,
            a.recv_rows) == (64, 6, 16, 64, 8, 2, 512)
    assert (a.x, a.topk_idx, a.recv, a.offsets, a.workspace) == (
        i["x"].data_ptr(), idx64.data_ptr(), recv.data_ptr(), offsets.data_ptr(),
        i["ws"].data_ptr())
    assert not a.out and not a.expert_out and not a.weights and not a.topk_weights
    assert a.size == ctypes.sizeof(_lib.MoeArgs) and a.version == _lib.TW_MOE_ARGS_VERSION
    v = i["recv"]._version
    _dispatch(comm, i)
    assert lib.calls[-1][1].index_bits == 32
    assert i["recv"]._version == v + 1  # written: bumped as the dispatcher would
    out = _combine(comm, i, out=None)
    name, a = lib.calls[-1]
    assert name == "tw_moe_combine" and out.shape == (6, 32) and out.dtype == bf16
    assert (a.tokens, a.n_out, a.recv_rows, a.top_k, a.experts) == (6, 32, 512, 2, 8)
    assert (a.expert_out, a.out, a.topk_weights, a.topk_idx) == (
        i["eout"].data_ptr(), out.data_ptr(), i["w"].data_ptr(), i["idx"].data_ptr())
    assert not a.x and not a.recv and not a.offsets
    eout, offs = _dispatch_gemm(comm, i)
    name, a = lib.calls[-1]
    assert name == "tw_moe_dispatch_gemm" and eout is i["eout"] and offs is i["offsets"]
    assert (a.hidden, a.n_out, a.recv_rows) == (64, 32, 512)
    assert (a.weights, a.expert_out, a.recv) == (
        i["weights"].data_ptr(), eout.data_ptr(), i["recv"].data_ptr())
    # no tokens on this rank: NULL token pointers, still a call (it is collective)
    _dispatch(comm, i, x=_cpu(0, 64), topk_idx=torch.zeros(0, 2, dtype=torch.int32))
    a = lib.calls[-1][1]
    assert a.tokens == 0 and not a.x and not a.topk_idx


def test_moe_launch_refuses_non_symmetric_and_misaligned(moe_stubbed, monkeypatch):
    from tilewire import _moe, _moe_launch

    comm, lib = moe_stubbed
    i = _moe_inputs()
    monkeypatch.setattr(_moe_launch, "is_symmetric", lambda comm, t: t is not i["recv"])
    with pytest.raises(ValueError, match="recv must be a symmetric tensor of rank 0's comm"):
        _dispatch(comm, i)
    monkeypatch.setattr(_moe_launch, "is_symmetric", lambda comm, t: t is not i["ws"])
    with pytest.raises(ValueError, match="workspace must be a symmetric tensor"):
        _combine(comm, i)
    monkeypatch.setattr(_moe_launch, "is_symmetric", lambda comm, t: True)
    odd = torch.empty(6 * 64 + 8, dtype=bf16)[1:1 + 6 * 64].view(6, 64)
    with pytest.raises(ValueError, match="x's data pointer .* not 16-byte aligned"):
        _dispatch(comm, i, x=odd)
    assert lib.calls == []
