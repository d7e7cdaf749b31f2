/*
 * tw_moe_dispatch and tw_moe_combine: MoE expert parallelism inside a node, routed on the GPU
 * (contracts in tilewire.h). Each call is one launch on the rank's stream:
 *
 *   moe_dispatch_kernel   persistent, one CTA per SM of the budget. Block 0 first lays out this
 *                         rank's tokens (layout_block): their slots counted per expert and
 *                         numbered in entry (token, then slot) order (warp w takes the w-th
 *                         16th of the entries, 32 at a time, lanes of one expert numbered in
 *                         lane order, then the warps' counts scanned per expert), every entry
 *                         validated, into cnt[experts + 2] (the counts, a status, a bad value)
 *                         and pos[entry] (the entry's place among this rank's rows of its
 *                         expert). (A kernel of its own before this one could find every SM
 *                         held by other virtual ranks' dispatch kernels waiting for its counts.)
 *                         Then block 0 stores cnt into
 *                         every rank's counts_in[this rank] and flags it; every CTA waits for
 *                         every rank's counts and derives the layout every rank derives alike
 *                         (each expert's rows padded to 128, experts in order on their rank,
 *                         sources in rank order inside an expert), checks it (a bad index or an
 *                         overflowing rank: no rank copies, each records the error), copies its
 *                         share of the rows into the experts' ranks' recv, and records each
 *                         entry's destination (route) for the combine. The last CTA to finish
 *                         its copies flags every rank; the kernel ends once every rank's rows
 *                         have landed here.
 *   moe_combine_kernel    after the entry handshake (every rank entered the combine, so its
 *                         expert GEMM is done), each token's slots are summed in slot order from
 *                         the experts' ranks' expert_out, weighted, in fp32.
 *
 * Flags of TW_CH_MOE: [0, world) counts from rank s; [world, 2 world) rank s's rows landed.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "device/signal.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/argcheck.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

namespace {

constexpr int kMaxExperts = 1024, kMaxTopK = 16;
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kDispatch = 1, kCombine = 2; /* the call kind, a field of the description */

/* The workspace of one rank (byte offsets): counts_in [world][experts + 2] int32 (stored by
 * the ranks), cnt [experts + 2] int32, pos [max_tokens * top_k] int32, route
 * [max_tokens * top_k] int64 (rank << 40 | row; -1 none), one uint32 counter. */
struct Layout {
  size_t counts_in, cnt, pos, route, counter, bytes;
};

size_t up256(size_t x) { return (x + 255) / 256 * 256; }

Layout layout_of(int world, int64_t max_tokens, int64_t experts, int64_t top_k) {
  Layout l;
  const size_t row = (size_t)(experts + 2) * 4, entries = (size_t)max_tokens * (size_t)top_k;
  l.counts_in = 0;
  l.cnt = up256((size_t)world * row);
  l.pos = l.cnt + up256(row);
  l.route = l.pos + up256(entries * 4);
  l.counter = l.route + up256(entries * 8);
  l.bytes = l.counter + 256;
  return l;
}

