/* The GEMM engine's types (contract in gemm_sm90.cuh): tile shape constants, tile orders, the
 * tile queue, GemmParams, the stock hooks (NoWait, EpiTmaStore and kin) and the shared-memory
 * layout. */
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

// A grouped GEMM's order (tw_grouped_gemm, tw_moe_dispatch_gemm): tile t of a row-major order
// whose row block lies in one group's row blocks [first, last), moved to the default order's L2
// groups of group_m row blocks inside that group (column-major inside one), so the group's
// weights stream through L2 once per group_m row blocks; a permutation of the group's tiles.
__host__ __device__ __forceinline__ int32_t group_tile_index(int32_t t, int32_t n_blocks,
                                                             int32_t first, int32_t last,
                                                             int32_t group_m) {
  const int32_t mb0 = t / n_blocks;
  if (mb0 < first || mb0 >= last)
    return t;
  const int32_t u = t - first * n_blocks, per = group_m * n_blocks;
  const int32_t band = u / per, rows = min(group_m, last - first - band * group_m);
  const int32_t r = u - band * per;
  return (first + band * group_m + r % rows) * n_blocks + r / rows;
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
  // (q) kDynamic only: this CTA claims no tile (it runs the loop's start and end only, and
  // still leaves the queue once), so a fused op's other role can start on it beside the GEMM
  // with no code of that role before the loop.
  template <class P> __device__ static bool takes_no_tile(const P &) { return false; }
  // (a') Where the tile's A rows come from: by default p.a_map at row mb * kBlockM. A hook may
  // point the loads at another tensor map (in its Params) and row, e.g. a local copy of rows
  // that need no wait. Custom Wait policies inherit this default from NoWait.
  template <class P>
  __device__ static void a_source(const P &, int32_t, const CUtensorMap *&, int32_t &) {}
  // (a''') The first of the tile's B rows, given as n_block * (the rows of a B box): a grouped
  // GEMM moves it to the weights of the row block's group (expert).
  template <class P> __device__ static void b_source(const P &, int32_t, int32_t &) {}
  // (t) The tiles to run, given TileOrder::num_tiles (read on every claim): a grouped GEMM
  // whose live row blocks are known only on the device runs a prefix of a row-major order.
  template <class P> __device__ static int32_t tile_count(const P &, int32_t num_tiles) {
    return num_tiles;
  }
  // (t') The order's index of the t-th tile claimed (gemm_cta_loop's producer; the consumers
  // read it from the stage's slot): a permutation of the claimed prefix.
  template <class P> __device__ static int32_t tile_index(const P &, int32_t t) { return t; }
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
// Wait::kKRange (optional, false if absent): hook (k) of gemm_cta_loop, each tile's own range of
// K blocks (Wait::k_range). Without it the loop's code is as if the hook did not exist.
TW_OPTIONAL_FLAG(KRangeOf, kKRange)

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

} // namespace gemm
} // namespace tw
