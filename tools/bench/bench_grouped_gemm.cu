/*
 * `tw-bench grouped_gemm`: an MoE layer's expert GEMMs, E experts of m rows each (group-major
 * rows, group e's rows [offsets[e], offsets[e + 1]) of a and out, offsets multiples of 128):
 *   out[E * m, n] = a[E * m, k] * b[e][n, k]^T for the rows of expert e, bf16 in and out.
 * Shape: m = rows per expert, n, k; E from the sweep's label ("E=32 ...") or, for a shape given
 * with --m/--n/--k, TW_BENCH_GROUPED_EXPERTS (default 8): `TW_BENCH_GROUPED_EXPERTS=32 tw-bench
 * grouped_gemm --m 1024 --n 4096 --k 7168` is the sweep's first shape. Rows:
 *   tilewire       tw_grouped_gemm, one launch, the offsets in device memory
 *   tw_gemm-dense  tw_gemm of one dense [E * m, k] x [n, k] product (expert 0's weights): the
 *                  same FLOPs, the core's speed with no grouping
 *   cublas-dense   cuBLAS (cublasGemmEx, as tw-bench gemm) of the same dense product
 *   cublas-loop    one cuBLAS GEMM per expert, in turn on one stream: the unfused way, and the
 *                  baseline (speedup = cublas-loop time / this time), as the unfused pipeline
 *                  is the baseline of the fused ops
 * TW_BENCH_GROUPED_SKEW=S (S > 0; 1 is a seed like any other) adds tilewire-skew and
 * cublas-loop-skew: the same total rows split unevenly (multiples of 128 drawn from seed S, some
 * experts empty; the sizes go to stderr), their speedup over cublas-loop-skew.
 * TFLOP/s from 2 * E * m * n * k. With --sm-budget S every row runs on S SMs (tw's sm_count,
 * cuBLAS's cublasSetSmCountTarget). Timing as tw-bench gemm: TW_BENCH_GEMM_ROUNDS interleaved
 * rounds (default 3) of bench_time_ms, the row the median of the rounds' medians, p10/p90 the
 * lowest and highest round median; inputs rotate through copies of at least 4x the L2.
 * The check (before timing, on random inputs, the outputs poisoned): tilewire bitwise equal to
 * tw_gemm of each expert's rows on its own (the header's promise: the same core and order of
 * accumulation) and within 1e-2 relative of cublas-loop; tw_gemm-dense within 1e-2 of
 * cublas-dense; a cuBLAS row fails when it leaves a row of its output unwritten.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ref/ref_gemm.h"
#include "tw_test.h"

/* m = rows per expert, n, k; the label's "E=" is the expert count. */
static const bench_shape_t grouped_sweep[] = {
    {1024, 4096, 7168, "E=32 dsv3-ep8-gate-up"}, /* DeepSeek-V3 gate+up at EP8 */
    {1024, 7168, 2048, "E=32 dsv3-ep8-down"},    /* its down projection */
    {4096, 14336, 4096, "E=8 mixtral"},
    {128, 4096, 7168, "E=32 decode"}, /* decode-sized groups */
};
static const bench_shape_t grouped_quick[] = {
    {1024, 4096, 7168, "E=32 dsv3-ep8-gate-up"},
    {128, 4096, 7168, "E=32 decode"},
};

enum { kRowBlock = 128, kMaxExperts = 65536, kDefaultExperts = 8 };

typedef struct gg_ctx {
  cudaStream_t stream;
  tw_ref_blas_t *blas;
  int copies;
  void **a, **b, **out;           /* per copy: a [m, k], b [experts][n, k], out [m, n] */
  void *ref;                      /* the check's second output */
  int64_t experts, rows, m, n, k; /* m = experts * rows */
  size_t out_bytes;
  int sm_count;
  int sets;                 /* 1, or 2 with the skewed offsets */
  int32_t *offsets[2];      /* device, [experts + 1]: uniform, skewed */
  int32_t *host_offsets[2]; /* the same on the host (the per-expert loops) */
  char label[96];           /* the rows' shape column */
} gg_ctx_t;

/* ---- one call of each library ------------------------------------------------------------- */

