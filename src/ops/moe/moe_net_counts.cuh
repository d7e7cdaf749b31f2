/*
 * The counts step of the MoE calls across nodes (moe_net.cuh says what it does): every rank's
 * count row reaches every rank, inside the node over NVLink and to each rail peer by one RDMA
 * write, and every CTA derives the one layout. Two forms: the fenced exchange (count rows in
 * counts_in under flags) and, where the call has a low-latency area, the rows as flagged words
 * inside the node with only the rail hop an RDMA write. Included by the kernels that run the
 * counts step (moe_net.cu, moe_gemm.cu, moe_ffn.cu).
 */
#ifndef TW_OPS_MOE_NET_COUNTS_CUH
#define TW_OPS_MOE_NET_COUNTS_CUH

#include "ops/moe/moe_net.cuh"

namespace tw {
namespace moe {

/* Whether rank r is on this rank's rail in another node (its count row lands here by RDMA). */
__device__ __forceinline__ bool rail_peer(const tw_rail_t &x, int r) {
  return x.node_of[r] != x.node && x.local_of[r] == x.local;
}

/* The flag this rank waits on for rank r's count row: a net flag where r is a rail peer (its row
 * landed here by RDMA), else this rank's flag r (set by r, or by the rank of this node that
 * forwards what r sent). */
__device__ __forceinline__ const uint64_t *count_flag(const tw_dev_comm_t &dc, const MoeNet &n,
                                                      int r) {
  const tw_rail_t &x = n.rail;
  if (rail_peer(x, r))
    return tw_net_flag(dc, TW_CH_MOE, kNetCounts + x.node_of[r]);
  return tw_own_flag(dc, TW_CH_MOE, r);
}

/* Thread 0 of block 0: this rank's count row (cnt) into each rail peer's counts_in by RDMA,
 * under the net flag of (this node, counts). */
__device__ inline void post_count_row(const tw_dev_comm_t &dc, const MoeNet &n, NetCta &c,
                                      int stride, uint64_t epoch) {
  const tw_rail_t &x = n.rail;
  for (int q = 0; q < x.nodes; q++)
    if (q != x.node)
      net_post(dc, n, c, q, n.l.cnt, n.l.counts_in + (uint64_t)dc.rank * stride * 4,
               (uint64_t)stride * 4, kNetCounts + x.node, epoch);
}

/* Every thread of block 0: thread 0 waits for the count row of node q's rail peer (its net
 * flag); returns whether it landed (false: the wait failed, recorded in c). */
__device__ inline bool await_rail_row(const tw_dev_comm_t &dc, const MoeNet &n, NetCta &c, int q,
                                      uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0 && c.ok)
    c.ok = tw_wait_geq(dc, TW_CH_MOE, tw_net_flag(dc, TW_CH_MOE, kNetCounts + q), epoch,
                       n.rail.rail[q], -1);
  __syncthreads();
  return c.ok;
}

/* The count row of each other node's rank on this rank's rail, in node order: awaited, then
 * fn(src) forwards it (src: that rank). Stops at the first failed wait (recorded in c). */
template <class F>
__device__ inline void forward_rail_rows(const tw_dev_comm_t &dc, const MoeNet &n, NetCta &c,
                                         uint64_t epoch, F &&fn) {
  for (int q = 0; q < n.rail.nodes; q++) {
    if (q == n.rail.node)
      continue;
    if (!await_rail_row(dc, n, c, q, epoch))
      return;
    fn(n.rail.rail[q]);
  }
}

/* Where exchange_layout_net_ll's layout reads the count rows: a rail peer's in counts_in (landed
 * by RDMA), every other rank's as words in this rank's low-latency area (its own, this node's
 * ranks', and the other nodes' ranks forwarded by this node's rank on their rail). */
struct NetLlCounts {
  LlCounts ll;
  const volatile int32_t *c; /* this rank's counts_in */
  int stride;
  const tw_rail_t *x;
  __device__ int32_t operator()(int r, int i) const {
    return rail_peer(*x, r) ? c[r * stride + i] : ll(r, i);
  }
};

/* exchange_layout_net through the low-latency area (p.ll_half; exchange_layout_ll's words and
 * contract inside the node), every CTA. Block 0 announces the call, signals its net entry to
 * each rail peer, lays out this rank's entries, stores its count row as words into every
 * rank of this node and posts it to each rail peer (counts_in, under the net flag, as the
 * fenced exchange does); then, as each rail peer's row lands, stores it as that rank's words
 * into this node's other ranks. Every CTA waits for each rail peer's net flag and every other
 * rank's words, and derives the layout. The words stand for this node's entry handshake, as
 * inside a node; the rail hop keeps its net entry. Block 0 keeps every row in counts_in (the
 * combine backward's, and rows_to_node's rail rows). Returns whether the CTA may go on. */
__device__ inline int exchange_layout_net_ll(const tw_dev_comm_t &dc, const MoeParams &p,
                                             const MoeNet &n, SharedLayout &s, int32_t *s_count,
                                             NetCta &c, uint64_t epoch) {
  const int ch = TW_CH_MOE, W = dc.world, stride = count_stride(p.experts);
  const tw_rail_t &x = n.rail;
  const uint64_t seq = tw_ll_next_seq(dc), items = ll_count_items(p.experts);
  const uint2 flag = tw_ll_flags(seq, dc.call.digest);
  const uint64_t half = p.ll_off + tw_ll_half(seq, p.ll_half);
  if (threadIdx.x == 0) {
    c.last = ~0ull, c.entered = 0, c.weighed = 0;
    tw_trace_stamp(dc, TW_TR_START);
    tw_trace_channel(dc, ch);
    c.ok = tw_op_usable(dc, ch);
    if (blockIdx.x == 0 && c.ok) {
      tw_call_publish(dc, ch);
      tw_signal_current(dc, ch, epoch);
      tw_ll_announce(dc, flag);
      for (int q = 0; q < x.nodes && c.ok; q++)
        if (q != x.node) {
          const uint64_t t = tw_net_signal_entry(dc, ch, x.rail[q], x.node, epoch);
          c.ok = t != ~0ull;
          c.last = t;
        }
    }
  }
  __syncthreads();
  const uint8_t *own = (const uint8_t *)dc.ctrl + half;
  /* the words of row `src` (data at `row`) into the slot of src in every rank of this node but
   * `skip` */
  auto put_row = [&](int src, const volatile int32_t *row, int skip) {
    for (uint64_t j = threadIdx.x; j < (uint64_t)x.local_size * items; j += blockDim.x) {
      const int r = x.local_rank[j / items];
      const uint64_t it = j % items;
      if (r == skip)
        continue;
      int32_t v[4];
      for (int q = 0; q < 4; q++)
        v[q] = (int)it * 4 + q < stride ? row[it * 4 + q] : 0;
      uint8_t *base = (uint8_t *)(r == dc.rank ? dc.ctrl : dc.peer_ctrl[r]);
      tw_ll_put_item(base + half + (uint64_t)src * kLlCountSlot, it, items,
                     make_uint4((uint32_t)v[0], (uint32_t)v[1], (uint32_t)v[2], (uint32_t)v[3]),
                     flag);
    }
  };
  if (blockIdx.x == 0 && c.ok) {
    layout_block(p, s_count);
    net_layout_block(p, n); /* ends with a CTA barrier: cnt is complete */
    put_row(dc.rank, p.cnt, -1);
    if (threadIdx.x == 0 && x.nodes > 1) {
      tw_fence_acq_rel_sys(); /* the block's cnt before the NIC reads it */
      post_count_row(dc, n, c, stride, epoch);
    }
    /* the rail peers' rows, as their words, into the other ranks of this node */
    forward_rail_rows(dc, n, c, epoch, [&](int src) {
      put_row(src, p.counts_in[dc.rank] + (int64_t)src * stride, dc.rank);
    });
  }
  __syncthreads();
  const NetLlCounts rows{LlCounts{own, items}, p.counts_in[dc.rank], stride, &x};
  int mine = c.ok;
  for (uint64_t j = threadIdx.x; mine && j < (uint64_t)W * items; j += blockDim.x) {
    const int r = (int)(j / items);
    if (rail_peer(x, r))
      continue;
    uint4 v;
    mine = tw_ll_wait_item(dc, ch, own + (uint64_t)r * kLlCountSlot, j % items, items, flag, r, &v);
  }
  if (threadIdx.x == 0)
    for (int q = 0; q < x.nodes && mine; q++)
      if (q != x.node)
        mine =
            tw_wait_geq(dc, ch, tw_net_flag(dc, ch, kNetCounts + q), epoch, x.rail[q], x.rail[q]);
  const int ok = __syncthreads_and(mine);
  if (threadIdx.x == 0)
    c.ok = ok;
  if (!ok)
    return 0;
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < W * stride; i += blockDim.x)
      if (!rail_peer(x, i / stride))
        p.counts_in[dc.rank][i] = rows(i / stride, i % stride);
  derive_layout(p, dc, s, rows);
  return 1;
}

