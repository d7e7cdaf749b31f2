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
#include "ops/attention/attention_sm90.cuh"
#include "runtime/argcheck.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "runtime/registry.h"

using namespace tw::attn;

namespace {

constexpr int64_t kMaxSeq = INT32_MAX - 2 * kBlockM; // rows index in int32 with a tile to spare
constexpr int64_t kMaxOffset = (int64_t)1 << 62;

tw_status_t fail_arg(const char *what) { return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s", what); }

template <int D> cudaError_t preload_one() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, (const void *)attention_kernel<D>);
}

/* The 4D map of one operand; `what` names it in the error message. */
tw_status_t operand_map(CUtensorMap *map, const void *ptr, int64_t batch, int64_t seq,
                        int64_t heads, int64_t d, const char *what) {
  const tw_driver_api_t *api = NULL;
  tw_status_t st = tw_driver(&api);
  if (st != TW_SUCCESS)
    return st;
  cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)heads, (cuuint64_t)seq, (cuuint64_t)batch};
  cuuint64_t strides[3] = {(cuuint64_t)(d * 2), (cuuint64_t)(heads * d * 2),
                           (cuuint64_t)(seq * heads * d * 2)};
  cuuint32_t box[4] = {(cuuint32_t)kBoxCols, 1, (cuuint32_t)kBlockN, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUresult res = api->cuTensorMapEncodeTiled(
      map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)ptr, dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return tw_cu_check(res, what);
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
  char why[256];
  const struct {
    int64_t value, most;
    const char *name;
  } sizes[5] = {{a.batch, 65535, "batch"},
                {a.heads_q, 65535, "heads_q"},
                {a.heads_kv, 65535, "heads_kv"},
                {a.seq_q, kMaxSeq, "seq_q"},
                {a.seq_kv, kMaxSeq, "seq_kv"}};
  for (int i = 0; i < 5; i++)
    if (sizes[i].value < 1 || sizes[i].value > sizes[i].most) {
      snprintf(why, sizeof(why), "tw_attention: %s is %lld; expected 1 .. %lld", sizes[i].name,
               (long long)sizes[i].value, (long long)sizes[i].most);
      return fail_arg(why);
    }
  if (a.heads_q % a.heads_kv) {
    snprintf(why, sizeof(why),
             "tw_attention: heads_q is %lld; expected a multiple of heads_kv (%lld)",
             (long long)a.heads_q, (long long)a.heads_kv);
    return fail_arg(why);
  }
  if (a.head_dim != 64 && a.head_dim != 128) {
    snprintf(why, sizeof(why), "tw_attention: head_dim is %lld; expected 64 or 128",
             (long long)a.head_dim);
    return fail_arg(why);
  }
  if (a.causal != 0 && a.causal != 1) {
    snprintf(why, sizeof(why), "tw_attention: causal is %d; expected 0 or 1", (int)a.causal);
    return fail_arg(why);
  }
  if (!(a.softmax_scale >= 0.f) || !isfinite(a.softmax_scale)) {
    snprintf(why, sizeof(why),
             "tw_attention: softmax_scale is %g; expected > 0 (or 0: 1 / sqrt(head_dim))",
             (double)a.softmax_scale);
    return fail_arg(why);
  }
  const int64_t offs[2] = {a.q_offset, a.kv_offset};
  const char *off_names[2] = {"q_offset", "kv_offset"};
  for (int i = 0; i < 2; i++)
    if (offs[i] < 0 || offs[i] > kMaxOffset) {
      snprintf(why, sizeof(why), "tw_attention: %s is %lld; expected 0 .. 2^62", off_names[i],
               (long long)offs[i]);
      return fail_arg(why);
    }
  /* a batch's rows (the maps' outermost stride) below 2^40 bytes, every operand below 2^62 */
  const int64_t seqs[2] = {a.seq_q, a.seq_kv}, heads[2] = {a.heads_q, a.heads_kv};
  for (int i = 0; i < 2; i++)
    if (seqs[i] * heads[i] * a.head_dim * 2 >= ((int64_t)1 << 40) ||
        (double)a.batch * (double)(seqs[i] * heads[i] * a.head_dim * 2) >= 4.0e18) {
      snprintf(why, sizeof(why),
               "tw_attention: %s x %s x head_dim is %lld elements a batch (batch %lld); expected "
               "below 2^39 a batch and 2^61 in all",
               i ? "seq_kv" : "seq_q", i ? "heads_kv" : "heads_q",
               (long long)(seqs[i] * heads[i] * a.head_dim), (long long)a.batch);
      return fail_arg(why);
    }
  const int64_t m_tiles = (a.seq_q + kBlockM - 1) / kBlockM;
  if (m_tiles * a.heads_q * a.batch > INT32_MAX) {
    snprintf(why, sizeof(why),
             "tw_attention: batch x heads_q x ceil(seq_q / 128) is %lld tiles; at most 2^31 - 1",
             (long long)(m_tiles * a.heads_q * a.batch));
    return fail_arg(why);
  }
  return TW_SUCCESS;
}

