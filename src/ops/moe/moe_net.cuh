/*
 * The MoE calls across nodes (ops/moe): the pieces of tw_moe_dispatch and tw_moe_combine when the
 * comm spans nodes (moe_net.cu holds their kernels). A token crosses the network once per node
 * that holds one of its experts, on its rank's rail (to the rank of the same local index there:
 * the rail peer), and that rank forwards it over NVLink to the ranks of its node that hold the
 * experts; the combine comes back the same way, summed per node first.
 *
 *   counts    block 0 lays out this rank's entries as inside a node (layout_block), and counts
 *             the tokens bound for each other node and numbers them in token order
 *             (net_layout_block: cnt[experts + 2 + node], send_idx, tok_out). The count row goes
 *             over NVLink to the ranks of this node and by RDMA to each rail peer, which forwards
 *             it to the ranks of its node: every rank then holds every rank's row and derives the
 *             one layout every rank derives (derive_layout), so a row's place in an expert's recv
 *             is known where it is sent (moe_net_counts.cuh).
 *   dispatch  pack: the rows bound for node q, in their order there, each staged with its meta
 *             (the token, and per slot the destination rank << 40 | row, or -1 for a slot of
 *             another node) into rows_out, then one RDMA write a chunk (at most kNetChunks a
 *             node) into the rail peer's rows_in, under the net flag of (this node, chunk).
 *             local: the rows for experts of this node, copied straight into their recv.
 *             forward: each chunk a rail peer sent, once its flag is set: its meta kept in
 *             meta_in (the combine reads it), each row copied into the recv of every slot's rank.
 *             Every CTA does its pack items first, then its local rows, then its forwards, and a
 *             forward waits only for a pack, so nothing waits on work queued behind it.
 *   combine   the weights go by RDMA to each rail peer that holds rows of this rank (w_in);
 *             each rank sums, for the rows its rail peers sent, the slots its node holds in slot
 *             order (fp32, __fmaf_rn), rounds the partial to bf16 and writes it back by RDMA, a
 *             chunk at a time, into the sender's rows_in; then out[t] = the sum over t's slots of
 *             this node in slot order, then each other node's partial in node order, fp32,
 *             rounded to bf16 once.
 *
 * Ordering: a rank writes into a rank of its node only after that rank entered the call, and by
 * RDMA into a rail peer only after its net entry flag (device/net.cuh); the regions a call
 * writes into on a peer (counts_in, rows_in, w_in) are free once the peer entered it, since its
 * previous call read them before it ended. The NIC has read what a CTA posted before the CTA
 * ends. The counts, rows, weights and partials flags are net flags of TW_CH_MOE (below).
 */
#ifndef TW_OPS_MOE_NET_CUH
#define TW_OPS_MOE_NET_CUH

#include "device/net.cuh"
#include "ops/moe/moe_layout.cuh"

