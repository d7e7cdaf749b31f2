/*
 * tw_grouped_gemm_wgrad: out[g] = a_g^T b_g for group-major rows, against tw_gemm of each
 * group's transposed rows (a_g^T [n, rows] x b_g^T [k, rows]: bitwise, the same core and K
 * order) and an fp64 host reference (bf16 / fp32 tolerance), with random group sizes
 * (multiples of 128, empty groups, an empty last group), a bound m past the last group whose
 * rows are NaN (never read), padding rows zero in a with other finite values in b and the
 * reverse, tails in n and k, padded strides (lda, ldb, ldo: their padding NaN, ldo's never
 * written), bf16 and fp32 out poisoned before the call with a guard after it; two calls bitwise
 * alike; a small sm_count; a CUDA graph replayed with new offsets; every refusal named, with
 * out untouched. 77 without a Hopper GPU.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test.h"

enum { kGuard = 4096, kMaxReport = 8 };
static const uint16_t kNaN = 0xFFFF; /* the poison's bf16 */

typedef struct {
  const char *name;
  int64_t groups, m, n, k, lda, ldb, ldo;
  tw_dtype_t dt;
  int sm_count;
  int32_t *h_off, *d_off;  /* [groups + 1] */
  uint16_t *h_a, *h_b;     /* host bf16 bits: a [m, lda], b [m, ldb] */
  void *a, *b;             /* device copies */
  void *out, *ref, *first; /* device [groups][n, ldo] + kGuard bytes; ref: tw_gemm's */
  void *ws;
  size_t ws_bytes, out_bytes; /* out_bytes: without the guard */
} case_t;

static size_t esz(const case_t *c) { return c->dt == TW_BF16 ? 2 : 4; }

static uint16_t rand_bf16(uint64_t *rng) {
  const float u = (float)(tw_test_xorshift(rng) >> 40) * (1.0f / 16777216.0f);
  return tw_test_float_to_bf16(2.0f * u - 1.0f);
}

/* Group sizes of 0 .. max_blocks row blocks (group 1 and, from 4 groups on, the last one
 * empty), then `spare` rows of bound. */
static void make_offsets(int32_t *off, int64_t groups, int max_blocks, uint64_t *rng) {
  off[0] = 0;
  for (int64_t g = 0; g < groups; g++) {
    int blocks = (int)(tw_test_xorshift(rng) % (uint64_t)(max_blocks + 1));
    if ((groups >= 3 && g == 1) || (groups >= 4 && g == groups - 1))
      blocks = 0;
    off[g + 1] = off[g] + 128 * blocks;
  }
}

/* a and b: rows below `live` random, their last pad rows of each group zero in one of them
 * (a for even groups, b for odd ones; pad random below 128), rows from `live` on and stride
 * padding NaN. */
static void fill_host(case_t *c, int64_t live, uint64_t seed) {
  uint64_t rng = seed * 2654435761u + 7;
  for (size_t i = 0; i < (size_t)c->m * c->lda; i++)
    c->h_a[i] = kNaN;
  for (size_t i = 0; i < (size_t)c->m * c->ldb; i++)
    c->h_b[i] = kNaN;
  for (int64_t r = 0; r < live; r++) {
    for (int64_t j = 0; j < c->n; j++)
      c->h_a[r * c->lda + j] = rand_bf16(&rng);
    for (int64_t j = 0; j < c->k; j++)
      c->h_b[r * c->ldb + j] = rand_bf16(&rng);
  }
  for (int64_t g = 0; g < c->groups; g++) {
    const int64_t r0 = c->h_off[g], r1 = c->h_off[g + 1];
    if (r1 == r0 || r1 > live)
      continue;
    const int64_t pad = (int64_t)(tw_test_xorshift(&rng) % 128);
    for (int64_t r = r1 - pad; r < r1; r++) {
      if (g % 2 == 0)
        memset(c->h_a + r * c->lda, 0, (size_t)c->n * 2);
      else
        memset(c->h_b + r * c->ldb, 0, (size_t)c->k * 2);
    }
  }
}

