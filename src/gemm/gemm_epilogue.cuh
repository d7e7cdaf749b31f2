/* The GEMM engine's epilogue (contract in gemm_sm90.cuh): a consumer warpgroup's accumulators
 * through swizzled shared memory into Epi's boxes, and the tile signals that follow the stores. */
#pragma once

#include "gemm/gemm_params.cuh"

namespace tw {
namespace gemm {

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
        // (bank conflicts on most of the epilogue's store wavefronts). Odd rows store
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

} // namespace gemm
} // namespace tw
