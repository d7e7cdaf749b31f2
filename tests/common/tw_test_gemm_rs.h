/*
 * Checks of tw_gemm_rs and tw_gemm_ar on virtual ranks of one process (tests/common/
 * tw_test_gemm_rs.cu), for the CUDA tests test_gemm_rs.cu and test_gemm_rs_unfused.cu. Each
 * call builds a comm of `world` ranks (on GPU 0, or with TW_TEST_DEVICES=distinct rank r on GPU
 * r % (number of GPUs)) and checks the fused output bitwise against the unfused pipeline built
 * from the same core (tw_gemm per rank with fp32 output, bf16 with bf16 partials, then the
 * rank-ordered fp32 reduction of src/ref/ref_reduce.cu). The knobs are read from the
 * environment as each call is enqueued: set them around a check.
 */
#ifndef TW_TEST_GEMM_RS_H
#define TW_TEST_GEMM_RS_H

#include <stdint.h>

/* tw_partials_t of every call (fused args and the unfused pipeline); TW_PARTIALS_FP32 unless
 * set. */
extern int rs_partials;

/* One shape of both ops (m = m_local x world rows): bitwise the unfused pipeline, and within
 * bf16 tolerance of the fp32 reference (tw_ref_gemm_fp32 summed over ranks, on rank 0's GPU). */
void rs_test_case(int world, int64_t m_local, int64_t n, int64_t k, int reduce_sms, uint64_t seed);
/* `calls` calls with fresh inputs, rs and ar alternating, no host sync in between, each checked
 * on the GPU against the unfused pipeline; n = k = 256 (m_local 200 for rs_test_back_to_back). */
void rs_test_back_to_back_at(int world, int calls, int64_t m_local, uint64_t seed);
void rs_test_back_to_back(int world, int calls, uint64_t seed);
/* tw_gemm_ar calls of changing shapes on one comm (n 256, 2048, 256). */
void rs_test_shape_changes(int world, uint64_t seed);
/* The unfused pipeline and the fused kernel in turn on one comm and workspace. */
void rs_test_unfused_mixed(int world, int calls, uint64_t seed);
/* `replays` replays of a CUDA graph of tw_gemm_rs then tw_gemm_ar (ranks of one GPU only). */
void rs_test_graph(int world, int replays, uint64_t seed);
/* The argument errors of both ops, then valid calls that still complete. */
void rs_test_bad_arguments(void);

/* A knob setting (name = value; name NULL: none), optionally with bands of `band` column blocks
 * (TW_RS_BAND) and with bf16 partials: rs_test_case on worlds 2, 3, 4, 8 (the first shape
 * always, the others unless --small), back-to-back calls, optionally a graph replay; then
 * unset. */
typedef struct {
  const char *name, *value;
  const char *band; /* TW_RS_BAND for the cases, or NULL */
  int partials;     /* tw_partials_t of the cases */
  struct {
    int64_t m_local, n, k;
    int reduce_sms;
  } shapes[3];
  uint64_t seed_step;
  int b2b_world; /* then 200 back-to-back calls on this world (20 on 2 with --small) */
  int graph;     /* and a graph replay test */
} rs_env_cases_t;

void rs_run_env_cases(const rs_env_cases_t *c, int small, uint64_t seed);

#endif
