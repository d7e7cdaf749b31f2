"""The fused ops across virtual nodes (Config(ranks_per_node=...)) of one Hopper GPU, through
the verbs test double that scripts/run-pytest.sh points TW_IBVERBS_LIB at: ag_gemm bitwise
tilewire.gemm of the gathered rows; gemm_rs / gemm_ar bitwise the rail path's sum (each node's
ranks in rank order, then the nodes in node order, fp32, one bf16 rounding). Skipped without
torch, a Hopper GPU or the double."""

import os

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import (  # noqa: E402
    TOL,
    ag_inputs,
    assert_clean,
    bf16,
    close_all,
    init_nodes,
    reduce_case,
    ref_product,
    rel_err,
    rs_and_ar,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("hopper_synced"),
    pytest.mark.skipif(not os.environ.get("TW_IBVERBS_LIB"),
                       reason="no verbs test double (TW_IBVERBS_LIB) to join virtual nodes"),
]

LAYOUTS = [(2, 2), (2, 1), (3, 2)]  # nodes x ranks per node


def rail_ordered_sum(a, b, per_node, partials="fp32"):
    """tw_gemm's partial of every rank (fp32, or bf16 with bf16 partials), summed in the rail
    path's order in fp32."""
    dtype = torch.float32 if partials == "fp32" else bf16
    parts = [tilewire.gemm(x, y, out_dtype=dtype).float() for x, y in zip(a, b)]
    total = None
    for first in range(0, len(parts), per_node):
        node = parts[first]
        for p in parts[first + 1:first + per_node]:
            node = node + p
        total = node if total is None else total + node
    return total


@pytest.mark.parametrize("backend", ["ib", "efa"])
@pytest.mark.parametrize("nodes,per_node", LAYOUTS)
def test_ag_gemm_across_nodes(nodes, per_node, backend):
    comms = init_nodes(nodes, per_node, backend)
    try:
        assert comms[0].nodes == nodes
        gathered, a, b = ag_inputs(comms, m_local=200, n=264, k=256)  # tails
        for _ in range(2):  # back to back
            outs = tilewire.for_each_rank(
                comms, lambda c: tilewire.ag_gemm(c, a[c.rank], b, gathered[c.rank]))
            torch.cuda.synchronize()
        full = torch.cat(a)
        want = tilewire.gemm(full, b)
        assert rel_err(want, ref_product(full, b)) < TOL[bf16]
        for r in range(len(comms)):
            assert torch.equal(gathered[r], full), "rank %d's a_gathered" % r
            assert torch.equal(outs[r], want), "rank %d" % r
        assert_clean(comms, gathered)
    finally:
        close_all(comms)


@pytest.mark.parametrize("partials", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["ib", "efa"])
@pytest.mark.parametrize("nodes,per_node", LAYOUTS)
def test_gemm_rs_and_ar_across_nodes(nodes, per_node, backend, partials):
    comms = init_nodes(nodes, per_node, backend)
    world = nodes * per_node
    try:
        m, n, a, b = reduce_case(world, m_per_rank=192, n=264, k=320)
        ws, rs, ar = rs_and_ar(comms, a, b, m, n, partials)
        total = rail_ordered_sum(a, b, per_node, partials)
        want = total.to(bf16)
        ref = sum(ref_product(x, y) for x, y in zip(a, b))
        assert rel_err(want, ref) < TOL[bf16]
        rows = m // world
        for r in range(world):
            assert torch.equal(rs[r], want[r * rows:(r + 1) * rows]), "rank %d's rs" % r
            assert torch.equal(ar[r], want), "rank %d's ar" % r
        assert_clean(comms)
        ws.clear()
    finally:
        close_all(comms)
