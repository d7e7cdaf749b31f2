/*
 * tw_grouped_gemm: group-major rows against tw_gemm of each group's rows (bitwise: the same core
 * and accumulation order) and an fp32 reference, with random group sizes (multiples of 128, empty
 * groups, a bound past the last group), tails in n and k, bf16 and fp32 out, both kernel widths;
 * rows past the last group left as they were; offsets changed between CUDA graph replays;
 * offsets that break the contract never fault nor write outside out; bad arguments refused
 * naming them. 77 without a Hopper GPU.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include "ref/ref_gemm.h"
#include "tw_test.h"

typedef struct {
  int64_t groups, m, n, k;
  tw_dtype_t out_dtype;
  int32_t *h_off;          /* host copy of the offsets */
  int32_t *d_off;          /* device, [groups + 1] */
  void *a, *b, *out, *ref; /* ref: tw_gemm of each group's rows, out's layout */
} case_t;

static size_t out_bytes(const case_t *c) {
  return (size_t)c->m * c->n * (c->out_dtype == TW_BF16 ? 2 : 4);
}

/* Random sizes of up to max_blocks row blocks per group (some empty), in a bound of `spare`
 * more rows than they fill. */
static void make_offsets(case_t *c, int max_blocks, int64_t spare, uint64_t *rng) {
  c->h_off[0] = 0;
  for (int64_t g = 0; g < c->groups; g++) {
    const int blocks = (int)(tw_test_xorshift(rng) % (uint64_t)(max_blocks + 1));
    c->h_off[g + 1] = c->h_off[g] + 128 * blocks;
  }
  c->m = c->h_off[c->groups] + spare;
  if (c->m < 1)
    c->m = 1;
}

