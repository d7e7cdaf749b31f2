/*
 * Hopper (sm_90a) bf16 GEMM mainloop with ping-pong consumers: C[M,N] = A[M,K] * B[N,K]^T, fp32
 * accumulate, the same hooks' contract as gemm_sm90.cuh's cooperative loop for the subset it
 * serves (a plain or queued schedule, Wait::before_tile / a_source, Epi::issue_box, kSignal).
 *
 * Size: gemm_cta_loop_pp is one function for the reason gemm_sm90.cuh gives for its loop: the
 * roles share one barrier protocol, kept readable in one body.
 *
 * Layout: one CTA = 384 threads. WG0 is the producer, as in gemm_cta_loop: one thread claims
 * tiles (static stride or the tile queue), posts each tile's index into a ring of kPpTileRing
 * entries (full / empty mbarriers), then streams its 128x64 A and BNx64 B boxes through the
 * Stages-deep ring of stages. The tile is 128 x BN (128 or 192) and belongs to ONE consumer
 * warpgroup: tile j of the CTA (its j-th claim) goes to warpgroup j & 1, which multiplies all
 * 128 rows (two wgmma m64nBNk16 per 16-wide k step, 2 x BN / 2 fp32 accumulators per thread), then
 * stores the tile (both 64-row halves through its own epilogue buffer) while the other warpgroup
 * runs the next tile's mainloop: the epilogue leaves the tensor cores' critical path. Every tile
 * has k_blocks stages, so tile j's first stage is the ring's stage number j * k_blocks: a warpgroup
 * skips the other's stages by arithmetic, and releases only the stages it read (the empty barriers
 * count the 4 warps of one warpgroup).
 *
 * Order: a warpgroup starts tile j's mainloop only once the other has waited for every stage
 * of tile j - 1 (an mbarrier per warpgroup, one arrival per tile). This is what makes the
 * parity waits right: tile j's first stage is then at most one phase ahead of its barrier (a
 * warpgroup that jumped k_blocks stages ahead of the other's would see an older phase of the
 * same parity as its own); it also keeps the two mainloops from sharing the tensor cores.
 * End: after its last tile the producer posts two -1 entries, one for each warpgroup.
 * Signals (Epi::kSignal): a warpgroup signals its tile once its own stores are performed,
 * deferred to the end of its next tile's epilogue as in gemm_cta_loop, from the consumer
 * thread Epi::signal_thread (the warpgroup is off the tensor cores then: no signal warp).
 *
 * kRestoreRegs: every warp returns to 168 registers at the end, as in gemm_cta_loop (the fused
 * ops' work after the loop). Not served: pairs, split-K, swap-AB, the write-through warp
 * (static_assert) and owner tiles (the host never plans them here). Every output element is the
 * same k-ordered chain of m64nNk16 products as in the cooperative loop's 128-column tiles, so the
 * same bits (tests/gpu/test_gemm.cu's variants).
 */
#pragma once

#include "gemm/gemm_sm90.cuh"

