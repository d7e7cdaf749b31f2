/*
 * The MoE calls' shared pieces (ops/moe): the workspace layout, the kernels' parameters, the
 * layout of a rank's entries (block 0), the count exchange and the layout every rank derives
 * from it, the barrier of a call that writes rows into every rank, and the host's argument checks,
 * parameters and launch. moe.cu holds tw_moe_dispatch and tw_moe_combine, moe_gemm.cu
 * tw_moe_dispatch_gemm, moe_backward.cu tw_moe_combine_backward.
 */
#ifndef TW_OPS_MOE_LAYOUT_CUH
#define TW_OPS_MOE_LAYOUT_CUH

#include <cuda_bf16.h>

#include <stdint.h>
#include <string.h>

#include "device/signal.cuh"

extern "C" {
#include "runtime/comm.h"
}

namespace tw {
namespace moe {

constexpr int kMaxExperts = 1024, kMaxTopK = 16;
constexpr int kMoeThreads = 512, kMoeWarps = kMoeThreads / 32;
constexpr int kDispatch = 1, kCombine = 2, kDispatchGemm = 3, kGemmCombine = 4, kFfn = 5,
              kCombineBackward = 6; /* call kinds */

/* The flags of TW_CH_MOE (the control block's, zero at init; a call field cannot hold them):
 * [0, world) the counts from rank s; [world, 2 world) rank s's rows landed (the dispatch's
 * copies, the combine backward's gradient rows: set to the call's epoch); from kFlagBlocks
 * tw_moe_dispatch_gemm's rows per 128-row block (zeroed by its last CTA); from
 * kFlagCombineBlocks tw_moe_gemm_combine's finished tiles per row block (cumulative over its
 * calls); the dispatch's CTAs out of their copies; the sum of tw_moe_gemm_combine's column
 * blocks over its calls so far (every block counter's value between calls). The count of CTAs
 * out of their copies (kFlagCopiesDone) serves every call that ends in rows_landed. */
constexpr int kMaxBlocks = 8000; /* row blocks of recv (recv_rows / 128) the fused calls serve */
constexpr int kFlagBlocks = 2 * TW_MAX_WORLD, kFlagCombineBlocks = 8192;
constexpr int kFlagCopiesDone = TW_CHANNEL_FLAGS - 3, kFlagCombineCount = TW_CHANNEL_FLAGS - 4;
static_assert(kFlagBlocks + kMaxBlocks <= kFlagCombineBlocks &&
                  kFlagCombineBlocks + kMaxBlocks <= kFlagCombineCount,
              "the MoE flags overlap");

/* A rank's count row (cnt, and each row of counts_in): the tokens of each expert, a status, a
 * bad value, then across nodes the tokens bound for each node (moe_net.cuh; zero inside one). */
__host__ __device__ constexpr int count_stride(int experts) {
  return experts + 2 + TW_RAIL_MAX_NODES;
}

/* The workspace of one rank (byte offsets): counts_in [world][count_stride] int32 (stored by
 * the ranks), cnt [count_stride] int32, pos [max_tokens * top_k] int32, route
 * [max_tokens * top_k] int64 (rank << 40 | row; -1 none), cbase, inv, and tw_moe_ffn's stage
 * counters ffn [2 kMaxBlocks + 1] uint64 (this rank's only: each call zeroes them first).
 * Across nodes (nodes > 1; moe_net.cuh) then: send_idx [max_tokens][nodes] int32 (a token's
 * place among the rows sent to each node, -1 none), tok_out [nodes - 1][max_tokens] int32 (the
 * token of each row sent), meta_in [nodes - 1][max_tokens][top_k + 1] int64 (the rows received:
 * their token and each slot's destination), w_out [max_tokens * top_k] and w_in
 * [nodes - 1][max_tokens * top_k] fp32 (the combine's weights), rows_out and rows_in
 * [nodes - 1][max_tokens][stage bytes] (the staged rows, in the call's stage size), and for
 * tw_moe_ffn, which dispatches and combines in one call, parts_out and parts_in [nodes - 1]
 * [max_tokens][part_stage bytes] (the combine's partials: a rail peer may still forward the rows
 * staged in rows_in while this rank's partials land). Every region before rows_out has the same
 * offset in every call of one comm and max_tokens, experts and top_k; the staged rows live only
 * within one call. */
struct Layout {
  size_t counts_in, cnt, pos, route, cbase, inv, ffn;
  size_t send_idx, tok_out, meta_in, w_out, w_in, rows_out, rows_in, parts_out, parts_in, bytes;
};

inline size_t up256(size_t x) { return (x + 255) / 256 * 256; }

inline Layout layout_of(int world, int64_t max_tokens, int64_t experts, int64_t top_k,
                        int nodes = 1, size_t stage = 0, size_t part_stage = 0) {
  Layout l;
  memset(&l, 0, sizeof(l));
  const size_t row = (size_t)count_stride((int)experts) * 4,
               entries = (size_t)max_tokens * (size_t)top_k, T = (size_t)max_tokens;
  l.counts_in = 0;
  l.cnt = up256((size_t)world * row);
  l.pos = l.cnt + up256(row);
  l.route = l.pos + up256(entries * 4);
  l.cbase = l.route + up256(entries * 8);
  l.inv = l.cbase + up256((size_t)(experts + 1) * 4);
  l.ffn = l.inv + up256(entries * 4);
  l.bytes = l.ffn + up256((2 * (size_t)kMaxBlocks + 1) * 8);
  if (nodes > 1) {
    const size_t far = (size_t)(nodes - 1);
    l.send_idx = l.bytes;
    l.tok_out = l.send_idx + up256(T * (size_t)nodes * 4);
    l.meta_in = l.tok_out + up256(far * T * 4);
    l.w_out = l.meta_in + up256(far * T * (size_t)(top_k + 1) * 8);
    l.w_in = l.w_out + up256(entries * 4);
    l.rows_out = l.w_in + up256(far * entries * 4);
    l.rows_in = l.rows_out + up256(far * T * stage);
    l.parts_out = l.rows_in + up256(far * T * stage);
    l.parts_in = l.parts_out + up256(far * T * part_stage);
    l.bytes = l.parts_in + up256(far * T * part_stage);
  }
  return l;
}

struct MoeParams {
  const uint16_t *x; /* bf16 bits */
  const void *topk_idx;
  const float *topk_weights;
  uint16_t *recv[TW_MAX_WORLD];             /* every rank's recv, mapped here */
  const uint16_t *expert_out[TW_MAX_WORLD]; /* every rank's expert_out, mapped here */
  uint16_t *out;
  const uint16_t *grad;                /* the combine backward's: bf16 [tokens, n_out] */
  uint16_t *expert_grad[TW_MAX_WORLD]; /* and every rank's expert_grad, mapped here */
  float *weights_grad;                 /* fp32 [tokens, top_k] (NULL: not computed) */
  int32_t *offsets;
  int32_t *counts_in[TW_MAX_WORLD]; /* every rank's counts_in, mapped here */
  int32_t *cnt, *pos;
  int32_t *cbase; /* [experts + 1]: the exclusive prefix of cnt over the experts */
  int32_t *inv;   /* [entries]: inv[cbase[e] + pos] = the entry (the fused copies' order) */
  int64_t *route;
  uint64_t *ffn_cnt; /* [2 kMaxBlocks + 1]: tw_moe_ffn's stage counters (Layout::ffn) */
  /* The count exchange through the comm's low-latency area (exchange_layout): the area's offset
   * from each rank's control block (alike on every rank: symmetric) and one parity's bytes;
   * ll_half 0: the fenced exchange (across nodes, or no area) */
  uint64_t ll_off, ll_half;
  int64_t tokens, hidden, n_out, recv_rows;
  int32_t experts, top_k, index_bits, local_experts;
};

/* Status word of cnt[experts]: 0, or 1 + the first entry with an index outside [-1, experts). */
__device__ __forceinline__ int32_t load_index(const MoeParams &p, int64_t i) {
  return p.index_bits == 64
             ? (int32_t)max((int64_t)INT32_MIN,
                            min((int64_t)INT32_MAX, ((const int64_t *)p.topk_idx)[i]))
             : ((const int32_t *)p.topk_idx)[i];
}

/* Block 0 of the dispatch, all threads (at most kMoeThreads): the layout of this rank's
 * entries (moe.cu's comment), s_count [warps + 1][experts] of shared memory. */
__device__ inline void layout_block(const MoeParams &p, int32_t *s_count) {
  __shared__ int32_t s_bad_entry;
  const int E = p.experts, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = (int)(blockDim.x / 32); /* at most kMoeWarps */
  for (int i = threadIdx.x; i < warps * E; i += blockDim.x)
    s_count[i] = 0;
  if (threadIdx.x == 0)
    s_bad_entry = INT32_MAX;
  __syncthreads();
  const int64_t n = p.tokens * p.top_k;
  const int64_t begin = n * warp / warps, end = n * (warp + 1) / warps;
  int32_t *mine = s_count + warp * E;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    int32_t e = i < end ? load_index(p, i) : -1;
    if (e < -1 || e >= E) {
      atomicMin(&s_bad_entry, (int32_t)i);
      e = -1;
    }
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int before = __popc(same & ((1u << lane) - 1));
    int32_t at = -1;
    if (e >= 0)
      at = mine[e] + before;
    __syncwarp();
    if (e >= 0 && before == 0)
      mine[e] += __popc(same);
    __syncwarp();
    if (i < end)
      p.pos[i] = at;
  }
  __syncthreads();
  /* the warps' counts of each expert scanned: warp w's base, and the rank's count */
  int32_t *s_base = s_count + warps * E; /* [E]: the counts, then their exclusive prefix */
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = 0;
    for (int w = 0; w < warps; w++) {
      const int32_t c = s_count[w * E + e];
      s_count[w * E + e] = run;
      run += c;
    }
    p.cnt[e] = run;
    s_base[e] = run;
  }
  __syncthreads();
  if (warp == 0) { /* the experts' prefix, 32 at a time (a serial loop over global memory was a
                    * dependent L2 round trip per expert) */
    int32_t carry = 0;
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      const int32_t v = e < E ? s_base[e] : 0;
      int32_t incl = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o)
          incl += y;
      }
      if (e < E) {
        s_base[e] = carry + incl - v;
        p.cbase[e] = carry + incl - v;
      }
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0)
      p.cbase[E] = carry;
  }
  __syncthreads();
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    if (i < end) {
      const int32_t at = p.pos[i];
      const int32_t e = load_index(p, i);
      if (at >= 0) {
        p.pos[i] = at + mine[e];
        p.inv[s_base[e] + at + mine[e]] = (int32_t)i;
      } else {
        p.route[i] = -1; /* an unused slot (or a bad index): nothing to combine */
      }
    }
  }
  if (threadIdx.x == 0) {
    const bool bad = s_bad_entry != INT32_MAX;
    p.cnt[E] = bad ? 1 + s_bad_entry : 0;
    p.cnt[E + 1] = bad ? load_index(p, s_bad_entry) : 0;
  }
  for (int q = threadIdx.x; q < TW_RAIL_MAX_NODES; q += blockDim.x)
    p.cnt[E + 2 + q] = 0; /* the tokens bound for each node: across nodes, moe_net.cuh */
  __syncthreads();
}

