/*
 * tw_moe_combine_backward: the backward of tw_moe_combine (contract in tilewire.h), one
 * persistent launch on the rank's stream through moe_call (moe.cu), on TW_CH_MOE like the
 * dispatch and the combine:
 *
 *   entry     thread 0 of every CTA signals this rank's entry (block 0) and waits for every
 *             rank's (tw_wait_entries): every CTA writes into peers' expert_grad, and a peer's
 *             entry proves its stream finished its earlier work on that buffer.
 *   layout    every CTA derives the last dispatch's layout from this rank's counts_in (the
 *             counts every rank stored there; the next dispatch is the first to rewrite them, and
 *             it waits for this rank's entry): each local expert's first row and live rows.
 *   padding   this rank's expert_grad rows of each local expert past its live rows, up to its
 *             multiple of 128, zeroed (a warp a row; row k of local expert e's last block is
 *             item e * 128 + k, so the warps share every expert's padding).
 *   entries   a warp per 32 entries (entry i = token i / top_k, slot i % top_k), 32 columns at a
 *             time: a group of 4 lanes loads 8 columns of one entry's grad row and expert_out row
 *             (read in place on the expert's rank, from the route the dispatch recorded), stores
 *             bf16(w * g) into the expert's rank's expert_grad (fp32 product, rounded once) and
 *             puts the (g, y) pairs into the warp's shared tile [32 entries][32 columns]; then
 *             lane l adds entry l's 32 products to its sum, in column order (__fmaf_rn: a product
 *             of two bf16 values is exact in fp32, so this is the sum of the products in column
 *             order, one rounding an add). The sum is weights_grad[i] (0 for a slot of -1).
 *   barrier   rows_landed: the last CTA out of its writes tells every rank this rank's rows
 *             landed; the kernel ends once every rank's have landed here.
 *
 * A rank's next dispatch waits for every rank's entry into it (its count words), and so for the
 * end of this call on every rank; a tw_moe_combine after this one is another call of the channel
 * with its own entry handshake. Neither this call nor a plain combine touches the cumulative tile
 * counts of tw_moe_gemm_combine and tw_moe_ffn (kFlagCombineBlocks, kFlagCombineCount), which those
 * calls alone keep.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "device/signal.cuh"
#include "ops/moe/moe_layout.cuh"
#include "ops/moe/moe_net.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

namespace {

using namespace tw::moe;

/* A warp's tile of (g, y) pairs, [32 entries][32 columns], its rows padded to 33 words: the
 * stores of a 4-lane group (8 consecutive columns) and the reads of a row by its lane both hit 32
 * distinct banks. One pair is a uint32: g's bf16 bits above y's. */
constexpr int kPairStride = 33;
constexpr int kBackwardSmem = kMoeWarps * 32 * kPairStride * 4;
static_assert(kBackwardSmem <= (kMoeWarps + 1) * kMaxExperts * 4,
              "the shared memory moe_call gives a CTA");

/* All threads of a CTA: this rank's expert_grad rows past each local expert's live rows up to its
 * multiple of 128, zeroed (s: the layout every rank derived). */
__device__ inline void zero_padding(const MoeParams &p, const tw_dev_comm_t &dc,
                                    const SharedLayout &s) {
  const int lane = threadIdx.x % 32;
  const int64_t vecs = p.n_out / 8, items = (int64_t)p.local_experts * 128;
  uint4 *eg = reinterpret_cast<uint4 *>(p.expert_grad[dc.rank]);
  for (int64_t q = (int64_t)blockIdx.x * kMoeWarps + threadIdx.x / 32; q < items;
       q += (int64_t)gridDim.x * kMoeWarps) {
    const int e = dc.rank * p.local_experts + (int)(q / 128), k = (int)(q % 128);
    const int32_t total = s.total[e];
    if (k >= (total + 127) / 128 * 128 - total)
      continue;
    const int64_t row = (int64_t)s.start[e] + total + k;
    for (int64_t v = lane; v < vecs; v += 32)
      eg[row * vecs + v] = make_uint4(0, 0, 0, 0);
  }
}

