/*
 * The inter-node path across processes: 4 processes, one rank each, as 2 virtual nodes x 2
 * (TW_RANKS_PER_NODE), on the local GPUs (all on GPU 0 when there is one: run under MPS, which
 * scripts/gpu-suite.sh starts), over the verbs test double, whose NIC instances in the four
 * processes share one fabric file. tw_allgather and tw_ag_gemm take the rail path: the RDMA
 * writes leave one process's GPU memory and land in another's. Every process fills every rank's
 * shard from the rank's seed, so it builds the gathered A and tw_gemm's C of it (the same core)
 * on its own: the fused C must equal it bitwise, both gathered A's the shards, over several calls
 * with fresh inputs. tw_gemm_rs and tw_gemm_ar likewise: every process builds every rank's
 * partial with tw_gemm and their sum in the rail path's order (tw_test_rail_sum_bf16), which
 * every rank's out must equal bitwise. Then ranks whose TW_NET differs (rank 0 ib, the others efa,
 * on a host with NICs of both kinds): every rank's tw_comm_init_rank fails, and those that see each
 * other's choice name both. Usage: test_mp_nodes [iterations=20].
 */
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tw_test.h"

#ifndef TW_VERBS_DOUBLE
int main(void) {
  printf("built without rdma-core's headers: no inter-node backend to test\n");
  return 77;
}
#else

enum { kWorld = 4, kPerNode = 2 };
static const int64_t kMLocal = 320, kN = 512, kK = 384;

/* tw_gemm_rs then tw_gemm_ar, `iters` times with fresh inputs, against the rail-order sum of
 * every rank's tw_gemm partial (built here from the ranks' seeds). Returns the failures. */
static int run_rs(tw_comm_t comm, int rank, int iters, cudaStream_t s) {
  const int64_t m = kMLocal * kWorld;
  const size_t mn = (size_t)m * kN;
  size_t ws_bytes = 0;
  void *ws = NULL, *a = NULL, *b = NULL, *part = NULL, *out = NULL;
  if (tw_gemm_rs_workspace_size(comm, m, kN, &ws_bytes) != TW_SUCCESS ||
      tw_mem_alloc(comm, ws_bytes, &ws) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: workspace: %s\n", rank, tw_comm_last_error(comm));
    return 1;
  }
  cudaMalloc(&a, (size_t)m * kK * 2), cudaMalloc(&b, (size_t)kN * kK * 2);
  cudaMalloc(&part, mn * 4), cudaMalloc(&out, mn * 2);
  float *parts = (float *)malloc(mn * 4 * kWorld);
  uint16_t *ref = (uint16_t *)malloc(mn * 2), *got = (uint16_t *)malloc(mn * 2);
  int failures = 0;
  for (int it = 0; it < iters && !failures; it++) {
    const uint64_t seed = 5000 + 7919 * (uint64_t)it;
    for (int r = 0; r < kWorld; r++) { /* every rank's partial, as that rank computes it */
      tw_test_fill_bf16(a, (size_t)m * kK, seed + 31 * r, (tw_stream_t)s);
      tw_test_fill_bf16(b, (size_t)kN * kK, seed + 7 + r, (tw_stream_t)s);
      tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
      g.c_dtype = TW_FP32;
      g.a = a, g.b = b, g.c = part;
      g.m = m, g.n = kN, g.k = kK;
      tw_comm_sm_budget(comm, &g.sm_count);
      if (tw_gemm(&g, (tw_stream_t)s) != TW_SUCCESS)
        failures++;
      cudaMemcpyAsync(parts + (size_t)r * mn, part, mn * 4, cudaMemcpyDeviceToHost, s);
      cudaStreamSynchronize(s);
    }
    tw_test_rail_sum_bf16(parts, kWorld, kPerNode, mn, ref);
    tw_test_fill_bf16(a, (size_t)m * kK, seed + 31 * rank, (tw_stream_t)s);
    tw_test_fill_bf16(b, (size_t)kN * kK, seed + 7 + rank, (tw_stream_t)s);
    for (int ar = 0; ar < 2 && !failures; ar++) {
      tw_test_poison(out, mn * 2, (tw_stream_t)s);
      tw_gemm_rs_args_t args = TW_GEMM_RS_ARGS_INIT;
      args.a = a, args.b = b, args.out = out, args.workspace = ws;
      args.m = m, args.n = kN, args.k = kK;
      const tw_status_t st =
          ar ? tw_gemm_ar(comm, &args, (tw_stream_t)s) : tw_gemm_rs(comm, &args, (tw_stream_t)s);
      const size_t rows = ar ? (size_t)m : (size_t)kMLocal;
      /* the call first: a copy into pageable memory queued behind it would hold the driver's
       * staging, which the double's own copies (the NIC's DMA) need while the call runs */
      cudaStreamSynchronize(s);
      cudaMemcpy(got, out, rows * kN * 2, cudaMemcpyDeviceToHost);
      const uint16_t *want = ref + (ar ? 0 : (size_t)rank * kMLocal * kN);
      size_t diff = 0;
      for (size_t i = 0; i < rows * kN; i++)
        diff += got[i] != want[i];
      tw_status_t async = TW_SUCCESS;
      tw_comm_async_error(comm, &async);
      if (st != TW_SUCCESS || diff || async != TW_SUCCESS) {
        fprintf(stderr, "rank %d call %d: tw_gemm_%s: %s, %zu elements differ\n", rank, it,
                ar ? "ar" : "rs", st || async ? tw_comm_last_error(comm) : "ok", diff);
        failures++;
      }
    }
  }
  free(parts), free(ref), free(got);
  cudaFree(a), cudaFree(b), cudaFree(part), cudaFree(out);
  tw_mem_free(comm, ws);
  return failures;
}