struct MoeParams {
  const uint16_t *x; /* bf16 bits */
  const void *topk_idx;
  const float *topk_weights;
  uint16_t *recv[TW_MAX_WORLD];             /* every rank's recv, mapped here */
  const uint16_t *expert_out[TW_MAX_WORLD]; /* every rank's expert_out, mapped here */
  uint16_t *out;
  int32_t *offsets;
  int32_t *counts_in[TW_MAX_WORLD]; /* every rank's counts_in, mapped here */
  int32_t *cnt, *pos;
  int64_t *route;
  uint32_t *counter;
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

/* Block 0 of the dispatch, all threads: the layout of this rank's entries (the file's
 * comment), s_count [warps][experts] of shared memory. */
__device__ void layout_block(const MoeParams &p, int32_t *s_count) {
  __shared__ int32_t s_bad_entry;
  const int E = p.experts, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x)
    s_count[i] = 0;
  if (threadIdx.x == 0)
    s_bad_entry = INT32_MAX;
  __syncthreads();
  const int64_t n = p.tokens * p.top_k;
  const int64_t begin = n * warp / kWarps, end = n * (warp + 1) / kWarps;
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
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = 0;
    for (int w = 0; w < kWarps; w++) {
      const int32_t c = s_count[w * E + e];
      s_count[w * E + e] = run;
      run += c;
    }
    p.cnt[e] = run;
  }
  __syncthreads();
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    if (i < end) {
      const int32_t at = p.pos[i];
      if (at >= 0)
        p.pos[i] = at + mine[load_index(p, i)];
    }
  }
  if (threadIdx.x == 0) {
    const bool bad = s_bad_entry != INT32_MAX;
    p.cnt[E] = bad ? 1 + s_bad_entry : 0;
    p.cnt[E + 1] = bad ? load_index(p, s_bad_entry) : 0;
  }
  __syncthreads();
}

/* Every CTA's view of the layout: this rank's first row in each expert's segment (base) and, per
 * rank, the rows its experts need. */
struct SharedLayout {
  int32_t base[kMaxExperts];
  int32_t start[kMaxExperts]; /* each expert's first row on its rank */
  int64_t need[TW_MAX_WORLD];
  int32_t bad_src, bad_entry, bad_value, over_rank;
};

