"""tilewire.moe_ffn's and tilewire.swiglu's argument checks and the calls they make, on a comm
whose C calls are recorded (as test_torch_host.py's MoE tests): CPU and meta tensors, no GPU.
Skipped where torch is not installed."""

import contextlib
import ctypes
import re

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from tilewire import _eager, _lib, _moe, _moe_launch, _torch  # noqa: E402

bf16 = torch.bfloat16
WORKSPACE = 4096


def _cpu(*shape, dtype=bf16):
    return torch.zeros(*shape, dtype=dtype)


class _Library:
    """Stands in for _lib.call: a comm of `world` ranks, the MoE workspace size, and the MoE
    and SwiGLU calls recorded as (function, args struct copy or the argument tuple)."""

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
            args[5]._obj.value = WORKSPACE
        elif name == "tw_swiglu":
            self.calls.append((name, args, comm))
        elif name.startswith("tw_moe_"):
            struct = ctypes.cast(args[1], ctypes.POINTER(_lib.MoeArgs)).contents
            self.calls.append((name, _lib.MoeArgs.from_buffer_copy(struct)))


@pytest.fixture
def ffn_comm(monkeypatch):
    """A comm of 2 ranks on no device (the C calls recorded): (comm, recorder)."""
    from tilewire import _comm

    lib = _Library(2)
    monkeypatch.setattr(_lib, "call", lib)
    monkeypatch.setattr(_comm, "_capturing", lambda: False)
    comm = tilewire.Comm(0x1234)
    yield comm, lib
    comm.close()


def _inputs(tokens=6, hidden=64, inter=40, top_k=2, local=4, rows=512):
    """CPU tensors of an FFN call (world 2, 8 experts)."""
    return dict(
        x=_cpu(tokens, hidden), topk_idx=torch.zeros(tokens, top_k, dtype=torch.int32),
        topk_weights=torch.ones(tokens, top_k), w13=_cpu(local, 2 * inter, hidden),
        w2=_cpu(local, hidden, inter), workspace=torch.zeros(WORKSPACE, dtype=torch.uint8),
        recv=_cpu(rows, hidden), expert_out=_cpu(rows, hidden), out=_cpu(tokens, hidden),
        h=_cpu(rows, 2 * inter), act=_cpu(rows, inter))


def _ffn(comm, i, **kw):
    args = dict(i, max_tokens=16, experts=8)
    args.update(kw)
    positional = [args.pop(k) for k in ("x", "topk_idx", "topk_weights", "w13", "w2")]
    return tilewire.moe_ffn(comm, *positional, **args)


_I = _inputs()


def test_ffn_ops_are_registered():
    for name in ("moe_ffn", "swiglu"):
        assert hasattr(torch.ops.tilewire, name)
        assert getattr(tilewire, name) is getattr(_torch, name) is getattr(_moe, name)
        assert name in tilewire.__all__ and name in _torch.__all__
    schema = str(torch.ops.tilewire.moe_ffn.default._schema)
    for arg in ("recv", "offsets", "h", "act", "expert_out", "workspace", "out"):
        assert re.search(r"Tensor\(a\d*!\) %s\b" % arg, schema), (arg, schema)
    for arg in ("x", "topk_idx", "topk_weights", "w13", "w2"):
        assert re.search(r"Tensor %s\b" % arg, schema), (arg, schema)
    schema = str(torch.ops.tilewire.swiglu.default._schema)
    assert re.search(r"Tensor\(a\d*!\) out", schema) and "Tensor h" in schema, schema


