/*
 * Internal: tw_ring_attention's consumer warpgroups and kernel (ring_attention.cuh's contract).
 * The per-block math is attention_consumer.cuh's (qk_gemm, softmax_step, pv_gemm); the state
 * (m, l, O) of a tile carries across every KV run.
 */
#pragma once

namespace tw {
namespace attn {

// O / l and lse of this thread's two rows (those inside the Q segment) at their local rows.
template <int D>
__device__ __forceinline__ void ring_store_rows(const RingParams &p, const RingTile &tl,
                                                int32_t row0, int lane, const float (&o)[D / 2],
                                                const float (&m)[2], const float (&l)[2]) {
  const RingSeg &q = p.q_segs[tl.qseg];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int32_t row = row0 + 8 * r;
    if (row >= q.rows)
      continue;
    const int64_t local = (int64_t)q.row0 + row;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int64_t q_row = ((int64_t)tl.batch * p.a.seq_q + local) * p.a.heads_q + tl.head;
    uint32_t *dst = reinterpret_cast<uint32_t *>(p.a.o + q_row * D + 2 * (lane % 4));
#pragma unroll
    for (int j = 0; j < D / 8; j++)
      dst[4 * j] = pack_bf16(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    if (p.a.lse && lane % 4 == 0)
      p.a.lse[((int64_t)tl.batch * p.a.heads_q + tl.head) * p.a.seq_q + local] =
          sum > 0.f ? m[r] * 0.69314718055994531f + logf(sum) : -INFINITY;
  }
}

// Consumer warpgroup cw (0 or 1): rows 64 cw .. 64 cw + 63 of every tile of this CTA.
template <int D>
__device__ __forceinline__ void ring_consumer(const RingParams &p, uint32_t base, uint32_t bars,
                                              int cw, int tid) {
  using L = AttnSmem<D>;
  const int warp = tid / 32, lane = tid % 32;
  const uint32_t q_full = bars, q_empty = bars + 8;
  const uint32_t q_lo = ptx::wgmma_desc_lo_sw128(base + L::kQ + cw * 64 * 128);
  uint32_t stage = 0, phase = 0, q_phase = 0;
  fwd_turns_begin(cw);
  for (int32_t t = blockIdx.x; t < p.a.num_tiles; t = next_tile(t)) {
    const RingTile tl = ring_tile_at(p, t);
    const int32_t wg_row = tl.m_block * kBlockM + 64 * cw; // the warpgroup's first row
    const int32_t row0 = wg_row + 16 * warp + lane / 4;    // this thread's rows: row0, row0 + 8
    FwdRows<D> st;
    fwd_begin<D>(st);
    wait_bar(q_full, q_phase, p.a, kWaitQFull, 0, t);
    q_phase ^= 1;
    if (tl.n_blocks == 0 && lane == 0)
      ptx::mbar_arrive(q_empty);
    int32_t left = tl.n_blocks; // blocks of the tile still to come
    for (int j = 0; j < p.n_kv_segs; j++) {
      const KvRun run = kv_run(p, tl, j);
      for (int32_t n = 0; n < run.n_blocks; n++) {
        const int64_t block_end = (int64_t)n * kBlockN + kBlockN - 1;
        const bool masked = block_end >= run.rows || (p.a.causal && block_end > run.delta + wg_row);
        int32_t lim[2] = {kBlockN, kBlockN};
        if (masked)
          row_limits(run.rows, p.a.causal, run.delta, row0, n, lim);
        fwd_block<D>(st, p.a, t, cw, lane, q_lo, q_empty, base, bars + 16 + 32 * stage, stage,
                     phase, --left == 0, masked, lim, p.a.scale_log2);
        if (++stage == L::kStages)
          stage = 0, phase ^= 1;
      }
    }
    fwd_flush<D>(st, p.a, t, lane);
    ring_store_rows<D>(p, tl, row0, lane, st.o, st.m, st.l);
  }
  fwd_turns_end(cw);
}

// Thread 0, after every CTA's reads: counts this CTA out (releasing the peers' k and v); the
// grid's last CTA waits until every peer released this rank's, then ends the call.
__device__ __forceinline__ void ring_exit(const tw_dev_comm_t &dc, uint64_t epoch) {
  if (!tw_op_exit(dc, TW_CH_ATTN, epoch, /*release=*/true))
    return;
  for (int q = 0; q < dc.world; q++)
    if (q != dc.rank && dc.peer_ctrl[q] &&
        !tw_wait_geq(dc, TW_CH_ATTN, &dc.ctrl->done[TW_CH_ATTN][q], epoch, q, -1))
      break; /* recorded; the call still ends */
  tw_trace_stamp(dc, TW_TR_END);
  tw_op_end(dc, TW_CH_ATTN, epoch);
}

// Thread 0 of a ring kernel's CTA: enters call `epoch` (`signal`: the call's first kernel, whose
// block 0 signals this rank's entry; else the entry the first kernel made is checked again) and
// waits for every peer's entry, then makes the peers' buffers (written before their entry)
// visible to the async proxy. Whether the CTA may run its tiles.
__device__ __forceinline__ bool ring_enter(const tw_dev_comm_t &dc, uint64_t epoch, bool signal) {
  const bool ok =
      (signal ? tw_kernel_enter(dc, TW_CH_ATTN, epoch) : tw_op_usable(dc, TW_CH_ATTN)) &&
      tw_wait_entries(dc, TW_CH_ATTN, epoch);
  if (ok)
    tw_fence_proxy_async_global();
  return ok;
}

// The body of a ring kernel over Q tiles that ends the call (shared-memory layout L, parameters
// P): the barriers and ring_enter (`signal` as there), run_tile_kernel's roles where it
// succeeded, then ring_exit once no read of a peer's buffer is left.
template <class L, class P, void (*Producer)(const P &, uint32_t, uint32_t),
          void (*Consumer)(const P &, uint32_t, uint32_t, int, int)>
__device__ __forceinline__ void run_ring_tile_kernel(const tw_dev_comm_t &dc, const P &p,
                                                     bool signal) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_ok;
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t bars = base + L::kBars;
  const uint64_t epoch = tw_op_begin(dc, TW_CH_ATTN);
  if (threadIdx.x == 0) {
    init_tile_bars(smem_raw, bars, L::kStages);
    s_ok = ring_enter(dc, epoch, signal);
  }
  __syncthreads();
  const bool ok = s_ok != 0;
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0 && ok)
      Producer(p, base, bars);
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    if (ok)
      Consumer(p, base, bars, wg - 1, threadIdx.x % 128);
  }
  __syncthreads();        /* every load consumed: no read of a peer's buffer is left */
  if (threadIdx.x == 128) /* a consumer thread: the producer's have given up registers */
    ring_exit(dc, epoch);
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    ring_attention_kernel(const __grid_constant__ tw_dev_comm_t dc,
                          const __grid_constant__ RingParams p) {
  run_ring_tile_kernel<AttnSmem<D>, RingParams, ring_producer<D>, ring_consumer<D>>(dc, p, true);
}

} // namespace attn
} // namespace tw
