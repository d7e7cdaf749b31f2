/*
 * tw_moe_dispatch and tw_moe_combine: MoE expert parallelism, routed on the GPU
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
 *                         Then block 0 stores cnt as low-latency words into every rank's
 *                         area (or, without one, into every rank's counts_in[this rank] behind a
 *                         flag, after the entry handshake; exchange_layout); every CTA waits for
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
 * moe_call (declared in moe_layout.cuh) checks, describes and launches these two,
 * tw_moe_combine_backward's kernels (moe_backward.cu) and, on a comm that spans nodes, the
 * dispatch and combine kernels of moe_net.cu in their place. Flags of TW_CH_MOE: moe_layout.cuh.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "device/signal.cuh"
#include "ops/moe/moe_layout.cuh"
#include "ops/moe/moe_net.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/argcheck.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/comm_net.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

namespace {

using namespace tw::moe;

__global__ void __launch_bounds__(kMoeThreads, 1)
    moe_dispatch_kernel(const __grid_constant__ tw_dev_comm_t dc,
                        const __grid_constant__ MoeParams p) {
  __shared__ SharedLayout s;
  extern __shared__ int32_t s_count[]; /* block 0's layout: [warps + 1][experts] */
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  const int ok = exchange_layout(dc, p, s, s_count, epoch);
  const bool copy = ok && s.bad_src < 0 && s.over_rank < 0;
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_LAYOUT_AT);
  if (ok && !copy && blockIdx.x == 0 && threadIdx.x == 0)
    record_layout_error(dc, p, s); /* no rank copies */
  const int64_t n = p.tokens * p.top_k;
  const int lane = threadIdx.x % 32;
  const int64_t first = (int64_t)blockIdx.x * kMoeWarps + threadIdx.x / 32;
  for (int64_t i = first; copy && i < n; i += (int64_t)gridDim.x * kMoeWarps) {
    const int32_t e = load_index(p, i);
    if (e < 0)
      continue; /* its route is -1 (layout_block) */
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
    tw_trace_stamp(dc, TW_TR_COMM_END);
    if (ok)
      rows_landed(dc, epoch); /* the kernel ends once every rank's rows landed here */
    if (tw_op_exit(dc, ch, epoch, false)) {
      ll_call_done(dc, p);
      tw_op_end(dc, ch, epoch);
    }
  }
}

__global__ void __launch_bounds__(kMoeThreads, 1)
    moe_combine_kernel(const __grid_constant__ tw_dev_comm_t dc,
                       const __grid_constant__ MoeParams p) {
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  int mine = 1;
  if (threadIdx.x == 0)
    mine = tw_kernel_enter(dc, ch, epoch) && tw_wait_entries(dc, ch, epoch);
  const int ok = __syncthreads_and(mine);
  for (int64_t t = blockIdx.x; ok && t < p.tokens; t += gridDim.x)
    combine_token(p, t);
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_COMM_END);
    tw_op_finish(dc, ch, epoch);
  }
}

/* What the MoE calls must have alike (the fields tw_moe_call sets). */
const tw_call_fields_t moe_calls[] = {
    {TW_CH_MOE,
     "tw_moe_dispatch / tw_moe_combine",
     {"call (1 dispatch, 2 combine, 3 dispatch + GEMM, 4 GEMM + combine, 5 FFN, 6 combine "
      "backward)",
      "max_tokens", "hidden or n_out (FFN: hidden << 32 | inter)", "experts", "top_k", "recv_rows",
      "recv, expert_out or (combine backward) expert_grad (heap offset)",
      "workspace (heap offset)"}}};

