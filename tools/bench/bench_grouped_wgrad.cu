/*
 * `tw-bench grouped_wgrad`: an MoE layer's expert weight gradients, E experts of m rows each
 * (group-major rows, group e's rows [e m, (e + 1) m)):
 *   out[e][n, k] = a_e^T b_e,  a [E m, n] (the gradient of the experts' output), b [E m, k]
 *   (their input), fp32 out (TW_BENCH_WGRAD_OUT=bf16: bf16 out, every row alike).
 * Shape: m = rows per expert, n, k; E from the sweep's label ("E=32 ...") or, for a shape given
 * with --m/--n/--k, TW_BENCH_GROUPED_EXPERTS (default 8). Rows:
 *   tilewire       tw_grouped_gemm_wgrad, its transposes and the K-grouped GEMM, one call
 *   tw_gemm-dense  tw_gemm of one dense [n, E m] x [k, E m]^T product (K-major operands, no
 *                  transpose): the same FLOPs, the core's speed with no grouping
 *   cublas-dense   cuBLAS (cublasGemmEx, as tw-bench gemm) of the same dense product
 *   cublas-loop    one cublasGemmEx per expert on a and b as they lie (NT: no transpose), in
 *                  turn on one stream, the host knowing the offsets: the unfused way, and the
 *                  baseline (speedup = cublas-loop time / this time)
 * TFLOP/s from 2 * E * m * n * k. With --sm-budget S every row runs on S SMs (tw's sm_count,
 * cuBLAS's cublasSetSmCountTarget). Timing as tw-bench grouped_gemm: TW_BENCH_GEMM_ROUNDS
 * interleaved rounds (default 3) of bench_time_ms, the row the median of the rounds' medians,
 * p10/p90 the lowest and highest round median; inputs and outputs rotate through copies of at
 * least 4x the L2. The check (before timing, random inputs, outputs poisoned): tilewire within
 * 1e-2 (bf16 out) or 1e-3 (fp32 out) relative of cublas-loop, tw_gemm-dense of cublas-dense;
 * a row fails when it leaves an element of its output non-finite. (tests/gpu/test_grouped_wgrad
 * checks tilewire bitwise against tw_gemm per expert.)
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ref/ref_gemm.h"
#include "tw_test.h"

/* m = rows per expert, n, k; the label's "E=" is the expert count. */
static const bench_shape_t wgrad_sweep[] = {
    {1024, 4096, 7168, "E=32 dsv3-ep8-gate-up"}, /* DeepSeek-V3's gate+up weights at EP8 */
    {128, 4096, 7168, "E=32 dsv3-gate-up-128"},  /* 128 rows an expert */
    {1024, 7168, 2048, "E=32 dsv3-ep8-down"},    /* its down projection's */
    {128, 7168, 2048, "E=32 dsv3-down-128"},     {1024, 14336, 4096, "E=8 mixtral"},
};
static const bench_shape_t wgrad_quick[] = {
    {1024, 7168, 2048, "E=32 dsv3-ep8-down"},
    {128, 4096, 7168, "E=32 dsv3-gate-up-128"},
};

enum { kMaxExperts = 65536, kDefaultExperts = 8 };

typedef struct wg_ctx {
  cudaStream_t stream;
  tw_ref_blas_t *blas;   /* the dense cuBLAS row (tw_ref_cublas_gemm: TN) */
  cublasHandle_t handle; /* the loop's NT GEMMs */
  void *blas_ws;         /* its workspace */
  int copies;
  void **a, **b, **out;    /* per copy: a [T, n], b [T, k], out [E][n, k] (T = E m) */
  void **at, **bt, **dout; /* per copy: the dense product's a [n, T], b [k, T], out [n, k] */
  void *ref;               /* the check's second output */
  void *ws;                /* tw_grouped_gemm_wgrad's workspace */
  size_t ws_bytes, out_bytes, dout_bytes;
  int64_t experts, rows, total, n, k;
  tw_dtype_t dt;
  int sm_count;
  int32_t *offsets; /* device, [experts + 1] */
  char label[96];
} wg_ctx_t;

/* ---- one call of each library ------------------------------------------------------------- */

