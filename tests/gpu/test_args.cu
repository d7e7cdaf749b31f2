/*
 * Bad pointer arguments are refused before anything is enqueued, with TW_ERR_INVALID_ARGUMENT
 * and a message naming the argument, and the CUDA context survives them: pageable host
 * memory, freed memory, a buffer smaller than the shapes make it, and outputs that overlap an
 * input or the workspace, for tw_gemm, tw_allgather, tw_ag_gemm and tw_gemm_rs / tw_gemm_ar on
 * 2 ranks (virtual ranks on one GPU). After the refusals the same calls with good arguments run
 * on both ranks and the device synchronises without error, so no refused call left a rank out
 * of step. Exit 77 without a Hopper GPU.
 */
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include "tw_test.h"

enum { kWorld = 2, M = 256, N = 128, K = 128 }; /* c and a the same size: aliases fit */

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  TEST_REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess, "cudaMalloc(%zu)", bytes);
  TEST_REQUIRE(cudaMemset(p, 0, bytes) == cudaSuccess, "cudaMemset");
  return p;
}

static void context_alive(const char *after) {
  TEST_ASSERT(cudaGetLastError() == cudaSuccess, "a CUDA error is left after %s", after);
  TEST_ASSERT(cudaDeviceSynchronize() == cudaSuccess, "the context failed after %s", after);
}

static void gemm_cases(cudaStream_t s) {
  void *a = dev_alloc((size_t)M * K * 2), *b = dev_alloc((size_t)N * K * 2);
  void *c = dev_alloc((size_t)M * N * 2), *small = dev_alloc((size_t)M * N);
  void *freed = dev_alloc((size_t)M * K * 2);
  cudaFree(freed);
  void *host = aligned_alloc(256, (size_t)M * K * 2);
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.a = a, g.b = b, g.c = c, g.m = M, g.n = N, g.k = K;
  tw_gemm_args_t bad = g;
  bad.a = host;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)s), TW_ERR_INVALID_ARGUMENT, "tw_gemm: a");
  bad = g, bad.b = freed;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)s), TW_ERR_INVALID_ARGUMENT, "tw_gemm: b");
  bad = g, bad.c = small;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)s), TW_ERR_INVALID_ARGUMENT, "tw_gemm: c");
  bad = g, bad.c = a; /* out aliasing an input */
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)s), TW_ERR_INVALID_ARGUMENT, "overlaps a");
  context_alive("tw_gemm's refusals");
  TEST_TW_OK(tw_gemm(&g, (tw_stream_t)s));
  context_alive("tw_gemm");
  free(host);
  cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(small);
}

