/*
 * Prints, as JSON, the layout of every public struct of tilewire.h (sizeof, alignment, and
 * each field's offset and size), every enum constant and the #define constants, so the
 * Python layout test (python/tests/test_layout.py) can check the ctypes mirror against
 * the C compiler's view of the header. Built and run by the test:
 *
 *   cc -std=c11 -Wall -Wextra -Werror -I include python/tools/struct_layout.c -o layout
 *
 * A new public struct or enum: add it below (the test also parses the header and fails
 * when something it declares is missing here or in the Python binding).
 */
#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>

#include "tilewire.h"

static int first_item;

static void begin_object(const char *name) {
  printf("%s\n    \"%s\": {", first_item ? "" : ",", name);
  first_item = 0;
}

static int first_field;

static void begin_struct(const char *name, size_t size, size_t align) {
  begin_object(name);
  printf("\"size\": %zu, \"align\": %zu, \"fields\": [", size, align);
  first_field = 1;
}

static void field(const char *name, size_t offset, size_t size) {
  printf("%s\n      [\"%s\", %zu, %zu]", first_field ? "" : ",", name, offset, size);
  first_field = 0;
}

static void end_struct(void) { printf("\n    ]}"); }

#define STRUCT(T) begin_struct(#T, sizeof(T), alignof(T))
#define FIELD(T, f) field(#f, offsetof(T, f), sizeof(((T *)0)->f))

static void value(const char *name, long long v) {
  printf("%s\n    \"%s\": %lld", first_item ? "" : ",", name, v);
  first_item = 0;
}

#define VALUE(v) value(#v, (long long)(v))

