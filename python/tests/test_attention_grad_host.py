"""The autograd of tilewire.attention, tilewire.ring_attention and tilewire.nn.RingAttention on
the host (torch's CPU build, no GPU): the backward ops' schemas and launch fields (the library
call intercepted), the argument checks, and the Python path end to end through CPU stand-ins
of the custom ops (torch.library kernels computing attention and its backward in fp32), eager
and under torch.compile: gradients against torch autograd of an fp32 reference, the stand-ins
seeing a full lse, a contiguous dout and the module's symmetric buffers (under torch.compile
too: inductor must hand tilewire::ring_attention_staged and ring_attention_backward the
module's buffers themselves, not the caller's k and v nor copies)."""

import ctypes
import re

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
import tilewire.nn  # noqa: E402
from tilewire import _attention, _attention_grad, _eager, _glue, _lib  # noqa: E402
from tilewire._comm import Comm  # noqa: E402
from _host import FakeComm  # noqa: E402

bf16 = torch.bfloat16
scoped_library = getattr(torch.library, "_scoped_library", None)
needs_custom_ops = pytest.mark.skipif(not _glue._HAVE_CUSTOM_OP or scoped_library is None,
                                      reason="this torch has no torch.library.custom_op")


# ---- an fp32 reference and CPU stand-ins of the custom ops ----------------------------------