static tw_status_t call_grouped(const gg_ctx_t *c, int i, void *out, int set) {
  tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
  g.a = c->a[i];
  g.b = c->b[i];
  g.out = out;
  g.offsets = c->offsets[set];
  g.m = c->m;
  g.n = c->n;
  g.k = c->k;
  g.groups = c->experts;
  g.sm_count = c->sm_count;
  return tw_grouped_gemm(&g, (tw_stream_t)c->stream);
}

static tw_status_t call_tw_gemm(const gg_ctx_t *c, const void *a, const void *b, void *out,
                                int64_t m) {
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.a = a;
  g.b = b;
  g.c = out;
  g.m = m;
  g.n = c->n;
  g.k = c->k;
  g.sm_count = c->sm_count;
  return tw_gemm(&g, (tw_stream_t)c->stream);
}

static tw_status_t call_cublas(const gg_ctx_t *c, const void *a, const void *b, void *out,
                               int64_t m) {
  return tw_ref_cublas_gemm(c->blas, a, b, out, TW_BF16, m, c->n, c->k, c->k, c->k, c->n,
                            c->sm_count, c->stream);
}

/* One GEMM per non-empty expert of offsets[set], in turn on the stream: cuBLAS, or tw_gemm
 * (the check's reference). */
static tw_status_t call_loop(const gg_ctx_t *c, int i, void *out, int set, int cublas) {
  const int32_t *off = c->host_offsets[set];
  for (int64_t e = 0; e < c->experts; e++) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0)
      continue;
    const char *a = (const char *)c->a[i] + (size_t)off[e] * (size_t)c->k * 2;
    const char *b = (const char *)c->b[i] + (size_t)(e * c->n) * (size_t)c->k * 2;
    char *o = (char *)out + (size_t)off[e] * (size_t)c->n * 2;
    tw_status_t st = cublas ? call_cublas(c, a, b, o, rows) : call_tw_gemm(c, a, b, o, rows);
    if (st != TW_SUCCESS)
      return st;
  }
  return TW_SUCCESS;
}

/* ---- the rows ------------------------------------------------------------------------------ */

typedef enum { V_GROUPED, V_TW_DENSE, V_CUBLAS_DENSE, V_CUBLAS_LOOP } kind_t;

typedef struct variant {
  const char *name;
  kind_t kind;
  int set;                    /* the offsets (grouped and loop rows): 0 uniform, 1 skewed */
  double t[BENCH_MAX_ROUNDS]; /* the median of each round */
  int ok;
} variant_t;

static tw_status_t call_variant(const gg_ctx_t *c, const variant_t *v, int i, void *out) {
  switch (v->kind) {
  case V_GROUPED: return call_grouped(c, i, out, v->set);
  case V_TW_DENSE: return call_tw_gemm(c, c->a[i], c->b[i], out, c->m);
  case V_CUBLAS_DENSE: return call_cublas(c, c->a[i], c->b[i], out, c->m);
  default: return call_loop(c, i, out, v->set, 1);
  }
}

typedef struct timed {
  gg_ctx_t *c;
  const variant_t *v;
} timed_t;

static void run_timed(void *p, int iter) {
  const timed_t *t = (const timed_t *)p;
  const int i = iter % t->c->copies;
  tw_status_t st = call_variant(t->c, t->v, i, t->c->out[i]);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "tw-bench grouped_gemm: %s: %s (%s)\n", t->v->name, tw_status_string(st),
            tw_last_error());
    exit(1);
  }
}

/* ---- the check ---------------------------------------------------------------------------- */

/* A failed call before timing: says which and returns -1 (the shape's setup error). */
static int call_failed(const gg_ctx_t *c, const char *what, tw_status_t st) {
  fprintf(stderr, "grouped_gemm %s: %s: %s (%s)\n", c->label, what, tw_status_string(st),
          tw_last_error());
  return -1;
}

/* rel err of x against y over the whole output, and the non-finite values of x and of y (rows
 * left poisoned). The stream is drained first: the helpers run on the legacy stream. */
static double compare(const gg_ctx_t *c, const void *x, const void *y, size_t *bad_x,
                      size_t *bad_y) {
  const size_t count = c->out_bytes / 2;
  BENCH_CUDA(cudaStreamSynchronize(c->stream));
  const double err = tw_test_rel_err_bf16(x, y, 0, count, bad_x);
  (void)tw_test_rel_err_bf16(y, x, 0, count, bad_y);
  BENCH_CUDA(cudaGetLastError());
  return err;
}