/* The structs of the comm and of the single-GPU ops. */
static void core_structs(void) {
  STRUCT(tw_unique_id_t);
  FIELD(tw_unique_id_t, internal);
  end_struct();

  STRUCT(tw_config_t);
  FIELD(tw_config_t, size);
  FIELD(tw_config_t, version);
  FIELD(tw_config_t, sm_budget);
  FIELD(tw_config_t, ranks_per_node);
  FIELD(tw_config_t, bootstrap_timeout_ms);
  FIELD(tw_config_t, wait_timeout_ms);
  FIELD(tw_config_t, reserved0);
  FIELD(tw_config_t, heap_bytes);
  end_struct();

  STRUCT(tw_gemm_args_t);
  FIELD(tw_gemm_args_t, size);
  FIELD(tw_gemm_args_t, version);
  FIELD(tw_gemm_args_t, c_dtype);
  FIELD(tw_gemm_args_t, a);
  FIELD(tw_gemm_args_t, b);
  FIELD(tw_gemm_args_t, c);
  FIELD(tw_gemm_args_t, m);
  FIELD(tw_gemm_args_t, n);
  FIELD(tw_gemm_args_t, k);
  FIELD(tw_gemm_args_t, lda);
  FIELD(tw_gemm_args_t, ldb);
  FIELD(tw_gemm_args_t, ldc);
  FIELD(tw_gemm_args_t, sm_count);
  FIELD(tw_gemm_args_t, tile_order);
  FIELD(tw_gemm_args_t, rotate_start);
  FIELD(tw_gemm_args_t, split_k);
  FIELD(tw_gemm_args_t, workspace);
  FIELD(tw_gemm_args_t, workspace_bytes);
  end_struct();

  STRUCT(tw_grouped_gemm_args_t);
  FIELD(tw_grouped_gemm_args_t, size);
  FIELD(tw_grouped_gemm_args_t, version);
  FIELD(tw_grouped_gemm_args_t, c_dtype);
  FIELD(tw_grouped_gemm_args_t, a);
  FIELD(tw_grouped_gemm_args_t, b);
  FIELD(tw_grouped_gemm_args_t, out);
  FIELD(tw_grouped_gemm_args_t, offsets);
  FIELD(tw_grouped_gemm_args_t, m);
  FIELD(tw_grouped_gemm_args_t, n);
  FIELD(tw_grouped_gemm_args_t, k);
  FIELD(tw_grouped_gemm_args_t, groups);
  FIELD(tw_grouped_gemm_args_t, lda);
  FIELD(tw_grouped_gemm_args_t, ldb);
  FIELD(tw_grouped_gemm_args_t, ldo);
  FIELD(tw_grouped_gemm_args_t, sm_count);
  end_struct();

  STRUCT(tw_attention_args_t);
  FIELD(tw_attention_args_t, size);
  FIELD(tw_attention_args_t, version);
  FIELD(tw_attention_args_t, causal);
  FIELD(tw_attention_args_t, q);
  FIELD(tw_attention_args_t, k);
  FIELD(tw_attention_args_t, v);
  FIELD(tw_attention_args_t, o);
  FIELD(tw_attention_args_t, lse);
  FIELD(tw_attention_args_t, batch);
  FIELD(tw_attention_args_t, heads_q);
  FIELD(tw_attention_args_t, heads_kv);
  FIELD(tw_attention_args_t, seq_q);
  FIELD(tw_attention_args_t, seq_kv);
  FIELD(tw_attention_args_t, head_dim);
  FIELD(tw_attention_args_t, q_offset);
  FIELD(tw_attention_args_t, kv_offset);
  FIELD(tw_attention_args_t, softmax_scale);
  FIELD(tw_attention_args_t, sm_count);
  end_struct();

  STRUCT(tw_attention_backward_args_t);
  FIELD(tw_attention_backward_args_t, size);
  FIELD(tw_attention_backward_args_t, version);
  FIELD(tw_attention_backward_args_t, causal);
  FIELD(tw_attention_backward_args_t, q);
  FIELD(tw_attention_backward_args_t, k);
  FIELD(tw_attention_backward_args_t, v);
  FIELD(tw_attention_backward_args_t, o);
  FIELD(tw_attention_backward_args_t, dout);
  FIELD(tw_attention_backward_args_t, lse);
  FIELD(tw_attention_backward_args_t, dq);
  FIELD(tw_attention_backward_args_t, dk);
  FIELD(tw_attention_backward_args_t, dv);
  FIELD(tw_attention_backward_args_t, workspace);
  FIELD(tw_attention_backward_args_t, batch);
  FIELD(tw_attention_backward_args_t, heads_q);
  FIELD(tw_attention_backward_args_t, heads_kv);
  FIELD(tw_attention_backward_args_t, seq_q);
  FIELD(tw_attention_backward_args_t, seq_kv);
  FIELD(tw_attention_backward_args_t, head_dim);
  FIELD(tw_attention_backward_args_t, q_offset);
  FIELD(tw_attention_backward_args_t, kv_offset);
  FIELD(tw_attention_backward_args_t, softmax_scale);
  FIELD(tw_attention_backward_args_t, sm_count);
  FIELD(tw_attention_backward_args_t, dq_accum);
  end_struct();
}

