"""The torch front end's argument checks, which need torch but no GPU (CPU and meta tensors).
Skipped where torch is not installed."""

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
    """tilewire.gemm on CPU tensors with the C call recorded instead of made: returns the list
    of (function, args struct copy) calls. The device checks, stream and device queries are
    stubbed; everything else (the checks, the lane) is the real code."""
    if not (_eager._FAST_EAGER and _eager._LANE_ON):
        pytest.skip("the fast lane is off (TILEWIRE_FAST_LANE=0, or no direct eager path)")
    import contextlib
    import ctypes

    calls = []

    def fake_call(name, *args, comm=None):
        struct = ctypes.cast(args[0], ctypes.POINTER(_lib.GemmArgs)).contents
        calls.append((name, _lib.GemmArgs.from_buffer_copy(struct)))

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
