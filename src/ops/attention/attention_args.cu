/* The attention ops' shared host pieces (attention_args.h). */
#include "ops/attention/attention_args.h"

#include <math.h>
#include <stdio.h>

#include "ops/attention/attention_sm90.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/argcheck.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
}

namespace tw {
namespace attn {

const char *const kArgNames[kArgCount] = {"q", "k", "v", "o", "lse"};

tw_status_t operand_map(CUtensorMap *map, const void *ptr, int64_t batch, int64_t seq,
                        int64_t heads, int64_t d, const char *what, int box_rows) {
  const tw_driver_api_t *api = NULL;
  tw_status_t st = tw_driver(&api);
  if (st != TW_SUCCESS)
    return st;
  cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)heads, (cuuint64_t)seq, (cuuint64_t)batch};
  cuuint64_t strides[3] = {(cuuint64_t)(d * 2), (cuuint64_t)(heads * d * 2),
                           (cuuint64_t)(seq * heads * d * 2)};
  cuuint32_t box[4] = {(cuuint32_t)kBoxCols, 1, (cuuint32_t)box_rows, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUresult res = api->cuTensorMapEncodeTiled(
      map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)ptr, dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return tw_cu_check(res, what);
}

tw_status_t check_heads(const char *op, int64_t batch, int64_t heads_q, int64_t heads_kv,
                        int64_t head_dim, int64_t causal, float softmax_scale) {
  const struct {
    int64_t value;
    const char *name;
  } sizes[3] = {{batch, "batch"}, {heads_q, "heads_q"}, {heads_kv, "heads_kv"}};
  for (int i = 0; i < 3; i++)
    if (sizes[i].value < 1 || sizes[i].value > 65535)
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s is %lld; expected 1 .. 65535", op,
                     sizes[i].name, (long long)sizes[i].value);
  if (heads_q % heads_kv)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: heads_q is %lld; expected a multiple of heads_kv (%lld)", op,
                   (long long)heads_q, (long long)heads_kv);
  if (head_dim != 64 && head_dim != 128)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: head_dim is %lld; expected 64 or 128", op,
                   (long long)head_dim);
  if (causal != 0 && causal != 1)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: causal is %lld; expected 0 or 1", op,
                   (long long)causal);
  if (!(softmax_scale >= 0.f) || !isfinite(softmax_scale))
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: softmax_scale is %g; expected > 0 (or 0: 1 / sqrt(head_dim))", op,
                   (double)softmax_scale);
  return TW_SUCCESS;
}

tw_status_t check_seqs(const char *op, int64_t seq_q, int64_t seq_kv, int64_t q_offset,
                       int64_t kv_offset) {
  const struct {
    int64_t value;
    const char *name;
  } seqs[2] = {{seq_q, "seq_q"}, {seq_kv, "seq_kv"}},
    offs[2] = {{q_offset, "q_offset"}, {kv_offset, "kv_offset"}};
  for (int i = 0; i < 2; i++)
    if (seqs[i].value < 1 || seqs[i].value > kMaxSeq)
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s is %lld; expected 1 .. %lld", op,
                     seqs[i].name, (long long)seqs[i].value, (long long)kMaxSeq);
  for (int i = 0; i < 2; i++)
    if (offs[i].value < 0 || offs[i].value > ((int64_t)1 << 62))
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s is %lld; expected 0 .. 2^62", op,
                     offs[i].name, (long long)offs[i].value);
  return TW_SUCCESS;
}

tw_status_t check_extent(const char *op, const char *seq_name, const char *heads_name,
                         int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  const int64_t elems = seq * heads * head_dim;
  if (elems * 2 >= ((int64_t)1 << 40) || (double)batch * (double)(elems * 2) >= 4.0e18)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: %s x %s x head_dim is %lld elements a batch (batch %lld); expected below "
                   "2^39 a batch and 2^61 in all",
                   op, seq_name, heads_name, (long long)elems, (long long)batch);
  return TW_SUCCESS;
}

tw_status_t check_aligned(const char *op, const void *const ptrs[kArgCount]) {
  for (int i = 0; i < kArgCount; i++) {
    if (!ptrs[i] && i != kArgLse)
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s is NULL", op, kArgNames[i]);
    const int align = i != kArgLse ? 16 : 4;
    if ((uintptr_t)ptrs[i] % align)
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s (%p) is not %d-byte aligned", op,
                     kArgNames[i], ptrs[i], align);
  }
  return TW_SUCCESS;
}

tw_status_t check_outputs_disjoint(const char *op, const void *const ptrs[kArgCount],
                                   const size_t bytes[kArgCount]) {
  char what[96];
  tw_status_t st = TW_SUCCESS;
  for (int out = kArgO; out < kArgCount && st == TW_SUCCESS; out++)
    for (int in = 0; in < out && st == TW_SUCCESS; in++) {
      if (!ptrs[out] || !ptrs[in])
        continue;
      snprintf(what, sizeof(what), "%s: %s", op, kArgNames[out]);
      st = tw_check_disjoint(ptrs[out], bytes[out], what, ptrs[in], bytes[in], kArgNames[in]);
    }
  return st;
}

} // namespace attn
} // namespace tw