/* The structs of the fused (multi-GPU) ops. */
static void fused_structs(void) {
  STRUCT(tw_ring_attention_args_t);
  FIELD(tw_ring_attention_args_t, size);
  FIELD(tw_ring_attention_args_t, version);
  FIELD(tw_ring_attention_args_t, causal);
  FIELD(tw_ring_attention_args_t, q);
  FIELD(tw_ring_attention_args_t, k);
  FIELD(tw_ring_attention_args_t, v);
  FIELD(tw_ring_attention_args_t, o);
  FIELD(tw_ring_attention_args_t, lse);
  FIELD(tw_ring_attention_args_t, batch);
  FIELD(tw_ring_attention_args_t, heads_q);
  FIELD(tw_ring_attention_args_t, heads_kv);
  FIELD(tw_ring_attention_args_t, seq_local);
  FIELD(tw_ring_attention_args_t, head_dim);
  FIELD(tw_ring_attention_args_t, softmax_scale);
  FIELD(tw_ring_attention_args_t, layout);
  FIELD(tw_ring_attention_args_t, sm_count);
  FIELD(tw_ring_attention_args_t, gathered);
  end_struct();

  STRUCT(tw_ring_attention_backward_args_t);
  FIELD(tw_ring_attention_backward_args_t, size);
  FIELD(tw_ring_attention_backward_args_t, version);
  FIELD(tw_ring_attention_backward_args_t, causal);
  FIELD(tw_ring_attention_backward_args_t, q);
  FIELD(tw_ring_attention_backward_args_t, k);
  FIELD(tw_ring_attention_backward_args_t, v);
  FIELD(tw_ring_attention_backward_args_t, o);
  FIELD(tw_ring_attention_backward_args_t, dout);
  FIELD(tw_ring_attention_backward_args_t, lse);
  FIELD(tw_ring_attention_backward_args_t, dq);
  FIELD(tw_ring_attention_backward_args_t, dk);
  FIELD(tw_ring_attention_backward_args_t, dv);
  FIELD(tw_ring_attention_backward_args_t, workspace);
  FIELD(tw_ring_attention_backward_args_t, batch);
  FIELD(tw_ring_attention_backward_args_t, heads_q);
  FIELD(tw_ring_attention_backward_args_t, heads_kv);
  FIELD(tw_ring_attention_backward_args_t, seq_local);
  FIELD(tw_ring_attention_backward_args_t, head_dim);
  FIELD(tw_ring_attention_backward_args_t, softmax_scale);
  FIELD(tw_ring_attention_backward_args_t, layout);
  FIELD(tw_ring_attention_backward_args_t, sm_count);
  FIELD(tw_ring_attention_backward_args_t, gathered);
  end_struct();

  STRUCT(tw_ag_gemm_args_t);
  FIELD(tw_ag_gemm_args_t, size);
  FIELD(tw_ag_gemm_args_t, version);
  FIELD(tw_ag_gemm_args_t, c_dtype);
  FIELD(tw_ag_gemm_args_t, a);
  FIELD(tw_ag_gemm_args_t, b);
  FIELD(tw_ag_gemm_args_t, c);
  FIELD(tw_ag_gemm_args_t, a_gathered);
  FIELD(tw_ag_gemm_args_t, m_local);
  FIELD(tw_ag_gemm_args_t, n);
  FIELD(tw_ag_gemm_args_t, k);
  FIELD(tw_ag_gemm_args_t, ldb);
  FIELD(tw_ag_gemm_args_t, ldc);
  FIELD(tw_ag_gemm_args_t, comm_sms);
  FIELD(tw_ag_gemm_args_t, comm_mode);
  FIELD(tw_ag_gemm_args_t, no_gathered_out);
  FIELD(tw_ag_gemm_args_t, reserved);
  end_struct();

  STRUCT(tw_gemm_rs_args_t);
  FIELD(tw_gemm_rs_args_t, size);
  FIELD(tw_gemm_rs_args_t, version);
  FIELD(tw_gemm_rs_args_t, out_dtype);
  FIELD(tw_gemm_rs_args_t, a);
  FIELD(tw_gemm_rs_args_t, b);
  FIELD(tw_gemm_rs_args_t, out);
  FIELD(tw_gemm_rs_args_t, workspace);
  FIELD(tw_gemm_rs_args_t, m);
  FIELD(tw_gemm_rs_args_t, n);
  FIELD(tw_gemm_rs_args_t, k);
  FIELD(tw_gemm_rs_args_t, lda);
  FIELD(tw_gemm_rs_args_t, ldb);
  FIELD(tw_gemm_rs_args_t, ldo);
  FIELD(tw_gemm_rs_args_t, reduce_sms);
  FIELD(tw_gemm_rs_args_t, partials);
  FIELD(tw_gemm_rs_args_t, out_symmetric);
  FIELD(tw_gemm_rs_args_t, reserved);
  end_struct();

  STRUCT(tw_moe_args_t);
  FIELD(tw_moe_args_t, size);
  FIELD(tw_moe_args_t, version);
  FIELD(tw_moe_args_t, index_bits);
  FIELD(tw_moe_args_t, x);
  FIELD(tw_moe_args_t, topk_idx);
  FIELD(tw_moe_args_t, topk_weights);
  FIELD(tw_moe_args_t, recv);
  FIELD(tw_moe_args_t, offsets);
  FIELD(tw_moe_args_t, expert_out);
  FIELD(tw_moe_args_t, out);
  FIELD(tw_moe_args_t, workspace);
  FIELD(tw_moe_args_t, tokens);
  FIELD(tw_moe_args_t, max_tokens);
  FIELD(tw_moe_args_t, hidden);
  FIELD(tw_moe_args_t, n_out);
  FIELD(tw_moe_args_t, experts);
  FIELD(tw_moe_args_t, top_k);
  FIELD(tw_moe_args_t, recv_rows);
  FIELD(tw_moe_args_t, weights);
  FIELD(tw_moe_args_t, weights2);
  FIELD(tw_moe_args_t, h);
  FIELD(tw_moe_args_t, act);
  FIELD(tw_moe_args_t, inter);
  FIELD(tw_moe_args_t, grad);
  FIELD(tw_moe_args_t, expert_grad);
  FIELD(tw_moe_args_t, weights_grad);
  end_struct();

  /* ---- the next ops' argument structs go here as they land ---- */
}

