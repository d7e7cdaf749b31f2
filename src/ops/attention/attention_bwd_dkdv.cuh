/*
 * Internal: the attention backward's dkdv_kernel (attention_bwd.cuh's contract).
 *
 * Fragments (attention_consumer.cuh's layouts) of a consumer warpgroup owning keys
 * key0 .. key0 + 63 of its tile: S^T and dP^T are m64n64 accumulators, thread (warp, lane) holds
 * keys key0 + 16 warp + g + 8 ((i / 2) % 2) and query columns 8 (i / 4) + 2 t + i % 2 of the
 * block (g = lane / 4, t = lane % 4); packed in pairs they are the A operand of the k16 steps
 * over the block's 64 queries (step kk: accumulators 8 kk .. 8 kk + 7), so P^T and dS^T feed the
 * RS wgmmas straight from registers, as the forward's P does.
 */
#pragma once

namespace tw {
namespace attn {

// K and V of a tile, then `Stages` stages of a query block's Q and dO (boxes of 64 columns).
template <int D, int Stages> struct DkvStages {
  static constexpr int kStages = Stages;
  static constexpr int kKvBoxBytes = kBlockN * 128; // K and V: boxes of 128 rows
  static constexpr int kBlockQ = kBwdBlockQ<D>;
  static constexpr int kQBoxBytes = kBlockQ * 128; // Q and dO: boxes of kBlockQ rows
  static constexpr int kKvBytes = (D / kBoxCols) * kKvBoxBytes;
  static constexpr int kQBytes = (D / kBoxCols) * kQBoxBytes;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKvBytes;
  static constexpr int kQ = kV + kKvBytes;
  static constexpr int kDO = kQ + kStages * kQBytes;
  static constexpr int kEnd = kDO + kStages * kQBytes;
  // kv_full, kv_empty, then s_full, s_empty of each stage
  static constexpr int kBarCount = 2 + 2 * kStages;
};

template <int D> struct DkvSmem : DkvStages<D, D == 128 ? 3 : 4> {
  using B = DkvStages<D, D == 128 ? 3 : 4>;
  static constexpr int kStats = B::kEnd; // per consumer: lse2[kBlockQ], dsum[kBlockQ]
  static constexpr int kBars = kStats + 2 * 2 * B::kBlockQ * 4;
  static constexpr int kDynamicBytes = kBars + B::kBarCount * 8 + 1024;
};

struct KvTile {
  int32_t n_block, kv_head, batch;
  int32_t m_first; // the first 64-row query block that sees a key of the tile (causal)
};

template <int D> __device__ __forceinline__ KvTile kv_tile_at(const BwdParams &p, int32_t t) {
  KvTile tl;
  tl.n_block = t % p.n_tiles;
  const int32_t bh = t / p.n_tiles;
  tl.kv_head = bh % p.heads_kv;
  tl.batch = bh / p.heads_kv;
  tl.m_first = 0;
  if (p.causal) { // query i sees key j iff j <= delta + i: i >= n_block 128 - delta
    const int64_t first_row = (int64_t)tl.n_block * kBlockN - p.delta;
    tl.m_first = (int32_t)min((int64_t)p.q_blocks, max((int64_t)0, first_row / kBwdBlockQ<D>));
  }
  return tl;
}

// The (q head, query block) items of a tile, in order: every head of the group, each from
// m_first on.
__device__ __forceinline__ int32_t kv_items(const BwdParams &p, const KvTile &tl) {
  return p.group * (p.q_blocks - tl.m_first);
}

// Warpgroup 0's thread 0 of a kernel of layout L (DkvSmem<D>'s K, V and Q / dO stages at
// least): each tile's K and V, then Q and dO of each of its query blocks into the stages.
template <int D, class L = DkvSmem<D>>
__device__ __forceinline__ void dkdv_producer(const BwdParams &p, uint32_t base, uint32_t bars) {
  const uint32_t kv_full = bars, kv_empty = bars + 8;
  uint32_t stage = 0, phase = 0, kv_phase = 0;
  for (int32_t t = blockIdx.x; t < p.num_kv_tiles; t = next_tile(t)) {
    const KvTile tl = kv_tile_at<D>(p, t);
    wait_bar(kv_empty, kv_phase ^ 1, p, kWaitKEmpty, 0, t);
    ptx::mbar_arrive_expect_tx(kv_full, 2 * L::kKvBytes);
    for (int c = 0; c < D / kBoxCols; c++) {
      ptx::tma_load_4d(base + L::kK + c * L::kKvBoxBytes, &p.k_map, kv_full, c * kBoxCols,
                       tl.kv_head, tl.n_block * kBlockN, tl.batch);
      ptx::tma_load_4d(base + L::kV + c * L::kKvBoxBytes, &p.v_map, kv_full, c * kBoxCols,
                       tl.kv_head, tl.n_block * kBlockN, tl.batch);
    }
    kv_phase ^= 1;
    const int32_t per_head = p.q_blocks - tl.m_first;
    for (int32_t it = 0; it < kv_items(p, tl); it++) {
      const int32_t head = tl.kv_head * p.group + it / per_head;
      const int32_t m = tl.m_first + it % per_head;
      const uint32_t s_full = bars + 16 + 16 * stage, s_empty = s_full + 8;
      wait_bar(s_empty, phase ^ 1, p, kWaitQEmpty, stage, t);
      ptx::mbar_arrive_expect_tx(s_full, 2 * L::kQBytes);
      for (int c = 0; c < D / kBoxCols; c++) {
        ptx::tma_load_4d(base + L::kQ + stage * L::kQBytes + c * L::kQBoxBytes, &p.q64_map, s_full,
                         c * kBoxCols, head, m * L::kBlockQ, tl.batch);
        ptx::tma_load_4d(base + L::kDO + stage * L::kQBytes + c * L::kQBoxBytes, &p.do64_map,
                         s_full, c * kBoxCols, head, m * L::kBlockQ, tl.batch);
      }
      if (++stage == L::kStages)
        stage = 0, phase ^= 1;
    }
  }
}

// acc = A B^T over K = D for this warpgroup's 64 rows of A and N rows of B (m64nNk16 steps,
// committed, not waited for): A's boxes a_box bytes apart, B's b_box; a 16-column step adds 32
// bytes.
template <int D, int N>
__device__ __forceinline__ void nt_gemm(float (&acc)[N / 2], uint32_t a_lo, int a_box,
                                        uint32_t b_lo, int b_box) {
#pragma unroll
  for (int i = 0; i < N / 2; i++)
    ptx::reg_fence(acc[i]);
  ptx::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++) {
    const uint32_t a_off = (uint32_t)((ks / 4) * a_box + (ks % 4) * 32) >> 4;
    const uint32_t b_off = (uint32_t)((ks / 4) * b_box + (ks % 4) * 32) >> 4;
    ptx::wgmma_bf16<N>(acc, ptx::wgmma_desc_from_lo(a_lo + a_off),
                       ptx::wgmma_desc_from_lo(b_lo + b_off), ks > 0);
  }
  ptx::wgmma_commit();
}

// acc += X B over K = the block's N queries: X's N / 16 k16 steps from registers, B (N rows x
// D, MN-major: 16-row steps 16 x 128 bytes apart, its 64-column boxes kQBoxBytes apart).
template <int D, int N>
__device__ __forceinline__ void tn_gemm(float (&acc)[D / 2], uint32_t (&x)[N / 4], uint32_t b_lo) {
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    ptx::reg_fence(acc[i]);
#pragma unroll
  for (int i = 0; i < N / 4; i++)
    ptx::reg_fence(x[i]);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < N / 16; kk++) {
    const uint32_t a[4] = {x[4 * kk], x[4 * kk + 1], x[4 * kk + 2], x[4 * kk + 3]};
    ptx::wgmma_rs_bf16_tb<D>(acc, a, ptx::wgmma_desc_from_lo(b_lo + ((kk * 16 * 128) >> 4)), 1);
  }
  ptx::wgmma_commit();
}