/* A count row as low-latency words (signal.cuh): 16 data bytes an item, 32 bytes of words. A
 * rank's slot is sized for the most experts a call may have, so the slots' places in the area
 * are alike whatever any rank's call says. */
__host__ __device__ constexpr uint64_t ll_count_items(int experts) {
  return ((uint64_t)count_stride(experts) * 4 + 15) / 16;
}
constexpr uint64_t kLlCountSlot = ll_count_items(kMaxExperts) * 32;

/* Where derive_layout reads the count rows: counts_in (the fenced exchange, the combine
 * backward), or the words in this rank's low-latency area, each already waited for. */
struct CountsIn {
  const volatile int32_t *c;
  int stride;
  __device__ int32_t operator()(int r, int i) const { return c[r * stride + i]; }
};
struct LlCounts {
  const uint8_t *half; /* this rank's area, the call's half */
  uint64_t items;
  __device__ int32_t operator()(int r, int i) const {
    /* int i of row r: item i / 4, its word (i % 4) / 2, that word's data half (i % 2) */
    const uint8_t *word =
        half + (uint64_t)r * kLlCountSlot + tw_ll_item_off((uint64_t)(i / 4), items, (i % 4) / 2);
    return *(const volatile int32_t *)(word + (i % 2) * 8);
  }
};