/* tw_grouped_gemm over offsets[set] against tw_gemm of each expert's rows (bitwise; the two
 * outputs poisoned differently, so a row neither writes differs too) and against the cuBLAS loop
 * (rel err). Sets v_tw->ok and v_loop->ok; -1 when a call fails. */
static int check_grouped(gg_ctx_t *c, int set, variant_t *v_tw, variant_t *v_loop) {
  tw_status_t st;
  BENCH_CUDA(cudaMemsetAsync(c->out[0], 0xFF, c->out_bytes, c->stream)); // NaN poison
  BENCH_CUDA(cudaMemsetAsync(c->ref, 0xFE, c->out_bytes, c->stream));
  if ((st = call_grouped(c, 0, c->out[0], set)) != TW_SUCCESS)
    return call_failed(c, v_tw->name, st);
  if ((st = call_loop(c, 0, c->ref, set, 0)) != TW_SUCCESS)
    return call_failed(c, "tw_gemm per expert", st);
  BENCH_CUDA(cudaStreamSynchronize(c->stream));
  const size_t diff = tw_test_count_diff(c->out[0], c->ref, c->out_bytes);
  BENCH_CUDA(cudaGetLastError());

  BENCH_CUDA(cudaMemsetAsync(c->ref, 0xFF, c->out_bytes, c->stream));
  if ((st = call_loop(c, 0, c->ref, set, 1)) != TW_SUCCESS)
    return call_failed(c, v_loop->name, st);
  size_t bad_tw = 0, bad_blas = 0;
  const double err = compare(c, c->out[0], c->ref, &bad_tw, &bad_blas);
  v_tw->ok = diff == 0 && err < 1e-2 && bad_tw == 0;
  v_loop->ok = bad_blas == 0;
  if (diff)
    fprintf(stderr, "grouped_gemm %s: %s: %zu of %zu bytes differ from tw_gemm per expert\n",
            c->label, v_tw->name, diff, c->out_bytes);
  if (!(err < 1e-2) || bad_tw)
    fprintf(stderr, "grouped_gemm %s: %s vs %s: rel err %.3g, %zu non-finite\n", c->label,
            v_tw->name, v_loop->name, err, bad_tw);
  if (bad_blas)
    fprintf(stderr, "grouped_gemm %s: %s: %zu non-finite values (rows left unwritten?)\n", c->label,
            v_loop->name, bad_blas);
  return 0;
}

/* tw_gemm of the dense product against cuBLAS's, as tw-bench gemm checks it. */
static int check_dense(gg_ctx_t *c, variant_t *v_tw, variant_t *v_blas) {
  tw_status_t st;
  BENCH_CUDA(cudaMemsetAsync(c->out[0], 0xFF, c->out_bytes, c->stream));
  BENCH_CUDA(cudaMemsetAsync(c->ref, 0xFF, c->out_bytes, c->stream));
  if ((st = call_tw_gemm(c, c->a[0], c->b[0], c->out[0], c->m)) != TW_SUCCESS)
    return call_failed(c, v_tw->name, st);
  if ((st = call_cublas(c, c->a[0], c->b[0], c->ref, c->m)) != TW_SUCCESS)
    return call_failed(c, v_blas->name, st);
  size_t bad_tw = 0, bad_blas = 0;
  const double err = compare(c, c->out[0], c->ref, &bad_tw, &bad_blas);
  v_tw->ok = err < 1e-2 && bad_tw == 0;
  v_blas->ok = bad_blas == 0;
  if (!v_tw->ok || !v_blas->ok)
    fprintf(stderr, "grouped_gemm %s: %s vs %s: rel err %.3g, %zu / %zu non-finite\n", c->label,
            v_tw->name, v_blas->name, err, bad_tw, bad_blas);
  return 0;
}

/* Without --check, one call of each row before timing still turns a refused call into the
 * shape's setup error. */
