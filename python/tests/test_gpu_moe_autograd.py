"""Autograd of tilewire.grouped_gemm, tilewire.grouped_gemm_wgrad, and the MoE ops (moe_ffn;
moe_dispatch_gemm, bitwise as the unfused moe_dispatch -> grouped_gemm; the chain moe_dispatch
-> grouped_gemm -> moe_combine) on virtual ranks sharing one Hopper GPU: every gradient within
bf16 tolerance of torch autograd over the same layer in fp32 (h and act rounded to bf16 where
the kernels round them), and bitwise repeatable. Skipped without torch or without a Hopper
GPU."""

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import tilewire  # noqa: E402
from _gpu import bf16, close_all  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]

EXPERTS, TOP_K, HIDDEN, INTER, MAX_TOKENS = 8, 2, 256, 200, 160
TOL = 3e-2  # gradients pass through two or three bf16 roundings


def _rel(x, ref):
    """The error's norm relative to the reference's."""
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _offsets(groups, g):
    """int32 [groups + 1] of random multiples of 128 (empty groups among them)."""
    blocks = torch.randint(0, 3, (groups,), generator=g)
    return torch.cat((torch.zeros(1, dtype=torch.int64), 128 * blocks.cumsum(0))).to(
        torch.int32)


@pytest.mark.parametrize("n,k", [(256, 192), (136, 264)])
def test_grouped_gemm_backward_matches_torch(n, k):
    """d_a and d_b of grouped_gemm against fp32 autograd, every row of a group (its padding
    rows too) counted, rows past the last group zero in d_a; grouped_gemm_wgrad repeatable
    bit for bit."""
    g = torch.Generator().manual_seed(n + k)
    groups = 5
    offs = _offsets(groups, g)
    m = int(offs[-1]) + 64  # rows of no group past the last
    a = (torch.randn(m, k, generator=g) / 4).to(bf16).cuda().requires_grad_()
    b = (torch.randn(groups, n, k, generator=g) / 4).to(bf16).cuda().requires_grad_()
    d_out = torch.randn(m, n, generator=g).to(bf16).cuda()
    offsets = offs.cuda()
    out = tilewire.grouped_gemm(a, b, offsets)
    live = int(offs[-1])
    out[:live].backward(d_out[:live])
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = torch.cat([a32[int(offs[i]):int(offs[i + 1])] @ b32[i].t() for i in range(groups)])
    ref.backward(d_out[:live].float())
    assert _rel(a.grad[:live], a32.grad[:live]) < TOL, "d_a"
    assert torch.count_nonzero(a.grad[live:]) == 0, "d_a's rows of no group"
    assert _rel(b.grad, b32.grad) < TOL, "d_b"
    for i in range(groups):
        if offs[i] == offs[i + 1]:
            assert torch.count_nonzero(b.grad[i]) == 0, "an empty group's d_b"
    w1 = tilewire.grouped_gemm_wgrad(d_out, a.detach(), offsets, out_dtype=torch.float32)
    w2 = tilewire.grouped_gemm_wgrad(d_out, a.detach(), offsets, out_dtype=torch.float32)
    assert torch.equal(w1, w2), "grouped_gemm_wgrad repeats bit for bit"
    assert _rel(w1, b32.grad) < TOL


def _routing(world, seed, tokens, experts=EXPERTS):
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for r in range(world):
        t = tokens[r]
        idx = torch.rand(t, experts, generator=g).argsort(dim=1)[:, :TOP_K]
        idx[torch.rand(t, TOP_K, generator=g) < 0.1] = -1  # unused slots
        xs.append(torch.randn(t, HIDDEN, generator=g).to(bf16).cuda().requires_grad_())
        idxs.append(idx.to(torch.int32).cuda())
        ws.append(torch.rand(t, TOP_K, generator=g).cuda().requires_grad_())
    return xs, idxs, ws