__device__ void derive_layout(const MoeParams &p, const tw_dev_comm_t &dc, SharedLayout &s) {
  const int E = p.experts, L = p.local_experts, W = dc.world, stride = E + 2;
  const volatile int32_t *c = p.counts_in[dc.rank];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t total = 0, mine = 0;
    for (int r = 0; r < W; r++) {
      const int32_t v = c[r * stride + e];
      if (r < dc.rank)
        mine += v;
      total += v;
    }
    s.base[e] = mine;
    s.start[e] = (total + 127) / 128 * 128; /* the padded size, made a start below */
  }
  if (threadIdx.x == 0) {
    s.bad_src = -1, s.over_rank = -1;
    for (int r = 0; r < W && s.bad_src < 0; r++)
      if (c[r * stride + E] != 0)
        s.bad_src = r, s.bad_entry = c[r * stride + E] - 1, s.bad_value = c[r * stride + E + 1];
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

/* 16-byte vectors of one row, by the lanes of a warp. */
__device__ __forceinline__ void warp_copy_row(uint16_t *dst, const uint16_t *src, int64_t elems,
                                              int lane) {
  const int64_t vecs = elems / 8;
  for (int64_t v = lane; v < vecs; v += 32)
    reinterpret_cast<uint4 *>(dst)[v] = __ldg(reinterpret_cast<const uint4 *>(src) + v);
}

__global__ void __launch_bounds__(kThreads, 1)
    moe_dispatch_kernel(const __grid_constant__ tw_dev_comm_t dc,
                        const __grid_constant__ MoeParams p) {
  __shared__ SharedLayout s;
  extern __shared__ int32_t s_count[]; /* block 0's layout: [warps][experts] */
  const int ch = TW_CH_MOE, W = dc.world, stride = p.experts + 2;
  const uint64_t epoch = tw_op_begin(dc, ch);
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
    if (threadIdx.x == 0)
      for (int r = 0; r < W; r++)
        tw_signal_set(
            r == dc.rank ? tw_own_flag(dc, ch, dc.rank) : tw_peer_flag(dc, r, ch, dc.rank), epoch);
  }
  if (threadIdx.x == 0)
    for (int r = 0; r < W && mine; r++)
      mine = tw_wait_geq(dc, ch, tw_own_flag(dc, ch, r), epoch, r, r);
  ok = __syncthreads_and(mine);
  if (ok)
    derive_layout(p, dc, s);
  const bool copy = ok && s.bad_src < 0 && s.over_rank < 0;
  if (ok && !copy && blockIdx.x == 0 && threadIdx.x == 0) {
    /* every rank finds the same and records it itself; no rank copies */
    if (s.bad_src >= 0)
      tw_record_wait_failure(dc, TW_ERR_INVALID_ARGUMENT, ch, tw_own_flag(dc, ch, s.bad_src),
                             (uint64_t)(int64_t)s.bad_value, (uint64_t)s.bad_entry,
                             TW_ERR_PEER_MOE_INDEX, s.bad_src);
    else
      tw_record_wait_failure(dc, TW_ERR_INVALID_ARGUMENT, ch, tw_own_flag(dc, ch, s.over_rank),
                             (uint64_t)s.need[s.over_rank], (uint64_t)p.recv_rows,
                             TW_ERR_PEER_MOE_CAPACITY, s.over_rank);
  }
  const int64_t n = p.tokens * p.top_k;
  const int lane = threadIdx.x % 32;
  const int64_t first = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  for (int64_t i = first; copy && i < n; i += (int64_t)gridDim.x * kWarps) {
    const int32_t e = load_index(p, i);
    if (e < 0) {
      if (lane == 0)
        p.route[i] = -1;
      continue;
    }
    const int d = e / p.local_experts;
    const int64_t row = (int64_t)s.base[e] + p.pos[i];
    warp_copy_row(p.recv[d] + row * p.hidden, p.x + (i / p.top_k) * p.hidden, p.hidden, lane);
    if (lane == 0)
      p.route[i] = (int64_t)d << 40 | row;
  }
  if (blockIdx.x == 0 && copy)
    for (int e = threadIdx.x; e <= p.local_experts; e += blockDim.x)
      p.offsets[e] =
          e < p.local_experts ? s.start[dc.rank * p.local_experts + e] : (int32_t)s.need[dc.rank];
  __syncthreads();
  if (threadIdx.x == 0) {
    if (ok) {
      /* the last CTA out tells every rank this rank's rows landed (the CTAs' fences make their
       * stores visible before the count that the last one reads) */
      tw_fence_acq_rel_sys();
      if (atomicAdd(p.counter, 1u) == gridDim.x - 1) {
        *(volatile uint32_t *)p.counter = 0;
        for (int r = 0; r < W; r++)
          tw_signal_set(r == dc.rank ? tw_own_flag(dc, ch, W + dc.rank)
                                     : tw_peer_flag(dc, r, ch, W + dc.rank),
                        epoch);
      }
      for (int r = blockIdx.x; r < W && ok; r += gridDim.x)
        ok = tw_wait_geq(dc, ch, tw_own_flag(dc, ch, W + r), epoch, r, W + r);
    }
    tw_op_finish(dc, ch, epoch);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    moe_combine_kernel(const __grid_constant__ tw_dev_comm_t dc,
                       const __grid_constant__ MoeParams p) {
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  int mine = 1;
  if (threadIdx.x == 0)
    mine = tw_kernel_enter(dc, ch, epoch) && tw_wait_entries(dc, ch, epoch);
  const int ok = __syncthreads_and(mine);
  const int64_t vecs = p.n_out / 8;
  for (int64_t t = blockIdx.x; ok && t < p.tokens; t += gridDim.x)
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
  __syncthreads();
  if (threadIdx.x == 0)
    tw_op_finish(dc, ch, epoch);
}

/* What the MoE calls must have alike (the fields tw_moe_call sets). */
const tw_call_fields_t moe_calls[] = {
    {TW_CH_MOE,
     "tw_moe_dispatch / tw_moe_combine",
     {"call (1 dispatch, 2 combine)", "max_tokens", "hidden or n_out", "experts", "top_k",
      "recv_rows", "recv or expert_out (heap offset)", "workspace (heap offset)"}}};

tw_status_t moe_preload(void) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, moe_dispatch_kernel);
  if (e == cudaSuccess)
    e = cudaFuncGetAttributes(&attr, moe_combine_kernel);
  return tw_cuda_check(e, "loading the MoE kernels");
}