tw_status_t moe_preload(void) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, moe_dispatch_kernel);
  if (e == cudaSuccess)
    e = cudaFuncGetAttributes(&attr, moe_combine_kernel);
  for (int kind = kDispatch; kind <= kCombine && e == cudaSuccess; kind++)
    e = cudaFuncGetAttributes(&attr, moe_net_kernel(kind));
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
  memcpy(args, &init, offsetof(tw_moe_args_t, weights_grad) + sizeof(init.weights_grad));
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_moe_workspace_size(tw_comm_t comm, int64_t max_tokens, int64_t hidden,
                                             int64_t experts, int64_t top_k, size_t *bytes) {
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
  const bool net = comm->nodes > 1;
  if (net && (hidden < 8 || hidden % 8 != 0 || hidden > INT32_MAX))
    return tw_comm_result(
        comm, tw_fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_moe_workspace_size: hidden is %lld; across nodes (%d) the workspace "
                      "stages rows: the widest hidden or n_out of the calls, a positive "
                      "multiple of 8",
                      (long long)hidden, comm->nodes));
  /* across nodes: room for tw_moe_ffn's staged rows and partials, the widest of the calls; a
   * dispatch's staged row is the widest of any call's (the combine backward's gradient row and
   * weights included), and the second staging the larger of the FFN's partials and the combine
   * backward's dots, so every region of every call fits its own */
  const size_t d = net ? net_stage(kDispatch, hidden, 0, top_k) : 0;
  const size_t pf = net_part_stage(kFfn, hidden, top_k);
  const size_t pb = net_part_stage(kCombineBackward, 0, top_k);
  const size_t c = net ? (pf > pb ? pf : pb) : 0;
  *bytes = layout_of(comm->world, max_tokens, experts, top_k, comm->nodes, d, c).bytes;
  return TW_SUCCESS;
}

/* The arguments' contract for `kind` before anything is launched: TW_ERR_INVALID_ARGUMENT
 * naming the first that breaks it. */
static const char *op_name(int kind) {
  static const char *const names[] = {"?",
                                      "tw_moe_dispatch",
                                      "tw_moe_combine",
                                      "tw_moe_dispatch_gemm",
                                      "tw_moe_gemm_combine",
                                      "tw_moe_ffn",
                                      "tw_moe_combine_backward"};
  return names[kind >= 1 && kind <= kCombineBackward ? kind : 0];
}

/* Whether a call of `kind` copies x into the ranks' recv; whether it reads their expert_out. */
static bool sends(int kind) { return kind == kDispatch || kind == kDispatchGemm || kind == kFfn; }
static bool reads_expert_out(int kind) {
  return kind == kCombine || kind == kGemmCombine || kind == kFfn || kind == kCombineBackward;
}

/* The dispatch's buffers: recv symmetric and as large as recv_rows, x, offsets. */
static tw_status_t check_dispatch(tw_comm_t comm, const tw_moe_args_t &a, const char *op,
                                  const Layout &l) {
  char what[96];
  const size_t rows_bytes = (size_t)a.recv_rows * (size_t)a.hidden * 2;
  snprintf(what, sizeof(what), "%s: args->recv", op);
  tw_status_t st = tw_heap_lookup(comm, a.recv, rows_bytes, what, NULL);
  if (st == TW_SUCCESS && a.tokens) {
    snprintf(what, sizeof(what), "%s: args->x", op);
    st = tw_comm_check_range(comm, a.x, (size_t)a.tokens * (size_t)a.hidden * 2, what);
  }
  if (st == TW_SUCCESS) {
    snprintf(what, sizeof(what), "%s: args->offsets", op);
    st = tw_comm_check_range(comm, a.offsets, (size_t)(a.experts / comm->world + 1) * 4, what);
  }
  if (st == TW_SUCCESS) {
    snprintf(what, sizeof(what), "%s: args->recv", op);
    st = tw_check_disjoint(a.recv, rows_bytes, what, a.workspace, l.bytes, "workspace");
  }
  return st;
}

