/*
 * Hopper (sm_90a) bf16 GEMM mainloop: C[M,N] = A[M,K] * B[N,K]^T, fp32 accumulate.
 *
 * Size: gemm_cta_loop is one function of about 380 lines on purpose. Its roles (the producer,
 * the signal and write-through warps, the consumers) share one set of mbarriers, one stage ring
 * and one register budget split by setmaxnreg; keeping them in one body keeps the pipeline's
 * protocol (who waits and arrives on which barrier, in which phase) readable in one place, and
 * the pieces that do not touch that protocol are already functions of their own (detail::).
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
 *          (a''') `static void b_source(const Params&, int m_block, int &row)`: may move the
 *          tile's first B row (n_block * BN) to another part of p.b_map, e.g. the weights of
 *          the row block's expert in a grouped GEMM. (t) `static int tile_count(const Params&,
 *          int num_tiles)`: the tiles this call runs, a prefix of the order, e.g. the live row
 *          blocks a grouped GEMM finds on the device. (t') `static int tile_index(const
 *          Params&, int t)`: the order's index of the t-th claimed tile (gemm_cta_loop only;
 *          the consumers get it through the stage's slot), e.g. a grouped GEMM's L2 groups
 *          inside each group of rows over a row-major order. (q) kDynamic: `static bool
 *          takes_no_tile(const Params&)`: this CTA runs the loop with no tile (another role
 *          of a fused kernel starts on it).
 *          (k) With `static constexpr bool kKRange = true`, `static void k_range(const Params&,
 *          int m_block, int n_block, int &kb0, int &kb1)` narrows or moves the tile's K blocks
 *          (given as all of them, [0, k_blocks)) to [kb0, kb1), e.g. a K-grouped GEMM (a weight
 *          gradient) whose tile sums only its group's rows. The producer and the consumers both
 *          call it for every tile and must get the same range; the consumers' first wgmma of the
 *          range starts from zero (scale-d 0), as at kb 0. An empty range runs nothing for the
 *          tile: the producer hands it to no consumer, so nothing is stored for it. Unsplit,
 *          single CTAs, no write-through warp (static_assert); not in gemm_cta_loop_pp.
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
 * shared memory); tests/gpu/test_gemm_hooks.cu is a complete example, and
 * src/ops/gemm/gemm_sm90.cu shows the tensor maps (A box {64, 128}, B box {64, BN}, C box
 * {128 / sizeof(Out), 64}, all 128B-swizzled). The plain GEMM runs Stages 3, EpiBytes 32768,
 * BN 256 (its figures against cuBLAS: docs/PERF.md).
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
#include "gemm/gemm_epilogue.cuh"
#include "gemm/gemm_params.cuh"
#include "gemm/gemm_split.cuh"

namespace tw {
namespace gemm {

namespace detail {
// The producer thread's pieces both loops share (gemm_cta_loop, gemm_cta_loop_pp).
// Its start: the operand maps and the epilogue's into the TMA unit's cache.
template <class Fns, class GP> __device__ __forceinline__ void producer_prefetch(const GP &p) {
  ptx::tma_prefetch_map(&p.a_map);
  ptx::tma_prefetch_map(&p.b_map);
  Fns::prefetch(p.epi);
}
// Its next tile: t from the queue (kDynamic) or as it stands (static); false past the last
// (Wait::tile_count), or at once where Wait::takes_no_tile.
template <bool kDynamic, class GP>
__device__ __forceinline__ bool producer_claim(const GP &p, int32_t &t) {
  if constexpr (kDynamic) {
    if (GP::WaitType::takes_no_tile(p.wait))
      return false;
    t = (int32_t)atomicAdd(&p.queue->next, 1u);
  }
  return t < GP::WaitType::tile_count(p.wait, p.order.num_tiles);
}
// Tile t's coordinates (a pair's CTA `rank` takes row block 2 mb + rank), its readiness wait
// (Wait::before_tile), where its A rows come from (Wait::a_source) and the first of its B rows
// (b_rows a column block, moved by Wait::b_source).
template <int kTileM, bool kPair, class GP>
__device__ __forceinline__ void producer_tile(const GP &p, int32_t t, uint32_t rank, int32_t &mb,
                                              int32_t &nb, const CUtensorMap *&a_map,
                                              int32_t &a_row, int32_t b_rows, int32_t &b_row) {
  tile_coords(p.order, t, mb, nb);
  if constexpr (kPair)
    mb = 2 * mb + (int32_t)rank;
  GP::WaitType::before_tile(p.wait, mb, nb);
  a_map = &p.a_map;
  a_row = mb * kTileM;
  GP::WaitType::a_source(p.wait, mb, a_map, a_row);
  b_row = nb * b_rows;
  GP::WaitType::b_source(p.wait, mb, b_row);
}
// The producer's stage addresses. kLean (the plain GEMM kernels): 32-bit shared-window
// addresses from a base it holds in a register. From generic pointers every stage re-derived
// the window's base (two S2UR among about 75 instructions a stage at swap-AB's 64-row tiles,
// where the producer issues all the time and never waits for a free stage, so its instruction
// count bounds the tile). The fused kernels' producers, at 40 registers with more
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
// barrier is also its explicit sync between its two setmaxnreg, which PTX requires). Idle
// producer warps that increased right after their decrease would race the consumers' increase
// for the CTA's register pool: a warp that won would leave the consumers blocked in setmaxnreg
// for good while it waited at the next CTA barrier, an unbounded hang.
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

// Runs the GEMM on this CTA until the tiles run out. All 384 threads call it; `smem_raw` is the
// dynamic shared memory (SmemLayout::kDynamicBytes). cta/ctas: this CTA's index among the CTAs
// running the static schedule and their number (ignored with kDynamic).
// kSplitWs: kSplit > 1 slices summed through global memory (GemmParams::split_ws) instead of a
// cluster's shared memory: no cluster, CTA i runs slice i % kSplit.
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
  // its full rate and two warpgroups' n32 at two thirds of it, which would hold these decode
  // tiles back. The workspace's split-K slices (kSplitWs) keep two consumers: their layout is per
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
  // released wait).
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
  constexpr bool kKRange = KRangeOf<Wait>::value;
  static_assert(!kKRange || (kSplit == 1 && !kPair && !kWT),
                "per-tile K ranges serve unsplit single CTAs without write-through");
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
        int32_t mb, nb, a_row, b_row;
        const CUtensorMap *a_map;
        const int32_t tile = Wait::tile_index(p.wait, t);
        detail::producer_tile<kTileM, kPair>(p, tile, rank, mb, nb, a_map, a_row,
                                             BN * (kHalfM ? 2 : 1), b_row);
        int32_t tkb0 = kb0, tkb1 = kb1; // the tile's K blocks: the CTA's, or hook (k)'s
        if constexpr (kKRange)
          Wait::k_range(p.wait, mb, nb, tkb0, tkb1);
        for (int32_t kb = tkb0; kb < tkb1; kb++) {
          wait(detail::bar_at(at(L::kEmpty + stage * 8)), phase ^ 1,
               kStuckProducerEmpty * 16 + stage);
          if (kb == tkb0)
            detail::store_slot(at(L::kSlot + stage * 4), tile);
          // tests (TW_FAULT_STALL_TILE): this stage's loads never come, so the waits for it
          // expire and mbar_stuck reports them
          const bool withheld = kb == tkb0 && t + 1 == p.fault_stall;
          if (withheld) {
          } else if constexpr (kPair) {
            ptx::mbar_arrive_expect_tx(&full[stage], kTileA + kTileB);
            ptx::tma_load_2d(smem + L::kA + stage * kTileA, a_map, &full[stage], kb * kBlockK,
                             a_row);
            ptx::tma_load_2d_multicast(smem + L::kB + stage * kTileB + rank * (kTileB / 2),
                                       &p.b_map, &full[stage], kb * kBlockK,
                                       b_row + (int32_t)rank * (BN / 2), 0x3);
          } else {
            detail::load_stage(p, at(L::kFull + stage * 8), at(L::kA + stage * kTileA),
                               at(L::kB + stage * kTileB), kTileA + kTileB, a_map, kb, a_row,
                               b_row);
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
        int32_t tkb0 = kb0, tkb1 = kb1; // the producer's range for this tile
        if constexpr (kKRange)
          Wait::k_range(p.wait, mb, nb, tkb0, tkb1);
        for (int32_t kb = 0; kb < tkb1 - tkb0; kb++) {
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