/* Every CTA's view of the layout: this rank's first row in each expert's segment (base) and, per
 * rank, the rows its experts need. */
struct SharedLayout {
  int32_t base[kMaxExperts];
  int32_t start[kMaxExperts]; /* each expert's first row on its rank */
  int32_t total[kMaxExperts]; /* each expert's rows from every rank */
  int64_t need[TW_MAX_WORLD];
  int32_t bad_src, bad_entry, bad_value, over_rank;
};

template <class Counts>
__device__ inline void derive_layout(const MoeParams &p, const tw_dev_comm_t &dc, SharedLayout &s,
                                     const Counts &c) {
  const int E = p.experts, L = p.local_experts, W = dc.world;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t total = 0, mine = 0;
    for (int r = 0; r < W; r++) {
      const int32_t v = c(r, e);
      if (r < dc.rank)
        mine += v;
      total += v;
    }
    s.base[e] = mine;
    s.total[e] = total;
    s.start[e] = (total + 127) / 128 * 128; /* the padded size, made a start below */
  }
  if (threadIdx.x == 0) {
    s.bad_src = -1, s.over_rank = -1;
    for (int r = 0; r < W && s.bad_src < 0; r++)
      if (c(r, E) != 0)
        s.bad_src = r, s.bad_entry = c(r, E) - 1, s.bad_value = c(r, E + 1);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < W; d += blockDim.x) {
    int64_t off = 0;
    for (int e = d * L; e < (d + 1) * L; e++) {
      const int32_t size = s.start[e];
      s.start[e] = (int32_t)min(off, (int64_t)INT32_MAX);
      off += size;
    }
    s.need[d] = off;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int d = 0; d < W && s.over_rank < 0; d++)
      if (s.need[d] > p.recv_rows)
        s.over_rank = d;
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    s.base[e] += s.start[e];
  __syncthreads();
}
__device__ inline void derive_layout(const MoeParams &p, const tw_dev_comm_t &dc, SharedLayout &s) {
  derive_layout(p, dc, s, CountsIn{p.counts_in[dc.rank], count_stride(p.experts)});
}