static tw_status_t call_wgrad(const wg_ctx_t *c, int i) {
  tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
  g.c_dtype = c->dt;
  g.a = c->a[i];
  g.b = c->b[i];
  g.out = c->out[i];
  g.offsets = c->offsets;
  g.m = c->total;
  g.n = c->n;
  g.k = c->k;
  g.groups = c->experts;
  g.sm_count = c->sm_count;
  return tw_grouped_gemm_wgrad(&g, c->ws, c->ws_bytes, (tw_stream_t)c->stream);
}

static tw_status_t call_tw_dense(const wg_ctx_t *c, int i, void *out) {
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.c_dtype = c->dt;
  g.a = c->at[i];
  g.b = c->bt[i];
  g.c = out;
  g.m = c->n;
  g.n = c->k;
  g.k = c->total;
  g.sm_count = c->sm_count;
  return tw_gemm(&g, (tw_stream_t)c->stream);
}

static tw_status_t call_cublas_dense(const wg_ctx_t *c, int i, void *out) {
  return tw_ref_cublas_gemm(c->blas, c->at[i], c->bt[i], out, c->dt, c->n, c->k, c->total, c->total,
                            c->total, c->k, c->sm_count, c->stream);
}

static tw_status_t blas_status(cublasStatus_t s, const char *what) {
  if (s == CUBLAS_STATUS_SUCCESS)
    return TW_SUCCESS;
  fprintf(stderr, "tw-bench grouped_wgrad: %s: %s\n", what, cublasGetStatusString(s));
  return TW_ERR_CUDA;
}

/* Row-major out_e [n, k] = a_e^T b_e is column-major out_e^T [k, n] = B A^T with B = b_e
 * (column-major [k, rows], ld k) and A = a_e (column-major [n, rows], ld n): "NT". */
static tw_status_t call_cublas_loop(const wg_ctx_t *c, int i, void *out) {
  const float alpha = 1.f, beta = 0.f;
  const size_t es = c->dt == TW_BF16 ? 2 : 4;
  for (int64_t e = 0; e < c->experts; e++) {
    const size_t r0 = (size_t)(e * c->rows);
    cublasStatus_t s =
        cublasGemmEx(c->handle, CUBLAS_OP_N, CUBLAS_OP_T, (int)c->k, (int)c->n, (int)c->rows,
                     &alpha, (const char *)c->b[i] + r0 * (size_t)c->k * 2, CUDA_R_16BF, (int)c->k,
                     (const char *)c->a[i] + r0 * (size_t)c->n * 2, CUDA_R_16BF, (int)c->n, &beta,
                     (char *)out + (size_t)(e * c->n) * (size_t)c->k * es,
                     c->dt == TW_FP32 ? CUDA_R_32F : CUDA_R_16BF, (int)c->k, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
      return blas_status(s, "cublasGemmEx");
  }
  return TW_SUCCESS;
}

/* ---- the rows ------------------------------------------------------------------------------ */

typedef enum { V_WGRAD, V_TW_DENSE, V_CUBLAS_DENSE, V_CUBLAS_LOOP } kind_t;

typedef struct variant {
  const char *name;
  kind_t kind;
  double t[BENCH_MAX_ROUNDS]; /* the median of each round */
  int ok;
} variant_t;

static tw_status_t call_variant(const wg_ctx_t *c, const variant_t *v, int i) {
  switch (v->kind) {
  case V_WGRAD: return call_wgrad(c, i);
  case V_TW_DENSE: return call_tw_dense(c, i, c->dout[i]);
  case V_CUBLAS_DENSE: return call_cublas_dense(c, i, c->dout[i]);
  default: return call_cublas_loop(c, i, c->out[i]);
  }
}

typedef struct timed {
  wg_ctx_t *c;
  const variant_t *v;
} timed_t;

static void run_timed(void *p, int iter) {
  const timed_t *t = (const timed_t *)p;
  tw_status_t st = call_variant(t->c, t->v, iter % t->c->copies);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "tw-bench grouped_wgrad: %s: %s (%s)\n", t->v->name, tw_status_string(st),
            tw_last_error());
    exit(1);
  }
}

/* ---- the check ---------------------------------------------------------------------------- */