/* exchange_layout across nodes (the counts step above), every CTA: the entry handshakes, block 0's
 * layout and count exchange, every rank's counts awaited and the layout derived into s. Returns
 * whether the CTA may go on (false: a wait failed, recorded). */
__device__ inline int exchange_layout_net(const tw_dev_comm_t &dc, const MoeParams &p,
                                          const MoeNet &n, SharedLayout &s, int32_t *s_count,
                                          NetCta &c, uint64_t epoch) {
  if (p.ll_half)
    return exchange_layout_net_ll(dc, p, n, s, s_count, c, epoch);
  const int ch = TW_CH_MOE, W = dc.world, stride = count_stride(p.experts);
  const tw_rail_t &x = n.rail;
  if (threadIdx.x == 0)
    net_enter(dc, n, c, epoch);
  __syncthreads();
  if (blockIdx.x == 0 && c.ok) {
    layout_block(p, s_count);
    net_layout_block(p, n);
    for (int j = 0; j < x.local_size; j++)
      for (int i = threadIdx.x; i < stride; i += blockDim.x)
        p.counts_in[x.local_rank[j]][dc.rank * stride + i] = p.cnt[i];
    __syncthreads();
    if (threadIdx.x == 0) {
      tw_fence_acq_rel_sys();
      for (int j = 0; j < x.local_size; j++) {
        const int r = x.local_rank[j];
        tw_signal_put(r == dc.rank ? tw_own_flag(dc, ch, r) : tw_peer_flag(dc, r, ch, dc.rank),
                      epoch);
      }
      post_count_row(dc, n, c, stride, epoch);
    }
    /* the rail peers' rows, forwarded to the other ranks of this node */
    forward_rail_rows(dc, n, c, epoch, [&](int src) {
      const volatile int32_t *row = p.counts_in[dc.rank] + (int64_t)src * stride;
      for (int j = 0; j < x.local_size; j++)
        for (int i = threadIdx.x; i < stride && x.local_rank[j] != dc.rank; i += blockDim.x)
          p.counts_in[x.local_rank[j]][src * stride + i] = row[i];
      __syncthreads();
      if (threadIdx.x == 0) {
        tw_fence_acq_rel_sys();
        for (int j = 0; j < x.local_size; j++)
          if (x.local_rank[j] != dc.rank)
            tw_signal_put(tw_peer_flag(dc, x.local_rank[j], ch, src), epoch);
      }
    });
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int r = 0; r < W && c.ok; r++)
      c.ok = tw_wait_geq(dc, ch, count_flag(dc, n, r), epoch, r, r);
  __syncthreads();
  const int ok = c.ok;
  if (ok)
    derive_layout(p, dc, s);
  return ok;
}

/* exchange_layout_net as a fused kernel's layout_phase takes it (moe_hooks.cuh). */
struct ExchangeNet {
  const tw_dev_comm_t &dc;
  const MoeParams &p;
  const MoeNet &n;
  NetCta &c;
  uint64_t epoch;
  __device__ int operator()(SharedLayout &s, int32_t *scratch) const {
    return exchange_layout_net(dc, p, n, s, scratch, c, epoch);
  }
};

} // namespace moe
} // namespace tw

#endif