static int run_rank(tw_unique_id_t id, int rank, int iters, int device) {
  cudaSetDevice(device);
  tw_comm_t comm = NULL;
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = kPerNode;
  if (tw_comm_init_rank(&comm, kWorld, id, rank, &cfg) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: init: %s\n", rank, tw_last_error());
    return 1;
  }
  const size_t shard = (size_t)kMLocal * kK * 2, all = shard * kWorld;
  const size_t c_bytes = (size_t)kMLocal * kWorld * kN * 2;
  void *gathered = NULL, *gathered2 = NULL, *ref = NULL, *a = NULL, *b = NULL, *c = NULL,
       *c_ref = NULL;
  if (tw_mem_alloc(comm, all, &gathered) != TW_SUCCESS ||
      tw_mem_alloc(comm, all, &gathered2) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: alloc: %s\n", rank, tw_comm_last_error(comm));
    return 1;
  }
  cudaMalloc(&ref, all), cudaMalloc(&a, shard), cudaMalloc(&b, (size_t)kN * kK * 2);
  cudaMalloc(&c, c_bytes), cudaMalloc(&c_ref, c_bytes);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int failures = 0;
  for (int it = 0; it < iters && !failures; it++) {
    const uint64_t seed = 1000 + 7919 * (uint64_t)it;
    for (int r = 0; r < kWorld; r++) /* every rank's shard, as that rank fills it */
      tw_test_fill_bf16((char *)ref + shard * r, (size_t)kMLocal * kK, seed + 31 * r,
                        (tw_stream_t)s);
    tw_test_fill_bf16(a, (size_t)kMLocal * kK, seed + 31 * rank, (tw_stream_t)s);
    tw_test_fill_bf16(b, (size_t)kN * kK, seed + 5 + rank, (tw_stream_t)s);
    tw_test_poison(gathered, all, (tw_stream_t)s);
    tw_test_poison(gathered2, all, (tw_stream_t)s);
    tw_test_poison(c, c_bytes, (tw_stream_t)s);
    tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
    g.a = ref, g.b = b, g.c = c_ref;
    g.m = kMLocal * kWorld, g.n = kN, g.k = kK;
    tw_comm_sm_budget(comm, &g.sm_count);
    tw_ag_gemm_args_t args = TW_AG_GEMM_ARGS_INIT;
    args.a = a, args.b = b, args.c = c, args.a_gathered = gathered;
    args.m_local = kMLocal, args.n = kN, args.k = kK;
    if (tw_gemm(&g, (tw_stream_t)s) != TW_SUCCESS ||
        tw_ag_gemm(comm, &args, (tw_stream_t)s) != TW_SUCCESS ||
        tw_allgather(comm, a, gathered2, shard, (tw_stream_t)s) != TW_SUCCESS) {
      fprintf(stderr, "rank %d call %d: %s\n", rank, it, tw_comm_last_error(comm));
      failures++;
      break;
    }
    cudaStreamSynchronize(s);
    const size_t dc = tw_test_count_diff(c, c_ref, c_bytes);
    const size_t dg = tw_test_count_diff(gathered, ref, all);
    const size_t dg2 = tw_test_count_diff(gathered2, ref, all);
    tw_status_t async = TW_SUCCESS;
    tw_comm_async_error(comm, &async);
    if (dc || dg || dg2 || async != TW_SUCCESS) {
      fprintf(stderr,
              "rank %d call %d: C differs in %zu bytes, gathered A in %zu, tw_allgather's "
              "in %zu; async: %s\n",
              rank, it, dc, dg, dg2, async ? tw_comm_last_error(comm) : "none");
      failures++;
    }
  }
  if (!failures)
    failures += run_rs(comm, rank, iters, s);
  if (!failures)
    printf("rank %d: %d calls of tw_ag_gemm, tw_allgather, tw_gemm_rs and tw_gemm_ar across "
           "processes: equal\n",
           rank, iters);
  cudaStreamDestroy(s);
  cudaFree(ref), cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(c_ref);
  tw_mem_free(comm, gathered), tw_mem_free(comm, gathered2);
  tw_comm_destroy(comm);
  return failures ? 1 : 0;
}

