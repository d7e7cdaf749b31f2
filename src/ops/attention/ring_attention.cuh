/*
 * Internal (ops layer): tw_ring_attention's persistent kernel, one a rank (contract in
 * tilewire.h; the design in docs/ARCHITECTURE.md, "Ring attention").
 *
 * The sequence is a list of segments (rank, local row start, rows, global position start):
 * one a rank (contiguous) or two (zigzag). A tile is 128 query rows of one Q segment of this
 * rank (so its positions are contiguous), one q head, one batch. Its KV "runs" are the KV
 * segments in ring order from this rank's own (kv_run, computed alike by the producer and the
 * consumers from the parameters): each is read in place from its rank's k and v through that
 * rank's tensor maps, 128-row blocks from the segment's first row, the mask tw_attention's with
 * delta = qseg.pos - kvseg.pos and the segment's rows as the key count (rows loaded past the
 * segment's end are masked; blocks no query of the tile sees are not loaded). The online
 * softmax state carries across every run of a tile, so O / l and lse are stored once.
 *
 * The roles, barriers, fragments and math are attention_sm90.cuh's (its helpers are reused);
 * only the KV loop walks runs instead of one sequence.
 *
 * Cross-rank protocol (channel TW_CH_ATTN): thread 0 of each CTA enters the call and waits for
 * every peer's entry (its k and v writes before the call are then complete), then makes them
 * visible to the async proxy before its first TMA read; a CTA whose wait failed skips its tiles
 * but still exits. At the end every CTA counts out with release (done[ATTN][rank] on every
 * peer), and the grid's last CTA waits, bounded, until every peer released this rank's k and v.
 */
#pragma once

#include "device/signal.cuh"
#include "ops/attention/attention_sm90.cuh"
#include "tilewire.h"