int main(void) {
  tw_test_require_hopper();
  int devices[kWorld] = {0, 0};
  tw_comm_t comms[kWorld];
  tw_config_t cfg = TW_CONFIG_INIT;
  TEST_REQUIRE(tw_comm_init_all(comms, kWorld, devices, &cfg) == TW_SUCCESS, "%s", tw_last_error());
  cudaStream_t streams[kWorld];
  for (int r = 0; r < kWorld; r++)
    TEST_REQUIRE(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking) == cudaSuccess,
                 "stream");
  gemm_cases(streams[0]);

  /* symmetric buffers and plain operands for the collectives */
  const size_t shard = (size_t)(M / kWorld) * K * 2;
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_gemm_rs_workspace_size(comms[0], M, N, &ws_bytes));
  void *recv[kWorld], *gathered[kWorld], *ws[kWorld], *send[kWorld], *a[kWorld], *b[kWorld],
      *c[kWorld], *out[kWorld];
  for (int r = 0; r < kWorld; r++) {
    TEST_TW_OK(tw_mem_alloc(comms[r], shard * kWorld, &recv[r]));
    TEST_TW_OK(tw_mem_alloc(comms[r], shard * kWorld, &gathered[r]));
    TEST_TW_OK(tw_mem_alloc(comms[r], ws_bytes, &ws[r]));
    send[r] = dev_alloc(shard);
    a[r] = dev_alloc((size_t)M * K * 2);
    b[r] = dev_alloc((size_t)N * K * 2);
    c[r] = dev_alloc((size_t)M * N * 2);
    out[r] = dev_alloc((size_t)M * N * 2);
  }
  void *host = aligned_alloc(256, (size_t)M * N * 2);
  void *small = dev_alloc(64);

  /* tw_allgather: send must be device memory as large as bytes */
  TEST_TW_FAILS(tw_allgather(comms[0], host, recv[0], shard, (tw_stream_t)streams[0]),
                TW_ERR_INVALID_ARGUMENT, "send");
  TEST_TW_FAILS(tw_allgather(comms[0], small, recv[0], shard, (tw_stream_t)streams[0]),
                TW_ERR_INVALID_ARGUMENT, "send");
  context_alive("tw_allgather's refusals");

  /* tw_ag_gemm */
  tw_ag_gemm_args_t ag[kWorld];
  for (int r = 0; r < kWorld; r++) {
    tw_ag_gemm_args_t x = TW_AG_GEMM_ARGS_INIT;
    x.a = send[r], x.b = b[r], x.c = c[r], x.a_gathered = gathered[r];
    x.m_local = M / kWorld, x.n = N, x.k = K;
    ag[r] = x;
  }
  tw_ag_gemm_args_t bad = ag[0];
  bad.b = host;
  TEST_TW_FAILS(tw_ag_gemm(comms[0], &bad, (tw_stream_t)streams[0]), TW_ERR_INVALID_ARGUMENT,
                "args->b");
  bad = ag[0], bad.c = small;
  TEST_TW_FAILS(tw_ag_gemm(comms[0], &bad, (tw_stream_t)streams[0]), TW_ERR_INVALID_ARGUMENT,
                "args->c");
  bad = ag[0], bad.c = gathered[0]; /* the output over the gathered input */
  TEST_TW_FAILS(tw_ag_gemm(comms[0], &bad, (tw_stream_t)streams[0]), TW_ERR_INVALID_ARGUMENT,
                "overlaps");
  context_alive("tw_ag_gemm's refusals");

  /* tw_gemm_rs / tw_gemm_ar */
  tw_gemm_rs_args_t rs[kWorld];
  for (int r = 0; r < kWorld; r++) {
    tw_gemm_rs_args_t x = TW_GEMM_RS_ARGS_INIT;
    x.a = a[r], x.b = b[r], x.out = out[r], x.workspace = ws[r];
    x.m = M, x.n = N, x.k = K;
    rs[r] = x;
  }
  tw_gemm_rs_args_t bad_rs = rs[0];
  bad_rs.a = host; /* a pageable host pointer: refused, not an illegal address in the kernel */
  TEST_TW_FAILS(tw_gemm_rs(comms[0], &bad_rs, (tw_stream_t)streams[0]), TW_ERR_INVALID_ARGUMENT,
                "args->a");
  bad_rs = rs[0], bad_rs.out = small;
  TEST_TW_FAILS(tw_gemm_ar(comms[0], &bad_rs, (tw_stream_t)streams[0]), TW_ERR_INVALID_ARGUMENT,
                "args->out");
  bad_rs = rs[0], bad_rs.out = (void *)rs[0].a; /* out aliasing a */
  TEST_TW_FAILS(tw_gemm_rs(comms[0], &bad_rs, (tw_stream_t)streams[0]), TW_ERR_INVALID_ARGUMENT,
                "overlaps a");
  bad_rs = rs[0], bad_rs.out = ws[0]; /* out inside the workspace */
  TEST_TW_FAILS(tw_gemm_ar(comms[0], &bad_rs, (tw_stream_t)streams[0]), TW_ERR_INVALID_ARGUMENT,
                "workspace");
  context_alive("tw_gemm_rs's refusals");

  /* the good calls on every rank: nothing above left a rank out of step */
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_allgather(comms[r], send[r], recv[r], shard, (tw_stream_t)streams[r]));
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_ag_gemm(comms[r], &ag[r], (tw_stream_t)streams[r]));
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_gemm_rs(comms[r], &rs[r], (tw_stream_t)streams[r]));
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_gemm_ar(comms[r], &rs[r], (tw_stream_t)streams[r]));
  tw_test_sync_devices(devices, kWorld);
  for (int r = 0; r < kWorld; r++) {
    tw_status_t async = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "rank %d: async error %s (%s)", r, tw_status_string(async),
                tw_comm_last_error(comms[r]));
  }
  free(host);
  for (int r = 0; r < kWorld; r++)
    tw_comm_destroy(comms[r]);
  return tw_test_finish();
}
