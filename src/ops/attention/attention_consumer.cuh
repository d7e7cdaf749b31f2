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

// The consumers' schedule over a tile's KV blocks (FlashAttention-3's): each warpgroup issues
// block n's S = Q K^T, then block n - 1's O += P V, and runs block n's softmax while that PV
// runs (intra-warpgroup overlap); and the two warpgroups take turns issuing their GEMMs (named
// barriers kTurnBar + cw: a warpgroup waits for its turn, issues both GEMMs and hands the turn
// over), so one runs its softmax while the other's GEMMs hold the tensor cores. A turn's wait
// is a bar.sync, unbounded, but its holder's only waits are the bounded barrier waits.
constexpr uint32_t kTurnBar = 3; // and kTurnBar + 1 (0 is __syncthreads, 1 and 2 the backward's)

// A consumer warpgroup's rows of one tile across its KV blocks: O, the running maxima and sums,
// and the block whose PV is still to be issued: P packed, the rescale of O it needs first
// (alpha: O holds the blocks before it at the old maxima), its V stage.
template <int D> struct FwdRows {
  float o[D / 2], m[2], l[2], alpha[2];
  uint32_t pa[32];
  uint32_t v_lo, v_bars, v_phase, v_stage; // the pending PV's V stage (its k_full address)
  int pending;
};

template <int D> __device__ __forceinline__ void fwd_begin(FwdRows<D> &st) {
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    st.o[i] = 0.f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.f;
  st.pending = 0;
}

// Issues the pending block's O = alpha O + P V once its V stage is full. The rescale sits here,
// while the next block's S runs, not after the softmax: there ptxas would hoist the wait for
// the PV in flight above the softmax to schedule it early.
template <int D, class P>
__device__ __forceinline__ void fwd_issue_pv(FwdRows<D> &st, const P &p, int32_t t) {
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    st.o[i] *= st.alpha[(i / 2) % 2];
  wait_bar(st.v_bars + 16, st.v_phase, p, kWaitVFull, (int)st.v_stage, t);
  pv_gemm<D>(st.o, st.pa, st.v_lo);
}

// Releases the pending block's V stage once its PV completed (lane 0 of each warp). The
// predicate also reads the row sums, which are never below 0, only so that the arrival depends
// on the softmax: else ptxas schedules it early and the wgmma wait that must precede it with
// it, ahead of the softmax, which then runs only after the PV in flight.
template <int D> __device__ __forceinline__ void fwd_release_pv(FwdRows<D> &st, int lane) {
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    ptx::reg_fence(st.o[i]);
  ptx::mbar_arrive_if(st.v_bars + 24, lane == 0 && !(st.l[0] < 0.f) && !(st.l[1] < 0.f));
}

// After S of a block completed: S fenced, its K stage released (and Q after the tile's last
// block), the mask applied (kMasked), then the online softmax (alpha: O's rescale). No branch:
// this runs between the two wgmma waits.
template <bool kMasked>
__device__ __forceinline__ void fwd_softmax(float (&s)[64], float (&m)[2], float (&l)[2],
                                            float (&alpha)[2], int lane, uint32_t k_empty,
                                            uint32_t q_empty, bool last_q, const int32_t (&lim)[2],
                                            float scale_log2) {
#pragma unroll
  for (int i = 0; i < 64; i++)
    ptx::reg_fence(s[i]);
  ptx::mbar_arrive_if(k_empty, lane == 0);
  ptx::mbar_arrive_if(q_empty, lane == 0 && last_q);
  if constexpr (kMasked)
    apply_mask(s, lim, 2 * (lane % 4));
  softmax_step(s, m, l, alpha, scale_log2);
}

// The GEMMs and the softmax of one block (fwd_block's contract), straight-line for one value of
// kMasked and of kPending (a PV issued behind this block's S, waited for after the softmax).
// Each path waits for every wgmma it issued, so ptxas sees none in flight where paths join
// (else it serialises the wgmmas).
template <int D, bool kMasked, bool kPending, class P>
__device__ __forceinline__ void fwd_gemms(FwdRows<D> &st, const P &p, int32_t t, int cw, int lane,
                                          float (&s)[64], uint32_t q_lo, uint32_t k_lo,
                                          uint32_t q_empty, uint32_t sb, bool last_q,
                                          const int32_t (&lim)[2], float scale_log2) {
  qk_gemm<D>(s, q_lo, k_lo);
  if constexpr (kPending)
    fwd_issue_pv<D>(st, p, t);
  ptx::named_bar_arrive(kTurnBar + (cw ^ 1), 256);
  if constexpr (kPending)
    ptx::wgmma_wait<1>();
  else
    ptx::wgmma_wait<0>();
  fwd_softmax<kMasked>(s, st.m, st.l, st.alpha, lane, sb + 8, q_empty, last_q, lim, scale_log2);
  if constexpr (kPending) {
    ptx::wgmma_wait<0>();
    fwd_release_pv<D>(st, lane);
  }
}

