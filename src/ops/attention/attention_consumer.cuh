/*
 * Internal: tw_attention's consumer warpgroups (attention_sm90.cuh's contract).
 *
 * Fragment layouts (PTX ISA, wgmma register fragments), for thread `lane` of warp `warp` of a
 * consumer warpgroup, g = lane / 4, t = lane % 4:
 *   accumulator d[i] of an m64nN tile: row 16 warp + g + 8 ((i / 2) % 2),
 *                                      column 8 (i / 4) + 2 t + i % 2;
 *   A operand (m64 x k16 from registers), register q of 4: rows as d's with i = 2q,
 *                                      columns 2 t + 8 (q / 2) + {0, 1} (low half first).
 * So a thread's two rows are g and g + 8, a row's values sit in the 4 threads of a quad
 * (reductions: shuffles over lane bits 0 and 1), and P's k16 step kk as an A operand is
 * S's accumulators 8 kk .. 8 kk + 7 packed in pairs, in order (pack_p).
 */
#pragma once

#include <math.h>

namespace tw {
namespace attn {

// S = Q K^T for this warpgroup's 64 rows (committed, not waited for). q_lo / k_lo: the
// descriptors' low words of the Q rows' first box and of the K stage's first box; a 16-column
// step adds 32 bytes inside a box, the next box kBoxBytes.
template <int D>
__device__ __forceinline__ void qk_gemm(float (&s)[64], uint32_t q_lo, uint32_t k_lo) {
#pragma unroll
  for (int i = 0; i < 64; i++)
    ptx::reg_fence(s[i]);
  ptx::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++) {
    const uint32_t off = (uint32_t)((ks / 4) * AttnSmem<D>::kBoxBytes + (ks % 4) * 32) >> 4;
    ptx::wgmma_m64n128k16_bf16(s, ptx::wgmma_desc_from_lo(q_lo + off),
                               ptx::wgmma_desc_from_lo(k_lo + off), ks > 0);
  }
  ptx::wgmma_commit();
}

// O += P V: P's 8 k16 steps from registers; V's 16-row steps 16 x 128 bytes apart, its two
// 64-column boxes (D = 128) kBoxBytes apart (the MN-major descriptor's leading byte offset).
template <int D>
__device__ __forceinline__ void pv_gemm(float (&o)[D / 2], uint32_t (&pa)[32], uint32_t v_lo) {
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    ptx::reg_fence(o[i]);
#pragma unroll
  for (int i = 0; i < 32; i++)
    ptx::reg_fence(pa[i]);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; kk++) {
    const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
    ptx::wgmma_rs_bf16_tb<D>(o, a, ptx::wgmma_desc_from_lo(v_lo + ((kk * 16 * 128) >> 4)), 1);
  }
  ptx::wgmma_commit();
}

// Keys past lim[r] (relative to the block's first key) of row r get -inf.
__device__ __forceinline__ void apply_mask(float (&s)[64], const int32_t (&lim)[2], int col0) {
#pragma unroll
  for (int i = 0; i < 64; i++) {
    const int col = 8 * (i / 4) + col0 + (i % 2);
    if (col > lim[(i / 2) % 2])
      s[i] = -INFINITY;
  }
}

// The online softmax step on one block: the rows' running maxima m (log2 domain, scaled), the
// thread's partial row sums l (its own columns; the quad's are added in the epilogue: alpha is
// the same on the quad), S turned into P = 2^(s scale_log2 - m), and alpha = 2^(m_old - m_new)
// for rescaling O. A row with no visible key so far keeps m = -inf and subtracts 0 instead
// (-inf - -inf would be NaN): its P and alpha are 0, and its O and l stay 0.
__device__ __forceinline__ void softmax_step(float (&s)[64], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; j++)
      mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[r], mx * scale_log2);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = ptx::ex2_approx(m[r] - m_use);
    m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 16; j++) {
      float &x0 = s[4 * j + 2 * r], &x1 = s[4 * j + 2 * r + 1];
      x0 = ptx::ex2_approx(fmaf(x0, scale_log2, -m_use));
      x1 = ptx::ex2_approx(fmaf(x1, scale_log2, -m_use));
      sum += x0 + x1;
    }
    l[r] = l[r] * alpha[r] + sum;
  }
}

// bf16 pair, lo in the low half (the element of the smaller column).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ void pack_p(const float (&s)[64], uint32_t (&pa)[32]) {
#pragma unroll
  for (int k = 0; k < 32; k++)
    pa[k] = pack_bf16(s[2 * k], s[2 * k + 1]);
}