namespace tw {
namespace gemm {

constexpr int kPpTileRing = 4; // tile indices the producer may post ahead of the consumers

// BN: the tile's columns, 128 or 192 (one warpgroup's 2 x 64 x BN fp32 accumulators: 128 or 192
// registers a thread).
template <int Stages, int EpiBytes, int BN> struct PpSmemLayout {
  using L = SmemLayout<Stages, EpiBytes, BN>; // stages, epilogue buffers, stage barriers
  static constexpr int kTFull = (L::kEnd + 7) / 8 * 8;
  static constexpr int kTEmpty = kTFull + kPpTileRing * 8;
  static constexpr int kOrder = kTEmpty + kPpTileRing * 8; // [wg]: the other's mainloop ended
  static constexpr int kTSlot = kOrder + 2 * 8;
  static constexpr int kEnd = kTSlot + kPpTileRing * 4;
  static constexpr int kDynamicBytes = kEnd + 1024; // slack to align the base to 1024
};

namespace detail {
// kSignal, ping-pong: the warpgroup's tile (mb, nb) once its own stores of it are performed
// (`Pending` newer groups of this thread may still be in flight).
template <int Pending, class Epi, class Params>
__device__ __forceinline__ void pp_signal_after_stores(const Params &p, int cwg, int wg_thread,
                                                       int32_t mb, int32_t nb) {
  if (wg_thread == 0) {
    if constexpr (DiagSignalAfterReadOf<Epi>::value)
      ptx::bulk_wait_read<Pending>();
    else
      ptx::bulk_wait<Pending>(); // writes performed, not just read out
  }
  ptx::named_bar_sync(kBarConsumerWg0 + cwg, 128);
  if (wg_thread == Epi::signal_thread(p.epi))
    Epi::signal(p.epi, mb, nb);
}
} // namespace detail

// Fns: the epilogue whose functions run (Epi's by default); it takes Epi's Params (a variant of
// Epi with the same parameters, e.g. without code the loop never reaches).
// kLeanProducer: the producer's stage addresses from a register, as detail::StageAt explains
// (gemm_sm90_pp_kernel, the plain GEMM's, sets it; the fused kernels keep generic pointers).
template <int Stages, int EpiBytes, int BN, class Epi, class Wait, bool kDynamic,
          bool kRestoreRegs = false, class Fns = Epi, bool kLeanProducer = false>
__device__ __forceinline__ void gemm_cta_loop_pp(const GemmParams<Epi, Wait> &p, uint8_t *smem_raw,
                                                 int32_t cta, int32_t ctas) {
  static_assert(BN == 128 || BN == 192, "tiles of 128 x 128 or 128 x 192");
  using L = SmemLayout<Stages, EpiBytes, BN>;
  using PL = PpSmemLayout<Stages, EpiBytes, BN>;
  constexpr int kTileA = L::kTileA;
  constexpr int kTileB = L::kTileB;
  // An epilogue that declares kOwnerEpi (tw_gemm_rs's) runs here only where no tile is an owner
  // tile (the host plans the owner epilogue on the cooperative loop's 256-column tiles only).
  static_assert(!TransposedOf<Fns>::value && !WriteThroughOf<Wait>::value,
                "the ping-pong loop serves plain and signalled epilogues");
  static_assert(Stages <= 16, "stuck codes carry the stage in 4 bits");
  static_assert(!KRangeOf<Wait>::value, "per-tile K ranges (hook (k)) serve gemm_cta_loop");
  // A signal warp (Fns::kSignalWarp) has nothing to take off the consumers here: each
  // warpgroup signals in its own epilogue phase, off the tensor cores. (The assertion only names
  // the flag, which nvcc would otherwise report as an unused member of such an epilogue.)
  static_assert(SignalWarpOf<Fns>::value || !SignalWarpOf<Fns>::value, "");
  uint8_t *smem = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                              ~uintptr_t(1023));
  uint64_t *full = reinterpret_cast<uint64_t *>(smem + L::kFull);
  uint64_t *empty = reinterpret_cast<uint64_t *>(smem + L::kEmpty);
  uint64_t *tfull = reinterpret_cast<uint64_t *>(smem + PL::kTFull);
  uint64_t *tempty = reinterpret_cast<uint64_t *>(smem + PL::kTEmpty);
  uint64_t *order = reinterpret_cast<uint64_t *>(smem + PL::kOrder);
  volatile int32_t *tslot = reinterpret_cast<volatile int32_t *>(smem + PL::kTSlot);
  const int wg = threadIdx.x / 128;
  const int wg_thread = threadIdx.x % 128;
  const int32_t k_blocks = p.k_blocks;
  const uint64_t timeout_ns = detail::mbar_timeout(p);
  auto wait = [&](auto bar, uint32_t parity, int32_t code) { // a pointer or a window address
    if (!ptx::mbar_wait_for(bar, parity, timeout_ns))
      Wait::mbar_stuck(p.wait, code);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; s++) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], 4); // the 4 warps of the one warpgroup that reads the stage
    }
    for (int i = 0; i < kPpTileRing; i++) {
      ptx::mbar_init(&tfull[i], 1);
      ptx::mbar_init(&tempty[i], 128); // every thread of the warpgroup, after reading the index
    }
    ptx::mbar_init(&order[0], 1);
    ptx::mbar_init(&order[1], 1);
    ptx::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer ----------------
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (wg_thread == 0) {
      detail::producer_prefetch<Fns>(p);
      if (p.after_grid)
        ptx::griddep_wait();
      int stage = 0;
      uint32_t phase = 0, j = 0;
      auto post = [&](int32_t t) { // tile entry j: index t (-1: no more)
        const int i = (int)(j % kPpTileRing);
        wait(&tempty[i], ((j / kPpTileRing) & 1) ^ 1, kStuckPpTileEmpty * 16 + i);
        tslot[i] = t;
        ptx::mbar_arrive(&tfull[i]);
        j++;
      };
      int32_t t = cta;
      const detail::StageAt<kLeanProducer> at(smem);
      while (detail::producer_claim<kDynamic>(p, t)) {
        int32_t mb, nb, a_row, b_row;
        const CUtensorMap *a_map;
        detail::producer_tile<kBlockM, false>(p, t, 0, mb, nb, a_map, a_row, BN, b_row);
        post(t);
        for (int32_t kb = 0; kb < k_blocks; kb++) {
          wait(detail::bar_at(at(L::kEmpty + stage * 8)), phase ^ 1,
               kStuckProducerEmpty * 16 + stage);
          // tests (TW_FAULT_STALL_TILE): this stage's loads never come
          if (!(kb == 0 && t + 1 == p.fault_stall))
            detail::load_stage(p, at(L::kFull + stage * 8), at(L::kA + stage * kTileA),
                               at(L::kB + stage * kTileB), kTileA + kTileB, a_map, kb, a_row,
                               b_row);
          if (++stage == Stages) {
            stage = 0;
            phase ^= 1;
          }
        }
        if constexpr (!kDynamic)
          t += ctas;
      }
      post(-1); // one end entry for each consumer warpgroup
      post(-1);
      if constexpr (kDynamic)
        queue_leave(p.queue, p.participants);
    }
    if constexpr (kRestoreRegs)
      detail::restore_regs_producer();
  } else {
    // ---------------- consumers ----------------
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int cwg = wg - 1;
    const int lane = wg_thread & 31;
    uint8_t *cbuf = smem + L::kC + cwg * EpiBytes;
    float acc0[BN / 2], acc1[BN / 2]; // the tile's rows 0-63 and 64-127
    int32_t sig_mb = -1, sig_nb = 0;  // kSignal: this warpgroup's tile whose signal is owed
    constexpr int kPasses = 2 * detail::epi_passes<EpiBytes, BN, typename Fns::Out>();
    for (uint32_t j = (uint32_t)cwg;; j += 2) {
      const int i = (int)(j % kPpTileRing);
      wait(&tfull[i], (j / kPpTileRing) & 1, kStuckPpTileFull * 16 + i);
      const int32_t t = tslot[i];
      ptx::mbar_arrive(&tempty[i]);
      if (t < 0)
        break;
      int32_t mb, nb;
      tile_coords(p.order, t, mb, nb);
      if constexpr (OwnerEpiOf<Fns>::value)
        if (Fns::owner_tile(p, mb)) // the host plans owner tiles on gemm_cta_loop only
          Wait::mbar_stuck(p.wait, kStuckPpOwner * 16);
      // Tile j - 1's stages all loaded (its warpgroup waited for them): this one's first stage
      // is the next phase of its barrier. The n-th tile of warpgroup 0 waits for phase n - 1 of
      // order[0], warpgroup 1's n-th for phase n of order[1].
      if (j > 0)
        wait(&order[cwg], ((j - 1) >> 1) & 1, kStuckPpOrder * 16 + cwg);
      const uint32_t first = j * (uint32_t)k_blocks; // the tile's first stage in ring order
      int stage = (int)(first % Stages);
      uint32_t phase = (first / Stages) & 1;
      int prev_stage = stage;
      for (int32_t kb = 0; kb < k_blocks; kb++) {
        wait(&full[stage], phase, kStuckConsumerFull * 16 + stage);
        const uint64_t da0 = ptx::wgmma_desc_sw128(smem + L::kA + stage * kTileA);
        const uint64_t da1 = ptx::wgmma_desc_sw128(smem + L::kA + stage * kTileA + kBoxRows * 128);
        const uint64_t db = ptx::wgmma_desc_sw128(smem + L::kB + stage * kTileB);
        ptx::wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBlockK / 16; k++) {
          ptx::wgmma_bf16<BN>(acc0, da0 + 2 * k, db + 2 * k, (kb | k) != 0);
          ptx::wgmma_bf16<BN>(acc1, da1 + 2 * k, db + 2 * k, (kb | k) != 0);
        }
        ptx::wgmma_commit();
        ptx::wgmma_wait<1>(); // the previous stage's wgmmas are done: release it
        if (kb > 0 && lane == 0)
          ptx::mbar_arrive(&empty[prev_stage]);
        prev_stage = stage;
        if (++stage == Stages) {
          stage = 0;
          phase ^= 1;
        }
      }
      if (wg_thread == 0) // every stage of this tile has been waited for: the other may start
        ptx::mbar_arrive(&order[cwg ^ 1]);
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int r = 0; r < BN / 2; r++) {
        ptx::reg_fence(acc0[r]);
        ptx::reg_fence(acc1[r]);
      }
      if (lane == 0)
        ptx::mbar_arrive(&empty[prev_stage]);
      detail::epilogue<EpiBytes, BN, Fns>(p, acc0, cbuf, cwg, wg_thread, mb, nb, 0);
      detail::epilogue<EpiBytes, BN, Fns>(p, acc1, cbuf, cwg, wg_thread, mb, nb, 1);
      if constexpr (Fns::kSignal) { // the previous tile's signal, this tile's stores in flight
        if (sig_mb >= 0)
          detail::pp_signal_after_stores<kPasses, Fns>(p, cwg, wg_thread, sig_mb, sig_nb);
        sig_mb = mb, sig_nb = nb;
      }
    }
    if constexpr (Fns::kSignal)
      if (sig_mb >= 0)
        detail::pp_signal_after_stores<0, Fns>(p, cwg, wg_thread, sig_mb, sig_nb);
    if (wg_thread == 0)
      ptx::bulk_wait<0>(); // shared memory must outlive the last stores
    if constexpr (kRestoreRegs)
      detail::restore_regs_consumer(cwg);
  }
}

template <int Stages, int EpiBytes, int BN, class Epi, class Wait, bool kDynamic>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_sm90_pp_kernel(const __grid_constant__ GemmParams<Epi, Wait> p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  if (threadIdx.x == 0)
    ptx::griddep_launch_dependents();
  gemm_cta_loop_pp<Stages, EpiBytes, BN, Epi, Wait, kDynamic, false, Epi, true>(
      p, smem_raw, blockIdx.x, gridDim.x);
}

} // namespace gemm
} // namespace tw