const tw_op_desc_t moe_registration = {"moe", moe_preload, moe_calls, 1};

} // namespace

TW_OP_REGISTER(moe, moe_registration);

extern "C" tw_status_t tw_moe_args_init(tw_moe_args_t *args) {
  if (!args)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_moe_args_init: args is NULL");
  const tw_moe_args_t init = TW_MOE_ARGS_INIT;
  memset(args, 0, sizeof(*args)); /* the padding too */
  memcpy(args, &init, offsetof(tw_moe_args_t, recv_rows) + sizeof(init.recv_rows));
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_moe_workspace_size(tw_comm_t comm, int64_t max_tokens, int64_t experts,
                                             int64_t top_k, size_t *bytes) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (!bytes || max_tokens < 0 || max_tokens > INT32_MAX / kMaxTopK || experts < 1 ||
      experts > kMaxExperts || top_k < 1 || top_k > kMaxTopK)
    return tw_comm_result(
        comm, tw_fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_moe_workspace_size: max_tokens %lld (0 .. 2^27), experts %lld (1 .. "
                      "%d), top_k %lld (1 .. %d), bytes %p (not NULL)",
                      (long long)max_tokens, (long long)experts, kMaxExperts, (long long)top_k,
                      kMaxTopK, (void *)bytes));
  *bytes = layout_of(comm->world, max_tokens, experts, top_k).bytes;
  return TW_SUCCESS;
}

/* The arguments' contract for `kind` before anything is launched: TW_ERR_INVALID_ARGUMENT
 * naming the first that breaks it (or TW_ERR_NOT_SUPPORTED across nodes). */
