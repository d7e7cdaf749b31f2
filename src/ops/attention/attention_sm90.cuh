/*
 * Internal (ops layer): tw_attention's persistent forward kernel (FlashAttention-3 structure).
 *
 * Contract:
 *   Grid     min(SMs, tiles) CTAs of kThreads threads, AttnSmem<D>::kDynamicBytes of dynamic
 *            shared memory; the CTAs run the tiles (128-row Q block, q head, batch; tile_at)
 *            in passes of one tile each, snaking across the CTAs (next_tile).
 *   Roles    warpgroup 0 is the producer: one thread issues every TMA load (Q once a tile,
 *            then K and V of each visible 128-row KV block into a ring of kStages stages);
 *            warpgroups 1 and 2 are consumers, each owning 64 of the tile's 128 query rows
 *            (the rows of its wgmma m64 fragments) and the whole KV loop for them. Each
 *            issues block n's S behind block n - 1's PV and runs n's softmax while that PV
 *            runs; the two take turns issuing their GEMMs (named barriers kTurnBar + 0/1,
 *            attention_consumer.cuh).
 *   Barriers q_full / k_full[s] / v_full[s]: the loads' bytes (expect_tx, one arrival);
 *            q_empty / k_empty[s] / v_empty[s]: lane 0 of each of the 8 consumer warps after
 *            its warpgroup's last wgmma reading the buffer has completed. Every wait is bounded
 *            (AttnParams::timeout_ns): an expired one records what it waited for and traps.
 *   Math     S = Q K^T (SS wgmma m64n128k16, Q and K K-major, 128B swizzle); masking (the KV
 *            tail and the causal diagonal) only on the KV blocks that need it; online softmax
 *            in the log2 domain; O += P V with P (bf16) from registers as the A operand (RS
 *            wgmma m64nDk16) and V an MN-major operand (imm-trans-b); O / l stored from
 *            registers; lse = m ln 2 + ln l (natural log), -inf and O = 0 for a row no key
 *            reaches.
 * The derivations (fragment layouts, the V descriptor) are in docs/ARCHITECTURE.md.
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "device/ptx_sm90.cuh"

namespace tw {
namespace attn {

constexpr int kThreads = 384;
constexpr int kBlockM = 128; // query rows of a tile: 64 per consumer warpgroup
constexpr int kBlockN = 128; // key rows of a KV stage
constexpr int kBoxCols = 64; // a TMA box is 64 head-dim columns (128 bytes, the swizzle span)
constexpr uint32_t kProducerRegs = 40;
// 384 threads launch with 168 registers each; setmaxnreg.inc stalls until registers are free,
// so the producer's release, 128 x (168 - 40), must cover the consumers' raise, 256 x (232 -
// 168): every kernel of this shape (the backward's too) keeps exactly these two values.
constexpr uint32_t kConsumerRegs = 232;
constexpr uint64_t kTimeoutDefaultNs = 30ull * 1000 * 1000 * 1000;

struct AttnParams {
  CUtensorMap q_map, k_map, v_map; // 4D {head_dim, heads, seq, batch}, box {64, 1, 128, 1}
  __nv_bfloat16 *o;                // [batch, seq_q, heads_q, head_dim]
  float *lse;                      // [batch, heads_q, seq_q] or NULL
  int32_t batch, heads_q, seq_q, seq_kv;
  int32_t group;   // heads_q / heads_kv: q head h reads kv head h / group
  int32_t m_tiles; // ceil(seq_q / 128)
  int32_t num_tiles;
  int32_t causal;
  // q_offset - kv_offset: key j is visible to query i iff j <= delta + i (causal).
  int64_t delta;
  float scale_log2; // softmax_scale * log2(e)
  uint64_t timeout_ns;
};

template <int D> struct AttnSmem {
  static constexpr int kStages = D == 128 ? 2 : 4;
  static constexpr int kBoxes = D / kBoxCols;
  static constexpr int kBoxBytes = kBlockN * 128; // 128 rows x 128 bytes (Q's boxes too)
  static constexpr int kTileBytes = kBoxes * kBoxBytes;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kTileBytes;
  static constexpr int kV = kK + kStages * kTileBytes;
  static constexpr int kBars = kV + kStages * kTileBytes;
  // q_full, q_empty, then k_full, k_empty, v_full, v_empty of each stage
  static constexpr int kBarCount = 2 + 4 * kStages;
  static constexpr int kDynamicBytes = kBars + kBarCount * 8 + 1024; // + alignment slack
};

// What an expired wait was waiting for (the report's words).
enum { kWaitQEmpty, kWaitKEmpty, kWaitVEmpty, kWaitQFull, kWaitKFull, kWaitVFull };

// The last expired wait of the process (for a debugger: the kernel traps right after, and a
// trap leaves no channel to the host): what, stage, tile, CTA.
__device__ int32_t g_attn_stuck[4];

__device__ __forceinline__ void report_stuck(int what, int stage, int32_t tile) {
  volatile int32_t *rec = g_attn_stuck;
  rec[0] = what, rec[1] = stage, rec[2] = tile, rec[3] = (int32_t)blockIdx.x;
  __threadfence_system();
  __trap();
}

// P: AttnParams or the backward's BwdParams (timeout_ns).
template <class P>
__device__ __forceinline__ void wait_bar(uint32_t bar, uint32_t parity, const P &p, int what,
                                         int stage, int32_t tile) {
  if (!ptx::mbar_wait_for(bar, parity, p.timeout_ns))
    report_stuck(what, stage, tile);
}

struct Tile {
  int32_t m_block, head, batch;
  int32_t n_blocks; // KV blocks with a visible key (0: every row of the tile is dead)
};

// Tile t: the m blocks of one (batch, head) are consecutive, so CTAs running at once share
// that head's K and V in L2; causal tiles take each head's m blocks longest first. P:
// AttnParams or BwdParams (m_tiles, heads_q, seq_q, seq_kv, causal, delta).
template <class P> __device__ __forceinline__ Tile tile_at(const P &p, int32_t t) {
  Tile tl;
  const int32_t mb = t % p.m_tiles;
  const int32_t bh = t / p.m_tiles;
  tl.m_block = p.causal ? p.m_tiles - 1 - mb : mb;
  tl.head = bh % p.heads_q;
  tl.batch = bh / p.heads_q;
  int64_t end = p.seq_kv; // keys [0, end) may be visible to some row of the tile
  if (p.causal) {
    const int64_t last_row = min((int64_t)tl.m_block * kBlockM + kBlockM - 1, (int64_t)p.seq_q - 1);
    end = min(end, max((int64_t)0, p.delta + last_row + 1));
  }
  tl.n_blocks = (int32_t)((end + kBlockN - 1) / kBlockN);
  return tl;
}

// The static schedule over a kernel's tiles: the CTA's tile on pass k is k G + c on even passes
// and k G + G - 1 - c on odd ones (c = blockIdx.x, G = gridDim.x), a snake over the tile order,
// so that tiles of falling length (causal, longest first) even out across the CTAs (a plain
// round robin leaves the CTA of the longest tiles up to 14% over the mean), while each pass
// still runs G consecutive tiles at once (the heads they share stay in L2). A CTA's first tile
// is blockIdx.x; the one after t is next_tile(t); past the last tile (t >= the count), so is
// every later one. Usage: for (int32_t t = blockIdx.x; t < n; t = next_tile(t)).
__device__ __forceinline__ int32_t next_tile(int32_t t) {
  const int32_t g = (int32_t)gridDim.x, k = t / g + 1;
  return k * g + (k % 2 == 0 ? (int32_t)blockIdx.x : g - 1 - (int32_t)blockIdx.x);
}

// Warpgroup 0's thread 0: every load of every tile of this CTA, in the consumers' order.
template <int D>
__device__ __forceinline__ void producer_loop(const AttnParams &p, uint32_t base, uint32_t bars) {
  using L = AttnSmem<D>;
  ptx::tma_prefetch_map(&p.q_map);
  ptx::tma_prefetch_map(&p.k_map);
  ptx::tma_prefetch_map(&p.v_map);
  const uint32_t q_full = bars, q_empty = bars + 8;
  uint32_t stage = 0, phase = 0, q_phase = 0;
  for (int32_t t = blockIdx.x; t < p.num_tiles; t = next_tile(t)) {
    const Tile tl = tile_at(p, t);
    const int32_t kv_head = tl.head / p.group;
    wait_bar(q_empty, q_phase ^ 1, p, kWaitQEmpty, 0, t);
    ptx::mbar_arrive_expect_tx(q_full, L::kTileBytes);
    for (int c = 0; c < L::kBoxes; c++)
      ptx::tma_load_4d(base + L::kQ + c * L::kBoxBytes, &p.q_map, q_full, c * kBoxCols, tl.head,
                       tl.m_block * kBlockM, tl.batch);
    q_phase ^= 1;
    for (int32_t n = 0; n < tl.n_blocks; n++) {
      const uint32_t k_full = bars + 16 + 32 * stage, k_empty = k_full + 8;
      const uint32_t v_full = k_full + 16, v_empty = k_full + 24;
      wait_bar(k_empty, phase ^ 1, p, kWaitKEmpty, stage, t);
      ptx::mbar_arrive_expect_tx(k_full, L::kTileBytes);
      const uint32_t k_dst = base + L::kK + stage * L::kTileBytes;
      for (int c = 0; c < L::kBoxes; c++)
        ptx::tma_load_4d(k_dst + c * L::kBoxBytes, &p.k_map, k_full, c * kBoxCols, kv_head,
                         n * kBlockN, tl.batch);
      wait_bar(v_empty, phase ^ 1, p, kWaitVEmpty, stage, t);
      ptx::mbar_arrive_expect_tx(v_full, L::kTileBytes);
      const uint32_t v_dst = base + L::kV + stage * L::kTileBytes;
      for (int c = 0; c < L::kBoxes; c++)
        ptx::tma_load_4d(v_dst + c * L::kBoxBytes, &p.v_map, v_full, c * kBoxCols, kv_head,
                         n * kBlockN, tl.batch);
      if (++stage == L::kStages)
        stage = 0, phase ^= 1;
    }
  }
}

} // namespace attn
} // namespace tw

#include "ops/attention/attention_consumer.cuh"

namespace tw {
namespace attn {

// Thread 0 (the CTA synchronises after): the barriers of a Q-tile kernel at shared address
// `bars` (q_full, q_empty, then k_full, k_empty, v_full, v_empty of each of `stages` stages: one
// arrival for a load's bytes, the 8 consumer warps' for a release).
__device__ __forceinline__ void init_tile_bars(uint8_t *smem_raw, uint32_t bars, int stages) {
  uint64_t *bar = reinterpret_cast<uint64_t *>(smem_raw + (bars - ptx::smem_u32(smem_raw)));
  ptx::mbar_init(&bar[0], 1); // q_full
  ptx::mbar_init(&bar[1], 8); // q_empty
  for (int s = 0; s < stages; s++) {
    ptx::mbar_init(&bar[2 + 4 * s], 1);     // k_full
    ptx::mbar_init(&bar[2 + 4 * s + 1], 8); // k_empty
    ptx::mbar_init(&bar[2 + 4 * s + 2], 1); // v_full
    ptx::mbar_init(&bar[2 + 4 * s + 3], 8); // v_empty
  }
  ptx::mbar_init_fence();
}

// The body of a Q-tile kernel (shared-memory layout L, parameters P): the barriers, then
// warpgroup 0's thread 0 runs Producer(p, base, bars) and warpgroups 1 and 2
// Consumer(p, base, bars, consumer index, thread of the warpgroup).
template <class L, class P, void (*Producer)(const P &, uint32_t, uint32_t),
          void (*Consumer)(const P &, uint32_t, uint32_t, int, int)>
__device__ __forceinline__ void run_tile_kernel(const P &p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t bars = base + L::kBars;
  if (threadIdx.x == 0)
    init_tile_bars(smem_raw, bars, L::kStages);
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0)
      Producer(p, base, bars);
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    Consumer(p, base, bars, wg - 1, threadIdx.x % 128);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    attention_kernel(const __grid_constant__ AttnParams p) {
  run_tile_kernel<AttnSmem<D>, AttnParams, producer_loop<D>, consumer_loop<D>>(p);
}

} // namespace attn
} // namespace tw