static void upload(case_t *c) {
  TEST_CUDA_OK(cudaMemcpy(c->a, c->h_a, (size_t)c->m * c->lda * 2, cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemcpy(c->b, c->h_b, (size_t)c->m * c->ldb * 2, cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemcpy(c->d_off, c->h_off, (size_t)(c->groups + 1) * 4, cudaMemcpyHostToDevice));
}

/* A case of random groups (make_offsets) in a bound of `spare` more rows; pad_ld: the strides'
 * padding, lda = n + pad_ld, ldb = k + 2 pad_ld, ldo = k + pad_ld (0: packed). */
static void setup(case_t *c, const char *name, int64_t groups, int64_t n, int64_t k, tw_dtype_t dt,
                  int max_blocks, int64_t spare, int64_t pad_ld, uint64_t seed) {
  memset(c, 0, sizeof(*c));
  c->name = name;
  c->groups = groups, c->n = n, c->k = k, c->dt = dt;
  c->h_off = (int32_t *)malloc((size_t)(groups + 1) * 4);
  TEST_REQUIRE(c->h_off, "host memory");
  uint64_t rng = seed | 1;
  make_offsets(c->h_off, groups, max_blocks, &rng);
  c->m = c->h_off[groups] + spare;
  if (c->m < 1)
    c->m = 1;
  c->lda = n + pad_ld, c->ldb = k + 2 * pad_ld, c->ldo = k + pad_ld;
  c->h_a = (uint16_t *)malloc((size_t)c->m * c->lda * 2);
  c->h_b = (uint16_t *)malloc((size_t)c->m * c->ldb * 2);
  TEST_REQUIRE(c->h_a && c->h_b, "host memory");
  fill_host(c, c->h_off[groups], seed);
  c->out_bytes = (size_t)(groups * n) * c->ldo * esz(c);
  TEST_CUDA_OK(cudaMalloc(&c->d_off, (size_t)(groups + 1) * 4));
  TEST_CUDA_OK(cudaMalloc(&c->a, (size_t)c->m * c->lda * 2));
  TEST_CUDA_OK(cudaMalloc(&c->b, (size_t)c->m * c->ldb * 2));
  TEST_CUDA_OK(cudaMalloc(&c->out, c->out_bytes + kGuard));
  TEST_CUDA_OK(cudaMalloc(&c->ref, c->out_bytes + kGuard));
  TEST_CUDA_OK(cudaMalloc(&c->first, c->out_bytes + kGuard));
  TEST_TW_OK(tw_grouped_gemm_wgrad_workspace_size(c->m, n, k, &c->ws_bytes));
  TEST_CUDA_OK(cudaMalloc(&c->ws, c->ws_bytes));
  upload(c);
}

static void teardown(case_t *c) {
  cudaFree(c->d_off), cudaFree(c->a), cudaFree(c->b), cudaFree(c->out), cudaFree(c->ref);
  cudaFree(c->first), cudaFree(c->ws);
  free(c->h_off), free(c->h_a), free(c->h_b);
}

static tw_grouped_gemm_args_t args_of(const case_t *c) {
  tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
  g.c_dtype = c->dt;
  g.a = c->a, g.b = c->b, g.out = c->out, g.offsets = c->d_off;
  g.m = c->m, g.n = c->n, g.k = c->k, g.groups = c->groups;
  g.lda = c->lda, g.ldb = c->ldb, g.ldo = c->ldo;
  g.sm_count = c->sm_count;
  return g;
}

static void describe(const case_t *c, char *buf, size_t len) {
  snprintf(buf, len,
           "case '%s' (%s out): groups %lld, m %lld (rows used %d), n %lld, k %lld, lda %lld, "
           "ldb %lld, ldo %lld, sm_count %d",
           c->name, c->dt == TW_BF16 ? "bf16" : "fp32", (long long)c->groups, (long long)c->m,
           c->h_off[c->groups], (long long)c->n, (long long)c->k, (long long)c->lda,
           (long long)c->ldb, (long long)c->ldo, c->sm_count);
}

/* ref = the poison, then each group's [n, k]: tw_gemm of its transposed rows, or zeros. */
static void reference(case_t *c) {
  tw_test_poison(c->ref, c->out_bytes + kGuard, 0);
  const size_t es = esz(c);
  for (int64_t g = 0; g < c->groups; g++) {
    const int64_t r0 = c->h_off[g], rows = c->h_off[g + 1] - r0;
    char *dst = (char *)c->ref + (size_t)(g * c->n) * c->ldo * es;
    if (rows == 0) {
      TEST_CUDA_OK(cudaMemset2D(dst, (size_t)c->ldo * es, 0, (size_t)c->k * es, (size_t)c->n));
      continue;
    }
    uint16_t *at = (uint16_t *)malloc((size_t)(c->n + c->k) * rows * 2), *bt;
    TEST_REQUIRE(at, "host memory");
    bt = at + (size_t)c->n * rows;
    for (int64_t r = 0; r < rows; r++) {
      for (int64_t i = 0; i < c->n; i++)
        at[i * rows + r] = c->h_a[(r0 + r) * c->lda + i];
      for (int64_t j = 0; j < c->k; j++)
        bt[j * rows + r] = c->h_b[(r0 + r) * c->ldb + j];
    }
    void *d = NULL;
    TEST_CUDA_OK(cudaMalloc(&d, (size_t)(c->n + c->k) * rows * 2));
    TEST_CUDA_OK(cudaMemcpy(d, at, (size_t)(c->n + c->k) * rows * 2, cudaMemcpyHostToDevice));
    tw_gemm_args_t a = TW_GEMM_ARGS_INIT;
    a.c_dtype = c->dt;
    a.a = d, a.b = (const char *)d + (size_t)c->n * rows * 2, a.c = dst;
    a.m = c->n, a.n = c->k, a.k = rows;
    a.ldc = c->ldo;
    TEST_TW_OK(tw_gemm(&a, (tw_stream_t)0));
    TEST_CUDA_OK(cudaDeviceSynchronize());
    cudaFree(d);
    free(at);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static double host_value(const case_t *c, const void *buf, size_t idx, uint32_t *bits) {
  if (c->dt == TW_BF16) {
    *bits = ((const uint16_t *)buf)[idx];
    return tw_test_bf16_to_float((uint16_t)*bits);
  }
  float f;
  memcpy(&f, (const char *)buf + idx * 4, 4);
  memcpy(bits, &f, 4);
  return f;
}

static void *to_host(const void *dev, size_t bytes) {
  void *h = malloc(bytes);
  TEST_REQUIRE(h, "host memory (%zu bytes)", bytes);
  TEST_CUDA_OK(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
  return h;
}

/* out bitwise `want` (device, out's layout with the guard); on a difference, the first
 * elements that differ (group, row, column; got and expected) and where the others lie. */
static void expect_bitwise(const case_t *c, const void *want, const char *against,
                           const char *step) {
  char desc[320];
  describe(c, desc, sizeof(desc));
  const size_t total = c->out_bytes + kGuard;
  const size_t diff = tw_test_count_diff(c->out, want, total);
  TEST_ASSERT(diff == 0, "%s, %s: %zu bytes differ from %s", desc, step, diff, against);
  if (diff == 0)
    return;
  void *got = to_host(c->out, total), *exp = to_host(want, total);
  const size_t es = esz(c), elems = c->out_bytes / es;
  size_t shown = 0, in_pad = 0, in_data = 0;
  for (size_t e = 0; e < elems; e++) {
    uint32_t gb, wb;
    const double gv = host_value(c, got, e, &gb), wv = host_value(c, exp, e, &wb);
    if (gb == wb)
      continue;
    const int64_t row = (int64_t)(e / (size_t)c->ldo), col = (int64_t)(e % (size_t)c->ldo);
    if (col >= c->k) {
      in_pad++;
      continue;
    }
    in_data++;
    if (shown++ < kMaxReport)
      fprintf(stderr,
              "  %s: out[group %lld][row %lld][col %lld] = 0x%0*x (%.8g), %s 0x%0*x (%.8g)\n", step,
              (long long)(row / c->n), (long long)(row % c->n), (long long)col, (int)(2 * es), gb,
              gv, against, (int)(2 * es), wb, wv);
  }
  const int guard_bad = memcmp((char *)got + c->out_bytes, (char *)exp + c->out_bytes, kGuard);
  fprintf(stderr, "  %s: %zu elements differ in [n, k], %zu in ldo's padding, guard %s\n", step,
          in_data, in_pad, guard_bad ? "written" : "intact");
  free(got), free(exp);
}

/* Elements (g, i, j) against the fp64 sum over g's rows: all of them where that is cheap, else
 * a sample with every group's last row and last column. */
static void check_fp64(const case_t *c) {
  char desc[320];
  describe(c, desc, sizeof(desc));
  void *got = to_host(c->out, c->out_bytes);
  double macs = 0;
  for (int64_t g = 0; g < c->groups; g++)
    macs += (double)(c->h_off[g + 1] - c->h_off[g]) * (double)c->n * (double)c->k;
  const int all = macs <= 3e7;
  const int64_t samples = all ? c->groups * c->n * c->k : 6000;
  uint64_t rng = 12345;
  size_t bad = 0, checked = 0;
  double worst = 0;
  for (int64_t s = 0; s < samples; s++) {
    int64_t g, i, j;
    if (all) {
      g = s / (c->n * c->k), i = (s / c->k) % c->n, j = s % c->k;
    } else {
      g = (int64_t)(tw_test_xorshift(&rng) % (uint64_t)c->groups);
      i = s % 3 == 0 ? c->n - 1 : (int64_t)(tw_test_xorshift(&rng) % (uint64_t)c->n);
      j = s % 3 == 1 ? c->k - 1 : (int64_t)(tw_test_xorshift(&rng) % (uint64_t)c->k);
    }
    double sum = 0, mag = 0;
    for (int64_t r = c->h_off[g]; r < c->h_off[g + 1]; r++) {
      const double p = (double)tw_test_bf16_to_float(c->h_a[r * c->lda + i]) *
                       (double)tw_test_bf16_to_float(c->h_b[r * c->ldb + j]);
      sum += p, mag += fabs(p);
    }
    uint32_t bits;
    const double v = host_value(c, got, (size_t)((g * c->n + i) * c->ldo + j), &bits);
    const double tol = (c->dt == TW_BF16 ? ldexp(fabs(sum), -8) : 0) + 1e-4 * mag + 1e-30;
    const double err = fabs(v - sum);
    checked++;
    if (!(err <= tol)) {
      if (bad++ < kMaxReport)
        fprintf(stderr,
                "  fp64: out[group %lld][row %lld][col %lld] = %.8g (0x%x), expected %.8g "
                "(sum of |terms| %.4g, tolerance %.3g)\n",
                (long long)g, (long long)i, (long long)j, v, bits, sum, mag, tol);
    } else if (mag > 0 && err / mag > worst) {
      worst = err / mag;
    }
  }
  TEST_ASSERT(bad == 0,
              "%s: %zu of %zu elements outside the fp64 tolerance (worst inside: %.3g "
              "of the sum of |terms|)",
              desc, bad, checked, worst);
  free(got);
}

/* out poisoned, the call, out bitwise tw_gemm per group; the fp64 check; a second call bitwise
 * the first. */
static void check_case(case_t *c) {
  reference(c);
  tw_grouped_gemm_args_t g = args_of(c);
  tw_test_poison(c->out, c->out_bytes + kGuard, 0);
  TEST_TW_OK(tw_grouped_gemm_wgrad(&g, c->ws, c->ws_bytes, (tw_stream_t)0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  expect_bitwise(c, c->ref, "tw_gemm per group", "first call");
  check_fp64(c);
  TEST_CUDA_OK(cudaMemcpy(c->first, c->out, c->out_bytes + kGuard, cudaMemcpyDeviceToDevice));
  tw_test_poison(c->out, c->out_bytes + kGuard, 0);
  tw_test_fill_bytes(c->ws, c->ws_bytes, 99, 0); /* the workspace's old contents do not matter */
  TEST_TW_OK(tw_grouped_gemm_wgrad(&g, c->ws, c->ws_bytes, (tw_stream_t)0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  expect_bitwise(c, c->first, "the first call", "second call");
}

static void test_random(const char *name, int64_t groups, int64_t n, int64_t k, int max_blocks,
                        int64_t spare, int64_t pad_ld, int sm_count, uint64_t seed) {
  for (int dt = 0; dt < 2; dt++) {
    case_t c;
    setup(&c, name, groups, n, k, dt ? TW_FP32 : TW_BF16, max_blocks, spare, pad_ld,
          seed + 17 * (uint64_t)dt);
    c.sm_count = sm_count;
    check_case(&c);
    teardown(&c);
  }
}

/* Graph replays read the offsets as they are at replay: new sizes in the same array (within the
 * captured bound's filled rows) give the new grouping's result. */
static void test_graph(uint64_t seed) {
  case_t c;
  setup(&c, "graph", 6, 264, 200, TW_BF16, 3, 64, 0, seed);
  for (int64_t g = 0; g <= c.groups; g++) /* every group 3 blocks: all rows below 2304 filled */
    c.h_off[g] = (int32_t)(g * 3 * 128);
  const int64_t filled = c.h_off[c.groups], m = filled + 64;
  free(c.h_a), free(c.h_b), cudaFree(c.a), cudaFree(c.b), cudaFree(c.ws);
  c.m = m, c.lda = c.n, c.ldb = c.k;
  c.h_a = (uint16_t *)malloc((size_t)m * c.lda * 2);
  c.h_b = (uint16_t *)malloc((size_t)m * c.ldb * 2);
  TEST_REQUIRE(c.h_a && c.h_b, "host memory");
  fill_host(&c, filled, seed);
  TEST_CUDA_OK(cudaMalloc(&c.a, (size_t)m * c.lda * 2));
  TEST_CUDA_OK(cudaMalloc(&c.b, (size_t)m * c.ldb * 2));
  TEST_TW_OK(tw_grouped_gemm_wgrad_workspace_size(m, c.n, c.k, &c.ws_bytes));
  TEST_CUDA_OK(cudaMalloc(&c.ws, c.ws_bytes));
  upload(&c);
  cudaStream_t s;
  TEST_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  tw_grouped_gemm_args_t g = args_of(&c);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TEST_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  TEST_TW_OK(tw_grouped_gemm_wgrad(&g, c.ws, c.ws_bytes, (tw_stream_t)s));
  TEST_CUDA_OK(cudaStreamEndCapture(s, &graph));
  TEST_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  uint64_t rng = seed * 3 + 1;
  for (int replay = 0; replay < 4; replay++) {
    if (replay > 0) /* replay 0: the capture's offsets */
      make_offsets(c.h_off, c.groups, 3, &rng);
    TEST_CUDA_OK(cudaMemcpy(c.d_off, c.h_off, (size_t)(c.groups + 1) * 4, cudaMemcpyHostToDevice));
    reference(&c);
    tw_test_poison(c.out, c.out_bytes + kGuard, 0);
    TEST_CUDA_OK(cudaDeviceSynchronize());
    TEST_CUDA_OK(cudaGraphLaunch(exec, s));
    TEST_CUDA_OK(cudaStreamSynchronize(s));
    char step[64];
    snprintf(step, sizeof(step), "graph replay %d", replay);
    expect_bitwise(&c, c.ref, "tw_gemm per group", step);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  teardown(&c);
}

#define REFUSED(g, ws, bytes, needle)                                                              \
  TEST_TW_FAILS(tw_grouped_gemm_wgrad(&(g), (ws), (bytes), (tw_stream_t)0),                        \
                TW_ERR_INVALID_ARGUMENT, (needle))

/* Shapes, strides, pointers, alignment, sizes, the workspace. */
static void refuse_args(case_t *c, void *ws, size_t wsb) {
  tw_grouped_gemm_args_t g;
  TEST_TW_FAILS(tw_grouped_gemm_wgrad(NULL, ws, wsb, (tw_stream_t)0), TW_ERR_INVALID_ARGUMENT,
                "args is NULL");
  g = args_of(c), g.size = 8;
  REFUSED(g, ws, wsb, "args->size");
  g = args_of(c), g.c_dtype = (tw_dtype_t)7;
  REFUSED(g, ws, wsb, "c_dtype");
  g = args_of(c), g.c_dtype = TW_FP16;
  REFUSED(g, ws, wsb, "c_dtype");
  g = args_of(c), g.groups = 0;
  REFUSED(g, ws, wsb, "groups is 0");
  g = args_of(c), g.groups = 70000;
  REFUSED(g, ws, wsb, "groups is 70000");
  g = args_of(c), g.m = 0;
  REFUSED(g, ws, wsb, "m is 0");
  g = args_of(c), g.n = 100;
  REFUSED(g, ws, wsb, "n is 100");
  g = args_of(c), g.k = 0;
  REFUSED(g, ws, wsb, "k is 0");
  g = args_of(c), g.k = 12;
  REFUSED(g, ws, wsb, "k is 12");
  g = args_of(c), g.groups = 65536, g.n = 65536;
  REFUSED(g, ws, wsb, "groups (65536) x n (65536)");
  g = args_of(c), g.lda = c->n - 8;
  REFUSED(g, ws, wsb, "lda is");
  g = args_of(c), g.ldb = c->k + 4;
  REFUSED(g, ws, wsb, "ldb is");
  g = args_of(c), g.ldo = c->k - 8;
  REFUSED(g, ws, wsb, "ldo is");
  g = args_of(c), g.c_dtype = TW_FP32, g.ldo = c->k + 2; /* 16-byte rows: fp32 needs 4 */
  REFUSED(g, ws, wsb, "ldo is");
  g = args_of(c), g.ldo = (int64_t)1 << 32;
  REFUSED(g, ws, wsb, "ldo is");
  const char *null_names[4] = {"a is NULL", "b is NULL", "out is NULL", "offsets is NULL"};
  for (int i = 0; i < 4; i++) {
    g = args_of(c);
    if (i == 0)
      g.a = NULL;
    else if (i == 1)
      g.b = NULL;
    else if (i == 2)
      g.out = NULL;
    else
      g.offsets = NULL;
    REFUSED(g, ws, wsb, null_names[i]);
  }
  g = args_of(c);
  REFUSED(g, NULL, wsb, "workspace is NULL");
  g = args_of(c), g.a = (const char *)c->a + 2;
  REFUSED(g, ws, wsb, "a (");
  g = args_of(c), g.b = (const char *)c->b + 8;
  REFUSED(g, ws, wsb, "b (");
  g = args_of(c), g.out = (char *)c->out + 4;
  REFUSED(g, ws, wsb, "out (");
  g = args_of(c), g.offsets = (const int32_t *)((const char *)c->d_off + 2);
  REFUSED(g, ws, wsb, "offsets (");
  g = args_of(c);
  REFUSED(g, (char *)ws + 8, wsb, "workspace (");
  size_t need = 0;
  TEST_TW_OK(tw_grouped_gemm_wgrad_workspace_size(c->m, c->n, c->k, &need));
  REFUSED(g, ws, need - 1, "workspace_bytes");
  g = args_of(c), g.m = c->m * 2; /* a too small for the bound (the workspace is large enough) */
  REFUSED(g, ws, wsb, "tw_grouped_gemm_wgrad: a");
  g = args_of(c), g.b = (const char *)c->b + (size_t)c->m * c->ldb * 2 - 64; /* runs past b's */
  REFUSED(g, ws, wsb, "tw_grouped_gemm_wgrad: b");
  g = args_of(c), g.groups = c->groups * 2; /* out and offsets hold c->groups */
  REFUSED(g, ws, wsb, "tw_grouped_gemm_wgrad: out");
  g = args_of(c), g.offsets = c->h_off; /* host memory */
  REFUSED(g, ws, wsb, "tw_grouped_gemm_wgrad: offsets");
  g = args_of(c), g.sm_count = 100000;
  REFUSED(g, ws, wsb, "sm_count");
  g = args_of(c), g.sm_count = -1;
  REFUSED(g, ws, wsb, "sm_count");
}

/* The workspace and out against the other buffers; host and other devices' memory. */
static void refuse_memory(case_t *c, void *ws, size_t wsb, int ngpus) {
  tw_grouped_gemm_args_t g = args_of(c);
  void *host_ws = NULL;
  TEST_REQUIRE(posix_memalign(&host_ws, 256, wsb) == 0, "host memory");
  REFUSED(g, host_ws, wsb, "tw_grouped_gemm_wgrad: workspace");
  free(host_ws);
  /* one allocation holding out and then the workspace, overlapping by 256 bytes */
  char *both = NULL;
  TEST_CUDA_OK(cudaMalloc(&both, c->out_bytes + wsb));
  g = args_of(c), g.out = both;
  REFUSED(g, both + c->out_bytes - 256, wsb, "overlaps workspace");
  /* out inside the workspace's range as a whole */
  g = args_of(c), g.out = both + 512;
  REFUSED(g, both, c->out_bytes + wsb, "overlaps workspace");
  cudaFree(both);
  /* a inside the workspace: a's bytes from the workspace's 256th on */
  char *ws_a = NULL;
  const size_t a_bytes = (size_t)c->m * c->lda * 2;
  TEST_CUDA_OK(cudaMalloc(&ws_a, a_bytes + wsb));
  g = args_of(c), g.a = ws_a + 256;
  tw_status_t st = tw_grouped_gemm_wgrad(&g, ws_a, wsb, (tw_stream_t)0);
  TEST_ASSERT(st == TW_ERR_INVALID_ARGUMENT && strstr(tw_last_error(), "overlaps a"),
              "workspace overlapping a: %s (%s)", tw_status_string(st), tw_last_error());
  g = args_of(c), g.offsets = (const int32_t *)(ws_a + 1024);
  REFUSED(g, ws_a, wsb, "overlaps offsets");
  cudaFree(ws_a);
  g = args_of(c), g.out = c->a;
  REFUSED(g, c->ws, c->ws_bytes, "tw_grouped_gemm_wgrad: out");
  if (ngpus >= 2) { /* a on another device */
    void *other = NULL;
    TEST_CUDA_OK(cudaSetDevice(1));
    TEST_CUDA_OK(cudaMalloc(&other, (size_t)c->m * c->lda * 2));
    TEST_CUDA_OK(cudaSetDevice(0));
    g = args_of(c), g.a = other;
    REFUSED(g, ws, wsb, "tw_grouped_gemm_wgrad: a");
    TEST_CUDA_OK(cudaSetDevice(1));
    cudaFree(other);
    TEST_CUDA_OK(cudaSetDevice(0));
  } else {
    printf("refusals: one GPU, another device's pointer not tried\n");
  }
  size_t bytes = 0;
  TEST_TW_FAILS(tw_grouped_gemm_wgrad_workspace_size(c->m, c->n, c->k, NULL),
                TW_ERR_INVALID_ARGUMENT, "bytes is NULL");
  TEST_TW_FAILS(tw_grouped_gemm_wgrad_workspace_size(0, c->n, c->k, &bytes),
                TW_ERR_INVALID_ARGUMENT, "m is 0");
  TEST_TW_FAILS(tw_grouped_gemm_wgrad_workspace_size(c->m, 4, c->k, &bytes),
                TW_ERR_INVALID_ARGUMENT, "n is 4");
  TEST_TW_FAILS(tw_grouped_gemm_wgrad_workspace_size(c->m, c->n, 20, &bytes),
                TW_ERR_INVALID_ARGUMENT, "k is 20");
}

static void test_refusals(int ngpus) {
  case_t c;
  setup(&c, "refusals", 4, 256, 128, TW_BF16, 2, 128, 0, 5);
  size_t wsb = 0; /* for twice the bound, so that a too small m x 2 is what is refused */
  TEST_TW_OK(tw_grouped_gemm_wgrad_workspace_size(c.m * 2, c.n, c.k, &wsb));
  void *ws = NULL;
  TEST_CUDA_OK(cudaMalloc(&ws, wsb));
  tw_test_poison(c.out, c.out_bytes + kGuard, 0);
  tw_test_poison(c.ref, c.out_bytes + kGuard, 0);
  refuse_args(&c, ws, wsb);
  refuse_memory(&c, ws, wsb, ngpus);
  TEST_CUDA_OK(cudaDeviceSynchronize());
  expect_bitwise(&c, c.ref, "the poison", "after the refusals (nothing may run)");
  cudaFree(ws);
  teardown(&c);
}

int main(void) {
  const int ngpus = tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  test_random("one group", 1, 256, 256, 3, 0, 0, 0, seed);
  test_random("tails, strides, spare bound", 8, 264, 200, 4, 77, 8, 0, seed + 100);
  test_random("n of 2 row blocks", 16, 136, 520, 2, 128, 0, 0, seed + 200);
  test_random("wide", 4, 1024, 2048, 6, 0, 0, 0, seed + 300);
  test_random("many small groups", 32, 512, 384, 1, 200, 16, 0, seed + 400);
  test_random("every group empty", 5, 256, 264, 0, 300, 0, 0, seed + 500);
  test_random("3 SMs", 8, 264, 200, 4, 77, 8, 3, seed + 600);
  test_random("k below one tile", 6, 384, 8, 3, 5, 0, 0, seed + 700);
  test_graph(seed + 800);
  test_refusals(ngpus);
  return tw_test_finish();
}