static int call_failed(const wg_ctx_t *c, const char *what, tw_status_t st) {
  fprintf(stderr, "grouped_wgrad %s: %s: %s (%s)\n", c->label, what, tw_status_string(st),
          tw_last_error());
  return -1;
}

/* rel err of x against y (count elements), and the non-finite values of each. */
static double compare(const wg_ctx_t *c, const void *x, const void *y, size_t count, size_t *bad_x,
                      size_t *bad_y) {
  BENCH_CUDA(cudaStreamSynchronize(c->stream));
  double err;
  if (c->dt == TW_FP32) {
    err = tw_test_rel_err_fp32((const float *)x, (const float *)y, count, bad_x);
    (void)tw_test_rel_err_fp32((const float *)y, (const float *)x, count, bad_y);
  } else {
    err = tw_test_rel_err_bf16(x, y, 0, count, bad_x);
    (void)tw_test_rel_err_bf16(y, x, 0, count, bad_y);
  }
  BENCH_CUDA(cudaGetLastError());
  return err;
}

/* x's row against y's row: copy 0's outputs, both poisoned first (NaN). */
static int check_pair(wg_ctx_t *c, variant_t *vx, variant_t *vy, void *x, void *y, size_t bytes) {
  BENCH_CUDA(cudaMemsetAsync(x, 0xFF, bytes, c->stream));
  BENCH_CUDA(cudaMemsetAsync(y, 0xFF, bytes, c->stream));
  tw_status_t st;
  if ((st = call_variant(c, vx, 0)) != TW_SUCCESS)
    return call_failed(c, vx->name, st);
  if (vy->kind == V_CUBLAS_LOOP)
    st = call_cublas_loop(c, 0, y);
  else
    st = call_cublas_dense(c, 0, y);
  if (st != TW_SUCCESS)
    return call_failed(c, vy->name, st);
  size_t bad_x = 0, bad_y = 0;
  const size_t count = bytes / (c->dt == TW_BF16 ? 2 : 4);
  const double err = compare(c, x, y, count, &bad_x, &bad_y);
  const double tol = c->dt == TW_BF16 ? 1e-2 : 1e-3;
  vx->ok = err < tol && bad_x == 0;
  vy->ok = bad_y == 0;
  if (!vx->ok || !vy->ok)
    fprintf(stderr,
            "grouped_wgrad %s: %s vs %s: rel err %.3g (tolerance %.0e), %zu / %zu "
            "non-finite\n",
            c->label, vx->name, vy->name, err, tol, bad_x, bad_y);
  return 0;
}

/* ---- setup -------------------------------------------------------------------------------- */

/* The shape's contract (tw_grouped_gemm_wgrad's, cuBLAS's int dimensions): 0, or -1 saying why
 * not. */
static int shape_ok(const bench_shape_t *shape, int64_t experts) {
  if (experts < 1) {
    fprintf(stderr, "tw-bench grouped_wgrad: TW_BENCH_GROUPED_EXPERTS wants 1 .. %d\n",
            kMaxExperts);
    return -1;
  }
  if (shape->m < 128 || shape->m % 128 || shape->m * experts > (int64_t)INT32_MAX - 256) {
    fprintf(stderr,
            "tw-bench grouped_wgrad: m (rows per expert) is %lld; expected a multiple of 128 "
            "with m x experts (%lld) below 2^31 - 256\n",
            (long long)shape->m, (long long)experts);
    return -1;
  }
  if (shape->n < 8 || shape->n % 8 || shape->n * experts > (int64_t)INT32_MAX - 128 * experts ||
      shape->k < 8 || shape->k % 8 || shape->k > (int64_t)INT32_MAX) {
    fprintf(stderr,
            "tw-bench grouped_wgrad: n %lld, k %lld: expected multiples of 8, n x experts "
            "(%lld) and k below 2^31\n",
            (long long)shape->n, (long long)shape->k, (long long)experts);
    return -1;
  }
  return 0;
}

static void **alloc_copies(int copies, size_t bytes, uint64_t seed, cudaStream_t stream) {
  void **p = (void **)calloc((size_t)copies, sizeof(void *));
  if (!p) {
    fprintf(stderr, "tw-bench: out of host memory (%d copies)\n", copies);
    exit(3);
  }
  for (int i = 0; i < copies; i++) {
    BENCH_CUDA(cudaMalloc(&p[i], bytes));
    if (seed)
      tw_test_fill_bf16(p[i], bytes / 2, seed + 2 * (uint64_t)i, (tw_stream_t)stream);
  }
  return p;
}