/* 16-byte vectors of one row, by the lanes of a warp, kCopyBatch loads in flight a lane before
 * their stores: a row is a few batches of latency, not one per vector (the loads could alias the
 * stores, so a plain loop waits for each load before the next). */
constexpr int kCopyBatch = 8;
/* kCoherent: the source may have been written during this kernel (by the NIC, or by another
 * CTA), so it is read through L2 (ld.global.cg) rather than the read-only path. */
template <bool kCoherent = false>
__device__ __forceinline__ void warp_copy_row(uint16_t *dst, const uint16_t *src, int64_t elems,
                                              int lane) {
  const int64_t vecs = elems / 8;
  const uint4 *s = reinterpret_cast<const uint4 *>(src);
  uint4 *d = reinterpret_cast<uint4 *>(dst);
  for (int64_t b = lane; b < vecs; b += 32 * kCopyBatch) {
    uint4 r[kCopyBatch];
#pragma unroll
    for (int u = 0; u < kCopyBatch; u++)
      if (b + 32 * u < vecs)
        r[u] = kCoherent ? __ldcg(s + b + 32 * u) : __ldg(s + b + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyBatch; u++)
      if (b + 32 * u < vecs)
        d[b + 32 * u] = r[u];
  }
}
/* All threads of a CTA: out[t] = the sum over t's slots in order of weight x the expert's
 * output row (read in place from its rank's expert_out), fp32 (__fmaf_rn), rounded once. */