// dK x scale and dV of this thread's two keys of a segment (segment keys key0 and key0 + 8,
// those below `rows`, at local rows row_base + key) of (batch, kv head) as bf16.
template <int D>
__device__ __forceinline__ void store_dkdv(const BwdParams &p, int32_t batch, int32_t kv_head,
                                           int32_t row_base, int32_t rows, int32_t key0, int lane,
                                           const float (&dk)[D / 2], const float (&dv)[D / 2]) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int32_t key = key0 + 8 * r;
    if (key >= rows)
      continue;
    const int64_t at =
        (((int64_t)batch * p.seq_kv + row_base + key) * p.heads_kv + kv_head) * D + 2 * (lane % 4);
    uint32_t *k_dst = reinterpret_cast<uint32_t *>(p.dk + at);
    uint32_t *v_dst = reinterpret_cast<uint32_t *>(p.dv + at);
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
      k_dst[4 * j] = pack_bf16(dk[4 * j + 2 * r] * p.scale, dk[4 * j + 2 * r + 1] * p.scale);
      v_dst[4 * j] = pack_bf16(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
    }
  }
}

// P^T of one block of N queries in place (st), packed as the dV GEMM's A operand: query columns
// past the run (their lse2 +inf) and (causal) keys a query cannot see (key j, query i:
// j > delta + i) get P = 0. stats: the block's lse2[N] then dsum[N].
template <int N>
__device__ __forceinline__ void block_p(const BwdParams &p, int64_t delta, float (&st)[N / 2],
                                        const float *stats, int32_t key_r, int32_t q0, int lane,
                                        uint32_t (&pa)[N / 4]) {
  const bool mask = p.causal && (int64_t)key_r + 8 > delta + q0; // some pair may be hidden
#pragma unroll
  for (int i = 0; i < N / 2; i++) {
    const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
    const int32_t key = key_r + 8 * ((i / 2) % 2);
    st[i] = ptx::ex2_approx(fmaf(st[i], p.scale_log2, -stats[col]));
    if (mask && (int64_t)key > delta + q0 + col)
      st[i] = 0.f;
  }
#pragma unroll
  for (int k = 0; k < N / 4; k++)
    pa[k] = pack_bf16(st[2 * k], st[2 * k + 1]);
}

