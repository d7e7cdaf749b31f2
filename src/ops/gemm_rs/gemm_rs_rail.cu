/*
 * tw_gemm_rs / tw_gemm_ar across nodes: the rail path's kernel and its host side (geometry,
 * order of the sums, workspace and flags: gemm_rs_rail.h).
 *
 * One persistent launch per rank. Every CTA runs the roles in turn (the first reduce_ctas of
 * them claim no tile, so they start on the reduce while the others compute):
 *   compute       the GEMM mainloop of the fused kernel (gemm_rs_fused.cuh's RsEpi), whose
 *                 epilogue stores each tile's partials over NVLink into the staging of the rank
 *                 of this node that reduces its rows (the owner's local index) and counts them;
 *                 the tile order starts at the rows sent across nodes. The unfused pipeline
 *                 instead copies the partial tw_gemm wrote (copy_tiles);
 *   reduce        once the tile queue runs dry: the node reduce of each rail owner's groups,
 *                 other nodes' owners first, each then sent by RDMA (inter-node send); this
 *                 rank's own groups last, each once the other nodes' partials landed (inter-node
 *                 reduce);
 *   gather        tw_gemm_ar: forward what the rail peers sent to the node, then copy every
 *                 owner's rows into out.
 * The reduce CTAs pass through the GEMM loop with no tile (RailWait::takes_no_tile) rather than
 * branching around it: reduce code before the loop, inlined or not, made the loop spill or fail
 * register allocation, while one copy of it after the loop serves both kinds of CTA.
 * Nothing waits on work queued behind it: the reduce waits for tiles and RDMA arrivals, which
 * depend on no reduce, and the forwards come before the copies that wait for them.
 *
 * Ordering: a rank stores into a node peer's staging or gathered area only after that peer
 * entered the call, and writes by RDMA into a rail peer only after that peer's net entry flag
 * (device/net.cuh). Every CTA waits, before the call ends, until the NIC has read what it posted
 * (the outbox and the gathered area are rewritten by the next call).
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "device/net.cuh"
#include "gemm/gemm_launch.cuh"
#include "ops/gemm_rs/gemm_rs_fused.cuh"
#include "ops/gemm_rs/gemm_rs_impl.h"
#include "ops/gemm_rs/gemm_rs_rail.h"

extern "C" {
#include "gemm/tma_map.h"
#include "runtime/comm.h"
#include "runtime/comm_net.h"
#include "runtime/cuda_check.h"
}

namespace tw {
namespace rs {

namespace {

/* Thread 0's state across the roles, in shared memory so that nothing stays live in registers
 * through the GEMM loop (its producer warps run on 40): the CTA's last RDMA ticket (~0: none)
 * and bit n = node n's rail peer entered. */
__shared__ uint64_t s_last;
__shared__ uint32_t s_rail_entered;

/* Thread 0: waits until every rank of this node entered call `epoch` (s_entered, as RsWait);
 * false: timed out, aborted or a peer's call differs (recorded). */
__device__ __forceinline__ bool rail_entered(const tw_dev_comm_t &dc, int ch, const tw_rail_t &r,
                                             uint64_t epoch) {
  for (int j = 0; j < r.local_size; j++) {
    const int q = r.local_rank[j];
    if (s_entered >> q & 1u)
      continue;
    if (!tw_wait_entry(dc, ch, q, epoch)) {
      s_entered = ~0u;
      s_entry_failed = 1;
      return false;
    }
    s_entered |= 1u << q;
  }
  return true;
}

/* Before a CTA's first tile's loads: the node's ranks entered this call (their staging is free).
 * The ranks of other nodes are waited for where this rank writes into them (net entry flags).
 * CTAs [0, reduce_ctas) claim no tile and go straight to the reduce. */
struct RailWait : NoWait {
  struct Params {
    tw_dev_comm_t dc;
    int32_t ch;
    int32_t reduce_ctas;
    tw_rail_t rail;
  };
  __device__ __forceinline__ static bool takes_no_tile(const Params &p) {
    return (int32_t)blockIdx.x < p.reduce_ctas;
  }
  __device__ __forceinline__ static void before_tile(const Params &p, int32_t mb, int32_t nb) {
    tw_trace_tile(p.dc.trace, TW_TR_CLAIMED, mb, nb);
    rail_entered(p.dc, p.ch, p.rail, tw_op_begin(p.dc, p.ch));
  }
  __device__ static void mbar_stuck(const Params &p, int32_t code) {
    tw_pipeline_stall(p.dc, p.ch, code);
  }
};