static void setup(case_t *c, int64_t groups, int64_t n, int64_t k, tw_dtype_t dt, int max_blocks,
                  int64_t spare, uint64_t seed) {
  memset(c, 0, sizeof(*c));
  c->groups = groups, c->n = n, c->k = k, c->out_dtype = dt;
  c->h_off = (int32_t *)malloc((size_t)(groups + 1) * 4);
  TEST_REQUIRE(c->h_off, "host memory");
  uint64_t rng = seed | 1;
  make_offsets(c, max_blocks, spare, &rng);
  TEST_CUDA_OK(cudaMalloc(&c->d_off, (size_t)(groups + 1) * 4));
  TEST_CUDA_OK(cudaMemcpy(c->d_off, c->h_off, (size_t)(groups + 1) * 4, cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMalloc(&c->a, (size_t)c->m * k * 2));
  TEST_CUDA_OK(cudaMalloc(&c->b, (size_t)groups * n * k * 2));
  TEST_CUDA_OK(cudaMalloc(&c->out, out_bytes(c)));
  TEST_CUDA_OK(cudaMalloc(&c->ref, out_bytes(c)));
  tw_test_fill_bf16(c->a, (size_t)c->m * k, seed + 1, 0);
  tw_test_fill_bf16(c->b, (size_t)groups * n * k, seed + 2, 0);
}

static void teardown(case_t *c) {
  cudaFree(c->d_off), cudaFree(c->a), cudaFree(c->b), cudaFree(c->out), cudaFree(c->ref);
  free(c->h_off);
}

static tw_grouped_gemm_args_t args_of(const case_t *c) {
  tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
  g.c_dtype = c->out_dtype;
  g.a = c->a, g.b = c->b, g.out = c->out, g.offsets = c->d_off;
  g.m = c->m, g.n = c->n, g.k = c->k, g.groups = c->groups;
  return g;
}

/* ref = the poison, then tw_gemm of every non-empty group's rows into its rows. */
static void reference(case_t *c) {
  tw_test_poison(c->ref, out_bytes(c), 0);
  const size_t esz = c->out_dtype == TW_BF16 ? 2 : 4;
  for (int64_t g = 0; g < c->groups; g++) {
    const int64_t r0 = c->h_off[g], rows = c->h_off[g + 1] - r0;
    if (rows == 0)
      continue;
    tw_gemm_args_t a = TW_GEMM_ARGS_INIT;
    a.c_dtype = c->out_dtype;
    a.a = (const char *)c->a + (size_t)r0 * c->k * 2;
    a.b = (const char *)c->b + (size_t)g * c->n * c->k * 2;
    a.c = (char *)c->ref + (size_t)r0 * c->n * esz;
    a.m = rows, a.n = c->n, a.k = c->k;
    TEST_TW_OK(tw_gemm(&a, (tw_stream_t)0));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

/* out poisoned, the grouped GEMM, then out bitwise ref (rows past the last group: the poison). */
static void check_case(case_t *c, const char *what) {
  tw_test_poison(c->out, out_bytes(c), 0);
  tw_grouped_gemm_args_t g = args_of(c);
  TEST_TW_OK(tw_grouped_gemm(&g, (tw_stream_t)0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  const size_t diff = tw_test_count_diff(c->out, c->ref, out_bytes(c));
  TEST_ASSERT(diff == 0,
              "%s: %zu bytes differ from tw_gemm per group (groups %lld, m %lld, n %lld, "
              "k %lld, %s out, rows used %d)",
              what, diff, (long long)c->groups, (long long)c->m, (long long)c->n, (long long)c->k,
              c->out_dtype == TW_BF16 ? "bf16" : "fp32", c->h_off[c->groups]);
}

/* The bf16 out of the live rows within tolerance of an fp32 GEMM of each group. */
static void check_fp32_reference(case_t *c, const char *what) {
  const int64_t rows = c->h_off[c->groups];
  if (rows == 0 || c->out_dtype != TW_BF16)
    return;
  float *ref = NULL;
  TEST_CUDA_OK(cudaMalloc(&ref, (size_t)rows * c->n * 4));
  for (int64_t g = 0; g < c->groups; g++) {
    const int64_t r0 = c->h_off[g], n_rows = c->h_off[g + 1] - r0;
    if (n_rows)
      TEST_TW_OK(tw_ref_gemm_fp32((const char *)c->a + (size_t)r0 * c->k * 2,
                                  (const char *)c->b + (size_t)g * c->n * c->k * 2,
                                  ref + (size_t)r0 * c->n, n_rows, c->n, c->k, c->k, c->k, c->n,
                                  0));
  }
  size_t nans = 0;
  const double err = tw_test_rel_err_bf16(c->out, ref, 1, (size_t)rows * c->n, &nans);
  TEST_ASSERT(err < 1e-2 && nans == 0, "%s: rel err %.3g against fp32, %zu NaN", what, err, nans);
  cudaFree(ref);
}

static void test_random(int64_t groups, int64_t n, int64_t k, int max_blocks, int64_t spare,
                        uint64_t seed) {
  for (int dt = 0; dt < 2; dt++) {
    case_t c;
    setup(&c, groups, n, k, dt ? TW_FP32 : TW_BF16, max_blocks, spare, seed + 17 * dt);
    char what[96];
    snprintf(what, sizeof(what), "%lld groups, n %lld, k %lld", (long long)groups, (long long)n,
             (long long)k);
    reference(&c);
    check_case(&c, what);
    check_fp32_reference(&c, what);
    teardown(&c);
  }
}

/* Graph replays read the offsets as they are at replay: new sizes in the same array give the
 * new grouping's result. */
static void test_graph(uint64_t seed) {
  case_t c;
  setup(&c, 8, 512, 256, TW_BF16, 3, 128 * 8 * 3, seed);
  cudaStream_t s;
  TEST_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  tw_grouped_gemm_args_t g = args_of(&c);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TEST_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  TEST_TW_OK(tw_grouped_gemm(&g, (tw_stream_t)s));
  TEST_CUDA_OK(cudaStreamEndCapture(s, &graph));
  TEST_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  uint64_t rng = seed * 3 + 1;
  const int64_t m = c.m;
  for (int replay = 0; replay < 3; replay++) {
    make_offsets(&c, 3, 0, &rng); /* new sizes that fit the captured bound */
    c.m = m;
    TEST_CUDA_OK(cudaMemcpy(c.d_off, c.h_off, (size_t)(c.groups + 1) * 4, cudaMemcpyHostToDevice));
    reference(&c);
    tw_test_poison(c.out, out_bytes(&c), 0);
    TEST_CUDA_OK(cudaDeviceSynchronize());
    TEST_CUDA_OK(cudaGraphLaunch(exec, s));
    TEST_CUDA_OK(cudaStreamSynchronize(s));
    const size_t diff = tw_test_count_diff(c.out, c.ref, out_bytes(&c));
    TEST_ASSERT(diff == 0, "graph replay %d (rows used %d): %zu bytes differ", replay,
                c.h_off[c.groups], diff);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  teardown(&c);
}

/* Offsets that break the contract (unaligned, decreasing, past m, negative): the kernel ends
 * without a fault and nothing outside out changes (out sits between two poisoned guards). */
static void test_broken_offsets(uint64_t seed) {
  const int64_t groups = 4, n = 256, k = 128, m = 512, guard = 1 << 16;
  const size_t ob = (size_t)m * n * 2;
  char *buf = NULL;
  void *a = NULL, *b = NULL, *guards = NULL;
  int32_t *d_off = NULL;
  TEST_CUDA_OK(cudaMalloc(&buf, ob + 2 * guard));
  TEST_CUDA_OK(cudaMalloc(&guards, ob + 2 * guard));
  TEST_CUDA_OK(cudaMalloc(&a, (size_t)m * k * 2));
  TEST_CUDA_OK(cudaMalloc(&b, (size_t)groups * n * k * 2));
  TEST_CUDA_OK(cudaMalloc(&d_off, (groups + 1) * 4));
  tw_test_fill_bf16(a, (size_t)m * k, seed, 0);
  tw_test_fill_bf16(b, (size_t)groups * n * k, seed + 1, 0);
  const int32_t cases[][5] = {{0, 100, 300, 301, 512},
                              {0, 384, 128, 256, 512},
                              {0, 128, 256, 384, 1 << 30},
                              {-256, -128, 0, 128, 256},
                              {0, 0, 0, 0, -5}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    TEST_CUDA_OK(cudaMemcpy(d_off, cases[i], sizeof(cases[i]), cudaMemcpyHostToDevice));
    tw_test_poison(buf, ob + 2 * guard, 0);
    tw_test_poison(guards, ob + 2 * guard, 0);
    tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
    g.a = a, g.b = b, g.out = buf + guard, g.offsets = d_off;
    g.m = m, g.n = n, g.k = k, g.groups = groups;
    TEST_TW_OK(tw_grouped_gemm(&g, (tw_stream_t)0));
    const cudaError_t e = cudaDeviceSynchronize();
    TEST_REQUIRE(e == cudaSuccess, "broken offsets case %zu: %s", i, cudaGetErrorString(e));
    TEST_ASSERT(tw_test_count_diff(buf, guards, guard) == 0 &&
                    tw_test_count_diff(buf + guard + ob, (char *)guards + guard + ob, guard) == 0,
                "broken offsets case %zu: a write outside out", i);
  }
  cudaFree(buf), cudaFree(guards), cudaFree(a), cudaFree(b), cudaFree(d_off);
}

static void test_refusals(void) {
  case_t c;
  setup(&c, 4, 256, 128, TW_BF16, 2, 128, 5);
  tw_grouped_gemm_args_t g;
  TEST_TW_FAILS(tw_grouped_gemm(NULL, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "args is NULL");
  g = args_of(&c), g.size = 8;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "args->size");
  g = args_of(&c), g.c_dtype = (tw_dtype_t)7;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "c_dtype");
  g = args_of(&c), g.groups = 0;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "groups");
  g = args_of(&c), g.n = 100;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "n is 100");
  g = args_of(&c), g.k = 0;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "k is 0");
  g = args_of(&c), g.lda = 100;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "lda");
  g = args_of(&c), g.offsets = NULL;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "offsets is NULL");
  g = args_of(&c), g.offsets = (const int32_t *)((const char *)c.d_off + 2);
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "offsets");
  g = args_of(&c), g.offsets = c.h_off; /* host memory */
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "offsets");
  g = args_of(&c), g.groups = 70000;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "groups is 70000");
  g = args_of(&c), g.groups = 8; /* b and offsets hold 4 */
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "tw_grouped_gemm: b");
  g = args_of(&c), g.out = c.a;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "out");
  g = args_of(&c), g.m = c.m * 4; /* a too small for the bound */
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "tw_grouped_gemm: a");
  g = args_of(&c), g.sm_count = 100000;
  TEST_TW_FAILS(tw_grouped_gemm(&g, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT, "sm_count");
  teardown(&c);
}

int main(void) {
  tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  test_random(1, 256, 128, 3, 0, seed);          /* one group: tw_gemm */
  test_random(8, 264, 200, 4, 384, seed + 100);  /* tails, empty groups, a spare bound */
  test_random(32, 4096, 1024, 4, 0, seed + 200); /* 128 x 256 tiles */
  test_random(16, 128, 512, 3, 128, seed + 300); /* 128 x 128 tiles */
  test_random(64, 512, 256, 1, 640, seed + 400); /* many single-block groups */
  test_random(5, 256, 256, 0, 512, seed + 500);  /* every group empty: nothing written */
  test_graph(seed + 600);
  test_broken_offsets(seed + 700);
  test_refusals();
  return tw_test_finish();
}
