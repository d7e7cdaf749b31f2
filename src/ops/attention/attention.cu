/*
 * tw_attention: argument checks, the operands' tensor maps, and the launch of the persistent
 * forward kernel (attention_sm90.cuh) for head_dim 64 or 128.
 *
 * Each operand [batch, seq, heads, head_dim] is one 4D tensor map {head_dim, heads, seq, batch}
 * with boxes {64, 1, 128, 1} (128 rows of one head, 128 bytes wide, 128B swizzle): a box past a
 * sequence's end is zero-filled per batch, so K and V tails never read another batch's rows.
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/status.h"
#include "ops/attention/attention_args.h"
#include "ops/attention/attention_sm90.cuh"
#include "runtime/argcheck.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "runtime/registry.h"

using namespace tw::attn;

namespace {

template <int D> cudaError_t preload_one() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, (const void *)attention_kernel<D>);
}

} // namespace

/* Loads the attention kernels on the current device now (see tw_ops_preload). */
static tw_status_t tw_attention_preload(void) {
  cudaError_t e = preload_one<64>();
  cudaError_t f = preload_one<128>();
  return tw_cuda_check(e != cudaSuccess ? e : f, "loading the attention kernels");
}

static const tw_op_desc_t attention_registration = {"attention", tw_attention_preload};
TW_OP_REGISTER(attention, attention_registration);

extern "C" tw_status_t tw_attention_args_init(tw_attention_args_t *args) {
  if (!args)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_attention_args_init: args is NULL");
  const tw_attention_args_t init = TW_ATTENTION_ARGS_INIT;
  memset(args, 0, sizeof(*args)); /* the padding too */
  memcpy(args, &init, offsetof(tw_attention_args_t, sm_count) + sizeof(init.sm_count));
  return TW_SUCCESS;
}

/* The shapes' contract: TW_ERR_INVALID_ARGUMENT naming the first argument that breaks it. */
static tw_status_t check_shapes(const tw_attention_args_t &a) {
  const char *op = "tw_attention";
  tw_status_t st =
      check_heads(op, a.batch, a.heads_q, a.heads_kv, a.head_dim, a.causal, a.softmax_scale);
  if (st == TW_SUCCESS)
    st = check_seqs(op, a.seq_q, a.seq_kv, a.q_offset, a.kv_offset);
  if (st == TW_SUCCESS)
    st = check_extent(op, "seq_q", "heads_q", a.batch, a.seq_q, a.heads_q, a.head_dim);
  if (st == TW_SUCCESS)
    st = check_extent(op, "seq_kv", "heads_kv", a.batch, a.seq_kv, a.heads_kv, a.head_dim);
  const int64_t m_tiles = (a.seq_q + kBlockM - 1) / kBlockM;
  if (st == TW_SUCCESS && m_tiles * a.heads_q * a.batch > INT32_MAX)
    st = tw_fail(TW_ERR_INVALID_ARGUMENT,
                 "%s: batch x heads_q x ceil(seq_q / 128) is %lld tiles; at most 2^31 - 1", op,
                 (long long)(m_tiles * a.heads_q * a.batch));
  return st;
}

/* Pointers: set, aligned, device memory of `device` as large as the shapes make them, o and lse
 * overlapping no input (nor each other). */
static tw_status_t check_pointers(const tw_attention_args_t &a, int device) {
  const char *op = "tw_attention";
  const size_t q_bytes = (size_t)(a.batch * a.seq_q * a.heads_q * a.head_dim) * 2;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_kv * a.heads_kv * a.head_dim) * 2;
  const size_t lse_bytes = (size_t)(a.batch * a.heads_q * a.seq_q) * 4;
  const void *const ptrs[kArgCount] = {a.q, a.k, a.v, a.o, a.lse};
  const size_t bytes[kArgCount] = {q_bytes, kv_bytes, kv_bytes, q_bytes, lse_bytes};
  tw_status_t st = check_aligned(op, ptrs);
  char what[96];
  for (int i = 0; i < kArgCount && st == TW_SUCCESS; i++) {
    if (!ptrs[i])
      continue;
    snprintf(what, sizeof(what), "%s: %s", op, kArgNames[i]);
    st = tw_check_device_range(device, ptrs[i], bytes[i], what);
  }
  return st == TW_SUCCESS ? check_outputs_disjoint(op, ptrs, bytes) : st;
}

template <int D>
static tw_status_t launch(const tw_attention_args_t &a, int sms, cudaStream_t stream) {
  AttnParams p;
  memset(&p, 0, sizeof(p));
  tw_status_t st = operand_map(&p.q_map, a.q, a.batch, a.seq_q, a.heads_q, D,
                               "tw_attention: cuTensorMapEncodeTiled(q)");
  if (st == TW_SUCCESS)
    st = operand_map(&p.k_map, a.k, a.batch, a.seq_kv, a.heads_kv, D,
                     "tw_attention: cuTensorMapEncodeTiled(k)");
  if (st == TW_SUCCESS)
    st = operand_map(&p.v_map, a.v, a.batch, a.seq_kv, a.heads_kv, D,
                     "tw_attention: cuTensorMapEncodeTiled(v)");
  if (st != TW_SUCCESS)
    return st;
  p.o = (__nv_bfloat16 *)a.o;
  p.lse = a.lse;
  p.batch = (int32_t)a.batch;
  p.heads_q = (int32_t)a.heads_q;
  p.seq_q = (int32_t)a.seq_q;
  p.seq_kv = (int32_t)a.seq_kv;
  p.group = (int32_t)(a.heads_q / a.heads_kv);
  p.m_tiles = (int32_t)((a.seq_q + kBlockM - 1) / kBlockM);
  p.num_tiles = (int32_t)(p.m_tiles * a.heads_q * a.batch);
  p.causal = a.causal;
  p.delta = a.q_offset - a.kv_offset;
  const float scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / sqrtf((float)D);
  p.scale_log2 = scale * 1.4426950408889634f;
  p.timeout_ns = kTimeoutDefaultNs;
  constexpr int kSmem = AttnSmem<D>::kDynamicBytes;
  static uint64_t configured; /* a bit per device */
  st = tw_kernel_smem_once((const void *)attention_kernel<D>, kSmem, &configured,
                           "tw_attention: cudaFuncSetAttribute(max dynamic shared memory)");
  if (st != TW_SUCCESS)
    return st;
  const int grid = p.num_tiles < sms ? p.num_tiles : sms;
  attention_kernel<D><<<grid, kThreads, kSmem, stream>>>(p);
  return tw_cuda_check(cudaGetLastError(), "tw_attention: kernel launch");
}

extern "C" tw_status_t tw_attention(const tw_attention_args_t *args_in, tw_stream_t stream) {
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  tw_status_t st = tw_args_copy(args_in, &a, sizeof(a), offsetof(tw_attention_args_t, sm_count),
                                "tw_attention", "tw_attention_args_t", "TW_ATTENTION_ARGS_INIT");
  if (st != TW_SUCCESS)
    return st;
  st = check_shapes(a);
  if (st != TW_SUCCESS)
    return st;
  int device = 0, sms = 0;
  if ((st = tw_op_device("tw_attention", &device)) != TW_SUCCESS)
    return st;
  if ((st = check_pointers(a, device)) != TW_SUCCESS)
    return st;
  if ((st = tw_op_sms("tw_attention", device, a.sm_count, &sms)) != TW_SUCCESS)
    return st;
  return a.head_dim == 128 ? launch<128>(a, sms, (cudaStream_t)stream)
                           : launch<64>(a, sms, (cudaStream_t)stream);
}