// dS^T = P^T (dP^T - dsum) packed as the dK GEMM's A operand, P^T read back from its bf16 pairs
// (pa): the fp32 P^T is not kept, so the dV and dP^T GEMMs can run together within the
// consumers' registers; dS is rounded to bf16 for its GEMM either way.
template <int N>
__device__ __forceinline__ void block_ds(const float (&dpt)[N / 2], const uint32_t (&pa)[N / 4],
                                         const float *stats, int lane, uint32_t (&dsa)[N / 4]) {
#pragma unroll
  for (int k = 0; k < N / 4; k++) {
    const int col = 8 * ((2 * k) / 4) + 2 * (lane % 4); // the pair's first column
    const float p0 = __uint_as_float(pa[k] << 16), p1 = __uint_as_float(pa[k] & 0xffff0000u);
    dsa[k] =
        pack_bf16(p0 * (dpt[2 * k] - stats[N + col]), p1 * (dpt[2 * k + 1] - stats[N + col + 1]));
  }
}

// The queries of one Q run as a dkdv tile sees them: the lse and dsum of its (batch, q head)
// with run row i at [i] (rows [0, rows) valid), key j of the tile's keys visible to query i iff
// j <= delta + i (causal).
struct QueryRun {
  const float *lse, *dsum;
  int32_t rows;
  int64_t delta;
};

