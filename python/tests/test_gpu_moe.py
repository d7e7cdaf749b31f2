"""The MoE ops (moe_dispatch, moe_combine, moe_dispatch_gemm) on virtual ranks sharing one
Hopper GPU, against torch reimplementations: the dispatch's layout, the combine's slot-order
sum, the whole layer, the fused dispatch + GEMM, and routing errors found on the device.
Skipped without torch or without a Hopper GPU."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import TOL, bf16, close_all, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]

EXPERTS, TOP_K, HIDDEN, N_OUT, MAX_TOKENS = 8, 2, 256, 128, 200
POISON = -1  # int16 bits 0xffff: a bf16 NaN that no dispatch writes


# ---- inputs and torch references ----------------------------------------------------------


def _routing(world, seed, index_dtype=torch.int32, tokens=None):
    """Per rank: x bf16 [T, HIDDEN], topk_idx [T, TOP_K] (distinct experts per token) and
    topk_weights fp32 [T, TOP_K], T random in 0 .. MAX_TOKENS (or `tokens`), on the GPU."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for r in range(world):
        t = tokens if tokens is not None else int(torch.randint(0, MAX_TOKENS + 1, (1,),
                                                                generator=g))
        idx = torch.rand(t, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
        xs.append(torch.randn(t, HIDDEN, generator=g).to(bf16).cuda())
        idxs.append(idx.to(index_dtype).cuda())
        ws.append(torch.rand(t, TOP_K, generator=g).cuda())
    return xs, idxs, ws


def _ref_layout(world, xs, idxs):
    """The dispatch's layout in torch: per rank d its recv's live rows (expert-major, inside
    an expert by source rank, inside a source in token order, each expert's rows from a
    multiple of 128), its offsets, and per source rank s the destination (d, row) of every
    (token, slot) ([T, TOP_K] each; -1 where unused)."""
    local = EXPERTS // world
    xs, idxs = [x.cpu() for x in xs], [i.cpu() for i in idxs]
    dest_rank = [torch.full(i.shape, -1, dtype=torch.int64) for i in idxs]
    dest_row = [torch.full(i.shape, -1, dtype=torch.int64) for i in idxs]
    rows, offsets = [], []
    for d in range(world):
        live, offs, row = [], [], 0
        for el in range(local):
            e = d * local + el
            offs.append(row)
            for s in range(world):
                t, j = (idxs[s] == e).nonzero(as_tuple=True)  # token order
                live.append((row + torch.arange(len(t)), xs[s][t]))
                dest_rank[s][t, j] = d
                dest_row[s][t, j] = row + torch.arange(len(t))
                row += len(t)
            row = (row + 127) // 128 * 128
        offs.append(row)
        rows.append(live)
        offsets.append(torch.tensor(offs, dtype=torch.int32))
    return rows, offsets, dest_rank, dest_row


def _fma_f32(acc, w, y):
    """fmaf(w, y, acc) elementwise, exactly (CPU, fp32 tensors): the product is exact in
    fp64 (24 x 8 significant bits), the sum rounded to odd in fp64 (TwoSum's error decides),
    then to nearest in fp32, which is then the correctly rounded fp32 sum."""
    a, p = acc.double(), w.double() * y.double()
    s = a + p
    bb = s - a
    err = (a - (s - bb)) + (p - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")),
                         torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def _ref_combine(eouts, dest_rank, dest_row, w, fma):
    """One source rank's combine in torch (CPU): sum over slots in order of w * expert_out
    row, in fp32 (fma: exactly as the kernel's fmaf; else torch's addcmul), then bf16."""
    acc = torch.zeros(w.shape[0], N_OUT, dtype=torch.float32)
    w = w.cpu()
    for j in range(TOP_K):
        used = dest_rank[:, j] >= 0
        y = torch.zeros(w.shape[0], N_OUT, dtype=torch.float32)
        for d in range(len(eouts)):
            mine = dest_rank[:, j] == d
            y[mine] = eouts[d][dest_row[mine, j]].float()
        wj = torch.where(used, w[:, j], torch.zeros_like(w[:, j])).unsqueeze(1)
        if fma:
            acc = torch.where(used.unsqueeze(1), _fma_f32(acc, wj.expand_as(y), y), acc)
        else:
            acc = torch.where(used.unsqueeze(1), torch.addcmul(acc, wj, y), acc)
    return acc.to(bf16)


def _ordinal(t):
    """bf16 bits as integers in value order (+0 and -0 alike), for ulp distances."""
    bits = t.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


# ---- the pipeline on every rank -----------------------------------------------------------


class _Layer:
    """Every rank's buffers: workspace, recv and expert_out (symmetric), the experts' weights,
    and the routing."""

    def __init__(self, comms, xs, idxs, ws, seed=7):
        world = len(comms)
        self.comms, self.xs, self.idxs, self.ws = comms, xs, idxs, ws
        self.rows = tilewire.moe_recv_rows(world, MAX_TOKENS, EXPERTS, TOP_K)
        self.work = [tilewire.moe_workspace(c, MAX_TOKENS, EXPERTS, TOP_K) for c in comms]
        self.recv = tilewire.symmetric_empty(comms, (self.rows, HIDDEN), bf16)
        self.eout = tilewire.symmetric_empty(comms, (self.rows, N_OUT), bf16)
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.weights = [(torch.randn(EXPERTS // world, N_OUT, HIDDEN, device="cuda",
                                     generator=g) / 16).to(bf16) for _ in comms]

    def poison(self):
        for t in self.recv + self.eout:
            t.view(torch.int16).fill_(POISON)

    def dispatch(self):
        return tilewire.for_each_rank(self.comms, lambda c: tilewire.moe_dispatch(
            c, self.xs[c.rank], self.idxs[c.rank], self.recv[c.rank], None, self.work[c.rank],
            MAX_TOKENS, experts=EXPERTS))

    def dispatch_gemm(self):
        return tilewire.for_each_rank(self.comms, lambda c: tilewire.moe_dispatch_gemm(
            c, self.xs[c.rank], self.idxs[c.rank], self.weights[c.rank], self.recv[c.rank],
            self.eout[c.rank], None, self.work[c.rank], MAX_TOKENS, experts=EXPERTS))

    def gemm(self, offsets):
        tilewire.for_each_rank(self.comms, lambda c: tilewire.grouped_gemm(
            self.recv[c.rank], self.weights[c.rank], offsets[c.rank], out=self.eout[c.rank]))

    def combine(self):
        return tilewire.for_each_rank(self.comms, lambda c: tilewire.moe_combine(
            c, self.eout[c.rank], self.idxs[c.rank], self.ws[c.rank], self.work[c.rank],
            MAX_TOKENS, experts=EXPERTS))

    def release(self):
        for buffers in (self.work, self.recv, self.eout):
            buffers.clear()


def _check_dispatch(layer, results, ref_rows, ref_offsets):
    """(a): every rank's recv and offsets as the torch layout; padding rows untouched."""
    for d, (recv, offsets) in enumerate(results):
        assert recv is layer.recv[d]
        assert offsets.dtype == torch.int32 and offsets.shape == (EXPERTS // len(results) + 1,)
        assert torch.equal(offsets.cpu(), ref_offsets[d]), "rank %d's offsets" % d
        host = recv.cpu()
        written = torch.zeros(host.shape[0], dtype=torch.bool)
        for at, x in ref_rows[d]:
            assert torch.equal(host[at], x), "rank %d's recv rows %s" % (d, at[:1].tolist())
            written[at] = True
        untouched = (host[~written].view(torch.int16) == POISON).all()
        assert untouched, "rank %d: a padding or spare row of recv was written" % d


def _check_combine(layer, outs, dest_rank, dest_row):
    """(b): each rank's combine bitwise the slot-order fmaf sum of the expert_out rows, within
    1 bf16 ulp of torch's addcmul sum, and within bf16 tolerance of the float layer."""
    world = len(outs)
    eouts = [e.cpu() for e in layer.eout]
    local = EXPERTS // world
    for r, out in enumerate(outs):
        out = out.cpu()
        assert out.shape == (layer.xs[r].shape[0], N_OUT) and out.dtype == bf16
        exact = _ref_combine(eouts, dest_rank[r], dest_row[r], layer.ws[r], fma=True)
        bad = (out.view(torch.int16) != exact.view(torch.int16)).sum().item()
        assert bad == 0, "rank %d: %d outputs differ from the slot-order fmaf sum" % (r, bad)
        plain = _ref_combine(eouts, dest_rank[r], dest_row[r], layer.ws[r], fma=False)
        ulps = (_ordinal(out) - _ordinal(plain)).abs()
        assert ulps.numel() == 0 or ulps.max().item() <= 1, "rank %d: vs addcmul" % r
        if out.shape[0] == 0:
            continue
        # the whole layer in float: sum_j w * (x @ W_e.T) over the token's experts
        x = layer.xs[r].float()
        idx = layer.idxs[r].long()
        ref = torch.zeros(x.shape[0], N_OUT, device="cuda")
        for j in range(TOP_K):
            e = idx[:, j]
            w_e = torch.stack(layer.weights)[e // local, e % local].float()  # [T, N_OUT, H]
            ref += layer.ws[r][:, j:j + 1] * torch.einsum("th,tnh->tn", x, w_e)
        assert rel_err(out.cuda(), ref) < TOL[bf16], "rank %d: the whole layer" % r


@pytest.mark.parametrize("world,index_dtype", [(1, torch.int32), (2, torch.int32),
                                               (4, torch.int32), (2, torch.int64)])
def test_moe_layer_virtual_ranks(world, index_dtype):
    """(a) the dispatch's layout, (b) grouped GEMM then combine, (c) the fused dispatch +
    GEMM bitwise as the unfused pipeline, twice with fresh routings."""
    comms = tilewire.init_virtual(world)
    layer = None
    try:
        for it in range(2):
            xs, idxs, ws = _routing(world, 100 * world + it, index_dtype)
            if layer is None:
                layer = _Layer(comms, xs, idxs, ws)
            layer.xs, layer.idxs, layer.ws = xs, idxs, ws
            ref_rows, ref_offsets, dest_rank, dest_row = _ref_layout(world, xs, idxs)
            layer.poison()
            torch.cuda.synchronize()
            results = layer.dispatch()
            torch.cuda.synchronize()
            _check_dispatch(layer, results, ref_rows, ref_offsets)
            offsets = [o for _, o in results]
            layer.gemm(offsets)
            outs = layer.combine()
            torch.cuda.synchronize()
            _check_combine(layer, outs, dest_rank, dest_row)
            for c in comms:
                assert c.async_error() is None
            # (c) the fused dispatch + GEMM, into poisoned buffers, then the combine again
            recv0 = [t.clone() for t in layer.recv]
            eout0 = [t.clone() for t in layer.eout]
            layer.poison()
            fused = layer.dispatch_gemm()
            outs2 = layer.combine()
            torch.cuda.synchronize()
            for r, (eout, offs) in enumerate(fused):
                assert eout is layer.eout[r]
                assert torch.equal(offs, offsets[r]), "rank %d: fused offsets" % r
                assert torch.equal(layer.recv[r].view(torch.int16), recv0[r].view(torch.int16))
                for at, _ in ref_rows[r]:
                    if len(at):
                        live = slice(at[0].item(), at[-1].item() + 1)
                        assert torch.equal(eout[live].view(torch.int16),
                                           eout0[r][live].view(torch.int16)), "rank %d" % r
                assert torch.equal(outs2[r].view(torch.int16), outs[r].view(torch.int16))
            for c in comms:
                assert c.async_error() is None
            del results, fused  # they hold the symmetric recv and expert_out
        layer.release()
    finally:
        close_all(comms)


@pytest.mark.parametrize("what", ["index", "capacity"])
def test_moe_routing_errors_are_reported_by_every_rank(what):
    """(d) an expert index out of range on rank 1 (or a recv too small for the routing): every
    rank's comm.async_error() is an InvalidArgumentError with the library's message, and no
    rank's recv was written."""
    world = 2
    comms = tilewire.init_virtual(world)
    layer = None
    try:
        xs, idxs, ws = _routing(world, 5, tokens=100)
        layer = _Layer(comms, xs, idxs, ws)
        if what == "index":
            idxs[1][28, 1] = EXPERTS + 1  # entry 28 x top_k + 1 = 57
            needle = "rank 1's args->topk_idx holds expert 9 at entry 57"
        else:
            layer.recv = tilewire.symmetric_empty(comms, (130, HIDDEN), bf16)
            needle = "whose args->recv_rows is 130"
        layer.poison()
        torch.cuda.synchronize()
        layer.dispatch()  # returns: the error is found on the device
        torch.cuda.synchronize()
        for c in comms:
            err = c.async_error()
            assert isinstance(err, tilewire.InvalidArgumentError), (c.rank, err)
            assert err.status == tilewire.Status.ERR_INVALID_ARGUMENT
            assert needle in err.message and "No rank copied anything" in err.message, err
            with pytest.raises(tilewire.InvalidArgumentError, match="topk_idx|recv_rows"):
                c.check_async()
        for r in range(world):
            assert (layer.recv[r].view(torch.int16) == POISON).all(), "rank %d's recv" % r
        layer.release()
    finally:
        close_all(comms)


def test_moe_argument_errors_on_gpu():
    """Refusals before any launch: Python's (a recv that is not symmetric, a workspace too
    small, a tensor off the GPU) name the argument; the library's (a workspace overlapping
    recv, which Python does not check) comes back as its InvalidArgumentError."""
    comms = tilewire.init_virtual(1)
    try:
        c = comms[0]
        xs, idxs, ws = _routing(1, 3, tokens=16)
        rows = tilewire.moe_recv_rows(1, MAX_TOKENS, EXPERTS, TOP_K)
        work = tilewire.moe_workspace(c, MAX_TOKENS, EXPERTS, TOP_K)
        plain = torch.empty(rows, HIDDEN, dtype=bf16, device="cuda")
        with pytest.raises(ValueError, match="recv must be a symmetric tensor"):
            tilewire.moe_dispatch(c, xs[0], idxs[0], plain, None, work, MAX_TOKENS,
                                  experts=EXPERTS)
        recv = c.empty((rows, HIDDEN), bf16)
        small = c.empty((16,), torch.uint8)
        with pytest.raises(ValueError, match="workspace has 16 bytes"):
            tilewire.moe_dispatch(c, xs[0], idxs[0], recv, None, small, MAX_TOKENS,
                                  experts=EXPERTS)
        with pytest.raises(ValueError, match="x is on cpu"):
            tilewire.moe_dispatch(c, xs[0].cpu(), idxs[0], recv, None, work, MAX_TOKENS,
                                  experts=EXPERTS)
        with pytest.raises(tilewire.InvalidArgumentError, match="args->recv .* overlaps "
                           "workspace") as info:
            tilewire.moe_dispatch(c, xs[0], idxs[0], recv, None, recv.view(torch.uint8),
                                  MAX_TOKENS, experts=EXPERTS)
        assert info.value.function == "tw_moe_dispatch"
        assert c.async_error() is None
        del recv, small, work, info
    finally:
        close_all(comms)
