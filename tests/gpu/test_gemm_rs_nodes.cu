/*
 * tw_gemm_rs and tw_gemm_ar across nodes, on virtual nodes of one GPU (tw_config.ranks_per_node)
 * over the verbs test double: the rail path (ops/gemm_rs/gemm_rs_rail.h) reduces each owner's
 * rows inside every node over NVLink, sends the node partials by RDMA through the ranks'
 * proxies and the ib (RC) or efa (SRD) backend, and (tw_gemm_ar) gathers the reduced rows
 * rail-aligned. For layouts 2x2, 2x4, 3x2 and 4x2 (nodes x ranks per node), with tails, fp32 and
 * bf16 partials, every rank's out equals, bitwise, the same-core reference: tw_gemm's partial of
 * every rank (fp32, or bf16 with bf16 partials) summed on the host in the rail path's order
 * (nodes in order, each node's ranks in order, fp32) and rounded to bf16; the unfused pipeline
 * (TW_RS_UNFUSED_SMALL=1: tw_gemm, then the rail kernel) equals it too; the first call is within
 * bf16 tolerance of an fp32 reference GEMM. Then back-to-back calls with fresh inputs, a CUDA
 * graph replay, nodes whose calls disagree (TW_ERR_MISMATCH, nothing written across), and the
 * refusals. 77 without a Hopper GPU or without the double (built with
 * rdma-core's headers).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref/ref_gemm.h"
#include "tw_test.h"

#ifndef TW_VERBS_DOUBLE
int main(void) {
  printf("built without rdma-core's headers: no inter-node backend to test\n");
  return 77;
}
#else

typedef struct {
  int world, nodes, per_node, partials;
  int64_t m, n, k;
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *a[TW_MAX_WORLD], *b[TW_MAX_WORLD], *out[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  void *partial[TW_MAX_WORLD]; /* tw_gemm's partial [m][n], fp32 or bf16 */
  uint16_t *ref;               /* host: bf16 [m][n], the rail order's sum */
} fixture;

static int wait_ms; /* tw_config.wait_timeout_ms of the next setup (0: the default) */

static void setup(fixture *f, int nodes, int per_node, int64_t m_local, int64_t n, int64_t k,
                  int partials) {
  memset(f, 0, sizeof(*f));
  f->world = nodes * per_node, f->nodes = nodes, f->per_node = per_node;
  f->m = m_local * f->world, f->n = n, f->k = k, f->partials = partials;
  int devices[TW_MAX_WORLD] = {0};
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = per_node;
  cfg.wait_timeout_ms = wait_ms;
  TEST_REQUIRE(tw_comm_init_all(f->comms, f->world, devices, &cfg) == TW_SUCCESS,
               "init_all(%dx%d): %s", nodes, per_node, tw_last_error());
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_gemm_rs_workspace_size(f->comms[0], f->m, n, &ws_bytes));
  for (int r = 0; r < f->world; r++) {
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&f->streams[r], cudaStreamNonBlocking));
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], ws_bytes, &f->ws[r]) == TW_SUCCESS, "alloc: %s",
                 tw_comm_last_error(f->comms[r]));
    TEST_CUDA_OK(cudaMalloc(&f->a[r], (size_t)f->m * k * 2));
    TEST_CUDA_OK(cudaMalloc(&f->b[r], (size_t)n * k * 2));
    TEST_CUDA_OK(cudaMalloc(&f->out[r], (size_t)f->m * n * 2));
    TEST_CUDA_OK(cudaMalloc(&f->partial[r], (size_t)f->m * n * 4));
  }
  f->ref = (uint16_t *)malloc((size_t)f->m * n * 2);
  TEST_REQUIRE(f->ref, "host memory");
}

static void teardown(fixture *f) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < f->world; r++) {
    cudaFree(f->a[r]), cudaFree(f->b[r]), cudaFree(f->out[r]), cudaFree(f->partial[r]);
    TEST_TW_OK(tw_mem_free(f->comms[r], f->ws[r]));
    cudaStreamDestroy(f->streams[r]);
  }
  for (int r = 0; r < f->world; r++)
    TEST_TW_OK(tw_comm_destroy(f->comms[r]));
  free(f->ref);
}