/* The entries backward_entries serves (Src::count of them), each naming its grad row g, its
 * expert_out row y, the expert_grad row eg it writes and its weight w (false: no expert, or none
 * of this pass), and where its sum goes.
 *
 * OwnEntries: this rank's entries, i = token * top_k + slot, rows where route points. Across
 * nodes (rail set) an entry whose expert sits on another node has route -1 and its sum comes
 * back from there (net_weights_grad), so it is left alone here. */
struct OwnEntries {
  const MoeParams &p;
  const tw_rail_t *rail; /* across nodes; NULL inside one */
  __device__ int64_t count() const { return p.tokens * p.top_k; }
  __device__ bool at(int64_t i, const uint16_t *&g, const uint16_t *&y, uint16_t *&eg,
                     float &w) const {
    const int64_t r = p.route[i];
    if (r < 0)
      return false;
    const int64_t row = r & ((1ll << 40) - 1);
    g = p.grad + (i / p.top_k) * p.n_out;
    y = p.expert_out[r >> 40] + row * p.n_out;
    eg = p.expert_grad[r >> 40] + row * p.n_out;
    w = p.topk_weights[i];
    return true;
  }
  __device__ void sum(int64_t i, bool live, float acc) const {
    if (rail) {
      const int32_t e = load_index(p, i);
      if (e >= 0 && rail->node_of[e / p.local_experts] != rail->node)
        return;
    }
    p.weights_grad[i] = live ? acc : 0.f;
  }
};

/* One warp: entries [base, base + 32) of src (module comment); pairs is the warp's tile. The grad
 * rows are read through L2: across nodes they are staged rows the NIC wrote during the call. */
template <class Src>
__device__ __forceinline__ void backward_entries(const MoeParams &p, const Src &src, int64_t base,
                                                 uint32_t *pairs, bool dot) {
  const int lane = threadIdx.x % 32, sub = lane / 4, part = lane % 4;
  const int64_t n = src.count(), N = p.n_out;
  /* the lane's 4 entries base + 8 k + sub: grad row, expert_out row, expert_grad row, weight */
  const uint16_t *g[4], *y[4];
  uint16_t *eg[4];
  float w[4];
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int64_t i = base + k * 8 + sub;
    g[k] = nullptr, y[k] = nullptr, eg[k] = nullptr, w[k] = 0.f;
    if (!(i < n && src.at(i, g[k], y[k], eg[k], w[k])))
      g[k] = nullptr;
  }
  const int64_t mine = base + lane; /* the entry whose sum this lane keeps */
  const uint16_t *mg, *my;
  uint16_t *meg;
  float mw;
  const bool live = mine < n && src.at(mine, mg, my, meg, mw);
  float acc = 0.f;
  for (int64_t c0 = 0; c0 < N; c0 += 32) {
    const int64_t col = c0 + part * 8;
    uint4 gv[4], yv[4];
#pragma unroll
    for (int k = 0; k < 4; k++) /* every load of the step in flight before the first use */
      if (g[k] && col < N) {
        gv[k] = __ldcg(reinterpret_cast<const uint4 *>(g[k] + col));
        if (dot)
          yv[k] = __ldcg(reinterpret_cast<const uint4 *>(y[k] + col));
      }
#pragma unroll
    for (int k = 0; k < 4; k++) {
      if (!g[k] || col >= N)
        continue;
      const uint32_t gw[4] = {gv[k].x, gv[k].y, gv[k].z, gv[k].w};
      uint32_t packed[4];
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const float lo = __uint_as_float(gw[q] << 16), hi = __uint_as_float(gw[q] & 0xffff0000u);
        const __nv_bfloat162 h = __floats2bfloat162_rn(__fmul_rn(w[k], lo), __fmul_rn(w[k], hi));
        memcpy(&packed[q], &h, 4);
      }
      *reinterpret_cast<uint4 *>(eg[k] + col) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
      if (dot) {
        const uint32_t yw[4] = {yv[k].x, yv[k].y, yv[k].z, yv[k].w};
        uint32_t *at = pairs + (k * 8 + sub) * kPairStride + part * 8;
#pragma unroll
        for (int q = 0; q < 4; q++) {
          at[2 * q] = gw[q] << 16 | (yw[q] & 0xffffu);
          at[2 * q + 1] = (gw[q] & 0xffff0000u) | yw[q] >> 16;
        }
      }
    }
    if (!dot)
      continue;
    __syncwarp();
    if (live) {
      const uint32_t *row = pairs + lane * kPairStride;
      if (N - c0 >= 32) {
#pragma unroll
        for (int c = 0; c < 32; c++)
          acc =
              __fmaf_rn(__uint_as_float(row[c] & 0xffff0000u), __uint_as_float(row[c] << 16), acc);
      } else {
        for (int c = 0; c < (int)(N - c0); c++)
          acc =
              __fmaf_rn(__uint_as_float(row[c] & 0xffff0000u), __uint_as_float(row[c] << 16), acc);
      }
    }
    __syncwarp();
  }
  if (dot && mine < n)
    src.sum(mine, live, acc);
}