namespace tw {
namespace moe {

/* Net flags of TW_CH_MOE (each set to the call's epoch): [kNetCounts + n] node n's rail peer's
 * count row landed; [kNetWeights + n] its weights; [kNetRows + slot * kNetChunks + c] chunk c of
 * the rows it sent; [kNetParts + slot * kNetChunks + c] chunk c of the partials it sent back
 * (slot: node_slot of the sending node here). */
constexpr int kNetChunks = 64;
constexpr int kNetCounts = 0, kNetWeights = TW_RAIL_MAX_NODES, kNetRows = 2 * TW_RAIL_MAX_NODES,
              kNetParts = kNetRows + (TW_RAIL_MAX_NODES - 1) * kNetChunks;
static_assert(kNetParts + (TW_RAIL_MAX_NODES - 1) * kNetChunks <= TW_NET_CH_FLAGS - 64,
              "the MoE net flags reach the entry flags");
static_assert(TW_RAIL_MAX_NODES <= 32, "a token's nodes are a 32-bit mask");

/* Where node `other`'s rows sit among this node's (mine) staging slots: 0 .. nodes - 2. */
__host__ __device__ __forceinline__ int node_slot(int other, int mine, int nodes) {
  return (other - mine + nodes) % nodes - 1;
}
/* Rows of one RDMA chunk of `rows` rows (at least 16, at most kNetChunks chunks), and chunks. */
__host__ __device__ __forceinline__ int64_t chunk_rows(int64_t rows) {
  const int64_t r = (rows + kNetChunks - 1) / kNetChunks;
  return r < 16 ? 16 : r;
}
__host__ __device__ __forceinline__ int chunk_count(int64_t rows) {
  return (int)((rows + chunk_rows(rows) - 1) / chunk_rows(rows));
}

/* What the kernels across nodes add to MoeParams (a kernel parameter of its own). */
struct MoeNet {
  tw_rail_t rail;
  Layout l;
  uint8_t *ws;     /* this rank's workspace */
  uint64_t ws_off; /* its heap offset, alike on every rank */
  int64_t max_tokens;
  int64_t stage; /* bytes of a staged row: dispatch up16(hidden * 2 + (top_k + 1) * 8), combine
                    n_out * 2 */
};

/* The call's thread-0 state of a CTA, in shared memory: the last ticket it posted (~0 none),
 * the rail peers whose entry it saw (bit = node), whether it goes on. */
struct NetCta {
  uint64_t last;
  uint32_t entered, weighed; /* weighed: the rail peers whose weights landed (the combine) */
  int ok;
};

/* Thread 0: before the CTA's first RDMA write to node q's rail peer, that peer entered the call
 * (its regions here are free); false: the wait failed (recorded). */
__device__ __forceinline__ bool net_peer_entered(const tw_dev_comm_t &dc, const MoeNet &n,
                                                 NetCta &c, int q, uint64_t epoch) {
  if (c.entered >> q & 1u)
    return true;
  if (!tw_net_wait_entry(dc, TW_CH_MOE, n.rail.rail[q], q, epoch))
    return false;
  c.entered |= 1u << q;
  return true;
}

/* Thread 0: posts `bytes` at workspace offset `from` to node q's rail peer's `to`, under its
 * net flag `slot`. */
__device__ __forceinline__ void net_post(const tw_dev_comm_t &dc, const MoeNet &n, NetCta &c, int q,
                                         uint64_t from, uint64_t to, uint64_t bytes, int slot,
                                         uint64_t epoch) {
  if (!c.ok || !(c.ok = net_peer_entered(dc, n, c, q, epoch)))
    return;
  const uint64_t t = tw_net_post_write(dc, TW_CH_MOE, n.rail.rail[q], n.ws_off + from,
                                       n.ws_off + to, bytes, slot, epoch);
  c.ok = t != ~0ull;
  c.last = c.ok ? t : c.last;
}

/* Thread 0: staged rows k0 .. k1 of node q's slot in region `from` (rows of `stage` bytes,
 * [nodes - 1][max_tokens] of them) posted into the same rows of this node's slot in q's rail
 * peer's region `to`, under net flag `flags` + (that slot) x kNetChunks + chunk. */
__device__ __forceinline__ void post_staged(const tw_dev_comm_t &dc, const MoeNet &n, NetCta &c,
                                            int q, int chunk, int64_t k0, int64_t k1, int flags,
                                            uint64_t epoch, uint64_t from, uint64_t to,
                                            int64_t stage) {
  const int N = n.rail.nodes, h = node_slot(q, n.rail.node, N), hr = node_slot(n.rail.node, q, N);
  const uint64_t off = (uint64_t)k0 * stage;
  net_post(dc, n, c, q, from + (uint64_t)h * n.max_tokens * stage + off,
           to + (uint64_t)hr * n.max_tokens * stage + off, (uint64_t)(k1 - k0) * stage,
           flags + hr * kNetChunks + chunk, epoch);
}
/* post_staged from rows_out into rows_in (this node's rows for q, or the partials of q's rows). */
__device__ __forceinline__ void post_chunk(const tw_dev_comm_t &dc, const MoeNet &n, NetCta &c,
                                           int q, int chunk, int64_t k0, int64_t k1, int flags,
                                           uint64_t epoch) {
  post_staged(dc, n, c, q, chunk, k0, k1, flags, epoch, n.l.rows_out, n.l.rows_in, n.stage);
}

/* The nodes other than this one that hold an expert of token t (bit = node). */
__device__ __forceinline__ uint32_t token_nodes(const MoeParams &p, const MoeNet &n, int64_t t) {
  uint32_t mask = 0;
  for (int j = 0; j < p.top_k; j++) {
    const int32_t e = load_index(p, t * p.top_k + j);
    if (e >= 0 && e < p.experts)
      mask |= 1u << n.rail.node_of[e / p.local_experts];
  }
  return mask & ~(1u << n.rail.node);
}

/* Block 0, all threads, after layout_block: the tokens bound for each other node, counted into
 * cnt[experts + 2 + node] and numbered in token order (send_idx[t][node], -1 none; tok_out[slot]
 * [i] = the token of row i). Warp w takes the w-th part of the tokens, as layout_block. */
__device__ inline void net_layout_block(const MoeParams &p, const MoeNet &n) {
  __shared__ int32_t s_node[kMoeWarps + 1][TW_RAIL_MAX_NODES];
  const int N = n.rail.nodes, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = (int)(blockDim.x / 32);
  const int64_t T = p.tokens, begin = T * warp / warps, end = T * (warp + 1) / warps;
  int32_t *send_idx = (int32_t *)(n.ws + n.l.send_idx);
  int32_t *tok_out = (int32_t *)(n.ws + n.l.tok_out);
  int32_t count = 0; /* lane q: this warp's tokens bound for node q */
  for (int64_t base = begin; base < end; base += 32) {
    const uint32_t m = base + lane < end ? token_nodes(p, n, base + lane) : 0;
    for (int q = 0; q < N; q++) {
      const int c = __popc(__ballot_sync(0xffffffffu, m >> q & 1u));
      count += lane == q ? c : 0;
    }
  }
  if (lane < N)
    s_node[warp][lane] = count;
  __syncthreads();
  if (threadIdx.x < N) { /* node q's warps scanned */
    const int q = threadIdx.x;
    int32_t run = 0;
    for (int w = 0; w < warps; w++) {
      const int32_t c = s_node[w][q];
      s_node[w][q] = run;
      run += c;
    }
    p.cnt[p.experts + 2 + q] = q == n.rail.node ? 0 : run;
  }
  __syncthreads();
  int32_t next = lane < N ? s_node[warp][lane] : 0; /* lane q: node q's next row */
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t t = base + lane;
    const uint32_t m = t < end ? token_nodes(p, n, t) : 0;
    for (int q = 0; q < N; q++) {
      const unsigned bits = __ballot_sync(0xffffffffu, m >> q & 1u);
      const int32_t at = __shfl_sync(0xffffffffu, next, q) + __popc(bits & ((1u << lane) - 1));
      if (t < end) {
        send_idx[t * N + q] = m >> q & 1u ? at : -1;
        if (m >> q & 1u)
          tok_out[(int64_t)node_slot(q, n.rail.node, N) * n.max_tokens + at] = (int32_t)t;
      }
      next += lane == q ? __popc(bits) : 0;
    }
  }
  __syncthreads();
}

/* Thread 0 of every CTA, a call's start across nodes: the CTA's state, the entry handshake of
 * this node's ranks, and block 0's net entry to each rail peer. */
__device__ inline void net_enter(const tw_dev_comm_t &dc, const MoeNet &n, NetCta &c,
                                 uint64_t epoch) {
  const tw_rail_t &x = n.rail;
  c.last = ~0ull, c.entered = 0, c.weighed = 0;
  c.ok = tw_kernel_enter(dc, TW_CH_MOE, epoch) && tw_wait_entries(dc, TW_CH_MOE, epoch);
  for (int q = 0; q < x.nodes && c.ok && blockIdx.x == 0; q++)
    if (q != x.node) {
      const uint64_t t = tw_net_signal_entry(dc, TW_CH_MOE, x.rail[q], x.node, epoch);
      c.ok = t != ~0ull;
      c.last = t;
    }
}

/* Rows rank src sends to node q (from the count rows every rank holds). */
__device__ __forceinline__ int64_t rows_to_node(const MoeParams &p, const tw_dev_comm_t &dc,
                                                int src, int q) {
  const volatile int32_t *row = p.counts_in[dc.rank] + (int64_t)src * count_stride(p.experts);
  return row[p.experts + 2 + q];
}

/* All threads: chunk c of the rows bound for node q (row k: token tok_out[k], in the order the
 * dispatch numbered them) each staged by stage(dst, t, lane), a warp a row, then posted under the
 * rows flags. */
template <class Stage>
__device__ inline void pack_rows(const tw_dev_comm_t &dc, const MoeParams &p, const MoeNet &n,
                                 NetCta &c, int q, int chunk, uint64_t epoch, const Stage &stage) {
  const int h = node_slot(q, n.rail.node, n.rail.nodes), lane = threadIdx.x % 32;
  const int64_t rows = p.cnt[p.experts + 2 + q], cr = chunk_rows(rows), k0 = chunk * cr;
  const int64_t k1 = min(rows, k0 + cr), slot0 = (int64_t)h * n.max_tokens;
  const int32_t *tok = (const int32_t *)(n.ws + n.l.tok_out) + slot0;
  uint8_t *staged = n.ws + n.l.rows_out + (size_t)slot0 * n.stage;
  for (int64_t k = k0 + threadIdx.x / 32; k < k1; k += blockDim.x / 32)
    stage(staged + (size_t)k * n.stage, (int64_t)tok[k], lane);
  __syncthreads();
  if (threadIdx.x == 0)
    post_chunk(dc, n, c, q, chunk, k0, k1, kNetRows, epoch);
  __syncthreads();
}

/* A dispatch's staged row for node q: token t's row of x, then its meta (the token, and per slot
 * the destination rank << 40 | row, or -1 for a slot of another node). */
struct StageDispatch {
  const MoeParams &p;
  const tw_rail_t &x;
  const SharedLayout &s;
  int q;
  __device__ void operator()(uint8_t *dst, int64_t t, int lane) const {
    warp_copy_row((uint16_t *)dst, p.x + t * p.hidden, p.hidden, lane);
    int64_t *meta = (int64_t *)(dst + p.hidden * 2);
    if (lane == 0)
      meta[0] = t;
    for (int j = lane; j < p.top_k; j += 32) {
      const int64_t i = t * p.top_k + j;
      const int32_t e = load_index(p, i);
      int64_t m = -1;
      if (e >= 0 && x.node_of[e / p.local_experts] == q)
        m = (int64_t)(e / p.local_experts) << 40 | (int64_t)(s.base[e] + p.pos[i]);
      meta[1 + j] = m;
    }
  }
};

/* All threads: chunk c of the rows bound for node q staged (each with its meta) and posted. */
__device__ inline void pack_chunk(const tw_dev_comm_t &dc, const MoeParams &p, const MoeNet &n,
                                  const SharedLayout &s, NetCta &c, int q, int chunk,
                                  uint64_t epoch) {
  pack_rows(dc, p, n, c, q, chunk, epoch, StageDispatch{p, n.rail, s, q});
}

/* All threads: chunk c of the rows node q's rail peer sent (rows k0 .. k1 of q's slot, which
 * starts at row slot0 of the staging), once its flag is set; false: the wait failed (recorded). */
__device__ inline bool await_sent_chunk(const tw_dev_comm_t &dc, const MoeParams &p,
                                        const MoeNet &n, NetCta &c, int q, int chunk,
                                        uint64_t epoch, int64_t *k0, int64_t *k1, int64_t *slot0) {
  const tw_rail_t &x = n.rail;
  const int h = node_slot(q, x.node, x.nodes), src = x.rail[q];
  const int64_t rows = rows_to_node(p, dc, src, x.node), cr = chunk_rows(rows);
  *k0 = chunk * cr, *k1 = min(rows, *k0 + cr), *slot0 = (int64_t)h * n.max_tokens;
  if (threadIdx.x == 0 && c.ok)
    c.ok = tw_wait_geq(dc, TW_CH_MOE, tw_net_flag(dc, TW_CH_MOE, kNetRows + h * kNetChunks + chunk),
                       epoch, src, chunk);
  __syncthreads();
  return c.ok;
}

/* All threads: chunk c of the rows node q's rail peer sent, once landed: each row's meta kept in
 * meta_in, the row copied into the recv of each slot's rank; kCount (tw_moe_dispatch_gemm): then
 * one system-scope add of 1 to the counter of the row's 128-row block on that rank, as copy_rows
 * adds (moe_hooks.cuh). */
template <bool kCount = false>
__device__ inline void forward_chunk(const tw_dev_comm_t &dc, const MoeParams &p, const MoeNet &n,
                                     NetCta &c, int q, int chunk, uint64_t epoch) {
  const int lane = threadIdx.x % 32;
  int64_t k0, k1, slot0;
  if (!await_sent_chunk(dc, p, n, c, q, chunk, epoch, &k0, &k1, &slot0))
    return;
  const uint8_t *staged = n.ws + n.l.rows_in + (size_t)slot0 * n.stage;
  int64_t *kept = (int64_t *)(n.ws + n.l.meta_in) + slot0 * (p.top_k + 1);
  for (int64_t k = k0 + threadIdx.x / 32; k < k1; k += blockDim.x / 32) {
    const uint8_t *row = staged + (size_t)k * n.stage;
    const int64_t *meta = (const int64_t *)(row + p.hidden * 2);
    for (int j = lane; j <= p.top_k; j += 32)
      kept[k * (p.top_k + 1) + j] = __ldcg(meta + j);
    for (int j = 0; j < p.top_k; j++) {
      const int64_t m = __ldcg(meta + 1 + j);
      if (m < 0)
        continue;
      const int d = (int)(m >> 40);
      const int64_t at = m & ((1ll << 40) - 1);
      warp_copy_row<true>(p.recv[d] + at * p.hidden, (const uint16_t *)row, p.hidden, lane);
      if constexpr (kCount) {
        __syncwarp();
        if (lane == 0) {
          const int index = kFlagBlocks + (int)(at / 128);
          tw_fence_acq_rel_sys(); /* the warp's stores (seen through the barrier) before the add */
          tw_red_relaxed_sys_add(d == dc.rank ? tw_own_flag(dc, TW_CH_MOE, index)
                                              : tw_peer_flag(dc, d, TW_CH_MOE, index),
                                 1);
        }
      }
    }
  }
  __syncthreads();
}

/* fp32 acc[8] += w x the 8 bf16 of `bits` (__fmaf_rn). */
__device__ __forceinline__ void fma_bf16x8(float *acc, float w, uint4 bits) {
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int q = 0; q < 8; q++) {
    const uint32_t h = q % 2 ? words[q / 2] >> 16 : words[q / 2] & 0xffffu;
    acc[q] = __fmaf_rn(w, __uint_as_float(h << 16), acc[q]);
  }
}
__device__ __forceinline__ uint4 pack_bf16x8(const float *acc) {
  uint32_t packed[4];
#pragma unroll
  for (int q = 0; q < 4; q++) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    memcpy(&packed[q], &h, 4);
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

/* The expert rows a combine reads, ready where they are read: tw_moe_combine's are (the GEMM
 * before it is stream-ordered); a fused kernel's Ready waits (thread 0, bounded) until the row
 * block of route entry `m` (rank << 40 | row) is complete on its rank. */
struct RowsReady {
  __device__ bool operator()(int64_t) const { return true; }
};

/* All threads: chunk c of the partials for the rows node q's rail peer sent (their weights
 * landed): per row the slots of this node, in slot order, staged as bf16 and posted back; each
 * row once ready(slot) held for each of its slots (thread 0). */
template <class Ready = RowsReady>
__device__ inline void partial_chunk(const tw_dev_comm_t &dc, const MoeParams &p, const MoeNet &n,
                                     NetCta &c, int q, int chunk, uint64_t epoch,
                                     const Ready &ready = Ready()) {
  __shared__ int64_t s_meta[kMaxTopK + 1];
  const tw_rail_t &x = n.rail;
  const int N = x.nodes, h = node_slot(q, x.node, N), src = x.rail[q];
  const int64_t rows = rows_to_node(p, dc, src, x.node), cr = chunk_rows(rows), k0 = chunk * cr;
  const int64_t k1 = min(rows, k0 + cr), slot0 = (int64_t)h * n.max_tokens;
  const float *w = (const float *)(n.ws + n.l.w_in) + slot0 * p.top_k;
  const int64_t *kept = (const int64_t *)(n.ws + n.l.meta_in) + slot0 * (p.top_k + 1);
  uint8_t *staged = n.ws + n.l.rows_out + (size_t)slot0 * n.stage;
  const int64_t vecs = p.n_out / 8;
  if (threadIdx.x == 0 && c.ok && !(c.weighed >> q & 1u)) {
    c.ok = tw_wait_geq(dc, TW_CH_MOE, tw_net_flag(dc, TW_CH_MOE, kNetWeights + q), epoch, src, -1);
    c.weighed |= 1u << q;
  }
  __syncthreads();
  if (!c.ok)
    return;
  for (int64_t k = k0; k < k1; k++) {
    __syncthreads();
    if (threadIdx.x <= p.top_k)
      s_meta[threadIdx.x] = kept[k * (p.top_k + 1) + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0)
      for (int j = 0; j < p.top_k && c.ok; j++)
        if (s_meta[1 + j] >= 0)
          c.ok = ready(s_meta[1 + j]);
    __syncthreads();
    if (!c.ok)
      break; /* read by every thread before thread 0 can write it again */
    const int64_t t = s_meta[0];
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int j = 0; j < p.top_k; j++) {
        const int64_t m = s_meta[1 + j];
        if (m < 0)
          continue;
        const uint16_t *y = p.expert_out[m >> 40] + (m & ((1ll << 40) - 1)) * p.n_out;
        fma_bf16x8(acc, __ldcg(w + t * p.top_k + j),
                   __ldcg(reinterpret_cast<const uint4 *>(y) + v));
      }
      reinterpret_cast<uint4 *>(staged + (size_t)k * n.stage)[v] = pack_bf16x8(acc);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0)
    post_chunk(dc, n, c, q, chunk, k0, k1, kNetParts, epoch);
  __syncthreads();
}