static tw_gemm_rs_args_t args_of(const fixture *f, int r) {
  tw_gemm_rs_args_t a = TW_GEMM_RS_ARGS_INIT;
  a.a = f->a[r], a.b = f->b[r], a.out = f->out[r], a.workspace = f->ws[r];
  a.m = f->m, a.n = f->n, a.k = f->k;
  a.partials = f->partials ? TW_PARTIALS_BF16 : TW_PARTIALS_FP32;
  return a;
}

/* Fresh inputs, every rank's partial by tw_gemm, and the host reference in the rail order. */
static void fill_and_reference(fixture *f, uint64_t seed) {
  const size_t mn = (size_t)f->m * f->n;
  float *part = (float *)malloc(mn * 4 * f->world);
  uint16_t *h16 = (uint16_t *)malloc(mn * 2);
  TEST_REQUIRE(part && h16, "host memory");
  for (int r = 0; r < f->world; r++) {
    tw_stream_t s = (tw_stream_t)f->streams[r];
    tw_test_fill_bf16(f->a[r], (size_t)f->m * f->k, seed + 31 * r, s);
    tw_test_fill_bf16(f->b[r], (size_t)f->n * f->k, seed + 1000 + r, s);
    tw_test_poison(f->out[r], mn * 2, s);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < f->world; r++) {
    tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
    g.c_dtype = f->partials ? TW_BF16 : TW_FP32;
    g.a = f->a[r], g.b = f->b[r], g.c = f->partial[r];
    g.m = f->m, g.n = f->n, g.k = f->k;
    TEST_TW_OK(tw_comm_sm_budget(f->comms[r], &g.sm_count));
    TEST_TW_OK(tw_gemm(&g, (tw_stream_t)0));
    TEST_CUDA_OK(cudaDeviceSynchronize());
    if (f->partials) {
      TEST_CUDA_OK(cudaMemcpy(h16, f->partial[r], mn * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < mn; i++)
        part[r * mn + i] = tw_test_bf16_to_float(h16[i]);
    } else {
      TEST_CUDA_OK(cudaMemcpy(part + r * mn, f->partial[r], mn * 4, cudaMemcpyDeviceToHost));
    }
  }
  tw_test_rail_sum_bf16(part, f->world, f->per_node, mn, f->ref);
  free(part), free(h16);
}

/* Every rank's out against the reference: rs its m / world rows, ar all m. */
static size_t count_diff(fixture *f, int all_reduce) {
  const int64_t m_local = f->m / f->world;
  const size_t rows = (size_t)(all_reduce ? f->m : m_local);
  uint16_t *h = (uint16_t *)malloc(rows * f->n * 2);
  size_t diff = 0;
  for (int r = 0; r < f->world; r++) {
    TEST_CUDA_OK(cudaMemcpy(h, f->out[r], rows * f->n * 2, cudaMemcpyDeviceToHost));
    const uint16_t *ref = f->ref + (all_reduce ? 0 : (size_t)r * m_local * f->n);
    for (size_t i = 0; i < rows * f->n; i++)
      diff += h[i] != ref[i];
  }
  free(h);
  return diff;
}

static void check_async(fixture *f, const char *what) {
  for (int r = 0; r < f->world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(f->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "%s: rank %d: %s", what, r, tw_comm_last_error(f->comms[r]));
  }
}

static void run_op(fixture *f, int all_reduce) {
  for (int r = 0; r < f->world; r++) {
    tw_gemm_rs_args_t a = args_of(f, r);
    tw_stream_t s = (tw_stream_t)f->streams[r];
    TEST_TW_OK(all_reduce ? tw_gemm_ar(f->comms[r], &a, s) : tw_gemm_rs(f->comms[r], &a, s));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

/* The fp32 reference GEMM of every rank, summed in double, against rank 0's ar out. */
static double fp32_rel_err(fixture *f) {
  const size_t mn = (size_t)f->m * f->n;
  float *ref = NULL;
  TEST_CUDA_OK(cudaMalloc(&ref, mn * 4));
  double *acc = (double *)calloc(mn, sizeof(double));
  float *h = (float *)malloc(mn * 4);
  uint16_t *o = (uint16_t *)malloc(mn * 2);
  for (int r = 0; r < f->world; r++) {
    TEST_REQUIRE(tw_ref_gemm_fp32(f->a[r], f->b[r], ref, f->m, f->n, f->k, f->k, f->k, f->n, 0) ==
                     TW_SUCCESS,
                 "ref gemm");
    TEST_CUDA_OK(cudaMemcpy(h, ref, mn * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < mn; i++)
      acc[i] += h[i];
  }
  TEST_CUDA_OK(cudaMemcpy(o, f->out[0], mn * 2, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < mn; i++) {
    const double d = tw_test_bf16_to_float(o[i]) - acc[i];
    num += d * d, den += acc[i] * acc[i];
  }
  cudaFree(ref), free(acc), free(h), free(o);
  return sqrt(num / (den > 0 ? den : 1));
}

/* `calls` rounds with fresh inputs of: rs fused, ar fused, rs and ar through the unfused
 * pipeline; every rank's out bitwise against the reference. */
static void test_layout(int nodes, int per_node, int64_t m_local, int64_t n, int64_t k,
                        int partials, int calls, uint64_t seed) {
  fixture f;
  setup(&f, nodes, per_node, m_local, n, k, partials);
  size_t diff[4] = {0, 0, 0, 0};
  double err = 0, best = 1e30;
  for (int call = 0; call < calls; call++) {
    fill_and_reference(&f, seed + 7919 * (uint64_t)call);
    for (int v = 0; v < 4; v++) {
      if (v >= 2)
        setenv("TW_RS_UNFUSED_SMALL", "1", 1);
      const double t0 = tw_test_now();
      run_op(&f, v & 1);
      const double dt = tw_test_now() - t0;
      if (v < 2 && dt < best)
        best = dt;
      unsetenv("TW_RS_UNFUSED_SMALL");
      diff[v] += count_diff(&f, v & 1);
      if (call == 0 && v == 1)
        err = fp32_rel_err(&f);
      for (int r = 0; r < f.world; r++)
        tw_test_poison(f.out[r], (size_t)f.m * f.n * 2, (tw_stream_t)f.streams[r]);
      TEST_CUDA_OK(cudaDeviceSynchronize());
    }
  }
  const char *names[4] = {"rs", "ar", "rs unfused", "ar unfused"};
  for (int v = 0; v < 4; v++)
    TEST_ASSERT(diff[v] == 0,
                "%dx%d m_local %lld n %lld k %lld %s partials: %s != reference in %zu "
                "elements",
                nodes, per_node, (long long)m_local, (long long)n, (long long)k,
                partials ? "bf16" : "fp32", names[v], diff[v]);
  TEST_ASSERT(err < 1e-2, "%dx%d: rel err %.3g against the fp32 GEMM", nodes, per_node, err);
  check_async(&f, "layout");
  printf("  %dx%d m_local %lld n %lld k %lld %s partials, %d calls x 4: diff %zu/%zu/%zu/%zu, rel "
         "err %.2e, best call %.2f ms\n",
         nodes, per_node, (long long)m_local, (long long)n, (long long)k,
         partials ? "bf16" : "fp32", calls, diff[0], diff[1], diff[2], diff[3], err, best * 1e3);
  teardown(&f);
}

/* A graph of tw_gemm_rs then tw_gemm_ar per rank, replayed with fresh inputs. */
static void test_graph(int nodes, int per_node, int replays, uint64_t seed) {
  fixture f;
  setup(&f, nodes, per_node, 256, 512, 256, 0);
  void *out_rs[TW_MAX_WORLD];
  cudaGraphExec_t exec[TW_MAX_WORLD];
  for (int r = 0; r < f.world; r++) {
    TEST_CUDA_OK(cudaMalloc(&out_rs[r], (size_t)f.m * f.n * 2));
    cudaGraph_t g;
    TEST_CUDA_OK(cudaStreamBeginCapture(f.streams[r], cudaStreamCaptureModeThreadLocal));
    tw_gemm_rs_args_t a = args_of(&f, r);
    a.out = out_rs[r];
    TEST_TW_OK(tw_gemm_rs(f.comms[r], &a, (tw_stream_t)f.streams[r]));
    a.out = f.out[r];
    TEST_TW_OK(tw_gemm_ar(f.comms[r], &a, (tw_stream_t)f.streams[r]));
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
    diff += count_diff(&f, 1);
    for (int r = 0; r < f.world; r++) {
      void *keep = f.out[r];
      f.out[r] = out_rs[r];
      out_rs[r] = keep;
    }
    diff += count_diff(&f, 0);
    for (int r = 0; r < f.world; r++) {
      void *keep = f.out[r];
      f.out[r] = out_rs[r];
      out_rs[r] = keep;
    }
  }
  TEST_ASSERT(diff == 0, "graph %dx%d: %zu elements differ over %d replays", nodes, per_node, diff,
              replays);
  check_async(&f, "graph");
  printf("  graph %dx%d (rs then ar): %d replays, diff %zu\n", nodes, per_node, replays, diff);
  for (int r = 0; r < f.world; r++) {
    cudaGraphExecDestroy(exec[r]);
    cudaFree(out_rs[r]);
  }
  teardown(&f);
}

/* What the rail path refuses: a workspace sized for one node, and nodes of unequal size. */
static void test_refusals(void) {
  fixture f;
  setup(&f, 2, 2, 256, 256, 256, 0);
  size_t ws_nodes = 0;
  TEST_TW_OK(tw_gemm_rs_workspace_size(f.comms[0], f.m, f.n, &ws_nodes));
  void *small[TW_MAX_WORLD];
  for (int r = 0; r < f.world; r++)
    TEST_TW_OK(tw_mem_alloc(f.comms[r], ws_nodes / 2, &small[r]));
  tw_gemm_rs_args_t a = args_of(&f, 0);
  a.workspace = small[0];
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, (tw_stream_t)f.streams[0]), TW_ERR_INVALID_ARGUMENT,
                "args->workspace");
  for (int r = 0; r < f.world; r++)
    TEST_TW_OK(tw_mem_free(f.comms[r], small[r]));
  teardown(&f);
  int devices[6] = {0};
  tw_comm_t comms[6];
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = 4; /* {0..3}, {4, 5} */
  TEST_REQUIRE(tw_comm_init_all(comms, 6, devices, &cfg) == TW_SUCCESS, "init 6: %s",
               tw_last_error());
  void *ws[6];
  for (int r = 0; r < 6; r++)
    TEST_TW_OK(tw_mem_alloc(comms[r], 64 << 20, &ws[r]));
  void *x = NULL;
  TEST_CUDA_OK(cudaMalloc(&x, 3 * 6 * 128 * 256 * 2));
  tw_gemm_rs_args_t u = TW_GEMM_RS_ARGS_INIT;
  u.a = x, u.b = (char *)x + 6 * 128 * 256 * 2, u.out = (char *)x + 2 * 6 * 128 * 256 * 2;
  u.workspace = ws[0];
  u.m = 6 * 128, u.n = 256, u.k = 256;
  TEST_TW_FAILS(tw_gemm_ar(comms[0], &u, (tw_stream_t)0), TW_ERR_NOT_SUPPORTED,
                "as many ranks on every node");
  for (int r = 0; r < 6; r++) {
    TEST_TW_OK(tw_mem_free(comms[r], ws[r]));
    TEST_TW_OK(tw_comm_destroy(comms[r]));
  }
  cudaFree(x);
}

/* Nodes that disagree: node 0's ranks call with n, node 1's with n / 2 (each node agrees
 * within itself, so only the digest that travels with the net entry flag can tell). Every rank
 * reports TW_ERR_MISMATCH naming the rail peer's node well within the wait bound, and no rank
 * wrote into another node: a poisoned out of node 1 stays poisoned. */
static void test_mismatch_across_nodes(int all_reduce) {
  const int bound_ms = 4000;
  fixture f;
  wait_ms = bound_ms;
  setup(&f, 2, 2, 256, 512, 256, 0);
  wait_ms = 0;
  fill_and_reference(&f, 7);
  const double t0 = tw_test_now();
  for (int r = 0; r < f.world; r++) {
    tw_gemm_rs_args_t a = args_of(&f, r);
    if (r >= f.per_node)
      a.n = f.n / 2;
    tw_stream_t s = (tw_stream_t)f.streams[r];
    TEST_TW_OK(all_reduce ? tw_gemm_ar(f.comms[r], &a, s) : tw_gemm_rs(f.comms[r], &a, s));
  }
  for (int r = 0; r < f.world; r++) {
    const cudaError_t e = cudaStreamSynchronize(f.streams[r]);
    TEST_REQUIRE(e == cudaSuccess, "rank %d's stream: %s", r, cudaGetErrorString(e));
  }
  const double waited = tw_test_now() - t0;
  const char *what = all_reduce ? "tw_gemm_ar, nodes with another n"
                                : "tw_gemm_rs, nodes with "
                                  "another n";
  TEST_ASSERT(waited < 0.5 * bound_ms / 1000.0, "%s: the kernels ended after %.2f s", what, waited);
  for (int r = 0; r < f.world; r++) {
    tw_status_t async = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(f.comms[r], &async));
    const char *msg = tw_comm_last_error(f.comms[r]);
    char needle[32];
    snprintf(needle, sizeof(needle), "on node %d", r < f.per_node ? 1 : 0);
    TEST_ASSERT(async == TW_ERR_MISMATCH && strstr(msg, needle) != NULL,
                "%s: rank %d: async %s (%s)", what, r, tw_status_string(async), msg);
    if (r == 0)
      printf("  %s, after %.3f s: rank 0: %s\n", what, waited, msg);
  }
  /* node 1's rows of out: nothing of node 0 landed there, nor a result */
  const size_t rows = (size_t)(all_reduce ? f.m : f.m / f.world);
  uint16_t *h = (uint16_t *)malloc(rows * (f.n / 2) * 2);
  TEST_REQUIRE(h, "host memory");
  TEST_CUDA_OK(cudaMemcpy(h, f.out[f.per_node], rows * (f.n / 2) * 2, cudaMemcpyDeviceToHost));
  size_t unpoisoned = 0;
  for (size_t i = 0; i < rows * (f.n / 2); i++)
    unpoisoned += h[i] != 0xffff;
  free(h);
  TEST_ASSERT(unpoisoned == 0, "%s: %zu elements of rank %d's out were written", what, unpoisoned,
              f.per_node);
  teardown(&f);
}

static void run_backend(const char *name, int small, uint64_t seed) {
  printf("backend %s:\n", name);
  test_layout(2, 2, 256, 512, 512, 0, small ? 1 : 3, seed);
  test_layout(2, 4, 200, 264, 200, 1, small ? 1 : 2, seed + 100); /* tails everywhere */
  test_layout(3, 2, 384, 1024, 512, 0, small ? 1 : 2, seed + 200);
  test_layout(4, 2, 300, 512, 256, 1, small ? 1 : 2, seed + 300);
  test_layout(2, 2, 1024, 2048, 1024, 0, small ? 1 : 2, seed + 400); /* many groups */
  test_graph(2, 2, 3, seed + 500);
  test_mismatch_across_nodes(0);
  test_mismatch_across_nodes(1);
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
