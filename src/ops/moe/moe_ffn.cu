/*
 * tw_moe_ffn: the expert FFN of an MoE layer, dispatch to combine, in one persistent kernel
 * (contract in tilewire.h). One CTA per SM of the budget; every CTA runs each stage in turn, and
 * each stage's row block starts once the stage before has finished that block:
 *
 *   layout   every CTA: block 0 first zeroes this rank's stage counters (the workspace's ffn,
 *            read by this rank's CTAs only; the previous call on this rank has ended), then the
 *            count exchange of the dispatch (layout_phase, moe_hooks.cuh), whose own-rank
 *            signal comes after the zeroing.
 *   copy     every CTA its share of the dispatch's rows, as tw_moe_dispatch_gemm copies them.
 *   gate/up  recv x weights^T into h on the tile queue, each tile after its row block's rows
 *            landed (LayoutWait<true>); each stored tile adds 1 to its block's h counter.
 *   SwiGLU   row block b (a static stride over the CTAs, after the CTA's gate/up tiles), once
 *            its h counter holds every column block: act's rows of b (swiglu_rows, tw_swiglu's
 *            function), then its act counter is set.
 *   down     act x weights2^T into expert_out on the static schedule, each tile after its
 *            block's act (LayoutWait<false>); each stored tile adds 1 to the block's cumulative
 *            tile count of TW_CH_MOE (kFlagCombineBlocks, as tw_moe_gemm_combine's).
 *   combine  every CTA after its down tiles, once every copy CTA of the rank has counted itself
 *            done (the route entries it reads are the copies'): combine_phase (moe_hooks.cuh).
 *   end      the last CTA out zeroes the dispatch's block counters, tops up the combine's
 *            counts (combine_counts_top_up) and ends the call.
 *
 * No stage waits on a later one, and every CTA reaches each stage (the GEMM loops run on every
 * CTA, with no tiles where the layout is unusable), so the waits resolve in stage order.
 *
 * Across nodes (moe_net.cuh) the layout and copy stages are tw_moe_dispatch_gemm's across nodes
 * (the counts over the rail; the packs, local rows and forwards, each landed row counted into
 * its block), block 0 then sends this rank's weights to the rail peers, the GEMM and SwiGLU
 * stages run as inside a node, and the combine is tw_moe_gemm_combine's across nodes: the
 * partials for the rows the rail peers sent, each row once its slots' row blocks are complete,
 * then this rank's tokens. The partials travel in their own staging regions (parts_*), since a
 * rail peer may still forward rows out of rows_in when they land.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "gemm/gemm_launch.cuh"
#include "ops/moe/moe_gemm_host.cuh"
#include "ops/moe/moe_hooks.cuh"
#include "ops/moe/moe_layout.cuh"
#include "ops/moe/moe_net_counts.cuh"
#include "ops/moe/swiglu.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

namespace {

using namespace tw::gemm;
using namespace tw::moe;

constexpr int kStages = 3, kEpiBytes = 32768, kBN = kBlockN;
constexpr int kSmem = SmemLayout<kStages, kEpiBytes, kBN>::kDynamicBytes;

struct FfnParams {
  GemmParams<CountEpi, LayoutWait<true>> up;    /* recv x weights^T -> h */
  GemmParams<CountEpi, LayoutWait<false>> down; /* act x weights2^T -> expert_out */
  MoeParams moe;
  const uint16_t *h;
  uint16_t *act;
  uint64_t *h_count, *act_ready; /* the workspace's ffn counters, per row block */
  uint64_t *copies_done;         /* and the copy CTAs done (their route entries written) */
  int64_t inter;
  int32_t blocks; /* recv_rows' row blocks */
};

/* Block 0, all threads, first: this rank's stage counters zeroed (read by this rank's CTAs only;
 * the previous call on this rank has ended), before block 0 signals its counts (layout_phase). */
__device__ __forceinline__ void ffn_zero_counters(const FfnParams &fp) {
  if (blockIdx.x != 0)
    return;
  for (int32_t b = threadIdx.x; b < fp.blocks; b += blockDim.x)
    fp.h_count[b] = 0, fp.act_ready[b] = 0;
  if (threadIdx.x == 0)
    *fp.copies_done = 0;
  __syncthreads();
}

/* Every CTA after its copies (copied: it made them): the CTA counted done with its copies, then
 * the three FFN stages, gate/up tiles, SwiGLU of its row blocks, down tiles, then the wait
 * until every copy CTA of the rank is done (the combine reads the route and meta entries they
 * wrote). s_go is cleared where a wait failed. */