// O / l as bf16 into p.o, lse into p.lse, for this thread's two rows (those below seq_q).
template <int D>
__device__ __forceinline__ void store_rows(const AttnParams &p, const Tile &tl, int32_t row0,
                                           int lane, const float (&o)[D / 2], const float (&m)[2],
                                           const float (&l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int32_t row = row0 + 8 * r;
    if (row >= p.seq_q)
      continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int64_t q_row = ((int64_t)tl.batch * p.seq_q + row) * p.heads_q + tl.head;
    uint32_t *dst = reinterpret_cast<uint32_t *>(p.o + q_row * D + 2 * (lane % 4));
#pragma unroll
    for (int j = 0; j < D / 8; j++)
      dst[4 * j] = pack_bf16(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    if (p.lse && lane % 4 == 0)
      p.lse[((int64_t)tl.batch * p.heads_q + tl.head) * p.seq_q + row] =
          sum > 0.f ? m[r] * 0.69314718055994531f + logf(sum) : -INFINITY;
  }
}

// Keys [0, kv_rows) of a run whose key j row i sees iff j <= delta + i (causal): the last
// visible key of each of this thread's rows (row0, row0 + 8) relative to block n's first key,
// clamped to [-1, kBlockN] (no key / every key of the block). tw_attention's one run, the
// ring's runs, the backward's dq tiles.
__device__ __forceinline__ void row_limits(int64_t kv_rows, int32_t causal, int64_t delta,
                                           int32_t row0, int32_t n, int32_t (&lim)[2]) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    int64_t last = kv_rows - 1;
    if (causal)
      last = min(last, delta + row0 + 8 * r);
    last -= (int64_t)n * kBlockN;
    lim[r] = (int32_t)max((int64_t)-1, min(last, (int64_t)kBlockN));
  }
}

// Consumer warpgroup cw (0 or 1): rows 64 cw .. 64 cw + 63 of every tile of this CTA.
template <int D>
__device__ __forceinline__ void consumer_loop(const AttnParams &p, uint32_t base, uint32_t bars,
                                              int cw, int tid) {
  using L = AttnSmem<D>;
  const int warp = tid / 32, lane = tid % 32;
  const uint32_t q_full = bars, q_empty = bars + 8;
  const uint32_t q_lo = ptx::wgmma_desc_lo_sw128(base + L::kQ + cw * 64 * 128);
  uint32_t stage = 0, phase = 0, q_phase = 0;
  for (int32_t t = blockIdx.x; t < p.num_tiles; t += gridDim.x) {
    const Tile tl = tile_at(p, t);
    const int32_t wg_row = tl.m_block * kBlockM + 64 * cw; // the warpgroup's first row
    const int32_t row0 = wg_row + 16 * warp + lane / 4;    // this thread's rows: row0, row0 + 8
    float o[D / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < D / 2; i++)
      o[i] = 0.f;
    wait_bar(q_full, q_phase, p, kWaitQFull, 0, t);
    q_phase ^= 1;
    if (tl.n_blocks == 0 && lane == 0)
      ptx::mbar_arrive(q_empty);
    for (int32_t n = 0; n < tl.n_blocks; n++) {
      const uint32_t k_full = bars + 16 + 32 * stage, k_empty = k_full + 8;
      const uint32_t v_full = k_full + 16, v_empty = k_full + 24;
      float s[64];
      wait_bar(k_full, phase, p, kWaitKFull, stage, t);
      qk_gemm<D>(s, q_lo, ptx::wgmma_desc_lo_sw128(base + L::kK + stage * L::kTileBytes));
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 64; i++)
        ptx::reg_fence(s[i]);
      if (lane == 0) {
        ptx::mbar_arrive(k_empty);
        if (n == tl.n_blocks - 1)
          ptx::mbar_arrive(q_empty);
      }
      const int64_t block_end = (int64_t)n * kBlockN + kBlockN - 1;
      if (block_end >= p.seq_kv || (p.causal && block_end > p.delta + wg_row)) {
        int32_t lim[2];
        row_limits(p.seq_kv, p.causal, p.delta, row0, n, lim);
        apply_mask(s, lim, 2 * (lane % 4));
      }
      float alpha[2];
      softmax_step(s, m, l, alpha, p.scale_log2);
#pragma unroll
      for (int i = 0; i < D / 2; i++)
        o[i] *= alpha[(i / 2) % 2];
      uint32_t pa[32];
      pack_p(s, pa);
      wait_bar(v_full, phase, p, kWaitVFull, stage, t);
      pv_gemm<D>(o, pa,
                 ptx::wgmma_desc_lo_sw128_mn(base + L::kV + stage * L::kTileBytes, L::kBoxBytes));
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < D / 2; i++)
        ptx::reg_fence(o[i]);
      if (lane == 0)
        ptx::mbar_arrive(v_empty);
      if (++stage == L::kStages)
        stage = 0, phase ^= 1;
    }
    store_rows<D>(p, tl, row0, lane, o, m, l);
  }
}

} // namespace attn
} // namespace tw
