/*
 * Internal (ops layer): the attention backward's kernels (attention_backward.cu launches them in
 * this order on the caller's stream). With S = scale Q K^T, P = exp(S - lse) (the forward's lse),
 * dsum_i = sum_c dO[i][c] O[i][c] and dS = P (dO V^T - dsum):
 *
 *   dsum_kernel   a warp a query row: dsum (fp32) into the caller's workspace.
 *   dkdv_kernel   persistent over (128-key block, kv head, batch) tiles. Warpgroup 0's thread 0
 *                 loads the tile's K and V once, then for every q head of the kv head's group
 *                 and every 64-row query block that can see a key of the tile (causal), Q and
 *                 dO into a ring of stages; consumer warpgroups 1 and 2 own 64 keys each:
 *                   S^T = K Q^T, dP^T = V dO^T        (SS wgmma m64n64k16, every operand K-major)
 *                   P^T, dS^T in registers            (the block's lse and dsum in shared memory)
 *                   dV += P^T dO, dK += dS^T Q        (RS wgmma m64nDk16, dO and Q MN-major)
 *                 then dK x scale and dV stored as bf16. Deterministic: a tile's sums run in
 *                 one warpgroup, in block order.
 *   dq_kernel     the forward's structure (128-row Q tiles, K/V stages of 128 keys): Q and dO
 *                 once a tile, then per KV block S = Q K^T and dP = dO V^T (SS m64n128k16, the
 *                 forward's qk_gemm for both), dS in registers, dQ += dS K (RS, K MN-major: the
 *                 forward's pv_gemm), dQ x scale stored as bf16.
 *
 * With dq_accum the one pass replaces dkdv_kernel and dq_kernel (attention_bwd_onepass.cuh).
 *
 * P and dS enter the RS wgmmas as bf16, as in FlashAttention's backward; every sum is fp32.
 * Rows no key reaches (lse -inf) and keys no row sees get P = 0. Barriers and bounded waits as
 * the forward's (attention_sm90.cuh).
 */
#pragma once

#include "ops/attention/attention_sm90.cuh"

