/*
 * Internal: tw_gemm_rs / tw_gemm_ar across nodes, the rail path (gemm_rs_rail.cu): geometry,
 * workspace and flags, shared by the host side and the kernel.
 *
 * The ranks sit on `nodes` nodes of L ranks each (tw_rail_t); owner o = (node t, local index
 * l_o) holds rows [o m_local, (o + 1) m_local) of the sum, cut in the units of gemm_rs.h. The
 * sum of a unit is hierarchical, and so is its order:
 *   out[o] = sum over nodes t' = 0, 1, ... of (sum over local indices l' = 0, 1, ... of the
 *            partial of rank (t', l')), every addition fp32, one bf16 rounding at the end.
 * Rank (d, l) runs, for every owner o = (t, l) of its local index (its rail):
 *   node reduce   the L partials of o's rows from the ranks of node d, stored over NVLink into
 *                 its staging by their GEMM epilogues (slab t * L + l'), summed in local order;
 *   send          for t != d, that node partial (fp32) by RDMA to o, the rail peer on node t,
 *                 into o's inbox slot d, under net flag (d, group);
 *   final reduce  for t == d (o is this rank), once every other node's partial landed, the
 *                 nodes' partials in node order, rounded to bf16 into out.
 * tw_gemm_ar then gathers the owners' rows rail-aligned too: an owner pushes its bf16 rows over
 * NVLink into its node's gathered areas and by RDMA into its rail peers', which forward them
 * over NVLink to the rest of their node.
 *
 * The node partials, and the gathered rows, travel as whole groups of units, each unit packed
 * in a slot of 128 x block_n elements (row stride block_n), so a group is one contiguous RDMA
 * write; the staging is row-major as in gemm_rs.h.
 *
 * Workspace (symmetric, per rank; every area 256-byte aligned):
 *   staging   [nodes][L][m_local][n] partials (P; sized as fp32): slab t * L + l' holds rank
 *             (d, l')'s partial of the rows of owner (t, this rank's local index)
 *   partial   [m][n] this rank's whole partial (the unfused pipeline's tw_gemm writes it)
 *   inbox     [nodes][units_max] fp32 unit slots: slot t holds node t's partial of this rank's rows
 *   outbox    [nodes][units_max] fp32 unit slots: the node partial this rank sends to node t
 *   gathered  (tw_gemm_ar) [world][units_max] bf16 unit slots: owner o's reduced rows
 * Flags of the op's channel (ctrl->flags), stride S = tw_rs_rail_stride(nodes, world):
 *   [t S + g]          node reduce counters of owner (t, this rank's local index): every rank
 *                      of the node adds 1 per unit it stored; reset to 0 by the reduce
 *   [(nodes + o) S + g]  (tw_gemm_ar) owner o's group g is in this rank's gathered area (epoch)
 *   TW_CHANNEL_FLAGS - 1 / - 2  reduce / gather work queues
 * Net flags of the channel (device/net.cuh), cap G = tw_rs_rail_gcap(nodes) groups:
 *   [t G + g]            node t's partial of this rank's group g landed in the inbox
 *   [(nodes + t) G + g]  (tw_gemm_ar) rail peer (t, l)'s reduced group g landed in gathered
 */
#ifndef TW_OPS_GEMM_RS_RAIL_H
#define TW_OPS_GEMM_RS_RAIL_H

#include "ops/gemm_rs/gemm_rs.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The node partials of a group leave in one RDMA write of at least this many bytes (where the
 * owner has that many): with one 128 KiB unit a write, the rail reduce ran 1.1-1.7x longer on
 * the verbs test double than with 1 MiB writes (docs/PERF.md), and a NIC too spends per write. */
#define TW_RS_RAIL_WRITE_BYTES ((int64_t)1 << 20)

TW_RS_HD int tw_rs_rail_stride(int nodes, int world) {
  return (TW_CHANNEL_FLAGS - 2) / (nodes + world);
}
TW_RS_HD int tw_rs_rail_gcap(int nodes) { return (TW_NET_CH_FLAGS - 64) / (2 * nodes); }

typedef struct tw_rs_rail_layout {
  int64_t units_max;  /* units of the owner with the most */
  int64_t unit_elems; /* elements of a unit slot: 128 x block_n */
  uint64_t staging, partial, inbox, outbox, gathered, total; /* byte offsets; total: the size */
} tw_rs_rail_layout_t;

static inline uint64_t tw_rs_rail_align(uint64_t x) { return (x + 255) & ~(uint64_t)255; }

/* The layout for an m x n product on world ranks of `nodes` nodes, tiles of block_n columns. */
static inline void tw_rs_rail_layout(int world, int nodes, int64_t m, int64_t n, int block_n,
                                     tw_rs_rail_layout_t *l) {
  const int32_t m_local = (int32_t)(m / world);
  const int64_t n_blocks = (n + block_n - 1) / block_n;
  int64_t mbs = 0;
  for (int o = 0; o < world; o++)
    if (tw_rs_mb_count(o, m_local) > mbs)
      mbs = tw_rs_mb_count(o, m_local);
  l->units_max = mbs * n_blocks;
  l->unit_elems = (int64_t)TW_GEMM_RS_BLOCK_M * block_n;
  const uint64_t slot4 = (uint64_t)(l->units_max * l->unit_elems * 4);
  l->staging = 0;
  l->partial = tw_rs_rail_align((uint64_t)world * (uint64_t)m_local * (uint64_t)n * 4);
  l->inbox = l->partial + tw_rs_rail_align((uint64_t)m * (uint64_t)n * 4);
  l->outbox = l->inbox + tw_rs_rail_align(slot4 * (uint64_t)nodes);
  l->gathered = l->outbox + tw_rs_rail_align(slot4 * (uint64_t)nodes);
  l->total = l->gathered + tw_rs_rail_align(slot4 / 2 * (uint64_t)world);
}

/* Workspace bytes the rail path needs at any plan (tiles of 256 columns take the most). */
static inline size_t tw_rs_rail_workspace_bytes(int world, int nodes, int64_t m, int64_t n) {
  tw_rs_rail_layout_t l;
  tw_rs_rail_layout(world, nodes, m, n, TW_GEMM_RS_BLOCK_N, &l);
  return (size_t)l.total;
}

#ifdef __cplusplus
}
#endif
#endif