/* The combine's buffers: expert_out symmetric, topk_weights, out apart from expert_out. */
static tw_status_t check_combine(tw_comm_t comm, const tw_moe_args_t &a, const char *op) {
  char what[96];
  const size_t rows_bytes = (size_t)a.recv_rows * (size_t)a.n_out * 2;
  const size_t out_bytes = (size_t)a.tokens * (size_t)a.n_out * 2;
  snprintf(what, sizeof(what), "%s: args->expert_out", op);
  tw_status_t st = tw_heap_lookup(comm, a.expert_out, rows_bytes, what, NULL);
  if (st == TW_SUCCESS && a.tokens) {
    snprintf(what, sizeof(what), "%s: args->topk_weights", op);
    st = tw_comm_check_range(comm, a.topk_weights, (size_t)a.tokens * (size_t)a.top_k * 4, what);
    snprintf(what, sizeof(what), "%s: args->out", op);
    if (st == TW_SUCCESS)
      st = tw_comm_check_range(comm, a.out, out_bytes, what);
    if (st == TW_SUCCESS)
      st = tw_check_disjoint(a.out, out_bytes, what, a.expert_out, rows_bytes, "expert_out");
  }
  return st;
}

/* tw_moe_combine_backward's buffers: expert_out and expert_grad symmetric, grad, topk_weights,
 * weights_grad (may be NULL), and the two outputs apart from each other and from what is read. */
static tw_status_t check_backward(tw_comm_t comm, const tw_moe_args_t &a, const char *op,
                                  const Layout &l) {
  const size_t rows_bytes = (size_t)a.recv_rows * (size_t)a.n_out * 2;
  const size_t T = (size_t)a.tokens, entries = T * (size_t)a.top_k;
  TW_ARG_CHECK(a.grad || !T, "%s: args->grad is NULL (args->size %zu; version 3 has it)", op,
               a.size);
  TW_ARG_CHECK(a.expert_grad, "%s: args->expert_grad is NULL (args->size %zu; version 3 has it)",
               op, a.size);
  char what[96];
  snprintf(what, sizeof(what), "%s: args->expert_out", op);
  tw_status_t st = tw_heap_lookup(comm, a.expert_out, rows_bytes, what, NULL);
  snprintf(what, sizeof(what), "%s: args->expert_grad", op);
  if (st == TW_SUCCESS)
    st = tw_heap_lookup(comm, a.expert_grad, rows_bytes, what, NULL);
  const void *ptrs[3] = {a.grad, a.topk_weights, a.weights_grad};
  const size_t bytes[3] = {T * (size_t)a.n_out * 2, entries * 4, entries * 4};
  const char *names[3] = {"grad", "topk_weights", "weights_grad"};
  for (int i = 0; i < 3 && st == TW_SUCCESS && T; i++)
    if (ptrs[i] || i < 2) {
      snprintf(what, sizeof(what), "%s: args->%s", op, names[i]);
      st = tw_comm_check_range(comm, ptrs[i], bytes[i], what);
    }
  TW_ARG_CHECK(st != TW_SUCCESS || (uintptr_t)a.weights_grad % 4 == 0,
               "%s: args->weights_grad (%p) is not 4-byte aligned", op, (void *)a.weights_grad);
  /* the outputs apart from every buffer the call reads, and from each other */
  const void *outs[2] = {a.expert_grad, a.weights_grad};
  const size_t out_bytes[2] = {rows_bytes, entries * 4};
  const char *out_names[2] = {"expert_grad", "weights_grad"};
  const void *reads[5] = {a.grad, a.topk_weights, a.expert_out, a.topk_idx, a.workspace};
  const size_t read_bytes[5] = {bytes[0], bytes[1], rows_bytes,
                                entries * (size_t)(a.index_bits / 8), l.bytes};
  const char *read_names[5] = {"grad", "topk_weights", "expert_out", "topk_idx", "workspace"};
  for (int o = 0; o < 2 && st == TW_SUCCESS; o++) {
    snprintf(what, sizeof(what), "%s: args->%s", op, out_names[o]);
    for (int i = 0; i < 5 && st == TW_SUCCESS; i++)
      st = tw_check_disjoint(outs[o], out_bytes[o], what, reads[i], read_bytes[i], read_names[i]);
    if (st == TW_SUCCESS && o == 1)
      st = tw_check_disjoint(outs[1], out_bytes[1], what, outs[0], out_bytes[0], out_names[0]);
  }
  return st;
}