namespace tw {
namespace attn {

// dkdv_kernel's query block (the N of its SS wgmmas): 128 at head_dim 64, where dK, dV and a
// block's S^T and dP^T still fit the consumers' registers and the wider wgmmas run fuller; 64
// at head_dim 128.
template <int D> constexpr int kBwdBlockQ = D == 64 ? 128 : 64;

struct BwdParams {
  CUtensorMap q_map, k_map, v_map, do_map; // boxes {64, 1, 128, 1} (dq_kernel; K, V for both)
  CUtensorMap q64_map, do64_map;           // boxes {64, 1, 64, 1} (dkdv_kernel's Q and dO)
  const __nv_bfloat16 *o, *dout;           // dsum_kernel's
  const float *lse;                        // [batch, heads_q, seq_q], natural log
  float *dsum;                             // [batch, heads_q, seq_q]
  __nv_bfloat16 *dq, *dk, *dv;
  float *dq_accum; // dkdvq_kernel's dQ sums (attention_bwd_onepass.cuh); NULL otherwise
  int32_t batch, heads_q, heads_kv, seq_q, seq_kv, group;
  int32_t m_tiles;  // ceil(seq_q / 128): dq_kernel's tiles per (batch, head)
  int32_t q_blocks; // ceil(seq_q / kBwdBlockQ<D>): dkdv_kernel's query blocks per head
  int32_t n_tiles;  // ceil(seq_kv / 128): dkdv_kernel's tiles per (batch, kv head)
  int32_t num_tiles, num_kv_tiles;
  int32_t causal;
  int64_t delta; // q_offset - kv_offset: key j is visible to query i iff j <= delta + i (causal)
  float scale, scale_log2;
  uint64_t timeout_ns;
};

// Row `row` of a run's stats (lse and dsum of one (batch, head), row i at [i]): its lse in the
// log2 domain, or +inf where the row is not `valid` (past the run) or no key reaches it (so
// 2^(x - it) is 0); and its dsum (0 there).
__device__ __forceinline__ void row_stats_at(const float *lse, const float *dsum, int64_t row,
                                             bool valid, float &lse2, float &ds) {
  lse2 = INFINITY, ds = 0.f;
  if (!valid)
    return;
  const float l = lse[row];
  lse2 = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
  ds = dsum[row];
}

// row_stats_at for row `row` of (batch, head) of the whole [batch, heads_q, seq_q] stats.
__device__ __forceinline__ void row_stats(const BwdParams &p, int32_t batch, int32_t head,
                                          int64_t row, float &lse2, float &ds) {
  const int64_t at = ((int64_t)batch * p.heads_q + head) * p.seq_q;
  row_stats_at(p.lse + at, p.dsum + at, row, row < p.seq_q, lse2, ds);
}

// ---- dsum_kernel --------------------------------------------------------------------------

// A warp per row r of [batch, seq_q, heads_q] (o's row order): dsum[(b, h, i)] = dO . O.
// dsum_kernel's grid for `rows` query rows (a warp a row, 8 warps a CTA) with `sms` SMs.
inline int dsum_grid(int64_t rows, int sms) {
  return (int)(rows / 8 + 1 < (int64_t)sms * 16 ? rows / 8 + 1 : (int64_t)sms * 16);
}

template <int D> __global__ void dsum_kernel(const __grid_constant__ BwdParams p) {
  const int64_t rows = (int64_t)p.batch * p.seq_q * p.heads_q;
  const int lane = threadIdx.x % 32;
  for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows;
       r += (int64_t)gridDim.x * blockDim.x / 32) {
    const __nv_bfloat162 *o = reinterpret_cast<const __nv_bfloat162 *>(p.o + r * D);
    const __nv_bfloat162 *g = reinterpret_cast<const __nv_bfloat162 *>(p.dout + r * D);
    float sum = 0.f;
#pragma unroll
    for (int c = lane; c < D / 2; c += 32) {
      const float2 a = __bfloat1622float2(o[c]), b = __bfloat1622float2(g[c]);
      sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      const int64_t h = r % p.heads_q, i = (r / p.heads_q) % p.seq_q, b = r / p.heads_q / p.seq_q;
      p.dsum[(b * p.heads_q + h) * p.seq_q + i] = sum;
    }
  }
}

// ---- dq_kernel ----------------------------------------------------------------------------

template <int D> struct DqSmem {
  static constexpr int kStages = D == 128 ? 2 : 4;
  static constexpr int kBoxes = D / kBoxCols;
  static constexpr int kBoxBytes = kBlockN * 128;
  static constexpr int kTileBytes = kBoxes * kBoxBytes;
  static constexpr int kQ = 0;
  static constexpr int kDO = kQ + kTileBytes;
  static constexpr int kK = kDO + kTileBytes;
  static constexpr int kV = kK + kStages * kTileBytes;
  static constexpr int kBars = kV + kStages * kTileBytes;
  // q_full, q_empty (Q and dO), then k_full, k_empty, v_full, v_empty of each stage
  static constexpr int kBarCount = 2 + 4 * kStages;
  static constexpr int kDynamicBytes = kBars + kBarCount * 8 + 1024;
};

template <int D>
__device__ __forceinline__ void dq_producer(const BwdParams &p, uint32_t base, uint32_t bars) {
  using L = DqSmem<D>;
  const uint32_t q_full = bars, q_empty = bars + 8;
  uint32_t stage = 0, phase = 0, q_phase = 0;
  for (int32_t t = blockIdx.x; t < p.num_tiles; t = next_tile(t)) {
    const Tile tl = tile_at(p, t);
    const int32_t kv_head = tl.head / p.group;
    wait_bar(q_empty, q_phase ^ 1, p, kWaitQEmpty, 0, t);
    ptx::mbar_arrive_expect_tx(q_full, 2 * L::kTileBytes);
    for (int c = 0; c < D / kBoxCols; c++) {
      ptx::tma_load_4d(base + L::kQ + c * L::kBoxBytes, &p.q_map, q_full, c * kBoxCols, tl.head,
                       tl.m_block * kBlockM, tl.batch);
      ptx::tma_load_4d(base + L::kDO + c * L::kBoxBytes, &p.do_map, q_full, c * kBoxCols, tl.head,
                       tl.m_block * kBlockM, tl.batch);
    }
    q_phase ^= 1;
    for (int32_t n = 0; n < tl.n_blocks; n++) {
      const uint32_t k_full = bars + 16 + 32 * stage, k_empty = k_full + 8;
      const uint32_t v_full = k_full + 16, v_empty = k_full + 24;
      const uint32_t k_dst = base + L::kK + stage * L::kTileBytes;
      const uint32_t v_dst = base + L::kV + stage * L::kTileBytes;
      wait_bar(k_empty, phase ^ 1, p, kWaitKEmpty, stage, t);
      ptx::mbar_arrive_expect_tx(k_full, L::kTileBytes);
      for (int c = 0; c < D / kBoxCols; c++)
        ptx::tma_load_4d(k_dst + c * L::kBoxBytes, &p.k_map, k_full, c * kBoxCols, kv_head,
                         n * kBlockN, tl.batch);
      wait_bar(v_empty, phase ^ 1, p, kWaitVEmpty, stage, t);
      ptx::mbar_arrive_expect_tx(v_full, L::kTileBytes);
      for (int c = 0; c < D / kBoxCols; c++)
        ptx::tma_load_4d(v_dst + c * L::kBoxBytes, &p.v_map, v_full, c * kBoxCols, kv_head,
                         n * kBlockN, tl.batch);
      if (++stage == L::kStages)
        stage = 0, phase ^= 1;
    }
  }
}

// dQ x scale of this thread's two rows of a run (run rows row0 and row0 + 8, those below
// `rows`, at local rows row_base + row) as bf16.
template <int D>
__device__ __forceinline__ void store_dq(const BwdParams &p, int32_t batch, int32_t head,
                                         int32_t row_base, int32_t rows, int32_t row0, int lane,
                                         const float (&dq)[D / 2]) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int32_t row = row0 + 8 * r;
    if (row >= rows)
      continue;
    const int64_t q_row = ((int64_t)batch * p.seq_q + row_base + row) * p.heads_q + head;
    uint32_t *dst = reinterpret_cast<uint32_t *>(p.dq + q_row * D + 2 * (lane % 4));
#pragma unroll
    for (int j = 0; j < D / 8; j++)
      dst[4 * j] = pack_bf16(dq[4 * j + 2 * r] * p.scale, dq[4 * j + 2 * r + 1] * p.scale);
  }
}