/* All threads: out[t] = t's slots of this node in slot order, then each other node's partial in
 * node order (landed: the caller waited), fp32, rounded once. */
__device__ __forceinline__ void combine_token_net(const MoeParams &p, const MoeNet &n,
                                                  const int32_t *s_k, int64_t t) {
  const int N = n.rail.nodes;
  const int64_t vecs = p.n_out / 8;
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < p.top_k; j++) {
      const int64_t r = p.route[t * p.top_k + j];
      if (r >= 0)
        fma_bf16x8(acc, p.topk_weights[t * p.top_k + j],
                   __ldcg(reinterpret_cast<const uint4 *>(p.expert_out[r >> 40] +
                                                          (r & ((1ll << 40) - 1)) * p.n_out) +
                          v));
    }
    for (int q = 0; q < N; q++)
      if (s_k[q] >= 0) {
        const uint8_t *part =
            n.ws + n.l.rows_in +
            ((size_t)node_slot(q, n.rail.node, N) * n.max_tokens + s_k[q]) * n.stage;
        fma_bf16x8(acc, 1.0f, __ldcg(reinterpret_cast<const uint4 *>(part) + v));
      }
    reinterpret_cast<uint4 *>(p.out + t * p.n_out)[v] = pack_bf16x8(acc);
  }
}