// One KV block of stage `stage` (barriers at `sb`: k_full, k_empty, v_full, v_empty, 8 bytes
// apart; parity `phase`) for warpgroup cw's rows, in its turn: S = Q K^T with the pending
// block's PV behind it, the mask (masked: lim as row_limits gives), the online softmax; this
// block's P then waits to be issued with the next block's S (or by fwd_flush). last_q: the
// tile's last block, after whose S the Q buffer is released.
template <int D, class P>
__device__ __forceinline__ void fwd_block(FwdRows<D> &st, const P &p, int32_t t, int cw, int lane,
                                          uint32_t q_lo, uint32_t q_empty, uint32_t base,
                                          uint32_t sb, uint32_t stage, uint32_t phase, bool last_q,
                                          bool masked, const int32_t (&lim)[2], float scale_log2) {
  using L = AttnSmem<D>;
  const uint32_t k_lo = ptx::wgmma_desc_lo_sw128(base + L::kK + stage * L::kTileBytes);
  const uint32_t v_lo =
      ptx::wgmma_desc_lo_sw128_mn(base + L::kV + stage * L::kTileBytes, L::kBoxBytes);
  float s[64];
  wait_bar(sb, phase, p, kWaitKFull, (int)stage, t);
  ptx::named_bar_sync(kTurnBar + cw, 256);
  const bool pending = st.pending; // one read picks the path (re-read, ptxas serialises)
  if (pending && masked)
    fwd_gemms<D, true, true>(st, p, t, cw, lane, s, q_lo, k_lo, q_empty, sb, last_q, lim,
                             scale_log2);
  else if (pending)
    fwd_gemms<D, false, true>(st, p, t, cw, lane, s, q_lo, k_lo, q_empty, sb, last_q, lim,
                              scale_log2);
  else if (masked)
    fwd_gemms<D, true, false>(st, p, t, cw, lane, s, q_lo, k_lo, q_empty, sb, last_q, lim,
                              scale_log2);
  else
    fwd_gemms<D, false, false>(st, p, t, cw, lane, s, q_lo, k_lo, q_empty, sb, last_q, lim,
                               scale_log2);
  pack_p(s, st.pa);
  st.v_lo = v_lo, st.v_bars = sb, st.v_phase = phase, st.v_stage = stage;
  st.pending = 1;
}

// After a tile's last block: its pending PV, issued (outside the turns) and completed.
template <int D, class P>
__device__ __forceinline__ void fwd_flush(FwdRows<D> &st, const P &p, int32_t t, int lane) {
  if (!st.pending)
    return;
  fwd_issue_pv<D>(st, p, t);
  ptx::wgmma_wait<0>();
  fwd_release_pv<D>(st, lane);
  st.pending = 0;
}

// The turns' ends: warpgroup 1 lets warpgroup 0 take the first turn; at the end warpgroup 0
// takes the turn warpgroup 1's last block left it, so both barriers end with no arrival
// pending. Both warpgroups run the same blocks (a tile's blocks are its rows' union), so their
// turns alternate to the end.
__device__ __forceinline__ void fwd_turns_begin(int cw) {
  if (cw == 1)
    ptx::named_bar_arrive(kTurnBar, 256);
}
__device__ __forceinline__ void fwd_turns_end(int cw) {
  if (cw == 0)
    ptx::named_bar_sync(kTurnBar, 256);
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
  fwd_turns_begin(cw);
  for (int32_t t = blockIdx.x; t < p.num_tiles; t = next_tile(t)) {
    const Tile tl = tile_at(p, t);
    const int32_t wg_row = tl.m_block * kBlockM + 64 * cw; // the warpgroup's first row
    const int32_t row0 = wg_row + 16 * warp + lane / 4;    // this thread's rows: row0, row0 + 8
    FwdRows<D> st;
    fwd_begin<D>(st);
    wait_bar(q_full, q_phase, p, kWaitQFull, 0, t);
    q_phase ^= 1;
    if (tl.n_blocks == 0 && lane == 0)
      ptx::mbar_arrive(q_empty);
    for (int32_t n = 0; n < tl.n_blocks; n++) {
      const int64_t block_end = (int64_t)n * kBlockN + kBlockN - 1;
      const bool masked = block_end >= p.seq_kv || (p.causal && block_end > p.delta + wg_row);
      int32_t lim[2] = {kBlockN, kBlockN};
      if (masked)
        row_limits(p.seq_kv, p.causal, p.delta, row0, n, lim);
      fwd_block<D>(st, p, t, cw, lane, q_lo, q_empty, base, bars + 16 + 32 * stage, stage, phase,
                   n == tl.n_blocks - 1, masked, lim, p.scale_log2);
      if (++stage == L::kStages)
        stage = 0, phase ^= 1;
    }
    fwd_flush<D>(st, p, t, lane);
    store_rows<D>(p, tl, row0, lane, st.o, st.m, st.l);
  }
  fwd_turns_end(cw);
}

} // namespace attn
} // namespace tw