template <class P> struct RailParams {
  GemmParams<RsEpi<P>, RailWait> gemm;
  const P *stage;                        /* this rank's staging, [nodes][L][m_local][n] */
  const P *partial;                      /* the unfused pipeline: this rank's [m][n] partial */
  float *inbox, *outbox;                 /* [nodes][units_max] unit slots */
  __nv_bfloat16 *gathered[TW_MAX_WORLD]; /* tw_gemm_ar: node rank q's gathered area (else NULL) */
  __nv_bfloat16 *out;
  int64_t ldo;
  uint64_t ws_off; /* the workspace's heap offset (the same on every rank) */
  uint64_t inbox_off, outbox_off, gathered_off; /* the areas' offsets in the workspace */
  int32_t n, m_local, m, n_blocks, band, block_n;
  int32_t group_units, groups_max, units_max, unit_elems, stride, gcap;
  int32_t all_reduce, fused;
};

__device__ __forceinline__ int32_t rail_units(int32_t o, int32_t m_local, int32_t n_blocks) {
  return tw_rs_mb_count(o, m_local) * n_blocks;
}

/* Rows [r0, r1) of owner o's slab and columns [c0, c1) of its unit u. */
template <class P>
__device__ __forceinline__ void rail_rect(const RailParams<P> &p, int32_t o, int32_t u, int32_t &r0,
                                          int32_t &r1, int32_t &c0, int32_t &c1) {
  int32_t mb_rel, nb;
  tw_rs_unit_coords(u, tw_rs_mb_count(o, p.m_local), p.n_blocks, p.band, &mb_rel, &nb);
  const int64_t mb = tw_rs_mb_first(o, p.m_local) + mb_rel;
  const int64_t base = (int64_t)o * p.m_local;
  r0 = (int32_t)(max(mb * kBlockM, base) - base);
  r1 = (int32_t)(min(mb * kBlockM + kBlockM, base + p.m_local) - base);
  c0 = nb * p.block_n;
  c1 = min(p.n, c0 + p.block_n);
}

