"""tilewire.moe_ffn (the whole expert FFN in one kernel) on virtual ranks sharing one Hopper
GPU, bitwise against the unfused pipeline built from the other tilewire ops (moe_dispatch,
grouped_gemm of w13, swiglu, grouped_gemm of w2, moe_combine), and tilewire.swiglu against
torch's SiLU. Skipped without torch or without a Hopper GPU."""

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import tilewire  # noqa: E402
from _gpu import TOL, bf16, close_all, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]

EXPERTS, TOP_K, HIDDEN, INTER, MAX_TOKENS = 8, 2, 256, 200, 200  # 2 INTER: not a tile multiple
POISON = -1  # int16 bits 0xffff: a bf16 NaN


def _ordinal(t):
    """bf16 bits as integers in value order (+0 and -0 alike), for ulp distances."""
    bits = t.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _bits(t):
    return t.view(torch.int16)


def _routing(world, seed, index_dtype, tokens=None):
    """Per rank: x bf16 [T, HIDDEN], topk_idx [T, TOP_K] (distinct experts per token, some
    slots -1) and topk_weights fp32 [T, TOP_K], T random in 0 .. MAX_TOKENS (or `tokens`)."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(world):
        t = tokens if tokens is not None else int(torch.randint(0, MAX_TOKENS + 1, (1,),
                                                                generator=g))
        idx = torch.rand(t, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
        idx[torch.rand(t, TOP_K, generator=g) < 0.1] = -1  # unused slots
        xs.append(torch.randn(t, HIDDEN, generator=g).to(bf16).cuda())
        idxs.append(idx.to(index_dtype).cuda())
        ws.append(torch.rand(t, TOP_K, generator=g).cuda())
    return xs, idxs, ws


def _live_rows(world, idxs, offsets):
    """Per rank d a bool mask [recv_rows] of the live rows of its recv layout: local expert
    el's rows from offsets[el], one per (token, slot) routed to it from any rank."""
    local = EXPERTS // world
    masks = []
    for d in range(world):
        offs = offsets[d].cpu()
        mask = torch.zeros(int(offs[-1]), dtype=torch.bool)
        for el in range(local):
            e = d * local + el
            n = sum(int((i == e).sum()) for i in idxs)
            assert int(offs[el]) + n <= int(offs[el + 1])
            mask[int(offs[el]):int(offs[el]) + n] = True
        masks.append(mask)
    return masks


class _Ffn:
    """Every rank's buffers: a workspace, recv and expert_out (symmetric) and h, act for the
    fused call and for the unfused pipeline each, and the experts' weights."""

    def __init__(self, comms, seed=11):
        world = len(comms)
        self.comms = comms
        self.rows = tilewire.moe_recv_rows(world, MAX_TOKENS, EXPERTS, TOP_K)
        self.work = [tilewire.moe_workspace(c, MAX_TOKENS, EXPERTS, TOP_K) for c in comms]
        self.recv = {k: tilewire.symmetric_empty(comms, (self.rows, HIDDEN), bf16)
                     for k in ("ref", "fused")}
        self.eout = {k: tilewire.symmetric_empty(comms, (self.rows, HIDDEN), bf16)
                     for k in ("ref", "fused")}
        self.h = [torch.empty(self.rows, 2 * INTER, dtype=bf16, device="cuda") for _ in comms]
        self.act = [torch.empty(self.rows, INTER, dtype=bf16, device="cuda") for _ in comms]
        g = torch.Generator(device="cuda").manual_seed(seed)
        local = EXPERTS // world
        self.w13 = [(torch.randn(local, 2 * INTER, HIDDEN, device="cuda", generator=g) / 16)
                    .to(bf16) for _ in comms]
        self.w2 = [(torch.randn(local, HIDDEN, INTER, device="cuda", generator=g) / 16).to(bf16)
                   for _ in comms]

    def poison(self):
        for t in self.recv["ref"] + self.recv["fused"] + self.eout["ref"] + self.eout["fused"] \
                + self.h + self.act:
            _bits(t).fill_(POISON)

    def reference(self, xs, idxs, ws):
        """The unfused pipeline: (offsets, h, act, outs) per rank."""
        recv, eout = self.recv["ref"], self.eout["ref"]
        res = tilewire.for_each_rank(self.comms, lambda c: tilewire.moe_dispatch(
            c, xs[c.rank], idxs[c.rank], recv[c.rank], None, self.work[c.rank], MAX_TOKENS,
            experts=EXPERTS))
        offsets = [o for _, o in res]
        hs = tilewire.for_each_rank(self.comms, lambda c: tilewire.grouped_gemm(
            recv[c.rank], self.w13[c.rank], offsets[c.rank]))
        acts = tilewire.for_each_rank(self.comms, lambda c: tilewire.swiglu(hs[c.rank]))
        tilewire.for_each_rank(self.comms, lambda c: tilewire.grouped_gemm(
            acts[c.rank], self.w2[c.rank], offsets[c.rank], out=eout[c.rank]))
        outs = tilewire.for_each_rank(self.comms, lambda c: tilewire.moe_combine(
            c, eout[c.rank], idxs[c.rank], ws[c.rank], self.work[c.rank], MAX_TOKENS,
            experts=EXPERTS))
        return offsets, hs, acts, outs

    def fused(self, xs, idxs, ws, own_streams=False):
        """moe_ffn on every rank: through for_each_rank, or with each rank's stream passed as
        `stream` (forked from and joined back into the current stream)."""
        def call(c, stream=None):
            r = c.rank
            return tilewire.moe_ffn(
                c, xs[r], idxs[r], ws[r], self.w13[r], self.w2[r], workspace=self.work[r],
                recv=self.recv["fused"][r], expert_out=self.eout["fused"][r],
                max_tokens=MAX_TOKENS, experts=EXPERTS, h=self.h[r], act=self.act[r],
                stream=stream)

        if not own_streams:
            return tilewire.for_each_rank(self.comms, call)
        current = torch.cuda.current_stream()
        outs = []
        for c in self.comms:
            c.stream.wait_stream(current)
            outs.append(call(c, c.stream))
        for c in self.comms:
            current.wait_stream(c.stream)
        return outs

    def release(self):
        self.work.clear()
        for d in (self.recv, self.eout):
            for v in d.values():
                v.clear()