@pytest.mark.parametrize("kw, exc, pattern", [
    # the dispatch's checks, as moe_dispatch's
    ({"x": _I["x"].float()}, TypeError, "x must be torch.bfloat16"),
    ({"x": _cpu(5, 64)}, ValueError, r"x must be 2-D \[tokens=6 \(topk_idx's rows\), hidden\]"),
    ({"x": _cpu(64, 6).t()}, ValueError, "x must be contiguous"),
    ({"x": _cpu(6, 60)}, ValueError, "hidden=60 .* multiple of 8"),
    ({"topk_idx": _I["topk_idx"].short()}, TypeError,
     "topk_idx must be torch.int32 or torch.int64"),
    ({"topk_idx": torch.zeros(6, 17, dtype=torch.int32)}, ValueError, "top_k=17"),
    ({"max_tokens": 4}, ValueError, "topk_idx has 6 tokens .* more than max_tokens=4"),
    ({"max_tokens": True}, TypeError, "max_tokens must be an int"),
    ({"experts": 7}, ValueError, "experts=7 must be .* a multiple of the world \\(2\\)"),
    ({"experts": "8"}, TypeError, "experts must be an int"),
    ({"recv": _cpu(512, 32)}, ValueError, r"recv must be 2-D \[recv_rows, hidden=64\]"),
    ({"recv": _cpu(0, 64)}, ValueError, "recv has no rows"),
    ({"workspace": None}, TypeError, "workspace must be a torch.Tensor"),
    ({"workspace": torch.zeros(100, dtype=torch.uint8)}, ValueError,
     r"workspace has 100 bytes; it needs 4096 \(tilewire.moe_workspace\(comm, 16, 8, 2\)\)"),
    # the combine's
    ({"topk_weights": torch.ones(6, 2, dtype=torch.float64)}, TypeError,
     "topk_weights must be torch.float32"),
    ({"topk_weights": torch.ones(6, 3)}, ValueError,
     r"topk_weights must be 2-D \[tokens=6, top_k=2\]"),
    ({"out": _cpu(6, 32)}, ValueError, r"out must be 2-D \[tokens=6, hidden=64\]"),
    ({"out": _cpu(6, 64, dtype=torch.float32)}, TypeError, "out must be torch.bfloat16"),
    ({"out": _cpu(64, 6).t()}, ValueError, "out must be contiguous"),
    # the weights
    ({"w13": None}, TypeError, "w13 must be a torch.Tensor"),
    ({"w13": _I["w13"].half()}, TypeError, "w13 must be torch.bfloat16"),
    ({"w13": _cpu(3, 80, 64)}, ValueError,
     r"w13 must be 3-D \[local experts=4, 2 inter, hidden=64\] \(gate rows then up rows\), "
     r"got shape \(3, 80, 64\)"),
    ({"w13": _cpu(4, 80, 32)}, ValueError, "w13 must be 3-D"),
    ({"w13": _cpu(80, 64)}, ValueError, "w13 must be 3-D"),
    ({"w13": _cpu(4, 64, 80).transpose(1, 2)}, ValueError, "w13 must be contiguous"),
    ({"w13": _cpu(4, 81, 64)}, ValueError, r"w13.shape\[1\]=81 must be 2 inter .* even"),
    ({"w13": _cpu(4, 24, 64), "w2": _cpu(4, 64, 12)}, ValueError,
     r"inter=12 \(w13.shape\[1\] / 2\) must be a positive multiple of 8"),
    ({"w13": _cpu(4, 0, 64)}, ValueError, "inter=0 .* positive multiple of 8"),
    ({"w2": None}, TypeError, "w2 must be a torch.Tensor"),
    ({"w2": _I["w2"].float()}, TypeError, "w2 must be torch.bfloat16"),
    ({"w2": _cpu(4, 40, 64)}, ValueError,
     r"w2 must be 3-D \[local experts=4, hidden=64, inter=40\], got shape \(4, 40, 64\)"),
    ({"w2": _cpu(4, 40, 64).transpose(1, 2)}, ValueError, "w2 must be contiguous"),
    # expert_out, h and act
    ({"expert_out": None}, TypeError, "expert_out must be a torch.Tensor"),
    ({"expert_out": _cpu(256, 64)}, ValueError,
     r"expert_out must be 2-D \[recv_rows=512 \(recv's rows\), hidden=64\]"),
    ({"expert_out": _cpu(512, 32)}, ValueError, "expert_out must be 2-D"),
    ({"expert_out": _cpu(512, 64, dtype=torch.float32)}, TypeError,
     "expert_out must be torch.bfloat16"),
    ({"h": _cpu(512, 40)}, ValueError, r"h must be 2-D \[recv_rows=512, 2 inter=80\]"),
    ({"h": _cpu(80, 512).t()}, ValueError, "h must be contiguous"),
    ({"h": _cpu(512, 80, dtype=torch.float16)}, TypeError, "h must be torch.bfloat16"),
    ({"act": _cpu(512, 80)}, ValueError, r"act must be 2-D \[recv_rows=512, inter=40\]"),
    ({"act": "act"}, TypeError, "act must be a torch.Tensor"),
    ({"stream": 0}, TypeError, "stream must be a torch.cuda.Stream or None, got int"),
    # every metadata check passed: the device one
    ({}, ValueError, "x is on cpu; tilewire needs CUDA tensors"),
    ({"h": None, "act": None, "out": None}, ValueError, "x is on cpu"),
])
def test_moe_ffn_argument_errors(ffn_comm, kw, exc, pattern):
    comm, lib = ffn_comm
    with pytest.raises(exc, match=pattern) as info:
        _ffn(comm, _I, **kw)
    assert str(info.value).startswith("tilewire.moe_ffn: ")
    assert lib.calls == []


