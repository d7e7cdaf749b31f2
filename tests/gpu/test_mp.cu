/*
 * Several processes, one rank each, on the local GPUs (all on GPU 0 when there
 * is one: run under MPS, which scripts/gpu-suite.sh starts). Exercises the TCP
 * bootstrap, the fd exchange of the symmetric heap and the allgather across
 * processes, and tw_ag_gemm, tw_gemm_rs and tw_gemm_ar against their unfused pipelines, bitwise
 * (with a GPU per rank, every other tw_ag_gemm call in the copy-engine mode); then 2 ranks
 * whose TW_RS_BAND differs, where tw_comm_init_rank must fail on both, naming the knob.
 * Usage: test_mp [world=4] [iterations=100].
 */
#include <cuda_runtime.h>

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ref/ref_reduce.h"
#include "tw_test.h"

/* GEMM+ReduceScatter and GEMM+AllReduce across processes: fused == tw_gemm (fp32) per rank
 * + the rank-ordered reduction (tw_ref_reduce_rank between two barriers), bitwise. */
static int check_gemm_rs(tw_comm_t comm, int rank, int world, int iters, cudaStream_t stream) {
  const int64_t m = 96 * (int64_t)world, n = 256, k = 320;
  int failures = 0;
  size_t ws_bytes = 0;
  void *ws = NULL, *partial = NULL, *out_ar_ref = NULL, *a = NULL, *b = NULL, *out = NULL,
       *out_ref = NULL;
  if (tw_gemm_rs_workspace_size(comm, m, n, &ws_bytes) != TW_SUCCESS ||
      (ws_bytes && tw_mem_alloc(comm, ws_bytes, &ws) != TW_SUCCESS) ||
      tw_mem_alloc(comm, (size_t)m * n * 4, &partial) != TW_SUCCESS ||
      tw_mem_alloc(comm, (size_t)m * n * 2, &out_ar_ref) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: gemm_rs setup: %s\n", rank, tw_comm_last_error(comm));
    return 1;
  }
  cudaMalloc(&a, (size_t)m * k * 2);
  cudaMalloc(&b, (size_t)n * k * 2);
  cudaMalloc(&out, (size_t)m * n * 2);
  cudaMalloc(&out_ref, (size_t)m * n * 2);
  const void *peers[TW_MAX_WORLD];
  void *ar_outs[TW_MAX_WORLD];
  for (int s = 0; s < world; s++) {
    void *p = NULL, *q = NULL;
    tw_mem_peer_ptr(comm, partial, s, &p);
    tw_mem_peer_ptr(comm, out_ar_ref, s, &q);
    peers[s] = p;
    ar_outs[s] = q;
  }
  for (int i = 0; i < iters && !failures; i++) {
    for (int all_reduce = 0; all_reduce < 2 && !failures; all_reduce++) {
      tw_test_fill_bf16(a, (size_t)m * k, (uint64_t)i * 131 + rank, (tw_stream_t)stream);
      tw_test_fill_bf16(b, (size_t)n * k, (uint64_t)i * 137 + rank, (tw_stream_t)stream);
      tw_test_poison(out, (size_t)m * n * 2, (tw_stream_t)stream);
      tw_gemm_rs_args_t args = TW_GEMM_RS_ARGS_INIT;
      args.a = a, args.b = b, args.out = out, args.workspace = ws, args.m = m, args.n = n,
      args.k = k;
      tw_status_t st = all_reduce ? tw_gemm_ar(comm, &args, (tw_stream_t)stream)
                                  : tw_gemm_rs(comm, &args, (tw_stream_t)stream);
      /* Reference: fp32 partial per rank, barrier, this rank's share of the ordered sum, barrier.
       */
      tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
      g.c_dtype = TW_FP32, g.a = a, g.b = b, g.c = partial, g.m = m, g.n = n, g.k = k;
      if (st == TW_SUCCESS)
        st = tw_gemm(&g, (tw_stream_t)stream);
      if (st == TW_SUCCESS)
        st = tw_barrier(comm, (tw_stream_t)stream);
      void *outs[TW_MAX_WORLD];
      outs[0] = out_ref;
      cudaError_t ce = st == TW_SUCCESS
                           ? tw_ref_reduce_rank(world, rank, peers, 4, all_reduce ? ar_outs : outs,
                                                all_reduce, m, n, n, 0, stream)
                           : cudaSuccess;
      if (st == TW_SUCCESS)
        st = tw_barrier(comm, (tw_stream_t)stream);
      if (st != TW_SUCCESS || ce != cudaSuccess) {
        fprintf(stderr, "rank %d: gemm_%s iteration %d: %s / %s / %s\n", rank,
                all_reduce ? "ar" : "rs", i, tw_comm_last_error(comm), tw_last_error(),
                cudaGetErrorString(ce));
        failures++;
        break;
      }
      cudaStreamSynchronize(stream);
      const size_t bytes = (size_t)(all_reduce ? m : m / world) * n * 2;
      size_t diff = tw_test_count_diff(out, all_reduce ? out_ar_ref : out_ref, bytes);
      if (diff) {
        fprintf(stderr,
                "rank %d gemm_%s iteration %d: %zu bytes differ from the unfused pipeline\n", rank,
                all_reduce ? "ar" : "rs", i, diff);
        failures++;
      }
    }
  }
  cudaFree(a), cudaFree(b), cudaFree(out), cudaFree(out_ref);
  tw_mem_free(comm, out_ar_ref);
  tw_mem_free(comm, partial);
  if (ws)
    tw_mem_free(comm, ws);
  if (!failures)
    printf("rank %d: %d gemm_rs + gemm_ar iterations ok\n", rank, iters);
  return failures;
}

