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
#include "ops/moe/moe_net_counts.cuh"

namespace {

using namespace tw::moe;

__global__ void __launch_bounds__(kMoeThreads, 1)
    moe_dispatch_net_kernel(const __grid_constant__ tw_dev_comm_t dc,
                            const __grid_constant__ MoeParams p, const __grid_constant__ MoeNet n) {
  __shared__ SharedLayout s;
  __shared__ NetCta c;
  extern __shared__ int32_t s_count[]; /* block 0's layout: [warps + 1][experts] */
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  const int ok = exchange_layout_net(dc, p, n, s, s_count, c, epoch);
  const bool copy = ok && s.bad_src < 0 && s.over_rank < 0;
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_LAYOUT_AT);
  if (ok && !copy && blockIdx.x == 0 && threadIdx.x == 0)
    record_layout_error(dc, p, s); /* no rank copies */
  if (copy)
    net_copy_rounds<false>(dc, p, n, s, c, epoch);
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
    if (tw_op_exit(dc, ch, epoch, false)) {
      ll_call_done(dc, p);
      tw_op_end(dc, ch, epoch);
    }
  }
}

__global__ void __launch_bounds__(kMoeThreads, 1)
    moe_combine_net_kernel(const __grid_constant__ tw_dev_comm_t dc,
                           const __grid_constant__ MoeParams p, const __grid_constant__ MoeNet n) {
  __shared__ NetCta c;
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  if (threadIdx.x == 0)
    net_enter(dc, n, c, epoch);
  __syncthreads();
  if (blockIdx.x == 0 && c.ok)
    net_send_weights(dc, p, n, c, epoch);
  net_partials(dc, p, n, c, epoch, RowsReady());
  net_combine_tokens(dc, p, n, c, epoch, RowsReady());
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
