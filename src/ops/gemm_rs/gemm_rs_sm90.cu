/*
 * tw_gemm_rs (GEMM + ReduceScatter) and tw_gemm_ar (GEMM + AllReduce) in one
 * persistent launch per rank. Geometry, flags and workspace: gemm_rs.h.
 *
 * Every CTA runs the GEMM mainloop (src/gemm/gemm_sm90.cuh) from the tile
 * queue, in rank-rotated band sweeps: each band of `band` column blocks of the
 * product is swept over all row blocks (row-major inside the band, so a band
 * reads A once while its B stays in L2), starting at the rows of owner
 * rank + 1, so at any moment the ranks write into different owners, and every
 * owner's tiles of band b are complete after the ranks' b-th sweep (a staggered
 * schedule). Single-column sweeps (band 1, the first design) re-read all of A
 * from HBM for every column; at M=16384 K=2048 bands of 8 took the fused GEMM
 * phase from 1.9x to 1.75x the GEMM alone (the rest: docs/PERF.md).
 * The epilogue stores each finished tile of partials (fp32; bf16 with
 * TW_PARTIALS_BF16) by TMA straight into its owner's
 * staging slot for this rank (a tensor map per owner over the owner's memory;
 * a tile straddling owners is clipped by the maps) and, once the stores have
 * completed, adds 1 to the owner's counter for that unit of work.
 *
 * CTAs [0, reduce_ctas) start on the reduction: they claim this rank's unit
 * groups from a queue in unit order, wait until every rank delivered them,
 * sum the world partials in rank order (fp32, so the result does not depend on
 * arrival order) and write bf16. tw_gemm_ar then also copies each reduced group
 * to a bf16 area of the workspace and sets a ready flag on every rank, whose
 * reduce CTAs pull it into their own `out`; then they join the GEMM loop (the
 * tile queue lets CTAs join late). The GEMM CTAs then take the reduce and
 * gather work that is left (work stealing): the mainloop hands every warp back
 * the entry register split (setmaxnreg) when it ends, so that code is not
 * compiled under the producer's 40 registers (see gemm_rs_kernel).
 *
 * Ordering: a rank stores into owner o's staging only after o entered this call
 * (so o's previous call no longer reads it); an owner writes its bf16 area only
 * after every rank entered (so nobody still reads the previous call's).
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "device/signal.cuh"
#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_launch.cuh"
#include "gemm/gemm_pp_sm90.cuh"
#include "gemm/gemm_sm90.cuh"
#include "ops/gemm_rs/gemm_rs.h"
#include "ops/gemm_rs/gemm_rs_gemm.cuh"
#include "ops/gemm_rs/rs_vec.cuh"

extern "C" {
#include "core/env.h"
#include "core/log.h"
#include "gemm/tma_map.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

using namespace tw::gemm;
using tw::ll_sum_item;
using tw::pack_bf16x2;
using tw::RsVec;
using tw::sum_rank_order;

/* Measurement-only builds (-DTW_RS_DIAG=bits; results are WRONG, run tw-bench --no-check): each
 * bit removes one cost of the fused GEMM phase so its share of the time shows.
 * 1: every tile's partials go to this rank's own slot (no NVLink / peer stores);
 * 2: tile counts by a relaxed atomic, no release fence; 4: no partial stores at all;
 * 8: the reduce and gather CTAs wait for the counts but move no data;
 * 16: the plain GEMM's grouped tile order (rows rotated) instead of bands (the reduction
 * then waits long); 32: the tile signals from a consumer thread (no signal warp); 64: a tile is
 * signalled once its boxes left shared memory, not once its writes are performed (what the
 * consumers' wait for the writes costs: nothing measurable, fourteenth session); 128: the
 * second pass of a tile's fp32 epilogue (64 KiB a warpgroup through a 32 KiB buffer) does not
 * wait for the first pass's boxes to leave shared memory (what that wait costs). */
#ifndef TW_RS_DIAG
#define TW_RS_DIAG 0
#endif