__device__ __forceinline__ void combine_token(const MoeParams &p, int64_t t) {
  const int64_t vecs = p.n_out / 8;
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < p.top_k; j++) {
      const int64_t r = p.route[t * p.top_k + j];
      if (r < 0)
        continue;
      const float w = p.topk_weights[t * p.top_k + j];
      const uint16_t *y = p.expert_out[r >> 40] + (r & ((1ll << 40) - 1)) * p.n_out;
      const uint4 bits = __ldcg(reinterpret_cast<const uint4 *>(y) + v);
      const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
      for (int q = 0; q < 8; q++) {
        const uint32_t h = q % 2 ? words[q / 2] >> 16 : words[q / 2] & 0xffffu;
        acc[q] = __fmaf_rn(w, __uint_as_float(h << 16), acc[q]);
      }
    }
    uint32_t packed[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      memcpy(&packed[q], &h, 4);
    }
    reinterpret_cast<uint4 *>(p.out + t * p.n_out)[v] =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

/* The count exchange through the low-latency area (p.ll_half), all threads of every CTA: block 0
 * lays out this rank's entries and stores its count row as words of this call (call sequence q =
 * ctrl->ll_seq + 1, half q & 1, slot `rank`) into every rank's area; every CTA waits for every
 * rank's words and derives the layout from them. The words stand for the entry handshake too: a
 * rank stores them once its kernel runs, after everything earlier in its stream (its reads of
 * recv and expert_out included), and their second flag carries its call's digest, so no row is
 * copied into a rank before that rank entered this call with the same call. Nothing is fenced:
 * one latency from block 0's stores to every CTA's layout. Block 0 keeps the rows in counts_in
 * for the combine backward. A half is rewritten two calls later, by a rank that has had all of
 * the call between's words from this rank, stored once this one read everything here (the
 * comm's low-latency area contract, signal.cuh). */
