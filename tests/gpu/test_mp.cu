/*
 * Several processes, one rank each, on the local GPUs (all on GPU 0 when there
 * is one: run under MPS, which scripts/gpu-suite.sh starts). Exercises the TCP
 * bootstrap, the fd exchange of the symmetric heap and the allgather across
 * processes, and tw_ag_gemm against the unfused pipeline (tw_allgather, then tw_gemm), bitwise.
 * Usage: test_mp [world=4] [iterations=100].
 */
#include <cuda_runtime.h>

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tw_test.h"

static int run_rank(tw_unique_id_t id, int rank, int world, int iters, int device) {
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    fprintf(stderr, "rank %d: cudaSetDevice(%d): %s\n", rank, device, cudaGetErrorString(ce));
    return 1;
  }
  tw_comm_t comm;
  tw_status_t st = tw_comm_init_rank(&comm, world, id, rank, NULL);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "rank %d: init: %s: %s\n", rank, tw_status_string(st), tw_last_error());
    return 1;
  }
  int budget = 0, local_size = 0;
  tw_comm_sm_budget(comm, &budget);
  tw_comm_local_size(comm, &local_size);
  const size_t bytes = (1u << 20) + 48;
  void *recv = NULL, *send = NULL, *expected = NULL;
  int failures = 0;
  if (tw_mem_alloc(comm, bytes * world, &recv) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: alloc: %s\n", rank, tw_comm_last_error(comm));
    return 1;
  }
  cudaMalloc(&send, bytes);
  cudaMalloc(&expected, bytes * world);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  for (int i = 0; i < iters; i++) {
    tw_test_fill_bytes(send, bytes, (uint64_t)i * 1000 + rank, (tw_stream_t)stream);
    if (i % 10 == 0) tw_test_poison(recv, bytes * world, (tw_stream_t)stream);
    st = tw_allgather(comm, send, recv, bytes, (tw_stream_t)stream);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "rank %d: allgather: %s\n", rank, tw_comm_last_error(comm));
      failures++;
      break;
    }
    for (int src = 0; src < world; src++)
      tw_test_fill_bytes((char *)expected + src * bytes, bytes, (uint64_t)i * 1000 + src, (tw_stream_t)stream);
    cudaStreamSynchronize(stream);
    size_t diff = tw_test_count_diff(recv, expected, bytes * world);
    if (diff) {
      fprintf(stderr, "rank %d iteration %d: %zu bytes differ\n", rank, i, diff);
      failures++;
      break;
    }
  }
  /* AllGather+GEMM: fused == tw_allgather + tw_gemm, bitwise, with fresh inputs each time. */
  const int64_t m_local = 200, n = 256, k = 512;
  void *g1 = NULL, *g2 = NULL, *shard = NULL, *b = NULL, *c1 = NULL, *c2 = NULL;
  const size_t shard_bytes = (size_t)m_local * k * 2, c_bytes = (size_t)m_local * world * n * 2;
  if (tw_mem_alloc(comm, shard_bytes * world, &g1) != TW_SUCCESS ||
      tw_mem_alloc(comm, shard_bytes * world, &g2) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: alloc: %s\n", rank, tw_comm_last_error(comm));
    failures++;
  }
  cudaMalloc(&shard, shard_bytes);
  cudaMalloc(&b, (size_t)n * k * 2);
  cudaMalloc(&c1, c_bytes);
  cudaMalloc(&c2, c_bytes);
  for (int i = 0; i < iters / 2 && !failures; i++) {
    tw_test_fill_bf16(shard, (size_t)m_local * k, (uint64_t)i * 77 + rank, (tw_stream_t)stream);
    tw_test_fill_bf16(b, (size_t)n * k, (uint64_t)i * 91 + rank, (tw_stream_t)stream);
    tw_test_poison(c1, c_bytes, (tw_stream_t)stream);
    tw_ag_gemm_args_t a = TW_AG_GEMM_ARGS_INIT;
    a.a = shard, a.b = b, a.c = c1, a.a_gathered = g1, a.m_local = m_local, a.n = n, a.k = k;
    st = tw_ag_gemm(comm, &a, (tw_stream_t)stream);
    if (st == TW_SUCCESS) st = tw_allgather(comm, shard, g2, shard_bytes, (tw_stream_t)stream);
    tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
    g.a = g2, g.b = b, g.c = c2, g.m = m_local * world, g.n = n, g.k = k;
    tw_comm_sm_budget(comm, &g.sm_count);
    if (st == TW_SUCCESS) st = tw_gemm(&g, (tw_stream_t)stream);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "rank %d: ag_gemm iteration %d: %s / %s\n", rank, i, tw_comm_last_error(comm),
              tw_last_error());
      failures++;
      break;
    }
    cudaStreamSynchronize(stream);
    size_t diff = tw_test_count_diff(c1, c2, c_bytes);
    if (diff) {
      fprintf(stderr, "rank %d ag_gemm iteration %d: %zu bytes differ from the unfused pipeline\n",
              rank, i, diff);
      failures++;
    }
  }
  cudaFree(shard), cudaFree(b), cudaFree(c1), cudaFree(c2);
  if (g1) tw_mem_free(comm, g1);
  if (g2) tw_mem_free(comm, g2);
  tw_status_t async = TW_SUCCESS;
  tw_comm_async_error(comm, &async);
  if (async != TW_SUCCESS) {
    fprintf(stderr, "rank %d: async error: %s\n", rank, tw_comm_last_error(comm));
    failures++;
  }
  ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    fprintf(stderr, "rank %d: %s\n", rank, cudaGetErrorString(ce));
    failures++;
  }
  tw_mem_free(comm, recv);
  tw_comm_destroy(comm);
  printf("rank %d (pid %d, sm budget %d, %d ranks on this host): %d allgather + %d ag_gemm "
         "iterations, %s\n",
         rank,
         (int)getpid(), budget, local_size, iters, iters / 2, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

int main(int argc, char **argv) {
  setenv("CUDA_MODULE_LOADING", "EAGER", 0); /* the ranks' own kernels: see tw_test_require_hopper */
  int world = argc > 1 ? atoi(argv[1]) : 4;
  int iters = argc > 2 ? atoi(argv[2]) : 100;
  /* Probe the GPU in a child: CUDA must not be initialised in the parent before fork. */
  pid_t probe = fork();
  if (probe == 0) {
    int n = tw_test_require_hopper();
    _exit(n > 0 && n < 100 ? n : 1);
  }
  int status = 0;
  waitpid(probe, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 77) {
    printf("SKIP: no Hopper GPU\n");
    return 77;
  }
  int ngpus = WEXITSTATUS(status);
  if (ngpus < world && !getenv("CUDA_MPS_PIPE_DIRECTORY") && !getenv("TW_TEST_ALLOW_NO_MPS")) {
    printf("SKIP: %d processes would share %d GPU(s) without MPS (start MPS as "
           "scripts/gpu-suite.sh does, or set TW_TEST_ALLOW_NO_MPS=1)\n",
           world, ngpus);
    return 77;
  }
  tw_unique_id_t id;
  TEST_TW_OK(tw_get_unique_id(&id));
  pid_t pids[TW_MAX_WORLD];
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    if (pids[r] == 0) _exit(run_rank(id, r, world, iters, r % ngpus));
  }
  double deadline = tw_test_now() + 240;
  for (int r = 0; r < world; r++) {
    int st = 0;
    pid_t got;
    while ((got = waitpid(pids[r], &st, WNOHANG)) == 0 && tw_test_now() < deadline) usleep(10000);
    if (got == 0) {
      for (int k = 0; k < world; k++) kill(pids[k], SIGKILL);
      TEST_ASSERT(0, "rank %d did not finish within 240 s: killed", r);
      break;
    }
    TEST_ASSERT(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %d exited with status %d", r, st);
  }
  return tw_test_finish();
}