/* All threads of a CTA: its warps' share of src's entries, 32 a warp at a time. */
template <class Src>
__device__ inline void backward_pass(const MoeParams &p, const Src &src, uint32_t *s_pairs,
                                     bool dot, int64_t first, int64_t step) {
  const int warp = threadIdx.x / 32;
  for (int64_t base = first + (int64_t)warp * 32; base < src.count(); base += step)
    backward_entries(p, src, base, s_pairs + warp * 32 * kPairStride, dot);
}

__global__ void __launch_bounds__(kMoeThreads, 1)
    moe_combine_backward_kernel(const __grid_constant__ tw_dev_comm_t dc,
                                const __grid_constant__ MoeParams p) {
  __shared__ SharedLayout s;
  extern __shared__ uint32_t s_pairs[]; /* [warps][32][kPairStride] */
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  int mine = 1;
  if (threadIdx.x == 0)
    mine = tw_kernel_enter(dc, ch, epoch) && tw_wait_entries(dc, ch, epoch);
  const int ok = __syncthreads_and(mine);
  if (ok) {
    derive_layout(p, dc, s);
    if (threadIdx.x == 0)
      tw_trace_stamp(dc, TW_TR_LAYOUT_AT);
    zero_padding(p, dc, s);
    backward_pass(p, OwnEntries{p, nullptr}, s_pairs, p.weights_grad != nullptr,
                  (int64_t)blockIdx.x * kMoeWarps * 32, (int64_t)gridDim.x * kMoeWarps * 32);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_COMM_END);
    if (ok)
      rows_landed(dc, epoch); /* the kernel ends once every rank's rows landed here */
    tw_op_finish(dc, ch, epoch);
  }
}

/* Across nodes: the entries of the rows node q's rail peer sent, chunk rows k0 .. k0 + rows of
 * its slot of rows_in (each a gradient row, then its token's top_k weights): entry i is (row
 * k0 + i / top_k, slot i % top_k), on the rows its meta (meta_in, kept by the dispatch's forward)
 * names on this node; its sum is staged as that row's dot of the slot in parts_out (0 for a slot
 * of another node) and sent back. */
struct SentEntries {
  const MoeParams &p;
  const uint8_t *staged; /* rows_in, node q's slot */
  const int64_t *kept;   /* meta_in, node q's slot: [max_tokens][top_k + 1] */
  float *dots;           /* parts_out, node q's slot: [max_tokens][top_k] */
  int64_t k0, rows, stage;
  __device__ int64_t count() const { return rows * p.top_k; }
  __device__ bool at(int64_t i, const uint16_t *&g, const uint16_t *&y, uint16_t *&eg,
                     float &w) const {
    const int64_t k = k0 + i / p.top_k, j = i % p.top_k;
    const int64_t m = kept[k * (p.top_k + 1) + 1 + j];
    if (m < 0)
      return false;
    const uint8_t *row = staged + k * stage;
    const int64_t at = m & ((1ll << 40) - 1);
    g = reinterpret_cast<const uint16_t *>(row);
    w = __ldcg(reinterpret_cast<const float *>(row + p.n_out * 2) + j);
    y = p.expert_out[m >> 40] + at * p.n_out;
    eg = p.expert_grad[m >> 40] + at * p.n_out;
    return true;
  }
  __device__ void sum(int64_t i, bool live, float acc) const {
    dots[(k0 + i / p.top_k) * p.top_k + i % p.top_k] = live ? acc : 0.f;
  }
};