static int probe(gg_ctx_t *c, const variant_t *variants, int nvariants) {
  for (int v = 0; v < nvariants; v++) {
    tw_status_t st = call_variant(c, &variants[v], 0, c->out[0]);
    if (st != TW_SUCCESS)
      return call_failed(c, variants[v].name, st);
  }
  BENCH_CUDA(cudaStreamSynchronize(c->stream));
  return 0;
}

/* ---- setup -------------------------------------------------------------------------------- */

/* Uneven expert sizes, multiples of 128 summing to experts * rows: about one expert in eight
 * empty (at least one of four or more), the others' weights exponential (a few get several times
 * the mean, as an unbalanced router's), the offsets the rounded prefix sums of the weights (so
 * they add up exactly; a small weight may round to an empty expert too). */
static void skew_offsets(int64_t experts, int64_t blocks, uint64_t seed, int32_t *off) {
  double *w = (double *)calloc((size_t)experts, sizeof(double));
  if (!w) {
    fprintf(stderr, "tw-bench: out of host memory (%lld weights)\n", (long long)experts);
    exit(3);
  }
  uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  int64_t empty = 0;
  double sum = 0;
  for (int64_t e = 0; e < experts; e++) {
    const double u = (double)(tw_test_xorshift(&state) >> 11) * (1.0 / 9007199254740992.0);
    const int none = experts >= 4 && tw_test_xorshift(&state) % 8 == 0;
    w[e] = none ? 0.0 : -log(1.0 - u);
    empty += none;
  }
  if (experts >= 4 && empty == 0)
    w[tw_test_xorshift(&state) % (uint64_t)experts] = 0.0;
  for (int64_t e = 0; e < experts; e++)
    sum += w[e];
  if (!(sum > 0)) { /* every weight drawn zero: one expert takes all */
    w[0] = 1.0;
    sum = 1.0;
  }
  double prefix = 0;
  off[0] = 0;
  for (int64_t e = 0; e < experts; e++) {
    prefix += w[e];
    const int64_t at = e + 1 == experts ? blocks : llround((double)blocks * prefix / sum);
    off[e + 1] = (int32_t)((at < off[e] / kRowBlock ? off[e] / kRowBlock : at) * kRowBlock);
  }
  free(w);
}

/* The shape's contract (tw_grouped_gemm's, and the int32 offsets): 0, or -1 saying why not. */
static int shape_ok(const bench_shape_t *shape, int64_t experts) {
  if (experts < 1) {
    fprintf(stderr, "tw-bench grouped_gemm: TW_BENCH_GROUPED_EXPERTS wants 1 .. %d\n", kMaxExperts);
    return -1;
  }
  if (shape->m < kRowBlock || shape->m % kRowBlock ||
      shape->m * experts > (int64_t)INT32_MAX - kRowBlock) {
    fprintf(stderr,
            "tw-bench grouped_gemm: m (rows per expert) is %lld; expected a multiple of %d with "
            "m x experts (%lld) below 2^31 - %d\n",
            (long long)shape->m, kRowBlock, (long long)experts, kRowBlock);
    return -1;
  }
  if (shape->n < 8 || shape->n % 8 || shape->n * experts > (int64_t)INT32_MAX || shape->k < 8 ||
      shape->k % 8 || shape->k > (int64_t)INT32_MAX) {
    fprintf(stderr,
            "tw-bench grouped_gemm: n %lld, k %lld: expected multiples of 8, n x experts (%lld) "
            "and k below 2^31\n",
            (long long)shape->n, (long long)shape->k, (long long)experts);
    return -1;
  }
  return 0;
}

static void upload_offsets(gg_ctx_t *c, int set) {
  const size_t bytes = (size_t)(c->experts + 1) * sizeof(int32_t);
  BENCH_CUDA(cudaMalloc(&c->offsets[set], bytes));
  BENCH_CUDA(cudaMemcpyAsync(c->offsets[set], c->host_offsets[set], bytes, cudaMemcpyHostToDevice,
                             c->stream));
}

/* Allocates and fills `copies` rotations of a, b and out, the check's output, and the offsets
 * (the skewed ones with skew_seed > 0). */