/* tw_moe_ffn's own buffers: inter, both weights, h and act apart from each other and from
 * recv and expert_out, and the recv bound the fused GEMMs' block counters serve. */
static tw_status_t check_ffn(tw_comm_t comm, const tw_moe_args_t &a, const char *op) {
  TW_ARG_CHECK(a.inter >= 8 && a.inter % 8 == 0 && a.inter <= INT32_MAX / 2,
               "%s: args->inter is %lld; expected a positive multiple of 8", op,
               (long long)a.inter);
  TW_ARG_CHECK((a.recv_rows + 127) / 128 <= kMaxBlocks,
               "%s: args->recv_rows is %lld; at most %lld with the fused GEMMs", op,
               (long long)a.recv_rows, (long long)kMaxBlocks * 128);
  const size_t local = (size_t)(a.experts / comm->world), H = (size_t)a.hidden, I = (size_t)a.inter,
               R = (size_t)a.recv_rows;
  const void *ptrs[4] = {a.weights, a.weights2, a.h, a.act};
  const size_t bytes[4] = {local * 2 * I * H * 2, local * H * I * 2, R * 2 * I * 2, R * I * 2};
  const char *names[4] = {"weights", "weights2", "h", "act"};
  char what[96];
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < 4 && st == TW_SUCCESS; i++) {
    snprintf(what, sizeof(what), "%s: args->%s", op, names[i]);
    st = tw_comm_check_range(comm, ptrs[i], bytes[i], what);
    if (st == TW_SUCCESS && (uintptr_t)ptrs[i] % 16 != 0)
      st = tw_fail(TW_ERR_INVALID_ARGUMENT, "%s (%p) is not 16-byte aligned", what, ptrs[i]);
  }
  /* the outputs h and act apart from each other and from the other buffers they meet */
  const void *others[3] = {a.recv, a.expert_out, a.act};
  const size_t other_bytes[3] = {R * H * 2, R * H * 2, R * I * 2};
  const char *other_names[3] = {"recv", "expert_out", "act"};
  for (int o = 0; o < 2 && st == TW_SUCCESS; o++) {
    snprintf(what, sizeof(what), "%s: args->%s", op, names[2 + o]);
    for (int i = 0; i < 3 - o && st == TW_SUCCESS; i++)
      st = tw_check_disjoint(ptrs[2 + o], bytes[2 + o], what, others[i], other_bytes[i],
                             other_names[i]);
  }
  snprintf(what, sizeof(what), "%s: args->expert_out", op);
  if (st == TW_SUCCESS)
    st = tw_check_disjoint(a.expert_out, R * H * 2, what, a.recv, R * H * 2, "recv");
  return st;
}

