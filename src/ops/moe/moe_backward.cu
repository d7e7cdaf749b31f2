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

/* One warp: entries [base, base + 32) of this rank (module comment); pairs is the warp's tile. */
__device__ __forceinline__ void backward_entries(const MoeParams &p, int64_t base, uint32_t *pairs,
                                                 bool dot) {
  const int lane = threadIdx.x % 32, sub = lane / 4, part = lane % 4;
  const int64_t n = p.tokens * p.top_k, N = p.n_out;
  /* the lane's 4 entries base + 8 k + sub: grad row, expert_out row, expert_grad row, weight */
  const uint16_t *g[4], *y[4];
  uint16_t *eg[4];
  float w[4];
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int64_t i = base + k * 8 + sub;
    const int64_t r = i < n ? p.route[i] : -1;
    g[k] = nullptr, y[k] = nullptr, eg[k] = nullptr, w[k] = 0.f;
    if (r >= 0) {
      const int64_t row = r & ((1ll << 40) - 1);
      g[k] = p.grad + (i / p.top_k) * N;
      y[k] = p.expert_out[r >> 40] + row * N;
      eg[k] = p.expert_grad[r >> 40] + row * N;
      w[k] = p.topk_weights[i];
    }
  }
  const int64_t mine = base + lane; /* the entry whose sum this lane keeps */
  const bool live = mine < n && p.route[mine] >= 0;
  float acc = 0.f;
  for (int64_t c0 = 0; c0 < N; c0 += 32) {
    const int64_t col = c0 + part * 8;
    uint4 gv[4], yv[4];
#pragma unroll
    for (int k = 0; k < 4; k++) /* every load of the step in flight before the first use */
      if (g[k] && col < N) {
        gv[k] = __ldg(reinterpret_cast<const uint4 *>(g[k] + col));
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
    p.weights_grad[mine] = live ? acc : 0.f;
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
    const int warp = threadIdx.x / 32;
    const int64_t n = p.tokens * p.top_k, step = (int64_t)gridDim.x * kMoeWarps * 32;
    for (int64_t base = ((int64_t)blockIdx.x * kMoeWarps + warp) * 32; base < n; base += step)
      backward_entries(p, base, s_pairs + warp * 32 * kPairStride, p.weights_grad != nullptr);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_COMM_END);
    if (ok)
      rows_landed(dc, epoch); /* the kernel ends once every rank's rows landed here */
    tw_op_finish(dc, ch, epoch);
  }
}

/* Loads the kernel on the current device now (see tw_ops_preload). */
tw_status_t moe_backward_preload(void) {
  cudaFuncAttributes attr;
  return tw_cuda_check(cudaFuncGetAttributes(&attr, moe_combine_backward_kernel),
                       "loading tw_moe_combine_backward's kernel");
}

const tw_op_desc_t moe_backward_registration = {"moe_combine_backward", moe_backward_preload};

} // namespace

TW_OP_REGISTER(moe_combine_backward, moe_backward_registration);

extern "C" tw_status_t tw_moe_combine_backward(tw_comm_t comm, const tw_moe_args_t *args,
                                               tw_stream_t stream) {
  return moe_call(comm, args, stream, kCombineBackward, (const void *)moe_combine_backward_kernel);
}