/* 8 consecutive elements as floats, and back. */
__device__ __forceinline__ void load8(const float *src, float (&f)[8]) {
  const float4 a = __ldcg(reinterpret_cast<const float4 *>(src));
  const float4 b = __ldcg(reinterpret_cast<const float4 *>(src) + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void load8(const __nv_bfloat16 *src, float (&f)[8]) {
  RsVec<__nv_bfloat16>::unpack(__ldcg(reinterpret_cast<const uint4 *>(src)), f);
}
__device__ __forceinline__ void store8(float *dst, const float (&f)[8]) {
  reinterpret_cast<float4 *>(dst)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4 *>(dst)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

/* One thread: the flag of channel ch at index `index` of node rank q (this rank: its own). */
__device__ __forceinline__ uint64_t *rail_flag(const tw_dev_comm_t &dc, int ch, int q, int index) {
  return q == dc.rank ? tw_own_flag(dc, ch, index) : tw_peer_flag(dc, q, ch, index);
}

/* All threads: the units of group g of owner o = (t, this rank's local index): the node's
 * partials summed in local order, fp32, into the outbox slot t (for the send), or where t is
 * this node (o is this rank) into the inbox's own slot; then, for o, with the other nodes'
 * partials there, in node order, into out as bf16, and for tw_gemm_ar into every node rank's
 * gathered area. (The own node's partial goes through memory, exactly, so that both loops stay
 * small: one loop doing both ran out of registers beside the GEMM.) */
template <class P>
__device__ __forceinline__ void rail_reduce_group(const RailParams<P> &p, int32_t t, int32_t o,
                                                  int32_t g) {
  const tw_rail_t &r = p.gemm.wait.rail;
  const int32_t L = r.local_size, units = rail_units(o, p.m_local, p.n_blocks);
  const int32_t u_end = min(units, (g + 1) * p.group_units);
  const size_t slab = (size_t)p.m_local * p.n, box = (size_t)p.units_max * p.unit_elems;
  const bool own = t == r.node;
  float *dst = own ? p.inbox + (size_t)t * box : p.outbox + (size_t)t * box;
  const P *src = p.stage + (size_t)t * L * slab;
  for (int32_t u = g * p.group_units; u < u_end; u++) {
    int32_t r0, r1, c0, c1;
    rail_rect(p, o, u, r0, r1, c0, c1);
    const int32_t vecs = (c1 - c0) / 8, items = (r1 - r0) * vecs;
    const size_t unit_off = (size_t)u * p.unit_elems;
    for (int32_t i = threadIdx.x; i < items; i += blockDim.x) {
      const int32_t rr = r0 + i / vecs, cc = c0 + 8 * (i % vecs);
      const size_t off = (size_t)rr * p.n + cc;
      float acc[8], v[8];
      load8(src + off, acc);
#pragma unroll 1
      for (int32_t l = 1; l < L; l++) {
        load8(src + l * slab + off, v);
#pragma unroll
        for (int e = 0; e < 8; e++)
          acc[e] = __fadd_rn(acc[e], v[e]);
      }
      store8(dst + unit_off + (size_t)(rr - r0) * p.block_n + (cc - c0), acc);
    }
  }
  if (!own)
    return;
  __syncthreads();
  for (int32_t u = g * p.group_units; u < u_end; u++) {
    int32_t r0, r1, c0, c1;
    rail_rect(p, o, u, r0, r1, c0, c1);
    const int32_t vecs = (c1 - c0) / 8, items = (r1 - r0) * vecs;
    for (int32_t i = threadIdx.x; i < items; i += blockDim.x) {
      const int32_t rr = r0 + i / vecs, cc = c0 + 8 * (i % vecs);
      const size_t packed = (size_t)u * p.unit_elems + (size_t)(rr - r0) * p.block_n + (cc - c0);
      float sum[8], v[8];
      load8(p.inbox + packed, sum);
#pragma unroll 1
      for (int32_t d = 1; d < r.nodes; d++) {
        load8(p.inbox + d * box + packed, v);
#pragma unroll
        for (int e = 0; e < 8; e++)
          sum[e] = __fadd_rn(sum[e], v[e]);
      }
      const int4 bits = RsVec<__nv_bfloat16>::pack(sum);
      const int64_t out_row = p.all_reduce ? (int64_t)o * p.m_local + rr : rr;
      __stcs(reinterpret_cast<int4 *>(p.out + out_row * p.ldo + cc), bits);
#pragma unroll 1
      for (int32_t j = 0; p.all_reduce && j < L; j++)
        *reinterpret_cast<int4 *>(p.gathered[r.local_rank[j]] + (size_t)o * box + packed) = bits;
    }
  }
}

/* Thread 0, after rail_reduce_group (and a CTA barrier): posts the node partial of group g to
 * node t's rail peer, or (tw_gemm_ar, own group) signals the node's ranks and posts the reduced
 * rows to the rail peers. Returns the last ticket (~0 where nothing was posted); ok = 0 on a
 * failed wait or post. */
template <class P>
__device__ __forceinline__ uint64_t rail_after_group(const RailParams<P> &p, uint64_t epoch,
                                                     int32_t t, int32_t o, int32_t g, int &ok) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const tw_rail_t &r = p.gemm.wait.rail;
  const int ch = p.gemm.wait.ch;
  const int32_t units = rail_units(o, p.m_local, p.n_blocks);
  const int32_t nunits = min(p.group_units, units - g * p.group_units);
  uint64_t last = ~0ull;
  if (t == r.node && !p.all_reduce)
    return last;
  tw_fence_acq_rel_sys(); /* the CTA's stores (seen through the barrier) before the NIC reads */
  if (t == r.node) {
    for (int32_t j = 0; j < r.local_size; j++)
      if (r.local_rank[j] != dc.rank)
        tw_signal_put(rail_flag(dc, ch, r.local_rank[j], (r.nodes + o) * p.stride + g), epoch);
  }
  for (int32_t n = 0; n < r.nodes && ok; n++) {
    if (n == r.node || (t != r.node && n != t))
      continue;
    if (!(s_rail_entered >> n & 1u)) {
      ok = tw_net_wait_entry(dc, ch, r.rail[n], n, epoch);
      s_rail_entered |= 1u << n;
      if (!ok)
        break;
    }
    uint64_t local_off, remote_off, bytes;
    int slot;
    if (t != r.node) { /* outbox slot t -> the peer's inbox slot of this node */
      const uint64_t at = ((uint64_t)t * p.units_max + (uint64_t)g * p.group_units) * p.unit_elems;
      const uint64_t to =
          ((uint64_t)r.node * p.units_max + (uint64_t)g * p.group_units) * p.unit_elems;
      local_off = p.ws_off + p.outbox_off + at * 4;
      remote_off = p.ws_off + p.inbox_off + to * 4;
      bytes = (uint64_t)nunits * p.unit_elems * 4;
      slot = r.node * p.gcap + g;
    } else { /* this rank's reduced rows, block o of the gathered areas */
      const uint64_t at = ((uint64_t)o * p.units_max + (uint64_t)g * p.group_units) * p.unit_elems;
      local_off = remote_off = p.ws_off + p.gathered_off + at * 2;
      bytes = (uint64_t)nunits * p.unit_elems * 2;
      slot = (r.nodes + r.node) * p.gcap + g;
    }
    last = tw_net_post_write(dc, ch, r.rail[n], local_off, remote_off, bytes, slot, epoch);
    ok = last != ~0ull;
  }
  return last;
}

/* Reduce role: claims items of this rank's rail owners, group-major, the other nodes' owners
 * first (in node order from the next node) and this rank's own group last. */
template <class P>
__device__ __forceinline__ void rail_reduce_work(const RailParams<P> &p, uint64_t epoch,
                                                 int *s_item, int *s_ok) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const tw_rail_t &r = p.gemm.wait.rail;
  const int ch = p.gemm.wait.ch;
  TileQueue *queue = reinterpret_cast<TileQueue *>(tw_own_flag(dc, ch, kReduceQueue));
  const int items = r.nodes * p.groups_max;
  for (;;) {
    __syncthreads(); /* everyone read the previous s_item */
    if (threadIdx.x == 0) {
      int item = *s_ok ? (int)atomicAdd(&queue->next, 1u) : items;
      for (; item < items; item = (int)atomicAdd(&queue->next, 1u)) {
        const int32_t g = item / r.nodes, t = (r.node + 1 + item % r.nodes) % r.nodes;
        const int32_t o = t * r.local_size + r.local;
        const int32_t units = rail_units(o, p.m_local, p.n_blocks);
        if (g * p.group_units >= units)
          continue;
        const int32_t in_group = min(p.group_units, units - g * p.group_units);
        uint64_t *count = tw_own_flag(dc, ch, t * p.stride + g);
        bool ok = tw_wait_geq(dc, ch, count, (uint64_t)r.local_size * in_group, -1, g);
        if (ok)
          *(volatile uint64_t *)count = 0; /* every add of this call is in */
        for (int32_t d = 0; ok && t == r.node && d < r.nodes; d++)
          if (d != r.node)
            ok = tw_wait_geq(dc, ch, tw_net_flag(dc, ch, d * p.gcap + g), epoch, r.rail[d], g);
        if (ok && t == r.node && p.all_reduce)
          ok = rail_entered(dc, ch, r, epoch); /* their gathered areas are free */
        if (!ok)
          *s_ok = 0, item = items;
        break;
      }
      *s_item = item;
    }
    __syncthreads();
    const int item = *s_item;
    if (item >= items)
      break;
    const int32_t g = item / r.nodes, t = (r.node + 1 + item % r.nodes) % r.nodes;
    const int32_t o = t * r.local_size + r.local;
    rail_reduce_group(p, t, o, g);
    __syncthreads();
    if (threadIdx.x == 0) {
      int ok = 1;
      const uint64_t tk = rail_after_group(p, epoch, t, o, g, ok);
      if (tk != ~0ull)
        s_last = tk;
      if (!ok)
        *s_ok = 0;
    }
  }
  if (threadIdx.x == 0)
    queue_leave(queue, (int32_t)gridDim.x);
}

/* All threads: copies group g of owner o from this rank's gathered area into out, and (fwd)
 * into the gathered areas of the node's other ranks. */
template <class P>
__device__ __forceinline__ void rail_copy_group(const RailParams<P> &p, int32_t o, int32_t g,
                                                bool fwd) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const tw_rail_t &r = p.gemm.wait.rail;
  const int32_t u_end = min(rail_units(o, p.m_local, p.n_blocks), (g + 1) * p.group_units);
  const __nv_bfloat16 *src = p.gathered[dc.rank] + (size_t)o * p.units_max * p.unit_elems;
  for (int32_t u = g * p.group_units; u < u_end; u++) {
    int32_t r0, r1, c0, c1;
    rail_rect(p, o, u, r0, r1, c0, c1);
    const int32_t vecs = (c1 - c0) / 8, items = (r1 - r0) * vecs;
    for (int32_t i = threadIdx.x; i < items; i += blockDim.x) {
      const int32_t rr = r0 + i / vecs, cc = c0 + 8 * (i % vecs);
      const size_t packed = (size_t)u * p.unit_elems + (size_t)(rr - r0) * p.block_n + (cc - c0);
      const int4 v = __ldcg(reinterpret_cast<const int4 *>(src + packed));
      __stcs(reinterpret_cast<int4 *>(p.out + ((int64_t)o * p.m_local + rr) * p.ldo + cc), v);
      for (int32_t j = 0; fwd && j < r.local_size; j++)
        if (r.local_rank[j] != dc.rank)
          *reinterpret_cast<int4 *>(p.gathered[r.local_rank[j]] +
                                    (size_t)o * p.units_max * p.unit_elems + packed) = v;
    }
  }
}