static tw_status_t check_args(tw_comm_t comm, const tw_moe_args_t &a, int kind, Layout *l) {
  const char *op = op_name(kind);
  const int W = comm->world;
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
  const bool gemm = kind == kDispatchGemm || kind == kGemmCombine;
  const bool combine = kind == kCombine || kind == kGemmCombine || kind == kFfn;
  const bool hidden_read = kind != kCombine && kind != kCombineBackward;
  TW_ARG_CHECK(!hidden_read || (a.hidden >= 8 && a.hidden % 8 == 0 && a.hidden <= INT32_MAX),
               "%s: args->hidden is %lld; expected a positive multiple of 8", op,
               (long long)a.hidden);
  TW_ARG_CHECK(kind == kDispatch || (a.n_out >= 8 && a.n_out % 8 == 0 && a.n_out <= INT32_MAX),
               "%s: args->n_out is %lld; expected a positive multiple of 8", op,
               (long long)a.n_out);
  *l = layout_of(W, a.max_tokens, a.experts, a.top_k, comm->nodes,
                 comm->nodes > 1 ? net_stage(kind, a.hidden, a.n_out, a.top_k) : 0,
                 comm->nodes > 1 ? net_part_stage(kind, a.n_out, a.top_k) : 0);
  char what[96];
  snprintf(what, sizeof(what), "%s: args->workspace", op);
  tw_status_t st = tw_heap_lookup(comm, a.workspace, l->bytes, what, NULL);
  const size_t entries = (size_t)a.tokens * (size_t)a.top_k;
  if (st == TW_SUCCESS && entries) {
    snprintf(what, sizeof(what), "%s: args->topk_idx", op);
    st = tw_comm_check_range(comm, a.topk_idx, entries * (size_t)(a.index_bits / 8), what);
  }
  if (st == TW_SUCCESS && sends(kind))
    st = check_dispatch(comm, a, op, *l);
  if (st == TW_SUCCESS && combine)
    st = check_combine(comm, a, op);
  if (st == TW_SUCCESS && kind == kCombineBackward)
    st = check_backward(comm, a, op, *l);
  if (st == TW_SUCCESS && kind == kFfn)
    st = check_ffn(comm, a, op);
  if (st == TW_SUCCESS && kind == kGemmCombine) { /* the GEMM's input rows and offsets */
    snprintf(what, sizeof(what), "%s: args->recv", op);
    st = tw_comm_check_range(comm, a.recv, (size_t)a.recv_rows * (size_t)a.hidden * 2, what);
    snprintf(what, sizeof(what), "%s: args->offsets", op);
    if (st == TW_SUCCESS)
      st = tw_comm_check_range(comm, a.offsets, (size_t)(a.experts / W + 1) * 4, what);
  }
  const size_t out_rows = (size_t)a.recv_rows * (size_t)a.n_out * 2;
  if (st == TW_SUCCESS && gemm) {
    snprintf(what, sizeof(what), "%s: args->weights", op);
    st = tw_comm_check_range(
        comm, a.weights, (size_t)(a.experts / W) * (size_t)a.n_out * (size_t)a.hidden * 2, what);
    snprintf(what, sizeof(what), "%s: args->expert_out", op);
    if (st == TW_SUCCESS)
      st = tw_comm_check_range(comm, a.expert_out, out_rows, what);
    if (st == TW_SUCCESS)
      st = tw_check_disjoint(a.expert_out, out_rows, what, a.recv,
                             (size_t)a.recv_rows * (size_t)a.hidden * 2, "recv");
    TW_ARG_CHECK(st != TW_SUCCESS || (a.recv_rows + 127) / 128 <= kMaxBlocks,
                 "%s: args->recv_rows is %lld; at most %lld with the fused GEMM", op,
                 (long long)a.recv_rows, (long long)kMaxBlocks * 128);
  }
  if (st != TW_SUCCESS)
    return st;
  const bool bwd = kind == kCombineBackward; /* reads grad and expert_out, writes expert_grad */
  const void *aligned[4] = {bwd ? a.grad : a.x, kind == kCombine || bwd ? a.expert_out : a.recv,
                            bwd ? a.expert_grad : a.out,
                            gemm || kind == kFfn ? a.expert_out : NULL};
  const char *names[4] = {bwd ? "grad" : "x", kind == kCombine || bwd ? "expert_out" : "recv",
                          bwd ? "expert_grad" : "out", "expert_out"};
  for (int i = 0; i < 4; i++)
    TW_ARG_CHECK((uintptr_t)aligned[i] % 16 == 0, "%s: args->%s (%p) is not 16-byte aligned", op,
                 names[i], aligned[i]);
  return TW_SUCCESS;
}

