/*
 * Internal: the policies and device roles of tw_gemm_rs (GEMM + ReduceScatter) and tw_gemm_ar
 * (GEMM + AllReduce) in one persistent launch per rank: the tile configurations (RsConfig), the
 * wait before a tile's loads (RsWait), the epilogue that stores partials into the owners' staging
 * and counts them (RsEpi, RsEpiParams), the kernel's parameters (RsParams) and the reduce and
 * gather roles. The kernel that runs them, gemm_rs_kernel, and its launch are in
 * gemm_rs_fused.cu, the only file that includes this one. Geometry, flags and workspace:
 * gemm_rs.h.
 *
 * Every CTA runs the GEMM mainloop (src/gemm/gemm_sm90.cuh) from the tile
 * queue, in rank-rotated band sweeps: each band of `band` column blocks of the
 * product is swept over all row blocks (row-major inside the band, so a band
 * reads A once while its B stays in L2), starting at the rows of owner
 * rank + 1, so at any moment the ranks write into different owners, and every
 * owner's tiles of band b are complete after the ranks' b-th sweep (a staggered
 * schedule). Single-column sweeps (band 1) would re-read all of A from HBM for
 * every column, which leaves the fused GEMM phase further behind the GEMM alone
 * (figures: docs/PERF.md).
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
 * compiled under the producer's 40 registers (see gemm_rs_kernel, gemm_rs_fused.cu).
 *
 * Ordering: a rank stores into owner o's staging only after o entered this call
 * (so o's previous call no longer reads it); an owner writes its bf16 area only
 * after every rank entered (so nobody still reads the previous call's).
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "device/signal.cuh"
#include "gemm/gemm_pp_sm90.cuh"
#include "gemm/gemm_sm90.cuh"
#include "ops/gemm_rs/gemm_rs.h"
#include "ops/gemm_rs/gemm_rs_impl.h"
#include "ops/gemm_rs/rs_vec.cuh"

/* Measurement-only builds (-DTW_RS_DIAG=bits; results are WRONG, run tw-bench --no-check): each
 * bit removes one cost of the fused GEMM phase so its share of the time shows.
 * 1: every tile's partials go to this rank's own slot (no NVLink / peer stores);
 * 2: tile counts by a relaxed atomic, no release fence; 4: no partial stores at all;
 * 8: the reduce and gather CTAs wait for the counts but move no data;
 * 16: the plain GEMM's grouped tile order (rows rotated) instead of bands (the reduction
 * then waits long); 32: the tile signals from a consumer thread (no signal warp); 64: a tile is
 * signalled once its boxes left shared memory, not once its writes are performed (what the
 * consumers' wait for the writes costs); 128: the
 * second pass of a tile's fp32 epilogue (64 KiB a warpgroup through a 32 KiB buffer) does not
 * wait for the first pass's boxes to leave shared memory (what that wait costs). */
#ifndef TW_RS_DIAG
#define TW_RS_DIAG 0
#endif

namespace tw {
namespace rs {

using namespace tw::gemm;

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
constexpr int kReduceQueue = TW_CHANNEL_FLAGS - 1;
constexpr int kGatherQueue = TW_CHANNEL_FLAGS - 2;

static_assert(kBlockM == TW_GEMM_RS_BLOCK_M && kBlockN == TW_GEMM_RS_BLOCK_N, "tile geometry");
static_assert(kMaxWorld <= 32, "entry bits");

/* Bit p: rank p entered this call (as seen by this CTA). Written by thread 0 only. */
__shared__ uint32_t s_entered;
/* Set by thread 0 when a wait for an entry failed (timeout, abort, a peer's call differs) before
 * the loads of the tile it precedes: the epilogues then store and signal nothing (the stage's
 * full barrier orders it before their reads). */
__shared__ int s_entry_failed;

/* Thread 0: waits until every rank in [o0, o1] entered call `epoch`. false: timed out, aborted
 * or a peer's call differs (recorded). */
__device__ __forceinline__ bool wait_entered(const tw_dev_comm_t &dc, int ch, int o0, int o1,
                                             uint64_t epoch) {
  for (int o = o0; o <= o1; o++) {
    if (s_entered >> o & 1u)
      continue;
    if (!tw_wait_entry(dc, ch, o, epoch)) {
      s_entered = ~0u; /* recorded; the kernel finishes without waiting again */
      s_entry_failed = 1;
      return false;
    }
    s_entered |= 1u << o;
  }
  return true;
}

/* Before a CTA's first tile's loads: every rank entered this call (the owners' staging is free,
 * and direct / pull: every rank's previous call is over), with the same call as this rank's
 * (tw_wait_entry), so no tile is stored into a peer whose call differs. */
struct RsWait : NoWait {
  struct Params {
    tw_dev_comm_t dc;
    int32_t ch;
    int32_t m_local;
    int32_t m;
    int32_t world;
  };
  __device__ __forceinline__ static void before_tile(const Params &p, int32_t mb, int32_t nb) {
    tw_trace_tile(p.dc.trace, TW_TR_CLAIMED, mb, nb);
    wait_entered(p.dc, p.ch, 0, p.world - 1, tw_op_begin(p.dc, p.ch));
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
    if (row >= p.m || (TW_RS_DIAG & 4) || s_entry_failed)
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
       * not 64-row aligned take this path, and the plan pulls there unless TW_RS_PULL=0: one
       * thread's stores over NVLink are slow enough to make the op slower than tw_gemm followed
       * by a separate reduction. */
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
      if (p.owner_ar && !s_entry_failed)
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
   * so own + peer is the same bits on either rank. (More ranks would need the sum of the ranks
   * before this one first; done element by element, with each element's peer loads together, it
   * makes the consumers spill, 2 KiB per thread.) */
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
    if (s_entry_failed)
      return;
    if (p.owner_ar && mb >= p.own_mb0 && mb < p.own_mb0 + p.own_mbs) {
      /* an own tile of tw_gemm_ar: its reduced rows are at the peer (or here, for the pull) */
      const int32_t u = tw_rs_unit(mb - p.own_mb0, nb, p.own_mbs, p.n_blocks, p.band);
      tw_signal_set(p.peer_ready + u, s_rs_epoch);
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
 * them by one addition and a compare an item, the divisions happen once a unit: with a
 * division and remainder an item for the load and a 64-bit one for the store, that integer
 * arithmetic, not memory, bounds a reduce CTA's loop, alone or beside a GEMM. at<false> divides
 * per item instead (fewer registers). */
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
 * rank step: with one element per thread a CTA has only world x 6 KiB in flight, too little to
 * hide the latency of loads over NVLink. kWalk: the items' rows and vectors by ItemWalk; else a
 * division per
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
      tw_signal_put(tw_peer_flag(dc, q, p.gemm.wait.ch, p.flag_stride * (1 + me) + item), epoch);
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

} // namespace rs
} // namespace tw
