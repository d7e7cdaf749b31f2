"""tilewire.attention on a Hopper GPU against torch.nn.functional.scaled_dot_product_attention
in fp32 (and a float LSE reference): head_dim 64 and 128, causal or not, GQA, tails, shard
offsets with rows no key reaches, repeatability; its backward (tw_attention_backward) against
fp32 SDPA's gradients on the same bf16 inputs, repeatable, under torch.compile and in a CUDA
graph. Skipped without torch or a Hopper GPU."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import bf16  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]


def _inputs(b, sq, sk, hq, hk, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=bf16, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=bf16, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=bf16, generator=g)
    return q, k, v


def _reference(q, k, v, causal, scale, q_offset, kv_offset):
    """fp32 SDPA with an explicit mask (kv_offset + j <= q_offset + i) and the LSE; rows with
    no visible key give 0 and -inf."""
    group = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    sq, sk = q.shape[1], k.shape[1]
    scale = scale if scale is not None else q.shape[3] ** -0.5
    mask = None
    if causal:
        i = torch.arange(sq, device="cuda").unsqueeze(1) + q_offset
        j = torch.arange(sk, device="cuda").unsqueeze(0) + kv_offset
        mask = j <= i
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    dead = torch.isinf(lse)
    if mask is not None and not dead.any():
        o = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask,
                                                             scale=scale)
    else:
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        o = p @ vf
    return o.transpose(1, 2), lse, dead


CASES = [
    # b, sq, sk, hq, hk, d, causal, q_offset, kv_offset
    (2, 77, 300, 4, 4, 64, False, 0, 0),
    (1, 1000, 1000, 8, 2, 128, True, 0, 0),
    (2, 300, 300, 8, 1, 64, True, 0, 0),
    (1, 256, 384, 4, 4, 128, True, 300, 100),
    (1, 300, 300, 2, 1, 64, True, 0, 200),
    (2, 4096, 4096, 4, 4, 128, True, 0, 0),
    (1, 1, 1000, 4, 4, 128, True, 999, 0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b%d_sq%d_sk%d_h%d/%d_d%d_c%d_o%d/%d" % c)
def test_against_sdpa(case):
    b, sq, sk, hq, hk, d, causal, q_off, kv_off = case
    q, k, v = _inputs(b, sq, sk, hq, hk, d, seed=sum(case))
    o, lse = tilewire.attention(q, k, v, causal=causal, q_offset=q_off, kv_offset=kv_off,
                                return_lse=True)
    ref_o, ref_lse, dead = _reference(q, k, v, causal, None, q_off, kv_off)
    err = (o.float() - ref_o).abs()
    assert err.max().item() <= 2e-2 * max(1.0, ref_o.abs().max().item()), err.max().item()
    live = ~dead
    assert torch.allclose(lse[live], ref_lse[live], rtol=1e-3, atol=1e-3)
    assert torch.all(lse[dead] == float("-inf"))
    dead_rows = dead.transpose(1, 2)  # (b, sq, hq)
    assert torch.all(o[dead_rows] == 0)
    o2, lse2 = tilewire.attention(q, k, v, causal=causal, q_offset=q_off, kv_offset=kv_off,
                                  return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_scale_and_plain_sdpa():
    q, k, v = _inputs(2, 513, 700, 4, 4, 128, seed=7)
    o = tilewire.attention(q, k, v, softmax_scale=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        scale=0.25).transpose(1, 2)
    assert (o.float() - ref).abs().max().item() <= 2e-2


def test_library_refuses_misaligned():
    q, k, v = _inputs(1, 128, 128, 2, 2, 64, seed=3)
    flat = torch.empty(q.numel() + 1, dtype=bf16, device="cuda")
    qm = flat[1:].view(q.shape)
    with pytest.raises(ValueError, match="q"):
        tilewire.attention(qm, k, v)


def test_torch_compile_and_cuda_graph():
    """tilewire.attention (a custom op) under torch.compile(fullgraph=True), and captured into a
    CUDA graph that replays on new inputs: both bitwise the eager call."""
    q, k, v = _inputs(2, 300, 300, 8, 2, 128, seed=5)
    want, want_lse = tilewire.attention(q, k, v, causal=True, return_lse=True)
    fn = torch.compile(lambda a, b, c: tilewire.attention(a, b, c, causal=True, return_lse=True),
                       fullgraph=True)
    got, got_lse = fn(q, k, v)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    outs = {}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs["o"] = tilewire.attention(q, k, v, causal=True)
    q2, k2, v2 = _inputs(2, 300, 300, 8, 2, 128, seed=6)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs["o"], tilewire.attention(q, k, v, causal=True))


# ---- the backward (tw_attention_backward) --------------------------------------------------

GRAD_TOL = 2.5e-2  # relative to each gradient's largest magnitude


def _reference_grads(q, k, v, dout, causal, q_offset, kv_offset):
    """The gradients of fp32 SDPA (explicit mask kv_offset + j <= q_offset + i) on the same bf16
    inputs, GQA's kv heads repeated (autograd sums their group's gradients). A row no key
    reaches is attended over every key and then zeroed, so it contributes nothing, as the
    header says of tw_attention_backward."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    qt = qf.transpose(1, 2)
    kt = kf.repeat_interleave(group, dim=2).transpose(1, 2)
    vt = vf.repeat_interleave(group, dim=2).transpose(1, 2)
    sq, sk = q.shape[1], k.shape[1]
    live = torch.ones(sq, 1, device="cuda", dtype=torch.bool)
    mask = None
    if causal:
        i = torch.arange(sq, device="cuda").unsqueeze(1) + q_offset
        j = torch.arange(sk, device="cuda").unsqueeze(0) + kv_offset
        mask = j <= i
        live = mask.any(dim=1, keepdim=True)
        mask = mask | ~live
    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    o = o * live.float()  # (b, h, sq, d) times (sq, 1)
    o.transpose(1, 2).backward(dout.float())
    return qf.grad, kf.grad, vf.grad