// The keys of one KV run as a dq tile sees them: [0, rows), key j visible to row i of the tile's
// Q rows iff j <= delta + i (causal).
struct KeyRun {
  int64_t rows, delta;
};

// The rows a consumer warpgroup owns in a dq tile: its first row, this thread's rows (row0 and
// row0 + 8), their lse (log2 domain) and dsum.
struct DqRows {
  int32_t wg_row, row0;
  float lse2[2], ds[2];
};

// KV block n of a run (stage `stage` of layout L, in phase `phase`) for a warpgroup's rows of
// tile t: S = Q K^T and dP = dO V^T (SS), the run's mask, dS = P (dP - dsum), dQ += dS K (RS).
// Releases the stage's V after dP and its K after dQ, and Q and dO after the tile's last block
// (`last`).
template <int D, class L>
__device__ __forceinline__ void
dq_block(const BwdParams &p, const KeyRun &run, int32_t n, bool last, const DqRows &rw, int lane,
         uint32_t q_lo, uint32_t do_lo, uint32_t base, uint32_t bars, uint32_t stage,
         uint32_t phase, int32_t t, float (&dq)[D / 2]) {
  const uint32_t k_full = bars + 16 + 32 * stage, k_empty = k_full + 8;
  const uint32_t v_full = k_full + 16, v_empty = k_full + 24;
  const uint32_t k_at = base + L::kK + stage * L::kTileBytes;
  float s[64], dp[64];
  wait_bar(k_full, phase, p, kWaitKFull, stage, t);
  qk_gemm<D>(s, q_lo, ptx::wgmma_desc_lo_sw128(k_at));
  wait_bar(v_full, phase, p, kWaitVFull, stage, t);
  qk_gemm<D>(dp, do_lo, ptx::wgmma_desc_lo_sw128(base + L::kV + stage * L::kTileBytes));
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 64; i++)
    ptx::reg_fence(s[i]), ptx::reg_fence(dp[i]);
  if (lane == 0) {
    ptx::mbar_arrive(v_empty);
    if (last)
      ptx::mbar_arrive(bars + 8); // q_empty: Q and dO read by the tile's last S and dP
  }
  const int64_t block_end = (int64_t)n * kBlockN + kBlockN - 1;
  if (block_end >= run.rows || (p.causal && block_end > run.delta + rw.wg_row)) {
    int32_t lim[2];
    row_limits(run.rows, p.causal, run.delta, rw.row0, n, lim);
    apply_mask(s, lim, 2 * (lane % 4));
  }
