/*
 * Internal (ops layer): the attention backward's one-pass kernels (tw_attention_backward with
 * dq_accum set; attention_backward.cu launches dsum_kernel, a zeroing of dq_accum,
 * dkdvq_kernel and dq_convert_kernel in this order).
 *
 *   dkdvq_kernel       dkdv_kernel's tiles, roles and per-block math (dkdv_front, dK and dV in
 *                      registers over the tile's query blocks), and dQ in the same pass: each
 *                      block's dS^T (both consumers' 64 keys) is stored to shared memory as
 *                      bf16, and each consumer warpgroup takes a 64 x 64 piece of the block's
 *                      dQ = dS K over the tile's 128 keys:
 *                        head_dim 128 (64-query blocks): dQ's columns 64 cw .. 64 cw + 63;
 *                        head_dim 64 (128-query blocks): dQ's rows 64 cw .. 64 cw + 63;
 *                      (SS wgmma m64n64k16, both operands MN-major: dS^T as key rows of 64
 *                      queries, K's tile as loaded). The piece (fp32) goes through the
 *                      warpgroup's staging buffer and a bulk reduce-add into dq_accum, which
 *                      the memory system applies in no fixed order across the CTAs: dq is not
 *                      bitwise repeatable, dk and dv are (their sums stay in one warpgroup).
 *                      Five GEMMs a block where dkdv_kernel and dq_kernel together run seven.
 *   dq_convert_kernel  dq = scale x dq_accum as bf16.
 *
 * dq_accum's layout: a chunk of 4096 floats per (batch, q head, query block, consumer), chunk
 * ((b heads_q + h) q_blocks + m) 2 + cw; float 512 j + 4 tid + e of a chunk is accumulator
 * 4 j + e of thread tid of the warpgroup, the m64n64 fragment's row 16 warp + g + 8 (e / 2) and
 * column 8 j + 2 t + e % 2 of the piece (g = lane / 4, t = lane % 4).
 */
#pragma once

#include "ops/attention/attention_bwd.cuh"