__device__ __forceinline__ void ffn_stages(const FfnParams &fp, uint8_t *smem_raw, int &s_go,
                                           bool copied) {
  const tw_dev_comm_t &dc = fp.up.wait.dc;
  const MoeParams &p = fp.moe;
  __syncthreads();
  if (copied && threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_COMM_END);
    tw_fence_acq_rel_sys(); /* the CTA's route entries (seen through the barrier) first */
    tw_red_relaxed_sys_add(fp.copies_done, 1);
  }
  __syncthreads();
  gemm_cta_loop<kStages, kEpiBytes, CountEpi, LayoutWait<true>, true, 1, kBN, true>(
      fp.up, smem_raw, (int32_t)blockIdx.x, (int32_t)gridDim.x);
  __syncthreads();
  for (int32_t b = blockIdx.x; b < g_live_blocks; b += gridDim.x) {
    int mine = 1;
    if (threadIdx.x == 0)
      mine = tw_wait_geq(dc, TW_CH_MOE, fp.h_count + b, (uint64_t)fp.up.order.n_blocks, -1, b);
    if (!__syncthreads_and(mine)) {
      if (threadIdx.x == 0)
        s_go = 0;
      break;
    }
    const int64_t row1 = min((int64_t)(b + 1) * kBlockM, p.recv_rows);
    swiglu_rows(fp.h, fp.act, (int64_t)b * kBlockM, row1, fp.inter);
    __syncthreads();
    if (threadIdx.x == 0)
      tw_signal_set(fp.act_ready + b, 1); /* the CTA's act stores (seen through the barrier) */
  }
  gemm_cta_loop<kStages, kEpiBytes, CountEpi, LayoutWait<false>, false, 1, kBN, true>(
      fp.down, smem_raw, (int32_t)blockIdx.x, (int32_t)gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_GEMM_END);
  if (s_go && threadIdx.x == 0 &&
      !tw_wait_geq(dc, TW_CH_MOE, fp.copies_done, (uint64_t)gridDim.x, dc.rank, -1))
    s_go = 0;
  __syncthreads();
}

__global__ void __launch_bounds__(tw::gemm::kThreads, 1)
    moe_ffn_kernel(const __grid_constant__ FfnParams fp) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const tw_dev_comm_t &dc = fp.up.wait.dc;
  const MoeParams &p = fp.moe;
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  ffn_zero_counters(fp);
  __shared__ uint64_t s_target;
  if (threadIdx.x == 0)
    s_target = *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagCombineCount) +
               (uint64_t)fp.down.order.n_blocks;
  /* what the combine needs after the GEMM loops lives in shared memory, not in registers the
   * loops' producer warps cannot hold */
  __shared__ int s_go;
  const bool usable = layout_phase(dc, p, reinterpret_cast<int32_t *>(smem_raw), epoch);
  if (threadIdx.x == 0)
    s_go = usable;
  if (usable)
    copy_rows(p, dc);
  ffn_stages(fp, smem_raw, s_go, usable);
  if (s_go)
    combine_phase(dc, p, s_target);
  __syncthreads();
  __shared__ int s_last;
  if (threadIdx.x == 0)
    s_last = tw_op_exit(dc, ch, epoch, false);
  __syncthreads();
  if (!s_last)
    return;
  /* the last CTA: every tile waited for its block's adds, so all of them are in */
  for (int32_t b = threadIdx.x; b < g_live_blocks; b += blockDim.x)
    *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagBlocks + b) = 0;
  combine_counts_top_up(dc, g_live_blocks, fp.down.order.n_blocks, s_target);
  if (threadIdx.x == 0) {
    ll_call_done(dc, p);
    tw_op_end(dc, ch, epoch);
  }
}

/* Across nodes: the dispatch's staging (rows_*, the dispatch's stage) and the combine's
 * (parts_*, the combine's). */
struct FfnNetParams {
  FfnParams f;
  MoeNet rows, parts;
};

__global__ void __launch_bounds__(tw::gemm::kThreads, 1)
    moe_ffn_net_kernel(const __grid_constant__ FfnNetParams fn) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ NetCta c;
  __shared__ uint64_t s_target;
  __shared__ int s_go, s_last;
  const FfnParams &fp = fn.f;
  const tw_dev_comm_t &dc = fp.up.wait.dc;
  const MoeParams &p = fp.moe;
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  ffn_zero_counters(fp);
  if (threadIdx.x == 0)
    s_target = *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagCombineCount) +
               (uint64_t)fp.down.order.n_blocks;
  const bool usable = layout_phase(dc, p, reinterpret_cast<int32_t *>(smem_raw),
                                   ExchangeNet{dc, p, fn.rows, c, epoch});
  if (threadIdx.x == 0)
    s_go = usable;
  if (usable) {
    net_copy_rounds<true>(dc, p, fn.rows, g_layout, c, epoch);
    if (blockIdx.x == 0)
      net_send_weights(dc, p, fn.parts, c, epoch);
  }
  ffn_stages(fp, smem_raw, s_go, usable);
  if (s_go) {
    const TilesDone done{dc, s_target};
    net_partials(dc, p, fn.parts, c, epoch, done);
    net_combine_tokens(dc, p, fn.parts, c, epoch, done);
  }
  if (threadIdx.x == 0) {
    if (c.last != ~0ull)
      tw_fifo_wait_done(dc.fifo, dc, ch, c.last); /* the NIC has read this CTA's staged rows */
    s_last = tw_op_exit(dc, ch, epoch, false);
  }
  __syncthreads();
  if (!s_last)
    return;
  for (int32_t b = threadIdx.x; b < g_live_blocks; b += blockDim.x)
    *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagBlocks + b) = 0;
  combine_counts_top_up(dc, g_live_blocks, fp.down.order.n_blocks, s_target);
  if (threadIdx.x == 0) {
    ll_call_done(dc, p);
    tw_op_end(dc, ch, epoch);
  }
}