namespace {

/* Pipeline per tile width: 128 x 256 tiles 3 stages and a 32 KiB epilogue buffer per consumer
 * warpgroup (a one-pass fp32 epilogue); 128 x 128 tiles (few-tile shapes, plan.block_n) 6
 * stages and 16 KiB, tw_gemm's TW_GEMM_V_N128_S6; 128 x 192 below (the ping-pong loop). */
template <int BN> struct RsConfig {
  static constexpr int kStages = 3;
  static constexpr int kEpiBytes = 32768;
};
template <> struct RsConfig<128> {
  static constexpr int kStages = 6;
  static constexpr int kEpiBytes = 16384;
};
/* 128 x 192 tiles (TW_RS_BLOCK_N=192): the ping-pong loop (gemm_pp_sm90.cuh), each tile a whole
 * tile of one consumer warpgroup, its epilogue under the other's mainloop; 4 stages, 24 KiB. */
template <> struct RsConfig<192> {
  static constexpr int kStages = 4;
  static constexpr int kEpiBytes = 24576;
};
template <int BN> constexpr int rs_smem_bytes() {
  return BN == 192 ? PpSmemLayout<RsConfig<BN>::kStages, RsConfig<BN>::kEpiBytes, BN>::kDynamicBytes
                   : SmemLayout<RsConfig<BN>::kStages, RsConfig<BN>::kEpiBytes, BN>::kDynamicBytes;
}
constexpr int kMaxWorld = TW_GEMM_RS_MAX_WORLD;
constexpr int kReduceQueue = TW_CHANNEL_FLAGS - 1;
constexpr int kGatherQueue = TW_CHANNEL_FLAGS - 2;

static_assert(kBlockM == TW_GEMM_RS_BLOCK_M && kBlockN == TW_GEMM_RS_BLOCK_N, "tile geometry");
static_assert(kMaxWorld <= 32, "entry bits");

/* Bit p: rank p entered this call (as seen by this CTA). Written by thread 0 only. */
__shared__ uint32_t s_entered;

/* Thread 0: waits until every rank in [o0, o1] entered call `epoch`. false: timed out or
 * aborted (recorded). */
__device__ __forceinline__ bool wait_entered(const tw_dev_comm_t &dc, int ch, int o0, int o1,
                                             uint64_t epoch) {
  for (int o = o0; o <= o1; o++) {
    if (s_entered >> o & 1u)
      continue;
    if (!tw_wait_entry(dc, ch, o, epoch)) {
      s_entered = ~0u; /* recorded; the kernel finishes without waiting again */
      return false;
    }
    s_entered |= 1u << o;
  }
  return true;
}

/* Before a tile's loads: its owners entered this call (their staging is free). */
struct RsWait : NoWait {
  struct Params {
    tw_dev_comm_t dc;
    int32_t ch;
    int32_t m_local;
    int32_t m;
    int32_t world;
    int32_t wait_all; /* direct / pull: every rank's previous call must be over first */
    int32_t pad;
  };
  __device__ __forceinline__ static void before_tile(const Params &p, int32_t mb, int32_t nb) {
    tw_trace_tile(p.dc.trace, TW_TR_CLAIMED, mb, nb);
    const int32_t row0 = mb * kBlockM;
    const int32_t last = min(row0 + kBlockM, p.m) - 1;
    if (p.wait_all)
      wait_entered(p.dc, p.ch, 0, p.world - 1, tw_op_begin(p.dc, p.ch));
    else
      wait_entered(p.dc, p.ch, row0 / p.m_local, last / p.m_local, tw_op_begin(p.dc, p.ch));
  }
  __device__ static void mbar_stuck(const Params &p, int32_t code) {
    tw_pipeline_stall(p.dc, p.ch, code);
  }
};

/* The call's epoch in every CTA (gemm_rs_kernel sets it before its first barrier), for
 * RsEpi::signal's ready flags (the owner epilogue of tw_gemm_ar). */
__shared__ uint64_t s_rs_epoch;

/* RsEpi's parameters (one type for both of its instantiations, kNoRowCopy or not). */
template <class P> struct RsEpiParams {
  CUtensorMap slot_map[kMaxWorld];  /* owner o's slot for this rank: P [m_local, n] */
  uint64_t *owner_flags[kMaxWorld]; /* owner o's flags of the channel */
  P *slot[kMaxWorld];               /* the same slots as plain pointers */
  int32_t n;
  int32_t m_local;
  int32_t m;
  int32_t group_units;
  int32_t n_blocks, band; /* unit numbering (gemm_rs.h) */
  int32_t direct;         /* number of ranks every box and count go to (0: the rows' owners) */
  int32_t pull;      /* boxes go to slot_map[0], this rank's own [m, n] partial (global rows) */
  int32_t gpu_scope; /* every rank is on this GPU: the tile counts at GPU scope */
  int32_t owner_epi; /* 2 ranks (plan.owner_epi): this rank's own tiles are reduced in
                        their epilogue (kOwnerEpi below) */
  uint64_t *trace;   /* dc.trace (TW_TRACE): the signalled tile goes into TW_TR_DONE */
  /* owner_epi: this rank's out (bf16 [m_local, n], ldo), its staging slots (slot s holds rank
   * s's partial of its rows), its tile counters, and its row blocks [own_mb0, + own_mbs) */
  CUtensorMap out_map;
  const P *own_slab[kMaxWorld];
  uint64_t *own_counters;
  int32_t own_mb0, own_mbs;
  /* tw_gemm_ar with the owner epilogue (plan.owner_epi on 2 ranks): each own tile's
   * bf16 boxes also go through peer_map (the peer's block of this rank's reduced rows with the
   * push, this rank's own reduced rows with the pull, the peer's out with symmetric outputs),
   * and once they are performed the tile's signal sets the peer's ready flag of the unit
   * (peer_ready[u] = the call's epoch) instead of counting a partial. */
  CUtensorMap peer_map;
  uint64_t *peer_ready;
  int32_t owner_ar, pad2;
};

/* After a tile's accumulation: boxes of partials (P: float, or bf16 with
 * TW_PARTIALS_BF16) into the owners' staging, then count the unit. kNoRowCopy (the ping-pong
 * loop's, whose 192 accumulators a thread leave no registers for it): no 16-byte copy of a box's
 * rows of an owner that starts inside it; the plan takes 192-column tiles only where no box does
 * (the pull, or m_local a multiple of 64). */
template <class P, bool kNoRowCopy = false> struct RsEpi {
  using Out = P;
  static constexpr bool kSignal = true;
  /* The system-scope release of every tile's count runs on the producer warpgroup's warp 1,
   * not on a consumer warp (where it stalled the warpgroup's next wgmma): see docs/PERF.md. */
  static constexpr bool kSignalWarp = !(TW_RS_DIAG & 32);
  static constexpr bool kDiagSignalAfterRead = (TW_RS_DIAG & 64) != 0;
  static constexpr bool kDiagPassNoWait = (TW_RS_DIAG & 128) != 0;
  using Params = RsEpiParams<P>;
  /* The consumer thread of warpgroup 0 that signals (after both warpgroups' bulk waits): one
   * of warp 1, which has no bulk stores in flight. */
  __device__ __forceinline__ static int signal_thread(const Params &) { return 32; }
  __device__ __forceinline__ static void add(const Params &p, uint64_t *flag) {
    if (TW_RS_DIAG & 2) {
      atomicAdd(reinterpret_cast<unsigned long long *>(flag), 1ull);
      return;
    }
    if (p.gpu_scope)
      tw_red_release_gpu_add(flag, 1);
    else
      tw_red_release_sys_add(flag, 1);
  }
  __device__ __forceinline__ static void prefetch(const Params &p) {
    for (int o = 0; o < kMaxWorld; o++)
      if (p.owner_flags[o])
        tw::ptx::tma_prefetch_map(&p.slot_map[o]);
  }
  __device__ __forceinline__ static void issue_box(const Params &p, const void *box, int32_t col,
                                                   int32_t row) {
    if (row >= p.m || (TW_RS_DIAG & 4))
      return;
    if (p.pull) { /* owners read it from here when they reduce */
      tw::ptx::tma_store_2d(&p.slot_map[0], box, col, row);
      return;
    }
    if (p.direct) { /* the tile's rows are every rank's: its slot for this rank on each */
      for (int32_t d = 0; d < p.direct; d++)
        tw::ptx::tma_store_2d(&p.slot_map[d], box, col, row);
      return;
    }
    const int32_t last = min(row + kBoxRows, p.m) - 1;
    for (int32_t o = row / p.m_local; o <= last / p.m_local; o++) {
      const int32_t local = row - o * p.m_local;
      if (local >= 0) { /* rows past the owner's m_local are dropped by TMA */
        tw::ptx::tma_store_2d(&p.slot_map[o], box, col, local);
        continue;
      }
      if constexpr (kNoRowCopy)
        continue; /* the plan keeps these boxes off this epilogue (pull) */
      /* The owner's rows start inside the box: a TMA store would need a negative row
       * coordinate (an illegal instruction here), so this thread copies those rows out of
       * the 128B-swizzled box with 16-byte stores. Only boxes at owner boundaries that are
       * not 64-row aligned take this path, and the plan pulls there unless TW_RS_PULL=0 (one
       * thread's stores over NVLink made GEMM+AR at M=64 4x slower than tw_gemm + reduce). */
      constexpr int32_t kPer16 = 16 / (int32_t)sizeof(P); /* elements per 16-byte chunk */
      const int32_t r_end = min(kBoxRows, p.m_local - local);
      const uint8_t *src = static_cast<const uint8_t *>(box);
      for (int32_t r = -local; r < r_end; r++)
        for (int32_t j = 0; j < 8 && col + kPer16 * j < p.n; j++)
          *reinterpret_cast<int4 *>(p.slot[o] + (size_t)(local + r) * p.n + col + kPer16 * j) =
              *reinterpret_cast<const int4 *>(src + r * 128 + ((j ^ (r & 7)) << 4));
    }
  }
  /* plan.owner_epi (tw_gemm_rs_want_owner_epi): an own tile is the last partial of its unit to come
   * (the tile order lags the own tiles behind the peers', kOrderBandsOwnerLag), so its epilogue
   * adds the peers' partials, already in this rank's staging, to its accumulators in rank order
   * (the same fp32 sums, in the same order, as the reduce CTAs: the same bits) and stores the bf16
   * result into out. No own partial is stored or re-read, and no reduce CTA runs. */
  static constexpr bool kOwnerEpi = true;
  struct OwnerOut {
    using Out = __nv_bfloat16;
    __device__ __forceinline__ static void issue_box(const Params &p, const void *box, int32_t col,
                                                     int32_t row) {
      tw::ptx::tma_store_2d(&p.out_map, box, col, row - p.own_mb0 * kBlockM);
      if (p.owner_ar)
        tw::ptx::tma_store_2d(&p.peer_map, box, col, row - p.own_mb0 * kBlockM);
    }
  };
  /* Whether an own tile is signalled (tw_gemm_ar: the peer's ready flag) after its stores. */
  template <class GP> __device__ __forceinline__ static bool owner_signals(const GP &gp) {
    return gp.epi.owner_ar;
  }
  template <class GP> __device__ __forceinline__ static bool owner_tile(const GP &gp, int32_t mb) {
    return gp.epi.owner_epi && mb >= gp.epi.own_mb0 && mb < gp.epi.own_mb0 + gp.epi.own_mbs;
  }
  /* Consumer warpgroup wg's 64 rows of the tile: wait (one thread, bounded) until the peer
   * counted its partial of the unit, then add it to the accumulator fragment (rows warp * 16 +
   * lane / 4 and + 8, columns 8 j + 2 (lane % 4) + 0, 1) in place. Two ranks only: the reduce
   * CTAs compute slab[0] + slab[1], and a fp32 sum of two terms does not depend on their order,
   * so own + peer is the same bits on either rank. (More ranks need the sum of the ranks before
   * this one first: done element by element, with each element's peer loads together, the
   * consumers spilled, 2 KiB per thread, twelfth session.) */
  template <class GP, int N>
  __device__ __forceinline__ static void combine(const GP &gp, float (&acc)[N], int32_t mb,
                                                 int32_t nb, int wg, int wg_thread) {
    const Params &p = gp.epi;
    const tw_dev_comm_t &dc = gp.wait.dc;
    const int32_t u = tw_rs_unit(mb - p.own_mb0, nb, p.own_mbs, p.n_blocks, p.band);
    uint64_t *count = p.own_counters + u / p.group_units;
    if (wg_thread == 0)
      tw_wait_geq(dc, gp.wait.ch, count, 1, -1, u);     /* a failure is recorded; the sum is junk */
    tw::ptx::named_bar_sync(kBarConsumerWg0 + wg, 128); /* the acquire before every load */
    const int warp = wg_thread >> 5, lane = wg_thread & 31;
    const int32_t row = (mb - p.own_mb0) * kBlockM + wg * kBoxRows + warp * 16 + (lane >> 2);
    const int32_t col0 = nb * (N * 2) + 2 * (lane & 3);
    const P *lo = p.own_slab[1 - dc.rank] + (size_t)row * p.n + col0;
    const P *hi = lo + (size_t)8 * p.n;
#pragma unroll
    for (int j = 0; j < N / 4; j++) {
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      if (col0 + 8 * j < p.n) {
        load2(lo + 8 * j, x[0], x[1]);
        load2(hi + 8 * j, x[2], x[3]);
      }
#pragma unroll
      for (int e = 0; e < 4; e++)
        acc[4 * j + e] = __fadd_rn(own_value(acc[4 * j + e]), x[e]);
    }
    /* Both warpgroups have passed their waits: the counter is free for the next call (see
     * gemm_rs.h: every counter a call uses ends at 0). */
    tw::ptx::named_bar_sync(kBarConsumers, 256);
    if (wg == 0 && wg_thread == 0)
      *(volatile uint64_t *)count = 0;
  }
  /* This rank's own partial as the reduce CTAs would have read it back from its staging. */
  __device__ __forceinline__ static float own_value(float x) {
    if constexpr (sizeof(P) == 2)
      return __bfloat162float(__float2bfloat16_rn(x));
    else
      return x;
  }
  __device__ __forceinline__ static void load2(const P *src, float &x, float &y) {
    if constexpr (sizeof(P) == 2) {
      const uint32_t w = __ldcg(reinterpret_cast<const unsigned int *>(src));
      const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&w));
      x = t.x, y = t.y;
    } else {
      const float2 t = __ldcg(reinterpret_cast<const float2 *>(src));
      x = t.x, y = t.y;
    }
  }
  __device__ __forceinline__ static void signal(const Params &p, int32_t mb, int32_t nb) {
    tw_trace_tile(p.trace, TW_TR_DONE, mb, nb);
    if (p.owner_ar && mb >= p.own_mb0 && mb < p.own_mb0 + p.own_mbs) {
      /* an own tile of tw_gemm_ar: its reduced rows are at the peer (or here, for the pull) */
      const int32_t u = tw_rs_unit(mb - p.own_mb0, nb, p.own_mbs, p.n_blocks, p.band);
      tw_fence_acq_rel_sys();
      tw_st_release_sys(p.peer_ready + u, s_rs_epoch);
      return;
    }
    const int32_t row0 = mb * kBlockM;
    const int32_t last = min(row0 + kBlockM, p.m) - 1;
    if (!(TW_RS_DIAG & 2)) {
      if (p.gpu_scope)
        tw_fence_acq_rel_gpu();
      else
        tw_fence_acq_rel_sys();
    }
    if (p.direct) { /* geometry of one owner holding all m rows (m_local == m) */
      const int32_t u = tw_rs_unit(mb, nb, tw_rs_mb_count(0, p.m_local), p.n_blocks, p.band);
      for (int32_t d = 0; d < p.direct; d++)
        add(p, p.owner_flags[d] + u / p.group_units);
      return;
    }
    for (int32_t o = row0 / p.m_local; o <= last / p.m_local; o++) {
      const int32_t u = tw_rs_unit(mb - tw_rs_mb_first(o, p.m_local), nb,
                                   tw_rs_mb_count(o, p.m_local), p.n_blocks, p.band);
      add(p, p.owner_flags[o] + u / p.group_units);
    }
  }
};

template <class P> struct RsParams {
  GemmParams<RsEpi<P>, RsWait> gemm;
  /* Where the reduction reads rank s's partial of this rank's rows (row stride n): slot s of
   * this rank's staging, or (pull, TW_RS_PULL) rank s's own [m, n] partial at this rank's
   * first row, through the heap mapping. */
  const P *slab[kMaxWorld];
  __nv_bfloat16 *out;     /* rs: [m_local, n]; ar: [m, n] */
  __nv_bfloat16 *reduced; /* ar: this rank's reduced rows, bf16 [m_local, n] */
  const __nv_bfloat16 *reduced_peer[kMaxWorld]; /* where the gather reads owner o's rows */
  /* ar, push (TW_AR_PUSH): rank q's copy of this rank's reduced rows, written by the reduction
   * itself (stores over NVLink instead of the peers' loads) */
  __nv_bfloat16 *reduced_push[kMaxWorld];
  /* ar, symmetric outputs (args.out_symmetric): rank q's out, mapped here; the reduction writes
   * every rank's out and the gather only waits for the owners' ready flags */
  __nv_bfloat16 *out_peer[kMaxWorld];
  int32_t out_sym;
  int32_t push;
  int64_t ldo;
  int32_t n, m_local, n_blocks, band;
  int32_t block_n; /* the tile's (and a unit's) columns: 256, 192 or 128 (plan.block_n) */
  int32_t group_units, groups_max, flag_stride;
  int32_t reduce_ctas, all_reduce;
  /* tw_gemm_ar's direct scheme (TW_AR_DIRECT): every rank stores each fp32 tile into every
   * rank's staging and every rank reduces all m rows itself; the kernel then runs as a
   * reduce-scatter with one owner of m_local = m rows (all_reduce 0, no gather phase). */
  int32_t direct;
};

/* Rows [r0, r1) of owner o's slab and columns [c0, c1) of unit u. */
template <class P>
__device__ __forceinline__ void unit_rect(const RsParams<P> &p, int32_t o, int32_t u, int32_t &r0,
                                          int32_t &r1, int32_t &c0, int32_t &c1) {
  const int32_t m_local = p.m_local, n = p.n;
  int32_t mb_rel, nb;
  tw_rs_unit_coords(u, tw_rs_mb_count(o, m_local), p.n_blocks, p.band, &mb_rel, &nb);
  const int32_t mb = tw_rs_mb_first(o, m_local) + mb_rel;
  const int64_t base = (int64_t)o * m_local;
  r0 = (int32_t)(max((int64_t)mb * kBlockM, base) - base);
  r1 = (int32_t)(min((int64_t)mb * kBlockM + kBlockM, base + m_local) - base);
  c0 = nb * p.block_n;
  c1 = min(n, c0 + p.block_n);
}