/* Gather item `item`'s owner and group: items [0, F) forward the rail peers' groups (F = (nodes
 * - 1) x groups_max), group-major, the next node's first; then every other owner whose rows
 * reach this rank over NVLink (others of them: every rank but this one and its rail peers),
 * group-major from the owner after this rank. Returns whether it is a forward. */
template <class P>
__device__ __forceinline__ bool gather_item(const RailParams<P> &p, int item, int others,
                                            int32_t &o, int32_t &g) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const tw_rail_t &r = p.gemm.wait.rail;
  const int fwd_items = (r.nodes - 1) * p.groups_max;
  if (item < fwd_items) {
    g = item / (r.nodes - 1);
    o = ((r.node + 1 + item % (r.nodes - 1)) % r.nodes) * r.local_size + r.local;
    return true;
  }
  const int j = item - fwd_items;
  g = j / others;
  int k = j % others; /* the k-th such owner after this rank */
  o = dc.rank;
  do {
    o = (o + 1) % dc.world;
    if (r.local_of[o] != r.local)
      k--;
  } while (k >= 0);
  return false;
}

/* Gather role (tw_gemm_ar): the items of gather_item, each once its rows landed here. */
template <class P>
__device__ __forceinline__ void rail_gather_work(const RailParams<P> &p, uint64_t epoch,
                                                 int *s_item, int *s_ok) {
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const tw_rail_t &r = p.gemm.wait.rail;
  const int ch = p.gemm.wait.ch;
  TileQueue *queue = reinterpret_cast<TileQueue *>(tw_own_flag(dc, ch, kGatherQueue));
  const int L = r.local_size, others = dc.world - r.nodes;
  const int items = (r.nodes - 1 + others) * p.groups_max;
  for (;;) {
    __syncthreads();
    if (threadIdx.x == 0) {
      int item = *s_ok ? (int)atomicAdd(&queue->next, 1u) : items;
      for (; item < items; item = (int)atomicAdd(&queue->next, 1u)) {
        int32_t o, g;
        const bool fwd = gather_item(p, item, others, o, g);
        if (g * p.group_units >= rail_units(o, p.m_local, p.n_blocks))
          continue;
        const bool ok =
            fwd ? tw_wait_geq(dc, ch, tw_net_flag(dc, ch, (r.nodes + r.node_of[o]) * p.gcap + g),
                              epoch, o, g) &&
                      rail_entered(dc, ch, r, epoch)
                : tw_wait_geq(dc, ch, tw_own_flag(dc, ch, (r.nodes + o) * p.stride + g), epoch, o,
                              g);
        if (!ok)
          *s_ok = 0, item = items;
        break;
      }
      *s_item = item;
    }
    __syncthreads();
    const int item = *s_item;
    if (item >= items)
      break;
    int32_t o, g;
    const bool fwd = gather_item(p, item, others, o, g);
    rail_copy_group(p, o, g, fwd);
    if (fwd) {
      __syncthreads();
      if (threadIdx.x == 0) {
        tw_fence_acq_rel_sys();
        for (int32_t j = 0; j < L; j++)
          if (r.local_rank[j] != dc.rank)
            tw_signal_put(rail_flag(dc, ch, r.local_rank[j], (r.nodes + o) * p.stride + g), epoch);
      }
    }
  }
  if (threadIdx.x == 0)
    queue_leave(queue, (int32_t)gridDim.x);
}

