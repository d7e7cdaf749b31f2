/*
 * tw_moe_gemm_combine: the local experts' grouped GEMM and tw_moe_combine in one persistent
 * kernel (contract in tilewire.h). One CTA per SM of the budget, every CTA running the GEMM
 * engine's loop on the tile queue with tw_grouped_gemm's hooks (GroupedWait: the offsets of the
 * dispatch before it, in device memory):
 *
 *   GEMM      the experts' rows into this rank's expert_out; each tile's epilogue, once its
 *             stores are complete, adds 1 (system scope, behind a fence, on the signal warp) to
 *             its row block's counter. The counters count tiles over all of this op's calls:
 *             after a call every row block's holds the sum of the calls' column blocks so far
 *             (kFlagCombineCount; the last CTA tops up every block no tile touched), so a reader
 *             waits for that sum plus this call's n_blocks, and nothing is ever reset under a
 *             reader on another rank.
 *   combine   CTAs [0, reduce_ctas) claim no tile (Wait::takes_no_tile) and start on it at once;
 *             the others join after their tiles. Token t (static stride over the CTAs) waits
 *             until the row blocks of its slots' rows are complete on their ranks, then sums
 *             them as tw_moe_combine does (the same code, so the same bits).
 *
 * Before the first store the entry handshake: every rank entered this call, so every reader of
 * the previous call's expert_out is done.
 *
 * Across nodes (moe_net.cuh) the same GEMM, and the combine of tw_moe_combine across nodes: block
 * 0 first sends this rank's weights to the rail peers that hold its rows; after its tiles (the
 * reduce CTAs at once) every CTA computes its items of the partials for the rows the rail peers
 * sent, each row once its slots' row blocks are complete on their ranks of this node, and posts
 * them back; then its tokens, each once its partials landed and its own node's row blocks are
 * complete. No tile waits on anything of the combine, so the waits resolve.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "gemm/gemm_launch.cuh"
#include "ops/grouped_gemm/grouped_wait.cuh"
#include "ops/moe/moe_gemm_host.cuh"
#include "ops/moe/moe_hooks.cuh"
#include "ops/moe/moe_layout.cuh"
#include "ops/moe/moe_net.cuh"

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

struct CombineWait : GroupedWait {
  struct Params : GroupedWait::Params {
    tw_dev_comm_t dc;
    int32_t reduce_ctas;
  };
  __device__ static bool takes_no_tile(const Params &p) {
    return (int32_t)blockIdx.x < p.reduce_ctas;
  }
  __device__ static void mbar_stuck(const Params &p, int32_t code) {
    tw_pipeline_stall(p.dc, TW_CH_MOE, code);
  }
};

struct CombineParams {
  GemmParams<CountEpi, CombineWait> gemm;
  MoeParams moe;
};

/* The last CTA out, all threads: the combine's counts topped up (combine_counts_top_up) over
 * the rank's live row blocks, then the call's end. */
__device__ __forceinline__ void combine_end(const CombineParams &cp, uint64_t target,
                                            uint64_t epoch) {
  const tw_dev_comm_t &dc = cp.gemm.wait.dc;
  const int32_t live =
      min(cp.gemm.order.m_blocks,
          (__ldg(cp.gemm.wait.offsets + cp.gemm.wait.groups) + kBlockM - 1) / kBlockM);
  combine_counts_top_up(dc, live, cp.gemm.order.n_blocks, target);
  if (threadIdx.x == 0)
    tw_op_end(dc, TW_CH_MOE, epoch);
}

__global__ void __launch_bounds__(tw::gemm::kThreads, 1)
    moe_gemm_combine_kernel(const __grid_constant__ CombineParams cp) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const tw_dev_comm_t &dc = cp.gemm.wait.dc;
  const MoeParams &p = cp.moe;
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  __shared__ uint64_t s_target;
  int mine = 1;
  if (threadIdx.x == 0) {
    mine = tw_kernel_enter(dc, ch, epoch) && tw_wait_entries(dc, ch, epoch);
    const uint64_t base = *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagCombineCount);
    s_target = base + (uint64_t)cp.gemm.order.n_blocks;
  }
  const int ok = __syncthreads_and(mine);
  gemm_cta_loop<kStages, kEpiBytes, CountEpi, CombineWait, true, 1, kBN>(
      cp.gemm, smem_raw, (int32_t)blockIdx.x, (int32_t)gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_GEMM_END);
  if (ok)
    combine_phase(dc, p, s_target);
  __syncthreads();
  __shared__ int s_last;
  if (threadIdx.x == 0)
    s_last = tw_op_exit(dc, ch, epoch, false);
  __syncthreads();
  if (!s_last)
    return;
  combine_end(cp, s_target, epoch);
}

struct CombineNetParams {
  CombineParams c;
  MoeNet n;
};