tw_status_t tw::moe::moe_prepare(tw_comm_t comm, const tw_moe_args_t *in, int kind,
                                 tw_moe_args_t *out_args, Layout *out_l, MoeParams *out_p) {
  const char *op = op_name(kind);
  if (!in || in->size < offsetof(tw_moe_args_t, recv_rows) + sizeof(in->recv_rows) ||
      in->size > sizeof(tw_moe_args_t) + 4096)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: args is NULL or args->size is not sizeof(tw_moe_args_t) (initialise "
                   "with TW_MOE_ARGS_INIT)",
                   op);
  tw_moe_args_t &a = *out_args;
  a = TW_MOE_ARGS_INIT;
  memcpy(&a, in, in->size < sizeof(a) ? in->size : sizeof(a));
  if (kind == kFfn)
    a.n_out = a.hidden; /* the down projection's columns and the combine's */
  Layout &l = *out_l;
  tw_status_t st = check_args(comm, a, kind, &l);
  if (st != TW_SUCCESS)
    return st;
  MoeParams &p = *out_p;
  memset(&p, 0, sizeof(p));
  char *ws = (char *)a.workspace;
  p.x = (const uint16_t *)a.x;
  p.topk_idx = a.topk_idx;
  p.topk_weights = a.topk_weights;
  p.out = (uint16_t *)a.out;
  p.grad = (const uint16_t *)a.grad;
  p.weights_grad = a.weights_grad;
  p.offsets = a.offsets;
  p.cnt = (int32_t *)(ws + l.cnt);
  p.pos = (int32_t *)(ws + l.pos);
  p.route = (int64_t *)(ws + l.route);
  p.cbase = (int32_t *)(ws + l.cbase);
  p.inv = (int32_t *)(ws + l.inv);
  p.ffn_cnt = (uint64_t *)(ws + l.ffn);
  p.tokens = a.tokens, p.hidden = a.hidden, p.n_out = a.n_out, p.recv_rows = a.recv_rows;
  p.experts = (int32_t)a.experts, p.top_k = (int32_t)a.top_k, p.index_bits = a.index_bits;
  p.local_experts = (int32_t)(a.experts / comm->world);
  /* the count exchange through the low-latency area where every rank's slot fits a half and
   * the area sits at one offset from the control block of every rank of this node (the words
   * never leave the node: across nodes the count rows cross the rail as before); the choice
   * depends on the comm alone (TW_LL_BYTES is alike on every rank), so every rank makes it
   * alike */
  if (sends(kind) && comm->ll && comm->ll_bytes / 2 >= (size_t)comm->world * kLlCountSlot) {
    const uint64_t off = (uint64_t)((const char *)comm->ll - (const char *)comm->ctrl);
    bool mapped = true;
    for (int r = 0; r < comm->world && mapped; r++) {
      if (comm->node_of[r] != comm->node)
        continue;
      const char *ctrl =
          r == comm->rank ? (const char *)comm->ctrl : (const char *)comm->dev.peer_ctrl[r];
      mapped = ctrl && tw_heap_peer_ptr(comm, comm->ll, r) == (const void *)(ctrl + off);
    }
    if (mapped)
      p.ll_off = off, p.ll_half = comm->ll_bytes / 2;
  }
  for (int r = 0; r < comm->world; r++) {
    p.counts_in[r] = (int32_t *)tw_heap_peer_ptr(comm, ws + l.counts_in, r);
    const bool send = sends(kind), read = reads_expert_out(kind), bwd = kind == kCombineBackward;
    if (send)
      p.recv[r] = (uint16_t *)tw_heap_peer_ptr(comm, a.recv, r);
    if (read)
      p.expert_out[r] = (const uint16_t *)tw_heap_peer_ptr(comm, a.expert_out, r);
    if (bwd)
      p.expert_grad[r] = (uint16_t *)tw_heap_peer_ptr(comm, a.expert_grad, r);
    if (comm->node_of[r] != comm->node)
      continue; /* reached over the network only (moe_net.cuh) */
    if (!p.counts_in[r] || (send && !p.recv[r]) || (read && !p.expert_out[r]) ||
        (bwd && !p.expert_grad[r]))
      return tw_fail(TW_ERR_NOT_SUPPORTED, "%s: rank %d's memory is not mapped here", op, r);
  }
  return TW_SUCCESS;
}

tw_status_t tw::moe::moe_net_params(tw_comm_t comm, const tw_moe_args_t &a, int kind,
                                    const Layout &l, MoeNet *n) {
  memset(n, 0, sizeof(*n));
  tw_status_t st = tw_comm_rail(comm, op_name(kind), &n->rail);
  if (st != TW_SUCCESS)
    return st;
  n->l = l;
  n->ws = (uint8_t *)a.workspace;
  n->ws_off = (uint64_t)((const char *)a.workspace -
                         (const char *)tw_group_slot(comm->group, comm->rank, 0));
  n->max_tokens = a.max_tokens;
  n->stage = (int64_t)net_stage(kind, a.hidden, a.n_out, a.top_k);
  return TW_SUCCESS;
}

