/*
 * tw_moe_dispatch_gemm: tw_moe_dispatch and the local experts' grouped GEMM in one persistent
 * kernel (contract in tilewire.h). One CTA per SM of the budget, every CTA running the GEMM
 * engine's loop on the tile queue:
 *
 *   layout      every CTA, first: the entry handshake and the count exchange of the dispatch
 *               (exchange_layout, moe_layout.cuh); block 0 lays out this rank's entries. Every
 *               CTA then holds the layout in shared memory, where the GEMM's hooks read it.
 *   copy        CTAs [0, comm_ctas), before they join the GEMM: this rank's rows in the order
 *               the GEMM consumes them, expert by expert (the inverse table inv), starting at
 *               this rank's own experts, a warp a row; after each row one system-scope add of
 *               1 to the counter of its 128-row block on the expert's rank.
 *   GEMM        MoeWait: tile_count / tile_index / b_source as tw_grouped_gemm's (the offsets
 *               from shared memory), and before a tile's loads a bounded wait until its block's
 *               counter holds every live row of the block.
 *   end         the last CTA out zeroes this rank's block counters (every add of the call came
 *               before the tile that waited for it) and ends the call.
 *
 * Flags of TW_CH_MOE: moe_layout.cuh (the counts, then the block counters from kFlagBlocks).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "gemm/gemm_launch.cuh"
#include "ops/moe/moe_gemm_host.cuh"
#include "ops/moe/moe_layout.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
}

namespace {

using namespace tw::gemm;
using namespace tw::moe;

constexpr int kStages = 3, kEpiBytes = 32768, kBN = kBlockN;
constexpr int kSmem = SmemLayout<kStages, kEpiBytes, kBN>::kDynamicBytes;

/* The layout every CTA derived (the hooks read it), and its live row blocks (0 where the layout
 * is unusable: nothing to compute). */
__shared__ SharedLayout g_layout;
__shared__ int32_t g_live_blocks;

struct MoeWait : NoWait {
  struct Params {
    tw_dev_comm_t dc;
    int32_t first_expert, local, n, n_blocks, m_blocks, group_m, world;
  };
  /* The local expert whose rows hold row block mb (the last with start <= its first row). */
  __device__ static int32_t group_of(const Params &p, int32_t mb) {
    const int32_t row = mb * kBlockM;
    int32_t lo = 0, hi = p.local - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (g_layout.start[p.first_expert + mid] <= row)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }
  template <class P> __device__ static int32_t tile_count(const P &p, int32_t) {
    return g_live_blocks * p.n_blocks;
  }
  /* tw_grouped_gemm's order: inside each expert, L2 groups of group_m row blocks. */
  template <class P> __device__ static int32_t tile_index(const P &p, int32_t t) {
    const int32_t g = group_of(p, t / p.n_blocks);
    const int32_t first = g_layout.start[p.first_expert + g] / kBlockM;
    const int32_t end = g + 1 < p.local ? g_layout.start[p.first_expert + g + 1]
                                        : (int32_t)g_layout.need[p.dc.rank];
    return group_tile_index(t, p.n_blocks, first, min(p.m_blocks, (end + kBlockM - 1) / kBlockM),
                            p.group_m);
  }
  template <class P> __device__ static void b_source(const P &p, int32_t mb, int32_t &b_row) {
    b_row += group_of(p, mb) * p.n;
  }
  /* Every live row of the tile's block has landed (its counter counts them). */
  __device__ static void before_tile(const Params &p, int32_t mb, int32_t nb) {
    tw_trace_tile(p.dc.trace, TW_TR_CLAIMED, mb, nb);
    const int32_t g = group_of(p, mb), e = p.first_expert + g;
    const int32_t live = g_layout.start[e] + g_layout.total[e] - mb * kBlockM;
    if (live > 0) {
      const uint64_t *count = tw_own_flag(p.dc, TW_CH_MOE, kFlagBlocks + mb);
      tw_wait_geq(p.dc, TW_CH_MOE, count, (uint64_t)min(live, kBlockM), -1, mb);
    }
    tw_fence_proxy_async_global();
  }
  __device__ static void mbar_stuck(const Params &p, int32_t code) {
    tw_pipeline_stall(p.dc, TW_CH_MOE, code);
  }
};

struct FusedParams {
  GemmParams<EpiTmaStore<__nv_bfloat16>, MoeWait> gemm;
  MoeParams moe;
  int32_t comm_ctas;
};

