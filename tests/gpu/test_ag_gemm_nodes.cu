/*
 * tw_ag_gemm across nodes, on virtual nodes of one GPU (tw_config.ranks_per_node) over the verbs
 * test double: the rail path sends each shard by RDMA through the ranks' proxies and the ib (RC)
 * or efa (SRD) backend to the rail peers, and forwards over NVLink inside the node. For layouts
 * 2x2, 2x4, 3x2 and 4x2 (nodes x ranks per node) and shapes with tails, the fused C equals,
 * bitwise, tw_gemm (the same core) of the shards gathered by plain copies, the gathered A equals
 * the shards, tw_allgather across nodes (the unfused pipeline's half, the same rail gather
 * without the GEMM) gathers them alike, C is within bf16 tolerance of an fp32 reference;
 * back-to-back calls with fresh inputs each checked on the GPU; a CUDA graph replay; refusals of
 * what the rail path does not serve. 77 without a Hopper GPU or without the double (built with
 * rdma-core's headers).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>
#include <unistd.h>

#include "ref/ref_gemm.h"
#include "tw_test.h"

#ifndef TW_VERBS_DOUBLE
int main(void) {
  printf("built without rdma-core's headers: no inter-node backend to test\n");
  return 77;
}
#else

typedef struct {
  int world, per_node;
  int64_t m_local, n, k;
  tw_dtype_t c_dtype;
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *a[TW_MAX_WORLD], *gathered[TW_MAX_WORLD], *b[TW_MAX_WORLD], *c[TW_MAX_WORLD];
  void *ref_gathered, *c2[TW_MAX_WORLD];
  void *gathered2[TW_MAX_WORLD]; /* tw_allgather's */
  unsigned long long *bad;
} fixture;

static size_t c_bytes(const fixture *f) {
  return (size_t)f->m_local * f->world * f->n * (f->c_dtype == TW_BF16 ? 2 : 4);
}

static size_t shard_bytes(const fixture *f) { return (size_t)f->m_local * f->k * 2; }

static void setup(fixture *f, int nodes, int per_node, int64_t m_local, int64_t n, int64_t k,
                  tw_dtype_t c_dtype) {
  memset(f, 0, sizeof(*f));
  f->world = nodes * per_node, f->per_node = per_node;
  f->m_local = m_local, f->n = n, f->k = k, f->c_dtype = c_dtype;
  int devices[TW_MAX_WORLD] = {0};
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = per_node;
  tw_status_t st = tw_comm_init_all(f->comms, f->world, devices, &cfg);
  TEST_REQUIRE(st == TW_SUCCESS, "init_all(%dx%d): %s", nodes, per_node, tw_last_error());
  for (int r = 0; r < f->world; r++) {
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&f->streams[r], cudaStreamNonBlocking));
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], shard_bytes(f) * f->world, &f->gathered[r]) ==
                     TW_SUCCESS,
                 "alloc: %s", tw_comm_last_error(f->comms[r]));
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], shard_bytes(f) * f->world, &f->gathered2[r]) ==
                     TW_SUCCESS,
                 "alloc: %s", tw_comm_last_error(f->comms[r]));
    TEST_CUDA_OK(cudaMalloc(&f->a[r], shard_bytes(f)));
    TEST_CUDA_OK(cudaMalloc(&f->b[r], (size_t)n * k * 2));
    TEST_CUDA_OK(cudaMalloc(&f->c[r], c_bytes(f)));
    TEST_CUDA_OK(cudaMalloc(&f->c2[r], c_bytes(f)));
  }
  TEST_CUDA_OK(cudaMalloc(&f->ref_gathered, shard_bytes(f) * f->world));
  TEST_CUDA_OK(cudaMalloc(&f->bad, sizeof(unsigned long long)));
  TEST_CUDA_OK(cudaMemset(f->bad, 0, sizeof(unsigned long long)));
}