static tw_status_t check_args(tw_comm_t comm, const tw_moe_args_t &a, int kind, Layout *l) {
  const char *op = kind == kDispatch ? "tw_moe_dispatch" : "tw_moe_combine";
  const int W = comm->world;
  if (comm->nodes > 1)
    return tw_fail(TW_ERR_NOT_SUPPORTED,
                   "%s: the comm spans %d nodes; the MoE calls serve the ranks of one node so far",
                   op, comm->nodes);
  TW_ARG_CHECK(a.index_bits == 32 || a.index_bits == 64,
               "%s: args->index_bits is %d; expected 32 or 64", op, (int)a.index_bits);
  TW_ARG_CHECK(a.experts >= 1 && a.experts <= kMaxExperts && a.experts % W == 0,
               "%s: args->experts is %lld; expected 1 .. %d and a multiple of the world (%d)", op,
               (long long)a.experts, kMaxExperts, W);
  TW_ARG_CHECK(a.top_k >= 1 && a.top_k <= kMaxTopK && a.top_k <= a.experts,
               "%s: args->top_k is %lld; expected 1 .. %d and at most experts (%lld)", op,
               (long long)a.top_k, kMaxTopK, (long long)a.experts);
  TW_ARG_CHECK(a.max_tokens >= 0 && a.max_tokens <= INT32_MAX / kMaxTopK,
               "%s: args->max_tokens is %lld; expected 0 .. 2^27", op, (long long)a.max_tokens);
  TW_ARG_CHECK(a.tokens >= 0 && a.tokens <= a.max_tokens,
               "%s: args->tokens is %lld; expected 0 .. max_tokens (%lld)", op, (long long)a.tokens,
               (long long)a.max_tokens);
  TW_ARG_CHECK(a.recv_rows >= 1 && a.recv_rows <= INT32_MAX,
               "%s: args->recv_rows is %lld; expected 1 .. 2^31 - 1", op, (long long)a.recv_rows);
  const int64_t cols = kind == kDispatch ? a.hidden : a.n_out;
  TW_ARG_CHECK(cols >= 8 && cols % 8 == 0 && cols <= INT32_MAX,
               "%s: args->%s is %lld; expected a positive multiple of 8", op,
               kind == kDispatch ? "hidden" : "n_out", (long long)cols);
  *l = layout_of(W, a.max_tokens, a.experts, a.top_k);
  char what[96];
  snprintf(what, sizeof(what), "%s: args->workspace", op);
  tw_status_t st = tw_heap_lookup(comm, a.workspace, l->bytes, what, NULL);
  const size_t entries = (size_t)a.tokens * (size_t)a.top_k;
  if (st == TW_SUCCESS && entries) {
    snprintf(what, sizeof(what), "%s: args->topk_idx", op);
    st = tw_comm_check_range(comm, a.topk_idx, entries * (size_t)(a.index_bits / 8), what);
  }
  if (st != TW_SUCCESS)
    return st;
  const size_t rows_bytes = (size_t)a.recv_rows * (size_t)cols * 2;
  if (kind == kDispatch) {
    snprintf(what, sizeof(what), "%s: args->recv", op);
    st = tw_heap_lookup(comm, a.recv, rows_bytes, what, NULL);
    if (st == TW_SUCCESS && a.tokens) {
      snprintf(what, sizeof(what), "%s: args->x", op);
      st = tw_comm_check_range(comm, a.x, (size_t)a.tokens * (size_t)a.hidden * 2, what);
    }
    if (st == TW_SUCCESS) {
      snprintf(what, sizeof(what), "%s: args->offsets", op);
      st = tw_comm_check_range(comm, a.offsets, (size_t)(a.experts / W + 1) * 4, what);
    }
    if (st == TW_SUCCESS)
      st = tw_check_disjoint(a.recv, rows_bytes, "tw_moe_dispatch: args->recv", a.workspace,
                             l->bytes, "workspace");
  } else {
    snprintf(what, sizeof(what), "%s: args->expert_out", op);
    st = tw_heap_lookup(comm, a.expert_out, rows_bytes, what, NULL);
    if (st == TW_SUCCESS && a.tokens) {
      snprintf(what, sizeof(what), "%s: args->topk_weights", op);
      st = tw_comm_check_range(comm, a.topk_weights, entries * 4, what);
      snprintf(what, sizeof(what), "%s: args->out", op);
      if (st == TW_SUCCESS)
        st = tw_comm_check_range(comm, a.out, (size_t)a.tokens * (size_t)a.n_out * 2, what);
      if (st == TW_SUCCESS)
        st = tw_check_disjoint(a.out, (size_t)a.tokens * (size_t)a.n_out * 2,
                               "tw_moe_combine: args->out", a.expert_out, rows_bytes, "expert_out");
    }
  }
  if (st != TW_SUCCESS)
    return st;
  const void *aligned[3] = {a.x, kind == kDispatch ? a.recv : a.expert_out, a.out};
  const char *names[3] = {"x", kind == kDispatch ? "recv" : "expert_out", "out"};
  for (int i = 0; i < 3; i++)
    TW_ARG_CHECK((uintptr_t)aligned[i] % 16 == 0, "%s: args->%s (%p) is not 16-byte aligned", op,
                 names[i], aligned[i]);
  return TW_SUCCESS;
}

