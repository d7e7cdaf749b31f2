/*
 * The kernels of tw_moe_dispatch and tw_moe_combine across nodes (the design and its pieces:
 * moe_net.cuh; moe.cu checks, prepares and launches them). Both are persistent, one CTA per SM
 * of the budget, and take (tw_dev_comm_t, MoeParams, MoeNet).
 *
 *   moe_dispatch_net_kernel   the counts step (exchange_layout_net), then every CTA takes its
 *                             items in three rounds: the chunks bound for the other nodes
 *                             (pack_chunk), this rank's entries whose experts sit on this node
 *                             (copied as inside a node; an entry for another node gets route
 *                             -1: the combine reads its node's partial instead), and the chunks
 *                             the rail peers sent (forward_chunk). A pack waits for nothing but
 *                             the receiver's entry, so the forwards, which wait for packs, never
 *                             wait on work queued behind them. The kernel ends once every rank of
 *                             this node has had its rows land here (rows_landed) and the proxy
 *                             has finished this CTA's writes.
 *   moe_combine_net_kernel    block 0 sends this rank's weights to the rail peers that hold its
 *                             rows; every CTA then computes its share of the partials for the
 *                             rows the rail peers sent (partial_chunk), then combines its share
 *                             of this rank's tokens, each once the partials of its rows landed.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>

#include "device/signal.cuh"
#include "ops/moe/moe_net.cuh"

namespace {

using namespace tw::moe;

/* Item `item` of a CTA's round robin over the grid: whether it is this CTA's. */
__device__ __forceinline__ bool mine(int item) { return item % (int)gridDim.x == (int)blockIdx.x; }

__global__ void __launch_bounds__(kMoeThreads, 1)
    moe_dispatch_net_kernel(const __grid_constant__ tw_dev_comm_t dc,
                            const __grid_constant__ MoeParams p, const __grid_constant__ MoeNet n) {
  __shared__ SharedLayout s;
  __shared__ NetCta c;
  extern __shared__ int32_t s_count[]; /* block 0's layout: [warps + 1][experts] */
  const int ch = TW_CH_MOE, E = p.experts;
  const tw_rail_t &x = n.rail;
  const uint64_t epoch = tw_op_begin(dc, ch);
  const int ok = exchange_layout_net(dc, p, n, s, s_count, c, epoch);
  const bool copy = ok && s.bad_src < 0 && s.over_rank < 0;
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_LAYOUT_AT);
  if (ok && !copy && blockIdx.x == 0 && threadIdx.x == 0)
    record_layout_error(dc, p, s); /* no rank copies */
  int item = 0;                    /* the items of the pack and forward rounds, in turn */
  for (int q = 0; copy && q < x.nodes; q++)
    if (q != x.node)
      for (int k = 0, chunks = chunk_count(p.cnt[E + 2 + q]); k < chunks; k++, item++)
        if (mine(item))
          pack_chunk(dc, p, n, s, c, q, k, epoch);
  const int64_t entries = p.tokens * p.top_k;
  const int lane = threadIdx.x % 32;
  const int64_t first = (int64_t)blockIdx.x * kMoeWarps + threadIdx.x / 32;
  for (int64_t i = first; copy && i < entries; i += (int64_t)gridDim.x * kMoeWarps) {
    const int32_t e = load_index(p, i);
    if (e < 0)
      continue; /* its route is -1 (layout_block) */
    const int d = e / p.local_experts;
    if (x.node_of[d] != x.node) { /* sent in a chunk to d's node */
      if (lane == 0)
        p.route[i] = -1;
      continue;
    }
    const int64_t row = (int64_t)s.base[e] + p.pos[i];
    warp_copy_row(p.recv[d] + row * p.hidden, p.x + (i / p.top_k) * p.hidden, p.hidden, lane);
    if (lane == 0)
      p.route[i] = (int64_t)d << 40 | row;
  }
  for (int q = 0; copy && q < x.nodes; q++)
    if (q != x.node)
      for (int k = 0, chunks = chunk_count(rows_to_node(p, dc, x.rail[q], x.node)); k < chunks;
           k++, item++)
        if (mine(item))
          forward_chunk(dc, p, n, c, q, k, epoch);
  if (blockIdx.x == 0 && copy)
    for (int e = threadIdx.x; e <= p.local_experts; e += blockDim.x)
      p.offsets[e] =
          e < p.local_experts ? s.start[dc.rank * p.local_experts + e] : (int32_t)s.need[dc.rank];
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_COMM_END);
    if (c.last != ~0ull)
      tw_fifo_wait_done(dc.fifo, dc, ch, c.last); /* the NIC has read this CTA's staged rows */
    if (ok)
      rows_landed(dc, epoch); /* the kernel ends once every rank's rows landed here */
    tw_op_finish(dc, ch, epoch);
  }
}