static void gg_setup(gg_ctx_t *c, const bench_opts_t *opts, const bench_shape_t *shape,
                     int64_t experts, uint64_t skew_seed, tw_ref_blas_t *blas) {
  memset(c, 0, sizeof(*c));
  c->experts = experts;
  c->rows = shape->m;
  c->m = experts * shape->m;
  c->n = shape->n;
  c->k = shape->k;
  c->sm_count = opts->sm_budget;
  c->blas = blas;
  BENCH_CUDA(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  const size_t a_bytes = (size_t)(c->m * c->k) * 2, b0_bytes = (size_t)(c->n * c->k) * 2;
  const size_t b_bytes = (size_t)experts * b0_bytes;
  c->out_bytes = (size_t)(c->m * c->n) * 2;
  /* enough copies for the grouped rows' working set (every expert's weights) and the dense
   * rows' (expert 0's) */
  const int grouped = bench_rotation_count(a_bytes + b_bytes + c->out_bytes);
  const int dense = bench_rotation_count(a_bytes + b0_bytes + c->out_bytes);
  c->copies = grouped > dense ? grouped : dense;
  c->a = (void **)calloc((size_t)c->copies, sizeof(void *));
  c->b = (void **)calloc((size_t)c->copies, sizeof(void *));
  c->out = (void **)calloc((size_t)c->copies, sizeof(void *));
  c->sets = skew_seed ? 2 : 1;
  for (int s = 0; s < c->sets; s++)
    c->host_offsets[s] = (int32_t *)calloc((size_t)(experts + 1), sizeof(int32_t));
  if (!c->a || !c->b || !c->out || !c->host_offsets[0] || !c->host_offsets[c->sets - 1]) {
    fprintf(stderr, "tw-bench: out of host memory (%d copies)\n", c->copies);
    exit(3);
  }
  for (int i = 0; i < c->copies; i++) {
    BENCH_CUDA(cudaMalloc(&c->a[i], a_bytes));
    BENCH_CUDA(cudaMalloc(&c->b[i], b_bytes));
    BENCH_CUDA(cudaMalloc(&c->out[i], c->out_bytes));
    tw_test_fill_bf16(c->a[i], a_bytes / 2, 2000 + 2 * (uint64_t)i, (tw_stream_t)c->stream);
    tw_test_fill_bf16(c->b[i], b_bytes / 2, 2001 + 2 * (uint64_t)i, (tw_stream_t)c->stream);
  }
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaMalloc(&c->ref, c->out_bytes));
  for (int64_t e = 0; e <= experts; e++)
    c->host_offsets[0][e] = (int32_t)(e * c->rows);
  upload_offsets(c, 0);
  if (c->sm_count)
    snprintf(c->label, sizeof(c->label), "M=%lldx%lld N=%lld K=%lld sms=%d", (long long)experts,
             (long long)c->rows, (long long)c->n, (long long)c->k, c->sm_count);
  else
    snprintf(c->label, sizeof(c->label), "M=%lldx%lld N=%lld K=%lld", (long long)experts,
             (long long)c->rows, (long long)c->n, (long long)c->k);
  if (skew_seed) {
    int32_t *off = c->host_offsets[1];
    skew_offsets(experts, c->m / kRowBlock, skew_seed, off);
    int64_t empty = 0, largest = 0, smallest = c->m;
    for (int64_t e = 0; e < experts; e++) {
      const int64_t rows = off[e + 1] - off[e];
      empty += rows == 0;
      largest = rows > largest ? rows : largest;
      smallest = rows && rows < smallest ? rows : smallest;
    }
    fprintf(stderr,
            "grouped_gemm %s: skewed experts (seed %llu): %lld empty, rows %lld .. %lld "
            "(uniform %lld):",
            c->label, (unsigned long long)skew_seed, (long long)empty, (long long)smallest,
            (long long)largest, (long long)c->rows);
    for (int64_t e = 0; e < experts && e < 64; e++)
      fprintf(stderr, " %lld", (long long)(off[e + 1] - off[e]));
    fprintf(stderr, "%s\n", experts > 64 ? " ..." : "");
    upload_offsets(c, 1);
  }
}

static void gg_teardown(gg_ctx_t *c) {
  BENCH_CUDA(cudaStreamSynchronize(c->stream));
  for (int i = 0; i < c->copies; i++) {
    cudaFree(c->a[i]);
    cudaFree(c->b[i]);
    cudaFree(c->out[i]);
  }
  cudaFree(c->ref);
  for (int s = 0; s < c->sets; s++) {
    cudaFree(c->offsets[s]);
    free(c->host_offsets[s]);
  }
  free(c->a);
  free(c->b);
  free(c->out);
  BENCH_CUDA(cudaStreamDestroy(c->stream));
}