#pragma unroll
  for (int i = 0; i < 64; i++) { // s becomes dS = P (dP - dsum)
    const int r = (i / 2) % 2;
    s[i] = ptx::ex2_approx(fmaf(s[i], p.scale_log2, -rw.lse2[r])) * (dp[i] - rw.ds[r]);
  }
  uint32_t dsa[32];
  pack_p(s, dsa);
  pv_gemm<D>(dq, dsa, ptx::wgmma_desc_lo_sw128_mn(k_at, L::kBoxBytes));
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    ptx::reg_fence(dq[i]);
  if (lane == 0)
    ptx::mbar_arrive(k_empty);
}

template <int D>
__device__ __forceinline__ void dq_consumer(const BwdParams &p, uint32_t base, uint32_t bars,
                                            int cw, int tid) {
  using L = DqSmem<D>;
  const int warp = tid / 32, lane = tid % 32;
  const uint32_t q_full = bars, q_empty = bars + 8;
  const uint32_t q_lo = ptx::wgmma_desc_lo_sw128(base + L::kQ + cw * 64 * 128);
  const uint32_t do_lo = ptx::wgmma_desc_lo_sw128(base + L::kDO + cw * 64 * 128);
  const KeyRun run{p.seq_kv, p.delta};
  uint32_t stage = 0, phase = 0, q_phase = 0;
  for (int32_t t = blockIdx.x; t < p.num_tiles; t = next_tile(t)) {
    const Tile tl = tile_at(p, t);
    DqRows rw;
    rw.wg_row = tl.m_block * kBlockM + 64 * cw;
    rw.row0 = rw.wg_row + 16 * warp + lane / 4;
    row_stats(p, tl.batch, tl.head, rw.row0, rw.lse2[0], rw.ds[0]);
    row_stats(p, tl.batch, tl.head, rw.row0 + 8, rw.lse2[1], rw.ds[1]);
    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
      dq[i] = 0.f;
    wait_bar(q_full, q_phase, p, kWaitQFull, 0, t);
    q_phase ^= 1;
    if (tl.n_blocks == 0 && lane == 0)
      ptx::mbar_arrive(q_empty);
    for (int32_t n = 0; n < tl.n_blocks; n++) {
      dq_block<D, L>(p, run, n, n == tl.n_blocks - 1, rw, lane, q_lo, do_lo, base, bars, stage,
                     phase, t, dq);
      if (++stage == L::kStages)
        stage = 0, phase ^= 1;
    }
    store_dq<D>(p, tl.batch, tl.head, 0, p.seq_q, rw.row0, lane, dq);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(const __grid_constant__ BwdParams p) {
  run_tile_kernel<DqSmem<D>, BwdParams, dq_producer<D>, dq_consumer<D>>(p);
}

} // namespace attn
} // namespace tw

#include "ops/attention/attention_bwd_dkdv.cuh"
