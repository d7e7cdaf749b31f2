/*
 * tw_attention_backward: the backward of tw_attention (attention_bwd.cuh holds its kernels).
 * Internal until its GPU test (tests/gpu/test_attention_backward.cu) has passed: then this
 * declaration moves into tilewire.h and Python autograd uses it.
 *
 * With S = softmax_scale Q K^T masked as the forward masks it, P = exp(S - lse) (lse: the
 * forward's, natural log) and dsum_i = sum_c dout[i][c] o[i][c]:
 *   dv = P^T dout,  dk = softmax_scale dS^T q,  dq = softmax_scale dS k,  dS = P (dout v^T - dsum)
 * (GQA: a kv head's dk and dv sum over the q heads of its group). fp32 sums, P and dS rounded to
 * bf16 as the GEMMs' operands, dq, dk and dv rounded to bf16 once; deterministic (no atomics).
 * Rows no key reaches (lse -inf) contribute nothing. workspace: fp32 [batch, heads_q, seq_q]
 * (dsum), written. Three launches on `stream`, no host synchronisation (CUDA-graph capturable).
 */
#ifndef TW_OPS_ATTENTION_BACKWARD_H
#define TW_OPS_ATTENTION_BACKWARD_H

#include <stddef.h>
#include <stdint.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_ATTENTION_BACKWARD_ARGS_VERSION 1
typedef struct tw_attention_backward_args {
  size_t size;      /* sizeof(tw_attention_backward_args_t) */
  uint32_t version; /* TW_ATTENTION_BACKWARD_ARGS_VERSION */
  int32_t causal;   /* 0 or 1, as the forward's */
  const void *q;    /* bf16 [batch, seq_q, heads_q, head_dim] */
  const void *k;    /* bf16 [batch, seq_kv, heads_kv, head_dim] */
  const void *v;    /* bf16 [batch, seq_kv, heads_kv, head_dim] */
  const void *o;    /* bf16 [batch, seq_q, heads_q, head_dim]: the forward's output */
  const void *dout; /* bf16, o's shape: the gradient of o */
  const float *lse; /* fp32 [batch, heads_q, seq_q]: the forward's */
  void *dq;         /* bf16, q's shape, written */
  void *dk;         /* bf16, k's shape, written */
  void *dv;         /* bf16, v's shape, written */
  float *workspace; /* fp32 [batch, heads_q, seq_q], written */
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
  int64_t q_offset, kv_offset; /* as the forward's */
  float softmax_scale;         /* as the forward's; 0: 1 / sqrt(head_dim) */
  int32_t sm_count;            /* SMs to use; 0: all the device's */
} tw_attention_backward_args_t;

#define TW_ATTENTION_BACKWARD_ARGS_INIT                                                            \
  {                                                                                                \
    sizeof(tw_attention_backward_args_t), TW_ATTENTION_BACKWARD_ARGS_VERSION, 0, 0, 0, 0, 0, 0, 0, \
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0f, 0                                                \
  }

TW_API tw_status_t tw_attention_backward(const tw_attention_backward_args_t *args,
                                         tw_stream_t stream);

#ifdef __cplusplus
}
#endif
#endif