/* The combine backward's staged row: token t's gradient row, then its top_k weights. */
struct StageGrad {
  const MoeParams &p;
  __device__ void operator()(uint8_t *dst, int64_t t, int lane) const {
    warp_copy_row((uint16_t *)dst, p.grad + t * p.n_out, p.n_out, lane);
    float *w = (float *)(dst + p.n_out * 2);
    for (int j = lane; j < p.top_k; j += 32)
      w[j] = p.topk_weights[t * p.top_k + j];
  }
};

/* All threads: chunk c of the gradient rows node q's rail peer sent, once landed: each slot of
 * this node as inside a node (SentEntries), then the chunk's dots posted back. */
__device__ inline void sent_grad_chunk(const tw_dev_comm_t &dc, const MoeParams &p, const MoeNet &n,
                                       NetCta &c, int q, int chunk, uint64_t epoch,
                                       uint32_t *s_pairs) {
  int64_t k0, k1, slot0;
  if (!await_sent_chunk(dc, p, n, c, q, chunk, epoch, &k0, &k1, &slot0))
    return;
  const SentEntries e{p,
                      n.ws + n.l.rows_in + (size_t)slot0 * n.stage,
                      (const int64_t *)(n.ws + n.l.meta_in) + slot0 * (p.top_k + 1),
                      (float *)(n.ws + n.l.parts_out) + slot0 * p.top_k,
                      k0,
                      k1 - k0,
                      n.stage};
  backward_pass(p, e, s_pairs, true, 0, kMoeWarps * 32);
  __syncthreads();
  if (threadIdx.x == 0)
    post_staged(dc, n, c, q, chunk, k0, k1, kNetParts, epoch, n.l.parts_out, n.l.parts_in,
                p.top_k * 4);
  __syncthreads();
}

/* All threads of every CTA, after its other rounds: every node's dots awaited (so no write of
 * this call lands here after it ends), then weights_grad of this rank's entries whose experts
 * sit on other nodes, from the dots their nodes sent back (a grid stride). */
__device__ inline void net_weights_grad(const tw_dev_comm_t &dc, const MoeParams &p,
                                        const MoeNet &n, NetCta &c, uint64_t epoch) {
  const tw_rail_t &x = n.rail;
  const int N = x.nodes, ch = TW_CH_MOE;
  if (threadIdx.x == 0)
    for (int q = 0; q < N; q++)
      for (int k = 0, chunks = q == x.node ? 0 : chunk_count(p.cnt[p.experts + 2 + q]);
           k < chunks && c.ok; k++)
        c.ok = tw_wait_geq(
            dc, ch, tw_net_flag(dc, ch, kNetParts + node_slot(q, x.node, N) * kNetChunks + k),
            epoch, x.rail[q], k);
  __syncthreads();
  if (!c.ok || !p.weights_grad)
    return;
  const int32_t *send_idx = (const int32_t *)(n.ws + n.l.send_idx);
  const float *dots = (const float *)(n.ws + n.l.parts_in);
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.tokens * p.top_k;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int32_t e = load_index(p, i);
    const int q = e >= 0 ? x.node_of[e / p.local_experts] : x.node;
    if (q == x.node)
      continue;
    const int64_t k = send_idx[(i / p.top_k) * N + q];
    p.weights_grad[i] = __ldcg(
        dots + ((int64_t)node_slot(q, x.node, N) * n.max_tokens + k) * p.top_k + i % p.top_k);
  }
}