/* Item `item` of a CTA's round robin over the grid: whether it is this CTA's. */
__device__ __forceinline__ bool net_item_mine(int item) {
  return item % (int)gridDim.x == (int)blockIdx.x;
}

/* All threads of every CTA: a dispatch's three rounds across nodes, each CTA its items: the
 * chunks bound for the other nodes (pack_chunk), this rank's entries whose experts sit on this
 * node (copied into their recv; an entry for another node gets route -1: the combine reads its
 * node's partial instead), and the chunks the rail peers sent (forward_chunk). A pack waits for
 * nothing but the receiver's entry, so the forwards, which wait for packs, never wait on work
 * queued behind them. kCount (the fused dispatches): after each row lands, one system-scope add
 * of 1 to the counter of its 128-row block on its rank, as copy_rows adds (moe_hooks.cuh). */
template <bool kCount>
__device__ inline void net_copy_rounds(const tw_dev_comm_t &dc, const MoeParams &p, const MoeNet &n,
                                       const SharedLayout &s, NetCta &c, uint64_t epoch) {
  const tw_rail_t &x = n.rail;
  const int E = p.experts;
  int item = 0; /* the items of the pack and forward rounds, in turn */
  for (int q = 0; q < x.nodes; q++)
    if (q != x.node)
      for (int k = 0, chunks = chunk_count(p.cnt[E + 2 + q]); k < chunks; k++, item++)
        if (net_item_mine(item))
          pack_chunk(dc, p, n, s, c, q, k, epoch);
  const int64_t entries = p.tokens * p.top_k;
  const int lane = threadIdx.x % 32, warps = (int)(blockDim.x / 32);
  for (int64_t i = (int64_t)blockIdx.x * warps + threadIdx.x / 32; i < entries;
       i += (int64_t)gridDim.x * warps) {
    const int32_t e = load_index(p, i);
    if (e < 0)
      continue; /* its route is -1 (layout_block) */
    const int d = e / p.local_experts;
    if (x.node_of[d] != x.node) { /* sent in a chunk to d's node */
      if (lane == 0)
        p.route[i] = -1;
      continue;
    }
    const int64_t row = (int64_t)s.base[e] + p.pos[i];
    warp_copy_row(p.recv[d] + row * p.hidden, p.x + (i / p.top_k) * p.hidden, p.hidden, lane);
    if constexpr (kCount)
      __syncwarp();
    if (lane == 0) {
      p.route[i] = (int64_t)d << 40 | row;
      if constexpr (kCount) {
        const int index = kFlagBlocks + (int)(row / 128);
        tw_fence_acq_rel_sys(); /* the warp's stores (seen through the barrier) before the add */
        tw_red_relaxed_sys_add(d == dc.rank ? tw_own_flag(dc, TW_CH_MOE, index)
                                            : tw_peer_flag(dc, d, TW_CH_MOE, index),
                               1);
      }
    }
  }
  for (int q = 0; q < x.nodes; q++)
    if (q != x.node)
      for (int k = 0, chunks = chunk_count(rows_to_node(p, dc, x.rail[q], x.node)); k < chunks;
           k++, item++)
        if (net_item_mine(item))
          forward_chunk<kCount>(dc, p, n, c, q, k, epoch);
}