/* A comm CTA's share of this rank's rows, in the GEMM's order from this rank's own experts. */
__device__ void copy_rows(const FusedParams &fp, const tw_dev_comm_t &dc) {
  const MoeParams &p = fp.moe;
  const int32_t rows = p.cbase[p.experts], start = p.cbase[dc.rank * p.local_experts];
  const int lane = threadIdx.x % 32;
  for (int32_t j = (int32_t)(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32); j < rows;
       j += fp.comm_ctas * (int32_t)(blockDim.x / 32)) {
    const int32_t jj = (j + start) % rows, i = p.inv[jj];
    const int32_t e = load_index(p, i), d = e / p.local_experts;
    const int64_t row = (int64_t)g_layout.base[e] + p.pos[i];
    warp_copy_row(p.recv[d] + row * p.hidden, p.x + (i / p.top_k) * p.hidden, p.hidden, lane);
    __syncwarp();
    if (lane == 0) {
      p.route[i] = (int64_t)d << 40 | row;
      const int index = kFlagBlocks + (int)(row / kBlockM);
      tw_fence_acq_rel_sys(); /* the warp's stores (seen through the barrier) before the add */
      tw_red_release_sys_add(d == dc.rank ? tw_own_flag(dc, TW_CH_MOE, index)
                                          : tw_peer_flag(dc, d, TW_CH_MOE, index),
                             1);
    }
  }
}

__global__ void __launch_bounds__(tw::gemm::kThreads, 1)
    moe_dispatch_gemm_kernel(const __grid_constant__ FusedParams fp) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const tw_dev_comm_t &dc = fp.gemm.wait.dc;
  const MoeParams &p = fp.moe;
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  /* block 0's layout counts live in the GEMM's shared memory, unused until its loop starts */
  const int ok =
      exchange_layout(dc, p, g_layout, reinterpret_cast<int32_t *>(smem_raw), epoch, true);
  const bool usable = ok && g_layout.bad_src < 0 && g_layout.over_rank < 0;
  if (threadIdx.x == 0)
    g_live_blocks = usable ? (int32_t)((g_layout.need[dc.rank] + kBlockM - 1) / kBlockM) : 0;
  if (ok && !usable && blockIdx.x == 0 && threadIdx.x == 0)
    record_layout_error(dc, p, g_layout); /* no rank copies, no tile runs */
  if (blockIdx.x == 0 && usable)
    for (int e = threadIdx.x; e <= p.local_experts; e += blockDim.x)
      p.offsets[e] = e < p.local_experts ? g_layout.start[dc.rank * p.local_experts + e]
                                         : (int32_t)g_layout.need[dc.rank];
  __syncthreads();
  if (usable && (int)blockIdx.x < fp.comm_ctas)
    copy_rows(fp, dc);
  __syncthreads();
  gemm_cta_loop<kStages, kEpiBytes, EpiTmaStore<__nv_bfloat16>, MoeWait, true, 1, kBN>(
      fp.gemm, smem_raw, (int32_t)blockIdx.x, (int32_t)gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0 && tw_op_exit(dc, ch, epoch, false)) {
    /* the last CTA: every tile waited for its block's adds, so all of them are in */
    for (int32_t b = 0; b < g_live_blocks; b++)
      *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagBlocks + b) = 0;
    tw_op_end(dc, ch, epoch);
  }
}

static_assert(sizeof(FusedParams) <= 4096, "kernel parameters");
static_assert(kSmem + sizeof(SharedLayout) + 1024 <= 227 * 1024, "shared memory");
static_assert(kSmem >= 16 * kMaxExperts * 4, "block 0's layout fits the GEMM's smem");

} // namespace

extern "C" tw_status_t tw_moe_dispatch_gemm(tw_comm_t comm, const tw_moe_args_t *in,
                                            tw_stream_t stream) {
  const char *op = "tw_moe_dispatch_gemm";
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_moe_args_t a;
  Layout l;
  FusedParams fp;
  memset(&fp, 0, sizeof(fp));
  st = moe_prepare(comm, in, kDispatchGemm, &a, &l, &fp.moe);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const int local = (int)(a.experts / comm->world);
  auto &g = fp.gemm;
  st = moe_gemm_params(comm, a, g, op);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  g.wait.first_expert = comm->rank * local;
  g.wait.local = local;
  g.wait.n = (int32_t)a.n_out;
  g.wait.n_blocks = g.order.n_blocks;
  g.wait.m_blocks = g.order.m_blocks;
  g.wait.group_m = 16;
  g.wait.world = comm->world;
  /* copy CTAs: a warp a row; enough to keep ahead of the GEMM's tiles, at most a quarter */
  const int grid = comm->sm_budget;
  const int64_t entries = a.tokens * a.top_k;
  int64_t comm_ctas = entries / 256;
  if (comm_ctas > grid / 4)
    comm_ctas = grid / 4;
  fp.comm_ctas = (int32_t)(comm_ctas < 1 ? 1 : comm_ctas);
  st = moe_gemm_launch<moe_dispatch_gemm_kernel, kSmem>(
      comm, a, kDispatchGemm, fp,
      [](FusedParams &q, const tw_dev_comm_t &dc) { q.gemm.wait.dc = dc; }, stream, op);
  return tw_comm_result(comm, st);
}