GRAD_CASES = [
    # b, sq, sk, hq, hk, d, causal, q_offset, kv_offset
    (2, 300, 300, 8, 2, 64, True, 0, 0),
    (2, 300, 300, 8, 2, 128, False, 0, 0),
    (1, 300, 300, 8, 2, 128, True, 0, 0),
    (2, 300, 300, 8, 2, 64, False, 0, 0),
    (1, 77, 300, 8, 2, 64, False, 0, 0),
    (1, 256, 384, 4, 4, 128, True, 300, 100),
    (1, 300, 300, 2, 1, 64, True, 0, 200),  # rows 0..199 reach no key
    (1, 1024, 1024, 8, 2, 128, True, 0, 0),
]


def _leaves(case, seed):
    b, sq, sk, hq, hk, d = case[:6]
    q, k, v = _inputs(b, sq, sk, hq, hk, d, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=bf16, generator=g)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


@pytest.mark.parametrize("case", GRAD_CASES,
                         ids=lambda c: "b%d_sq%d_sk%d_h%d/%d_d%d_c%d_o%d/%d" % c)
def test_gradients_against_sdpa(case):
    """dq, dk, dv of tilewire.attention against fp32 SDPA's on the same bf16 inputs; a second
    backward gives the same bits."""
    causal, q_off, kv_off = case[6:]
    q, k, v, dout = _leaves(case, seed=sum(case))
    o = tilewire.attention(q, k, v, causal=causal, q_offset=q_off, kv_offset=kv_off)
    got = torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(o, (q, k, v), dout)
    want = _reference_grads(q, k, v, dout, causal, q_off, kv_off)
    for name, g, w, t, g2 in zip("qkv", got, want, (q, k, v), again):
        assert g.shape == t.shape and g.dtype == bf16, name
        assert torch.isfinite(g).all(), name
        err = (g.float() - w).abs().max().item() / w.abs().max().item()
        assert err <= GRAD_TOL, "d%s: %.3g" % (name, err)
        assert torch.equal(g, g2), "d%s: a second backward differs" % name