/* Block 0, all threads: this rank's weights by RDMA to each rail peer that holds rows of it. */
__device__ inline void net_send_weights(const tw_dev_comm_t &dc, const MoeParams &p,
                                        const MoeNet &n, NetCta &c, uint64_t epoch) {
  const tw_rail_t &x = n.rail;
  const int N = x.nodes;
  const int64_t entries = p.tokens * p.top_k;
  float *w_out = (float *)(n.ws + n.l.w_out);
  for (int64_t i = threadIdx.x; i < entries; i += blockDim.x)
    w_out[i] = p.topk_weights[i];
  __syncthreads();
  if (threadIdx.x == 0)
    for (int q = 0; q < N; q++)
      if (q != x.node && p.cnt[p.experts + 2 + q] > 0)
        net_post(dc, n, c, q, n.l.w_out,
                 n.l.w_in + (uint64_t)node_slot(x.node, q, N) * n.max_tokens * p.top_k * 4,
                 (uint64_t)entries * 4, kNetWeights + x.node, epoch);
  __syncthreads();
}

/* All threads of every CTA: its items of the partials for the rows the rail peers sent. */
template <class Ready>
__device__ inline void net_partials(const tw_dev_comm_t &dc, const MoeParams &p, const MoeNet &n,
                                    NetCta &c, uint64_t epoch, const Ready &ready) {
  const tw_rail_t &x = n.rail;
  int item = 0;
  for (int q = 0; q < x.nodes; q++)
    if (q != x.node)
      for (int k = 0, chunks = chunk_count(rows_to_node(p, dc, x.rail[q], x.node)); k < chunks;
           k++, item++)
        if (net_item_mine(item))
          partial_chunk(dc, p, n, c, q, k, epoch, ready);
}