static_assert(sizeof(FfnNetParams) <= 32764, "kernel parameters");
/* two GEMMs' parameters: above 4 KiB, inside the 32764 bytes CUDA 12.1 and later take on sm_90 */
static_assert(sizeof(FfnParams) <= 32764, "kernel parameters");
static_assert(kSmem + sizeof(SharedLayout) + 1024 <= 227 * 1024, "shared memory");
static_assert(kSmem >= (kThreads / 32 + 1) * kMaxExperts * 4,
              "block 0's layout fits the GEMM's smem");

} // namespace

/* Loads tw_moe_ffn's kernel on the current device now (see tw_ops_preload). */
static tw_status_t moe_ffn_preload(void) {
  tw_status_t st = preload_kernel<moe_ffn_kernel>("loading tw_moe_ffn's kernel");
  if (st == TW_SUCCESS)
    st = preload_kernel<moe_ffn_net_kernel>("loading tw_moe_ffn's kernel across nodes");
  return st;
}

/* Across nodes: the kernel of moe_ffn_net_kernel with its two staging regions. */
static tw_status_t ffn_net_launch(tw_comm_t comm, const tw_moe_args_t &a, const Layout &l,
                                  const FfnParams &f, tw_stream_t stream, const char *op) {
  FfnNetParams fn;
  memset(&fn, 0, sizeof(fn));
  fn.f = f;
  tw_status_t st = moe_net_params(comm, a, kFfn, l, &fn.rows);
  if (st != TW_SUCCESS)
    return st;
  fn.parts = fn.rows;
  fn.parts.l.rows_out = l.parts_out;
  fn.parts.l.rows_in = l.parts_in;
  fn.parts.stage = (int64_t)net_part_stage(kFfn, a.n_out, a.top_k);
  return moe_gemm_launch<moe_ffn_net_kernel, kSmem>(
      comm, a, kFfn, fn,
      [](FfnNetParams &q, const tw_dev_comm_t &dc) { q.f.up.wait.dc = q.f.down.wait.dc = dc; },
      stream, op);
}

static const tw_op_desc_t moe_ffn_registration = {"moe_ffn", moe_ffn_preload};
TW_OP_REGISTER(moe_ffn, moe_ffn_registration);

extern "C" tw_status_t tw_moe_ffn(tw_comm_t comm, const tw_moe_args_t *in, tw_stream_t stream) {
  const char *op = "tw_moe_ffn";
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_moe_args_t a;
  Layout l;
  FfnParams params;
  memset(&params, 0, sizeof(params));
  FfnParams *const fp = &params;
  st = moe_prepare(comm, in, kFfn, &a, &l, &fp->moe);
  const int64_t local = a.experts / comm->world;
  if (st == TW_SUCCESS)
    st = grouped_params(comm, fp->up, a.recv, a.recv_rows, a.hidden, a.weights, 2 * a.inter, local,
                        a.h, (TileQueue *)comm->ctrl->tile_queue[TW_CH_MOE], op, "recv", "h");
  if (st == TW_SUCCESS)
    st = grouped_params(comm, fp->down, a.act, a.recv_rows, a.inter, a.weights2, a.hidden, local,
                        a.expert_out, NULL, op, "act", "expert_out");
  if (st == TW_SUCCESS) {
    uint64_t *counters = fp->moe.ffn_cnt;
    fp->up.epi.counters = counters;
    fp->down.epi.counters = comm->ctrl->flags[TW_CH_MOE] + kFlagCombineBlocks;
    LayoutWait<true>::set(fp->up.wait, comm->rank, (int32_t)local, 2 * a.inter, fp->up.order);
    LayoutWait<false>::set(fp->down.wait, comm->rank, (int32_t)local, a.hidden, fp->down.order);
    fp->down.wait.ready = counters + kMaxBlocks;
    fp->h = (const uint16_t *)a.h;
    fp->act = (uint16_t *)a.act;
    fp->h_count = counters;
    fp->act_ready = counters + kMaxBlocks;
    fp->copies_done = counters + 2 * kMaxBlocks;
    fp->inter = a.inter;
    fp->blocks = fp->up.order.m_blocks;
    if (comm->nodes > 1)
      return tw_comm_result(comm, ffn_net_launch(comm, a, l, *fp, stream, op));
    st = moe_gemm_launch<moe_ffn_kernel, kSmem>(
        comm, a, kFfn, *fp,
        [](FfnParams &q, const tw_dev_comm_t &dc) { q.up.wait.dc = q.down.wait.dc = dc; }, stream,
        op);
  }
  return tw_comm_result(comm, st);
}