@pytest.mark.parametrize("case", GRAD_CASES[:4] + GRAD_CASES[6:],
                         ids=lambda c: "b%d_sq%d_sk%d_h%d/%d_d%d_c%d_o%d/%d" % c)
def test_one_pass_backward(case):
    """deterministic=False (the one-pass backward): dq within the tolerance of fp32 SDPA's, dk
    and dv the default backward's bits; under torch.use_deterministic_algorithms the default
    backward's bits for dq too."""
    causal, q_off, kv_off = case[6:]
    q, k, v, dout = _leaves(case, seed=sum(case) + 5)
    kw = dict(causal=causal, q_offset=q_off, kv_offset=kv_off)
    fast = torch.autograd.grad(tilewire.attention(q, k, v, deterministic=False, **kw), (q, k, v),
                               dout)
    default = torch.autograd.grad(tilewire.attention(q, k, v, **kw), (q, k, v), dout)
    want = _reference_grads(q, k, v, dout, causal, q_off, kv_off)[0]
    assert torch.isfinite(fast[0]).all()
    err = (fast[0].float() - want).abs().max().item() / want.abs().max().item()
    assert err <= GRAD_TOL, "dq: %.3g" % err
    assert torch.equal(fast[1], default[1]) and torch.equal(fast[2], default[2])
    torch.use_deterministic_algorithms(True)
    try:
        forced = torch.autograd.grad(tilewire.attention(q, k, v, deterministic=False, **kw),
                                     (q, k, v), dout)
    finally:
        torch.use_deterministic_algorithms(False)
    for g, w in zip(forced, default):
        assert torch.equal(g, w)


def test_gradient_of_some_inputs_and_a_strided_dout():
    """Only q requires grad: k and v get none; the loss o.sum() hands the backward an expanded
    dout (made contiguous for the kernel); lse comes back detached."""
    case = (1, 300, 300, 8, 2, 64, True, 0, 0)
    q, k, v, _ = _leaves(case, seed=11)
    k.requires_grad_(False), v.requires_grad_(False)
    o, lse = tilewire.attention(q, k, v, causal=True, return_lse=True)
    assert not lse.requires_grad
    o.float().sum().backward()
    want = _reference_grads(q, k, v, torch.ones_like(o), True, 0, 0)[0]
    err = (q.grad.float() - want).abs().max().item() / want.abs().max().item()
    assert err <= GRAD_TOL, err
    assert k.grad is None and v.grad is None


def test_backward_under_torch_compile():
    """torch.compile(fullgraph=True) of a loss through tilewire.attention: the forward's and the
    backward's custom ops in the compiled graphs, the eager gradients' bits."""
    case = (2, 300, 300, 8, 2, 128, True, 0, 0)
    q, k, v, dout = _leaves(case, seed=13)

    def loss(q, k, v):
        o = tilewire.attention(q, k, v, causal=True)
        return (o.float() * dout.float()).sum()

    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for name, g, w in zip("qkv", got, want):
        assert torch.equal(g, w), "d%s" % name


def test_backward_cuda_graph_replays():
    """Forward and backward captured into one CUDA graph replay on new inputs with the bits of
    the eager calls."""
    case = (1, 300, 300, 8, 2, 64, True, 0, 0)
    q, k, v, dout = _leaves(case, seed=17)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's docs ask
        for _ in range(2):
            torch.autograd.grad(tilewire.attention(q, k, v, causal=True), (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = torch.autograd.grad(tilewire.attention(q, k, v, causal=True), (q, k, v), dout)
    q2, k2, v2, dout2 = _leaves(case, seed=18)
    with torch.no_grad():
        for dst, src in zip((q, k, v, dout), (q2, k2, v2, dout2)):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [g.clone() for g in grads]
    want = torch.autograd.grad(tilewire.attention(q, k, v, causal=True), (q, k, v), dout)
    for name, g, w in zip("qkv", replayed, want):
        assert torch.equal(g, w), "d%s" % name
    graph = None