/* The unfused pipeline's stores (every CTA, before its reduce work): the tiles of the partial
 * tw_gemm wrote, in the fused kernel's tile order, copied into the reducing ranks' staging and
 * counted as the fused epilogue does. */
template <class P> __device__ __forceinline__ void copy_tiles(const RailParams<P> &p, int ok) {
  const RsEpiParams<P> &e = p.gemm.epi;
  const TileOrder &ord = p.gemm.order;
  constexpr int32_t kPer16 = 16 / (int32_t)sizeof(P);
  for (int32_t t = blockIdx.x; ok && t < ord.num_tiles; t += gridDim.x) {
    const int32_t mb = (ord.rotate_mb + t / ord.n_blocks) % ord.m_blocks, nb = t % ord.n_blocks;
    const int32_t row0 = mb * kBlockM, row1 = min(row0 + kBlockM, p.m);
    const int32_t c0 = nb * p.block_n, c1 = min(p.n, c0 + p.block_n);
    const int32_t vecs = (c1 - c0) / kPer16;
    for (int32_t o = row0 / p.m_local; o <= (row1 - 1) / p.m_local; o++) {
      const int32_t a = max(row0, o * p.m_local), b = min(row1, (o + 1) * p.m_local);
      const int32_t items = (b - a) * vecs;
      for (int32_t i = threadIdx.x; i < items; i += blockDim.x) {
        const int32_t row = a + i / vecs, col = c0 + kPer16 * (i % vecs);
        *reinterpret_cast<int4 *>(e.slot[o] + (size_t)(row - o * p.m_local) * p.n + col) =
            __ldcg(reinterpret_cast<const int4 *>(p.partial + (size_t)row * p.n + col));
      }
    }
    __syncthreads();
    if (threadIdx.x == 0)
      RsEpi<P>::signal(e, mb, nb);
  }
}