namespace tw {
namespace attn {

constexpr int kRingMaxWorld = 8;

struct RingSeg {
  int32_t rank; // the rank holding it (its map index)
  int32_t row0; // first local row
  int32_t rows;
  int32_t pad;
  int64_t pos; // global position of row0
};

struct RingParams {
  AttnParams a; // q_map, o, lse, batch, heads_q, seq_q (= seq_local), group, causal, scale,
                // timeout, num_tiles, m_tiles (tiles of a (batch, head): all Q segments')
  CUtensorMap k_maps[kRingMaxWorld], v_maps[kRingMaxWorld]; // rank r's k and v (4D, as a's)
  RingSeg q_segs[2];                                        // this rank's
  int32_t q_tiles[2];                                       // ceil(rows / 128) of each
  RingSeg kv_segs[2 * kRingMaxWorld];                       // every rank's, in ring order
  int32_t n_q_segs, n_kv_segs;
};

// Host (ring_attention.cu), shared by tw_ring_attention and its backward. ring_check: the comm
// (one node, at most kRingMaxWorld ranks), the shapes and sm_count of a's call (not its
// pointers), failures naming the argument after `op`. ring_params: every field of p from a (o may
// be NULL), with rank r's k and v maps at their mapped addresses, or (a rank on another node) at
// its slot of the gathered k and v regions.
tw_status_t ring_check(tw_comm_t comm, const char *op, const tw_ring_attention_args_t &a);
tw_status_t ring_params(tw_comm_t comm, const tw_ring_attention_args_t &a,
                        const uint8_t *gathered_k, const uint8_t *gathered_v, RingParams *p);
// Across nodes (inside one node these do nothing): ring_check_gathered checks the `gathered`
// argument of `bytes` against the call's n other buffers; ring_gather gathers n tensors into its
// regions (world slots of bytes[i] rounded up to 16 each) by tw_allgather on `stream`.
tw_status_t ring_check_gathered(tw_comm_t comm, const char *op, const void *gathered, size_t bytes,
                                int n, const void *const *others, const size_t *other_bytes,
                                const char *const *names);
tw_status_t ring_gather(tw_comm_t comm, const char *op, void *gathered, int n,
                        const void *const *src, const size_t *bytes, tw_stream_t stream);
// ring_gather's layout: a rank's slot of a tensor of `bytes` (rounded up to 16), and the offset
// of region i after regions 0 .. i - 1 of tensors of bytes[] (i == n: the whole size).
size_t ring_slot(size_t bytes);
size_t ring_region_off(int world, const size_t *bytes, int i);
// The call's TW_CH_ATTN description: call 0 forward (bwd NULL), 1 backward (bwd: its q, dout,
// lse and workspace).
void ring_call_fields(tw_comm_t comm, int call, const tw_ring_attention_args_t &a,
                      const void *const bwd[4], uint64_t fields[8]);
// The rest of a checked ring call (device, description, launch stream, the result recorded);
// launch enqueues the kernels on `on` with `sms` SMs.
typedef tw_status_t (*ring_launch_t)(tw_comm_t comm, const void *args, int64_t head_dim, int sms,
                                     cudaStream_t on);
tw_status_t ring_run(tw_comm_t comm, tw_stream_t stream, const uint64_t fields[8], int sm_count,
                     int64_t head_dim, ring_launch_t launch, const void *args);

struct RingTile {
  int32_t qseg, m_block, head, batch;
  int32_t n_blocks; // visible KV blocks over all runs (0: every row is dead)
};

struct KvRun {
  int32_t map, row0, rows, n_blocks;
  int64_t delta; // key j of the run is visible to row i of the Q segment iff j <= delta + i
};

// Run j of tile tl: KV segment j, with the blocks some row of the tile sees.
__device__ __forceinline__ KvRun kv_run(const RingParams &p, const RingTile &tl, int j) {
  const RingSeg &q = p.q_segs[tl.qseg];
  const RingSeg &k = p.kv_segs[j];
  KvRun r;
  r.map = k.rank, r.row0 = k.row0, r.rows = k.rows;
  r.delta = q.pos - k.pos;
  int64_t end = k.rows;
  if (p.a.causal) {
    const int64_t last = min((int64_t)tl.m_block * kBlockM + kBlockM - 1, (int64_t)q.rows - 1);
    end = min(end, max((int64_t)0, r.delta + last + 1));
  }
  r.n_blocks = (int32_t)((end + kBlockN - 1) / kBlockN);
  return r;
}

// Tile t: a (batch, head)'s m blocks consecutive; causal tiles longest first (the later
// segment's last blocks first).
__device__ __forceinline__ RingTile ring_tile_at(const RingParams &p, int32_t t) {
  RingTile tl;
  const int32_t mb = t % p.a.m_tiles;
  const int32_t bh = t / p.a.m_tiles;
  const int32_t m = p.a.causal ? p.a.m_tiles - 1 - mb : mb;
  tl.qseg = m < p.q_tiles[0] ? 0 : 1;
  tl.m_block = m - (tl.qseg ? p.q_tiles[0] : 0);
  tl.head = bh % p.a.heads_q;
  tl.batch = bh / p.a.heads_q;
  tl.n_blocks = 0;
  for (int j = 0; j < p.n_kv_segs; j++)
    tl.n_blocks += kv_run(p, tl, j).n_blocks;
  return tl;
}

// Warpgroup 0's thread 0 of a ring kernel over Q tiles: every load of every tile of this CTA, in
// the consumers' order, into shared-memory layout L: the tile's Q rows once (with kDO also its dO
// rows from *do_map at L::kDO, under the same barrier: the backward's dq kernel), then K and V of
// every visible block of every run.
template <int D, class L, bool kDO>
__device__ __forceinline__ void ring_loads(const RingParams &p, uint32_t base, uint32_t bars,
                                           const CUtensorMap *do_map) {
  ptx::tma_prefetch_map(&p.a.q_map);
  const uint32_t q_full = bars, q_empty = bars + 8;
  uint32_t stage = 0, phase = 0, q_phase = 0;
  for (int32_t t = blockIdx.x; t < p.a.num_tiles; t = next_tile(t)) {
    const RingTile tl = ring_tile_at(p, t);
    const int32_t kv_head = tl.head / p.a.group;
    wait_bar(q_empty, q_phase ^ 1, p.a, kWaitQEmpty, 0, t);
    ptx::mbar_arrive_expect_tx(q_full, (kDO ? 2 : 1) * L::kTileBytes);
    const int32_t q_row = p.q_segs[tl.qseg].row0 + tl.m_block * kBlockM;
    for (int c = 0; c < L::kBoxes; c++) {
      ptx::tma_load_4d(base + L::kQ + c * L::kBoxBytes, &p.a.q_map, q_full, c * kBoxCols, tl.head,
                       q_row, tl.batch);
      if constexpr (kDO)
        ptx::tma_load_4d(base + L::kDO + c * L::kBoxBytes, do_map, q_full, c * kBoxCols, tl.head,
                         q_row, tl.batch);
    }
    q_phase ^= 1;
    for (int j = 0; j < p.n_kv_segs; j++) {
      const KvRun run = kv_run(p, tl, j);
      const CUtensorMap *k_map = &p.k_maps[run.map], *v_map = &p.v_maps[run.map];
      for (int32_t n = 0; n < run.n_blocks; n++) {
        const uint32_t k_full = bars + 16 + 32 * stage, k_empty = k_full + 8;
        const uint32_t v_full = k_full + 16, v_empty = k_full + 24;
        const int32_t row = run.row0 + n * kBlockN;
        wait_bar(k_empty, phase ^ 1, p.a, kWaitKEmpty, stage, t);
        ptx::mbar_arrive_expect_tx(k_full, L::kTileBytes);
        const uint32_t k_dst = base + L::kK + stage * L::kTileBytes;
        for (int c = 0; c < L::kBoxes; c++)
          ptx::tma_load_4d(k_dst + c * L::kBoxBytes, k_map, k_full, c * kBoxCols, kv_head, row,
                           tl.batch);
        wait_bar(v_empty, phase ^ 1, p.a, kWaitVEmpty, stage, t);
        ptx::mbar_arrive_expect_tx(v_full, L::kTileBytes);
        const uint32_t v_dst = base + L::kV + stage * L::kTileBytes;
        for (int c = 0; c < L::kBoxes; c++)
          ptx::tma_load_4d(v_dst + c * L::kBoxBytes, v_map, v_full, c * kBoxCols, kv_head, row,
                           tl.batch);
        if (++stage == L::kStages)
          stage = 0, phase ^= 1;
      }
    }
  }
}

// ring_attention_kernel's producer.
template <int D>
__device__ __forceinline__ void ring_producer(const RingParams &p, uint32_t base, uint32_t bars) {
  ring_loads<D, AttnSmem<D>, false>(p, base, bars, nullptr);
}

} // namespace attn
} // namespace tw

#include "ops/attention/ring_attention_consumer.cuh"