def _float_ffn(x, idx, w, w13, w2, world):
    """The whole layer in float (h and act rounded to bf16 where the kernels round them)."""
    local = EXPERTS // world
    ref = torch.zeros(x.shape[0], HIDDEN, device="cuda")
    for j in range(TOP_K):
        for e in range(EXPERTS):
            t = (idx[:, j] == e).nonzero(as_tuple=True)[0]
            if len(t) == 0:
                continue
            h = (x[t].float() @ w13[e // local][e % local].float().t()).to(bf16).float()
            act = (F.silu(h[:, :INTER]) * h[:, INTER:]).to(bf16).float()
            ref[t] += w[t, j:j + 1] * (act @ w2[e // local][e % local].float().t())
    return ref


def _check_round(ffn, it, xs, idxs, ws, reference, outs):
    """One round's fused results against the unfused pipeline's (and the float layer's)."""
    world = len(ffn.comms)
    offsets, hs, acts, ref_outs = reference
    live = _live_rows(world, idxs, offsets)
    for r in range(world):
        m = live[r].cuda()
        rows = len(m)
        pairs = ((ffn.recv["ref"][r], ffn.recv["fused"][r], "recv"), (hs[r], ffn.h[r], "h"),
                 (acts[r], ffn.act[r], "act"),
                 (ffn.eout["ref"][r], ffn.eout["fused"][r], "expert_out"))
        for want, got, name in pairs:
            assert torch.equal(_bits(got[:rows][m]), _bits(want[:rows][m])), \
                "round %d, rank %d: %s's live rows" % (it, r, name)
        assert outs[r].shape == (xs[r].shape[0], HIDDEN) and outs[r].dtype == bf16
        assert torch.equal(_bits(outs[r]), _bits(ref_outs[r])), "round %d, rank %d: out" % (it, r)
        if xs[r].shape[0]:
            ref = _float_ffn(xs[r], idxs[r].long(), ws[r], ffn.w13, ffn.w2, world)
            assert rel_err(outs[r], ref) < TOL[bf16], "rank %d: the float layer" % r


@pytest.mark.parametrize("world,index_dtype", [(1, torch.int32), (2, torch.int32),
                                               (4, torch.int32), (2, torch.int64)])
def test_moe_ffn_is_the_unfused_pipeline_bitwise(world, index_dtype):
    """recv's, h's, act's and expert_out's live rows and every rank's out bitwise those of
    moe_dispatch + grouped_gemm(w13) + swiglu + grouped_gemm(w2) + moe_combine; three
    back-to-back rounds with fresh routings (the second with tokens on rank 0 alone, the last
    on the ranks' streams passed as `stream=`), out within bf16 tolerance of the float
    layer."""
    comms = tilewire.init_virtual(world)
    ffn = None
    try:
        ffn = _Ffn(comms)
        for it in range(3):
            lone = it == 1 and world > 1
            xs, idxs, ws = _routing(world, 300 * world + it, index_dtype,
                                    tokens=0 if lone else None)
            if lone:  # one rank with tokens, the others none
                xs[0], idxs[0], ws[0] = [t[0] for t in _routing(1, 5, index_dtype)]
            ffn.poison()
            torch.cuda.synchronize()
            reference = ffn.reference(xs, idxs, ws)
            outs = ffn.fused(xs, idxs, ws, own_streams=it == 2)
            torch.cuda.synchronize()
            for c in comms:
                assert c.async_error() is None
            _check_round(ffn, it, xs, idxs, ws, reference, outs)
        ffn.release()
    finally:
        ffn = None
        close_all(comms)


@pytest.mark.parametrize("rows,inter,scale", [(1, 8, 1.0), (300, 200, 4.0), (1000, 1024, 12.0),
                                              (0, 64, 1.0)])
def test_swiglu_matches_torch(rows, inter, scale):
    """tilewire.swiglu within 1 bf16 ulp of (F.silu(g.float()) * u.float()).bfloat16(), into a
    given out and into one it allocates, also on a stream passed as `stream=`."""
    g = torch.Generator(device="cuda").manual_seed(rows + inter)
    h = (torch.randn(rows, 2 * inter, device="cuda", generator=g) * scale).to(bf16)
    if rows:
        h[0, :4] = torch.tensor([0.0, -0.0, 88.0, -100.0], dtype=bf16)  # edge values
    ref = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).bfloat16()
    act = tilewire.swiglu(h)
    assert act.shape == (rows, inter) and act.dtype == bf16 and act.device == h.device
    ulps = (_ordinal(act) - _ordinal(ref)).abs()
    assert ulps.numel() == 0 or ulps.max().item() <= 1, "max %d ulps" % ulps.max().item()
    out = torch.full((rows, inter), float("nan"), dtype=bf16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    assert tilewire.swiglu(h, out=out, stream=side) is out
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(_bits(out), _bits(act))


def test_moe_ffn_argument_errors_on_gpu():
    """Refusals before any launch: Python's (recv or expert_out not symmetric, a weight off
    the GPU) name the argument; the library's (h overlapping act, which Python does not check)
    come back as its InvalidArgumentError; the comm stays usable."""
    comms = tilewire.init_virtual(1)
    ffn = None
    try:
        c = comms[0]
        ffn = _Ffn(comms)
        xs, idxs, ws = _routing(1, 3, torch.int32, tokens=16)
        kw = dict(workspace=ffn.work[0], recv=ffn.recv["fused"][0],
                  expert_out=ffn.eout["fused"][0], max_tokens=MAX_TOKENS, experts=EXPERTS)
        args = (c, xs[0], idxs[0], ws[0], ffn.w13[0], ffn.w2[0])
        plain = torch.empty(ffn.rows, HIDDEN, dtype=bf16, device="cuda")
        with pytest.raises(ValueError, match="recv must be a symmetric tensor"):
            tilewire.moe_ffn(*args, **dict(kw, recv=plain))
        with pytest.raises(ValueError, match="expert_out must be a symmetric tensor"):
            tilewire.moe_ffn(*args, **dict(kw, expert_out=plain))
        with pytest.raises(ValueError, match="w13 is on cpu"):
            tilewire.moe_ffn(c, xs[0], idxs[0], ws[0], ffn.w13[0].cpu(), ffn.w2[0], **kw)
        both = torch.empty(ffn.rows, 2 * INTER, dtype=bf16, device="cuda")
        inside = both.view(-1)[:ffn.rows * INTER].view(ffn.rows, INTER)  # h's first half
        with pytest.raises(tilewire.InvalidArgumentError, match="args->h .* overlaps act") \
                as info:
            tilewire.moe_ffn(*args, **kw, h=both, act=inside)
        assert info.value.function == "tw_moe_ffn"
        with pytest.raises(tilewire.InvalidArgumentError, match="act .* overlaps h") as info:
            tilewire.swiglu(both, out=inside)
        assert info.value.function == "tw_swiglu"
        assert c.async_error() is None
        # a correct call still goes through afterwards
        out = tilewire.moe_ffn(*args, **kw)
        torch.cuda.synchronize()
        assert out.shape == (16, HIDDEN) and c.async_error() is None
        del info, out, kw, args
        ffn.release()
    finally:
        ffn = None
        close_all(comms)