/* The parameters through an address the compiler cannot see through: loads of them in the roles
 * before and after the GEMM loop are not merged into values held in registers across it (where
 * the producer warps have 40). */
template <class T> __device__ __forceinline__ const T &opaque(const T &x) {
  const T *q = &x;
  asm volatile("" : "+l"(q));
  return *q;
}

template <class P, int BN, bool kFused>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_rs_rail_kernel(const __grid_constant__ RailParams<P> p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int s_item, s_ok;
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const tw_rail_t &r = p.gemm.wait.rail;
  const int ch = p.gemm.wait.ch;
  const uint64_t epoch = tw_op_begin(dc, ch);
  if (threadIdx.x == 0) {
    s_entered = 0;
    s_entry_failed = 0;
    s_rs_epoch = epoch;
    s_last = ~0ull;
    s_rail_entered = 0;
    s_ok = tw_kernel_enter(dc, ch, epoch);
    for (int n = 0; blockIdx.x == 0 && s_ok && n < r.nodes; n++)
      if (n != r.node) {
        s_last = tw_net_signal_entry(dc, ch, r.rail[n], r.node, epoch);
        if (s_last == ~0ull)
          s_ok = 0;
      }
    if (!kFused && s_ok && !rail_entered(dc, ch, r, epoch))
      s_ok = 0;
  }
  __syncthreads();
  if constexpr (kFused) {
    gemm_cta_loop<RsConfig<BN>::kStages, RsConfig<BN>::kEpiBytes, RsEpi<P>, RailWait, true, 1, BN,
                  true>(p.gemm, smem_raw, 0, 0);
    if (dc.trace) {
      __syncthreads();
      if (threadIdx.x == 0)
        tw_trace_stamp(dc, TW_TR_GEMM_END);
    }
  } else {
    copy_tiles(p, s_ok);
  }
  /* the epoch again from shared memory: nothing of the roles before stays live through the loop */
  const uint64_t epoch_after = s_rs_epoch;
  const tw_dev_comm_t &dca = opaque(p).gemm.wait.dc;
  rail_reduce_work(opaque(p), epoch_after, &s_item, &s_ok);
  if (p.all_reduce) {
    if (threadIdx.x == 0)
      tw_trace_gather_start(dca);
    rail_gather_work(opaque(p), epoch_after, &s_item, &s_ok);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s_last != ~0ull)
      tw_fifo_wait_done(dca.fifo, dca, p.gemm.wait.ch, s_last);
    tw_trace_stamp(dca, TW_TR_END);
    tw_op_finish(dca, p.gemm.wait.ch, epoch_after, true);
  }
}

