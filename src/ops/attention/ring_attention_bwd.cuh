/*
 * Internal (ops layer): tw_ring_attention_backward's kernels (contract in tilewire.h; the design
 * in docs/ARCHITECTURE.md, "Ring attention backward"). On the rank's launch stream, in order:
 *
 *   dsum_kernel       attention_bwd.cuh's, on this rank's o and dout, into its symmetric
 *                     workspace (peers read it).
 *   ring_dkdv_kernel  enters the call and waits for every peer's entry (their q, dout, lse, dsum,
 *                     k and v, written before it, are then complete), then dK and dV of this
 *                     rank's keys from every rank's queries: a tile is a 128-key block of one of
 *                     this rank's segments, one kv head, one batch; its items are, for every
 *                     rank's Q segment in ring order from this rank's (a Q run), every q head of
 *                     the group and every 64-row block of the run that sees a key of the tile:
 *                     Q and dO through the owner's tensor maps, lse and dsum read from the
 *                     owner's memory, the math dkdv_kernel's (dkdv_block) with the run's delta.
 *   ring_dq_kernel    dQ of this rank's queries from every rank's keys: ring_attention_kernel's
 *                     tiles and KV runs (ring_producer, with dO), the math dq_kernel's
 *                     (dq_block); then every CTA counts out with release and the last waits
 *                     until every peer released this rank's buffers (ring_exit), ending the call.
 *
 * Each rank computes the gradients of its own shard only, by reading the peers' inputs in place:
 * nothing is reduced across ranks, so no partial dK / dV travels and the sums run in a fixed
 * order (deterministic). The peers' buffers are read-only in the call. A failed entry wait
 * leaves the channel unusable (or its entry check fails again in ring_dq_kernel): both kernels
 * then skip their tiles and the call still ends.
 */
#pragma once

#include "ops/attention/attention_bwd.cuh"
#include "ops/attention/ring_attention.cuh"

