/*
 * Hopper (sm_90a) bf16 GEMM mainloop: C[M,N] = A[M,K] * B[N,K]^T, fp32 accumulate.
 *
 * Contract
 * --------
 * One CTA = 384 threads = 3 warpgroups, one CTA per SM, persistent:
 *   WG0  producer: one thread claims tiles (static stride or the global tile queue), calls
 *        Wait::before_tile(), then streams 128x64 A and BNx64 B boxes by TMA (128B swizzle)
 *        into a Stages-deep ring of shared-memory stages guarded by full/empty mbarriers.
 *        It hands each tile's index to the consumers in a per-stage slot; -1 means "no more".
 *   WG1, WG2  consumers: each owns 64 rows of the 128xBN tile (BN = 256, or 128 where big
 *        tiles quantize badly onto the SMs), issues wgmma m64nBNk16 per 16-wide k step
 *        (4 per stage), fp32 accumulators in registers (BN / 2 per thread), and
 *        then runs the epilogue on its own 64 rows: registers -> swizzled shared memory ->
 *        Epi::issue_box() (TMA store / TMA reduce-add, 64 rows x 128 bytes per box).
 *   Registers: setmaxnreg 40 (producer) / 232 (consumers); 128*40 + 256*232 <= 64K. With
 *        kRestoreRegs every warp returns to 168 at the end (consumers decrease, all meet at a
 *        CTA-wide named barrier, then WG0 increases: the CTA's register pool is shared).
 *   kCluster == 2 (static schedule only): CTA pairs along M share the B box; each loads half
 *        and multicasts it to both, so L2 serves B once per pair. Empty barriers then count
 *        the consumer warps of both CTAs, and the pair meets at a cluster barrier at both ends.
 *
 * Hooks (compile-time policies; the plain GEMM instantiates no-op ones, so pays nothing):
 *   Wait   (a) `static void before_tile(const Params&, int m_block, int n_block)`, called by the
 *          producer thread before the first TMA load of a tile. It may spin (bounded) on a
 *          readiness flag for the rows the tile reads; after an acquire it must issue
 *          ptx::fence_async_global() so the TMA loads see the data.
 *          (a') `static void a_source(const Params&, int m_block, const CUtensorMap *&map,
 *          int &row)`: may redirect the tile's A loads to another tensor map (kept in Params)
 *          and row, e.g. rows the rank already holds. Inherit NoWait for the default.
 *          (a'') With `static constexpr bool kWriteThrough = true`, warp 2 of WG0 (idle
 *          otherwise) follows the stages like a consumer warp and, for the tiles where
 *          `static int a_write_through(const Params&, int m_block, int n_block)` is 1,
 *          TMA-stores every A box the tile loads from the stage into p.a_map; where it is 2,
 *          only the boxes kb with kb % n_blocks == n_block (a row block's tiles share the
 *          stores). Its release of a stage waits for the store to read it out (the consumers'
 *          do not), so A rows a tile reads from elsewhere (a') land in p.a_map as a side
 *          effect of the GEMM.
 *   Epi    (b) `using Out` (bf16 or float: the shared-memory box layout);
 *          `static void issue_box(const Params&, const void *smem_box, int col, int row)`,
 *          called by one thread per consumer warpgroup for every 64 x (128 / sizeof(Out))
 *          box of finished output, inside a bulk group (store into the local C, into a peer's
 *          buffer through another tensor map, or reduce-add into a staging buffer);
 *          `static constexpr bool kSignal` and `static void signal(const Params&, int m_block,
 *          int n_block)`: when kSignal, once both consumer warpgroups' bulk groups of the tile
 *          have completed (cp.async.bulk.wait_group) and met at a barrier, thread
 *          `static int signal_thread(const Params&)` of consumer warpgroup 0 calls signal()
 *          (which does the release store / red on the consumer's flag). The signal
 *          is deferred to the end of the CTA's next tile's epilogue (or the end of its loop),
 *          so the stores overlap the next mainloop. With `static constexpr bool kSignalWarp`
 *          that thread only posts the tile into a shared-memory ring, and warp 1 of WG0 (idle
 *          otherwise) calls signal(): a system-scope fence then stalls that warp, not a
 *          consumer warpgroup's next wgmma.
 *   Wait   (s) `static void mbar_stuck(const Params&, int code)`: every mbarrier wait of the
 *          loop is bounded (GemmParams::mbar_timeout_ns); an expired one calls this, which must
 *          not return (NoWait traps; the fused ops record where in their comm, then trap).
 *   Grid   (c) the loop runs on the CTAs the caller gives it: gemm_cta_loop(p, smem, cta, ctas).
 *   Order  (d) TileOrder: ROW_MAJOR, DEFAULT (groups of group_m row blocks, column-major inside
 *          a group, L2-friendly), ROTATED (the DEFAULT order on row blocks shifted to start
 *          at rotate_mb and wrap) or BANDS (bands of group_n column blocks, row-major inside
 *          a band, rows rotated as ROTATED: each band streams A once while its B stays in L2)
 *          or BANDS_INTERLEAVED (BANDS whose rows go to group_m equal owners in turn).
 *   Queue  (e) kDynamic: tiles are claimed with atomicAdd on TileQueue::next, so CTAs may join
 *          late (a CTA that finished a communication role calls gemm_cta_loop then). Every
 *          one of `participants` CTAs must run the loop exactly once; the last one to finish
 *          resets the queue to zero, so no host reset is needed and graph replays work.
 *
 * A fused op instantiates gemm_cta_loop<Stages, EpiBytes, MyEpi, MyWait, true> inside its own
 * kernel (all 384 threads of the CTA call it, with SmemLayout<...>::kDynamicBytes of dynamic
 * shared memory); tests/gpu/test_gemm.cu (check_hooks) is a complete example, and
 * src/ops/gemm/gemm_sm90.cu shows the tensor maps (A box {64, 128}, B box {64, BN}, C box
 * {128 / sizeof(Out), 64}, all 128B-swizzled). Measured configurations: docs/PERF.md (GEMM core
 * section) (plain GEMM: Stages 3, EpiBytes 32768, BN 256; queue variant within ~1-4% of it).
 * gemm_pp_sm90.cuh runs the same contract's plain and signalled subset on ping-pong consumers
 * (each tile one consumer warpgroup's): tw_gemm's fp32 output and tw_gemm_rs at long K.
 *
 * Tails: the tensor maps carry the true M, N, K; TMA zero-fills out-of-bounds loads and drops
 * out-of-bounds stores, so any M >= 1, N % 8 == 0 and K % 8 == 0 work without special cases.
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "device/ptx_sm90.cuh"
#include "gemm/band_units.h"

namespace tw {
namespace gemm {

constexpr int kBlockM = 128;
constexpr int kBlockN = 256;
constexpr int kBlockK = 64;
constexpr int kThreads = 384;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kBoxRows = 64;        // output box: rows per consumer warpgroup
constexpr int kBoxBytes = 64 * 128; // one 128B-swizzled output box

// Named barrier ids (0 is __syncthreads).
constexpr uint32_t kBarConsumerWg0 = 1; // +wg
constexpr uint32_t kBarConsumers = 3;
constexpr uint32_t kBarRegs = 4; // kRestoreRegs: every warp, once the consumers returned registers

enum {
  kOrderDefault = 0,
  kOrderRowMajor = 1,
  kOrderRotated = 2,
  kOrderBands = 3,
  kOrderBandsInterleaved = 4,
  kOrderBandsOwnerLag = 5
};

struct TileOrder {
  int32_t m_blocks, n_blocks, num_tiles;
  int32_t order;     // kOrder*
  int32_t group_m;   // row blocks per group (DEFAULT, ROTATED); owners (BANDS_INTERLEAVED)
  int32_t rotate_mb; // first row block (ROTATED, BANDS)
  int32_t group_n;   // column blocks per band (BANDS)
  int32_t lag;       // BANDS_OWNER_LAG: own tiles the own rows trail the peers' by
};

// Linear tile index -> (row block, column block). Host-callable: tests/host/test_tile_order.cu
// checks every order is a bijection.
__host__ __device__ __forceinline__ void tile_coords(const TileOrder &o, int32_t t, int32_t &mb,
                                                     int32_t &nb) {
  if (o.order == kOrderRowMajor) {
    mb = t / o.n_blocks;
    nb = t - mb * o.n_blocks;
    return;
  }
  if (o.order == kOrderBandsOwnerLag) {
    // group_m owners of R = m_blocks / group_m row blocks each; rotate_mb is the first row of
    // owner rank + 1, so this rank is the owner at offset group_m - 1. Two sequences in unit
    // order (gemm_rs.h: bands of group_n columns, row-major inside): P, the peers' tiles as
    // kOrderBandsInterleaved visits them without this rank's rows, and O, this rank's own
    // tiles. Merged: the first lag * (world - 1) tiles of P, then rounds of world - 1 tiles of P
    // and one of O, then the last `lag` tiles of O. Own unit j thus comes at least `lag`
    // positions (about lag * world, but for the last units) after the peers' tiles of unit j of
    // this rank in their orders (tests/host/test_tile_order.cu).
    const int32_t world = o.group_m, w1 = world - 1, rows = o.m_blocks / world;
    const int32_t units = rows * o.n_blocks, lag = o.lag < units ? o.lag : units;
    const int32_t first_owner = o.rotate_mb / rows; // owner rank + 1
    int32_t p = -1, own = -1;
    if (t < lag * w1) {
      p = t;
    } else {
      const int32_t u = t - lag * w1, round = u / world, pos = u - round * world;
      if (round >= units - lag)
        own = units - lag + (u - (units - lag) * world);
      else if (pos < w1)
        p = lag * w1 + round * w1 + pos;
      else
        own = round;
    }
    int32_t owner, unit;
    if (own >= 0) {
      owner = (first_owner + w1) % world, unit = own;
    } else {
      const int32_t per_band = o.group_n * rows * w1;
      const int32_t band = p / per_band, first_n = band * o.group_n;
      const int32_t cols = min(o.group_n, o.n_blocks - first_n);
      const int32_t in_band = p - band * per_band, q = in_band / cols;
      owner = (first_owner + q % w1) % world;
      unit = first_n * rows + (q / w1) * cols + in_band % cols;
    }
    int32_t mb_rel;
    tw_rs_unit_coords(unit, rows, o.n_blocks, o.group_n, &mb_rel, &nb);
    mb = owner * rows + mb_rel;
    return;
  }
  if (o.order >= kOrderBands) { // bands of group_n columns, row-major inside, rows rotated
    const int32_t per_band = o.group_n * o.m_blocks;
    const int32_t band = t / per_band;
    const int32_t first_n = band * o.group_n;
    const int32_t cols = min(o.group_n, o.n_blocks - first_n);
    const int32_t in_band = t - band * per_band;
    const int32_t q = in_band / cols; // the band's q-th row
    if (o.order == kOrderBandsInterleaved) {
      // group_m owners of m_blocks / group_m row blocks each (rotate_mb a multiple of that):
      // rows go to the owners in turn, each owner's in ascending order.
      const int32_t per_owner = o.m_blocks / o.group_m;
      int32_t first = (q % o.group_m) * per_owner + o.rotate_mb;
      if (first >= o.m_blocks)
        first -= o.m_blocks;
      mb = first + q / o.group_m;
    } else {
      mb = q + o.rotate_mb;
      if (mb >= o.m_blocks)
        mb -= o.m_blocks;
    }
    nb = first_n + in_band % cols;
    return;
  }
  const int32_t per_group = o.group_m * o.n_blocks;
  const int32_t group = t / per_group;
  const int32_t first_m = group * o.group_m;
  const int32_t rows = min(o.group_m, o.m_blocks - first_m);
  const int32_t in_group = t - group * per_group;
  mb = first_m + in_group % rows;
  nb = in_group / rows;
  if (o.order == kOrderRotated) {
    mb += o.rotate_mb;
    if (mb >= o.m_blocks)
      mb -= o.m_blocks;
  }
}

// Global tile queue (device memory, zero at first use; reset by the last CTA of every call).
struct TileQueue {
  uint32_t next;     // tickets handed out
  uint32_t finished; // CTAs that found the queue empty
};

// One thread of each participant, once per call, after its last (failed) claim: the last one
// to leave resets the queue for the next call. Every other participant has made its final
// claim before its `finished` increment, so nobody claims after the reset. A CTA counted in
// `participants` that ends up not running the GEMM loop must still call this once.
__device__ __forceinline__ void queue_leave(TileQueue *queue, int32_t participants) {
  __threadfence();
  if (atomicAdd(&queue->finished, 1u) == (uint32_t)participants - 1) {
    atomicExch(&queue->next, 0u);
    atomicExch(&queue->finished, 0u);
  }
}

// Bound on every mbarrier wait of the loop where GemmParams::mbar_timeout_ns is 0. A wait can
// legitimately last as long as the producer's readiness hook (a bounded flag wait in the fused
// ops, which set the field above their flag bound) plus a tile.
constexpr uint64_t kMbarTimeoutDefaultNs = 30ull * 1000 * 1000 * 1000;

// What an expired mbarrier wait was (Wait::mbar_stuck's code): role * 16 + stage.
enum {
  kStuckProducerEmpty = 1, // the producer waited for the consumers to free a stage
  kStuckConsumerFull = 2,  // a consumer waited for a stage's loads
  kStuckSignalFull = 3,    // the signal warp waited for the consumers' next tile
  kStuckSignalPost = 4,    // a consumer waited for a free entry of the signal ring
  kStuckSplitFull = 5,     // split-K: a reader waited for its round's sender (+ the round)
  kStuckSplitFree = 6,     // split-K: a sender waited for its last tile's reader (+ the round)
  kStuckPpTileFull = 7,    // ping-pong: a consumer waited for its next tile's index (+ the entry)
  kStuckPpTileEmpty = 8,   // ping-pong: the producer waited for a free tile entry (+ the entry)
  kStuckPpOrder = 9,       // ping-pong: a consumer waited for the other's mainloop (+ warpgroup)
  kStuckPpOwner = 10       // ping-pong: an owner-epilogue tile, which that loop does not serve
};

template <class Epi, class Wait> struct GemmParams {
  using WaitType = Wait;
  CUtensorMap a_map; // bf16 [M, K] (dims {K, M}), box {64, 128}, 128B swizzle
  CUtensorMap b_map; // bf16 [N, K] (dims {K, N}), box {64, BN} ({64, BN / 2} for pairs), 128B sw.
  typename Epi::Params epi;
  typename Wait::Params wait;
  TileOrder order;
  TileQueue *queue;         // kDynamic only
  int32_t participants;     // kDynamic only: CTAs that run the loop once each
  int32_t k_blocks;         // ceil(K / 64)
  uint64_t mbar_timeout_ns; // bound on each mbarrier wait (0: kMbarTimeoutDefaultNs)
  int32_t fault_stall;      // tests (TW_FAULT_STALL_TILE): 1 + the tile (in this CTA loop's tile
                            // numbering) whose first stage the producer never loads; 0: none
  int32_t rows;             // split-K: the product's rows, at most 2^31 - 1 (0: not given)
  // split-K with split_scatter (TW_SPLIT_SCATTER, measurement): every slice sums one column
  // band of the tile over all slices and stores it to `split_c` (ldc elements per row, n
  // columns) itself, instead of the tree into slice 0 and its epilogue
  int32_t split_scatter;
  int32_t split_n;
  void *split_c;
  int64_t split_ldc;
  // Launched as a programmatic dependent of the grid before it in the stream, which writes one
  // operand (kAfterGridA: the loop's A; kAfterGridB: the loop's B) and lets its dependents
  // start early: the producer first brings the other operand's boxes of this CTA's first tile
  // (at most kAfterGridPrefetch K blocks) into L2, then waits for that grid (griddepcontrol.wait)
  // before its first load. 0: launched as usual.
  int32_t after_grid;
  // Split-K through global memory (kSplitWs): each slice stores its fp32 accumulators at
  // split_ws, [tile][slice][consumer warpgroup][BN / 8 chunks][128 threads] float4s, and counts
  // itself in split_cnt[tile * 2 + warpgroup] (zero before the call, zero again after it); the
  // last to arrive sums every slice's in the cluster tree's order and stores the tile.
  float *split_ws;
  uint32_t *split_cnt;
};

constexpr int32_t kAfterGridA = 1, kAfterGridB = 2;
constexpr int32_t kAfterGridPrefetch = 16;

// ---- stock hooks -----------------------------------------------------------------------------

struct NoWait {
  struct Params {};
  __device__ static void before_tile(const Params &, int32_t, int32_t) {}
  // (a') Where the tile's A rows come from: by default p.a_map at row mb * kBlockM. A hook may
  // point the loads at another tensor map (in its Params) and row, e.g. a local copy of rows
  // that need no wait. Custom Wait policies inherit this default from NoWait.
  template <class P>
  __device__ static void a_source(const P &, int32_t, const CUtensorMap *&, int32_t &) {}
  // (a'') Which of the tile's A boxes the write-through warp stores into p.a_map: 0 none, 1
  // all, 2 those with kb % n_blocks == n_block.
  template <class P> __device__ static int a_write_through(const P &, int32_t, int32_t) {
    return 0;
  }
  // (s) An mbarrier wait of the loop outlived GemmParams::mbar_timeout_ns (an internal stall:
  // the loop cannot go on). `code`: kStuck* * 16 + stage. Must not return: the default traps;
  // a fused op's hook records where first (its comm's error block) and aborts the comm.
  template <class P> __device__ static void mbar_stuck(const P &, int32_t) { __trap(); }
};

// TMA store of the tile into `c_map` (the local C, or a peer's buffer mapped here).
// c_map: Out [rows, cols] (dims {cols, rows}), box {128 / sizeof(Out), 64}, 128B swizzle.
template <class OutT> struct EpiTmaStore {
  using Out = OutT;
  static constexpr bool kSignal = false;
  struct Params {
    CUtensorMap c_map;
  };
  __device__ static void prefetch(const Params &p) { ptx::tma_prefetch_map(&p.c_map); }
  __device__ static void issue_box(const Params &p, const void *box, int32_t col, int32_t row) {
    ptx::tma_store_2d(&p.c_map, box, col, row);
  }
  __device__ static void signal(const Params &, int32_t, int32_t) {}
};

// TMA reduce-add of the tile into `c_map` (fp32 staging buffer, local or a peer's).
template <class OutT> struct EpiTmaReduceAdd : EpiTmaStore<OutT> {
  using Params = typename EpiTmaStore<OutT>::Params;
  __device__ static void issue_box(const Params &p, const void *box, int32_t col, int32_t row) {
    ptx::tma_reduce_add_2d(&p.c_map, box, col, row);
  }
};

// Swap-AB (decode shapes, tw_gemm with m <= 64): the loop computes C^T = B * A^T, its "A"
// operand the product's B (128 of its N rows a tile) and its "B" operand the product's few A
// rows (BN = 16 or 64), so no wgmma row is wasted on rows past M. The epilogue stores each
// consumer warpgroup's 64 x BN accumulators transposed: boxes of BN rows x 128 bytes of C,
// c_map box {128 / sizeof(Out), BN}, issued at (C column, C row) (detail::epilogue_t).
template <class OutT> struct EpiTmaStoreT : EpiTmaStore<OutT> {
  static constexpr bool kTransposed = true;
};

// ---- shared memory layout --------------------------------------------------------------------

constexpr int kSigDepth = 4; // tiles whose signal may wait for the signal warp

// An optional policy flag: Name<P>::value is P::member where the policy declares it, else
// false (the flags below).
#define TW_OPTIONAL_FLAG(Name, member)                                                             \
  template <class P, class = void> struct Name { static constexpr bool value = false; };           \
  template <class P> struct Name<P, decltype(void(P::member))> {                                   \
    static constexpr bool value = P::member;                                                       \
  };

// Epi::kSignalWarp (kSignal epilogues, optional, false if absent): the consumers hand each
// finished tile to warp 1 of the producer warpgroup, idle otherwise, which calls Epi::signal
// for it. A signal that fences at system scope then stalls that warp instead of a consumer
// warp (and with it the warpgroup's next wgmma).
// Epi::kOwnerEpi (optional, false if absent; tw_gemm_rs / tw_gemm_ar on 2 ranks,
// plan.owner_epi): a tile where `static bool owner_tile(const GemmParams&, int m_block)` holds
// is final in this CTA: `static void combine(const GemmParams&, float (&acc)[BN / 2], int
// m_block, int n_block, int wg, int wg_thread)` adds what other ranks stored for it into the
// accumulators (it may wait, bounded), and the tile is stored through `typename Epi::OwnerOut`
// (its own Out and issue_box, taking Epi::Params), signalled only where `static bool
// owner_signals(const GemmParams&)` holds. The previous tile's signal is given first.
TW_OPTIONAL_FLAG(OwnerEpiOf, kOwnerEpi)
TW_OPTIONAL_FLAG(SignalWarpOf, kSignalWarp)

// Epi::kDiagSignalAfterRead (measurement builds only, false if absent): a tile is signalled once
// its boxes have been read out of shared memory, not once the writes are performed, so the
// signal may precede the data (results are wrong); it shows what waiting for the writes costs.
TW_OPTIONAL_FLAG(DiagSignalAfterReadOf, kDiagSignalAfterRead)
// Epi::kDiagPassNoWait (measurement builds only, false if absent): an epilogue pass after the
// tile's first writes its boxes without waiting for the previous pass's boxes to leave shared
// memory (results are wrong); it shows what a two-pass epilogue (fp32 partials) waits.
TW_OPTIONAL_FLAG(DiagPassNoWaitOf, kDiagPassNoWait)

// Epi::kTransposed (optional, false if absent): EpiTmaStoreT's transposed store.
// Epi::kWarpgroupStore (transposed epilogues, optional): the consumer warpgroup stores its
// boxes itself from shared memory (`template <int kBoxes, int kBoxBytes, int kRows> static void
// store_boxes(const Params&, const uint8_t *boxes, int wg_thread, int32_t col, int32_t row)`,
// all 128 threads, col / row: the first box's C column and C row) instead of a TMA store.
TW_OPTIONAL_FLAG(WarpgroupStoreOf, kWarpgroupStore)
TW_OPTIONAL_FLAG(TransposedOf, kTransposed)

// Wait::kWriteThrough (optional, false if absent): the write-through warp of hook (a'').
TW_OPTIONAL_FLAG(WriteThroughOf, kWriteThrough)

// kTileM 64 (swap-AB's 64-row tiles): A tiles of 64 rows, B tiles of 2 x BN rows (one consumer
// warpgroup multiplies the 64 rows by all of them; with the workspace's split-K, each of the two
// by its BN).
template <int Stages, int EpiBytes, int BN = kBlockN, int kTileM = kBlockM> struct SmemLayout {
  static_assert(kTileM == kBlockM || kTileM == 64, "tiles of 128 or 64 rows");
  static constexpr int kTileA = kTileM * kBlockK * 2;
  static constexpr int kTileB = BN * (kTileM == 64 ? 2 : 1) * kBlockK * 2;
  static constexpr int kA = 0;
  static constexpr int kB = kA + Stages * kTileA;
  static constexpr int kC = kB + Stages * kTileB; // EpiBytes per consumer warpgroup
  static constexpr int kFull = kC + 2 * EpiBytes;
  static constexpr int kEmpty = kFull + Stages * 8;
  static constexpr int kSlot = kEmpty + Stages * 8;
  static constexpr int kSigFull = (kSlot + Stages * 4 + 7) / 8 * 8; // the signal ring (kSigDepth)
  static constexpr int kSigEmpty = kSigFull + kSigDepth * 8;
  static constexpr int kSigSlot = kSigEmpty + kSigDepth * 8; // {mb, nb} per entry
  static constexpr int kEnd = kSigSlot + kSigDepth * 8;
  static constexpr int kDynamicBytes = kEnd + 1024; // slack to align the base to 1024
  static_assert(EpiBytes % kBoxBytes == 0, "epilogue buffer holds whole boxes");
};

// ---- the loop ----------------------------------------------------------------------------------

namespace detail {

// Boxes of 64 x (128 / sizeof(Out)) one epilogue pass fills: as many as the buffer holds, at
// most a row of the tile (split-K's 32 KiB buffer is larger than a bf16 128-column row).
template <int EpiBytes, int BN, class Out> constexpr int epi_boxes_per_pass() {
  return EpiBytes / kBoxBytes < BN / (128 / (int)sizeof(Out)) ? EpiBytes / kBoxBytes
                                                              : BN / (128 / (int)sizeof(Out));
}
// The 16-byte chunks that consumer thread t (of a warpgroup's 128) takes of kBoxes boxes of kRows
// rows x 128 bytes, 128B-swizzled, kBoxBytes apart: fn(b, r, c16, chunk) for box b, row r,
// 16-byte column c16 (0-7) and the chunk's address in shared memory (for warpgroup stores).
template <int kBoxes, int kBoxBytes, int kRows, class F>
__device__ __forceinline__ void for_box_chunks(const uint8_t *boxes, int t, F &&fn) {
  constexpr int kChunks = kBoxes * kRows * 8;
#pragma unroll
  for (int j = 0; j < (kChunks + 127) / 128; j++) {
    const int c = t + 128 * j;
    if (c >= kChunks)
      break;
    const int b = c / (kRows * 8), r = (c / 8) % kRows, c16 = c % 8;
    fn(b, r, c16, boxes + b * kBoxBytes + r * 128 + ((c16 ^ (r & 7)) << 4));
  }
}

// Consumer warpgroup `wg` writes its 64 x 256 accumulators as boxes of 64 x (128 / sizeof(Out))
// in the 128B-swizzled layout TMA expects, EpiBytes at a time, and issues them. `row_wg`: which
// 64 rows of the tile they are (-1: the warpgroup's own; the ping-pong loop, gemm_pp_sm90.cuh,
// stores both halves of its tile from one warpgroup).
template <int EpiBytes, int BN, class Epi, class Params>
__device__ __forceinline__ void epilogue(const Params &p, float (&acc)[BN / 2], uint8_t *cbuf,
                                         int wg, int wg_thread, int32_t mb, int32_t nb,
                                         int row_wg = -1) {
  using Out = typename Epi::Out;
  constexpr int kBoxCols = 128 / (int)sizeof(Out);
  constexpr int kBoxesPerPass = epi_boxes_per_pass<EpiBytes, BN, Out>();
  constexpr int kColsPerPass = kBoxesPerPass * kBoxCols;
  constexpr int kPasses = BN / kColsPerPass;
  constexpr int kJPerPass = kColsPerPass / 8; // n8 accumulator groups per pass
  static_assert(BN % kColsPerPass == 0, "passes cover the tile");
  const int warp = wg_thread >> 5, lane = wg_thread & 31;
  const int r = warp * 16 + (lane >> 2); // and r + 8; (r + 8) & 7 == r & 7
  const int32_t row0 = mb * kBlockM + (row_wg < 0 ? wg : row_wg) * kBoxRows;
  const int32_t col0 = nb * BN;
  const uint32_t base = ptx::smem_u32(cbuf);
#pragma unroll
  for (int pass = 0; pass < kPasses; pass++) {
    if (wg_thread == 0 && !(DiagPassNoWaitOf<Epi>::value && pass > 0))
      ptx::bulk_wait_read<0>(); // the previous boxes left shared memory
    ptx::named_bar_sync(kBarConsumerWg0 + wg, 128);
#pragma unroll
    for (int jj = 0; jj < kJPerPass; jj++) {
      const int j = pass * kJPerPass + jj;
      if constexpr (sizeof(Out) == 2) {
        const int box = jj >> 3;
        const uint32_t off = box * kBoxBytes + ((((jj & 7) ^ (r & 7)) << 4) | ((lane & 3) << 2));
        __nv_bfloat162 lo = __floats2bfloat162_rn(acc[4 * j + 0], acc[4 * j + 1]);
        __nv_bfloat162 hi = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off + r * 128),
                     "r"(*reinterpret_cast<uint32_t *>(&lo)));
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off + (r + 8) * 128),
                     "r"(*reinterpret_cast<uint32_t *>(&hi)));
      } else {
        // A half-warp's 8-byte stores cover rows r..r+3, 32 bytes each: with the same group jj
        // on every row, rows r and r ^ 1 land on the same two 16-byte chunks after the swizzle
        // (ncu: 4.2-way conflicts, 51% of the epilogue's store wavefronts). Odd rows store
        // group jj ^ 2 at the same step (the swizzle then puts the 4 rows on 4 chunk pairs);
        // every value still goes to its own address, so C is unchanged.
        static_assert(kJPerPass % 4 == 0, "fp32 passes hold whole boxes of 4 groups");
        const bool odd = r & 1;
        const int jw = odd ? (jj ^ 2) : jj;         // the group this thread stores now
        const int jo = pass * kJPerPass + (jj ^ 2); // its accumulators, for odd rows
        const float v0 = odd ? acc[4 * jo + 0] : acc[4 * j + 0];
        const float v1 = odd ? acc[4 * jo + 1] : acc[4 * j + 1];
        const float v2 = odd ? acc[4 * jo + 2] : acc[4 * j + 2];
        const float v3 = odd ? acc[4 * jo + 3] : acc[4 * j + 3];
        const int box = jw >> 2;
        const int byte = ((jw & 3) << 5) | ((lane & 3) << 3);
        const uint32_t off = box * kBoxBytes + ((((byte >> 4) ^ (r & 7)) << 4) | (byte & 15));
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(base + off + r * 128), "f"(v0),
                     "f"(v1));
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(base + off + (r + 8) * 128), "f"(v2),
                     "f"(v3));
      }
    }
    ptx::fence_async_shared();
    ptx::named_bar_sync(kBarConsumerWg0 + wg, 128);
    if (wg_thread == 0) {
#pragma unroll
      for (int b = 0; b < kBoxesPerPass; b++)
        Epi::issue_box(p.epi, cbuf + b * kBoxBytes, col0 + (pass * kBoxesPerPass + b) * kBoxCols,
                       row0);
      ptx::bulk_commit();
    }
  }
}

// Swap-AB's epilogue (Epi::kTransposed): consumer warpgroup `wg` holds C^T's 64 x BN block at
// C columns mb * 128 + wg * 64 + [0, 64) and C rows nb * BN + [0, BN) (64-row tiles, kTileM 64:
// C columns mb * 64 + [0, 64) and C rows (2 nb + wg) * BN + [0, BN)); it writes it as 64 /
// (128 / sizeof(Out)) boxes of BN C rows x 128 bytes in the 128B-swizzled layout and issues
// them. In the wgmma layout (as in epilogue()) accumulator 4 j + q of a thread holds C column
// r + 8 (q >> 1) (r = 16 warp + lane / 4) and C row 8 j + 2 (lane & 3) + (q & 1), so each
// thread stores scalars; the block is small (at most 64 x 64).
template <int EpiBytes, int BN, class Epi, int kTileM, int kWgs, class Params>
__device__ __forceinline__ void epilogue_t(const Params &p, float (&acc)[BN / 2], uint8_t *cbuf,
                                           int wg, int wg_thread, int32_t mb, int32_t nb) {
  using Out = typename Epi::Out;
  constexpr int kBoxCols = 128 / (int)sizeof(Out); // C columns per box
  constexpr int kBoxes = kBoxRows / kBoxCols;      // per warpgroup: 1 (bf16) or 2 (fp32)
  constexpr int kBoxBytesT = BN * 128;
  static_assert(kBoxes * kBoxBytesT <= EpiBytes, "the transposed boxes fit the buffer");
  static_assert(kBoxBytesT % 1024 == 0, "every box starts on a swizzle atom");
  const int warp = wg_thread >> 5, lane = wg_thread & 31;
  const int r = warp * 16 + (lane >> 2); // C columns r and r + 8 of the warpgroup's 64
  const uint32_t base = ptx::smem_u32(cbuf);
  if (wg_thread == 0)
    ptx::bulk_wait_read<0>(); // the previous tile's boxes left shared memory
  ptx::named_bar_sync(kBarConsumerWg0 + wg, 128);
#pragma unroll
  for (int j = 0; j < BN / 8; j++) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int col = r + (q >> 1) * 8;                 // C column in the warpgroup's 64
      const int row = 8 * j + 2 * (lane & 3) + (q & 1); // C row in the tile's BN
      const int box = col / kBoxCols, byte = (col % kBoxCols) * (int)sizeof(Out);
      const uint32_t off =
          box * kBoxBytesT + row * 128 + ((((byte >> 4) ^ (row & 7)) << 4) | (byte & 15));
      if constexpr (sizeof(Out) == 2) {
        const __nv_bfloat16 v = __float2bfloat16_rn(acc[4 * j + q]);
        asm volatile("st.shared.b16 [%0], %1;" ::"r"(base + off),
                     "h"(*reinterpret_cast<const uint16_t *>(&v)));
      } else {
        asm volatile("st.shared.f32 [%0], %1;" ::"r"(base + off), "f"(acc[4 * j + q]));
      }
    }
  }
  const int32_t col0 = mb * kTileM + (kTileM == 64 ? 0 : wg * kBoxRows);
  const int32_t row0 = kTileM == 64 ? (nb * kWgs + wg) * BN : nb * BN;
  if constexpr (WarpgroupStoreOf<Epi>::value) {
    // the warpgroup reads the boxes back (generic proxy) and stores them itself; the next
    // tile's first barrier above keeps its writes behind these reads
    ptx::named_bar_sync(kBarConsumerWg0 + wg, 128);
    Epi::template store_boxes<kBoxes, kBoxBytesT, BN>(p.epi, cbuf, wg_thread, col0, row0);
  } else {
    ptx::fence_async_shared();
    ptx::named_bar_sync(kBarConsumerWg0 + wg, 128);
    if (wg_thread == 0) {
#pragma unroll
      for (int b = 0; b < kBoxes; b++)
        Epi::issue_box(p.epi, cbuf + b * kBoxBytesT, col0 + b * kBoxCols, row0);
      ptx::bulk_commit();
    }
  }
}

// The tile's epilogue: transposed for swap-AB (EpiTmaStoreT), else as the core's.
template <int EpiBytes, int BN, class Epi, int kTileM = kBlockM, int kWgs = 2, class Params>
__device__ __forceinline__ void epilogue_any(const Params &p, float (&acc)[BN / 2], uint8_t *cbuf,
                                             int wg, int wg_thread, int32_t mb, int32_t nb) {
  if constexpr (TransposedOf<Epi>::value)
    epilogue_t<EpiBytes, BN, Epi, kTileM, kWgs>(p, acc, cbuf, wg, wg_thread, mb, nb);
  else
    epilogue<EpiBytes, BN, Epi>(p, acc, cbuf, wg, wg_thread, mb, nb);
}

// Bulk groups one tile's epilogue commits per consumer warpgroup (one for the transposed
// epilogue, whose BN may be narrower than a box: no pass count applies there).
template <int EpiBytes, int BN, class Out> constexpr int epi_passes() {
  constexpr int cols = epi_boxes_per_pass<EpiBytes, BN, Out>() * (128 / (int)sizeof(Out));
  return cols > 0 ? BN / cols : 1;
}

// The consumers' end of the signal ring (SignalWarpOf<Epi>): entry i, its phase.
struct SigRing {
  uint64_t *full, *empty;
  int32_t *slot;
  int i;
  uint32_t phase;
  // false: no free entry within timeout_ns.
  __device__ __forceinline__ bool post(int32_t mb, int32_t nb, uint64_t timeout_ns) {
    if (!ptx::mbar_wait_for(&empty[i], phase ^ 1, timeout_ns))
      return false;
    slot[2 * i] = mb;
    slot[2 * i + 1] = nb;
    ptx::mbar_arrive(&full[i]); // release: the stores' completion seen by this thread goes along
    if (++i == kSigDepth) {
      i = 0;
      phase ^= 1;
    }
    return true;
  }
};

template <class Params> __device__ __forceinline__ uint64_t mbar_timeout(const Params &p) {
  return p.mbar_timeout_ns ? p.mbar_timeout_ns : kMbarTimeoutDefaultNs;
}

// kSignal epilogues: tile (mb, nb)'s signal once both consumer warpgroups' stores of it have
// completed. `Pending` groups of this thread may still be in flight (the next tile's), so the
// stores of a tile overlap the next tile's mainloop instead of stalling the consumers: with
// fp32 tiles stored to a peer over NVLink the wait cost tw_gemm_rs up to half its GEMM speed.
template <int Pending, class Epi, class Params>
__device__ __forceinline__ void signal_after_stores(const Params &p, int wg, int wg_thread,
                                                    int32_t mb, int32_t nb, SigRing &ring) {
  if (wg_thread == 0) {
    if constexpr (DiagSignalAfterReadOf<Epi>::value)
      ptx::bulk_wait_read<Pending>();
    else
      ptx::bulk_wait<Pending>(); // writes performed, not just read out
  }
  ptx::named_bar_sync(kBarConsumers, 256);
  if (wg == 0 && wg_thread == Epi::signal_thread(p.epi)) {
    if constexpr (SignalWarpOf<Epi>::value) {
      if (!ring.post(mb, nb, mbar_timeout(p)))
        Params::WaitType::mbar_stuck(p.wait, kStuckSignalPost * 16 + ring.i);
    } else
      Epi::signal(p.epi, mb, nb);
  }
}

} // namespace detail

namespace detail {

// Split-K, one consumer warpgroup (all 128 threads) after a tile's mainloop: the slices'
// accumulators summed as a binary tree over distributed shared memory, log2(kSplit) rounds. In
// round r (half = kSplit >> (r + 1)) slice s in [half, 2 half) waits until its previous tile's
// buffer was read, writes its accumulators into its epilogue buffer (thread-major in 16-byte
// chunks: conflict-free), arrives on slice s - half's bar[r] (release, cluster scope) and is done
// (returns false); slice s < half waits on its bar[r] (acquire, cluster scope), adds slice s +
// half's accumulators to its own and tells that slice its buffer is free (its bar[kRounds]).
// Slice 0 ends with the sum ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)) for 8 slices, the same
// order on every run; returns true. Each barrier completes once per tile (one sender per round,
// one reader per buffer), so `it` (the warpgroup's tiles so far) gives every phase. Against one
// reader of every slice in turn: log2(kSplit) buffers on the longest path, not kSplit - 1.
// Split-K with GemmParams::split_scatter, one consumer warpgroup (all 128 threads): every slice
// writes its accumulators into its epilogue buffer (thread-major 16-byte chunks) and arrives on
// every other slice's bar[0] (release, cluster scope); then, once every other slice arrived on
// its own bar[0] (acquire), it sums its band of kChunks / kSplit chunks (8 of the tile's
// columns each) over slices 0, 1, ... in that order (the first version's order, the same bits
// on every run) and stores them to p.split_c with plain stores (rows past p.rows and columns
// past p.split_n left out); it then tells every other slice that it has read their buffers (their
// bar[1], which completes after kSplit - 1 arrivals), and waits for its own bar[1] before it
// writes its buffer again (the next tile). One round on every slice's path, no epilogue.
template <int kSplit, int BN, class Out, class Params>
__device__ __forceinline__ void
split_scatter(const Params &p, float (&acc)[BN / 2], uint8_t *cbuf, uint64_t *bar, uint32_t slice,
              uint32_t it, int wg_thread, int wg, int32_t mb, int32_t nb, uint64_t timeout_ns) {
  constexpr int kChunks = BN / 8;
  constexpr int kBand = kChunks / kSplit;
  static_assert(kBand >= 1 && kChunks % kSplit == 0, "every slice a whole band of chunks");
  using WaitT = typename Params::WaitType;
  if (!ptx::mbar_wait_for<true>(&bar[1], (it & 1) ^ 1, timeout_ns))
    WaitT::mbar_stuck(p.wait, kStuckSplitFree * 16 + 8);
  float4 *mine = reinterpret_cast<float4 *>(cbuf);
#pragma unroll
  for (int j = 0; j < kChunks; j++)
    mine[j * 128 + wg_thread] =
        make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
  const uint32_t full = ptx::smem_u32(&bar[0]);
#pragma unroll 1
  for (uint32_t q = 0; q < (uint32_t)kSplit; q++)
    if (q != slice)
      ptx::mbar_arrive_release_cluster(ptx::mapa_shared(full, q));
  if (!ptx::mbar_wait_for<true>(&bar[0], it & 1, timeout_ns))
    WaitT::mbar_stuck(p.wait, kStuckSplitFull * 16 + 8);
  const uint32_t base = ptx::smem_u32(cbuf) + 16u * (uint32_t)wg_thread;
  const int j0 = (int)slice * kBand;
  float4 sum[kBand];
#pragma unroll
  for (int b = 0; b < kBand; b++)
    sum[b] = ptx::ld_shared_cluster_f4(ptx::mapa_shared(base, 0) + 16u * 128u * (uint32_t)(j0 + b));
#pragma unroll 1
  for (uint32_t q = 1; q < (uint32_t)kSplit; q++) {
    const uint32_t remote = ptx::mapa_shared(base, q);
#pragma unroll
    for (int b = 0; b < kBand; b++) {
      const float4 v = ptx::ld_shared_cluster_f4(remote + 16u * 128u * (uint32_t)(j0 + b));
      sum[b].x = __fadd_rn(sum[b].x, v.x);
      sum[b].y = __fadd_rn(sum[b].y, v.y);
      sum[b].z = __fadd_rn(sum[b].z, v.z);
      sum[b].w = __fadd_rn(sum[b].w, v.w);
    }
  }
  // Every thread of the warpgroup has read the other slices' buffers: they may be written again.
  ptx::named_bar_sync(kBarConsumerWg0 + wg, 128);
  if (wg_thread == 0) {
    const uint32_t freed = ptx::smem_u32(&bar[1]);
    for (uint32_t q = 0; q < (uint32_t)kSplit; q++)
      if (q != slice)
        ptx::mbar_arrive_release_cluster(ptx::mapa_shared(freed, q));
  }
  // Chunk j of thread t: rows r and r + 8 of the warpgroup's 64, columns 8 j + 2 (t % 4) + {0, 1}
  // (the wgmma accumulator layout, as in the epilogue).
  const int warp = wg_thread >> 5, lane = wg_thread & 31;
  const int64_t row0 = (int64_t)mb * kBlockM + wg * (kBlockM / 2) + warp * 16 + (lane >> 2);
  Out *c = static_cast<Out *>(p.split_c);
#pragma unroll
  for (int b = 0; b < kBand; b++) {
    const int64_t col = (int64_t)nb * BN + 8 * (j0 + b) + 2 * (lane & 3);
    if (col >= p.split_n)
      continue;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int64_t row = row0 + 8 * h;
      if (row >= p.rows)
        continue;
      const float lo = h ? sum[b].z : sum[b].x, hi = h ? sum[b].w : sum[b].y;
      Out *dst = c + row * p.split_ldc + col;
      if constexpr (sizeof(Out) == 2)
        *reinterpret_cast<__nv_bfloat162 *>(dst) = __floats2bfloat162_rn(lo, hi);
      else
        *reinterpret_cast<float2 *>(dst) = make_float2(lo, hi);
    }
  }
}

template <int kSplit> constexpr int split_rounds() {
  return kSplit >= 8 ? 3 : (kSplit >= 4 ? 2 : 1);
}
template <int kSplit, int BN, class Params>
__device__ __forceinline__ bool split_combine(const Params &p, float (&acc)[BN / 2], uint8_t *cbuf,
                                              uint64_t *bar, uint32_t slice, uint32_t it,
                                              int wg_thread, uint64_t timeout_ns) {
  constexpr int kChunks = BN / 8; // 16-byte chunks of accumulators per thread
  constexpr int kRounds = split_rounds<kSplit>();
  uint64_t *free_bar = &bar[kRounds];
  using WaitT = typename Params::WaitType;
  const uint32_t base = ptx::smem_u32(cbuf) + 16u * (uint32_t)wg_thread;
#pragma unroll
  for (int r = 0; r < kRounds; r++) {
    const uint32_t half = (uint32_t)kSplit >> (r + 1);
    if (slice >= half) { // this round's sender (slices >= 2 half sent in an earlier round)
      if (!ptx::mbar_wait_for<true>(free_bar, (it & 1) ^ 1, timeout_ns))
        WaitT::mbar_stuck(p.wait, kStuckSplitFree * 16 + r);
      float4 *mine = reinterpret_cast<float4 *>(cbuf);
#pragma unroll
      for (int j = 0; j < kChunks; j++)
        mine[j * 128 + wg_thread] =
            make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
      ptx::mbar_arrive_release_cluster(ptx::mapa_shared(ptx::smem_u32(&bar[r]), slice - half));
      return false;
    }
    if (!ptx::mbar_wait_for<true>(&bar[r], it & 1, timeout_ns))
      WaitT::mbar_stuck(p.wait, kStuckSplitFull * 16 + r);
    const uint32_t remote = ptx::mapa_shared(base, slice + half);
#pragma unroll
    for (int j = 0; j < kChunks; j++) {
      const float4 v = ptx::ld_shared_cluster_f4(remote + 16u * 128u * (uint32_t)j);
      acc[4 * j] = __fadd_rn(acc[4 * j], v.x);
      acc[4 * j + 1] = __fadd_rn(acc[4 * j + 1], v.y);
      acc[4 * j + 2] = __fadd_rn(acc[4 * j + 2], v.z);
      acc[4 * j + 3] = __fadd_rn(acc[4 * j + 3], v.w);
    }
    // Every thread of the warpgroup has read the sender's buffer: it may be written again.
    ptx::named_bar_sync(kBarConsumerWg0 + (int)(threadIdx.x / 128) - 1, 128);
    if (wg_thread == 0)
      ptx::mbar_arrive_release_cluster(ptx::mapa_shared(ptx::smem_u32(free_bar), slice + half));
  }
  return true;
}

// The value slice s holds after R rounds of split_combine's tree, from the slices' partials at
// part + slice * stride: V(R, s) = V(R - 1, s) + V(R - 1, s + kSplit >> R) (the receiver's
// first), V(0, s) = partial s. Depth first, so about R values are live, not kSplit.
template <int kSplit, int R> struct WsTree {
  __device__ static __forceinline__ float4 at(const float4 *part, size_t stride, int s) {
    const float4 a = WsTree<kSplit, R - 1>::at(part, stride, s);
    const float4 b = WsTree<kSplit, R - 1>::at(part, stride, s + (kSplit >> R));
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z),
                       __fadd_rn(a.w, b.w));
  }
};
template <int kSplit> struct WsTree<kSplit, 0> {
  __device__ static __forceinline__ float4 at(const float4 *part, size_t stride, int s) {
    return __ldcg(part + (size_t)s * stride);
  }
};

// Split-K through global memory (GemmParams::split_ws): this slice's accumulators go to the
// workspace; the warpgroup's count for the tile says whether it came last, and the last sums
// all kSplit slices' partials in split_combine's tree order (round r: slice s < kSplit >> (r + 1)
// takes s + (kSplit >> (r + 1))), so its bits are the cluster tree's. Returns true where this
// warpgroup stores the tile. No wait: nobody waits for anybody.
template <int kSplit, int BN, class Params>
__device__ __forceinline__ bool split_ws_combine(const Params &p, float (&acc)[BN / 2],
                                                 int32_t tile, uint32_t slice, int cwg,
                                                 int wg_thread, volatile int32_t *last) {
  constexpr int kChunks = BN / 8; // 16-byte chunks of accumulators per thread
  constexpr size_t kRegion = (size_t)kChunks * 128;
  float4 *ws = reinterpret_cast<float4 *>(p.split_ws);
  float4 *mine = ws + ((size_t)tile * kSplit * 2 + (size_t)slice * 2 + (size_t)cwg) * kRegion;
#pragma unroll
  for (int j = 0; j < kChunks; j++)
    __stcg(&mine[j * 128 + wg_thread],
           make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]));
  __threadfence(); // this thread's partial before the count that publishes it
  ptx::named_bar_sync(kBarConsumerWg0 + cwg, 128);
  if (wg_thread == 0) {
    uint32_t *count = &p.split_cnt[tile * 2 + cwg];
    const bool is_last = atomicAdd(count, 1u) == (uint32_t)(kSplit - 1);
    if (is_last) {
      atomicExch(count, 0u); // for the next call (stream-ordered after this kernel)
      __threadfence();       // every slice's partial before this warpgroup's reads
    }
    *last = is_last;
  }
  ptx::named_bar_sync(kBarConsumerWg0 + cwg, 128);
  if (!*last)
    return false;
  const float4 *base = ws + ((size_t)tile * kSplit * 2 + (size_t)cwg) * kRegion;
#pragma unroll
  for (int j = 0; j < kChunks; j++) { // unrolled: acc stays in registers
    const float4 v =
        WsTree<kSplit, split_rounds<kSplit>()>::at(base + j * 128 + wg_thread, 2 * kRegion, 0);
    acc[4 * j] = v.x, acc[4 * j + 1] = v.y, acc[4 * j + 2] = v.z, acc[4 * j + 3] = v.w;
  }
  return true;
}

} // namespace detail

// Runs the GEMM on this CTA until the tiles run out. All 384 threads call it; `smem_raw` is the
// dynamic shared memory (SmemLayout::kDynamicBytes). cta/ctas: this CTA's index among the CTAs
// running the static schedule and their number (ignored with kDynamic).
// kSplitWs: kSplit > 1 slices summed through global memory (GemmParams::split_ws) instead of a
// cluster's shared memory: no cluster, CTA i runs slice i % kSplit.
namespace detail {
// The producer thread's pieces both loops share (gemm_cta_loop, gemm_cta_loop_pp).
// Its start: the operand maps and the epilogue's into the TMA unit's cache.
template <class Fns, class GP> __device__ __forceinline__ void producer_prefetch(const GP &p) {
  ptx::tma_prefetch_map(&p.a_map);
  ptx::tma_prefetch_map(&p.b_map);
  Fns::prefetch(p.epi);
}
// Its next tile: t from the queue (kDynamic) or as it stands (static); false past the last.
template <bool kDynamic, class GP>
__device__ __forceinline__ bool producer_claim(const GP &p, int32_t &t) {
  if constexpr (kDynamic)
    t = (int32_t)atomicAdd(&p.queue->next, 1u);
  return t < p.order.num_tiles;
}
// Tile t's coordinates (a pair's CTA `rank` takes row block 2 mb + rank), its readiness wait
// (Wait::before_tile) and where its A rows come from (Wait::a_source).
template <int kTileM, bool kPair, class GP>
__device__ __forceinline__ void producer_tile(const GP &p, int32_t t, uint32_t rank, int32_t &mb,
                                              int32_t &nb, const CUtensorMap *&a_map,
                                              int32_t &a_row) {
  tile_coords(p.order, t, mb, nb);
  if constexpr (kPair)
    mb = 2 * mb + (int32_t)rank;
  GP::WaitType::before_tile(p.wait, mb, nb);
  a_map = &p.a_map;
  a_row = mb * kTileM;
  GP::WaitType::a_source(p.wait, mb, a_map, a_row);
}
// The producer's stage addresses. kLean (the plain GEMM kernels): 32-bit shared-window
// addresses from a base it holds in a register. From generic pointers every stage re-derived
// the window's base (two S2UR among about 75 instructions a stage at swap-AB's 64-row tiles,
// where ncu found the producer issuing all the time and never waiting for a free stage;
// docs/PERF.md, thirty-fourth session). The fused kernels' producers, at 40 registers with more
// to hold, spill that base, so they keep the generic pointers.
template <bool kLean> struct StageAt {
  uint8_t *smem;
  uint32_t base; // kLean: smem's shared-window address
  __device__ __forceinline__ explicit StageAt(uint8_t *s)
      : smem(s), base(kLean ? ptx::opaque(ptx::smem_u32(s)) : 0u) {}
  __device__ __forceinline__ auto operator()(int off) const {
    if constexpr (kLean)
      return base + (uint32_t)off;
    else
      return smem + off;
  }
};
__device__ __forceinline__ uint32_t bar_at(uint32_t a) { return a; }
__device__ __forceinline__ uint64_t *bar_at(uint8_t *a) { return reinterpret_cast<uint64_t *>(a); }
__device__ __forceinline__ void store_slot(uint32_t a, int32_t t) { ptx::st_shared_s32(a, t); }
__device__ __forceinline__ void store_slot(uint8_t *a, int32_t t) {
  *reinterpret_cast<volatile int32_t *>(a) = t;
}
// One stage's loads of a single CTA: A's box at (kb, a_row) and B's at (kb, b_row), `bytes`
// expected on `full` (StageAt's addresses).
template <class GP, class Addr>
__device__ __forceinline__ void load_stage(const GP &p, Addr full, Addr sa, Addr sb, uint32_t bytes,
                                           const CUtensorMap *a_map, int32_t kb, int32_t a_row,
                                           int32_t b_row) {
  ptx::mbar_arrive_expect_tx(bar_at(full), bytes);
  ptx::tma_load_2d(sa, a_map, bar_at(full), kb * kBlockK, a_row);
  ptx::tma_load_2d(sb, &p.b_map, bar_at(full), kb * kBlockK, b_row);
}
// kRestoreRegs: back to the entry split (168 registers a thread) for code after the loop.
// The producer warpgroup increases only once both consumer warpgroups have returned theirs (the
// barrier is also its explicit sync between its two setmaxnreg, which PTX requires). Until the
// fifth session its idle warps increased right after their decrease and raced the consumers'
// increase for the CTA's register pool: a warp that won left the consumers blocked in
// setmaxnreg for good while it waited at the next CTA barrier, an unbounded hang, the likely
// cause of the intermittent tw_gemm_rs / tw_gemm_ar stalls (docs/PERF.md).
__device__ __forceinline__ void restore_regs_producer() {
  ptx::named_bar_sync(kBarRegs, kThreads);
  ptx::setmaxnreg_inc<168>();
}
// A consumer warpgroup: PTX wants its warps synchronized between two setmaxnreg (a CTA that
// ran no tile has met no other barrier since its increase); then the registers are returned
// and the producers may take them.
__device__ __forceinline__ void restore_regs_consumer(int cwg) {
  ptx::named_bar_sync(kBarConsumerWg0 + cwg, 128);
  ptx::setmaxnreg_dec<168>();
  ptx::named_bar_sync(kBarRegs, kThreads);
}
} // namespace detail

template <int Stages, int EpiBytes, class Epi, class Wait, bool kDynamic, int kCluster = 1,
          int BN = kBlockN, bool kRestoreRegs = false, int kSplit = 1, int kTileM = kBlockM,
          bool kSplitWs = false, bool kLeanProducer = false>
__device__ __forceinline__ void gemm_cta_loop(const GemmParams<Epi, Wait> &p, uint8_t *smem_raw,
                                              int32_t cta, int32_t ctas) {
  using L = SmemLayout<Stages, EpiBytes, BN, kTileM>;
  constexpr int kTileA = L::kTileA;
  constexpr int kTileB = L::kTileB;
  // 64-row tiles (swap-AB at decode shapes where 128-row tiles would leave most SMs idle): the
  // tile is 64 A rows x 2 x BN B rows (kOneWg below says which warpgroups multiply it).
  constexpr bool kHalfM = kTileM == 64;
  // 64-row tiles: one consumer warpgroup multiplies the tile's 64 A rows by all 2 x BN B rows
  // (wgmma m64n(2 BN)k16) and the other idles; the tensor pipe runs one warpgroup's n64 chain at
  // its full rate and two warpgroups' n32 at two thirds of it (scripts/probes/
  // probe_wgmma_chain.cu: a stage of 4 k steps 128 against 192 cycles), which held these decode
  // tiles. The workspace's split-K slices (kSplitWs) keep two consumers: their layout is per
  // warpgroup. The same products in the same k order: the same bits.
  constexpr bool kOneWg = kHalfM && !(kSplitWs && kSplit > 1);
  constexpr int CBN = kOneWg ? 2 * BN : BN;                    // a consumer's wgmma N
  constexpr int kCEpiBytes = kOneWg ? 2 * EpiBytes : EpiBytes; // and its epilogue buffer
  constexpr bool kPair = kCluster == 2;
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs along M");
  static_assert(!(kPair && kDynamic), "the tile queue serves single CTAs");
  // Split-K (kSplit > 1): a cluster of kSplit CTAs runs each tile, CTA s over K blocks
  // [s * k_blocks / kSplit, (s + 1) * k_blocks / kSplit); their accumulators are summed into
  // CTA 0's as a binary tree through distributed shared memory (detail::split_combine: fp32, a
  // fixed order, the same bits on every run), then CTA 0 stores the tile.
  // kSplitWs: the same slices, summed through global memory by the last to finish
  // (detail::split_ws_combine: the same tree, so the same bits), with no cluster.
  constexpr bool kWs = kSplitWs && kSplit > 1;
  constexpr bool kSplitK = kSplit > 1 && !kSplitWs; // the cluster's tree
  static_assert(kSplit == 1 || kSplit == 2 || kSplit == 4 || kSplit == 8, "1, 2, 4 or 8 slices");
  static_assert(!(kSplitK || kWs) || (kCluster == 1 && !kDynamic && !Epi::kSignal &&
                                      !OwnerEpiOf<Epi>::value && !WriteThroughOf<Wait>::value),
                "split-K serves the plain GEMM on a static schedule");
  static_assert(!kSplitK || EpiBytes >= 128 * (BN / 2) * 4,
                "a consumer warpgroup's accumulators fit its epilogue buffer");
  // Swap-AB's transposed store serves the plain GEMM (tw_gemm, and the unfused pipeline's
  // released wait); split_scatter writes C untransposed, so the host never sets it there.
  constexpr bool kTransposedEpi = TransposedOf<Epi>::value;
  static_assert(!kTransposedEpi || (!Epi::kSignal && !OwnerEpiOf<Epi>::value && !kPair),
                "the transposed epilogue serves the plain GEMM");
  static_assert(!kHalfM || (kTransposedEpi && !kSplitK && !kDynamic),
                "64-row tiles serve swap-AB's unsplit static schedule");
  // With a CTA pair, `p.order` counts pairs of row blocks; this CTA takes row block
  // 2 * pair + rank and loads half of the shared B box, multicast to both CTAs.
  const uint32_t rank = kPair ? ptx::cluster_ctarank() : 0;
  uint8_t *smem = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                              ~uintptr_t(1023));
  uint64_t *full = reinterpret_cast<uint64_t *>(smem + L::kFull);
  uint64_t *empty = reinterpret_cast<uint64_t *>(smem + L::kEmpty);
  volatile int32_t *slot = reinterpret_cast<volatile int32_t *>(smem + L::kSlot);
  constexpr bool kSigWarp = SignalWarpOf<Epi>::value;
  static_assert(!kSigWarp || Epi::kSignal, "a signal warp serves kSignal epilogues");
  constexpr bool kWT = WriteThroughOf<Wait>::value;
  static_assert(!(kWT && kPair), "the write-through warp serves single CTAs");
  uint64_t *sig_full = reinterpret_cast<uint64_t *>(smem + L::kSigFull);
  uint64_t *sig_empty = reinterpret_cast<uint64_t *>(smem + L::kSigEmpty);
  int32_t *sig_slot = reinterpret_cast<int32_t *>(smem + L::kSigSlot);
  const int wg = threadIdx.x / 128;
  const int wg_thread = threadIdx.x % 128;
  const int32_t k_blocks = p.k_blocks;
  // This CTA's K blocks (all of them without split-K; the host gives every slice one or more).
  const uint32_t slice = kSplitK ? ptx::cluster_ctarank() : (kWs ? blockIdx.x % kSplit : 0);
  const int32_t kb0 = (int32_t)((int64_t)slice * k_blocks / kSplit);
  const int32_t kb1 = (int32_t)((int64_t)(slice + 1) * k_blocks / kSplit);
  // split-K: per consumer warpgroup, [r] "round r's sender wrote its accumulators" (its 128
  // threads arrive) for each round of detail::split_combine, then "this slice's accumulators
  // were read" (one arrival).
  constexpr int kSplitRounds = detail::split_rounds<kSplit>();
  __shared__ uint64_t split_bar[2][kSplitRounds + 1];
  // split_scatter: per consumer warpgroup, [0] "every other slice wrote its accumulators"
  // ((kSplit - 1) x 128 arrivals) and [1] "every other slice read this one's" (kSplit - 1)
  __shared__ uint64_t scatter_bar[2][2];
  const uint64_t timeout_ns = detail::mbar_timeout(p);
  // Every mbarrier wait is bounded; an expired one is an internal stall: reported, never a hang.
  // (bar: a generic pointer or a shared-window address)
  auto wait = [&](auto bar, uint32_t parity, int32_t code) {
    if (!ptx::mbar_wait_for(bar, parity, timeout_ns))
      Wait::mbar_stuck(p.wait, code);
  };
  // A stage reader's next tile: waits for the stage's loads, then its slot names the tile
  // (false: the end marker).
  auto next_tile = [&](int stage, uint32_t phase, int32_t &mb, int32_t &nb) {
    wait(&full[stage], phase, kStuckConsumerFull * 16 + stage);
    const int32_t t = slot[stage];
    if (t < 0)
      return false;
    tile_coords(p.order, t, mb, nb);
    if constexpr (kPair)
      mb = 2 * mb + (int32_t)rank;
    return true;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; s++) {
      ptx::mbar_init(&full[s], 1);
      // One arrival per consumer warp of the cluster (and the write-through warp's).
      ptx::mbar_init(&empty[s], (kOneWg ? 4 : 8) * kCluster + (kWT ? 1 : 0));
    }
    if constexpr (kSigWarp)
      for (int s = 0; s < kSigDepth; s++) {
        ptx::mbar_init(&sig_full[s], 1);
        ptx::mbar_init(&sig_empty[s], 1);
      }
    if constexpr (kSplitK)
      for (int w = 0; w < 2; w++) {
        for (int r = 0; r < kSplitRounds; r++)
          ptx::mbar_init(&split_bar[w][r], 128);
        ptx::mbar_init(&split_bar[w][kSplitRounds], 1);
        ptx::mbar_init(&scatter_bar[w][0], (kSplit - 1) * 128);
        ptx::mbar_init(&scatter_bar[w][1], kSplit - 1);
      }
    ptx::mbar_init_fence();
  }
  if constexpr (kPair || kSplitK)
    ptx::cluster_sync(); // the peers' barriers exist before anything reaches them
  else
    __syncthreads();

  if (wg == 0) {
    // ---------------- producer ----------------
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (wg_thread == 0) {
      detail::producer_prefetch<Epi>(p);
      if (p.after_grid) {
        // The operand the previous grid does not write streams into L2 while it runs; only the
        // loads of the one it writes wait for its end (nothing else here reads its output).
        if (!kDynamic && !kPair && cta < p.order.num_tiles) {
          int32_t mb, nb;
          tile_coords(p.order, cta, mb, nb);
          const int32_t kb_end = kb1 - kb0 > kAfterGridPrefetch ? kb0 + kAfterGridPrefetch : kb1;
          for (int32_t kb = kb0; kb < kb_end; kb++) {
            if (p.after_grid == kAfterGridA)
              ptx::tma_prefetch_2d(&p.b_map, kb * kBlockK, nb * BN * (kHalfM ? 2 : 1));
            else
              ptx::tma_prefetch_2d(&p.a_map, kb * kBlockK, mb * kTileM);
          }
        }
        ptx::griddep_wait();
      }
      int stage = 0;
      uint32_t phase = 0;
      int32_t t = cta;
      const detail::StageAt<kLeanProducer> at(smem);
      while (detail::producer_claim<kDynamic>(p, t)) {
        int32_t mb, nb, a_row;
        const CUtensorMap *a_map;
        detail::producer_tile<kTileM, kPair>(p, t, rank, mb, nb, a_map, a_row);
        for (int32_t kb = kb0; kb < kb1; kb++) {
          wait(detail::bar_at(at(L::kEmpty + stage * 8)), phase ^ 1,
               kStuckProducerEmpty * 16 + stage);
          if (kb == kb0)
            detail::store_slot(at(L::kSlot + stage * 4), t);
          // tests (TW_FAULT_STALL_TILE): this stage's loads never come, so the waits for it
          // expire and mbar_stuck reports them
          const bool withheld = kb == kb0 && t + 1 == p.fault_stall;
          if (withheld) {
          } else if constexpr (kPair) {
            ptx::mbar_arrive_expect_tx(&full[stage], kTileA + kTileB);
            ptx::tma_load_2d(smem + L::kA + stage * kTileA, a_map, &full[stage], kb * kBlockK,
                             a_row);
            ptx::tma_load_2d_multicast(smem + L::kB + stage * kTileB + rank * (kTileB / 2),
                                       &p.b_map, &full[stage], kb * kBlockK,
                                       nb * BN + (int32_t)rank * (BN / 2), 0x3);
          } else {
            detail::load_stage(p, at(L::kFull + stage * 8), at(L::kA + stage * kTileA),
                               at(L::kB + stage * kTileB), kTileA + kTileB, a_map, kb, a_row,
                               nb * BN * (kHalfM ? 2 : 1));
          }
          if (++stage == Stages) {
            stage = 0;
            phase ^= 1;
          }
        }
        if constexpr (!kDynamic)
          t += ctas;
      }
      // End marker: a stage with no data whose slot says -1.
      wait(&empty[stage], phase ^ 1, kStuckProducerEmpty * 16 + stage);
      slot[stage] = -1;
      ptx::mbar_arrive(&full[stage]);
      if constexpr (kDynamic)
        queue_leave(p.queue, p.participants);
    }
    if constexpr (kSigWarp) {
      if (wg_thread == 32) { // the signal warp: each tile the consumers post, until mb < 0
        int i = 0;
        uint32_t phase = 0;
        for (;;) {
          wait(&sig_full[i], phase, kStuckSignalFull * 16 + i);
          const int32_t mb = sig_slot[2 * i], nb = sig_slot[2 * i + 1];
          if (mb < 0)
            break;
          Epi::signal(p.epi, mb, nb);
          ptx::mbar_arrive(&sig_empty[i]);
          if (++i == kSigDepth) {
            i = 0;
            phase ^= 1;
          }
        }
      }
    }
    if constexpr (kWT) {
      if (wg_thread == 64) { // the write-through warp: every stage, as a consumer warp would
        int stage = 0;
        uint32_t phase = 0;
        int32_t mb, nb;
        while (next_tile(stage, phase, mb, nb)) {
          const int wt = Wait::a_write_through(p.wait, mb, nb);
          int prev_stage = -1; // a stage whose store may still be reading it
          for (int32_t kb = 0; kb < k_blocks; kb++) {
            if (kb > 0)
              wait(&full[stage], phase, kStuckConsumerFull * 16 + stage);
            if (wt == 1 || (wt == 2 && kb % p.order.n_blocks == nb)) {
              // two stores in flight: the previous one has read its stage out
              ptx::tma_store_2d(&p.a_map, smem + L::kA + stage * kTileA, kb * kBlockK, mb * kTileM);
              ptx::bulk_commit();
              if (prev_stage >= 0) {
                ptx::bulk_wait_read<1>();
                ptx::mbar_arrive(&empty[prev_stage]);
              }
              prev_stage = stage;
            } else {
              if (prev_stage >= 0) { // never hold a stage past the next one
                ptx::bulk_wait_read<0>();
                ptx::mbar_arrive(&empty[prev_stage]);
                prev_stage = -1;
              }
              ptx::mbar_arrive(&empty[stage]);
            }
            if (++stage == Stages) {
              stage = 0;
              phase ^= 1;
            }
          }
          if (prev_stage >= 0) {
            ptx::bulk_wait_read<0>();
            ptx::mbar_arrive(&empty[prev_stage]);
          }
        }
        ptx::bulk_wait<0>(); // the stores are performed before the CTA leaves
      }
    }
    if constexpr (kRestoreRegs) {
      detail::restore_regs_producer();
    }
  } else {
    // ---------------- consumers ----------------
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int cwg = wg - 1;
    const int lane = wg_thread & 31;
    // Both CTAs of a pair write into this stage (their halves of B): both producers wait for it.
    auto release = [&](int s) {
      ptx::mbar_arrive(&empty[s]);
      if constexpr (kPair)
        ptx::mbar_arrive_cluster(&empty[s], rank ^ 1);
    };
    if (!(kOneWg && cwg == 1)) {
      uint8_t *cbuf = smem + L::kC + cwg * EpiBytes;
      float acc[CBN / 2];
#pragma unroll
      for (int i = 0; i < CBN / 2; i++)
        acc[i] = 0.f;
      int stage = 0;
      uint32_t phase = 0;
      int32_t sig_mb = -1, sig_nb = 0; // kSignal: the tile whose signal is still owed
      constexpr int kPasses = detail::epi_passes<kCEpiBytes, CBN, typename Epi::Out>();
      detail::SigRing ring{sig_full, sig_empty, sig_slot, 0, 0};
      int32_t mb, nb;
      uint32_t split_it = 0; // split-K: tiles this warpgroup has passed on or gathered
      // The stage-0 descriptors' low words; a stage adds its offset (wgmma_desc_lo_sw128).
      const uint32_t lo_a0 = ptx::wgmma_desc_lo_sw128(
          ptx::smem_u32(smem + L::kA + (kHalfM ? 0 : cwg * kBoxRows * 128)));
      const uint32_t lo_b0 =
          ptx::wgmma_desc_lo_sw128(ptx::smem_u32(smem + L::kB + (kHalfM ? cwg * BN * 128 : 0)));
      while (next_tile(stage, phase, mb, nb)) {
        int prev_stage = stage;
        for (int32_t kb = 0; kb < kb1 - kb0; kb++) {
          if (kb > 0)
            wait(&full[stage], phase, kStuckConsumerFull * 16 + stage);
          const uint32_t la = lo_a0 + (uint32_t)(stage * (kTileA >> 4));
          const uint32_t lb = lo_b0 + (uint32_t)(stage * (kTileB >> 4));
          ptx::wgmma_fence();
#pragma unroll
          for (int k = 0; k < kBlockK / 16; k++)
            ptx::wgmma_bf16<CBN>(acc, ptx::wgmma_desc_from_lo(la + 2 * k),
                                 ptx::wgmma_desc_from_lo(lb + 2 * k), (kb | k) != 0);
          ptx::wgmma_commit();
          ptx::wgmma_wait<1>(); // the previous stage's wgmmas are done: release it
          if (kb > 0 && lane == 0)
            release(prev_stage);
          prev_stage = stage;
          if (++stage == Stages) {
            stage = 0;
            phase ^= 1;
          }
        }
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < CBN / 2; i++)
          ptx::reg_fence(acc[i]);
        if (lane == 0)
          release(prev_stage);
        if constexpr (kWs) {
          // As below; with 64-row tiles both warpgroups share the tile's rows.
          if (p.rows > 0 && (int64_t)mb * kTileM + (kHalfM ? 0 : cwg * (kBlockM / 2)) >= p.rows)
            continue;
          __shared__ int32_t ws_last[2];
          if (!detail::split_ws_combine<kSplit, BN>(p, acc, mb * p.order.n_blocks + nb, slice, cwg,
                                                    wg_thread, &ws_last[cwg]))
            continue; // another slice stores the tile
        }
        if constexpr (kSplitK) {
          // A warpgroup whose 64 rows of the tile all lie past the product's (decode: M=64) has
          // nothing to sum or store; every slice skips it alike (the same tile, the same rows).
          if (p.rows > 0 && (int64_t)mb * kBlockM + cwg * (kBlockM / 2) >= p.rows)
            continue;
          if constexpr (!kTransposedEpi) {
            if (p.split_scatter) {
              detail::split_scatter<kSplit, BN, typename Epi::Out>(p, acc, cbuf, scatter_bar[cwg],
                                                                   slice, split_it++, wg_thread,
                                                                   cwg, mb, nb, timeout_ns);
              continue; // the tile's columns are stored, by every slice its band
            }
          }
          if (!detail::split_combine<kSplit, BN>(p, acc, cbuf, split_bar[cwg], slice, split_it++,
                                                 wg_thread, timeout_ns))
            continue; // a slice: its accumulators are in another's now
        }
        if constexpr (OwnerEpiOf<Epi>::value) {
          if (Epi::owner_tile(p, mb)) {
            if (sig_mb >= 0) { // the previous tile's signal, its stores performed
              detail::signal_after_stores<0, Epi>(p, cwg, wg_thread, sig_mb, sig_nb, ring);
              sig_mb = -1;
            }
            Epi::combine(p, acc, mb, nb, cwg, wg_thread);
            // Signalled like any tile once its stores are performed, where the epilogue says so.
            // The tile's coordinates wait in shared memory, not in registers, across the
            // epilogue (one more live register spilled the bf16 kernels): thread 0 writes them
            // after combine's barriers (every thread has read the previous own tile's) and the
            // epilogue's first warpgroup barrier orders them before every thread's read.
            __shared__ int32_t own_sig[2][2];
            volatile int32_t *sig = own_sig[cwg];
            if (wg_thread == 0)
              sig[0] = Epi::owner_signals(p) ? mb : -1, sig[1] = nb;
            detail::epilogue<EpiBytes, BN, typename Epi::OwnerOut>(p, acc, cbuf, cwg, wg_thread, mb,
                                                                   nb);
            sig_mb = sig[0], sig_nb = sig[1];
            continue;
          }
        }
        detail::epilogue_any<kCEpiBytes, CBN, Epi, kTileM, kOneWg ? 1 : 2>(p, acc, cbuf, cwg,
                                                                           wg_thread, mb, nb);
        if constexpr (Epi::kSignal) { // the previous tile's signal, this tile's in flight
          if (sig_mb >= 0)
            detail::signal_after_stores<kPasses, Epi>(p, cwg, wg_thread, sig_mb, sig_nb, ring);
          sig_mb = mb, sig_nb = nb;
        }
      }
      if constexpr (Epi::kSignal)
        if (sig_mb >= 0)
          detail::signal_after_stores<0, Epi>(p, cwg, wg_thread, sig_mb, sig_nb, ring);
      if constexpr (kSigWarp)
        if (cwg == 0 && wg_thread == Epi::signal_thread(p.epi))
          if (!ring.post(-1, 0, timeout_ns)) // the signal warp may leave
            Wait::mbar_stuck(p.wait, kStuckSignalPost * 16 + ring.i);
      if (wg_thread == 0)
        ptx::bulk_wait<0>(); // shared memory must outlive the last stores
    }                        // !(kOneWg && cwg == 1)
    if constexpr (kRestoreRegs)
      detail::restore_regs_consumer(cwg);
  }
  // No CTA of a pair leaves while its peer may still arrive on its barriers (split-K: nor
  // while the leader may still read its accumulators).
  if constexpr (kPair || kSplitK)
    ptx::cluster_sync();
}

// kCluster == 2: launch with cluster dimension (2, 1, 1) and an even grid; kSplit > 1: cluster
// dimension (kSplit, 1, 1) and a grid of whole clusters.
template <int Stages, int EpiBytes, class Epi, class Wait, bool kDynamic, int kCluster = 1,
          int BN = kBlockN, int kSplit = 1, int kTileM = kBlockM, bool kSplitWs = false>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_sm90_kernel(const __grid_constant__ GemmParams<Epi, Wait> p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // A dependent launched with programmatic serialization (the decode GEMM+RS pipeline's reduce
  // kernel) may take idle SMs now; it waits for this grid's completion before it reads C.
  if (threadIdx.x == 0)
    ptx::griddep_launch_dependents();
  gemm_cta_loop<Stages, EpiBytes, Epi, Wait, kDynamic, kCluster, BN, false, kSplit, kTileM,
                kSplitWs, true>(p, smem_raw, blockIdx.x / (kCluster * kSplit),
                                gridDim.x / (kCluster * kSplit));
}

} // namespace gemm
} // namespace tw