template <class P> __device__ __forceinline__ int32_t owner_units(const RsParams<P> &p, int32_t o) {
  return tw_rs_mb_count(o, p.m_local) * p.n_blocks;
}

/* One packed group of sums of this rank's row r (slab-relative), column c (off = r * n + c):
 * into out, and for tw_gemm_ar into every rank's out (symmetric outputs), every other rank's
 * copy of this rank's rows (the push) or this rank's reduced rows (the pull's gather reads
 * them). */
template <class Packed, class P>
__device__ __forceinline__ void store_sum(const RsParams<P> &p, int world, int me, size_t off,
                                          int32_t r, int32_t c, const Packed &packed) {
  const int64_t out_row = p.all_reduce ? (int64_t)me * p.m_local + r : r;
  if (p.all_reduce && p.out_sym) { /* every rank's out, the next rank's first */
    for (int q = 1; q <= world; q++)
      *reinterpret_cast<Packed *>(p.out_peer[(me + q) % world] + out_row * p.ldo + c) = packed;
    return;
  }
  __stcs(reinterpret_cast<Packed *>(p.out + out_row * p.ldo + c), packed);
  if (p.all_reduce && p.push) { /* into every other rank's copy of this rank's rows */
    for (int q = 0; q < world; q++)
      if (q != me)
        *reinterpret_cast<Packed *>(p.reduced_push[q] + off) = packed;
  } else if (p.all_reduce) {
    *reinterpret_cast<Packed *>(p.reduced + off) = packed;
  }
}

/* The 16-byte items of a unit's rect (rows x vecs) that one thread visits: item i is row
 * i / vecs, vector i % vecs, for i = the thread's index, + the CTA's size, ... at<true> steps
 * them by one addition and a compare an item, the divisions happen once a unit. (Twenty-fifth
 * session: with a division and remainder an item for the load and a 64-bit one for the store, a
 * reduce CTA's loop ran at 56 GB/s alone and 44 beside a GEMM, against 94 and 76 without:
 * tools/micro/rbench.cu.) at<false> divides per item instead (fewer registers). */
struct ItemWalk {
  int32_t row, col, step_r, step_c, vecs, rows, items;
  __device__ __forceinline__ ItemWalk(int32_t rows_, int32_t vecs_, int32_t first, int32_t stride)
      : vecs(vecs_), rows(rows_), items(rows_ * vecs_) {
    row = first / vecs;
    col = first - row * vecs;
    step_r = stride / vecs;
    step_c = stride - step_r * vecs;
  }
  __device__ __forceinline__ void next() {
    row += step_r;
    col += step_c;
    if (col >= vecs)
      col -= vecs, row++;
  }
  /* Row (rect-relative) and vector of item i, which must be the walk's next (first, first +
   * stride, ...: every call steps it). Past the end (i >= items) the last item, so that loads
   * stay in bounds; the caller stores only items below `items`. */
  template <bool kWalk> __device__ __forceinline__ void at(int32_t i, int32_t &r, int32_t &v) {
    if constexpr (kWalk) {
      const bool in = i < items;
      r = in ? row : rows - 1;
      v = in ? col : vecs - 1;
      next();
    } else {
      i = min(i, items - 1);
      r = i / vecs;
      v = i - r * vecs;
    }
  }
};

/* acc[j] += the partials at off[j] of slabs 1, 2, ..., world - 1, in that order (fp32: the same
 * order for every element, so the result is bitwise the unfused reduce's). */
template <int kN, class P>
__device__ __forceinline__ void add_ranks(const RsParams<P> &p, int world, const size_t (&off)[kN],
                                          float (&acc)[kN][RsVec<P>::kE]) {
  using V = RsVec<P>;
#pragma unroll 1
  for (int s = 1; s < world; s++) {
    const P *slab = p.slab[s];
    float v[kN][V::kE];
#pragma unroll
    for (int j = 0; j < kN; j++)
      V::load(slab + off[j], v[j]);
#pragma unroll
    for (int j = 0; j < kN; j++)
#pragma unroll
      for (int e = 0; e < V::kE; e++)
        acc[j][e] = __fadd_rn(acc[j][e], v[j][e]);
  }
}

/* All threads: sum unit u of this rank's rows over the ranks' slots, in rank order. Each thread
 * keeps kItems x 16 bytes of fp32 partials (kItems / 2 x 16 bytes of bf16 ones) in flight per
 * rank step: with one element per thread a CTA had only world x 6 KiB in flight and a reduce
 * CTA moved ~12 GB/s. kWalk: the items' rows and vectors by ItemWalk; else a division per
 * item (bf16 partials, whose stealing kernel spills 4 bytes with the walk). */
template <int kItems, bool kWalk, class P>
__device__ __forceinline__ void reduce_unit(const RsParams<P> &p, int world, int me, int32_t u) {
  if (TW_RS_DIAG & 8)
    return;
  using V = RsVec<P>;
  constexpr int kE = V::kE, kN = kItems * 4 / kE; /* elements per item, items in flight */
  int32_t r0, r1, c0, c1;
  unit_rect(p, me, u, r0, r1, c0, c1);
  const int32_t tid = (int32_t)threadIdx.x, stride = (int32_t)blockDim.x;
  ItemWalk w(r1 - r0, (c1 - c0) / kE, tid, stride);
  const int32_t items = w.items;
  for (int32_t base = tid; base < items; base += kN * stride) {
    size_t off[kN];
    int32_t rr[kN], cc[kN]; /* slab row and column of each item */
    float acc[kN][kE];
#pragma unroll
    for (int j = 0; j < kN; j++) {
      int32_t r, v;
      w.at<kWalk>(base + j * stride, r, v);
      rr[j] = r0 + r;
      cc[j] = c0 + kE * v;
      off[j] = (size_t)rr[j] * p.n + cc[j];
      V::load(p.slab[0] + off[j], acc[j]);
    }
    add_ranks(p, world, off, acc);
#pragma unroll
    for (int j = 0; j < kN && base + j * stride < items; j++)
      store_sum(p, world, me, off[j], rr[j], cc[j], V::pack(acc[j]));
  }
}

/* All threads: copy unit u of owner o's reduced rows into this rank's out, kItems 16-byte
 * loads in flight per thread (kWalk as in reduce_unit). */
template <int kItems, bool kWalk, class P>
__device__ __forceinline__ void gather_unit(const RsParams<P> &p, int32_t o, int32_t u) {
  if (TW_RS_DIAG & 8)
    return;
  int32_t r0, r1, c0, c1;
  unit_rect(p, o, u, r0, r1, c0, c1);
  const __nv_bfloat16 *src = p.reduced_peer[o];
  __nv_bfloat16 *dst = p.out + (int64_t)o * p.m_local * p.ldo;
  const int32_t stride = (int32_t)blockDim.x;
  ItemWalk w(r1 - r0, (c1 - c0) / 8, (int32_t)threadIdx.x, stride);
  const int32_t items = w.items;
  for (int32_t base = threadIdx.x; base < items; base += kItems * stride) {
    int4 v[kItems];
    int32_t rr[kItems], cc[kItems];
#pragma unroll
    for (int j = 0; j < kItems; j++) {
      int32_t r, vec;
      w.at<kWalk>(base + j * stride, r, vec);
      rr[j] = r0 + r;
      cc[j] = c0 + 8 * vec;
      v[j] = __ldcg(reinterpret_cast<const int4 *>(src + (size_t)rr[j] * p.n + cc[j]));
    }
#pragma unroll
    for (int j = 0; j < kItems; j++) {
      if (base + j * stride >= items)
        break;
      __stcs(reinterpret_cast<int4 *>(dst + (int64_t)rr[j] * p.ldo + cc[j]), v[j]);
    }
  }
}

/* One thread, once group `item` of this rank's reduced rows is stored by the CTA:
 * the other ranks' ready flags of it (tw_gemm_ar's gather waits for them). */
template <class P>
__device__ __forceinline__ void signal_reduced(const RsParams<P> &p, int me, int item,
                                               uint64_t epoch) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  tw_fence_acq_rel_sys();
  for (int q = 0; q < dc.world; q++)
    if (q != me)
      tw_st_release_sys(tw_peer_flag(dc, q, p.gemm.wait.ch, p.flag_stride * (1 + me) + item),
                        epoch);
}

/* One thread: waits until group `item` of this rank's units has all its partials (then resets
 * its count for the next call). `groups` when item is past the end or the wait failed (*s_ok is
 * then 0); with `entered`, first that every rank entered the call (tw_gemm_ar: the owners'
 * ready flags of the previous call are consumed). */
template <class P>
__device__ __forceinline__ int wait_group(const RsParams<P> &p, uint64_t epoch, int item,
                                          int groups, int32_t units, int *s_ok, bool entered) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const int ch = p.gemm.wait.ch;
  if (item >= groups || !*s_ok)
    return groups;
  if (entered && !wait_entered(dc, ch, 0, dc.world - 1, epoch)) {
    *s_ok = 0;
    return groups;
  }
  const int32_t in_group = min(p.group_units, units - item * p.group_units);
  uint64_t *count = tw_own_flag(dc, ch, item);
  if (!tw_wait_geq(dc, ch, count, (uint64_t)dc.world * in_group, -1, item)) {
    *s_ok = 0;
    return groups;
  }
  *(volatile uint64_t *)count = 0; /* all adds of this call are in; see gemm_rs.h */
  return item;
}

/* All threads: the units of group `item`. */
template <int kItems, class P>
__device__ __forceinline__ void reduce_group(const RsParams<P> &p, int world, int me, int item,
                                             int32_t units) {
  const int32_t u_end = min(units, (item + 1) * p.group_units);
  for (int32_t u = item * p.group_units; u < u_end; u++) /* bf16 partials: no walk (a spill) */
    reduce_unit<kItems, sizeof(P) == 4>(p, world, me, u);
}

/* Reduce role: claims this rank's unit groups in order until none are left. `trace_field`:
 * where TW_TRACE counts them (TW_TR_REDUCED, or TW_TR_REDUCED_AFTER after the CTA's tiles). */
template <int kItems, class P>
__device__ __forceinline__ void reduce_work(const RsParams<P> &p, uint64_t epoch, int *s_item,
                                            int *s_ok, int trace_field) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const int ch = p.gemm.wait.ch;
  const int me = p.direct ? 0 : dc.rank, world = dc.world; /* me: the geometry's owner */
  TileQueue *queue = reinterpret_cast<TileQueue *>(tw_own_flag(dc, ch, kReduceQueue));
  const int32_t units = owner_units(p, me);
  const int32_t groups = (units + p.group_units - 1) / p.group_units;
  /* The reduce CTAs (trace_field TW_TR_REDUCED: they reduce beside the GEMM) claim their next
   * group as they start one, so the claim's round trip to L2 overlaps the reduction; after the
   * tiles a CTA claims one group at a time, lest the last groups wait behind a busy CTA. */
  const bool ahead = trace_field == TW_TR_REDUCED;
  int next = -1; /* thread 0: the group claimed ahead (-1: none) */
  uint32_t reduced = 0;
  for (;;) {
    __syncthreads(); /* everyone read the previous s_item */
    if (threadIdx.x == 0) {
      int item = !*s_ok ? groups : next >= 0 ? next : (int)atomicAdd(&queue->next, 1u);
      next = ahead && item < groups ? (int)atomicAdd(&queue->next, 1u) : -1;
      *s_item = wait_group(p, epoch, item, groups, units, s_ok, p.all_reduce);
    }
    __syncthreads();
    const int item = *s_item;
    if (item >= groups)
      break;
    reduced++;
    reduce_group<kItems>(p, world, me, item, units);
    if (p.all_reduce) {
      __syncthreads();
      if (threadIdx.x == 0)
        signal_reduced(p, me, item, epoch);
    }
  }
  if (threadIdx.x == 0) {
    queue_leave(queue, (int32_t)gridDim.x);
    tw_trace_count(dc, trace_field, reduced);
  }
}