// The first part of the query block at run row q0 (layout L's stage `stage`, in phase `phase`)
// for a consumer warpgroup's keys (this thread's key_r and key_r + 8) of tile t: the block's
// stats into the warpgroup's shared `stats`, S^T = K Q^T (SS), P^T, dV += P^T dO (RS) with
// dP^T = V dO^T (SS), and dS^T packed into dsa. kTail: keys at or past seq_kv (the tile's
// zero-filled tail) get P = 0 too, for a kernel whose dQ GEMM multiplies dS by K's rows there
// (exp of a score of 0 can overflow, and inf x 0 is NaN); dK and dV never store them.
template <int D, class L, bool kTail>
__device__ __forceinline__ void
dkdv_front(const BwdParams &p, const QueryRun &run, int32_t q0, int32_t key_r, float *stats, int cw,
           int tid, uint32_t k_lo, uint32_t v_lo, uint32_t base, uint32_t bars, uint32_t stage,
           uint32_t phase, int32_t t, float (&dv)[D / 2], uint32_t (&dsa)[L::kBlockQ / 4]) {
  const int lane = tid % 32;
  const uint32_t s_full = bars + 16 + 16 * stage;
  const uint32_t q_at = base + L::kQ + stage * L::kQBytes;
  const uint32_t do_at = base + L::kDO + stage * L::kQBytes;
  ptx::named_bar_sync(1 + cw, 128); // the previous block's stats are read
  if (tid < L::kBlockQ)
    row_stats_at(run.lse, run.dsum, q0 + tid, q0 + tid < run.rows, stats[tid],
                 stats[L::kBlockQ + tid]);
  ptx::named_bar_sync(1 + cw, 128);
  constexpr int N = L::kBlockQ;
  float st[N / 2], dpt[N / 2];
  uint32_t pa[N / 4];
  wait_bar(s_full, phase, p, kWaitQFull, stage, t);
  nt_gemm<D, N>(st, k_lo, L::kKvBoxBytes, ptx::wgmma_desc_lo_sw128(q_at), L::kQBoxBytes);
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; i++)
    ptx::reg_fence(st[i]);
  block_p<N>(p, run.delta, st, stats, key_r, q0, lane, pa);
  if constexpr (kTail) {
    if (key_r + 8 >= p.seq_kv) {
#pragma unroll
      for (int k = 0; k < N / 4; k++)
        if (key_r + 8 * (k % 2) >= p.seq_kv)
          pa[k] = 0u;
    }
  }
  tn_gemm<D, N>(dv, pa, ptx::wgmma_desc_lo_sw128_mn(do_at, L::kQBoxBytes));
  nt_gemm<D, N>(dpt, v_lo, L::kKvBoxBytes, ptx::wgmma_desc_lo_sw128(do_at), L::kQBoxBytes);
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; i++)
    ptx::reg_fence(dpt[i]);
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    ptx::reg_fence(dv[i]);
  block_ds<N>(dpt, pa, stats, lane, dsa);
}

// The query block at run row q0 (DkvSmem<D>::kBlockQ rows; stage `stage`, in phase `phase`) for a
// consumer warpgroup's keys of tile t: dkdv_front, then dK += dS^T Q (RS). Releases the stage
// after dK.
template <int D>
__device__ __forceinline__ void
dkdv_block(const BwdParams &p, const QueryRun &run, int32_t q0, int32_t key_r, float *stats, int cw,
           int tid, uint32_t k_lo, uint32_t v_lo, uint32_t base, uint32_t bars, uint32_t stage,
           uint32_t phase, int32_t t, float (&dk)[D / 2], float (&dv)[D / 2]) {
  using L = DkvSmem<D>;
  constexpr int N = L::kBlockQ;
  uint32_t dsa[N / 4];
  dkdv_front<D, L, false>(p, run, q0, key_r, stats, cw, tid, k_lo, v_lo, base, bars, stage, phase,
                          t, dv, dsa);
  const uint32_t q_at = base + L::kQ + stage * L::kQBytes;
  tn_gemm<D, N>(dk, dsa, ptx::wgmma_desc_lo_sw128_mn(q_at, L::kQBoxBytes));
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < D / 2; i++)
    ptx::reg_fence(dk[i]), ptx::reg_fence(dv[i]);
  if (tid % 32 == 0)
    ptx::mbar_arrive(bars + 16 + 16 * stage + 8); // s_empty
}

// A consumer warpgroup's tiles in a kernel of layout L: per tile, dK and dV zeroed, K and V
// awaited, then for each of its query blocks block(run, q head, m, key_r, stage, phase, t, dk,
// dv) (key_r: this thread's first key; the block releases its stage), K and V released, and dK,
// dV stored.
template <int D, class L, class Block>
__device__ __forceinline__ void kv_tile_loop(const BwdParams &p, uint32_t bars, int cw, int tid,
                                             Block &&block) {
  const int warp = tid / 32, lane = tid % 32;
  const uint32_t kv_full = bars, kv_empty = bars + 8;
  uint32_t stage = 0, phase = 0, kv_phase = 0;
  for (int32_t t = blockIdx.x; t < p.num_kv_tiles; t = next_tile(t)) {
    const KvTile tl = kv_tile_at<D>(p, t);
    const int32_t key_r = tl.n_block * kBlockN + 64 * cw + 16 * warp + lane / 4; // and + 8
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
      dk[i] = 0.f, dv[i] = 0.f;
    wait_bar(kv_full, kv_phase, p, kWaitKFull, 0, t);
    kv_phase ^= 1;
    const int32_t per_head = p.q_blocks - tl.m_first, items = kv_items(p, tl);
    for (int32_t it = 0; it < items; it++) {
      const int32_t head = tl.kv_head * p.group + it / per_head;
      const int64_t at = ((int64_t)tl.batch * p.heads_q + head) * p.seq_q;
      const QueryRun run{p.lse + at, p.dsum + at, p.seq_q, p.delta};
      block(run, tl.batch, head, tl.m_first + it % per_head, key_r, stage, phase, t, dk, dv);
      if (++stage == L::kStages)
        stage = 0, phase ^= 1;
    }
    if (lane == 0)
      ptx::mbar_arrive(kv_empty); // K and V: read by the tile's last block
    store_dkdv<D>(p, tl.batch, tl.kv_head, 0, p.seq_kv, key_r, lane, dk, dv);
  }
}

