/*
 * The GEMM engine's hooks the fused MoE kernels share (moe_gemm.cu, moe_gemm_combine.cu,
 * moe_ffn.cu): the layout every CTA derived, in shared memory; the Wait that reads it (a grouped
 * GEMM's tiles over the local experts' row blocks, each tile after its block is ready); the
 * epilogue that counts a row block's finished tiles; and the copies of the dispatch in the order
 * the GEMM consumes them.
 */
#ifndef TW_OPS_MOE_HOOKS_CUH
#define TW_OPS_MOE_HOOKS_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "gemm/gemm_params.cuh"
#include "ops/moe/moe_layout.cuh"

namespace tw {
namespace moe {

/* The layout every CTA of a fused kernel derived (the hooks read it), and this rank's live row
 * blocks (0 where the layout is unusable: nothing to compute). Each kernel's translation unit
 * has its own. */
static __shared__ SharedLayout g_layout;
static __shared__ int32_t g_live_blocks;

/* A grouped GEMM over this rank's local experts as g_layout lays out their rows: tile_count /
 * tile_index / b_source as tw_grouped_gemm's (the offsets from shared memory), and before a
 * tile's loads a bounded wait until its row block is ready: kRows, until the block's counter
 * (TW_CH_MOE, from kFlagBlocks) holds every live row of the block (the dispatch's copies);
 * else until `ready[mb]` (this rank's memory) is at least 1. */
template <bool kRows> struct LayoutWait : gemm::NoWait {
  struct Params {
    tw_dev_comm_t dc;
    const uint64_t *ready; /* !kRows */
    int32_t first_expert, local, n, n_blocks, m_blocks, group_m;
  };
  /* The local expert whose rows hold row block mb (the last with start <= its first row). */
  __device__ static int32_t group_of(const Params &p, int32_t mb) {
    const int32_t row = mb * gemm::kBlockM;
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
    const int32_t first = g_layout.start[p.first_expert + g] / gemm::kBlockM;
    const int32_t end = g + 1 < p.local ? g_layout.start[p.first_expert + g + 1]
                                        : (int32_t)g_layout.need[p.dc.rank];
    return gemm::group_tile_index(t, p.n_blocks, first,
                                  min(p.m_blocks, (end + gemm::kBlockM - 1) / gemm::kBlockM),
                                  p.group_m);
  }
  template <class P> __device__ static void b_source(const P &p, int32_t mb, int32_t &b_row) {
    b_row += group_of(p, mb) * p.n;
  }
  __device__ static void before_tile(const Params &p, int32_t mb, int32_t nb) {
    tw_trace_tile(p.dc.trace, TW_TR_CLAIMED, mb, nb);
    if constexpr (kRows) {
      const int32_t g = group_of(p, mb), e = p.first_expert + g;
      const int32_t live = g_layout.start[e] + g_layout.total[e] - mb * gemm::kBlockM;
      if (live > 0) {
        const uint64_t *count = tw_own_flag(p.dc, TW_CH_MOE, kFlagBlocks + mb);
        tw_wait_geq(p.dc, TW_CH_MOE, count, (uint64_t)min(live, gemm::kBlockM), -1, mb);
      }
    } else {
      tw_wait_geq(p.dc, TW_CH_MOE, p.ready + mb, 1, -1, mb);
    }
    tw_fence_proxy_async_global();
  }
  __device__ static void mbar_stuck(const Params &p, int32_t code) {
    tw_pipeline_stall(p.dc, TW_CH_MOE, code);
  }
  /* The engine's parameters of this Wait for a grouped GEMM of n columns over `order`. */
  static void set(Params &w, int32_t rank, int32_t local, int64_t n, const gemm::TileOrder &order) {
    w.first_expert = rank * local;
    w.local = local;
    w.n = (int32_t)n;
    w.n_blocks = order.n_blocks;
    w.m_blocks = order.m_blocks;
    w.group_m = 16;
  }
};

/* The tile into its output through c_map, then one add to its row block's counter: system
 * scope, behind a fence, on the signal warp (a fence stalls that warp, not a consumer). */
struct CountEpi {
  using Out = __nv_bfloat16;
  static constexpr bool kSignal = true;
  static constexpr bool kSignalWarp = true;
  struct Params {
    CUtensorMap c_map;
    uint64_t *counters; /* this rank's, one per row block */
  };
  __device__ static void prefetch(const Params &p) { tw::ptx::tma_prefetch_map(&p.c_map); }
  __device__ static void issue_box(const Params &p, const void *box, int32_t col, int32_t row) {
    tw::ptx::tma_store_2d(&p.c_map, box, col, row);
  }
  __device__ __forceinline__ static int signal_thread(const Params &) { return 32; }
  __device__ static void signal(const Params &p, int32_t mb, int32_t) {
    tw_fence_acq_rel_sys(); /* the tile's stores (complete) before the count its readers see */
    tw_red_relaxed_sys_add(p.counters + mb, 1);
  }
};

/* The dispatch's copies by every CTA of the grid, each its share, before the CTAs join the
 * GEMM: this rank's rows in the order the GEMM consumes them, expert by expert (the inverse
 * table inv) from this rank's own experts, a warp a row; after each row one system-scope add of
 * 1 to the counter of its 128-row block on the expert's rank (LayoutWait<true> waits for them).
 * Every CTA copies so the rows land at the dispatch's own rate: with a few copying CTAs the
 * others sat waiting for rows longer than the copies take when all CTAs share them
 * (docs/PERF.md, the MoE section). */
__device__ inline void copy_rows(const MoeParams &p, const tw_dev_comm_t &dc) {
  const int32_t copy_ctas = (int32_t)gridDim.x;
  const int32_t rows = p.cbase[p.experts], start = p.cbase[dc.rank * p.local_experts];
  const int lane = threadIdx.x % 32;
  for (int32_t j = (int32_t)(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32); j < rows;
       j += copy_ctas * (int32_t)(blockDim.x / 32)) {
    const int32_t jj = (j + start) % rows, i = p.inv[jj];
    const int32_t e = load_index(p, i), d = e / p.local_experts;
    const int64_t row = (int64_t)g_layout.base[e] + p.pos[i];
    warp_copy_row(p.recv[d] + row * p.hidden, p.x + (i / p.top_k) * p.hidden, p.hidden, lane);
    __syncwarp();
    if (lane == 0) {
      p.route[i] = (int64_t)d << 40 | row;
      const int index = kFlagBlocks + (int)(row / gemm::kBlockM);
      tw_fence_acq_rel_sys(); /* the warp's stores (seen through the barrier) before the add */
      tw_red_relaxed_sys_add(d == dc.rank ? tw_own_flag(dc, TW_CH_MOE, index)
                                          : tw_peer_flag(dc, d, TW_CH_MOE, index),
                             1);
    }
  }
}

/* The dispatch's layout phase of a fused kernel, all threads of every CTA: the count exchange
 * (exchange(layout, scratch), by default exchange_layout, into g_layout; block 0's counts in
 * `scratch`, shared memory free until the GEMM starts), g_live_blocks, the error where the
 * layout is unusable, block 0's offsets. Returns whether the layout is usable (rows to copy and
 * tiles to run). */
struct ExchangeInNode {
  const tw_dev_comm_t &dc;
  const MoeParams &p;
  uint64_t epoch;
  __device__ int operator()(SharedLayout &s, int32_t *scratch) const {
    return exchange_layout(dc, p, s, scratch, epoch);
  }
};
template <class Exchange>
__device__ inline bool layout_phase(const tw_dev_comm_t &dc, const MoeParams &p, int32_t *scratch,
                                    const Exchange &exchange) {
  const int ok = exchange(g_layout, scratch);
  const bool usable = ok && g_layout.bad_src < 0 && g_layout.over_rank < 0;
  if (threadIdx.x == 0) {
    g_live_blocks =
        usable ? (int32_t)((g_layout.need[dc.rank] + gemm::kBlockM - 1) / gemm::kBlockM) : 0;
    tw_trace_stamp(dc, TW_TR_LAYOUT_AT);
  }
  if (ok && !usable && blockIdx.x == 0 && threadIdx.x == 0)
    record_layout_error(dc, p, g_layout); /* no rank copies, no tile runs */
  if (blockIdx.x == 0 && usable)
    for (int e = threadIdx.x; e <= p.local_experts; e += blockDim.x)
      p.offsets[e] = e < p.local_experts ? g_layout.start[dc.rank * p.local_experts + e]
                                         : (int32_t)g_layout.need[dc.rank];
  __syncthreads();
  return usable;
}
__device__ inline bool layout_phase(const tw_dev_comm_t &dc, const MoeParams &p, int32_t *scratch,
                                    uint64_t epoch) {
  return layout_phase(dc, p, scratch, ExchangeInNode{dc, p, epoch});
}

/* The combine phase of a fused kernel after its GEMM, all threads: token t (a static stride
 * over the CTAs) waits until the row blocks of its slots' rows are complete on their ranks
 * (TilesDone: the cumulative tile counts of kFlagCombineBlocks at `target`), then sums them as
 * tw_moe_combine does (combine_token: the same bits). Returns whether every wait succeeded.
 * Across nodes the fused kernels wait through TilesDone too (moe_net.cuh's Ready). */
struct TilesDone {
  const tw_dev_comm_t &dc;
  uint64_t target;
  /* Thread 0: a bounded wait until the row block of route entry r (rank << 40 | row) holds
   * `target` finished tiles on its rank (kFlagCombineBlocks); false: it failed (recorded). */
  __device__ bool operator()(int64_t r) const {
    const int d = (int)(r >> 40), block = (int)((r & ((1ll << 40) - 1)) / gemm::kBlockM);
    const int index = kFlagCombineBlocks + block;
    const uint64_t *count =
        d == dc.rank ? tw_own_flag(dc, TW_CH_MOE, index) : tw_peer_flag(dc, d, TW_CH_MOE, index);
    return tw_wait_geq(dc, TW_CH_MOE, count, target, d, block);
  }
};
__device__ inline bool combine_phase(const tw_dev_comm_t &dc, const MoeParams &p, uint64_t target) {
  const TilesDone done{dc, target};
  int mine = 1, ok = 1;
  for (int64_t t = blockIdx.x; ok && t < p.tokens; t += gridDim.x) {
    if (threadIdx.x == 0)
      for (int j = 0; j < p.top_k && mine; j++) {
        const int64_t r = p.route[t * p.top_k + j];
        if (r >= 0)
          mine = done(r);
      }
    ok = __syncthreads_and(mine);
    if (ok)
      combine_token(p, t);
  }
  return ok;
}

/* The last CTA of a call whose GEMM counted tiles into kFlagCombineBlocks, all threads: every
 * row block this call's tiles did not count, of every bound a call may have (kMaxBlocks),
 * reaches the call's count too, so the next call's target holds for all of them whatever its
 * n_out and recv_rows; then the count itself. */
__device__ inline void combine_counts_top_up(const tw_dev_comm_t &dc, int32_t live,
                                             int32_t n_blocks, uint64_t target) {
  for (int32_t b = max(live, 0) + (int32_t)threadIdx.x; b < kMaxBlocks; b += blockDim.x)
    atomicAdd((unsigned long long *)tw_own_flag(dc, TW_CH_MOE, kFlagCombineBlocks + b),
              (unsigned long long)n_blocks);
  __syncthreads();
  if (threadIdx.x == 0)
    *(volatile uint64_t *)tw_own_flag(dc, TW_CH_MOE, kFlagCombineCount) = target;
}

} // namespace moe
} // namespace tw
#endif