/* All-gather role (tw_gemm_ar): copies every other owner's reduced groups as they are ready. */
template <class P>
__device__ __forceinline__ void gather_work(const RsParams<P> &p, uint64_t epoch, int *s_item,
                                            int *s_ok) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const int ch = p.gemm.wait.ch;
  const int me = dc.rank, world = dc.world;
  TileQueue *queue = reinterpret_cast<TileQueue *>(tw_own_flag(dc, ch, kGatherQueue));
  const int items = (world - 1) * p.groups_max;
  for (;;) {
    __syncthreads();
    if (threadIdx.x == 0) {
      int item = *s_ok ? (int)atomicAdd(&queue->next, 1u) : items;
      if (item < items) {
        /* Group-major over owners me + 1, me + 2, ...: the order the owners finish them in. */
        const int g = item / (world - 1);
        const int o = (me + 1 + item % (world - 1)) % world;
        const int32_t units = owner_units(p, o);
        if (g * p.group_units < units &&
            !tw_wait_geq(dc, ch, tw_own_flag(dc, ch, p.flag_stride * (1 + o) + g), epoch, o, g))
          item = items, *s_ok = 0;
      }
      *s_item = item;
    }
    __syncthreads();
    const int item = *s_item;
    if (item >= items)
      break;
    const int g = item / (world - 1);
    const int o = (me + 1 + item % (world - 1)) % world;
    const int32_t u_end = min(owner_units(p, o), (g + 1) * p.group_units);
    for (int32_t u = g * p.group_units; u < u_end && !p.out_sym; u++) /* as in reduce_group */
      gather_unit<8, sizeof(P) == 4>(p, o, u);
  }
  if (threadIdx.x == 0)
    queue_leave(queue, (int32_t)gridDim.x);
}

/* Work stealing: the mainloop hands every warp back the entry register split when it ends
 * (setmaxnreg), so code after it is not compiled under the producer's 40 registers, and the
 * GEMM CTAs then take reduction (and gather) work too. Every CTA takes part in the
 * reduce/gather queues. */
template <class P, int BN>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_rs_kernel(const __grid_constant__ RsParams<P> p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int s_item, s_ok;
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const int ch = p.gemm.wait.ch;
  const uint64_t epoch = tw_op_begin(dc, ch);
  if (threadIdx.x == 0) {
    s_entered = 0;
    s_rs_epoch = epoch;
    s_ok = tw_kernel_enter(dc, ch, epoch);
  }
  __syncthreads();
  if ((int)blockIdx.x < p.reduce_ctas && !p.gemm.epi.owner_epi) {
    reduce_work<8>(p, epoch, &s_item, &s_ok, TW_TR_REDUCED);
    if (p.all_reduce) {
      if (threadIdx.x == 0) /* TW_TRACE's gather stamp */
        tw_trace_gather_start(dc);
      gather_work(p, epoch, &s_item, &s_ok);
    }
    if (threadIdx.x == 0)
      tw_trace_stamp(dc, TW_TR_COMM_END);
  }
  if constexpr (BN == 192)
    gemm_cta_loop_pp<RsConfig<BN>::kStages, RsConfig<BN>::kEpiBytes, BN, RsEpi<P>, RsWait, true,
                     true, RsEpi<P, true>>(p.gemm, smem_raw, 0, 0);
  else
    gemm_cta_loop<RsConfig<BN>::kStages, RsConfig<BN>::kEpiBytes, RsEpi<P>, RsWait, true, 1, BN,
                  true>(p.gemm, smem_raw, 0, 0);
  if (dc.trace) { /* the consumers' last tile, not the producer's last load */
    __syncthreads();
    if (threadIdx.x == 0)
      tw_trace_stamp(dc, TW_TR_GEMM_END);
  }
  if ((int)blockIdx.x >= p.reduce_ctas) {
    if (!p.gemm.epi.owner_epi) /* the owner epilogue reduced every own unit */
      reduce_work<8>(p, epoch, &s_item, &s_ok, TW_TR_REDUCED_AFTER);
    if (p.all_reduce) {
      if (threadIdx.x == 0)
        tw_trace_gather_start(dc);
      gather_work(p, epoch, &s_item, &s_ok);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_END);
    /* release: the unfused pipeline's GEMM, which writes the workspace before any handshake,
     * may follow on the same workspace (ReleasedWait) */
    tw_op_finish(dc, ch, epoch, true);
  }
}

template <class P, int BN>
tw_status_t launch_bn(const RsParams<P> &params, int grid, cudaStream_t stream) {
  constexpr int kSmem = rs_smem_bytes<BN>();
  const char *set = "tw_gemm_rs: cudaFuncSetAttribute", *go = "tw_gemm_rs: kernel launch";
  return launch_persistent<gemm_rs_kernel<P, BN>, kSmem>(params, grid, stream, set, go);
}

template <class P> tw_status_t launch(const RsParams<P> &params, int grid, cudaStream_t stream) {
  if (params.block_n == 128)
    return launch_bn<P, 128>(params, grid, stream);
  if (params.block_n == 192)
    return launch_bn<P, 192>(params, grid, stream);
  return launch_bn<P, kBlockN>(params, grid, stream);
}

template <class P>
tw_status_t run_fused(tw_comm_t comm, const tw_gemm_rs_args_t &a, const tw_gemm_rs_plan_t &plan,
                      int all_reduce, cudaStream_t stream) {
  constexpr CUtensorMapDataType kMapType =
      sizeof(P) == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const int world = comm->world, rank = comm->rank;
  const int ch = all_reduce ? TW_CH_GEMM_AR : TW_CH_GEMM_RS;
  /* Direct scheme: the geometry of one owner holding all m rows, every rank's staging a
   * target of every tile. */
  const int64_t m_local = plan.direct ? a.m : a.m / world;
  RsParams<P> p;
  memset(&p, 0, sizeof(p));
  tw_status_t st;
  st = operand_maps(&p.gemm.a_map, &p.gemm.b_map, a.a, a.m, a.lda, a.b, a.n, a.ldb, a.k,
                    plan.block_n, "tw_gemm_rs", "a");
  if (st != TW_SUCCESS)
    return st;
  const size_t slot_bytes = (size_t)m_local * (size_t)a.n * sizeof(P);
  const size_t reduced_offset = slot_bytes * (size_t)world;
  /* tw_gemm_ar's reduced rows, bf16 after the staging. Push (plan.ar_push): the area is
   * [world][m_local][n], block o holding owner o's rows; owner o's reduction stores block o of
   * every other rank's area, and each rank's gather copies from its own area (local loads).
   * Otherwise the owner keeps its rows in block 0 of its own area and the others load them
   * from there over NVLink. */
  p.push = plan.ar_push;       /* prepare: tw_gemm_ar only, never with the direct scheme */
  p.out_sym = plan.ar_out_sym; /* likewise */
  for (int q = 0; p.out_sym && q < world; q++)
    p.out_peer[q] = (__nv_bfloat16 *)tw_heap_peer_ptr(comm, a.out, q);
  const size_t block = (size_t)m_local * (size_t)a.n * 2;
  for (int o = 0; o < world; o++) {
    char *owner_ws = (char *)tw_heap_peer_ptr(comm, a.workspace, o);
    char *store_ws = (TW_RS_DIAG & 1) ? (char *)a.workspace : owner_ws;
    st = tw_tma_map_2d(&p.gemm.epi.slot_map[o], kMapType, sizeof(P),
                       store_ws + slot_bytes * (size_t)rank, a.n, m_local, a.n, 128 / sizeof(P),
                       kBoxRows, "tw_gemm_rs: cuTensorMapEncodeTiled(staging)");
    if (st != TW_SUCCESS)
      return st;
    p.gemm.epi.owner_flags[o] = &comm->dev.peer_ctrl[o]->flags[ch][0];
    p.gemm.epi.slot[o] = (P *)(store_ws + slot_bytes * (size_t)rank);
    p.reduced_peer[o] =
        (const __nv_bfloat16 *)(p.push ? (char *)a.workspace + reduced_offset + block * o
                                       : owner_ws + reduced_offset);
    if (p.push)
      p.reduced_push[o] = (__nv_bfloat16 *)(owner_ws + reduced_offset + block * (size_t)rank);
  }
  p.gemm.epi.n = (int32_t)a.n;
  p.gemm.epi.m_local = (int32_t)m_local;
  p.gemm.epi.m = (int32_t)a.m;
  p.gemm.epi.group_units = plan.group_units;
  p.gemm.epi.direct = plan.direct ? world : 0;
  p.direct = plan.direct;
  /* The pull (plan.pull): each rank stores its whole partial locally and the owners read
   * their rows of it from every rank when they reduce. */
  const int pull = !plan.direct && plan.pull;
  p.gemm.epi.pull = pull;
  p.gemm.wait.wait_all = plan.direct || pull;
  for (int s = 0; s < world; s++)
    p.slab[s] = pull ? (const P *)tw_heap_peer_ptr(comm, a.workspace, s) +
                           (size_t)rank * (size_t)m_local * (size_t)a.n
                     : (const P *)a.workspace + (size_t)s * (size_t)m_local * (size_t)a.n;
  if (pull) {
    st = tw_tma_map_2d(&p.gemm.epi.slot_map[0], kMapType, sizeof(P), a.workspace, a.n, a.m, a.n,
                       128 / sizeof(P), kBoxRows, "tw_gemm_rs: cuTensorMapEncodeTiled(own)");
    if (st != TW_SUCCESS)
      return st;
  }
  TileOrder &o = p.gemm.order;
  o.m_blocks = (int32_t)((a.m + kBlockM - 1) / kBlockM);
  o.n_blocks = (int32_t)((a.n + plan.block_n - 1) / plan.block_n);
  o.num_tiles = o.m_blocks * o.n_blocks;
  /* Band sweeps over all row blocks, from owner rank + 1's rows (see the top); the owners'
   * rows interleaved where the plan says (gemm_rs_heuristics.c): each owner's rows still
   * ascending, so the unit order (and the reduce queue that follows it) is unchanged. */
  o.order = plan.interleave ? kOrderBandsInterleaved : kOrderBands; /* never direct: 1 owner */
  o.group_m = plan.interleave ? world : o.m_blocks;
  o.group_n = plan.band;
  if (plan.owner_epi) {
    /* plan.owner_epi: own tiles trail the peers' by `lag` positions at least
     * (tests/host/test_tile_order.cu), two waves of this rank's CTAs, so the peers' partials of
     * an own unit have landed when its epilogue needs them. */
    const int32_t own_mbs = (int32_t)(m_local / kBlockM);
    const int32_t units = own_mbs * o.n_blocks;
    o.order = kOrderBandsOwnerLag;
    o.group_m = world;
    o.lag = 2 * plan.ctas < units ? 2 * plan.ctas : units;
    p.gemm.epi.owner_epi = 1;
    p.gemm.epi.own_mb0 = rank * own_mbs;
    p.gemm.epi.own_mbs = own_mbs;
    p.gemm.epi.own_counters = &comm->dev.ctrl->flags[ch][0]; /* tw_own_flag(dc, ch, 0) */
    for (int s = 0; s < world; s++)
      p.gemm.epi.own_slab[s] = (const P *)a.workspace + (size_t)s * (size_t)m_local * (size_t)a.n;
    /* tw_gemm_ar's out holds every owner's rows: this rank's start at rank * m_local */
    const __nv_bfloat16 *own_out =
        (const __nv_bfloat16 *)a.out + (all_reduce ? (size_t)rank * m_local * (size_t)a.ldo : 0);
    st = out_map<__nv_bfloat16>(&p.gemm.epi.out_map, own_out, a.n, m_local, a.ldo,
                                "tw_gemm_rs: cuTensorMapEncodeTiled(out)");
    if (st != TW_SUCCESS)
      return st;
    if (all_reduce) { /* prepare: 2 ranks (the gather runs after the tiles) */
      const int peer = 1 - rank;
      const void *dst =
          p.out_sym ? (const void *)(p.out_peer[peer] + (size_t)rank * m_local * (size_t)a.ldo)
          : p.push  ? (const void *)p.reduced_push[peer]
                    : (const void *)((const char *)a.workspace + reduced_offset);
      st = out_map<__nv_bfloat16>(&p.gemm.epi.peer_map, dst, a.n, m_local, p.out_sym ? a.ldo : a.n,
                                  "tw_gemm_ar: cuTensorMapEncodeTiled(reduced rows)");
      if (st != TW_SUCCESS)
        return st;
      p.gemm.epi.owner_ar = 1;
      p.gemm.epi.peer_ready =
          &comm->dev.peer_ctrl[peer]->flags[ch][(size_t)plan.flag_stride * (size_t)(1 + rank)];
    }
  }
  o.rotate_mb = plan.direct ? 0 : tw_rs_mb_first((rank + 1) % world, (int32_t)m_local);
  /* The measurement build's bit 16: the plain GEMM's grouped order. Any order is correct, the
   * reduction waiting for counts; the owner epilogue needs its own (kOrderBandsOwnerLag). */
  if ((TW_RS_DIAG & 16) && !plan.owner_epi) {
    o.order = kOrderRotated;
    o.group_m = o.m_blocks < 16 ? o.m_blocks : 16;
  }
  p.gemm.queue = (TileQueue *)comm->ctrl->tile_queue[ch];
  p.gemm.participants = plan.ctas;
  p.gemm.k_blocks = (int32_t)((a.k + kBlockK - 1) / kBlockK);
  p.gemm.mbar_timeout_ns = fused_mbar_timeout_ns(comm->dev.timeout_ns);
  apply_fault_stall(p.gemm);
  p.gemm.wait.dc = comm->dev;
  p.gemm.wait.ch = ch;
  p.gemm.wait.m_local = (int32_t)m_local;
  p.gemm.wait.m = (int32_t)a.m;
  p.gemm.wait.world = world;
  p.out = (__nv_bfloat16 *)a.out;
  p.reduced = (__nv_bfloat16 *)((char *)a.workspace + reduced_offset);
  p.ldo = a.ldo;
  p.n = (int32_t)a.n;
  p.m_local = (int32_t)m_local;
  p.n_blocks = o.n_blocks;
  p.block_n = plan.block_n;
  p.band = plan.band;
  p.gemm.epi.n_blocks = o.n_blocks;
  p.gemm.epi.band = plan.band;
  p.gemm.epi.trace = comm->dev.trace;
  p.gemm.epi.gpu_scope = comm->ranks_on_device == world;
  p.group_units = plan.group_units;
  p.groups_max = plan.groups_max;
  p.flag_stride = plan.flag_stride;
  p.reduce_ctas = plan.reduce_ctas;
  p.all_reduce = plan.direct ? 0 : all_reduce; /* direct: no gather phase */
  return launch(p, plan.ctas, stream);
}