/* All threads of every CTA: out for this CTA's tokens (a static stride), each once the partials
 * of its rows landed from the other nodes and ready(slot) held for its slots on this node
 * (thread 0). */
template <class Ready>
__device__ inline void net_combine_tokens(const tw_dev_comm_t &dc, const MoeParams &p,
                                          const MoeNet &n, NetCta &c, uint64_t epoch,
                                          const Ready &ready) {
  __shared__ int32_t s_k[TW_RAIL_MAX_NODES];    /* a token's row among those sent to each node */
  __shared__ int32_t waited[TW_RAIL_MAX_NODES]; /* thread 0's: the last chunk of partials seen
                                                 * per node (shared: indexed at run time) */
  const int ch = TW_CH_MOE, E = p.experts;
  const tw_rail_t &x = n.rail;
  const int N = x.nodes;
  const int32_t *send_idx = (const int32_t *)(n.ws + n.l.send_idx);
  if (threadIdx.x == 0)
    for (int q = 0; q < N; q++)
      waited[q] = -1;
  __syncthreads();
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    if (threadIdx.x == 0) {
      for (int j = 0; j < p.top_k && c.ok; j++) {
        const int64_t r = p.route[t * p.top_k + j];
        if (r >= 0)
          c.ok = ready(r);
      }
      for (int q = 0; q < N; q++) {
        const int32_t k = q == x.node ? -1 : send_idx[t * N + q];
        s_k[q] = k;
        const int chunk = k < 0 ? -1 : (int)(k / chunk_rows(p.cnt[E + 2 + q]));
        if (chunk > waited[q] && c.ok) {
          c.ok = tw_wait_geq(
              dc, ch, tw_net_flag(dc, ch, kNetParts + node_slot(q, x.node, N) * kNetChunks + chunk),
              epoch, x.rail[q], chunk);
          waited[q] = chunk;
        }
      }
    }
    __syncthreads();
    const bool go = c.ok; /* read by every thread before thread 0 can write it again */
    if (go)
      combine_token_net(p, n, s_k, t);
    __syncthreads();
    if (!go)
      break;
  }
}