static void teardown(fixture *f) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < f->world; r++) {
    cudaFree(f->a[r]), cudaFree(f->b[r]), cudaFree(f->c[r]), cudaFree(f->c2[r]);
    TEST_TW_OK(tw_mem_free(f->comms[r], f->gathered[r]));
    TEST_TW_OK(tw_mem_free(f->comms[r], f->gathered2[r]));
  }
  cudaFree(f->ref_gathered), cudaFree(f->bad);
  for (int r = 0; r < f->world; r++) {
    cudaStreamDestroy(f->streams[r]);
    TEST_TW_OK(tw_comm_destroy(f->comms[r]));
  }
}

static tw_ag_gemm_args_t fused_args(const fixture *f, int r) {
  tw_ag_gemm_args_t a = TW_AG_GEMM_ARGS_INIT;
  a.c_dtype = f->c_dtype;
  a.a = f->a[r], a.b = f->b[r], a.c = f->c[r];
  a.a_gathered = f->gathered[r];
  a.m_local = f->m_local, a.n = f->n, a.k = f->k;
  return a;
}

/* Fresh shards and B, poisoned outputs, and the reference: the shards gathered by copies, then
 * tw_gemm (the fused op's core) on each rank's B. Every rank's stream. */
static void fill_and_reference(fixture *f, uint64_t seed) {
  for (int r = 0; r < f->world; r++) {
    tw_stream_t s = (tw_stream_t)f->streams[r];
    tw_test_fill_bf16(f->a[r], (size_t)f->m_local * f->k, seed + 31 * r, s);
    tw_test_fill_bf16(f->b[r], (size_t)f->n * f->k, seed + 1000 + r, s);
    tw_test_poison(f->gathered[r], shard_bytes(f) * f->world, s);
    tw_test_poison(f->gathered2[r], shard_bytes(f) * f->world, s);
    tw_test_poison(f->c[r], c_bytes(f), s);
    tw_test_poison(f->c2[r], c_bytes(f), s);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < f->world; r++)
    TEST_CUDA_OK(cudaMemcpy((char *)f->ref_gathered + shard_bytes(f) * r, f->a[r], shard_bytes(f),
                            cudaMemcpyDeviceToDevice));
  for (int r = 0; r < f->world; r++) {
    tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
    g.c_dtype = f->c_dtype;
    g.a = f->ref_gathered, g.b = f->b[r], g.c = f->c2[r];
    g.m = f->m_local * f->world, g.n = f->n, g.k = f->k;
    TEST_TW_OK(tw_comm_sm_budget(f->comms[r], &g.sm_count));
    TEST_TW_OK(tw_gemm(&g, (tw_stream_t)0));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static void check_async(fixture *f, const char *what) {
  for (int r = 0; r < f->world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(f->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "%s: rank %d: %s", what, r, tw_comm_last_error(f->comms[r]));
  }
}

/* calls calls with fresh inputs, each compared bitwise (C and the gathered A); the first also
 * against the fp32 reference. */
static void test_layout(int nodes, int per_node, int64_t m_local, int64_t n, int64_t k,
                        tw_dtype_t c_dtype, int calls, uint64_t seed) {
  fixture f;
  setup(&f, nodes, per_node, m_local, n, k, c_dtype);
  const int64_t m = m_local * f.world;
  size_t diff = 0, gather = 0, gather2 = 0;
  double err = 0, best = 1e30;
  for (int call = 0; call < calls; call++) {
    fill_and_reference(&f, seed + 7919 * (uint64_t)call);
    const double t0 = tw_test_now();
    for (int r = 0; r < f.world; r++) {
      tw_ag_gemm_args_t a = fused_args(&f, r);
      TEST_TW_OK(tw_ag_gemm(f.comms[r], &a, (tw_stream_t)f.streams[r]));
    }
    TEST_CUDA_OK(cudaDeviceSynchronize());
    const double dt = tw_test_now() - t0;
    best = dt < best ? dt : best;
    for (int r = 0; r < f.world; r++)
      TEST_TW_OK(tw_allgather(f.comms[r], f.a[r], f.gathered2[r], shard_bytes(&f),
                              (tw_stream_t)f.streams[r]));
    TEST_CUDA_OK(cudaDeviceSynchronize());
    for (int r = 0; r < f.world; r++) {
      diff += tw_test_count_diff(f.c[r], f.c2[r], c_bytes(&f));
      gather += tw_test_count_diff(f.gathered[r], f.ref_gathered, shard_bytes(&f) * f.world);
      gather2 += tw_test_count_diff(f.gathered2[r], f.ref_gathered, shard_bytes(&f) * f.world);
    }
    if (call == 0) {
      float *ref = NULL;
      TEST_CUDA_OK(cudaMalloc(&ref, (size_t)m * n * sizeof(float)));
      const int r = f.world - 1;
      TEST_REQUIRE(tw_ref_gemm_fp32(f.ref_gathered, f.b[r], ref, m, n, k, k, k, n, 0) == TW_SUCCESS,
                   "ref gemm");
      TEST_CUDA_OK(cudaDeviceSynchronize());
      size_t nans = 0;
      if (c_dtype == TW_BF16)
        err = tw_test_rel_err_bf16(f.c[r], ref, 1, (size_t)m * n, &nans);
      TEST_ASSERT(nans == 0, "%dx%d: %zu NaN/unwritten outputs", nodes, per_node, nans);
      cudaFree(ref);
    }
  }
  TEST_ASSERT(diff == 0,
              "%dx%d m_local %lld n %lld k %lld: fused != same-core reference in %zu "
              "bytes",
              nodes, per_node, (long long)m_local, (long long)n, (long long)k, diff);
  TEST_ASSERT(gather == 0, "%dx%d: gathered A differs in %zu bytes", nodes, per_node, gather);
  TEST_ASSERT(gather2 == 0, "%dx%d: tw_allgather's gathered A differs in %zu bytes", nodes,
              per_node, gather2);
  TEST_ASSERT(err < 1e-2, "%dx%d: rel err %.3g", nodes, per_node, err);
  check_async(&f, "layout");
  printf("  %dx%d m_local %lld n %lld k %lld %s, %d calls: diff %zu, rel err %.2e, best call "
         "%.2f ms\n",
         nodes, per_node, (long long)m_local, (long long)n, (long long)k,
         c_dtype == TW_BF16 ? "bf16" : "fp32", calls, diff, err, best * 1e3);
  teardown(&f);
}

/* A graph of one call per rank, replayed with fresh inputs: the device epochs carry on. */
static void test_graph(int nodes, int per_node, int replays, uint64_t seed) {
  fixture f;
  setup(&f, nodes, per_node, 256, 256, 512, TW_BF16);
  cudaGraphExec_t exec[TW_MAX_WORLD];
  for (int r = 0; r < f.world; r++) {
    cudaGraph_t g;
    TEST_CUDA_OK(cudaStreamBeginCapture(f.streams[r], cudaStreamCaptureModeThreadLocal));
    tw_ag_gemm_args_t a = fused_args(&f, r);
    TEST_TW_OK(tw_ag_gemm(f.comms[r], &a, (tw_stream_t)f.streams[r]));
    TEST_CUDA_OK(cudaStreamEndCapture(f.streams[r], &g));
    TEST_CUDA_OK(cudaGraphInstantiate(&exec[r], g, 0));
    cudaGraphDestroy(g);
  }
  size_t diff = 0;
  for (int i = 0; i < replays; i++) {
    fill_and_reference(&f, seed + 131 * (uint64_t)i);
    for (int r = 0; r < f.world; r++)
      TEST_CUDA_OK(cudaGraphLaunch(exec[r], f.streams[r]));
    TEST_CUDA_OK(cudaDeviceSynchronize());
    for (int r = 0; r < f.world; r++)
      diff += tw_test_count_diff(f.c[r], f.c2[r], c_bytes(&f));
  }
  TEST_ASSERT(diff == 0, "graph %dx%d: %zu bytes differ over %d replays", nodes, per_node, diff,
              replays);
  check_async(&f, "graph");
  printf("  graph %dx%d: %d replays, diff %zu\n", nodes, per_node, replays, diff);
  for (int r = 0; r < f.world; r++)
    cudaGraphExecDestroy(exec[r]);
  teardown(&f);
}

/* What the rail path refuses: the copy-engine mode, and nodes of unequal size (init passes:
 * the transport serves them; the op does not). */
static void test_refusals(void) {
  fixture f;
  setup(&f, 2, 2, 256, 256, 256, TW_BF16);
  tw_ag_gemm_args_t a = fused_args(&f, 0);
  a.comm_mode = TW_AG_COMM_COPY_ENGINE;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, (tw_stream_t)f.streams[0]), TW_ERR_NOT_SUPPORTED,
                "TW_AG_COMM_COPY_ENGINE");
  teardown(&f);
  int devices[6] = {0};
  tw_comm_t comms[6];
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = 4; /* {0..3}, {4, 5} */
  TEST_REQUIRE(tw_comm_init_all(comms, 6, devices, &cfg) == TW_SUCCESS, "init 6: %s",
               tw_last_error());
  void *g[6];
  for (int r = 0; r < 6; r++)
    TEST_TW_OK(tw_mem_alloc(comms[r], 6 * 128 * 256 * 2, &g[r]));
  void *shard = NULL, *b = NULL, *c = NULL;
  TEST_CUDA_OK(cudaMalloc(&shard, 128 * 256 * 2));
  TEST_CUDA_OK(cudaMalloc(&b, 256 * 256 * 2));
  TEST_CUDA_OK(cudaMalloc(&c, 6 * 128 * 256 * 2));
  tw_ag_gemm_args_t u = TW_AG_GEMM_ARGS_INIT;
  u.a = shard, u.b = b, u.c = c, u.a_gathered = g[0];
  u.m_local = 128, u.n = 256, u.k = 256;
  TEST_TW_FAILS(tw_ag_gemm(comms[0], &u, (tw_stream_t)0), TW_ERR_NOT_SUPPORTED,
                "as many ranks on every node");
  for (int r = 0; r < 6; r++) {
    TEST_TW_OK(tw_mem_free(comms[r], g[r]));
    TEST_TW_OK(tw_comm_destroy(comms[r]));
  }
  cudaFree(shard), cudaFree(b), cudaFree(c);
}

static void run_backend(const char *name, int small, uint64_t seed) {
  printf("backend %s:\n", name);
  test_layout(2, 2, 256, 512, 512, TW_BF16, small ? 2 : 5, seed);
  test_layout(2, 4, 200, 264, 200, TW_BF16, 2, seed + 100); /* tails everywhere */
  test_layout(3, 2, 384, 1024, 1024, TW_BF16, small ? 2 : 5, seed + 200);
  test_layout(4, 2, 300, 512, 256, TW_FP32, 2, seed + 300);
  test_layout(2, 2, 2048, 2048, 2048, TW_BF16, small ? 2 : 10, seed + 400); /* many chunks */
  test_graph(2, 2, 5, seed + 500);
}

static int small;
static void run_small(const char *name, uint64_t seed) { run_backend(name, small, seed); }

int main(int argc, char **argv) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0); /* 8 ranks' kernels on one GPU, before CUDA */
  tw_test_require_hopper();
  small = argc > 1 && strcmp(argv[1], "--small") == 0;
  tw_test_on_both_backends(TW_VERBS_DOUBLE, run_small, test_refusals, 42);
  return tw_test_finish();
}
#endif