/* ---- the unfused pipeline (plan.unfused: decode shapes) -------------------------------------
 * Two launches on the rank's stream: tw_gemm of the whole partial [m][n] into the workspace
 * (fp32, or bf16 with TW_PARTIALS_BF16) whose CTAs first wait until every rank has released this
 * rank's workspace after its previous call (gemm_released.cuh), then unfused_reduce_kernel on
 * channel ch:
 *   entry(e) to every rank (this rank's partial is complete), wait for every rank's entry(e);
 *   sum rows [rank * m_local, +m_local) of the partials in rank order (fp32, the reference's
 *   __fadd_rn chain from partial 0), round to bf16, store into `out` (rs), or into every rank's
 *   gather area (the workspace after the partial) or every rank's symmetric `out` (ar);
 *   the grid's last CTA then sets done[ch][rank] = e on every rank: this rank no longer reads
 *   their partials and its rows are in their memory.
 *   ar into a plain `out`: every CTA waits for every rank's done(e), then copies the gather
 *   area into `out`. Otherwise the last CTA waits for them alone, so that the call ends only
 *   once no rank reads this rank's workspace (the fused kernel, which may follow, stores into
 *   a rank's workspace once that rank alone has entered).
 * The same bits as the fused kernel and the reference pipeline (tw_gemm per rank, then the
 * rank-ordered sum). */
constexpr int kUnfusedThreads = 256;

template <class P> struct UnfusedParams {
  tw_dev_comm_t dc;
  const P *partial[kMaxWorld];   /* rank s's partial [m][n], mapped for this rank */
  __nv_bfloat16 *dst[kMaxWorld]; /* rs: dst[0] = out; ar: every rank's gather area or out */
  const __nv_bfloat16 *gather;   /* ar into a plain out: this rank's gather area [m][n] */
  __nv_bfloat16 *out;
  int64_t ld_dst, ldo;
  int64_t dst_row0; /* rs: rank * m_local (out's first row); ar: 0 */
  int32_t ch, m_local, m, n, ndst, copy;
  int32_t peer_out; /* ar: dst[q] / its row stride are rank q's out, read from this rank's control
                       block after q's entry (plan.ar_peer_out); this rank's goes to every peer's
                       before its own entry signal */
};

/* One 16-byte load of partials as floats: 4 fp32 or 8 bf16 (kVec<P>), so that a warp's loads
 * are 512 contiguous bytes (two 16-byte loads per thread at a 32-byte stride fetched every
 * remote sector twice: the first version, 0.0674 against 0.0451 ms at M=256). */
template <class P> constexpr int kVec = RsVec<P>::kE;
template <class P> __device__ __forceinline__ void load_vec(const P *p, float (&v)[kVec<P>]) {
  RsVec<P>::unpack(__ldcg(reinterpret_cast<const uint4 *>(p)), v);
}
template <class P>
__global__ void __launch_bounds__(kUnfusedThreads)
    unfused_reduce_kernel(const __grid_constant__ UnfusedParams<P> p) {
  __shared__ int s_ok, s_last;
  /* launched with programmatic serialization (on GPUs of their own): the GEMM's partial is
   * complete and visible from here on (at once otherwise) */
  tw::ptx::griddep_wait();
  const tw_dev_comm_t &dc = p.dc;
  const int ch = p.ch, world = dc.world, rank = dc.rank;
  const uint64_t epoch = tw_op_begin(dc, ch);
  __shared__ __nv_bfloat16 *s_dst[kMaxWorld];
  __shared__ int64_t s_ld[kMaxWorld];
  if (threadIdx.x == 0) {
    /* peer outs: this rank's out into every peer's control block before the entry signal
     * (whose fence orders it); the peers read it once they have seen this rank enter */
    if (p.peer_out && blockIdx.x == 0 && tw_op_usable(dc, ch))
      for (int q = 0; q < world; q++)
        if (q != rank && dc.peer_ctrl[q]) {
          volatile uint64_t *slot = dc.peer_ctrl[q]->peer_out[ch][rank];
          slot[0] = (uint64_t)(uintptr_t)p.out;
          slot[1] = (uint64_t)p.ldo;
        }
    bool ok = tw_kernel_enter(dc, ch, epoch);
    for (int s = 0; ok && s < world; s++)
      if (s != rank)
        ok = tw_wait_entry(dc, ch, s, epoch);
    /* the destinations: every rank's out (peer outs, rows at their place in it), or p.dst[]
     * (rows from p.dst_row0 on, p.ld_dst apart) */
    if (ok && p.peer_out)
      for (int q = 0; q < world; q++) {
        const volatile uint64_t *slot = dc.ctrl->peer_out[ch][q];
        s_dst[q] = q == rank ? p.out : (__nv_bfloat16 *)(uintptr_t)slot[0];
        s_ld[q] = q == rank ? p.ldo : (int64_t)slot[1];
      }
    else
      for (int q = 0; q < p.ndst; q++) {
        s_dst[q] = p.dst[q];
        s_ld[q] = p.ld_dst;
      }
    s_ok = ok;
  }
  __syncthreads();
  if (!s_ok)
    return;
  constexpr int V = kVec<P>;
  const int64_t vecs = p.n / V, items = (int64_t)p.m_local * vecs;
  const int64_t row0 = (int64_t)rank * p.m_local;
  const int64_t dst_row0 = p.peer_out ? 0 : p.dst_row0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < items;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = row0 + i / vecs, c = V * (i % vecs);
    const size_t off = (size_t)r * (size_t)p.n + (size_t)c;
    /* every rank's loads in flight at once, then the sum in rank order */
    float v[kMaxWorld][V];
#pragma unroll
    for (int s = 0; s < kMaxWorld; s++)
      if (s < world)
        load_vec(p.partial[s] + off, v[s]);
    sum_rank_order(v, world);
    const typename RsVec<P>::Packed sum = RsVec<P>::pack(v[0]);
    for (int q = 0; q < p.ndst; q++)
      *reinterpret_cast<typename RsVec<P>::Packed *>(
          s_dst[q] + (size_t)(r - dst_row0) * (size_t)s_ld[q] + (size_t)c) = sum;
  }
  __syncthreads();
  /* this CTA's loads and stores before its count; the last CTA releases the peers' partials
   * and has put its rows in their memory (done[ch][rank] = e everywhere); the count is reset
   * before that, so the copy's CTAs count again after it */
  if (threadIdx.x == 0)
    s_last = tw_op_exit(dc, ch, epoch, true);
  __syncthreads();
  if (!p.copy) {
    /* rs, or ar into symmetric outputs: the last CTA waits until no rank reads this rank's
     * partial any more (and every rank's rows are in this rank's out), then ends the call */
    if (threadIdx.x == 0 && s_last) {
      bool ok = true;
      for (int q = 0; ok && q < world; q++)
        if (q != rank)
          ok = tw_wait_geq(dc, ch, &dc.ctrl->done[ch][q], epoch, q, -1);
      tw_trace_stamp(dc, TW_TR_END);
      if (ok)
        tw_op_end(dc, ch, epoch);
    }
    return;
  }
  /* ar into a plain out: every rank's rows are in this rank's gather area once every rank's
   * last CTA has signalled (this rank's too) */
  if (threadIdx.x == 0) {
    bool ok = true;
    for (int q = 0; ok && q < world; q++)
      ok = tw_wait_geq(dc, ch, &dc.ctrl->done[ch][q], epoch, q, -1);
    s_ok = ok;
  }
  __syncthreads();
  if (!s_ok)
    return;
  const int64_t vecs8 = p.n / 8, all = (int64_t)p.m * vecs8;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < all;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / vecs8, c = 8 * (i % vecs8);
    *reinterpret_cast<uint4 *>(p.out + (size_t)r * (size_t)p.ldo + (size_t)c) =
        __ldcg(reinterpret_cast<const uint4 *>(p.gather + (size_t)r * (size_t)p.n + (size_t)c));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_END);
    tw_op_finish(dc, ch, epoch);
  }
}