namespace tw {
namespace attn {

struct RingBwdParams {
  RingParams r; // this rank's q (q_map), every rank's k and v (maps), the segments, a.lse (ours)
  BwdParams b;  // o, dout, lse, dsum of this rank, dq, dk, dv, shapes (seq_q = seq_kv =
                // seq_local), group, causal, scale, timeout; its maps are not used
  CUtensorMap do_map;                   // this rank's dout, 128-row boxes (dq)
  CUtensorMap q64_maps[kRingMaxWorld];  // rank r's q, 64-row boxes (dkdv)
  CUtensorMap do64_maps[kRingMaxWorld]; // rank r's dout, 64-row boxes (dkdv)
  const float *lse[kRingMaxWorld];      // rank r's lse (mapped here)
  const float *dsum[kRingMaxWorld];     // rank r's dsum, its workspace (mapped here)
  int32_t num_kv_tiles;                 // r.a.m_tiles x heads_kv x batch
};

struct RingKvTile {
  int32_t seg, n_block, kv_head, batch; // 128-key block n_block of this rank's segment seg
};

// Tile t: a (batch, kv head)'s key blocks consecutive, segment 0's first.
__device__ __forceinline__ RingKvTile ring_kv_tile_at(const RingBwdParams &p, int32_t t) {
  RingKvTile tl;
  const int32_t nb = t % p.r.a.m_tiles;
  const int32_t bh = t / p.r.a.m_tiles;
  tl.seg = nb < p.r.q_tiles[0] ? 0 : 1;
  tl.n_block = nb - (tl.seg ? p.r.q_tiles[0] : 0);
  tl.kv_head = bh % p.b.heads_kv;
  tl.batch = bh / p.b.heads_kv;
  return tl;
}

// Q run j of a tile (rank segment r.kv_segs[j] as queries): its kBwdBlockQ-row blocks
// [first, blocks)
// that see a key of the tile, and delta (key k of the tile's segment is visible to query i of
// the run iff k <= delta + i).
struct QRun {
  int32_t first, blocks;
  int64_t delta;
};

template <int D>
__device__ __forceinline__ QRun q_run(const RingBwdParams &p, const RingKvTile &tl, int j) {
  constexpr int kQ = kBwdBlockQ<D>;
  const RingSeg &q = p.r.kv_segs[j], &k = p.r.q_segs[tl.seg];
  QRun r;
  r.delta = q.pos - k.pos;
  r.blocks = (q.rows + kQ - 1) / kQ;
  r.first = 0;
  if (p.b.causal) { // query i sees the tile's first key iff i >= n_block 128 - delta
    const int64_t first_row = (int64_t)tl.n_block * kBlockN - r.delta;
    r.first = (int32_t)min((int64_t)r.blocks, max((int64_t)0, first_row / kQ));
  }
  return r;
}

template <int D>
__device__ __forceinline__ void ring_dkdv_producer(const RingBwdParams &p, uint32_t base,
                                                   uint32_t bars) {
  using L = DkvSmem<D>;
  const uint32_t kv_full = bars, kv_empty = bars + 8;
  const int rank = p.r.q_segs[0].rank;
  uint32_t stage = 0, phase = 0, kv_phase = 0;
  for (int32_t t = blockIdx.x; t < p.num_kv_tiles; t = next_tile(t)) {
    const RingKvTile tl = ring_kv_tile_at(p, t);
    const int32_t key_row = p.r.q_segs[tl.seg].row0 + tl.n_block * kBlockN;
    wait_bar(kv_empty, kv_phase ^ 1, p.b, kWaitKEmpty, 0, t);
    ptx::mbar_arrive_expect_tx(kv_full, 2 * L::kKvBytes);
    for (int c = 0; c < D / kBoxCols; c++) {
      ptx::tma_load_4d(base + L::kK + c * L::kKvBoxBytes, &p.r.k_maps[rank], kv_full, c * kBoxCols,
                       tl.kv_head, key_row, tl.batch);
      ptx::tma_load_4d(base + L::kV + c * L::kKvBoxBytes, &p.r.v_maps[rank], kv_full, c * kBoxCols,
                       tl.kv_head, key_row, tl.batch);
    }
    kv_phase ^= 1;
    for (int j = 0; j < p.r.n_kv_segs; j++) {
      const QRun qr = q_run<D>(p, tl, j);
      const RingSeg &q = p.r.kv_segs[j];
      const CUtensorMap *q_map = &p.q64_maps[q.rank], *do_map = &p.do64_maps[q.rank];
      for (int32_t h = 0; h < p.b.group; h++) {
        const int32_t head = tl.kv_head * p.b.group + h;
        for (int32_t m = qr.first; m < qr.blocks; m++) {
          const uint32_t s_full = bars + 16 + 16 * stage, s_empty = s_full + 8;
          const int32_t row = q.row0 + m * L::kBlockQ;
          wait_bar(s_empty, phase ^ 1, p.b, kWaitQEmpty, stage, t);
          ptx::mbar_arrive_expect_tx(s_full, 2 * L::kQBytes);
          for (int c = 0; c < D / kBoxCols; c++) {
            ptx::tma_load_4d(base + L::kQ + stage * L::kQBytes + c * L::kQBoxBytes, q_map, s_full,
                             c * kBoxCols, head, row, tl.batch);
            ptx::tma_load_4d(base + L::kDO + stage * L::kQBytes + c * L::kQBoxBytes, do_map, s_full,
                             c * kBoxCols, head, row, tl.batch);
          }
          if (++stage == L::kStages)
            stage = 0, phase ^= 1;
        }
      }
    }
  }
}

template <int D>
__device__ __forceinline__ void ring_dkdv_consumer(const RingBwdParams &p, uint32_t base,
                                                   uint32_t bars, float *stats, int cw, int tid) {
  using L = DkvSmem<D>;
  const int warp = tid / 32, lane = tid % 32;
  const uint32_t kv_full = bars, kv_empty = bars + 8;
  const uint32_t k_lo = ptx::wgmma_desc_lo_sw128(base + L::kK + cw * 64 * 128);
  const uint32_t v_lo = ptx::wgmma_desc_lo_sw128(base + L::kV + cw * 64 * 128);
  uint32_t stage = 0, phase = 0, kv_phase = 0;
  for (int32_t t = blockIdx.x; t < p.num_kv_tiles; t = next_tile(t)) {
    const RingKvTile tl = ring_kv_tile_at(p, t);
    const RingSeg &kseg = p.r.q_segs[tl.seg];
    const int32_t key_r = tl.n_block * kBlockN + 64 * cw + 16 * warp + lane / 4; // and + 8
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
      dk[i] = 0.f, dv[i] = 0.f;
    wait_bar(kv_full, kv_phase, p.b, kWaitKFull, 0, t);
    kv_phase ^= 1;
    for (int j = 0; j < p.r.n_kv_segs; j++) {
      const QRun qr = q_run<D>(p, tl, j);
      const RingSeg &q = p.r.kv_segs[j];
      for (int32_t h = 0; h < p.b.group; h++) {
        const int32_t head = tl.kv_head * p.b.group + h;
        const int64_t at = ((int64_t)tl.batch * p.b.heads_q + head) * p.b.seq_q + q.row0;
        const QueryRun run{p.lse[q.rank] + at, p.dsum[q.rank] + at, q.rows, qr.delta};
        for (int32_t m = qr.first; m < qr.blocks; m++) {
          dkdv_block<D>(p.b, run, m * L::kBlockQ, key_r, stats, cw, tid, k_lo, v_lo, base, bars,
                        stage, phase, t, dk, dv);
          if (++stage == L::kStages)
            stage = 0, phase ^= 1;
        }
      }
    }
    if (lane == 0)
      ptx::mbar_arrive(kv_empty); // K and V: read by the tile's last block's S and dP
    store_dkdv<D>(p.b, tl.batch, tl.kv_head, kseg.row0, kseg.rows, key_r, lane, dk, dv);
  }
}

template <int D>
__device__ __forceinline__ void ring_dq_consumer(const RingBwdParams &p, uint32_t base,
                                                 uint32_t bars, int cw, int tid) {
  using L = DqSmem<D>;
  const int warp = tid / 32, lane = tid % 32;
  const uint32_t q_full = bars, q_empty = bars + 8;
  const uint32_t q_lo = ptx::wgmma_desc_lo_sw128(base + L::kQ + cw * 64 * 128);
  const uint32_t do_lo = ptx::wgmma_desc_lo_sw128(base + L::kDO + cw * 64 * 128);
  uint32_t stage = 0, phase = 0, q_phase = 0;
  for (int32_t t = blockIdx.x; t < p.r.a.num_tiles; t = next_tile(t)) {
    const RingTile tl = ring_tile_at(p.r, t);
    const RingSeg &qs = p.r.q_segs[tl.qseg];
    DqRows rw;
    rw.wg_row = tl.m_block * kBlockM + 64 * cw;
    rw.row0 = rw.wg_row + 16 * warp + lane / 4;
    const int64_t at = ((int64_t)tl.batch * p.b.heads_q + tl.head) * p.b.seq_q + qs.row0;
#pragma unroll
    for (int r = 0; r < 2; r++)
      row_stats_at(p.b.lse + at, p.b.dsum + at, rw.row0 + 8 * r, rw.row0 + 8 * r < qs.rows,
                   rw.lse2[r], rw.ds[r]);
    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
      dq[i] = 0.f;
    wait_bar(q_full, q_phase, p.b, kWaitQFull, 0, t);
    q_phase ^= 1;
    if (tl.n_blocks == 0 && lane == 0)
      ptx::mbar_arrive(q_empty);
    int32_t left = tl.n_blocks; // blocks of the tile still to come
    for (int j = 0; j < p.r.n_kv_segs; j++) {
      const KvRun run = kv_run(p.r, tl, j);
      const KeyRun keys{run.rows, run.delta};
      for (int32_t n = 0; n < run.n_blocks; n++) {
        --left;
        dq_block<D, L>(p.b, keys, n, left == 0, rw, lane, q_lo, do_lo, base, bars, stage, phase, t,
                       dq);
        if (++stage == L::kStages)
          stage = 0, phase ^= 1;
      }
    }
    store_dq<D>(p.b, tl.batch, tl.head, qs.row0, qs.rows, rw.row0, lane, dq);
  }
}

// ring_dq_kernel's producer: ring_attention_kernel's loads, with dO beside Q.
template <int D>
__device__ __forceinline__ void ring_dq_producer(const RingBwdParams &p, uint32_t base,
                                                 uint32_t bars) {
  ring_loads<D, DqSmem<D>, true>(p.r, base, bars, &p.do_map);
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    ring_dkdv_kernel(const __grid_constant__ tw_dev_comm_t dc,
                     const __grid_constant__ RingBwdParams p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_ok;
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t bars = base + DkvSmem<D>::kBars;
  if (threadIdx.x == 0) {
    init_dkdv_bars(smem_raw, bars, DkvSmem<D>::kStages);
    s_ok = ring_enter(dc, tw_op_begin(dc, TW_CH_ATTN), /*signal=*/true);
  }
  __syncthreads();
  if (s_ok) /* the call goes on in ring_dq_kernel, which ends it */
    run_dkdv_roles<D, RingBwdParams, ring_dkdv_producer<D>, ring_dkdv_consumer<D>>(p, smem_raw,
                                                                                   base, bars);
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    ring_dq_kernel(const __grid_constant__ tw_dev_comm_t dc,
                   const __grid_constant__ RingBwdParams p) {
  run_ring_tile_kernel<DqSmem<D>, RingBwdParams, ring_dq_producer<D>, ring_dq_consumer<D>>(
      dc, p, /*signal=*/false);
}

} // namespace attn
} // namespace tw