int main(void) {
  printf("{\n  \"structs\": {");
  first_item = 1;
  core_structs();
  fused_structs();

  printf("\n  },\n  \"enum_sizes\": {");
  first_item = 1;
  VALUE(sizeof(tw_status_t));
  VALUE(sizeof(tw_dtype_t));
  VALUE(sizeof(tw_tile_order_t));
  VALUE(sizeof(tw_ag_comm_mode_t));
  VALUE(sizeof(tw_partials_t));

  printf("\n  },\n  \"enums\": {");
  first_item = 1;
  VALUE(TW_SUCCESS);
  VALUE(TW_ERR_INVALID_ARGUMENT);
  VALUE(TW_ERR_NO_DEVICE);
  VALUE(TW_ERR_UNSUPPORTED_DEVICE);
  VALUE(TW_ERR_CUDA);
  VALUE(TW_ERR_OUT_OF_MEMORY);
  VALUE(TW_ERR_SYSTEM);
  VALUE(TW_ERR_TIMEOUT);
  VALUE(TW_ERR_REMOTE);
  VALUE(TW_ERR_DEVICE_TIMEOUT);
  VALUE(TW_ERR_NOT_SUPPORTED);
  VALUE(TW_ERR_INTERNAL);
  VALUE(TW_ERR_ABORTED);
  VALUE(TW_ERR_MISMATCH);
  VALUE(TW_ERR_NETWORK);
  VALUE(TW_BF16);
  VALUE(TW_FP16);
  VALUE(TW_FP32);
  VALUE(TW_TILE_ORDER_DEFAULT);
  VALUE(TW_TILE_ORDER_ROW_MAJOR);
  VALUE(TW_TILE_ORDER_ROTATED);
  VALUE(TW_AG_COMM_SM);
  VALUE(TW_AG_COMM_COPY_ENGINE);
  VALUE(TW_AG_COMM_AUTO);
  VALUE(TW_PARTIALS_FP32);
  VALUE(TW_PARTIALS_BF16);

  printf("\n  },\n  \"constants\": {");
  first_item = 1;
  VALUE(TW_VERSION_MAJOR);
  VALUE(TW_VERSION_MINOR);
  VALUE(TW_VERSION_PATCH);
  VALUE(TW_VERSION_CODE);
  VALUE(TW_MAX_WORLD);
  VALUE(TW_UNIQUE_ID_BYTES);
  VALUE(TW_CONFIG_VERSION);
  VALUE(TW_GEMM_ARGS_VERSION);
  VALUE(TW_GEMM_WORKSPACE_BYTES);
  VALUE(TW_GROUPED_GEMM_ARGS_VERSION);
  VALUE(TW_AG_GEMM_ARGS_VERSION);
  VALUE(TW_GEMM_RS_ARGS_VERSION);
  VALUE(TW_MOE_ARGS_VERSION);
  VALUE(TW_ATTENTION_ARGS_VERSION);
  VALUE(TW_ATTENTION_BACKWARD_ARGS_VERSION);
  VALUE(TW_RING_ATTENTION_ARGS_VERSION);
  VALUE(TW_RING_ATTENTION_BACKWARD_ARGS_VERSION);
  VALUE(TW_RING_CONTIGUOUS);
  VALUE(TW_RING_ZIGZAG);
  printf("\n  }\n}\n");
  return 0;
}