template <int D>
__device__ __forceinline__ void dkdv_consumer(const BwdParams &p, uint32_t base, uint32_t bars,
                                              float *stats, int cw, int tid) {
  using L = DkvSmem<D>;
  const uint32_t k_lo = ptx::wgmma_desc_lo_sw128(base + L::kK + cw * 64 * 128);
  const uint32_t v_lo = ptx::wgmma_desc_lo_sw128(base + L::kV + cw * 64 * 128);
  kv_tile_loop<D, L>(p, bars, cw, tid,
                     [&](const QueryRun &run, int32_t, int32_t, int32_t m, int32_t key_r,
                         uint32_t stage, uint32_t phase, int32_t t, float(&dk)[D / 2],
                         float(&dv)[D / 2]) {
                       dkdv_block<D>(p, run, m * L::kBlockQ, key_r, stats, cw, tid, k_lo, v_lo,
                                     base, bars, stage, phase, t, dk, dv);
                     });
}

// Thread 0 (the CTA synchronises after): DkvSmem's barriers at shared address `bars` (kv_full,
// kv_empty, then s_full, s_empty of each of `stages` stages).
__device__ __forceinline__ void init_dkdv_bars(uint8_t *smem_raw, uint32_t bars, int stages) {
  uint64_t *bar = reinterpret_cast<uint64_t *>(smem_raw + (bars - ptx::smem_u32(smem_raw)));
  ptx::mbar_init(&bar[0], 1); // kv_full
  ptx::mbar_init(&bar[1], 8); // kv_empty
  for (int s = 0; s < stages; s++) {
    ptx::mbar_init(&bar[2 + 2 * s], 1);     // s_full
    ptx::mbar_init(&bar[2 + 2 * s + 1], 8); // s_empty
  }
  ptx::mbar_init_fence();
}

// The roles of a kernel of layout L (DkvSmem<D>'s or one with its kStats and kBlockQ), its
// barriers initialised: warpgroup 0's thread 0 runs Producer(p, base, bars), warpgroups 1 and 2
// Consumer(p, base, bars, their stats, consumer index, thread of the warpgroup).
template <int D, class P, void (*Producer)(const P &, uint32_t, uint32_t),
          void (*Consumer)(const P &, uint32_t, uint32_t, float *, int, int), class L = DkvSmem<D>>
__device__ __forceinline__ void run_dkdv_roles(const P &p, uint8_t *smem_raw, uint32_t base,
                                               uint32_t bars) {
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0)
      Producer(p, base, bars);
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    uint8_t *aligned = smem_raw + (base - ptx::smem_u32(smem_raw));
    float *stats = reinterpret_cast<float *>(aligned + L::kStats) + (wg - 1) * 2 * L::kBlockQ;
    Consumer(p, base, bars, stats, wg - 1, threadIdx.x % 128);
  }
}

// The body of a BwdParams kernel of layout L (DkvSmem<D>'s barriers at kBars, its stats at
// kStats): the barriers, then dkdv_producer<D, L> and Consumer in their warpgroups.
template <int D, class L,
          void (*Consumer)(const BwdParams &, uint32_t, uint32_t, float *, int, int)>
__device__ __forceinline__ void run_dkdv_kernel(const BwdParams &p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t bars = base + L::kBars;
  if (threadIdx.x == 0)
    init_dkdv_bars(smem_raw, bars, L::kStages);
  __syncthreads();
  run_dkdv_roles<D, BwdParams, dkdv_producer<D, L>, Consumer, L>(p, smem_raw, base, bars);
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel(const __grid_constant__ BwdParams p) {
  run_dkdv_kernel<D, DkvSmem<D>, dkdv_consumer<D>>(p);
}

} // namespace attn
} // namespace tw
