/*
 * tw_attention_backward (contract in tilewire.h): the arguments checked (every
 * failure TW_ERR_INVALID_ARGUMENT naming the argument), then on the caller's stream dsum_kernel,
 * dkdv_kernel and dq_kernel (attention_bwd.cuh), or with dq_accum the one pass: dsum_kernel,
 * dq_accum zeroed, dkdvq_kernel and dq_convert_kernel (attention_bwd_onepass.cuh).
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ops/attention/attention_args.h"
#include "ops/attention/attention_bwd.cuh"
#include "ops/attention/attention_bwd_onepass.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/argcheck.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

using namespace tw::attn;

namespace {

constexpr const char *kOp = "tw_attention_backward";

template <int D> cudaError_t preload_one() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, (const void *)dsum_kernel<D>);
  const void *const kernels[] = {(const void *)dkdv_kernel<D>, (const void *)dq_kernel<D>,
                                 (const void *)dkdvq_kernel<D>, (const void *)dq_convert_kernel<D>};
  for (int i = 0; i < 4 && e == cudaSuccess; i++)
    e = cudaFuncGetAttributes(&attr, kernels[i]);
  return e;
}

tw_status_t backward_preload(void) {
  cudaError_t e = preload_one<64>();
  if (e == cudaSuccess)
    e = preload_one<128>();
  return tw_cuda_check(e, "loading the attention backward's kernels");
}

const tw_op_desc_t backward_registration = {"attention_backward", backward_preload};

/* The shapes' contract (the forward's, attention.cu). */
tw_status_t check_shapes(const tw_attention_backward_args_t &a) {
  tw_status_t st =
      check_heads(kOp, a.batch, a.heads_q, a.heads_kv, a.head_dim, a.causal, a.softmax_scale);
  if (st == TW_SUCCESS)
    st = check_seqs(kOp, a.seq_q, a.seq_kv, a.q_offset, a.kv_offset);
  if (st == TW_SUCCESS)
    st = check_extent(kOp, "seq_q", "heads_q", a.batch, a.seq_q, a.heads_q, a.head_dim);
  if (st == TW_SUCCESS)
    st = check_extent(kOp, "seq_kv", "heads_kv", a.batch, a.seq_kv, a.heads_kv, a.head_dim);
  const int64_t q_tiles = (a.seq_q + kBlockM - 1) / kBlockM * a.heads_q * a.batch;
  const int64_t kv_tiles = (a.seq_kv + kBlockN - 1) / kBlockN * a.heads_kv * a.batch;
  if (st == TW_SUCCESS && (q_tiles > INT32_MAX || kv_tiles > INT32_MAX))
    st = tw_fail(TW_ERR_INVALID_ARGUMENT,
                 "%s: batch x heads x ceil(seq / 128) is %lld (q) and %lld (kv) tiles; at most "
                 "2^31 - 1",
                 kOp, (long long)q_tiles, (long long)kv_tiles);
  return st;
}

/* dq_accum's bytes (the one-pass layout: 128-row blocks of every (batch, q head)). */
size_t dq_accum_bytes(const tw_attention_backward_args_t &a) {
  return (size_t)(a.batch * a.heads_q * ((a.seq_q + 127) / 128 * 128) * a.head_dim) * 4;
}

/* Every pointer set (dq_accum optional), aligned, device memory of `device` as large as the
 * shapes make it; the outputs (dq, dk, dv, workspace, dq_accum) overlapping no input nor each
 * other. */
tw_status_t check_pointers(const tw_attention_backward_args_t &a, int device) {
  enum { kAll = 11, kInputs = 6 };
  const int count = a.dq_accum ? kAll : kAll - 1;
  const size_t q_bytes = (size_t)(a.batch * a.seq_q * a.heads_q * a.head_dim) * 2;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_kv * a.heads_kv * a.head_dim) * 2;
  const size_t rows_bytes = (size_t)(a.batch * a.heads_q * a.seq_q) * 4;
  const void *const ptrs[kAll] = {a.q,  a.k,  a.v,  a.o,         a.dout,    a.lse,
                                  a.dq, a.dk, a.dv, a.workspace, a.dq_accum};
  const char *const names[kAll] = {"q",  "k",  "v",  "o",         "dout",    "lse",
                                   "dq", "dk", "dv", "workspace", "dq_accum"};
  const size_t sizes[kAll] = {q_bytes, kv_bytes, kv_bytes, q_bytes,    q_bytes,          rows_bytes,
                              q_bytes, kv_bytes, kv_bytes, rows_bytes, dq_accum_bytes(a)};
  char what[96];
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < count && st == TW_SUCCESS; i++) {
    const int align = i == 5 || i == 9 ? 4 : 16;
    if (!ptrs[i])
      st = tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s is NULL", kOp, names[i]);
    else if ((uintptr_t)ptrs[i] % align)
      st = tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s (%p) is not %d-byte aligned", kOp, names[i],
                   ptrs[i], align);
    if (st == TW_SUCCESS) {
      snprintf(what, sizeof(what), "%s: %s", kOp, names[i]);
      st = tw_check_device_range(device, ptrs[i], sizes[i], what);
    }
  }
  for (int out = kInputs; out < count && st == TW_SUCCESS; out++)
    for (int other = 0; other < out && st == TW_SUCCESS; other++) {
      snprintf(what, sizeof(what), "%s: %s", kOp, names[out]);
      st = tw_check_disjoint(ptrs[out], sizes[out], what, ptrs[other], sizes[other], names[other]);
    }
  return st;
}