/* Pointers: set, aligned, device memory of `device` as large as the shapes make them, o and lse
 * overlapping no input (nor each other). */
static tw_status_t check_pointers(const tw_attention_args_t &a, int device) {
  char why[256];
  const size_t q_bytes = (size_t)(a.batch * a.seq_q * a.heads_q * a.head_dim) * 2;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_kv * a.heads_kv * a.head_dim) * 2;
  const size_t lse_bytes = (size_t)(a.batch * a.heads_q * a.seq_q) * 4;
  const void *ptrs[5] = {a.q, a.k, a.v, a.o, a.lse};
  const size_t bytes[5] = {q_bytes, kv_bytes, kv_bytes, q_bytes, lse_bytes};
  const char *names[5] = {"q", "k", "v", "o", "lse"};
  for (int i = 0; i < 5; i++) {
    if (!ptrs[i] && i < 4) {
      snprintf(why, sizeof(why), "tw_attention: %s is NULL", names[i]);
      return fail_arg(why);
    }
    const int align = i < 4 ? 16 : 4;
    if ((uintptr_t)ptrs[i] % align) {
      snprintf(why, sizeof(why), "tw_attention: %s (%p) is not %d-byte aligned", names[i], ptrs[i],
               align);
      return fail_arg(why);
    }
  }
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < 5 && st == TW_SUCCESS; i++) {
    if (!ptrs[i])
      continue;
    snprintf(why, sizeof(why), "tw_attention: %s", names[i]);
    st = tw_check_device_range(device, ptrs[i], bytes[i], why);
  }
  for (int out = 3; out < 5 && st == TW_SUCCESS; out++)
    for (int in = 0; in < out && st == TW_SUCCESS; in++) {
      if (!ptrs[out])
        continue;
      snprintf(why, sizeof(why), "tw_attention: %s", names[out]);
      st = tw_check_disjoint(ptrs[out], bytes[out], why, ptrs[in], bytes[in], names[in]);
    }
  return st;
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
  if (!args_in)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_attention: args is NULL");
  if (args_in->size < offsetof(tw_attention_args_t, sm_count) ||
      args_in->size > sizeof(tw_attention_args_t) + 4096)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_attention: args->size is %zu; expected sizeof(tw_attention_args_t) = %zu "
                   "(initialise with TW_ATTENTION_ARGS_INIT)",
                   args_in->size, sizeof(tw_attention_args_t));
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  memcpy(&a, args_in, args_in->size < sizeof(a) ? args_in->size : sizeof(a));
  a.size = sizeof(a);
  tw_status_t st = check_shapes(a);
  if (st != TW_SUCCESS)
    return st;
  int device = 0, sms = 0;
  if ((st = tw_cuda_check(cudaGetDevice(&device), "tw_attention: cudaGetDevice")) != TW_SUCCESS)
    return st;
  if ((st = tw_check_device(device)) != TW_SUCCESS)
    return st;
  if ((st = check_pointers(a, device)) != TW_SUCCESS)
    return st;
  if ((st = tw_cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                          "tw_attention: multiprocessor count")) != TW_SUCCESS)
    return st;
  if (a.sm_count < 0 || a.sm_count > sms)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_attention: sm_count is %d; expected 0 (all) or 1..%d (device %d's SMs)",
                   (int)a.sm_count, sms, device);
  if (a.sm_count > 0)
    sms = a.sm_count;
  return a.head_dim == 128 ? launch<128>(a, sms, (cudaStream_t)stream)
                           : launch<64>(a, sms, (cudaStream_t)stream);
}