static tw_status_t moe_call(tw_comm_t comm, const tw_moe_args_t *in, tw_stream_t stream, int kind) {
  const char *op = kind == kDispatch ? "tw_moe_dispatch" : "tw_moe_combine";
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (!in || in->size < offsetof(tw_moe_args_t, recv_rows) + sizeof(in->recv_rows) ||
      in->size > sizeof(tw_moe_args_t) + 4096)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT,
                                        "%s: args is NULL or args->size is not "
                                        "sizeof(tw_moe_args_t) (initialise with TW_MOE_ARGS_INIT)",
                                        op));
  tw_moe_args_t a = TW_MOE_ARGS_INIT;
  memcpy(&a, in, in->size < sizeof(a) ? in->size : sizeof(a));
  Layout l;
  st = check_args(comm, a, kind, &l);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  MoeParams p;
  memset(&p, 0, sizeof(p));
  char *ws = (char *)a.workspace;
  p.x = (const uint16_t *)a.x;
  p.topk_idx = a.topk_idx;
  p.topk_weights = a.topk_weights;
  p.out = (uint16_t *)a.out;
  p.offsets = a.offsets;
  p.cnt = (int32_t *)(ws + l.cnt);
  p.pos = (int32_t *)(ws + l.pos);
  p.route = (int64_t *)(ws + l.route);
  p.counter = (uint32_t *)(ws + l.counter);
  p.tokens = a.tokens, p.hidden = a.hidden, p.n_out = a.n_out, p.recv_rows = a.recv_rows;
  p.experts = (int32_t)a.experts, p.top_k = (int32_t)a.top_k, p.index_bits = a.index_bits;
  p.local_experts = (int32_t)(a.experts / comm->world);
  for (int r = 0; r < comm->world; r++) {
    p.counts_in[r] = (int32_t *)tw_heap_peer_ptr(comm, ws + l.counts_in, r);
    if (kind == kDispatch)
      p.recv[r] = (uint16_t *)tw_heap_peer_ptr(comm, a.recv, r);
    else
      p.expert_out[r] = (const uint16_t *)tw_heap_peer_ptr(comm, a.expert_out, r);
    if (!p.counts_in[r] || (kind == kDispatch ? !p.recv[r] : !p.expert_out[r]))
      return tw_comm_result(
          comm, tw_fail(TW_ERR_NOT_SUPPORTED, "%s: rank %d's memory is not mapped here", op, r));
  }
  const uint64_t fields[8] = {(uint64_t)kind,
                              (uint64_t)a.max_tokens,
                              (uint64_t)(kind == kDispatch ? a.hidden : a.n_out),
                              (uint64_t)a.experts,
                              (uint64_t)a.top_k,
                              (uint64_t)a.recv_rows,
                              tw_call_heap_field(comm, kind == kDispatch ? a.recv : a.expert_out),
                              tw_call_heap_field(comm, a.workspace)};
  int prev = 0, smem = 0;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const tw_call_desc_t outer = tw_call_begin(comm, TW_CH_MOE, 8, fields);
  const void *kernel =
      kind == kDispatch ? (const void *)moe_dispatch_kernel : (const void *)moe_combine_kernel;
  st = tw_sm_exclusive_smem(kernel, &smem); /* more than block 0's layout needs */
  if (st == TW_SUCCESS && smem < kWarps * kMaxExperts * 4)
    st = tw_fail(TW_ERR_INTERNAL, "%s: %d bytes of shared memory a CTA; the layout needs %d", op,
                 smem, kWarps * kMaxExperts * 4);
  cudaStream_t launch = NULL;
  if (st == TW_SUCCESS)
    st = tw_launch_begin(comm, stream, &launch);
  const int64_t work = kind == kDispatch ? a.tokens * a.top_k / kWarps : a.tokens;
  int grid = comm->sm_budget;
  if (work < grid)
    grid = work < 1 ? 1 : (int)work;
  if (st == TW_SUCCESS && kind == kDispatch) {
    moe_dispatch_kernel<<<grid, kThreads, smem, launch>>>(comm->dev, p);
    st = tw_cuda_check(cudaGetLastError(), "tw_moe_dispatch: kernel launch");
  } else if (st == TW_SUCCESS) {
    moe_combine_kernel<<<grid, kThreads, smem, launch>>>(comm->dev, p);
    st = tw_cuda_check(cudaGetLastError(), "tw_moe_combine: kernel launch");
  }
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  tw_call_end(comm, outer);
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}

extern "C" tw_status_t tw_moe_dispatch(tw_comm_t comm, const tw_moe_args_t *args,
                                       tw_stream_t stream) {
  return moe_call(comm, args, stream, kDispatch);
}

extern "C" tw_status_t tw_moe_combine(tw_comm_t comm, const tw_moe_args_t *args,
                                      tw_stream_t stream) {
  return moe_call(comm, args, stream, kCombine);
}