static void free_copies(void **p, int copies) {
  for (int i = 0; i < copies; i++)
    cudaFree(p[i]);
  free(p);
}

static int wg_setup(wg_ctx_t *c, const bench_opts_t *opts, const bench_shape_t *shape,
                    int64_t experts, tw_ref_blas_t *blas, cublasHandle_t handle, void *blas_ws) {
  memset(c, 0, sizeof(*c));
  const char *out_env = getenv("TW_BENCH_WGRAD_OUT");
  c->dt = out_env && strcmp(out_env, "bf16") == 0 ? TW_BF16 : TW_FP32;
  c->experts = experts;
  c->rows = shape->m;
  c->total = experts * shape->m;
  c->n = shape->n;
  c->k = shape->k;
  c->sm_count = opts->sm_budget;
  c->blas = blas;
  c->handle = handle;
  c->blas_ws = blas_ws;
  BENCH_CUDA(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  const size_t es = c->dt == TW_BF16 ? 2 : 4;
  const size_t a_bytes = (size_t)(c->total * c->n) * 2, b_bytes = (size_t)(c->total * c->k) * 2;
  c->out_bytes = (size_t)(experts * c->n) * (size_t)c->k * es;
  c->dout_bytes = (size_t)(c->n * c->k) * es;
  c->copies = bench_rotation_count(a_bytes + b_bytes + c->out_bytes);
  c->a = alloc_copies(c->copies, a_bytes, 3000, c->stream);
  c->b = alloc_copies(c->copies, b_bytes, 3001, c->stream);
  c->out = alloc_copies(c->copies, c->out_bytes, 0, c->stream);
  c->at = alloc_copies(c->copies, a_bytes, 4000, c->stream);
  c->bt = alloc_copies(c->copies, b_bytes, 4001, c->stream);
  c->dout = alloc_copies(c->copies, c->dout_bytes, 0, c->stream);
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaMalloc(&c->ref, c->out_bytes));
  if (tw_grouped_gemm_wgrad_workspace_size(c->total, c->n, c->k, &c->ws_bytes) != TW_SUCCESS)
    return -1;
  BENCH_CUDA(cudaMalloc(&c->ws, c->ws_bytes));
  int32_t *host = (int32_t *)calloc((size_t)(experts + 1), sizeof(int32_t));
  if (!host) {
    fprintf(stderr, "tw-bench: out of host memory (%lld offsets)\n", (long long)experts);
    exit(3);
  }
  for (int64_t e = 0; e <= experts; e++)
    host[e] = (int32_t)(e * c->rows);
  BENCH_CUDA(cudaMalloc(&c->offsets, (size_t)(experts + 1) * sizeof(int32_t)));
  BENCH_CUDA(cudaMemcpy(c->offsets, host, (size_t)(experts + 1) * sizeof(int32_t),
                        cudaMemcpyHostToDevice));
  free(host);
  const int len = snprintf(c->label, sizeof(c->label), "M=%lldx%lld N=%lld K=%lld %s",
                           (long long)experts, (long long)c->rows, (long long)c->n, (long long)c->k,
                           c->dt == TW_BF16 ? "bf16" : "fp32");
  if (c->sm_count && len > 0 && (size_t)len < sizeof(c->label))
    snprintf(c->label + len, sizeof(c->label) - (size_t)len, " sms=%d", c->sm_count);
  if (blas_status(cublasSetStream(handle, c->stream), "cublasSetStream") != TW_SUCCESS ||
      blas_status(cublasSetWorkspace(handle, blas_ws, 32u << 20), "cublasSetWorkspace") !=
          TW_SUCCESS ||
      blas_status(cublasSetSmCountTarget(handle, c->sm_count), "cublasSetSmCountTarget") !=
          TW_SUCCESS)
    return -1;
  return 0;
}