template <int D> tw_status_t params_of(const tw_attention_backward_args_t &a, BwdParams *p) {
  memset(p, 0, sizeof(*p));
  const struct {
    CUtensorMap *map;
    const void *ptr;
    int64_t seq, heads;
    int rows;
    const char *what;
  } maps[6] = {
      {&p->q_map, a.q, a.seq_q, a.heads_q, kBlockM, "tw_attention_backward: q's tensor map"},
      {&p->k_map, a.k, a.seq_kv, a.heads_kv, kBlockN, "tw_attention_backward: k's tensor map"},
      {&p->v_map, a.v, a.seq_kv, a.heads_kv, kBlockN, "tw_attention_backward: v's tensor map"},
      {&p->do_map, a.dout, a.seq_q, a.heads_q, kBlockM, "tw_attention_backward: dout's tensor map"},
      {&p->q64_map, a.q, a.seq_q, a.heads_q, kBwdBlockQ<D>,
       "tw_attention_backward: q's tensor map"},
      {&p->do64_map, a.dout, a.seq_q, a.heads_q, kBwdBlockQ<D>,
       "tw_attention_backward: dout's tensor map"},
  };
  for (int i = 0; i < 6; i++) {
    tw_status_t st = operand_map(maps[i].map, maps[i].ptr, a.batch, maps[i].seq, maps[i].heads, D,
                                 maps[i].what, maps[i].rows);
    if (st != TW_SUCCESS)
      return st;
  }
  p->o = (const __nv_bfloat16 *)a.o;
  p->dout = (const __nv_bfloat16 *)a.dout;
  p->lse = a.lse;
  p->dsum = a.workspace;
  p->dq = (__nv_bfloat16 *)a.dq;
  p->dk = (__nv_bfloat16 *)a.dk;
  p->dv = (__nv_bfloat16 *)a.dv;
  p->dq_accum = a.dq_accum;
  p->batch = (int32_t)a.batch;
  p->heads_q = (int32_t)a.heads_q;
  p->heads_kv = (int32_t)a.heads_kv;
  p->seq_q = (int32_t)a.seq_q;
  p->seq_kv = (int32_t)a.seq_kv;
  p->group = (int32_t)(a.heads_q / a.heads_kv);
  p->m_tiles = (int32_t)((a.seq_q + kBlockM - 1) / kBlockM);
  p->q_blocks = (int32_t)((a.seq_q + kBwdBlockQ<D> - 1) / kBwdBlockQ<D>);
  p->n_tiles = (int32_t)((a.seq_kv + kBlockN - 1) / kBlockN);
  p->num_tiles = (int32_t)(p->m_tiles * a.heads_q * a.batch);
  p->num_kv_tiles = (int32_t)(p->n_tiles * a.heads_kv * a.batch);
  p->causal = a.causal;
  p->delta = a.q_offset - a.kv_offset;
  p->scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / sqrtf((float)D);
  p->scale_log2 = p->scale * 1.4426950408889634f;
  p->timeout_ns = kTimeoutDefaultNs;
  return TW_SUCCESS;
}