def test_moe_ffn_names_the_comm_and_takes_keywords(ffn_comm):
    comm, lib = ffn_comm
    i = _I
    pos = (i["x"], i["topk_idx"], i["topk_weights"], i["w13"], i["w2"])
    with pytest.raises(TypeError, match="tilewire.moe_ffn: comm must be a tilewire.Comm"):
        tilewire.moe_ffn(None, *pos, workspace=i["workspace"], recv=i["recv"],
                         expert_out=i["expert_out"], max_tokens=16, experts=8)
    with pytest.raises(TypeError, match="experts"):  # a required keyword
        tilewire.moe_ffn(comm, *pos, workspace=i["workspace"], recv=i["recv"],
                         expert_out=i["expert_out"], max_tokens=16)
    with pytest.raises(TypeError):  # the buffers are not positional
        tilewire.moe_ffn(comm, *pos, i["workspace"], i["recv"], i["expert_out"], 16, 8)
    # meta tensors pass every check up to the device one
    meta = {k: v.to("meta") for k, v in i.items()}
    with pytest.raises(ValueError, match="tilewire.moe_ffn: x is on meta"):
        _ffn(comm, meta)
    assert lib.calls == []


@pytest.fixture
def ffn_stubbed(ffn_comm, monkeypatch):
    """ffn_comm with the device checks, the stream and the symmetry check stubbed: CPU tensors
    reach the (recorded) library call."""
    if not _eager._FAST_EAGER:
        pytest.skip("no direct eager path (TILEWIRE_EAGER_DISPATCH=1, or an old torch)")
    monkeypatch.setattr(_moe, "_check_cuda", lambda *a, **k: None)
    monkeypatch.setattr(_moe_launch, "_stream", lambda device: ctypes.c_void_p(0))
    monkeypatch.setattr(_moe_launch, "_on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_moe_launch, "is_symmetric", lambda comm, t: True)
    return ffn_comm


def test_moe_ffn_fills_the_args(ffn_stubbed):
    comm, lib = ffn_stubbed
    i = _inputs()
    out = _ffn(comm, i)
    assert out is i["out"]
    name, a = lib.calls[-1]
    assert name == "tw_moe_ffn"
    assert a.size == ctypes.sizeof(_lib.MoeArgs) and a.version == _lib.TW_MOE_ARGS_VERSION == 3
    assert (a.index_bits, a.tokens, a.max_tokens, a.hidden, a.inter, a.experts, a.top_k,
            a.recv_rows) == (32, 6, 16, 64, 40, 8, 2, 512)
    assert a.n_out == 0  # not read by tw_moe_ffn
    assert (a.x, a.topk_idx, a.topk_weights, a.weights, a.weights2) == tuple(
        i[k].data_ptr() for k in ("x", "topk_idx", "topk_weights", "w13", "w2"))
    assert (a.recv, a.expert_out, a.h, a.act, a.out, a.workspace) == tuple(
        i[k].data_ptr() for k in ("recv", "expert_out", "h", "act", "out", "workspace"))
    assert a.offsets  # a tensor of the call's own
    versions = {k: i[k]._version for k in ("recv", "expert_out", "h", "act", "out")}
    _ffn(comm, i, topk_idx=i["topk_idx"].long())
    assert lib.calls[-1][1].index_bits == 64
    for k, v in versions.items():  # written: bumped as the dispatcher would
        assert i[k]._version == v + 1, k
    # out, h and act allocated when None
    out = _ffn(comm, i, out=None, h=None, act=None)
    a = lib.calls[-1][1]
    assert out.shape == (6, 64) and out.dtype == bf16 and a.out == out.data_ptr()
    assert a.h and a.act and a.h != i["h"].data_ptr() and a.act != i["act"].data_ptr()
    # no tokens on this rank: NULL token pointers, still a call (it is collective)
    out = _ffn(comm, i, x=_cpu(0, 64), topk_idx=torch.zeros(0, 2, dtype=torch.int32),
               topk_weights=torch.ones(0, 2), out=None)
    a = lib.calls[-1][1]
    assert out.shape == (0, 64)
    assert a.tokens == 0 and not a.x and not a.topk_idx and not a.topk_weights and not a.out
    assert a.recv and a.expert_out and a.h and a.act


def test_moe_ffn_launch_refuses_non_symmetric_and_misaligned(ffn_stubbed, monkeypatch):
    comm, lib = ffn_stubbed
    i = _inputs()
    for name in ("recv", "expert_out", "workspace"):
        monkeypatch.setattr(_moe_launch, "is_symmetric", lambda comm, t: t is not i[name])
        with pytest.raises(ValueError, match="moe_ffn: %s must be a symmetric tensor of rank 0's"
                           % name):
            _ffn(comm, i)
    monkeypatch.setattr(_moe_launch, "is_symmetric", lambda comm, t: True)
    odd = torch.empty(512 * 80 + 8, dtype=bf16)[1:1 + 512 * 80].view(512, 80)
    with pytest.raises(ValueError, match="h's data pointer .* not 16-byte aligned"):
        _ffn(comm, i, h=odd)
    assert lib.calls == []


@pytest.mark.parametrize("h, kw, exc, pattern", [
    ("h", {}, TypeError, "h must be a torch.Tensor"),
    (_cpu(4, 32, dtype=torch.float32), {}, TypeError, "h must be torch.bfloat16"),
    (_cpu(32), {}, ValueError, r"h must be 2-D \[rows, 2 inter\], got shape \(32,\)"),
    (_cpu(32, 4).t(), {}, ValueError, "h must be contiguous"),
    (_cpu(4, 33), {}, ValueError, r"h.shape\[1\]=33 must be 2 inter"),
    (_cpu(4, 24), {}, ValueError, r"inter=12 \(h.shape\[1\] / 2\) must be a positive multiple"),
    (_cpu(4, 0), {}, ValueError, "inter=0"),
    (_cpu(4, 32), {"out": _cpu(4, 32)}, ValueError, r"out must be 2-D \[rows=4, inter=16\]"),
    (_cpu(4, 32), {"out": _cpu(3, 16)}, ValueError, r"out must be 2-D \[rows=4, inter=16\]"),
    (_cpu(4, 32), {"out": _cpu(4, 16, dtype=torch.float32)}, TypeError,
     "out must be torch.bfloat16"),
    (_cpu(4, 32), {"stream": "s"}, TypeError, "stream must be a torch.cuda.Stream or None"),
    (_cpu(4, 32), {}, ValueError, "h is on cpu; tilewire needs CUDA tensors"),
    (_cpu(4, 32).to("meta"), {}, ValueError, "h is on meta"),
])
def test_swiglu_argument_errors(ffn_comm, h, kw, exc, pattern):
    _, lib = ffn_comm
    with pytest.raises(exc, match=pattern) as info:
        tilewire.swiglu(h, **kw)
    assert str(info.value).startswith("tilewire.swiglu: ")
    assert lib.calls == []


def test_swiglu_calls_the_library(ffn_stubbed):
    _, lib = ffn_stubbed
    h = _cpu(5, 48)
    act = tilewire.swiglu(h)
    assert act.shape == (5, 24) and act.dtype == bf16
    name, args, comm = lib.calls[-1]
    assert name == "tw_swiglu" and comm is False  # tw_last_error() explains a failure
    assert args[:4] == (h.data_ptr(), act.data_ptr(), 5, 24)
    out = _cpu(5, 24)
    v = out._version
    assert tilewire.swiglu(h, out=out) is out and out._version == v + 1
    assert lib.calls[-1][1][1] == out.data_ptr()
    n = len(lib.calls)
    assert tilewire.swiglu(_cpu(0, 48)).shape == (0, 24)  # no row: nothing to launch
    assert len(lib.calls) == n
    odd = torch.empty(5 * 48 + 8, dtype=bf16)[1:1 + 5 * 48].view(5, 48)
    with pytest.raises(ValueError, match="h's data pointer .* not 16-byte aligned"):
        tilewire.swiglu(odd)


def test_differentiable_moe_calls_need_their_grad_buffers(ffn_stubbed, monkeypatch):
    """moe_ffn, moe_dispatch and moe_combine with an input requiring grad name the gradient
    buffer their backward needs (missing, or of the wrong shape) before any library call."""
    from tilewire import _moe_grad

    monkeypatch.setattr(_moe_grad, "_need_symmetric", lambda *a: None)
    comm, lib = ffn_stubbed
    i = dict(_inputs())
    i["x"] = i["x"].clone().requires_grad_()
    with pytest.raises(ValueError, match=r"tilewire.moe_ffn: grad_buffer is needed .* \[512, 64\]"):
        _ffn(comm, i)
    with pytest.raises(ValueError, match=r"grad_buffer must be a contiguous \[512, 64\]"):
        _ffn(comm, i, grad_buffer=_cpu(256, 64))
    with pytest.raises(ValueError, match="tilewire.moe_dispatch: grad_buffer is needed"):
        tilewire.moe_dispatch(comm, i["x"], i["topk_idx"], i["recv"], None, i["workspace"], 16,
                              experts=8)
    eout = i["expert_out"].clone().requires_grad_()
    with pytest.raises(ValueError, match="tilewire.moe_combine: expert_grad is needed"):
        tilewire.moe_combine(comm, eout, i["topk_idx"], i["topk_weights"], i["workspace"], 16,
                             experts=8)
    with pytest.raises(TypeError, match="expert_grad must be torch.bfloat16"):
        tilewire.moe_combine(comm, eout, i["topk_idx"], i["topk_weights"], i["workspace"], 16,
                             experts=8, expert_grad=_cpu(512, 64, dtype=torch.float32))
    assert lib.calls == []


def _gemm_inputs(n_out=32):
    """CPU tensors of a moe_dispatch_gemm call (world 2, 8 experts: 4 local), offsets given
    (the recorded call writes none)."""
    i = _inputs()
    return dict(x=i["x"], topk_idx=i["topk_idx"], weights=_cpu(4, n_out, 64), recv=i["recv"],
                expert_out=_cpu(512, n_out),
                offsets=torch.tensor([0, 128, 128, 256, 384], dtype=torch.int32),
                workspace=i["workspace"])


def _dispatch_gemm(comm, i, **kw):
    args = dict(i, max_tokens=16, experts=8)
    args.update(kw)
    return tilewire.moe_dispatch_gemm(comm, **args)


def test_differentiable_moe_dispatch_gemm_needs_its_grad_buffer(ffn_stubbed, monkeypatch):
    """moe_dispatch_gemm with x requiring grad names grad_buffer (missing, of the wrong shape
    or dtype) before any library call; without a recorded graph, or with only the weights
    requiring grad (d_recv is not computed), it needs none."""
    from tilewire import _moe_grad

    monkeypatch.setattr(_moe_grad, "_need_symmetric", lambda *a: None)
    comm, lib = ffn_stubbed
    i = _gemm_inputs()
    x = i["x"].clone().requires_grad_()
    with pytest.raises(ValueError, match=r"tilewire.moe_dispatch_gemm: grad_buffer is needed "
                       r"for the backward .* \[512, 64\]"):
        _dispatch_gemm(comm, i, x=x)
    with pytest.raises(ValueError, match=r"tilewire.moe_dispatch_gemm: grad_buffer must be a "
                       r"contiguous \[512, 64\]"):
        _dispatch_gemm(comm, i, x=x, grad_buffer=_cpu(512, 32))
    with pytest.raises(TypeError, match="grad_buffer must be torch.bfloat16"):
        _dispatch_gemm(comm, i, x=x, grad_buffer=_cpu(512, 64, dtype=torch.float32))
    assert lib.calls == []
    with torch.no_grad():  # nothing recorded: the custom op's path
        eout, offsets = _dispatch_gemm(comm, i, x=x)
    assert eout is i["expert_out"] and offsets is i["offsets"] and eout.grad_fn is None
    assert lib.calls[-1][0] == "tw_moe_dispatch_gemm"
    weights = i["weights"].clone().requires_grad_()
    eout, _ = _dispatch_gemm(comm, i, weights=weights)
    assert type(eout.grad_fn).__name__ == "MoeDispatchGemmFnBackward"
    assert eout.data_ptr() == i["expert_out"].data_ptr() and eout is not i["expert_out"]
    name, a = lib.calls[-1]
    assert name == "tw_moe_dispatch_gemm" and len(lib.calls) == 2
    assert (a.weights, a.expert_out, a.recv, a.offsets) == (
        weights.data_ptr(), i["expert_out"].data_ptr(), i["recv"].data_ptr(),
        i["offsets"].data_ptr())


def _ref_grouped(a, b, offsets):
    """a @ b[g].T over each group's rows of offsets (CPU, fp32 then bf16); other rows 0."""
    out = torch.zeros(a.shape[0], b.shape[1])
    for g in range(b.shape[0]):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        out[lo:hi] = a[lo:hi].float() @ b[g].float().t()
    return out.to(bf16)


def test_moe_dispatch_gemm_backward_chain(ffn_stubbed, monkeypatch):
    """The backward's calls, the GEMMs replaced by torch references on the CPU: d_weights is
    grouped_gemm_wgrad(d_expert_out, recv, offsets), d_recv the grouped GEMM of d_expert_out
    over the transposed weights written into grad_buffer, and d_x the dispatch's backward (a
    tw_moe_combine of grad_buffer with every weight 1 into a [tokens, hidden] tensor)."""
    from tilewire import _moe_grad

    monkeypatch.setattr(_moe_grad, "_need_symmetric", lambda *a: None)
    comm, lib = ffn_stubbed
    seen = {}

    def wgrad(a, b, offsets, out=None, out_dtype=bf16):
        seen["wgrad"] = (a, b, offsets, out_dtype)
        return torch.stack([a[int(offsets[g]):int(offsets[g + 1])].float().t()
                            @ b[int(offsets[g]):int(offsets[g + 1])].float()
                            for g in range(offsets.numel() - 1)]).to(out_dtype)

    def grouped_out(a, b, offsets, out):
        out.copy_(_ref_grouped(a, b, offsets))

    monkeypatch.setattr(_moe_grad, "grouped_gemm_wgrad", wgrad)
    monkeypatch.setattr(_moe_grad, "_grouped_out", grouped_out)
    g = torch.Generator().manual_seed(5)
    i = _gemm_inputs()
    i["recv"] = torch.randn(512, 64, generator=g).to(bf16)
    i["weights"] = torch.randn(4, 32, 64, generator=g).to(bf16).requires_grad_()
    x = i["x"].clone().requires_grad_()
    buf = _cpu(512, 64)
    eout, offsets = _dispatch_gemm(comm, i, x=x, grad_buffer=buf)
    d_out = torch.randn(512, 32, generator=g).float()  # converted to bf16 by the backward
    eout.backward(d_out)
    a, b, offs, out_dtype = seen["wgrad"]
    assert a.dtype == bf16 and a.is_contiguous() and torch.equal(a, d_out.to(bf16))
    assert b is i["recv"] and offs is offsets and out_dtype == bf16
    assert torch.equal(i["weights"].grad, wgrad(d_out.to(bf16), i["recv"], offsets))
    # d_recv (rows 0 .. offsets[4] = 384) in grad_buffer: d_out @ weights[e]
    want = _ref_grouped(d_out.to(bf16), i["weights"].detach().transpose(1, 2), offsets)
    assert torch.equal(buf[:384], want[:384])
    name, c = lib.calls[-1]
    assert name == "tw_moe_combine" and len(lib.calls) == 2
    assert (c.expert_out, c.n_out, c.tokens, c.recv_rows) == (buf.data_ptr(), 64, 6, 512)
    assert x.grad.shape == (6, 64) and x.grad.dtype == bf16
    assert c.topk_weights and c.out and not c.x and not c.recv


@pytest.mark.parametrize("args, kw, exc, pattern", [
    ((_cpu(256, 64).float(), _cpu(256, 32)), {}, TypeError, "a must be torch.bfloat16"),
    ((_cpu(256, 64), _cpu(128, 32)), {}, ValueError, "a has 256 rows but b has 128"),
    ((_cpu(256, 60), _cpu(256, 32)), {}, ValueError, "a's rows must be contiguous with 60"),
    ((_cpu(256, 64), _cpu(256, 32, 2)), {}, ValueError, r"b must be 2-D \[M, K\]"),
    ((_cpu(256, 64), _cpu(256, 32)), {"out_dtype": torch.int32}, TypeError, "out_dtype"),
    ((_cpu(256, 64), _cpu(256, 32)), {"out": _cpu(3, 64, 32)}, ValueError,
     r"out must be a contiguous \[groups, N, K\] = \[2, 64, 32\]"),
    ((_cpu(256, 64), _cpu(256, 32)), {}, ValueError, "a is on cpu"),
])
def test_grouped_gemm_wgrad_argument_errors(args, kw, exc, pattern):
    offsets = torch.tensor([0, 128, 256], dtype=torch.int32)
    with pytest.raises(exc, match=pattern) as info:
        tilewire.grouped_gemm_wgrad(*args, offsets, **kw)
    assert str(info.value).startswith("tilewire.grouped_gemm_wgrad: ")