def _reference(q, k, v, causal, scale, q_offset, kv_offset):
    """(o [b, sq, hq, d], lse [b, hq, sq], p, qf, kf, vf, scale) in fp32, heads (b, h, s, d)."""
    g = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(g, 2).transpose(1, 2)
    vf = v.float().repeat_interleave(g, 2).transpose(1, 2)
    scale = scale or q.shape[3] ** -0.5
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(q.shape[1])[:, None] + q_offset
        j = torch.arange(k.shape[1])[None] + kv_offset
        s = s.masked_fill(j > i, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse, p, qf, kf, vf, scale


class StandIns:
    """CPU kernels of the attention custom ops (the header's math in fp32), recording what
    they were handed."""

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, o, lse, causal, scale, q_offset, kv_offset):
        self.calls.append(("attention", lse.numel()))
        self._forward(q, k, v, o, lse, causal, scale, q_offset, kv_offset)

    @staticmethod
    def _forward(q, k, v, o, lse, causal, scale, q_offset, kv_offset):
        ref_o, ref_lse = _reference(q, k, v, causal, scale, q_offset, kv_offset)[:2]
        o.copy_(ref_o)
        if lse.numel():
            lse.copy_(ref_lse)

    def backward(self, q, k, v, o, dout, lse, dq, dk, dv, ws, dq_accum, causal, scale, q_offset,
                 kv_offset):
        assert dq_accum.numel() == 0  # deterministic by default: the three-kernel backward
        self.calls.append(("attention_backward", dout.is_contiguous(), dout.dtype))
        self._backward(q, k, v, o, dout, lse, dq, dk, dv, ws, causal, scale, q_offset,
                       kv_offset)

    @staticmethod
    def _backward(q, k, v, o, dout, lse, dq, dk, dv, ws, causal, scale, q_offset, kv_offset):
        _, _, p, qf, kf, vf, scale = _reference(q, k, v, causal, scale, q_offset, kv_offset)
        do, of = dout.float().transpose(1, 2), o.float().transpose(1, 2)
        dsum = (do * of).sum(-1)
        ds = p * (do @ vf.transpose(-1, -2) - dsum[..., None])
        b, hq, sk, d = kf.shape
        hk = k.shape[2]
        dq.copy_((scale * ds @ kf).transpose(1, 2))
        dk.copy_((scale * ds.transpose(-1, -2) @ qf).view(b, hk, hq // hk, sk, d).sum(2)
                 .transpose(1, 2))
        dv.copy_((p.transpose(-1, -2) @ do).view(b, hk, hq // hk, sk, d).sum(2).transpose(1, 2))
        ws.copy_(dsum)

    # world 1: the ring is attention over the rank's own shard (zigzag's two chunks are the
    # sequence's halves in order)
    def ring_staged(self, comm_id, q, k, v, k_buf, v_buf, o, lse, causal, layout, scale):
        self.calls.append(("ring_attention_staged", k_buf, v_buf, lse.numel()))
        _attention_grad._stage(k_buf, k)
        _attention_grad._stage(v_buf, v)
        self._forward(q, k_buf, v_buf, o, lse, causal, scale, 0, 0)

    def ring_backward(self, comm_id, q, k, v, o, dout, lse, q_buf, k_buf, v_buf, dout_buf,
                      lse_buf, ws, dq, dk, dv, causal, layout, scale):
        self.calls.append(("ring_attention_backward", q_buf, k_buf, v_buf, dout_buf, lse_buf,
                           ws))
        self._backward(q, k, v, o, dout.contiguous(), lse, dq, dk, dv, ws, causal, scale, 0, 0)


@pytest.fixture
def stand_ins(monkeypatch):
    """The ops' CPU kernels registered (removed after the test), CPU tensors let through the
    CUDA check, eager calls through the dispatcher (the direct path would call the library)."""
    if not _glue._HAVE_CUSTOM_OP or scoped_library is None:
        pytest.skip("this torch has no torch.library.custom_op")
    monkeypatch.setattr(_attention, "_check_cuda", lambda *a: None)
    monkeypatch.setattr(_glue, "_check_comm", lambda *a: None)
    monkeypatch.setattr(_eager, "_FAST_EAGER", False)
    s = StandIns()
    with scoped_library("tilewire", "IMPL") as lib:
        lib.impl("attention", s.forward, "CPU")
        lib.impl("attention_backward", s.backward, "CPU")
        lib.impl("ring_attention_staged", s.ring_staged, "CPU")
        lib.impl("ring_attention_backward", s.ring_backward, "CPU")
        yield s


def _leaves(b, sq, sk, hq, hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(bf16).requires_grad_()
            for shape in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d))]


def _reference_grads(q, k, v, dout, causal, q_offset=0, kv_offset=0):
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    o = _reference(qf, kf, vf, causal, None, q_offset, kv_offset)[0]
    return torch.autograd.grad(o, (qf, kf, vf), dout.float())


def _rel(x, ref):
    return ((x.float() - ref).abs().max() / ref.abs().max()).item()


# ---- the backward ops ---------------------------------------------------------------------


@needs_custom_ops
def test_backward_ops_mutate_their_outputs_and_the_staging_buffers():
    schemas = {
        "attention_backward": ("dq", "dk", "dv", "workspace", "dq_accum"),
        "ring_attention_backward": ("q_buf", "k_buf", "v_buf", "dout_buf", "lse_buf",
                                    "workspace", "dq", "dk", "dv"),
        "ring_attention_staged": ("k_buf", "v_buf", "o", "lse"),
    }
    for name, mutated in schemas.items():
        schema = str(getattr(torch.ops.tilewire, name).default._schema)
        for arg in mutated:
            assert re.search(r"Tensor\(a\d+!\)\??\s%s\b" % arg, schema), (name, arg, schema)
        for arg in ("q", "k", "v"):
            assert re.search(r"Tensor %s\b" % arg, schema), (name, arg, schema)
    assert _attention_grad._attention_backward_fake(*[None] * 15) is None
    assert _attention_grad._ring_backward_fake(*[None] * 19) is None
    assert _attention._ring_staged_fake(*[None] * 11) is None


class _Calls:
    def __init__(self, monkeypatch, module):
        self.seen = []
        monkeypatch.setattr(_lib, "call", lambda name, *args, **kw: self.seen.append(
            (name, args)))
        monkeypatch.setattr(module, "_stream", lambda device: None)


def _args(seen, cls):
    name, args = seen
    assert isinstance(args[-2]._obj, cls)  # the byref of the args struct
    return name, args[-2]._obj


def test_attention_backward_launch_fields(monkeypatch):
    calls = _Calls(monkeypatch, _attention_grad)
    monkeypatch.setattr(_attention_grad, "_on_device", lambda index: _NoDevice())
    q, k, v = (t.detach() for t in _leaves(2, 40, 50, 8, 2, 128, 0))
    o, dout = torch.zeros_like(q), torch.zeros_like(q)
    lse, ws = torch.zeros(2, 8, 40), torch.zeros(2, 8, 40)
    dq, dk, dv = _attention_grad._grads(q, k)
    accum = _attention_grad._dq_accum(q, False)
    assert accum.dtype == torch.float32 and accum.numel() == 2 * 8 * 128 * 128
    _attention_grad._attention_backward_impl(q, k, v, o, dout, lse, dq, dk, dv, ws, accum, True,
                                             0.25, 7, 3)
    name, a = _args(calls.seen[0], _lib.AttentionBackwardArgs)
    assert name == "tw_attention_backward"
    ptrs = dict(q=q, k=k, v=v, o=o, dout=dout, lse=lse, dq=dq, dk=dk, dv=dv, workspace=ws)
    for field, t in ptrs.items():
        assert getattr(a, field) == t.data_ptr(), field
    assert (a.causal, a.batch, a.heads_q, a.heads_kv, a.seq_q, a.seq_kv, a.head_dim) == \
        (1, 2, 8, 2, 40, 50, 128)
    assert (a.q_offset, a.kv_offset, a.softmax_scale, a.sm_count) == (7, 3, 0.25, 0)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dk.dtype == bf16
    assert a.dq_accum == accum.data_ptr() and a.version == 2
    # deterministic: no scratch, the default backward (dq_accum NULL)
    _attention_grad._attention_backward_impl(q, k, v, o, dout, lse, dq, dk, dv, ws,
                                             _attention_grad._dq_accum(q, True), True, 0.25, 7, 3)
    assert _args(calls.seen[1], _lib.AttentionBackwardArgs)[1].dq_accum is None


class _NoDevice:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Registered:
    """comm_by_id's answer for the ring's launch: a handle."""

    handle = ctypes.c_void_p(1)


@pytest.mark.parametrize("staged", [False, True])
def test_ring_backward_stages_its_operands(monkeypatch, staged):
    calls = _Calls(monkeypatch, _attention_grad)
    import tilewire._comm as comm_module

    monkeypatch.setattr(comm_module, "comm_by_id", lambda comm_id: _Registered())
    q, k, v = (t.detach() for t in _leaves(1, 16, 16, 4, 2, 64, 1))
    o = torch.randn_like(q).to(bf16)
    dout = torch.randn(1, 16, 64, 4).to(bf16).transpose(2, 3)  # strided, as autograd may give
    lse = torch.randn(1, 4, 16)
    bufs = _attention_grad.RingAttentionGradBuffers(FakeComm(), 1, 16, 4, 64)
    k_buf = torch.zeros_like(k) if staged else None
    v_buf = torch.zeros_like(v) if staged else None
    dq, dk, dv = _attention_grad._grads(q, k)
    _attention_grad._ring_backward_impl(0, q, k, v, o, dout, lse, bufs.q, k_buf, v_buf,
                                        bufs.dout, bufs.lse, bufs.workspace, dq, dk, dv, True,
                                        "contiguous", 0.0)
    name, a = _args(calls.seen[0], _lib.RingAttentionBackwardArgs)
    assert name == "tw_ring_attention_backward"
    assert torch.equal(bufs.q, q) and torch.equal(bufs.dout, dout) and torch.equal(bufs.lse, lse)
    k_read, v_read = (k_buf, v_buf) if staged else (k, v)
    if staged:
        assert torch.equal(k_buf, k) and torch.equal(v_buf, v)
    ptrs = dict(q=bufs.q, k=k_read, v=v_read, o=o, dout=bufs.dout, lse=bufs.lse, dq=dq, dk=dk,
                dv=dv, workspace=bufs.workspace)
    for field, t in ptrs.items():
        assert getattr(a, field) == t.data_ptr(), field
    assert (a.causal, a.batch, a.heads_q, a.heads_kv, a.seq_local, a.head_dim, a.layout) == \
        (1, 1, 4, 2, 16, 64, _lib.TW_RING_CONTIGUOUS)


def test_ring_grad_buffers_shapes_and_checks():
    comm = FakeComm(rank=0, size=2)
    bufs = tilewire.ring_attention_grad_buffers(comm, 2, 8, 4, 64)
    assert comm.allocs == [(2, 8, 4, 64)] * 2 + [(2, 4, 8)] * 2
    assert (bufs.q.dtype, bufs.dout.dtype, bufs.lse.dtype, bufs.workspace.dtype) == \
        (bf16, bf16, torch.float32, torch.float32)
    assert bufs.shape == (2, 8, 4, 64) and bufs.comm is comm
    for bad in ((0, 8, 4, 64), (2, 8.0, 4, 64), (2, 8, True, 64)):
        with pytest.raises(ValueError, match="ring_attention_grad_buffers"):
            tilewire.ring_attention_grad_buffers(comm, *bad)
    q = torch.zeros(2, 8, 4, 64, dtype=bf16)
    op = "tilewire.ring_attention"
    _attention_grad._check_grad_buffers(op, comm, bufs, q)
    with pytest.raises(ValueError, match="grad_buffers=tilewire.ring_attention_grad_buffers"
                                         r"\(comm, 2, 8, 4, 64\)"):
        _attention_grad._check_grad_buffers(op, comm, None, q)
    with pytest.raises(TypeError, match="grad_buffers must come from"):
        _attention_grad._check_grad_buffers(op, comm, (bufs.q, bufs.dout), q)
    with pytest.raises(ValueError, match="another comm"):
        _attention_grad._check_grad_buffers(op, FakeComm(rank=1, size=2), bufs, q)
    with pytest.raises(ValueError, match="shape"):
        _attention_grad._check_grad_buffers(op, comm, bufs, q[:, :4])


def test_ring_attention_with_grad_needs_grad_buffers():
    from torch._subclasses.fake_tensor import FakeTensorMode

    comm = Comm.__new__(Comm)  # a stand-in: the checks only ask whether it is an open Comm
    comm._handle = ctypes.c_void_p(1)
    with FakeTensorMode():  # CUDA tensors without a GPU: every check before a launch runs
        q = torch.empty(1, 16, 4, 64, dtype=bf16, device="cuda", requires_grad=True)
        k = torch.empty(1, 16, 2, 64, dtype=bf16, device="cuda")
        with pytest.raises(ValueError, match="requires grad.*grad_buffers="):
            tilewire.ring_attention(comm, q, k, k.clone())
        with pytest.raises(TypeError, match="grad_buffers must come from"):
            tilewire.ring_attention(comm, q, k, k.clone(), grad_buffers=object())


# ---- tilewire.attention's autograd through the stand-ins ---------------------------------------


CASES = [
    # b, sq, sk, hq, hk, d, causal, q_offset, kv_offset
    (2, 24, 24, 4, 4, 64, False, 0, 0),
    (1, 40, 50, 8, 2, 128, True, 20, 5),
]


@pytest.mark.parametrize("case", CASES)
def test_attention_gradients_through_the_stand_ins(stand_ins, case):
    b, sq, sk, hq, hk, d, causal, q_off, kv_off = case
    q, k, v = _leaves(b, sq, sk, hq, hk, d, seed=sum(case))
    o, lse = tilewire.attention(q, k, v, causal=causal, q_offset=q_off, kv_offset=kv_off,
                                return_lse=True)
    assert o.requires_grad and not lse.requires_grad
    assert stand_ins.calls == [("attention", b * hq * sq)]  # lse computed for the backward
    dout = torch.randn(o.shape).to(bf16)
    got = torch.autograd.grad(o, (q, k, v), dout)
    assert stand_ins.calls[-1] == ("attention_backward", True, bf16)
    want = _reference_grads(q, k, v, dout, causal, q_off, kv_off)
    for name, g, w, t in zip("qkv", got, want, (q, k, v)):
        assert g.shape == t.shape and g.dtype == bf16, name
        assert _rel(g, w) < 2e-2, name


def test_attention_without_grad_asks_no_lse_and_dout_is_made_contiguous(stand_ins):
    q, k, v = _leaves(1, 16, 16, 4, 2, 64, seed=3)
    with torch.no_grad():
        tilewire.attention(q, k, v)
    assert stand_ins.calls == [("attention", 0)]
    k.requires_grad_(False)
    v.requires_grad_(False)
    o = tilewire.attention(q, k, v, causal=True)
    o.sum().backward()  # an expanded dout
    assert stand_ins.calls[-1] == ("attention_backward", True, bf16)
    assert q.grad is not None and k.grad is None and v.grad is None


def test_attention_backward_under_torch_compile(stand_ins):
    """torch.compile(fullgraph=True) traces the autograd Function (forward and backward ops)
    and gives the eager gradients' bits."""
    q, k, v = _leaves(1, 40, 50, 8, 2, 64, seed=5)

    def loss(q, k, v):
        o = tilewire.attention(q, k, v, causal=True, q_offset=20, kv_offset=5)
        return (o.float() ** 2).sum()

    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for name, g, w in zip("qkv", got, want):
        assert torch.equal(g, w), name
    assert [c[0] for c in stand_ins.calls].count("attention_backward") == 2


# ---- tilewire.nn.RingAttention through the stand-ins (world 1) ---------------------------------


class _Comm(FakeComm):
    id = 0  # the custom ops carry comms as ids


def test_ring_module_backward_stages_into_its_buffers(stand_ins):
    m = tilewire.nn.RingAttention(_Comm(rank=0, size=1), causal=True, layout="contiguous")
    q, k, v = _leaves(1, 16, 16, 4, 2, 64, seed=7)
    o = m(q, k, v)
    kind, k_buf, v_buf, lse_numel = stand_ins.calls[-1]
    assert kind == "ring_attention_staged" and lse_numel == 4 * 16
    assert k_buf is m._kv[0] and v_buf is m._kv[1]
    dout = torch.randn(o.shape).to(bf16)
    o.backward(dout)
    kind, q_buf, k_buf, v_buf, dout_buf, lse_buf, ws = stand_ins.calls[-1]
    assert kind == "ring_attention_backward"
    assert k_buf is m._kv[0] and v_buf is m._kv[1]
    for got, want in zip((q_buf, dout_buf, lse_buf, ws), m._grad.tensors()):
        assert got is want
    want = _reference_grads(q, k, v, dout, True)
    for name, t, w in zip("qkv", (q, k, v), want):
        assert _rel(t.grad, w) < 2e-2, name


def test_ring_module_under_torch_compile_hands_the_op_its_buffers(stand_ins):
    """The module's forward under torch.compile(fullgraph=True): the staged op receives the
    module's own K/V buffers (inductor re-inplaces them; a copy_ traced before the op would
    have had the caller's k passed instead) and gives the eager bits."""
    m = tilewire.nn.RingAttention(_Comm(rank=0, size=1), causal=False)
    m.reserve(1, 8, 2, 64)
    q, k, v = (t.detach() for t in _leaves(1, 8, 8, 2, 2, 64, seed=9))
    with torch.no_grad():
        want = m(q, k, v)
        torch._dynamo.reset()
        got = torch.compile(lambda a, b, c: m(a, b, c), fullgraph=True)(q, k, v)
    kind, k_buf, v_buf, _ = stand_ins.calls[-1]
    assert kind == "ring_attention_staged"
    assert k_buf.data_ptr() == m._kv[0].data_ptr() and v_buf.data_ptr() == m._kv[1].data_ptr()
    assert torch.equal(got, want)


def test_ring_module_backward_under_torch_compile(stand_ins):
    """A loss through the module under torch.compile(fullgraph=True): the eager gradients'
    bits, and the forward's and the backward's ops handed the module's own symmetric buffers
    (re-inplaced), not copies."""
    m = tilewire.nn.RingAttention(_Comm(rank=0, size=1), causal=True, layout="contiguous")
    m.reserve(1, 16, 2, 64, heads_q=4, grad=True)
    q, k, v = _leaves(1, 16, 16, 4, 2, 64, seed=11)

    def loss(q, k, v):
        return (m(q, k, v).float() ** 2).sum()

    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    torch._dynamo.reset()
    del stand_ins.calls[:]
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for name, g, w in zip("qkv", got, want):
        assert torch.equal(g, w), name
    (staged,) = [c for c in stand_ins.calls if c[0] == "ring_attention_staged"]
    (backward,) = [c for c in stand_ins.calls if c[0] == "ring_attention_backward"]
    assert [t.data_ptr() for t in staged[1:3]] == [t.data_ptr() for t in m._kv]
    buffers = (m._grad.q, m._kv[0], m._kv[1], m._grad.dout, m._grad.lse, m._grad.workspace)
    assert [t.data_ptr() for t in backward[1:]] == [t.data_ptr() for t in buffers]