/* Host: the net parameters of a call of `kind` (kDispatch, kCombine, kDispatchGemm) across
 * nodes. */
tw_status_t moe_net_params(tw_comm_t comm, const tw_moe_args_t &a, int kind, const Layout &l,
                           MoeNet *n);
/* Host: the kernel of `kind` across nodes. */
const void *moe_net_kernel(int kind);
/* Host: bytes of a staged row of `kind` (the dispatches, tw_moe_ffn's rows among them: of
 * `hidden` and its meta; the combine backward's: a gradient row of n_out and its token's
 * weights; the combines: of n_out). */
inline size_t net_stage(int kind, int64_t hidden, int64_t n_out, int64_t top_k) {
  if (kind == kDispatch || kind == kDispatchGemm || kind == kFfn)
    return ((size_t)hidden * 2 + (size_t)(top_k + 1) * 8 + 15) / 16 * 16;
  if (kind == kCombineBackward)
    return ((size_t)n_out * 2 + (size_t)top_k * 4 + 15) / 16 * 16;
  return (size_t)n_out * 2;
}
/* Host: bytes of a row of the second staging (parts_out / parts_in) of `kind`: tw_moe_ffn's
 * partials (n_out), the combine backward's dots (top_k fp32); 0 for the calls without one. The
 * workspace holds the larger of the two for its hidden (tw_moe_workspace_size), so every call
 * fits the workspace sized for its widest row. */
inline size_t net_part_stage(int kind, int64_t n_out, int64_t top_k) {
  return kind == kFfn ? (size_t)n_out * 2 : kind == kCombineBackward ? (size_t)top_k * 4 : 0;
}

} // namespace moe
} // namespace tw
#endif