static void wg_teardown(wg_ctx_t *c) {
  BENCH_CUDA(cudaStreamSynchronize(c->stream));
  free_copies(c->a, c->copies);
  free_copies(c->b, c->copies);
  free_copies(c->out, c->copies);
  free_copies(c->at, c->copies);
  free_copies(c->bt, c->copies);
  free_copies(c->dout, c->copies);
  cudaFree(c->ref);
  cudaFree(c->ws);
  cudaFree(c->offsets);
  BENCH_CUDA(cudaStreamDestroy(c->stream));
}

/* ---- timing and rows ---------------------------------------------------------------------- */

static void add_row(bench_results_t *res, const wg_ctx_t *c, const variant_t *v, double ms,
                    double p10, double p90, double baseline_ms) {
  bench_add_timed_row(res, "grouped_wgrad", v->name, c->label, ms, p10, p90,
                      2.0 * (double)c->total * (double)c->n * (double)c->k, baseline_ms, v->ok);
}

enum { kVariants = 4 };

static int wgrad_run(const bench_opts_t *opts, const bench_shape_t *shape, bench_results_t *res) {
  static tw_ref_blas_t *blas = NULL;
  static cublasHandle_t handle = NULL;
  static void *blas_ws = NULL;
  const int64_t experts = bench_grouped_experts(shape, kDefaultExperts, kMaxExperts);
  if (shape_ok(shape, experts) != 0)
    return 1;
  if (!blas && tw_ref_blas_create(&blas) != TW_SUCCESS)
    return 1;
  if (!handle) {
    if (blas_status(cublasCreate(&handle), "cublasCreate") != TW_SUCCESS)
      return 1;
    BENCH_CUDA(cudaMalloc(&blas_ws, 32u << 20));
  }
  wg_ctx_t c;
  int rc = wg_setup(&c, opts, shape, experts, blas, handle, blas_ws);
  variant_t variants[kVariants] = {
      {"tilewire", V_WGRAD, {0}, 1},
      {"tw_gemm-dense", V_TW_DENSE, {0}, 1},
      {"cublas-dense", V_CUBLAS_DENSE, {0}, 1},
      {"cublas-loop", V_CUBLAS_LOOP, {0}, 1},
  };
  if (rc == 0 && opts->check) {
    rc = check_pair(&c, &variants[0], &variants[3], c.out[0], c.ref, c.out_bytes);
    if (rc == 0)
      rc = check_pair(&c, &variants[1], &variants[2], c.dout[0], c.ref, c.dout_bytes);
  } else if (rc == 0) { /* one call of each row turns a refused call into a setup error */
    for (int v = 0; v < kVariants && rc == 0; v++) {
      tw_status_t st = call_variant(&c, &variants[v], 0);
      if (st != TW_SUCCESS)
        rc = call_failed(&c, variants[v].name, st);
    }
  }
  if (rc != 0) {
    wg_teardown(&c);
    return 1;
  }
  const int rounds = bench_gemm_rounds();
  for (int r = 0; r < rounds; r++) /* interleaved, so drift falls on every row alike */
    for (int v = 0; v < kVariants; v++) {
      timed_t t = {&c, &variants[v]};
      variants[v].t[r] =
          bench_time_ms(run_timed, &t, c.stream, opts->warmup, opts->repeats, NULL, NULL);
    }
  double median[kVariants];
  for (int v = 0; v < kVariants; v++)
    median[v] = bench_median(variants[v].t, rounds);
  for (int v = 0; v < kVariants; v++)
    add_row(res, &c, &variants[v], median[v], variants[v].t[0], variants[v].t[rounds - 1],
            median[3]);
  wg_teardown(&c);
  return 0;
}

static const bench_op_t grouped_wgrad_op = {
    "grouped_wgrad",
    "MoE experts' weight gradients (tw_grouped_gemm_wgrad) vs a cuBLAS loop and dense "
    "tw_gemm/cuBLAS; m = rows per expert, E in the label or TW_BENCH_GROUPED_EXPERTS (8)",
    wgrad_sweep,
    (int)(sizeof(wgrad_sweep) / sizeof(wgrad_sweep[0])),
    wgrad_quick,
    (int)(sizeof(wgrad_quick) / sizeof(wgrad_quick[0])),
    wgrad_run,
};
BENCH_OP_REGISTER(grouped_wgrad, grouped_wgrad_op, 16);