template <class P, int BN, bool kFused>
tw_status_t launch_rail(const RailParams<P> &params, int grid, cudaStream_t stream) {
  constexpr int kSmem = kFused ? rs_smem_bytes<BN>() : 0;
  const char *set = "tw_gemm_rs: cudaFuncSetAttribute", *go = "tw_gemm_rs: kernel launch";
  return launch_persistent<gemm_rs_rail_kernel<P, BN, kFused>, kSmem>(params, grid, stream, set,
                                                                      go);
}

} // namespace

template <class P>
tw_status_t run_rail(tw_comm_t comm, const tw_gemm_rs_args_t &a, const tw_gemm_rs_plan_t &plan,
                     int all_reduce, cudaStream_t stream) {
  constexpr CUtensorMapDataType kMapType =
      sizeof(P) == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const char *op = all_reduce ? "tw_gemm_ar" : "tw_gemm_rs";
  const int world = comm->world, rank = comm->rank;
  const int ch = all_reduce ? TW_CH_GEMM_AR : TW_CH_GEMM_RS;
  const int64_t m_local = a.m / world;
  RailParams<P> p;
  memset(&p, 0, sizeof(p));
  tw_rail_t &r = p.gemm.wait.rail;
  tw_status_t st = tw_comm_rail(comm, op, &r);
  if (st != TW_SUCCESS)
    return st;
  const int L = r.local_size;
  tw_rs_rail_layout_t lay;
  tw_rs_rail_layout(world, r.nodes, a.m, a.n, plan.block_n, &lay);
  char *ws = (char *)a.workspace;
  if (plan.unfused) { /* the partial, by the same core as the fused kernel's */
    st = plain_gemm(comm, a, ws + lay.partial, sizeof(P) == 2 ? TW_BF16 : TW_FP32, a.n, stream);
    if (st != TW_SUCCESS)
      return st;
  } else {
    st = operand_maps(&p.gemm.a_map, &p.gemm.b_map, a.a, a.m, a.lda, a.b, a.n, a.ldb, a.k,
                      plan.block_n, op, "a");
    if (st != TW_SUCCESS)
      return st;
  }
  const size_t slot_bytes = (size_t)m_local * (size_t)a.n * sizeof(P);
  const int stride = tw_rs_rail_stride(r.nodes, world);
  for (int o = 0; o < world; o++) {
    /* owner o's rows are reduced on this node by the rank of o's local index, in its slab
     * (o's node, this rank's local index) */
    const int q = r.local_rank[r.local_of[o]];
    char *slab = (char *)tw_heap_peer_ptr(comm, a.workspace, q) +
                 slot_bytes * (size_t)(r.node_of[o] * L + r.local);
    st = tw_tma_map_2d(&p.gemm.epi.slot_map[o], kMapType, sizeof(P), slab, a.n, m_local, a.n,
                       128 / sizeof(P), kBoxRows, "tw_gemm_rs: cuTensorMapEncodeTiled(staging)");
    if (st != TW_SUCCESS)
      return st;
    p.gemm.epi.slot[o] = (P *)slab;
    p.gemm.epi.owner_flags[o] =
        &comm->dev.peer_ctrl[q]->flags[ch][(size_t)r.node_of[o] * (size_t)stride];
  }
  for (int j = 0; all_reduce && j < L; j++) {
    const int q = r.local_rank[j];
    p.gathered[q] =
        (__nv_bfloat16 *)((char *)tw_heap_peer_ptr(comm, a.workspace, q) + lay.gathered);
  }
  p.gemm.epi.n = (int32_t)a.n;
  p.gemm.epi.m_local = (int32_t)m_local;
  p.gemm.epi.m = (int32_t)a.m;
  p.gemm.epi.group_units = plan.group_units;
  TileOrder &o = p.gemm.order;
  o.m_blocks = (int32_t)((a.m + kBlockM - 1) / kBlockM);
  o.n_blocks = (int32_t)((a.n + plan.block_n - 1) / plan.block_n);
  o.num_tiles = o.m_blocks * o.n_blocks;
  o.order = kOrderBands;
  o.group_m = o.m_blocks;
  o.group_n = plan.band;
  /* the sweeps start at the next node's rows (sent by RDMA, the longest way), each rank of
   * the node at another owner's, and end at this node's */
  o.rotate_mb = tw_rs_mb_first(((r.node + 1) % r.nodes) * L + (r.local + 1) % L, (int32_t)m_local);
  p.gemm.queue = (TileQueue *)comm->ctrl->tile_queue[ch];
  p.gemm.participants = plan.ctas;
  p.gemm.k_blocks = (int32_t)((a.k + kBlockK - 1) / kBlockK);
  p.gemm.mbar_timeout_ns = fused_mbar_timeout_ns(comm->dev.timeout_ns);
  apply_fault_stall(p.gemm);
  p.gemm.wait.dc = comm->dev;
  p.gemm.wait.ch = ch;
  p.gemm.wait.reduce_ctas = plan.unfused ? 0 : plan.reduce_ctas;
  p.gemm.epi.n_blocks = o.n_blocks;
  p.gemm.epi.band = plan.band;
  p.gemm.epi.trace = comm->dev.trace;
  p.gemm.epi.gpu_scope = comm->ranks_on_device == world;
  p.stage = (const P *)ws;
  p.partial = (const P *)(ws + lay.partial);
  p.inbox = (float *)(ws + lay.inbox);
  p.outbox = (float *)(ws + lay.outbox);
  p.out = (__nv_bfloat16 *)a.out;
  p.ldo = a.ldo;
  p.ws_off = (uint64_t)(ws - (char *)tw_group_slot(comm->group, rank, 0));
  p.inbox_off = lay.inbox, p.outbox_off = lay.outbox, p.gathered_off = lay.gathered;
  p.n = (int32_t)a.n;
  p.m_local = (int32_t)m_local;
  p.m = (int32_t)a.m;
  p.n_blocks = o.n_blocks;
  p.band = plan.band;
  p.block_n = plan.block_n;
  p.group_units = plan.group_units;
  p.groups_max = plan.groups_max;
  p.units_max = (int32_t)lay.units_max;
  p.unit_elems = (int32_t)lay.unit_elems;
  p.stride = stride;
  p.gcap = tw_rs_rail_gcap(r.nodes);
  p.all_reduce = all_reduce;
  p.fused = !plan.unfused;
  if (plan.unfused)
    return launch_rail<P, kBlockN, false>(p, plan.ctas, stream);
  if (plan.block_n == 128)
    return launch_rail<P, 128, true>(p, plan.ctas, stream);
  return launch_rail<P, kBlockN, true>(p, plan.ctas, stream);
}

template tw_status_t run_rail<float>(tw_comm_t, const tw_gemm_rs_args_t &,
                                     const tw_gemm_rs_plan_t &, int, cudaStream_t);
template tw_status_t run_rail<__nv_bfloat16>(tw_comm_t, const tw_gemm_rs_args_t &,
                                             const tw_gemm_rs_plan_t &, int, cudaStream_t);

cudaError_t preload_rail() {
  const void *kernels[] = {(const void *)gemm_rs_rail_kernel<float, kBlockN, true>,
                           (const void *)gemm_rs_rail_kernel<__nv_bfloat16, kBlockN, true>,
                           (const void *)gemm_rs_rail_kernel<float, 128, true>,
                           (const void *)gemm_rs_rail_kernel<__nv_bfloat16, 128, true>,
                           (const void *)gemm_rs_rail_kernel<float, kBlockN, false>,
                           (const void *)gemm_rs_rail_kernel<__nv_bfloat16, kBlockN, false>};
  return load_kernels(kernels, sizeof(kernels) / sizeof(kernels[0]));
}

} // namespace rs
} // namespace tw