namespace tw {
namespace attn {

template <int D> struct DkvqSmem : DkvStages<D, 3> {
  using B = DkvStages<D, 3>;
  // dS^T: kBlockQ / 64 boxes of 128 key rows x 64 queries, bf16, 128-byte swizzled
  static constexpr int kDsBoxBytes = kBlockN * 128;
  static constexpr int kDS = B::kEnd;
  static constexpr int kPieceBytes = 64 * 64 * 4; // a consumer's dQ piece, fp32
  static constexpr int kDQ = kDS + (B::kBlockQ / 64) * kDsBoxBytes;
  static constexpr int kStats = kDQ + 2 * kPieceBytes; // per consumer: lse2, dsum
  static constexpr int kBars = kStats + 2 * 2 * B::kBlockQ * 4;
  static constexpr int kDynamicBytes = kBars + B::kBarCount * 8 + 1024;
};

// Named barriers over both consumer warpgroups (256 threads): their dQ GEMMs of the previous
// block have read dS^T (it may be overwritten), and their dS^T of this block is stored.
constexpr uint32_t kDsFreeBar = 3, kDsReadyBar = 4;

// This thread's dS^T pairs (dsa, dkdv_front's) into the dS^T buffer at shared address ds:
// key row 64 cw + 16 warp + g + 8 (k % 2), query columns 8 (k / 2) + 2 t and + 1, in boxes of
// 64 query columns, swizzled as TMA's 128-byte mode (16-byte chunk c of a 128-byte row at
// c ^ (row % 8), and row % 8 is g), so the dQ GEMM reads it as a loaded tile and a warp's
// stores hit 32 banks.
template <int N>
__device__ __forceinline__ void store_ds(uint32_t ds, int cw, int tid,
                                         const uint32_t (&dsa)[N / 4]) {
  const int warp = tid / 32, g = (tid % 32) / 4, t4 = tid % 4;
#pragma unroll
  for (int k = 0; k < N / 4; k++) {
    const int row = 64 * cw + 16 * warp + g + 8 * (k % 2);
    const int chunk = (k / 2) % 8, box = (k / 2) / 8;
    ptx::st_shared_s32(ds + box * (kBlockN * 128) + row * 128 + ((chunk ^ g) * 16) + 4 * t4,
                       (int32_t)dsa[k]);
  }
}

// acc = dS K for this warpgroup's 64 x 64 piece over the tile's 128 keys (8 k16 steps, committed,
// not waited for): a_at the piece's dS^T box, b_at its K box (shared addresses, MN-major).
__device__ __forceinline__ void dq_gemm(float (&acc)[32], uint32_t a_at, uint32_t b_at) {
#pragma unroll
  for (int i = 0; i < 32; i++)
    ptx::reg_fence(acc[i]);
  ptx::wgmma_fence();
  const uint32_t a_lo = ptx::wgmma_desc_lo_sw128_mn(a_at, kBlockN * 128);
  const uint32_t b_lo = ptx::wgmma_desc_lo_sw128_mn(b_at, kBlockN * 128);
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ks++)
    ptx::wgmma_m64n64k16_bf16_tt(acc, ptx::wgmma_desc_from_lo(a_lo + ((ks * 16 * 128) >> 4)),
                                 ptx::wgmma_desc_from_lo(b_lo + ((ks * 16 * 128) >> 4)), ks > 0);
  ptx::wgmma_commit();
}

// This warpgroup's dQ piece (acc) added into its chunk of dq_accum (dst) through its staging
// buffer (shared address stage_at): thread 0 waits until the previous piece's reduce has read
// the buffer, the warpgroup stores the piece (float4 j of thread tid at float 512 j + 4 tid),
// and thread 0 issues the bulk reduce-add (waited for before the kernel ends).
__device__ __forceinline__ void add_piece(const float (&acc)[32], uint32_t stage_at, float *dst,
                                          int cw, int tid) {
  if (tid == 0)
    ptx::bulk_wait_read<0>();
  ptx::named_bar_sync(1 + cw, 128);
#pragma unroll
  for (int j = 0; j < 8; j++)
    ptx::st_shared_f4(stage_at + (512 * j + 4 * tid) * 4, acc[4 * j], acc[4 * j + 1],
                      acc[4 * j + 2], acc[4 * j + 3]);
  ptx::fence_async_shared();
  ptx::named_bar_sync(1 + cw, 128);
  if (tid == 0) {
    ptx::bulk_reduce_add_f32(dst, stage_at, 64 * 64 * 4);
    ptx::bulk_commit();
  }
}

// The query block at run row q0 (stage `stage`, in phase `phase`) for a consumer warpgroup's keys
// of tile t: dkdv_front (keys past seq_kv masked), dS^T to shared memory, dK += dS^T Q (RS) and
// the warpgroup's dQ piece (SS) together, the stage released, the piece added into dq_dst.
template <int D>
__device__ __forceinline__ void
dkdvq_block(const BwdParams &p, const QueryRun &run, int32_t q0, int32_t key_r, float *stats,
            int cw, int tid, uint32_t k_lo, uint32_t v_lo, uint32_t base, uint32_t bars,
            uint32_t stage, uint32_t phase, int32_t t, float *dq_dst, float (&dk)[D / 2],
            float (&dv)[D / 2]) {
  using L = DkvqSmem<D>;
  constexpr int N = L::kBlockQ;
  uint32_t dsa[N / 4];
  dkdv_front<D, L, true>(p, run, q0, key_r, stats, cw, tid, k_lo, v_lo, base, bars, stage, phase, t,
                         dv, dsa);
  ptx::named_bar_sync(kDsFreeBar, 256);
  store_ds<N>(base + L::kDS, cw, tid, dsa);
  ptx::fence_async_shared();
  ptx::named_bar_sync(kDsReadyBar, 256);
  const uint32_t q_at = base + L::kQ + stage * L::kQBytes;
  tn_gemm<D, N>(dk, dsa, ptx::wgmma_desc_lo_sw128_mn(q_at, L::kQBoxBytes));
  float acc[32];
  dq_gemm(acc, base + L::kDS + (D == 64 ? cw * L::kDsBoxBytes : 0),
          base + L::kK + (D == 128 ? cw * L::kKvBoxBytes : 0));
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    ptx::reg_fence(dk[i]), ptx::reg_fence(dv[i]);
#pragma unroll
  for (int i = 0; i < 32; i++)
    ptx::reg_fence(acc[i]);
  if (tid % 32 == 0)
    ptx::mbar_arrive(bars + 16 + 16 * stage + 8); // s_empty: Q and dO read
  add_piece(acc, base + L::kDQ + cw * L::kPieceBytes, dq_dst, cw, tid);
}

template <int D>
__device__ __forceinline__ void dkdvq_consumer(const BwdParams &p, uint32_t base, uint32_t bars,
                                               float *stats, int cw, int tid) {
  using L = DkvqSmem<D>;
  const uint32_t k_lo = ptx::wgmma_desc_lo_sw128(base + L::kK + cw * 64 * 128);
  const uint32_t v_lo = ptx::wgmma_desc_lo_sw128(base + L::kV + cw * 64 * 128);
  kv_tile_loop<D, L>(
      p, bars, cw, tid,
      [&](const QueryRun &run, int32_t batch, int32_t head, int32_t m, int32_t key_r,
          uint32_t stage, uint32_t phase, int32_t t, float(&dk)[D / 2], float(&dv)[D / 2]) {
        const int64_t chunk = (((int64_t)batch * p.heads_q + head) * p.q_blocks + m) * 2 + cw;
        dkdvq_block<D>(p, run, m * L::kBlockQ, key_r, stats, cw, tid, k_lo, v_lo, base, bars, stage,
                       phase, t, p.dq_accum + chunk * 4096, dk, dv);
      });
  if (tid == 0)
    ptx::bulk_wait<0>(); // the reduces are performed before the grid completes
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) dkdvq_kernel(const __grid_constant__ BwdParams p) {
  run_dkdv_kernel<D, DkvqSmem<D>, dkdvq_consumer<D>>(p);
}

// dq = scale x dq_accum as bf16 ([batch, seq_q, heads_q, D]): a thread per float4 of dq_accum
// (the layout above: two rows' column pairs), rows past seq_q skipped.
template <int D> __global__ void dq_convert_kernel(const __grid_constant__ BwdParams p) {
  const int64_t quads = (int64_t)p.batch * p.heads_q * p.q_blocks * 2 * 1024;
  for (int64_t f = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; f < quads;
       f += (int64_t)gridDim.x * blockDim.x) {
    const int64_t chunk = f / 1024, blk = chunk / 2;
    const int in = (int)(f % 1024), cw = (int)(chunk % 2);
    const int j = in / 128, tid = in % 128, lane = tid % 32;
    const int32_t m = (int32_t)(blk % p.q_blocks), h = (int32_t)(blk / p.q_blocks % p.heads_q);
    const int64_t b = blk / p.q_blocks / p.heads_q;
    const int r = 16 * (tid / 32) + lane / 4, c = 8 * j + 2 * (lane % 4);
    const int64_t row = D == 128 ? (int64_t)m * 64 + r : (int64_t)m * 128 + 64 * cw + r;
    const int col = D == 128 ? 64 * cw + c : c;
    const float4 v = reinterpret_cast<const float4 *>(p.dq_accum)[f];
    if (row < p.seq_q)
      *reinterpret_cast<uint32_t *>(p.dq + ((b * p.seq_q + row) * p.heads_q + h) * D + col) =
          pack_bf16(v.x * p.scale, v.y * p.scale);
    if (row + 8 < p.seq_q)
      *reinterpret_cast<uint32_t *>(p.dq + ((b * p.seq_q + row + 8) * p.heads_q + h) * D + col) =
          pack_bf16(v.z * p.scale, v.w * p.scale);
  }
}

} // namespace attn
} // namespace tw