/* The one pass after dsum_kernel: dq_accum zeroed, dkdvq_kernel, dq_convert_kernel. */
template <int D>
tw_status_t launch_one_pass(const tw_attention_backward_args_t &a, const BwdParams &p, int sms,
                            cudaStream_t stream) {
  static uint64_t configured; /* a bit per device */
  tw_status_t st =
      tw_kernel_smem_once((const void *)dkdvq_kernel<D>, DkvqSmem<D>::kDynamicBytes, &configured,
                          "tw_attention_backward: cudaFuncSetAttribute(dkdvq shared memory)");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaMemsetAsync(a.dq_accum, 0, dq_accum_bytes(a), stream),
                       "tw_attention_backward: zeroing dq_accum");
  if (st != TW_SUCCESS)
    return st;
  const int kv_grid = p.num_kv_tiles < sms ? p.num_kv_tiles : sms;
  dkdvq_kernel<D><<<kv_grid, kThreads, DkvqSmem<D>::kDynamicBytes, stream>>>(p);
  if ((st = tw_cuda_check(cudaGetLastError(), "tw_attention_backward: dkdvq launch")) != TW_SUCCESS)
    return st;
  const int64_t quads = (int64_t)p.batch * p.heads_q * p.q_blocks * 2 * 1024;
  const int grid = (int)(quads / 256 + 1 < (int64_t)sms * 8 ? quads / 256 + 1 : (int64_t)sms * 8);
  dq_convert_kernel<D><<<grid, 256, 0, stream>>>(p);
  return tw_cuda_check(cudaGetLastError(), "tw_attention_backward: dq_convert launch");
}

template <int D>
tw_status_t launch(const tw_attention_backward_args_t &a, int sms, cudaStream_t stream) {
  BwdParams p;
  tw_status_t st = params_of<D>(a, &p);
  static uint64_t dkdv_configured, dq_configured; /* a bit per device */
  if (st == TW_SUCCESS)
    st = tw_kernel_smem_once((const void *)dkdv_kernel<D>, DkvSmem<D>::kDynamicBytes,
                             &dkdv_configured,
                             "tw_attention_backward: cudaFuncSetAttribute(dkdv shared memory)");
  if (st == TW_SUCCESS)
    st = tw_kernel_smem_once((const void *)dq_kernel<D>, DqSmem<D>::kDynamicBytes, &dq_configured,
                             "tw_attention_backward: cudaFuncSetAttribute(dq shared memory)");
  if (st != TW_SUCCESS)
    return st;
  dsum_kernel<D><<<dsum_grid(a.batch * a.seq_q * a.heads_q, sms), 256, 0, stream>>>(p);
  if ((st = tw_cuda_check(cudaGetLastError(), "tw_attention_backward: dsum launch")) != TW_SUCCESS)
    return st;
  if (a.dq_accum)
    return launch_one_pass<D>(a, p, sms, stream);
  const int kv_grid = p.num_kv_tiles < sms ? p.num_kv_tiles : sms;
  dkdv_kernel<D><<<kv_grid, kThreads, DkvSmem<D>::kDynamicBytes, stream>>>(p);
  if ((st = tw_cuda_check(cudaGetLastError(), "tw_attention_backward: dkdv launch")) != TW_SUCCESS)
    return st;
  const int q_grid = p.num_tiles < sms ? p.num_tiles : sms;
  dq_kernel<D><<<q_grid, kThreads, DqSmem<D>::kDynamicBytes, stream>>>(p);
  return tw_cuda_check(cudaGetLastError(), "tw_attention_backward: dq launch");
}

} // namespace

TW_OP_REGISTER(attention_backward, backward_registration);

extern "C" tw_status_t tw_attention_backward_args_init(tw_attention_backward_args_t *args) {
  if (!args)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_attention_backward_args_init: args is NULL");
  const tw_attention_backward_args_t init = TW_ATTENTION_BACKWARD_ARGS_INIT;
  memset(args, 0, sizeof(*args)); /* the padding too */
  memcpy(args, &init, offsetof(tw_attention_backward_args_t, dq_accum) + sizeof(init.dq_accum));
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_attention_backward(const tw_attention_backward_args_t *args_in,
                                             tw_stream_t stream) {
  tw_attention_backward_args_t a = TW_ATTENTION_BACKWARD_ARGS_INIT;
  tw_status_t st =
      tw_args_copy(args_in, &a, sizeof(a), offsetof(tw_attention_backward_args_t, sm_count), kOp,
                   "tw_attention_backward_args_t", "TW_ATTENTION_BACKWARD_ARGS_INIT");
  if (st != TW_SUCCESS)
    return st;
  if ((st = check_shapes(a)) != TW_SUCCESS)
    return st;
  int device = 0, sms = 0;
  if ((st = tw_op_device("tw_attention_backward", &device)) != TW_SUCCESS)
    return st;
  if ((st = check_pointers(a, device)) != TW_SUCCESS)
    return st;
  if ((st = tw_op_sms("tw_attention_backward", device, a.sm_count, &sms)) != TW_SUCCESS)
    return st;
  return a.head_dim == 128 ? launch<128>(a, sms, (cudaStream_t)stream)
                           : launch<64>(a, sms, (cudaStream_t)stream);
}