def _float_ffn(x, idx, w, w13, w2, local):
    """The layer in fp32 over the global experts (w13, w2: per rank, fp32 leaves)."""
    out = torch.zeros(x.shape[0], HIDDEN, device="cuda")
    for j in range(TOP_K):
        for e in range(local * len(w13)):
            t = (idx[:, j] == e).nonzero(as_tuple=True)[0]
            if len(t) == 0:
                continue
            h = x[t] @ w13[e // local][e % local].t()
            h = h + (h.detach().to(bf16).float() - h.detach())  # rounded as the kernel's
            act = F.silu(h[:, :INTER]) * h[:, INTER:]
            act = act + (act.detach().to(bf16).float() - act.detach())
            out = out.index_add(0, t, w[t, j:j + 1] * (act @ w2[e // local][e % local].t()))
    return out


def _ffn_grads(comms, bufs, xs, idxs, ws, w13, w2, grads, experts):
    """moe_ffn forward and backward on every rank: [(d_x, d_w, d_w13, d_w2) per rank]."""
    for t in xs + ws + w13 + w2:
        t.grad = None
    outs = tilewire.for_each_rank(comms, lambda c: tilewire.moe_ffn(
        c, xs[c.rank], idxs[c.rank], ws[c.rank], w13[c.rank], w2[c.rank],
        workspace=bufs["work"][c.rank], recv=bufs["recv"][c.rank],
        expert_out=bufs["eout"][c.rank], max_tokens=MAX_TOKENS, experts=experts,
        grad_buffer=bufs["grad"][c.rank]))
    tilewire.for_each_rank(comms, lambda c: outs[c.rank].backward(grads[c.rank]))
    torch.cuda.synchronize()
    for c in comms:
        assert c.async_error() is None
    return [tuple(t.grad.clone() if t.grad is not None else None
                  for t in (xs[r], ws[r], w13[r], w2[r])) for r in range(len(comms))]


@pytest.mark.parametrize("world,experts,tokens", [(1, 8, (96,)), (2, 8, (160, 37)),
                                                  (3, 6, (0, 128, 5))])
def test_moe_ffn_backward_matches_torch(world, experts, tokens):
    """d_x, d_topk_weights, d_w13 and d_w2 of moe_ffn against fp32 autograd of the same layer
    over every rank's tokens; the backward again gives the same bits."""
    comms = tilewire.init_virtual(world)
    try:
        _ffn_case(comms, experts, tokens)
    finally:
        close_all(comms)


def _ffn_case(comms, experts, tokens):
    world = len(comms)
    rows = tilewire.moe_recv_rows(world, MAX_TOKENS, experts, TOP_K)
    bufs = {"work": [tilewire.moe_workspace(c, MAX_TOKENS, experts, TOP_K) for c in comms]}
    for name in ("recv", "eout", "grad"):
        bufs[name] = tilewire.symmetric_empty(comms, (rows, HIDDEN), bf16)
        for t in bufs[name]:
            t.zero_()  # finite padding rows (moe_ffn's contract for the backward)
    local = experts // world
    g = torch.Generator().manual_seed(world)
    w13 = [(torch.randn(local, 2 * INTER, HIDDEN, generator=g) / 16).to(bf16).cuda()
           .requires_grad_() for _ in comms]
    w2 = [(torch.randn(local, HIDDEN, INTER, generator=g) / 16).to(bf16).cuda()
          .requires_grad_() for _ in comms]
    xs, idxs, ws = _routing(world, 17 * world, tokens, experts)
    grads = [torch.randn(t, HIDDEN, generator=g).to(bf16).cuda() for t in tokens]
    got = _ffn_grads(comms, bufs, xs, idxs, ws, w13, w2, grads, experts)
    again = _ffn_grads(comms, bufs, xs, idxs, ws, w13, w2, grads, experts)
    for r in range(world):
        for name, a, b in zip(("d_x", "d_w", "d_w13", "d_w2"), got[r], again[r]):
            assert torch.equal(a, b), "rank %d: %s repeats bit for bit" % (r, name)
    # the reference: every rank's tokens through the global experts in fp32
    w13f = [w.detach().float().requires_grad_() for w in w13]
    w2f = [w.detach().float().requires_grad_() for w in w2]
    for r in range(world):
        if not tokens[r]:
            assert got[r][0].shape == (0, HIDDEN), "rank %d: d_x of no tokens" % r
            continue
        x32 = xs[r].detach().float().requires_grad_()
        w32 = ws[r].detach().clone().requires_grad_()
        out = _float_ffn(x32, idxs[r].long(), w32, w13f, w2f, local)
        out.backward(grads[r].float())
        assert _rel(got[r][0], x32.grad) < TOL, "rank %d: d_x" % r
        assert _rel(got[r][1], w32.grad) < TOL, "rank %d: d_topk_weights" % r
    for r in range(world):
        assert _rel(got[r][2], w13f[r].grad) < TOL, "rank %d: d_w13" % r
        assert _rel(got[r][3], w2f[r].grad) < TOL, "rank %d: d_w2" % r


def _slot_rows(world, idxs, experts):
    """The dispatch's layout (tilewire.h): per source rank s, the destination rank and recv row
    of every (token, slot) ([T, TOP_K] int64 each, -1 where unused): expert-major, inside an
    expert by source rank, inside a source in token order, each expert from a multiple of
    128."""
    local = experts // world
    idxs = [i.cpu() for i in idxs]
    dest_rank = [torch.full(i.shape, -1, dtype=torch.int64) for i in idxs]
    dest_row = [torch.full(i.shape, -1, dtype=torch.int64) for i in idxs]
    for d in range(world):
        row = 0
        for e in range(d * local, (d + 1) * local):
            for s in range(world):
                t, j = (idxs[s] == e).nonzero(as_tuple=True)  # token order
                dest_rank[s][t, j] = d
                dest_row[s][t, j] = row + torch.arange(len(t))
                row += len(t)
            row = (row + 127) // 128 * 128
    return dest_rank, dest_row


def _gemm_buffers(comms, experts, n_out):
    """One pipeline's buffers per rank: workspace, recv and grad_buffer (symmetric; recv zeroed
    once, as the backward's contract asks), expert_out."""
    rows = tilewire.moe_recv_rows(len(comms), MAX_TOKENS, experts, TOP_K)
    bufs = {"work": [tilewire.moe_workspace(c, MAX_TOKENS, experts, TOP_K) for c in comms],
            "recv": tilewire.symmetric_empty(comms, (rows, HIDDEN), bf16),
            "grad": tilewire.symmetric_empty(comms, (rows, HIDDEN), bf16),
            "eout": [torch.zeros(rows, n_out, dtype=bf16, device="cuda") for _ in comms]}
    for t in bufs["recv"]:
        t.zero_()
    return bufs


def _dispatch_gemm_grads(comms, bufs, xs, idxs, w, grads, experts, fused):
    """moe_dispatch_gemm (fused) or moe_dispatch then grouped_gemm, forward and backward of
    every rank's expert_out with grads: [(expert_out, offsets, d_x, d_w) per rank]."""
    for t in xs + w:
        t.grad = None

    def forward(c):
        r = c.rank
        if fused:
            return tilewire.moe_dispatch_gemm(
                c, xs[r], idxs[r], w[r], bufs["recv"][r], bufs["eout"][r], None,
                bufs["work"][r], MAX_TOKENS, experts=experts, grad_buffer=bufs["grad"][r])
        recv, offsets = tilewire.moe_dispatch(c, xs[r], idxs[r], bufs["recv"][r], None,
                                              bufs["work"][r], MAX_TOKENS, experts=experts,
                                              grad_buffer=bufs["grad"][r])
        return tilewire.grouped_gemm(recv, w[r], offsets), offsets

    outs = tilewire.for_each_rank(comms, forward)
    tilewire.for_each_rank(comms, lambda c: outs[c.rank][0].backward(grads[c.rank]))
    torch.cuda.synchronize()
    for c in comms:
        assert c.async_error() is None
    return [(eo.detach().clone(), offs.clone(),
             xs[r].grad.clone() if xs[r].grad is not None else None,
             w[r].grad.clone() if w[r].grad is not None else None)
            for r, (eo, offs) in enumerate(outs)]


@pytest.mark.parametrize("world,experts,tokens", [(1, 8, (96,)), (2, 8, (160, 37)),
                                                  (3, 6, (0, 128, 5))])
def test_moe_dispatch_gemm_backward_matches_unfused_and_torch(world, experts, tokens):
    """moe_dispatch_gemm's expert_out (live rows), d_x and d_weights bitwise those of
    moe_dispatch -> grouped_gemm differentiated alike, again the same bits on a second call,
    d_weights alone (x not requiring grad, no grad_buffer) the same bits, and d_x and
    d_weights within bf16 tolerance of fp32 autograd over the same rows."""
    comms = tilewire.init_virtual(world)
    try:
        _dispatch_gemm_case(comms, experts, tokens)
    finally:
        close_all(comms)


def _dispatch_gemm_case(comms, experts, tokens):
    world, n_out, local = len(comms), 128, experts // len(comms)
    g = torch.Generator().manual_seed(11 * world)
    w = [(torch.randn(local, n_out, HIDDEN, generator=g) / 16).to(bf16).cuda()
         .requires_grad_() for _ in comms]
    xs, idxs, _ = _routing(world, 23 * world, tokens, experts)
    fused_bufs = _gemm_buffers(comms, experts, n_out)
    rows = fused_bufs["recv"][0].shape[0]
    # every row of expert_out gets a gradient, padding rows and rows past the last expert too
    grads = [torch.randn(rows, n_out, generator=g).to(bf16).cuda() for _ in comms]
    fused = _dispatch_gemm_grads(comms, fused_bufs, xs, idxs, w, grads, experts, True)
    again = _dispatch_gemm_grads(comms, fused_bufs, xs, idxs, w, grads, experts, True)
    unfused = _dispatch_gemm_grads(comms, _gemm_buffers(comms, experts, n_out), xs, idxs, w,
                                   grads, experts, False)
    dest_rank, dest_row = _slot_rows(world, idxs, experts)
    for d in range(world):
        live = torch.cat([dest_row[s][dest_rank[s] == d] for s in range(world)]).cuda()
        f, u = fused[d], unfused[d]
        assert torch.equal(f[1], u[1]), "rank %d: offsets" % d
        assert torch.equal(f[0][live], u[0][live]), "rank %d: expert_out's live rows" % d
        for name, a, b, c in zip(("d_x", "d_w"), f[2:], u[2:], again[d][2:]):
            assert torch.equal(a, b), "rank %d: %s as the unfused chain's" % (d, name)
            assert torch.equal(a, c), "rank %d: %s repeats bit for bit" % (d, name)
    # only the weights require grad: no grad_buffer, the same d_weights
    detached = [x.detach() for x in xs]
    no_buf = dict(fused_bufs, grad=[None] * world)
    only_w = _dispatch_gemm_grads(comms, no_buf, detached, idxs, w, grads, experts, True)
    for d in range(world):
        assert torch.equal(only_w[d][3], fused[d][3]), "rank %d: d_w alone" % d
    # the reference: every (token, slot) row through its expert in fp32
    x32 = [x.detach().float().requires_grad_() for x in xs]
    wf = [t.detach().float().requires_grad_() for t in w]
    loss = 0
    for s in range(world):
        for j in range(TOP_K):
            for d in range(world):
                t = (dest_rank[s][:, j] == d).nonzero(as_tuple=True)[0]
                if len(t) == 0:
                    continue
                e = idxs[s][t, j].long().cpu() - d * local
                assert torch.equal(fused_bufs["recv"][d][dest_row[s][t, j].cuda()], xs[s][t]), \
                    "rank %d: recv rows of source %d, slot %d" % (d, s, j)
                y = torch.einsum("th,tnh->tn", x32[s][t], wf[d][e.cuda()])
                loss = loss + (y * grads[d][dest_row[s][t, j].cuda()].float()).sum()
    loss.backward()
    for r in range(world):
        if tokens[r]:
            assert _rel(fused[r][2], x32[r].grad) < TOL, "rank %d: d_x" % r
        else:
            assert fused[r][2].shape == (0, HIDDEN), "rank %d: d_x of no tokens" % r
        assert _rel(fused[r][3], wf[r].grad) < TOL, "rank %d: d_w" % r


def test_moe_dispatch_gemm_requires_grad_buffer_when_x_requires_grad():
    """A moe_dispatch_gemm call with x requiring grad and no grad_buffer is refused naming it,
    before any kernel runs; without grad recording it runs."""
    comms = tilewire.init_virtual(1)
    try:
        c = comms[0]
        bufs = _gemm_buffers(comms, EXPERTS, 128)
        x = torch.zeros(4, HIDDEN, dtype=bf16, device="cuda", requires_grad=True)
        idx = torch.zeros(4, TOP_K, dtype=torch.int32, device="cuda")
        idx[:, 1] = 1
        w = torch.zeros(EXPERTS, 128, HIDDEN, dtype=bf16, device="cuda")
        args = (c, x, idx, w, bufs["recv"][0], bufs["eout"][0], None, bufs["work"][0],
                MAX_TOKENS)
        with pytest.raises(ValueError, match="moe_dispatch_gemm: grad_buffer is needed"):
            tilewire.moe_dispatch_gemm(*args, experts=EXPERTS)
        with torch.no_grad():
            eout, _ = tilewire.moe_dispatch_gemm(*args, experts=EXPERTS)
        torch.cuda.synchronize()
        assert c.async_error() is None and eout.grad_fn is None
    finally:
        close_all(comms)


def test_dispatch_gemm_combine_chain_backward_matches_torch():
    """moe_dispatch -> grouped_gemm -> (copied into a symmetric expert_out) -> moe_combine,
    differentiated end to end: d_x, d_topk_weights and d_w against fp32 autograd."""
    comms = tilewire.init_virtual(2)
    try:
        _chain_case(comms)
    finally:
        close_all(comms)


def _chain_case(comms):
    world, n_out = len(comms), 128
    rows = tilewire.moe_recv_rows(world, MAX_TOKENS, EXPERTS, TOP_K)
    work = [tilewire.moe_workspace(c, MAX_TOKENS, EXPERTS, TOP_K) for c in comms]
    recv = tilewire.symmetric_empty(comms, (rows, HIDDEN), bf16)
    rgrad = tilewire.symmetric_empty(comms, (rows, HIDDEN), bf16)
    eout = tilewire.symmetric_empty(comms, (rows, n_out), bf16)
    egrad = tilewire.symmetric_empty(comms, (rows, n_out), bf16)
    for t in recv + eout:
        t.zero_()
    local = EXPERTS // world
    g = torch.Generator().manual_seed(3)
    w = [(torch.randn(local, n_out, HIDDEN, generator=g) / 16).to(bf16).cuda()
         .requires_grad_() for _ in comms]
    xs, idxs, ws = _routing(world, 5, (100, 60))
    grads = [torch.randn(x.shape[0], n_out, generator=g).to(bf16).cuda() for x in xs]

    def layer(c):
        r = c.rank
        rv, offsets = tilewire.moe_dispatch(c, xs[r], idxs[r], recv[r], None, work[r],
                                            MAX_TOKENS, experts=EXPERTS,
                                            grad_buffer=rgrad[r])
        y = tilewire.grouped_gemm(rv, w[r], offsets)
        eo = eout[r]
        eo.copy_(y)  # into the symmetric expert_out the combine reads (differentiable)
        return tilewire.moe_combine(c, eo, idxs[r], ws[r], work[r], MAX_TOKENS,
                                    experts=EXPERTS, expert_grad=egrad[r])

    outs = tilewire.for_each_rank(comms, layer)
    tilewire.for_each_rank(comms, lambda c: outs[c.rank].backward(grads[c.rank]))
    torch.cuda.synchronize()
    for c in comms:
        assert c.async_error() is None
    wf = [t.detach().float().requires_grad_() for t in w]
    for r in range(world):
        x32 = xs[r].detach().float().requires_grad_()
        w32 = ws[r].detach().clone().requires_grad_()
        out = torch.zeros(x32.shape[0], n_out, device="cuda")
        for j in range(TOP_K):
            for e in range(EXPERTS):
                t = (idxs[r][:, j].long() == e).nonzero(as_tuple=True)[0]
                if len(t):
                    y = x32[t] @ wf[e // local][e % local].t()
                    out = out.index_add(0, t, w32[t, j:j + 1] * y)
        out.backward(grads[r].float())
        assert _rel(xs[r].grad, x32.grad) < TOL, "rank %d: d_x" % r
        assert _rel(ws[r].grad, w32.grad) < TOL, "rank %d: d_topk_weights" % r
    for r in range(world):
        assert _rel(w[r].grad, wf[r].grad) < TOL, "rank %d: d_w" % r


def test_moe_ffn_requires_grad_buffer_for_the_backward():
    """A differentiable moe_ffn call without grad_buffer is refused naming it, before any
    kernel runs."""
    comms = tilewire.init_virtual(1)
    try:
        _refusal_case(comms[0])
    finally:
        close_all(comms)


def _refusal_case(c):
    rows = tilewire.moe_recv_rows(1, MAX_TOKENS, EXPERTS, TOP_K)
    work = tilewire.moe_workspace(c, MAX_TOKENS, EXPERTS, TOP_K)
    recv, eout = c.empty((rows, HIDDEN), bf16), c.empty((rows, HIDDEN), bf16)
    x = torch.zeros(4, HIDDEN, dtype=bf16, device="cuda", requires_grad=True)
    idx = torch.zeros(4, TOP_K, dtype=torch.int32, device="cuda")
    idx[:, 1] = 1
    w = torch.ones(4, TOP_K, device="cuda")
    w13 = torch.zeros(EXPERTS, 2 * INTER, HIDDEN, dtype=bf16, device="cuda")
    w2 = torch.zeros(EXPERTS, HIDDEN, INTER, dtype=bf16, device="cuda")
    with pytest.raises(ValueError, match="grad_buffer"):
        tilewire.moe_ffn(c, x, idx, w, w13, w2, workspace=work, recv=recv, expert_out=eout,
                         max_tokens=MAX_TOKENS, experts=EXPERTS)
    with torch.no_grad():  # nothing to record: no grad_buffer needed
        tilewire.moe_ffn(c, x, idx, w, w13, w2, workspace=work, recv=recv, expert_out=eout,
                         max_tokens=MAX_TOKENS, experts=EXPERTS)
    torch.cuda.synchronize()
    assert c.async_error() is None