/* ---- timing and rows ---------------------------------------------------------------------- */

static void add_row(bench_results_t *res, const gg_ctx_t *c, const variant_t *v, double ms,
                    double p10, double p90, double baseline_ms) {
  bench_add_timed_row(res, "grouped_gemm", v->name, c->label, ms, p10, p90,
                      2.0 * (double)c->m * (double)c->n * (double)c->k, baseline_ms, v->ok);
}

enum { kMaxVariants = 6 };

static int grouped_run(const bench_opts_t *opts, const bench_shape_t *shape, bench_results_t *res) {
  static tw_ref_blas_t *blas = NULL;
  const int64_t experts = bench_grouped_experts(shape, kDefaultExperts, kMaxExperts);
  if (shape_ok(shape, experts) != 0)
    return 1;
  if (!blas && tw_ref_blas_create(&blas) != TW_SUCCESS)
    return 1;
  const char *skew_env = getenv("TW_BENCH_GROUPED_SKEW");
  const long long skew = skew_env ? atoll(skew_env) : 0;
  gg_ctx_t c;
  gg_setup(&c, opts, shape, experts, skew > 0 ? (uint64_t)skew : 0, blas);

  /* table order; each set's cublas-loop is its rows' baseline */
  variant_t variants[kMaxVariants] = {
      {"tilewire", V_GROUPED, 0, {0}, 1},          {"tw_gemm-dense", V_TW_DENSE, 0, {0}, 1},
      {"cublas-dense", V_CUBLAS_DENSE, 0, {0}, 1}, {"cublas-loop", V_CUBLAS_LOOP, 0, {0}, 1},
      {"tilewire-skew", V_GROUPED, 1, {0}, 1},     {"cublas-loop-skew", V_CUBLAS_LOOP, 1, {0}, 1},
  };
  const int nvariants = c.sets == 2 ? 6 : 4;
  int rc = 0;
  if (opts->check) {
    rc = check_grouped(&c, 0, &variants[0], &variants[3]);
    if (rc == 0)
      rc = check_dense(&c, &variants[1], &variants[2]);
    if (rc == 0 && c.sets == 2)
      rc = check_grouped(&c, 1, &variants[4], &variants[5]);
  } else {
    rc = probe(&c, variants, nvariants);
  }
  if (rc != 0) {
    gg_teardown(&c);
    return 1;
  }

  const int rounds = bench_gemm_rounds();
  for (int r = 0; r < rounds; r++) /* interleaved, so drift falls on every row alike */
    for (int v = 0; v < nvariants; v++) {
      timed_t t = {&c, &variants[v]};
      variants[v].t[r] =
          bench_time_ms(run_timed, &t, c.stream, opts->warmup, opts->repeats, NULL, NULL);
    }
  double median[kMaxVariants], base[2] = {0, 0};
  for (int v = 0; v < nvariants; v++) {
    median[v] = bench_median(variants[v].t, rounds);
    if (variants[v].kind == V_CUBLAS_LOOP)
      base[variants[v].set] = median[v];
  }
  for (int v = 0; v < nvariants; v++)
    add_row(res, &c, &variants[v], median[v], variants[v].t[0], variants[v].t[rounds - 1],
            base[variants[v].set]);
  gg_teardown(&c);
  return 0;
}

static const bench_op_t grouped_gemm_op = {
    "grouped_gemm",
    "MoE experts' GEMMs (tw_grouped_gemm) vs dense tw_gemm/cuBLAS and a cuBLAS loop; "
    "m = rows per expert, E in the label or TW_BENCH_GROUPED_EXPERTS (8)",
    grouped_sweep,
    (int)(sizeof(grouped_sweep) / sizeof(grouped_sweep[0])),
    grouped_quick,
    (int)(sizeof(grouped_quick) / sizeof(grouped_quick[0])),
    grouped_run,
};
BENCH_OP_REGISTER(grouped_gemm, grouped_gemm_op, 15);