__global__ void __launch_bounds__(kMoeThreads, 1)
    moe_combine_net_kernel(const __grid_constant__ tw_dev_comm_t dc,
                           const __grid_constant__ MoeParams p, const __grid_constant__ MoeNet n) {
  __shared__ NetCta c;
  __shared__ int32_t s_k[TW_RAIL_MAX_NODES]; /* a token's row among those sent to each node */
  const int ch = TW_CH_MOE, E = p.experts;
  const tw_rail_t &x = n.rail;
  const int N = x.nodes;
  const uint64_t epoch = tw_op_begin(dc, ch);
  if (threadIdx.x == 0) {
    c.last = ~0ull, c.entered = 0, c.weighed = 0;
    c.ok = tw_kernel_enter(dc, ch, epoch) && tw_wait_entries(dc, ch, epoch);
    for (int q = 0; q < N && c.ok && blockIdx.x == 0; q++)
      if (q != x.node) {
        const uint64_t t = tw_net_signal_entry(dc, ch, x.rail[q], x.node, epoch);
        c.ok = t != ~0ull;
        c.last = t;
      }
  }
  __syncthreads();
  const int64_t entries = p.tokens * p.top_k;
  if (blockIdx.x == 0 && c.ok) { /* the weights, to each rail peer that holds rows of this rank */
    float *w_out = (float *)(n.ws + n.l.w_out);
    for (int64_t i = threadIdx.x; i < entries; i += blockDim.x)
      w_out[i] = p.topk_weights[i];
    __syncthreads();
    if (threadIdx.x == 0)
      for (int q = 0; q < N; q++)
        if (q != x.node && p.cnt[E + 2 + q] > 0)
          net_post(dc, n, c, q, n.l.w_out,
                   n.l.w_in + (uint64_t)node_slot(x.node, q, N) * n.max_tokens * p.top_k * 4,
                   (uint64_t)entries * 4, kNetWeights + x.node, epoch);
  }
  int item = 0;
  for (int q = 0; q < N; q++)
    if (q != x.node)
      for (int k = 0, chunks = chunk_count(rows_to_node(p, dc, x.rail[q], x.node)); k < chunks;
           k++, item++)
        if (mine(item))
          partial_chunk(dc, p, n, c, q, k, epoch);
  const int32_t *send_idx = (const int32_t *)(n.ws + n.l.send_idx);
  __shared__ int32_t waited[TW_RAIL_MAX_NODES]; /* thread 0's: the last chunk of partials seen
                                                 * per node (shared: indexed at run time) */
  if (threadIdx.x == 0)
    for (int q = 0; q < N; q++)
      waited[q] = -1;
  __syncthreads();
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    if (threadIdx.x == 0)
      for (int q = 0; q < N; q++) {
        const int32_t k = q == x.node ? -1 : send_idx[t * N + q];
        s_k[q] = k;
        const int chunk = k < 0 ? -1 : (int)(k / chunk_rows(p.cnt[E + 2 + q]));
        if (chunk > waited[q] && c.ok) {
          c.ok = tw_wait_geq(
              dc, ch, tw_net_flag(dc, ch, kNetParts + node_slot(q, x.node, N) * kNetChunks + chunk),
              epoch, x.rail[q], chunk);
          waited[q] = chunk;
        }
      }
    __syncthreads();
    const bool go = c.ok; /* read by every thread before thread 0 can write it again */
    if (go)
      combine_token_net(p, n, s_k, t);
    __syncthreads();
    if (!go)
      break;
  }
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_COMM_END);
    if (c.last != ~0ull)
      tw_fifo_wait_done(dc.fifo, dc, ch, c.last); /* the NIC has read this CTA's partials */
    tw_op_finish(dc, ch, epoch);
  }
}

} // namespace

const void *tw::moe::moe_net_kernel(int kind) {
  return kind == kDispatch  ? (const void *)moe_dispatch_net_kernel
         : kind == kCombine ? (const void *)moe_combine_net_kernel
                            : nullptr;
}