/* tw_moe_combine_backward across nodes: every CTA the entry handshakes (net_enter), the layout
 * and padding as inside a node, then its items in turn: this rank's gradient rows for the other
 * nodes (pack_rows, StageGrad), its entries on this node (OwnEntries), the rows the rail peers sent
 * (sent_grad_chunk: expert_grad and the dots for its node's slots, the dots posted back), and
 * the weights_grad of its entries on other nodes. A pack waits only for the receiver's entry, a
 * sent chunk only for a pack, the dots only for sent chunks: no wait closes a cycle. The kernel
 * ends once every rank of this node has had its rows land here and the NIC has read this CTA's
 * staging. expert_grad and weights_grad are bitwise those of a one-node call: the same products,
 * the same column-order sums. */
__global__ void __launch_bounds__(kMoeThreads, 1)
    moe_combine_backward_net_kernel(const __grid_constant__ tw_dev_comm_t dc,
                                    const __grid_constant__ MoeParams p,
                                    const __grid_constant__ MoeNet n) {
  __shared__ SharedLayout s;
  __shared__ NetCta c;
  extern __shared__ uint32_t s_pairs[]; /* [warps][32][kPairStride] */
  const int ch = TW_CH_MOE;
  const tw_rail_t &x = n.rail;
  const uint64_t epoch = tw_op_begin(dc, ch);
  if (threadIdx.x == 0)
    net_enter(dc, n, c, epoch);
  __syncthreads();
  const int entered = c.ok;
  if (entered) {
    derive_layout(p, dc, s);
    if (threadIdx.x == 0)
      tw_trace_stamp(dc, TW_TR_LAYOUT_AT);
    zero_padding(p, dc, s);
    int item = 0; /* the pack and sent rounds' items, in turn */
    for (int q = 0; q < x.nodes; q++)
      for (int k = 0, chunks = q == x.node ? 0 : chunk_count(p.cnt[p.experts + 2 + q]); k < chunks;
           k++, item++)
        if (net_item_mine(item))
          pack_rows(dc, p, n, c, q, k, epoch, StageGrad{p}); /* the rows the dispatch sent */
    backward_pass(p, OwnEntries{p, &x}, s_pairs, p.weights_grad != nullptr,
                  (int64_t)blockIdx.x * kMoeWarps * 32, (int64_t)gridDim.x * kMoeWarps * 32);
    for (int q = 0; q < x.nodes; q++)
      for (int k = 0,
               chunks = q == x.node ? 0 : chunk_count(rows_to_node(p, dc, x.rail[q], x.node));
           k < chunks; k++, item++)
        if (net_item_mine(item))
          sent_grad_chunk(dc, p, n, c, q, k, epoch, s_pairs);
    net_weights_grad(dc, p, n, c, epoch);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_COMM_END);
    if (c.last != ~0ull)
      tw_fifo_wait_done(dc.fifo, dc, ch, c.last); /* the NIC has read this CTA's staging */
    if (entered)
      rows_landed(dc, epoch); /* the kernel ends once every rank's rows landed here */
    tw_op_finish(dc, ch, epoch);
  }
}

/* Loads the kernels on the current device now (see tw_ops_preload). */
tw_status_t moe_backward_preload(void) {
  cudaFuncAttributes attr;
  tw_status_t st = tw_cuda_check(cudaFuncGetAttributes(&attr, moe_combine_backward_kernel),
                                 "loading tw_moe_combine_backward's kernel");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaFuncGetAttributes(&attr, moe_combine_backward_net_kernel),
                       "loading tw_moe_combine_backward's kernel across nodes");
  return st;
}

const tw_op_desc_t moe_backward_registration = {"moe_combine_backward", moe_backward_preload};

} // namespace

TW_OP_REGISTER(moe_combine_backward, moe_backward_registration);

extern "C" tw_status_t tw_moe_combine_backward(tw_comm_t comm, const tw_moe_args_t *args,
                                               tw_stream_t stream) {
  return moe_call(comm, args, stream, kCombineBackward, (const void *)moe_combine_backward_kernel,
                  (const void *)moe_combine_backward_net_kernel);
}