/* ---- the unfused pipeline's exchange through the low-latency area (plan.ll) ------------------
 * Instead of unfused_reduce_kernel (TW_RS_UNFUSED_LL; where the rows fit the comm's area):
 *   call sequence q = ctrl->ll_seq + 1 (every LL call of the comm, either channel, counts alike on
 *   every rank), flag tw_ll_flag(q), half q & 1 of every rank's area;
 *   1. done[ch][rank] = e on every rank at once: this rank reads no peer's workspace in the call
 *      (the next call's release wait, ReleasedWait, passes without waiting for its end);
 *   2. push: each 16-byte vector of this rank's partial in a peer's rows goes into that peer's
 *      area, slot `rank`, as two low-latency words (tw_ll_put_item: the flag rides with the
 *      data; 8 items' first words share a 128-byte line, so a warp's stores fill whole lines);
 *   3. reduce: each vector of this rank's rows: its own partial from the workspace, the peers'
 *      from this rank's area (tw_ll_wait_item), summed in rank order from partial 0 (the
 *      reference's __fadd_rn chain), rounded to bf16; rs: stored into `out`; ar: into `out` and, as
 *      low-latency words, into every peer's area (gather slot `rank`);
 *   4. ar: every peer's reduced rows from this rank's gather slots into `out`;
 *   5. the grid's last CTA stores ll_seq = q and ends the call (tw_op_end).
 * Why a half per parity of q suffices: a rank writes a peer's half q & 1 in call q only after it
 * has all of call q - 1's words, which that peer stored after its call q - 2 (the same half)
 * had read everything: its stream runs its calls in order. Nothing reads a peer's workspace, so
 * the call ends without waiting for anyone, and the workspace is free when it ends. */
template <class P> struct LlParams {
  tw_dev_comm_t dc;
  const P *partial;         /* this rank's partial [m][n] (the workspace) */
  uint8_t *area[kMaxWorld]; /* every rank's low-latency area, mapped for this rank */
  __nv_bfloat16 *out;
  int64_t ldo;
  uint64_t half_bytes, gather_off; /* one parity's bytes; its gather slots' offset in it */
  int32_t ch, m_local, n, all_reduce;
  int32_t from_gemm; /* the GEMM stored every rank's words itself (swap-AB, gemm_ll.cuh):
                        this rank's own rows too, so no push here and no wait for the GEMM */
  int32_t reduced;   /* tw_gemm_rs, TW_RS_LL_REDUCE: the GEMM's epilogue also summed this rank's
                        rows into out (gemm_ll.cuh): only the call's books are left here */
};

template <class P>
__global__ void __launch_bounds__(kUnfusedThreads)
    ll_reduce_kernel(const __grid_constant__ LlParams<P> p) {
  /* programmatic launch: the GEMM's partial is complete from here (from_gemm: its words carry
   * their flags, so nothing waits for the GEMM's end) */
  if (!p.from_gemm)
    tw::ptx::griddep_wait();
  const tw_dev_comm_t &dc = p.dc;
  const int ch = p.ch, world = dc.world, rank = dc.rank;
  const uint64_t epoch = tw_op_begin(dc, ch);
  const uint64_t seq = tw_ll_next_seq(dc);
  const uint32_t flag = tw_ll_flag(seq);
  const uint64_t half = tw_ll_half(seq, p.half_bytes);
  bool ok = tw_op_usable(dc, ch);
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_START);
    tw_trace_channel(dc, ch);
    if (blockIdx.x == 0 && ok)
      for (int q = 0; q < world; q++)
        if (q != rank && dc.peer_ctrl[q])
          tw_st_relaxed_sys(&dc.peer_ctrl[q]->done[ch][rank], epoch);
  }
  constexpr int V = kVec<P>;
  const int64_t vecs = p.n / V, items = (int64_t)p.m_local * vecs;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const uint64_t slot_bytes = (uint64_t)items * 32;  /* partials: 32 B per vector */
  constexpr uint64_t kGatherItem = V == 8 ? 32 : 16; /* bf16 sums: 16 or 8 B */
  /* 2. push this rank's partial rows of every peer into its area */
  for (int64_t i = first; ok && !p.from_gemm && i < items; i += stride) {
    const int64_t r = i / vecs, c = V * (i % vecs);
    for (int d = 0; d < world; d++) {
      if (d == rank)
        continue;
      const uint4 v = __ldcg(reinterpret_cast<const uint4 *>(
          p.partial + (size_t)(d * p.m_local + r) * (size_t)p.n + (size_t)c));
      tw_ll_put_item(p.area[d] + half + (uint64_t)rank * slot_bytes, (uint64_t)i, (uint64_t)items,
                     v, flag);
    }
  }
  /* 3. this rank's rows: the sum in rank order (reduced: the GEMM's epilogue did it) */
  const uint8_t *mine = p.area[rank] + half;
  for (int64_t i = first; ok && !p.reduced && i < items; i += stride) {
    const int64_t r = i / vecs, c = V * (i % vecs);
    /* this rank's own partial from the workspace, loaded before the peers' waits (from_gemm: in
     * its words, as the peers') */
    uint4 own;
    if (!p.from_gemm)
      own = __ldcg(reinterpret_cast<const uint4 *>(
          p.partial + (size_t)(rank * p.m_local + r) * (size_t)p.n + (size_t)c));
    float v[V];
    ok = ll_sum_item<P>(dc, ch, mine, slot_bytes, (uint64_t)i, (uint64_t)items, flag,
                        p.from_gemm ? nullptr : &own, v);
    if (!ok)
      break;
    const typename RsVec<P>::Packed sum = RsVec<P>::pack(v);
    const int64_t orow = p.all_reduce ? (int64_t)rank * p.m_local + r : r;
    *reinterpret_cast<typename RsVec<P>::Packed *>(p.out + (size_t)orow * (size_t)p.ldo +
                                                   (size_t)c) = sum;
    if (p.all_reduce)
      for (int d = 0; d < world; d++) {
        if (d == rank)
          continue;
        uint8_t *g = p.area[d] + half + p.gather_off + (uint64_t)rank * items * kGatherItem;
        if constexpr (V == 8)
          tw_ll_put_item(g, (uint64_t)i, (uint64_t)items, make_uint4(sum.x, sum.y, sum.z, sum.w),
                         flag);
        else /* one word an item: a warp's words fill whole lines as they are */
          tw_ll_store(reinterpret_cast<uint4 *>(g + (uint64_t)i * kGatherItem), sum.x, sum.y, flag);
      }
  }
  /* 4. tw_gemm_ar: every peer's reduced rows into out */
  if (p.all_reduce) {
    const int64_t all = (int64_t)(world - 1) * items;
    for (int64_t j = first; ok && j < all; j += stride) {
      const int64_t k = j / items, i = j % items;
      const int s = (int)k + ((int)k >= rank ? 1 : 0); /* the peers in order, this rank skipped */
      const int64_t r = i / vecs, c = V * (i % vecs);
      const uint8_t *g = mine + p.gather_off + (uint64_t)s * items * kGatherItem;
      __nv_bfloat16 *o = p.out + (size_t)((int64_t)s * p.m_local + r) * (size_t)p.ldo + (size_t)c;
      if constexpr (V == 8) {
        uint4 w;
        ok = tw_ll_wait_item(dc, ch, g, (uint64_t)i, (uint64_t)items, flag, s, &w);
        if (!ok)
          break;
        *reinterpret_cast<uint4 *>(o) = w;
      } else {
        uint2 lo;
        ok = tw_ll_wait(dc, ch, reinterpret_cast<const uint4 *>(g + (uint64_t)i * kGatherItem),
                        flag, s, (int)i, &lo);
        if (!ok)
          break;
        *reinterpret_cast<uint2 *>(o) = lo;
      }
    }
  }
  /* from_gemm: this grid does not end before the GEMM's (whatever follows on the stream finds
   * both done); by now the GEMM has stored its last words, so this costs its exit alone */
  if (p.from_gemm)
    tw::ptx::griddep_wait();
  /* 5. the last CTA ends the call */
  tw_ll_call_end(dc, ch, epoch, seq);
}

/* The unfused pipeline's second kernel on `stream`: one thread per item, at most one CTA per SM
 * of the rank's budget. The cap is load-bearing where ranks share a GPU: every rank's CTAs spin
 * in the entry handshake until all ranks have entered, so all ranks' kernels must be resident at
 * once (twenty-ninth session, group s76: 128 CTAs a rank on 8 virtual ranks timed out in it;
 * fewer than the budget, s75, only ran slower). On GPUs of their own it is launched while the GEMM
 * runs (programmatic dependent launch), so its launch and the CTAs' start overlap the GEMM's tail;
 * never where ranks share a GPU (its early CTAs would hold SMs another rank's GEMM needs). */
template <class Params>
tw_status_t launch_after_gemm(tw_comm_t comm, int64_t items, cudaStream_t stream,
                              void (*kernel)(Params), const Params &p) {
  int64_t grid = (items + kUnfusedThreads - 1) / kUnfusedThreads;
  if (grid > comm->sm_budget)
    grid = comm->sm_budget;
  if (grid < 1)
    grid = 1;
  const bool pdl = !comm->gpu_shared;
  cudaLaunchConfig_t config;
  memset(&config, 0, sizeof(config));
  cudaLaunchAttribute attr[1] = {pdl_attribute()};
  config.gridDim = dim3((unsigned)grid);
  config.blockDim = dim3(kUnfusedThreads);
  config.stream = stream;
  config.attrs = pdl ? attr : NULL;
  config.numAttrs = pdl ? 1 : 0;
  return tw_cuda_check(cudaLaunchKernelEx(&config, kernel, p),
                       "tw_gemm_rs: launching the reduce kernel");
}