tw_status_t tw::moe::moe_call(tw_comm_t comm, const tw_moe_args_t *in, tw_stream_t stream, int kind,
                              const void *kernel, const void *net_kernel) {
  const char *op = op_name(kind);
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_moe_args_t a;
  Layout l;
  MoeParams p;
  st = moe_prepare(comm, in, kind, &a, &l, &p);
  MoeNet n; /* across nodes: the kernel of moe_net.cu, with the rail and the staging regions */
  if (st == TW_SUCCESS && comm->nodes > 1) {
    st = moe_net_params(comm, a, kind, l, &n);
    kernel = net_kernel ? net_kernel : moe_net_kernel(kind);
  }
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  /* the buffer of field 6 is the one peers write into (recv, expert_grad), else the one they
   * read (expert_out) */
  const void *sym = kind == kDispatch          ? a.recv
                    : kind == kCombineBackward ? a.expert_grad
                                               : a.expert_out;
  const uint64_t fields[8] = {(uint64_t)kind,
                              (uint64_t)a.max_tokens,
                              (uint64_t)(kind == kDispatch ? a.hidden : a.n_out),
                              (uint64_t)a.experts,
                              (uint64_t)a.top_k,
                              (uint64_t)a.recv_rows,
                              tw_call_heap_field(comm, sym),
                              tw_call_heap_field(comm, a.workspace)};
  int prev = 0, smem = 0;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const tw_call_desc_t outer = tw_call_begin(comm, TW_CH_MOE, 8, fields);
  st = tw_sm_exclusive_smem(kernel, &smem); /* more than block 0's layout needs */
  if (st == TW_SUCCESS && smem < (kMoeWarps + 1) * kMaxExperts * 4)
    st = tw_fail(TW_ERR_INTERNAL, "%s: %d bytes of shared memory a CTA; the layout needs %d", op,
                 smem, (kMoeWarps + 1) * kMaxExperts * 4);
  cudaStream_t launch = NULL;
  if (st == TW_SUCCESS)
    st = tw_launch_begin(comm, stream, &launch);
  /* the dispatch: a warp an entry; the combine: a CTA a token; the backward: a warp per 32
   * entries and per row that may be padding (at most 128 a local expert, and recv_rows) */
  const int64_t pad =
      (a.experts / comm->world) * 128 < a.recv_rows ? (a.experts / comm->world) * 128 : a.recv_rows;
  const int64_t work = kind == kDispatch ? a.tokens * a.top_k / kMoeWarps
                       : kind == kCombine
                           ? a.tokens
                           : ((a.tokens * a.top_k + 31) / 32 + pad + kMoeWarps - 1) / kMoeWarps;
  int grid = comm->sm_budget;
  if (work < grid && comm->nodes == 1)
    grid = work < 1 ? 1 : (int)work;
  void *params[3] = {(void *)&comm->dev, (void *)&p, (void *)&n};
  char what[96];
  snprintf(what, sizeof(what), "%s: kernel launch", op);
  if (st == TW_SUCCESS)
    st = tw_cuda_check(
        cudaLaunchKernel(kernel, dim3(grid), dim3(kMoeThreads), params, (size_t)smem, launch),
        what);
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  tw_call_end(comm, outer);
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}

extern "C" tw_status_t tw_moe_dispatch(tw_comm_t comm, const tw_moe_args_t *args,
                                       tw_stream_t stream) {
  return moe_call(comm, args, stream, kDispatch, (const void *)moe_dispatch_kernel);
}

extern "C" tw_status_t tw_moe_combine(tw_comm_t comm, const tw_moe_args_t *args,
                                      tw_stream_t stream) {
  return moe_call(comm, args, stream, kCombine, (const void *)moe_combine_kernel);
}