__device__ __forceinline__ int exchange_layout_ll(const tw_dev_comm_t &dc, const MoeParams &p,
                                                  SharedLayout &s, int32_t *s_count,
                                                  uint64_t epoch) {
  const int ch = TW_CH_MOE, W = dc.world, stride = count_stride(p.experts);
  const uint64_t seq = tw_ll_next_seq(dc), items = ll_count_items(p.experts);
  const uint2 flag = tw_ll_flags(seq, dc.call.digest);
  const uint64_t half = p.ll_off + tw_ll_half(seq, p.ll_half);
  __shared__ int s_usable;
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_START);
    tw_trace_channel(dc, ch);
    s_usable = tw_op_usable(dc, ch);
    if (blockIdx.x == 0 && s_usable) {
      tw_call_publish(dc, ch);
      tw_signal_current(dc, ch, epoch);
      tw_ll_announce(dc, flag);
    }
  }
  __syncthreads();
  int mine = s_usable;
  if (blockIdx.x == 0 && mine) {
    layout_block(p, s_count); /* ends with a CTA barrier: cnt is complete */
    for (uint64_t j = threadIdx.x; j < (uint64_t)W * items; j += blockDim.x) {
      const int r = (int)(j / items);
      const uint64_t it = j % items;
      int32_t v[4];
      for (int q = 0; q < 4; q++)
        v[q] = (int)it * 4 + q < stride ? p.cnt[it * 4 + q] : 0;
      uint8_t *base = (uint8_t *)(r == dc.rank ? dc.ctrl : dc.peer_ctrl[r]);
      tw_ll_put_item(base + half + (uint64_t)dc.rank * kLlCountSlot, it, items,
                     make_uint4((uint32_t)v[0], (uint32_t)v[1], (uint32_t)v[2], (uint32_t)v[3]),
                     flag);
    }
  }
  const uint8_t *own = (const uint8_t *)dc.ctrl + half;
  for (uint64_t j = threadIdx.x; mine && j < (uint64_t)W * items; j += blockDim.x) {
    const int r = (int)(j / items);
    uint4 v;
    mine = tw_ll_wait_item(dc, ch, own + (uint64_t)r * kLlCountSlot, j % items, items, flag, r, &v);
  }
  const int ok = __syncthreads_and(mine);
  if (!ok)
    return 0;
  const LlCounts c{own, items};
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < W * stride; i += blockDim.x)
      p.counts_in[dc.rank][i] = c(i / stride, i % stride);
  derive_layout(p, dc, s, c);
  return 1;
}

/* Every CTA of a dispatch, first: the entry handshake, then block 0 lays out this rank's entries
 * and stores its counts into every rank's counts_in, and every CTA waits for every rank's counts
 * and derives the layout into s (or all of it through the low-latency area: exchange_layout_ll).
 * Returns whether the CTA may go on (false: a wait failed, recorded). */
__device__ __forceinline__ int exchange_layout(const tw_dev_comm_t &dc, const MoeParams &p,
                                               SharedLayout &s, int32_t *s_count, uint64_t epoch) {
  if (p.ll_half)
    return exchange_layout_ll(dc, p, s, s_count, epoch);
  const int ch = TW_CH_MOE, W = dc.world, stride = count_stride(p.experts);
  int mine = 1;
  if (threadIdx.x == 0)
    mine = tw_kernel_enter(dc, ch, epoch) && tw_wait_entries(dc, ch, epoch);
  int ok = __syncthreads_and(mine);
  if (blockIdx.x == 0 && ok) {
    layout_block(p, s_count);
    for (int r = 0; r < W; r++)
      for (int i = threadIdx.x; i < stride; i += blockDim.x)
        p.counts_in[r][dc.rank * stride + i] = p.cnt[i];
    __syncthreads();
    if (threadIdx.x == 0) {
      tw_fence_acq_rel_sys();
      for (int r = 0; r < W; r++)
        tw_signal_put(
            r == dc.rank ? tw_own_flag(dc, ch, dc.rank) : tw_peer_flag(dc, r, ch, dc.rank), epoch);
    }
  }
  if (threadIdx.x == 0)
    for (int r = 0; r < W && mine; r++)
      mine = tw_wait_geq(dc, ch, tw_own_flag(dc, ch, r), epoch, r, r);
  ok = __syncthreads_and(mine);
  if (ok)
    derive_layout(p, dc, s);
  return ok;
}

/* The last CTA of a call that exchanged its counts through the low-latency area, before
 * tw_op_end: the area's call sequence moves on (tw_ll_call_end's store). */
__device__ __forceinline__ void ll_call_done(const tw_dev_comm_t &dc, const MoeParams &p) {
  if (p.ll_half)
    *(volatile uint64_t *)&dc.ctrl->ll_seq = tw_ll_next_seq(dc);
}

/* Block 0 thread 0, where the layout is not usable (a bad index, a rank over recv_rows): the
 * error, which every rank finds alike and records itself. */