/* plan.ll: ll_reduce_kernel after the GEMM (run_unfused). */
template <class P>
tw_status_t launch_ll(tw_comm_t comm, const tw_gemm_rs_args_t &a, int all_reduce, int ch,
                      bool from_gemm, bool reduced, uint8_t *const *area, cudaStream_t stream) {
  const int world = comm->world;
  LlParams<P> p;
  memset(&p, 0, sizeof(p));
  p.dc = comm->dev;
  p.ch = ch;
  p.from_gemm = from_gemm;
  p.reduced = reduced;
  p.partial = (const P *)a.workspace;
  for (int s = 0; s < world; s++)
    p.area[s] = area[s];
  p.out = (__nv_bfloat16 *)a.out;
  p.ldo = a.ldo;
  p.m_local = (int32_t)(a.m / world);
  p.n = (int32_t)a.n;
  p.all_reduce = all_reduce;
  p.half_bytes = tw_gemm_rs_ll_bytes(world, a.m, a.n, (int)sizeof(P), all_reduce) / 2;
  p.gather_off = (uint64_t)world * (uint64_t)p.m_local * (uint64_t)a.n * sizeof(P) * 2;
  const int64_t items = (int64_t)p.m_local * (a.n / kVec<P>);
  /* reduced: one CTA keeps the books */
  return launch_after_gemm(comm,
                           reduced      ? 1
                           : all_reduce ? (world - 1) * items
                                        : items,
                           stream, ll_reduce_kernel<P>, p);
}

/* The unfused pipeline's launches (see above: two) on
 * `stream`, the rank's launch stream. */
template <class P>
tw_status_t run_unfused(tw_comm_t comm, const tw_gemm_rs_args_t &a, const tw_gemm_rs_plan_t &plan,
                        int all_reduce, cudaStream_t stream) {
  const int world = comm->world, rank = comm->rank;
  const int ch = all_reduce ? TW_CH_GEMM_AR : TW_CH_GEMM_RS;
  /* The peers' release of this workspace is waited for inside the GEMM (each CTA's producer
   * before its first tile, gemm_released.cuh). */
  tw_status_t st = TW_SUCCESS;
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.c_dtype = sizeof(P) == 2 ? TW_BF16 : TW_FP32;
  g.a = a.a, g.b = a.b, g.c = a.workspace;
  g.m = a.m, g.n = a.n, g.k = a.k;
  g.lda = a.lda, g.ldb = a.ldb, g.ldc = a.n;
  g.sm_count = comm->sm_budget;
  const int swap_max_m = (int)tw_gemm_rs_swap_max_m(comm->gpu_shared); /* swap-AB to m 128 here */
  /* Where it swaps A and B, the GEMM stores the words itself (gemm_ll.cuh), its own rows too; it
   * writes no workspace, so it waits for no release either */
  tw_gemm_ll_epi_t ll;
  memset(&ll, 0, sizeof(ll));
  if (plan.ll) /* every rank's area, mapped here (the GEMM's words and the reduce kernel's) */
    for (int s = 0; s < world; s++)
      ll.area[s] = (uint8_t *)tw_heap_peer_ptr(comm, comm->ll, s);
  const bool ll_epi =
      plan.ll && tw_gemm_swap_bn_upto((int)tw_env_int(TW_GEMM_SWAP_ID), a.m, swap_max_m) != 0;
  if (ll_epi) {
    ll.ll_seq = &comm->ctrl->ll_seq;
    ll.half_bytes = tw_gemm_rs_ll_bytes(world, a.m, a.n, (int)sizeof(P), all_reduce) / 2;
    ll.m_local = (int32_t)(a.m / world);
    ll.slot_bytes = (uint64_t)ll.m_local * (uint64_t)a.n * sizeof(P) * 2;
    ll.rank = rank;
    /* TW_RS_LL_REDUCE: tw_gemm_rs's own rows summed in the GEMM's epilogue (gemm_ll.cuh) */
    ll.reduce = tw_gemm_rs_want_ll_reduce((int)tw_env_int(TW_RS_LL_REDUCE_ID), all_reduce, a.m);
    ll.ch = ch;
    ll.dc = &comm->dev;
    ll.out = a.out;
    ll.ldo = a.ldo;
  }
  st = unfused_gemm<P>(g, swap_max_m, &comm->dev, ch, ll_epi ? &ll : NULL, stream);
  if (st != TW_SUCCESS)
    return st;
  if (plan.ll)
    return launch_ll<P>(comm, a, all_reduce, ch, ll_epi, ll.reduce != 0, ll.area, stream);
  UnfusedParams<P> p;
  memset(&p, 0, sizeof(p));
  p.dc = comm->dev;
  p.ch = ch;
  p.m_local = (int32_t)(a.m / world);
  p.m = (int32_t)a.m;
  p.n = (int32_t)a.n;
  const size_t partial_bytes = (size_t)a.m * (size_t)a.n * sizeof(P);
  for (int s = 0; s < world; s++)
    p.partial[s] = (const P *)tw_heap_peer_ptr(comm, a.workspace, s);
  if (!all_reduce) {
    p.ndst = 1;
    p.dst[0] = (__nv_bfloat16 *)a.out;
    p.ld_dst = a.ldo;
    p.dst_row0 = (int64_t)rank * p.m_local;
  } else if (plan.ar_peer_out) {
    p.ndst = world;
    p.peer_out = 1; /* dst[]: on the device, after the entries; no gather copy */
    p.out = (__nv_bfloat16 *)a.out;
    p.ldo = a.ldo;
  } else {
    p.ndst = world;
    p.copy = !plan.ar_out_sym;
    for (int q = 0; q < world; q++)
      p.dst[q] =
          plan.ar_out_sym
              ? (__nv_bfloat16 *)tw_heap_peer_ptr(comm, a.out, q)
              : (__nv_bfloat16 *)((char *)tw_heap_peer_ptr(comm, a.workspace, q) + partial_bytes);
    p.ld_dst = plan.ar_out_sym ? a.ldo : a.n;
    p.gather = (const __nv_bfloat16 *)((const char *)a.workspace + partial_bytes);
    p.out = (__nv_bfloat16 *)a.out;
    p.ldo = a.ldo;
  }
  const int64_t items = p.copy ? a.m * (a.n / 8) : a.m / world * (a.n / kVec<P>);
  return launch_after_gemm(comm, items, stream, unfused_reduce_kernel<P>, p);
}

/* World 1: the sum is the product itself; the plain GEMM core writes it as bf16 (the same
 * rounding of the same fp32 accumulators as the fused path would do). */
tw_status_t run_single(tw_comm_t comm, const tw_gemm_rs_args_t &a, cudaStream_t stream) {
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.c_dtype = TW_BF16;
  g.a = a.a, g.b = a.b, g.c = a.out;
  g.m = a.m, g.n = a.n, g.k = a.k;
  g.lda = a.lda, g.ldb = a.ldb, g.ldc = a.ldo;
  g.sm_count = comm->sm_budget;
  return tw_gemm(&g, (tw_stream_t)stream);
}