/* The combine's state after the GEMM loop lives in shared memory (the loop's producer warps hold
 * few registers; kRestoreRegs gives every warp its registers back for the combine). */
__global__ void __launch_bounds__(tw::gemm::kThreads, 1)
    moe_gemm_combine_net_kernel(const __grid_constant__ CombineNetParams cn) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ NetCta c;
  __shared__ uint64_t s_target;
  const CombineParams &cp = cn.c;
  const MoeNet &n = cn.n;
  const tw_dev_comm_t &dc = cp.gemm.wait.dc;
  const MoeParams &p = cp.moe;
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  if (threadIdx.x == 0) {
    net_enter(dc, n, c, epoch);
    s_target = *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagCombineCount) +
               (uint64_t)cp.gemm.order.n_blocks;
  }
  __syncthreads();
  if (blockIdx.x == 0 && c.ok)
    net_send_weights(dc, p, n, c, epoch);
  gemm_cta_loop<kStages, kEpiBytes, CountEpi, CombineWait, true, 1, kBN, true>(
      cp.gemm, smem_raw, (int32_t)blockIdx.x, (int32_t)gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_GEMM_END);
  const TilesDone done{dc, s_target};
  net_partials(dc, p, n, c, epoch, done);
  net_combine_tokens(dc, p, n, c, epoch, done);
  __shared__ int s_last;
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_COMM_END);
    if (c.last != ~0ull)
      tw_fifo_wait_done(dc.fifo, dc, ch, c.last); /* the NIC has read this CTA's partials */
    s_last = tw_op_exit(dc, ch, epoch, false);
  }
  __syncthreads();
  if (!s_last)
    return;
  combine_end(cp, s_target, epoch);
}

static_assert(sizeof(CombineParams) <= 4096, "kernel parameters");
/* above 4 KiB, inside the 32764 bytes CUDA 12.1 and later take on sm_90 */
static_assert(sizeof(CombineNetParams) <= 32764, "kernel parameters");

} // namespace

/* Loads tw_moe_gemm_combine's kernel on the current device now (see tw_ops_preload). */
static tw_status_t moe_gemm_combine_preload(void) {
  tw_status_t st = preload_kernel<moe_gemm_combine_kernel>("loading tw_moe_gemm_combine's kernel");
  if (st == TW_SUCCESS)
    st = preload_kernel<moe_gemm_combine_net_kernel>(
        "loading tw_moe_gemm_combine's kernel across nodes");
  return st;
}

static const tw_op_desc_t moe_gemm_combine_registration = {"moe_gemm_combine",
                                                           moe_gemm_combine_preload};
TW_OP_REGISTER(moe_gemm_combine, moe_gemm_combine_registration);

extern "C" tw_status_t tw_moe_gemm_combine(tw_comm_t comm, const tw_moe_args_t *in,
                                           tw_stream_t stream) {
  const char *op = "tw_moe_gemm_combine";
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_moe_args_t a;
  Layout l;
  CombineParams cp;
  memset(&cp, 0, sizeof(cp));
  st = moe_prepare(comm, in, kGemmCombine, &a, &l, &cp.moe);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const int local = (int)(a.experts / comm->world);
  auto &g = cp.gemm;
  st = moe_gemm_params(comm, a, g, op);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  g.epi.counters = comm->ctrl->flags[TW_CH_MOE] + kFlagCombineBlocks;
  g.wait.offsets = a.offsets;
  g.wait.groups = local;
  g.wait.n = (int32_t)a.n_out;
  g.wait.n_blocks = g.order.n_blocks;
  g.wait.m_blocks = g.order.m_blocks;
  g.wait.group_m = 16;
  /* CTAs on the combine from the start: 1 in 16 (the others join after their tiles) */
  const int grid = comm->sm_budget;
  g.wait.reduce_ctas = grid / 16 > 1 ? grid / 16 : 1;
  if (g.wait.reduce_ctas >= grid)
    g.wait.reduce_ctas = grid - 1;
  if (comm->nodes > 1) {
    CombineNetParams cn;
    memset(&cn, 0, sizeof(cn));
    cn.c = cp;
    st = moe_net_params(comm, a, kGemmCombine, l, &cn.n);
    if (st == TW_SUCCESS)
      st = moe_gemm_launch<moe_gemm_combine_net_kernel, kSmem>(
          comm, a, kGemmCombine, cn,
          [](CombineNetParams &q, const tw_dev_comm_t &dc) { q.c.gemm.wait.dc = dc; }, stream, op);
    return tw_comm_result(comm, st);
  }
  st = moe_gemm_launch<moe_gemm_combine_kernel, kSmem>(
      comm, a, kGemmCombine, cp,
      [](CombineParams &q, const tw_dev_comm_t &dc) { q.gemm.wait.dc = dc; }, stream, op);
  return tw_comm_result(comm, st);
}