/* distinct: every rank on a GPU of its own (then every other ag_gemm call takes the copy-engine
 * mode, which needs that). */
static int run_rank(tw_unique_id_t id, int rank, int world, int iters, int device, int distinct) {
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    fprintf(stderr, "rank %d: cudaSetDevice(%d): %s\n", rank, device, cudaGetErrorString(ce));
    return 1;
  }
  tw_comm_t comm;
  /* Odd ranks run on 8 SMs, the others on the default share: every op must work when the
   * ranks' budgets differ (a budget-derived allgather chunking once hung there). */
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.sm_budget = rank % 2 ? 8 : 0;
  tw_status_t st = tw_comm_init_rank(&comm, world, id, rank, &cfg);
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
    if (i % 10 == 0)
      tw_test_poison(recv, bytes * world, (tw_stream_t)stream);
    st = tw_allgather(comm, send, recv, bytes, (tw_stream_t)stream);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "rank %d: allgather: %s\n", rank, tw_comm_last_error(comm));
      failures++;
      break;
    }
    for (int src = 0; src < world; src++)
      tw_test_fill_bytes((char *)expected + src * bytes, bytes, (uint64_t)i * 1000 + src,
                         (tw_stream_t)stream);
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
    if (distinct && i % 2) /* one process per GPU: the copy-engine mode too */
      a.comm_mode = TW_AG_COMM_COPY_ENGINE;
    st = tw_ag_gemm(comm, &a, (tw_stream_t)stream);
    if (st == TW_SUCCESS)
      st = tw_allgather(comm, shard, g2, shard_bytes, (tw_stream_t)stream);
    tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
    g.a = g2, g.b = b, g.c = c2, g.m = m_local * world, g.n = n, g.k = k;
    g.split_k = -1; /* what tw_ag_gemm's GEMM does where it runs unfused (few tiles, long K) */
    tw_comm_sm_budget(comm, &g.sm_count);
    if (st == TW_SUCCESS)
      st = tw_gemm(&g, (tw_stream_t)stream);
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
  if (g1)
    tw_mem_free(comm, g1);
  if (g2)
    tw_mem_free(comm, g2);
  if (!failures)
    failures += check_gemm_rs(comm, rank, world, iters / 4 > 0 ? iters / 4 : 1, stream);
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
         rank, (int)getpid(), budget, local_size, iters, iters / 2, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

/* A rank whose TW_RS_BAND differs (rank 1 sets it): tw_comm_init_rank fails on every rank,
 * naming the knob, instead of a later call waiting on flags or summing partials too early. */
static int run_mismatch(tw_unique_id_t id, int rank, int world, int device) {
  if (cudaSetDevice(device) != cudaSuccess)
    return 1;
  if (rank == 1)
    setenv("TW_RS_BAND", "3", 1);
  tw_comm_t comm = NULL;
  const tw_status_t st = tw_comm_init_rank(&comm, world, id, rank, NULL);
  const char *why = tw_last_error();
  if (st == TW_ERR_INVALID_ARGUMENT && why &&
      strstr(why, "TW_RS_BAND is 0 on rank 0 but 3 on rank 1")) {
    printf("rank %d: init refused as expected: %s\n", rank, why);
    return 0;
  }
  fprintf(stderr, "rank %d: init with TW_RS_BAND set on rank 1 only: status %d (%s)\n", rank,
          (int)st, why ? why : "");
  if (comm)
    tw_comm_destroy(comm);
  return 1;
}

/* Forks `world` ranks running fn and waits for them (killed after 240 s). */
static void run_ranks(int world, int ngpus, int (*fn)(tw_unique_id_t, int, int, int, void *),
                      void *arg) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_get_unique_id(&id));
  pid_t pids[TW_MAX_WORLD];
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      const int rc = fn(id, r, world, r % ngpus, arg);
      fflush(NULL); /* _exit does not flush: the rank's lines were lost where stdout is a file */
      _exit(rc);
    }
  }
  int st[TW_MAX_WORLD];
  const int killed = tw_test_wait_children(pids, world, 240, st, "rank");
  TEST_ASSERT(killed == 0, "%d rank(s) did not finish within 240 s: killed", killed);
  for (int r = 0; r < world; r++)
    TEST_ASSERT(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "rank %d exited with status %d", r,
                st[r]);
}

typedef struct {
  int iters, own_gpu;
} main_args_t;

static int main_rank(tw_unique_id_t id, int rank, int world, int device, void *arg) {
  const main_args_t *a = (const main_args_t *)arg;
  return run_rank(id, rank, world, a->iters, device, a->own_gpu);
}

static int mismatch_rank(tw_unique_id_t id, int rank, int world, int device, void *arg) {
  (void)arg;
  return run_mismatch(id, rank, world, device);
}

int main(int argc, char **argv) {
  setenv("CUDA_MODULE_LOADING", "EAGER",
         0); /* the ranks' own kernels: see tw_test_require_hopper */
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
  main_args_t args = {iters, world <= ngpus};
  run_ranks(world, ngpus, main_rank, &args);
  run_ranks(2, ngpus, mismatch_rank, NULL);
  return tw_test_finish();
}