/* Validates (naming the bad argument) and resolves defaults. */
tw_status_t prepare(tw_comm_t comm, const tw_gemm_rs_args_t *in, int all_reduce,
                    tw_gemm_rs_args_t *a, tw_gemm_rs_plan_t *plan) {
  const char *op = all_reduce ? "tw_gemm_ar" : "tw_gemm_rs";
  TW_ARG_CHECK(in != NULL, "%s: args: NULL", op);
  TW_ARG_CHECK(in->size >= offsetof(tw_gemm_rs_args_t, reduce_sms) && in->size <= 65536,
               "%s: args->size: %zu; initialise with TW_GEMM_RS_ARGS_INIT", op, in->size);
  TW_ARG_CHECK(in->version >= 1 && in->version <= TW_GEMM_RS_ARGS_VERSION,
               "%s: args->version: %u; this library knows 1..%d", op, in->version,
               TW_GEMM_RS_ARGS_VERSION);
  tw_gemm_rs_args_t init = TW_GEMM_RS_ARGS_INIT;
  *a = init;
  memcpy(a, in, in->size < sizeof(*a) ? in->size : sizeof(*a));
  a->size = sizeof(*a);
  const int world = comm->world;
  TW_ARG_CHECK(a->out_dtype == TW_BF16, "%s: args->out_dtype: %d; expected TW_BF16", op,
               (int)a->out_dtype);
  TW_ARG_CHECK(a->partials == TW_PARTIALS_FP32 || a->partials == TW_PARTIALS_BF16,
               "%s: args->partials: %d; expected TW_PARTIALS_FP32 (0) or TW_PARTIALS_BF16 (1)", op,
               (int)a->partials);
  TW_ARG_CHECK(a->a && a->b && a->out, "%s: args->%s: NULL", op, !a->a ? "a" : !a->b ? "b" : "out");
  TW_ARG_CHECK(a->m >= 1 && a->m <= INT32_MAX, "%s: args->m: %lld; expected 1 <= m < 2^31", op,
               (long long)a->m);
  TW_ARG_CHECK(a->m % world == 0,
               "%s: args->m: %lld is not divisible by the world size %d (each rank owns m / "
               "world rows)",
               op, (long long)a->m, world);
  TW_ARG_CHECK(a->n >= 8 && a->n % 8 == 0 && a->n <= INT32_MAX,
               "%s: args->n: %lld; expected a positive multiple of 8", op, (long long)a->n);
  TW_ARG_CHECK(a->k >= 8 && a->k % 8 == 0 && a->k <= INT32_MAX,
               "%s: args->k: %lld; expected a positive multiple of 8", op, (long long)a->k);
  if (a->lda == 0)
    a->lda = a->k;
  if (a->ldb == 0)
    a->ldb = a->k;
  if (a->ldo == 0)
    a->ldo = a->n;
  TW_ARG_CHECK(a->lda >= a->k && a->lda % 8 == 0,
               "%s: args->lda: %lld; expected >= k (%lld) and a multiple of 8", op,
               (long long)a->lda, (long long)a->k);
  TW_ARG_CHECK(a->ldb >= a->k && a->ldb % 8 == 0,
               "%s: args->ldb: %lld; expected >= k (%lld) and a multiple of 8", op,
               (long long)a->ldb, (long long)a->k);
  TW_ARG_CHECK(a->ldo >= a->n && a->ldo % 8 == 0,
               "%s: args->ldo: %lld; expected >= n (%lld) and a multiple of 8", op,
               (long long)a->ldo, (long long)a->n);
  TW_ARG_CHECK((uintptr_t)a->a % 16 == 0, "%s: args->a: %p is not 16-byte aligned", op, a->a);
  TW_ARG_CHECK((uintptr_t)a->b % 16 == 0, "%s: args->b: %p is not 16-byte aligned", op, a->b);
  TW_ARG_CHECK((uintptr_t)a->out % 16 == 0, "%s: args->out: %p is not 16-byte aligned", op, a->out);
  TW_ARG_CHECK(a->reduce_sms >= 0 && a->reduce_sms < comm->sm_budget,
               "%s: args->reduce_sms: %d; expected 0 (heuristic) or fewer than the rank's %d SMs",
               op, a->reduce_sms, comm->sm_budget);
  /* World 1 is the plain GEMM, unless TW_RS_FUSED_W1 asks for the fused kernel (measurement:
   * with no peer to wait for it can run under ncu's kernel replay). */
  if (world == 1 && !tw_env_int(TW_RS_FUSED_W1_ID)) {
    plan->single = 1;
    return TW_SUCCESS;
  }
  if (comm->sm_budget < 2)
    return tw_fail(TW_ERR_NOT_SUPPORTED,
                   "%s: the rank's SM budget is %d; the fused op needs at least 2 (a GEMM CTA and "
                   "a reduce CTA)",
                   op, comm->sm_budget);
  if (world > TW_GEMM_RS_MAX_WORLD)
    return tw_fail(TW_ERR_NOT_SUPPORTED, "%s: world %d; the fused op serves 1 to %d ranks", op,
                   world, TW_GEMM_RS_MAX_WORLD);
  TW_ARG_CHECK(a->workspace != NULL,
               "%s: args->workspace: NULL; allocate tw_gemm_rs_workspace_size() bytes with "
               "tw_mem_alloc",
               op);
  TW_ARG_CHECK((uintptr_t)a->workspace % 128 == 0,
               "%s: args->workspace: %p is not 128-byte aligned", op, a->workspace);
  tw_status_t st = tw_heap_lookup(comm, a->workspace, tw_gemm_rs_workspace_bytes(world, a->m, a->n),
                                  "args->workspace", NULL);
  if (st != TW_SUCCESS)
    return st;
  for (int r = 0; r < world; r++)
    if (!tw_heap_peer_ptr(comm, a->workspace, r) || !comm->dev.peer_ctrl[r])
      return tw_fail(TW_ERR_NOT_SUPPORTED,
                     "%s: rank %d is on another node; inter-node %s is not implemented yet", op, r,
                     op);
  /* tw_gemm_ar's direct scheme (tw_gemm_ar_want_direct, TW_AR_DIRECT), where the workspace
   * holds it: planned as a reduce-scatter with one owner of all m rows (every rank reduces them
   * all). */
  const int pbytes = a->partials == TW_PARTIALS_BF16 ? 2 : 4;
  const int direct = all_reduce &&
                     tw_gemm_ar_want_direct((int)tw_env_int(TW_AR_DIRECT_ID), world,
                                            comm->gpu_shared, pbytes, a->m, a->k) &&
                     tw_heap_avail(comm, a->workspace) >=
                         tw_gemm_ar_direct_workspace_bytes(world, a->m, a->n, pbytes);
  tw_gemm_rs_plan_args_t pa = {direct ? 1 : world,
                               a->m,
                               a->n,
                               a->k,
                               comm->sm_budget,
                               a->reduce_sms,
                               direct ? 0 : all_reduce,
                               (int)tw_env_int(TW_RS_BAND_ID),
                               pbytes,
                               world,
                               comm->gpu_shared,
                               (int)tw_env_int(TW_RS_INTERLEAVE_ID),
                               (int)tw_env_int(TW_RS_REDUCE_CTAS_ID),
                               (int)tw_env_int(TW_RS_GROUP_UNITS_ID),
                               comm->plan_sms,
                               (int)tw_env_int(TW_RS_OWNER_EPI_ID),
                               (int)tw_env_int(TW_RS_PULL_ID),
                               (int)tw_env_int(TW_RS_BLOCK_N_ID)};
  tw_gemm_rs_make_plan(&pa, plan);
  plan->direct = direct;
  /* Symmetric outputs (args.out_symmetric): the owners store their reduced rows into every
   * rank's out (NVLink stores, or HBM where ranks share a GPU) and nobody copies them, neither
   * the push's nor the pull's copy. */
  if (all_reduce && a->out_symmetric) {
    TW_ARG_CHECK(a->out_symmetric == 1, "%s: args->out_symmetric: %d; expected 0 or 1", op,
                 (int)a->out_symmetric);
    st = tw_heap_lookup(comm, a->out, (size_t)((a->m - 1) * a->ldo + a->n) * 2,
                        "args->out (out_symmetric)", NULL);
    if (st != TW_SUCCESS)
      return st;
    plan->ar_out_sym = !direct;
  }
  /* The unfused pipeline (tw_gemm_rs_want_unfused) where the workspace holds this rank's
   * partial (and, for tw_gemm_ar into a plain out, every rank's reduced rows after it). */
  /* tw_gemm_ar into a plain out where every rank lives in this process on this GPU: the
   * unfused pipeline can store into the peers' outs themselves (TW_AR_PEER_OUT), as into
   * symmetric outputs, with no gather area */
  const int peer_out = all_reduce && !a->out_symmetric && comm->one_process &&
                       comm->ranks_on_device == world && tw_env_int(TW_AR_PEER_OUT_ID) != 0;
  /* tw_gemm_ar's unfused pipeline can store its rows straight into every rank's out */
  const int stores_all = all_reduce && (a->out_symmetric || peer_out);
  plan->unfused =
      tw_gemm_rs_want_unfused((int)tw_env_int(TW_RS_UNFUSED_SMALL_ID), world, comm->gpu_shared,
                              a->m, a->k, pbytes, all_reduce, stores_all) &&
      tw_heap_avail(comm, a->workspace) >=
          tw_gemm_rs_unfused_workspace_bytes(a->m, a->n, pbytes, all_reduce && !stores_all);
  if (plan->unfused)
    plan->ar_out_sym = all_reduce && a->out_symmetric; /* checked above, direct or not */
  /* its rows through the comm's low-latency area where they fit (TW_RS_UNFUSED_LL) */
  plan->ll = plan->unfused &&
             tw_gemm_rs_want_ll((int)tw_env_int(TW_RS_UNFUSED_LL_ID), world, a->m, a->n, pbytes,
                                all_reduce, comm->ll_bytes, comm->gpu_shared && stores_all,
                                tw_gemm_rs_swap_max_m(comm->gpu_shared));
  plan->ar_peer_out = plan->unfused && !plan->ll && peer_out;
  /* tw_gemm_ar's push gather (TW_AR_PUSH, the default) where the workspace holds every owner's
   * reduced rows (tw_gemm_rs_workspace_size asks for that much) and no two ranks share a GPU
   * (comm->gpu_shared: every rank must choose alike; with ranks_on_device, 3 ranks on 2 GPUs
   * mixed push and pull and test_gemm_rs failed at world 3, sixth session). On 2 H200s it turned
   * NVLink loads into stores (GEMM+AR M=16384 3.16 -> 2.76 ms fp32, 2.92 -> 2.62 bf16 partials,
   * flux-tp8 1.23-1.27 -> 1.15-1.21). Where ranks share a GPU they keep loading: there the
   * owner's world - 1 extra copies are HBM traffic that loads do not add (tenth session, 8
   * virtual ranks with coarser groups, fp32 pull / push: flux-tp8 9.28 / 9.56 ms, M=4096 0.751
   * / 0.852, 8192 3.54 / 3.86, 16384 21.4 / 22.6; bf16 partials alike). */
  const int64_t push_env = tw_env_int(TW_AR_PUSH_ID);
  plan->ar_push =
      all_reduce && !direct && !plan->unfused && !plan->ar_out_sym &&
      (push_env > 0 || (push_env < 0 && !comm->gpu_shared)) &&
      tw_heap_avail(comm, a->workspace) >= tw_gemm_ar_push_workspace_bytes(world, a->m, a->n);
  TW_DEBUG(
      "%s rank %d: m %lld n %lld k %lld, %s partials: ctas %d, block_n %d, reduce_ctas %d, band "
      "%d, group_units %d, interleave %d, direct %d, owner_epi %d, pull %d, ar_push %d, "
      "ar_out_sym %d, unfused %d, ll %d, ar_peer_out %d",
      op, comm->rank, (long long)a->m, (long long)a->n, (long long)a->k,
      pbytes == 2 ? "bf16" : "fp32", plan->ctas, plan->block_n, plan->reduce_ctas, plan->band,
      plan->group_units, plan->interleave, plan->direct, plan->owner_epi, plan->pull, plan->ar_push,
      plan->ar_out_sym, plan->unfused, plan->ll, plan->ar_peer_out);
  return TW_SUCCESS;
}

tw_status_t gemm_rs_op(tw_comm_t comm, const tw_gemm_rs_args_t *args, int all_reduce,
                       tw_stream_t stream) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_gemm_rs_args_t a;
  tw_gemm_rs_plan_t plan;
  st = prepare(comm, args, all_reduce, &a, &plan);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  int prev;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  cudaStream_t launch_stream = NULL;
  st = tw_launch_begin(comm, stream, &launch_stream);
  if (st == TW_SUCCESS)
    st = plan.single ? run_single(comm, a, launch_stream)
         : plan.unfused
             ? (a.partials == TW_PARTIALS_BF16
                    ? run_unfused<__nv_bfloat16>(comm, a, plan, all_reduce, launch_stream)
                    : run_unfused<float>(comm, a, plan, all_reduce, launch_stream))
         : a.partials == TW_PARTIALS_BF16
             ? run_fused<__nv_bfloat16>(comm, a, plan, all_reduce, launch_stream)
             : run_fused<float>(comm, a, plan, all_reduce, launch_stream);
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}

} // namespace

static tw_status_t tw_gemm_rs_preload(void) {
  cudaFuncAttributes attr;
  const void *kernels[] = {(const void *)gemm_rs_kernel<float, kBlockN>,
                           (const void *)gemm_rs_kernel<__nv_bfloat16, kBlockN>,
                           (const void *)gemm_rs_kernel<float, 128>,
                           (const void *)gemm_rs_kernel<__nv_bfloat16, 128>,
                           (const void *)gemm_rs_kernel<float, 192>,
                           (const void *)gemm_rs_kernel<__nv_bfloat16, 192>,
                           (const void *)unfused_reduce_kernel<float>,
                           (const void *)unfused_reduce_kernel<__nv_bfloat16>,
                           (const void *)ll_reduce_kernel<float>,
                           (const void *)ll_reduce_kernel<__nv_bfloat16>};
  cudaError_t e = cudaSuccess;
  for (size_t i = 0; i < sizeof(kernels) / sizeof(kernels[0]) && e == cudaSuccess; i++)
    e = cudaFuncGetAttributes(&attr, kernels[i]);
  /* the unfused pipeline's GEMM */
  if (e == cudaSuccess)
    e = preload_unfused_gemm<float>();
  if (e == cudaSuccess)
    e = preload_unfused_gemm<__nv_bfloat16>();
  return tw_cuda_check(e, "loading the gemm_rs kernels");
}

/* tw_gemm_rs and tw_gemm_ar, registered with the runtime (runtime/registry.h). */
static const tw_op_desc_t gemm_rs_registration = {"gemm_rs", tw_gemm_rs_preload};
TW_OP_REGISTER(gemm_rs, gemm_rs_registration);

extern "C" tw_status_t tw_gemm_rs_args_init(tw_gemm_rs_args_t *args) {
  TW_ARG_CHECK(args != NULL, "args: NULL");
  tw_gemm_rs_args_t init = TW_GEMM_RS_ARGS_INIT;
  *args = init;
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_gemm_rs_workspace_size(tw_comm_t comm, int64_t m, int64_t n,
                                                 size_t *bytes) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (!bytes)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "bytes: NULL"));
  if (m < 1 || m % comm->world)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT,
                                        "m: %lld; expected a positive multiple of the world "
                                        "size %d",
                                        (long long)m, comm->world));
  if (n < 8 || n % 8)
    return tw_comm_result(comm,
                          tw_fail(TW_ERR_INVALID_ARGUMENT,
                                  "n: %lld; expected a positive multiple of 8", (long long)n));
  *bytes = tw_gemm_rs_call_workspace_bytes(comm->world, m, n);
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_gemm_rs(tw_comm_t comm, const tw_gemm_rs_args_t *args,
                                  tw_stream_t stream) {
  return gemm_rs_op(comm, args, 0, stream);
}

extern "C" tw_status_t tw_gemm_ar(tw_comm_t comm, const tw_gemm_rs_args_t *args,
                                  tw_stream_t stream) {
  return gemm_rs_op(comm, args, 1, stream);
}