/* Rank 0 on ib, the others on efa: init fails everywhere, within the bootstrap's bound. */
static int run_disagree(tw_unique_id_t id, int rank, int device) {
  cudaSetDevice(device);
  setenv("TW_NET", rank == 0 ? "ib" : "efa", 1);
  tw_comm_t comm = NULL;
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = kPerNode;
  cfg.bootstrap_timeout_ms = 20000;
  const tw_status_t st = tw_comm_init_rank(&comm, kWorld, id, rank, &cfg);
  if (st == TW_SUCCESS) {
    fprintf(stderr, "rank %d: init passed with ranks on different transports\n", rank);
    tw_comm_destroy(comm);
    return 1;
  }
  /* ranks 0 and 2 are rails of each other: each sees the other's backend */
  if ((rank == 0 || rank == 2) &&
      !strstr(tw_last_error(), "disagree on the inter-node transport")) {
    fprintf(stderr, "rank %d: init failed, but not naming the disagreement: %s\n", rank,
            tw_last_error());
    return 1;
  }
  printf("rank %d: init refused: %s\n", rank, tw_last_error());
  return 0;
}

/* Forks the 4 ranks running fn (its arg: the iterations); every one must exit 0 within 240 s. */
static void run_ranks(tw_test_rank_fn fn, int iters, int ngpus, const char *what) {
  int st[kWorld];
  const int killed = tw_test_fork_ranks(kWorld, ngpus, fn, &iters, 240, st);
  TEST_ASSERT(killed == 0, "%s: %d rank(s) did not finish within 240 s", what, killed);
  for (int r = 0; r < kWorld; r++)
    TEST_ASSERT(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "%s: rank %d exited with %d", what, r,
                st[r]);
}

/* The rank bodies, as tw_test_fork_ranks calls them. */
static int rail_rank(tw_unique_id_t id, int rank, int world, int device, void *arg) {
  (void)world;
  return run_rank(id, rank, *(const int *)arg, device);
}

static int disagree_rank(tw_unique_id_t id, int rank, int world, int device, void *arg) {
  (void)world, (void)arg;
  return run_disagree(id, rank, device);
}

int main(int argc, char **argv) {
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  const int iters = argc > 1 ? atoi(argv[1]) : 20;
  tw_test_use_verbs_double(TW_VERBS_DOUBLE, "mlx5:4");
  /* CUDA must not start in the parent before fork: probe in a child */
  pid_t probe = fork();
  if (probe == 0) {
    const int n = tw_test_require_hopper();
    _exit(n > 0 && n < 100 ? n : 1);
  }
  int status = 0;
  waitpid(probe, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 77) {
    printf("SKIP: no Hopper GPU\n");
    return 77;
  }
  const int ngpus = WEXITSTATUS(status);
  if (ngpus < kWorld && !getenv("CUDA_MPS_PIPE_DIRECTORY") && !getenv("TW_TEST_ALLOW_NO_MPS")) {
    printf("SKIP: %d processes would share %d GPU(s) without MPS (start MPS as "
           "scripts/gpu-suite.sh does, or set TW_TEST_ALLOW_NO_MPS=1)\n",
           kWorld, ngpus);
    return 77;
  }
  const char *backends[] = {"ib", "efa"};
  const char *nics[] = {"mlx5:4", "efa:8"};
  for (int b = 0; b < 2; b++) {
    setenv("TW_NET", backends[b], 1);
    setenv("TW_VD_NICS", nics[b], 1);
    run_ranks(rail_rank, iters, ngpus, backends[b]);
  }
  setenv("TW_VD_NICS", "mlx5:4,efa:8", 1);
  run_ranks(disagree_rank, 0, ngpus, "disagreeing transports");
  return tw_test_finish();
}
#endif