__device__ __forceinline__ void record_layout_error(const tw_dev_comm_t &dc, const MoeParams &p,
                                                    const SharedLayout &s) {
  const int ch = TW_CH_MOE;
  if (s.bad_src >= 0)
    tw_record_wait_failure(dc, TW_ERR_INVALID_ARGUMENT, ch, tw_own_flag(dc, ch, s.bad_src),
                           (uint64_t)(int64_t)s.bad_value, (uint64_t)s.bad_entry,
                           TW_ERR_PEER_MOE_INDEX, s.bad_src);
  else
    tw_record_wait_failure(dc, TW_ERR_INVALID_ARGUMENT, ch, tw_own_flag(dc, ch, s.over_rank),
                           (uint64_t)s.need[s.over_rank], (uint64_t)p.recv_rows,
                           TW_ERR_PEER_MOE_CAPACITY, s.over_rank);
}

/* Thread 0 of every CTA of a call that writes rows into every rank's buffer (the dispatch's
 * copies into recv, the combine backward's rows into expert_grad), after the CTA's writes and a
 * CTA barrier: the last CTA out of its writes (a count behind each CTA's system fence, reset by
 * that CTA) tells every rank of this node that this rank's rows landed (flag world + rank =
 * epoch), then each CTA waits for its share of the node's ranks, so the kernel ends once every
 * rank's rows landed here. (Across nodes every row lands through a rank of this node, which
 * forwards what its rail peers sent: moe_net.cuh.) Returns whether every wait succeeded. */
__device__ __forceinline__ bool rows_landed(const tw_dev_comm_t &dc, uint64_t epoch) {
  const int ch = TW_CH_MOE, W = dc.world;
  tw_fence_acq_rel_sys(); /* this CTA's stores before the count that the last CTA reads */
  uint64_t *done = tw_own_flag(dc, ch, kFlagCopiesDone);
  if (atomicAdd((unsigned long long *)done, 1ull) == gridDim.x - 1) {
    *(volatile uint64_t *)done = 0;
    tw_fence_acq_rel_sys(); /* every CTA's rows, seen through the count, before any flag */
    for (int r = 0; r < W; r++)
      if (r == dc.rank || dc.peer_ctrl[r])
        tw_signal_put(r == dc.rank ? tw_own_flag(dc, ch, W + dc.rank)
                                   : tw_peer_flag(dc, r, ch, W + dc.rank),
                      epoch);
  }
  bool ok = true;
  for (int r = blockIdx.x; r < W && ok; r += gridDim.x)
    if (r == dc.rank || dc.peer_ctrl[r])
      ok = tw_wait_geq(dc, ch, tw_own_flag(dc, ch, W + r), epoch, r, W + r);
  return ok;
}

/* Host: the arguments' contract for `kind` (TW_ERR_INVALID_ARGUMENT naming the first that breaks
 * it; TW_ERR_NOT_SUPPORTED where a peer's memory is not mapped), then the kernels' parameters;
 * *l the workspace's layout. */
tw_status_t moe_prepare(tw_comm_t comm, const tw_moe_args_t *in, int kind, tw_moe_args_t *a,
                        Layout *l, MoeParams *p);

/* Host: the call of `kind` (kDispatch, kCombine, kCombineBackward) on comm's stream: checked and
 * prepared (moe_prepare), described (what every rank must have alike), then `kernel`, a
 * persistent kernel of kMoeThreads threads taking (tw_dev_comm_t, MoeParams), launched on at most
 * comm->sm_budget CTAs that each hold an SM. On a comm across nodes `net_kernel` instead (NULL:
 * moe_net_kernel(kind)), taking (tw_dev_comm_t, MoeParams, MoeNet), on comm->sm_budget CTAs. */
tw_status_t moe_call(tw_comm_t comm, const tw_moe_args_t *in, tw_stream_t stream, int kind,
                     const void *kernel, const void *net_kernel = nullptr);

} // namespace moe
} // namespace tw
#endif
