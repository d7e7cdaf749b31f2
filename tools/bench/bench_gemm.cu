/*
 * `tw-bench gemm`: the sm90 GEMM core (tw_gemm) and cuBLAS side by side, C[M,N] = A[M,K] *
 * B[N,K]^T, bf16 in and out, fp32 accumulate. With --sm-budget S both run on S SMs (tw_gemm's
 * sm_count, cuBLAS's cublasSetSmCountTarget). speedup = cuBLAS time / this time.
 * TW_BENCH_GEMM_VARIANTS=1 adds rows for the kernel variants (3-stage, dynamic tile queue).
 * TW_BENCH_GEMM_FP32=1 adds both with fp32 output (cublas-fp32out, tilewire-fp32out: what the
 * fused GEMM+RS / GEMM+AR epilogue stores with fp32 partials; their speedup is over
 * cublas-fp32out; their values are not compared, the bf16 rows' are).
 * TW_BENCH_GEMM_PRE=1 puts a kernel that rewrites A in place (one CTA a row, the same bits)
 * before every call of both libraries: the GEMM after the kernel that writes its input, as in
 * a layer (norm, activation), instead of back to back with itself.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "gemm/gemm_heuristics.h"
#include "ops/gemm/gemm_sm90.h"
#include "ref/ref_gemm.h"

static const bench_shape_t gemm_sweep[] = {
    {4096, 4096, 4096, NULL},  {8192, 8192, 8192, NULL},  {16384, 8192, 8192, NULL},
    {8192, 28672, 8192, NULL}, {8192, 8192, 28672, NULL}, {2048, 8192, 8192, NULL},
    {16384, 1024, 8192, NULL},
};
static const bench_shape_t gemm_quick[] = {
    {4096, 4096, 4096, NULL},
    {1000, 1000, 1000, "tails"},
};

// Uniform [-1, 1) bf16 from a hash of (seed, index): random data, never zeros.
static __global__ void fill_kernel(__nv_bfloat16 *dst, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ULL + i;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    dst[i] = __float2bfloat16((float)(x >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

// max |a - ref| and max |ref| (as ordered int bits), and the count of non-finite a.
static __global__ void diff_kernel(const __nv_bfloat16 *a, const __nv_bfloat16 *ref, size_t n,
                                   int *stats, unsigned long long *bad) {
  float md = 0.f, mr = 0.f;
  unsigned long long nb = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), r = __bfloat162float(ref[i]);
    if (!isfinite(x)) {
      nb++;
      continue;
    }
    md = fmaxf(md, fabsf(x - r));
    mr = fmaxf(mr, fabsf(r));
  }
  atomicMax(&stats[0], __float_as_int(md));
  atomicMax(&stats[1], __float_as_int(mr));
  if (nb)
    atomicAdd(bad, nb);
}

static double rel_err(const void *a, const void *ref, size_t n, cudaStream_t stream,
                      size_t *bad_out) {
  int *stats, host[2];
  unsigned long long *bad, host_bad;
  BENCH_CUDA(cudaMalloc(&stats, 2 * sizeof(int)));
  BENCH_CUDA(cudaMalloc(&bad, sizeof(*bad)));
  BENCH_CUDA(cudaMemsetAsync(stats, 0, 2 * sizeof(int), stream));
  BENCH_CUDA(cudaMemsetAsync(bad, 0, sizeof(*bad), stream));
  diff_kernel<<<512, 256, 0, stream>>>((const __nv_bfloat16 *)a, (const __nv_bfloat16 *)ref, n,
                                       stats, bad);
  BENCH_CUDA(cudaMemcpyAsync(host, stats, sizeof(host), cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaMemcpyAsync(&host_bad, bad, sizeof(host_bad), cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  BENCH_CUDA(cudaFree(stats));
  BENCH_CUDA(cudaFree(bad));
  float md, mr;
  memcpy(&md, &host[0], 4);
  memcpy(&mr, &host[1], 4);
  *bad_out = (size_t)host_bad;
  return mr > 0 ? (double)md / mr : (double)md;
}

typedef struct gemm_ctx {
  cudaStream_t stream;
  tw_ref_blas_t *blas;
  int copies;
  void **a, **b, **c;
  int64_t m, n, k;
  int sm_count;
  tw_gemm_sm90_opts_t opts;
  int use_opts;
  tw_dtype_t c_dtype;
  int split_k;    /* tw_gemm_args_t.split_k of the tilewire rows; -2: -1 with the workspace */
  void *ws;       /* TW_GEMM_WORKSPACE_BYTES, zeroed */
  int pre;        /* TW_BENCH_GEMM_PRE=1: each call after a kernel that writes its A (pre_kernel) */
  size_t c_bytes; /* one bf16 C */
  char label[96]; /* the rows' shape column */
} gemm_ctx_t;

/* TW_BENCH_GEMM_PRE=1: before every call (both libraries) a kernel rewrites A in place, one CTA a
 * row (the norm or activation before a layer's GEMM), so the GEMM follows a kernel that writes
 * its input and does not let dependents start early. */
static __global__ void pre_kernel(uint4 *a, int64_t row_vecs) {
  uint4 *row = a + (int64_t)blockIdx.x * row_vecs;
  for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    // the same bits back: volatile, so the compiler keeps the load and the store (a plain
    // row[i] = row[i] compiled to an empty kernel)
    uint32_t x, y, z, w;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(x), "=r"(y), "=r"(z), "=r"(w)
                 : "l"(row + i));
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(row + i), "r"(x), "r"(y), "r"(z),
                 "r"(w)
                 : "memory");
  }
}
static void run_pre(const gemm_ctx_t *ctx, int i) {
  if (!ctx->pre)
    return;
  pre_kernel<<<(unsigned)ctx->m, 256, 0, ctx->stream>>>((uint4 *)ctx->a[i], ctx->k / 8);
  BENCH_CUDA(cudaGetLastError());
}

static void run_tilewire(void *p, int iter) {
  gemm_ctx_t *ctx = (gemm_ctx_t *)p;
  const int i = iter % ctx->copies;
  run_pre(ctx, i);
  tw_gemm_args_t args = TW_GEMM_ARGS_INIT;
  args.a = ctx->a[i];
  args.b = ctx->b[i];
  args.c = ctx->c[i];
  args.m = ctx->m;
  args.n = ctx->n;
  args.k = ctx->k;
  args.sm_count = ctx->sm_count;
  args.c_dtype = ctx->c_dtype;
  args.split_k = ctx->split_k == -2 ? -1 : ctx->split_k;
  if (ctx->split_k == -2)
    args.workspace = ctx->ws, args.workspace_bytes = TW_GEMM_WORKSPACE_BYTES;
  tw_status_t st =
      tw_gemm_sm90_launch(&args, (tw_stream_t)ctx->stream, ctx->use_opts ? &ctx->opts : NULL);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "tw-bench gemm: tw_gemm: %s (%s)\n", tw_status_string(st), tw_last_error());
    exit(1);
  }
}

static void run_cublas(void *p, int iter);

/* tw_gemm with ctx's settings (bf16 out, poisoned C) against cuBLAS: 1 where they agree. */
static int check_tilewire(gemm_ctx_t *ctx, size_t c_bytes, const char *label) {
  void *ref;
  BENCH_CUDA(cudaMalloc(&ref, c_bytes));
  BENCH_CUDA(cudaMemsetAsync(ctx->c[0], 0xFF, c_bytes, ctx->stream)); // NaN poison
  run_tilewire(ctx, 0);
  BENCH_CUDA(cudaMemcpyAsync(ref, ctx->c[0], c_bytes, cudaMemcpyDeviceToDevice, ctx->stream));
  run_cublas(ctx, 0);
  size_t nan = 0;
  const double err = rel_err(ref, ctx->c[0], c_bytes / 2, ctx->stream, &nan);
  const int ok = err < 1e-2 && nan == 0;
  if (!ok)
    fprintf(stderr, "gemm %s: tilewire (split_k %d) vs cuBLAS rel err %.3g, %zu NaN\n", label,
            ctx->split_k, err, nan);
  BENCH_CUDA(cudaFree(ref));
  return ok;
}

static void run_cublas(void *p, int iter) {
  gemm_ctx_t *ctx = (gemm_ctx_t *)p;
  const int i = iter % ctx->copies;
  run_pre(ctx, i);
  tw_status_t st =
      tw_ref_cublas_gemm(ctx->blas, ctx->a[i], ctx->b[i], ctx->c[i], ctx->c_dtype, ctx->m, ctx->n,
                         ctx->k, ctx->k, ctx->k, ctx->n, ctx->sm_count, ctx->stream);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "tw-bench gemm: cuBLAS: %s\n", tw_last_error());
    exit(1);
  }
}

/* A row's knob while it runs (saved keeps the caller's, for bench_env_restore): rows with `swap`
 * under TW_GEMM_SWAP=swap. */
static void variant_knobs(bench_env_saved_t *saved, const char *swap) {
  bench_env_save(saved, "TW_GEMM_SWAP");
  if (swap)
    setenv("TW_GEMM_SWAP", swap, 1);
}

/* One row of `tw-bench gemm`: a library, its kernel options, output type and knobs. */
typedef struct variant {
  const char *name;
  int cublas, use_opts;
  tw_gemm_sm90_opts_t opts;
  double t[BENCH_MAX_ROUNDS]; /* the median of each round */
  tw_dtype_t c_dtype;
  int split_k;
  const char *swap; /* TW_GEMM_SWAP's value while it runs (NULL: the caller's) */
} variant_t;

enum { kMaxVariants = 32 };

/* Allocates and fills `copies` rotations of A, B and C (C twice as large with fp32 rows), the
 * split-K workspace, the stream, and the row's shape label. */
static void gemm_setup(gemm_ctx_t *ctx, const bench_opts_t *opts, const bench_shape_t *shape,
                       tw_ref_blas_t *blas, int fp32) {
  memset(ctx, 0, sizeof(*ctx));
  ctx->m = shape->m;
  ctx->n = shape->n;
  ctx->k = shape->k;
  ctx->sm_count = opts->sm_budget;
  ctx->blas = blas;
  ctx->c_dtype = TW_BF16;
  const char *pre_env = getenv("TW_BENCH_GEMM_PRE");
  ctx->pre = pre_env && atoi(pre_env) == 1 && ctx->k % 8 == 0 && ctx->m <= 65535;
  BENCH_CUDA(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
  const size_t a_bytes = (size_t)(ctx->m * ctx->k) * 2, b_bytes = (size_t)(ctx->n * ctx->k) * 2;
  ctx->c_bytes = (size_t)(ctx->m * ctx->n) * 2;
  const size_t c_alloc = fp32 ? 2 * ctx->c_bytes : ctx->c_bytes;
  ctx->copies = bench_rotation_count(a_bytes + b_bytes + c_alloc);
  ctx->a = (void **)calloc((size_t)ctx->copies, sizeof(void *));
  ctx->b = (void **)calloc((size_t)ctx->copies, sizeof(void *));
  ctx->c = (void **)calloc((size_t)ctx->copies, sizeof(void *));
  for (int i = 0; i < ctx->copies; i++) {
    BENCH_CUDA(cudaMalloc(&ctx->a[i], a_bytes));
    BENCH_CUDA(cudaMalloc(&ctx->b[i], b_bytes));
    BENCH_CUDA(cudaMalloc(&ctx->c[i], c_alloc));
    fill_kernel<<<1024, 256, 0, ctx->stream>>>((__nv_bfloat16 *)ctx->a[i], a_bytes / 2,
                                               1000 + 2 * i);
    fill_kernel<<<1024, 256, 0, ctx->stream>>>((__nv_bfloat16 *)ctx->b[i], b_bytes / 2,
                                               1001 + 2 * i);
  }
  BENCH_CUDA(cudaMalloc(&ctx->ws, TW_GEMM_WORKSPACE_BYTES));
  BENCH_CUDA(cudaMemsetAsync(ctx->ws, 0, TW_GEMM_WORKSPACE_BYTES, ctx->stream));
  if (ctx->sm_count)
    snprintf(ctx->label, sizeof(ctx->label), "M=%lld N=%lld K=%lld sms=%d", (long long)ctx->m,
             (long long)ctx->n, (long long)ctx->k, ctx->sm_count);
  else
    snprintf(ctx->label, sizeof(ctx->label), "M=%lld N=%lld K=%lld", (long long)ctx->m,
             (long long)ctx->n, (long long)ctx->k);
}

static void gemm_teardown(gemm_ctx_t *ctx) {
  for (int i = 0; i < ctx->copies; i++) {
    cudaFree(ctx->a[i]);
    cudaFree(ctx->b[i]);
    cudaFree(ctx->c[i]);
  }
  cudaFree(ctx->ws);
  free(ctx->a);
  free(ctx->b);
  free(ctx->c);
  BENCH_CUDA(cudaStreamDestroy(ctx->stream));
}

static void add_variants(variant_t *variants, int *n, const variant_t *more, size_t count) {
  for (size_t v = 0; v < count; v++)
    variants[(*n)++] = more[v];
}
#define ADD_VARIANTS(list) add_variants(variants, &n, list, sizeof(list) / sizeof(list[0]))

/* The rows of one shape, in table order: cuBLAS (the baseline) and tilewire first, then the
 * forced swap tile heights of decode shapes, the TW_BENCH_GEMM_SPLITK and TW_BENCH_GEMM_VARIANTS
 * rows, and the fp32-out rows last. Returns how many (at most kMaxVariants). */
static int gemm_variants(const gemm_ctx_t *ctx, int fp32, variant_t *variants) {
  int n = 0;
  variants[n++] = {"cublas", 1, 0, {-1, 0, 0}, {0}, TW_BF16, 0, NULL};
  variants[n++] = {"tilewire", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 0, NULL};
  /* decode shapes (m <= 64, where tw_gemm swaps A and B by default): the 128-row tiles beside;
   * up to m 128 the swap forced reaches (TW_GEMM_SWAP_FORCED_MAX_M) */
  const int swapped = ctx->m <= 64;
  if (ctx->m <= TW_GEMM_SWAP_FORCED_MAX_M) { /* the swap's two tile heights forced */
    const variant_t forced[] = {
        {"tilewire-noswap", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 0, "0"},
        {"tilewire-swap128", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 0, "1"},
        {"tilewire-swap64", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 0, "2"},
    };
    ADD_VARIANTS(forced);
  }
  /* TW_BENCH_GEMM_SPLITK=1: tw_gemm with split_k -1 (the library's choice; with and without a
   * workspace) and 2 / 4 / 8, the slices summed as a tree */
  const char *splitk = getenv("TW_BENCH_GEMM_SPLITK");
  if (splitk && atoi(splitk)) {
    const variant_t splits[] = {
        {"tilewire-splitk", 0, 0, {-1, 0, 0}, {0}, TW_BF16, -1, NULL},
        /* -1 with a workspace: the same slices as single CTAs on 64-row swap tiles */
        {"tilewire-splitk-ws", 0, 0, {-1, 0, 0}, {0}, TW_BF16, -2, NULL},
        {"tilewire-split2", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 2, NULL},
        {"tilewire-split4", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 4, NULL},
        {"tilewire-split8", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 8, NULL},
    };
    ADD_VARIANTS(splits);
    if (swapped) { /* the slices of 128-row tiles beside the swapped ones */
      const variant_t noswap[] = {
          {"tilewire-split2-noswap", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 2, "0"},
          {"tilewire-split4-noswap", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 4, "0"},
          {"tilewire-split8-noswap", 0, 0, {-1, 0, 0}, {0}, TW_BF16, 8, "0"},
      };
      ADD_VARIANTS(noswap);
    }
  }
  const char *extra_env = getenv("TW_BENCH_GEMM_VARIANTS");
  const int extra = extra_env && atoi(extra_env);
  if (extra) {
    const variant_t extras[] = {
        {"tw-1cta-4stage", 0, 1, {TW_GEMM_V_S4_E16, 0, 0}, {0}, TW_BF16, 0, NULL},
        {"tw-1cta-3stage", 0, 1, {TW_GEMM_V_S3_E32, 0, 0}, {0}, TW_BF16, 0, NULL},
        {"tw-pair-4stage", 0, 1, {TW_GEMM_V_S4_E16_C2, 0, 0}, {0}, TW_BF16, 0, NULL},
        {"tw-pair-3stage", 0, 1, {TW_GEMM_V_S3_E32_C2, 0, 0}, {0}, TW_BF16, 0, NULL},
        {"tw-n128", 0, 1, {TW_GEMM_V_N128_S6, 0, 0}, {0}, TW_BF16, 0, NULL},
        {"tw-pingpong", 0, 1, {TW_GEMM_V_PP_N128, 0, 0}, {0}, TW_BF16, 0, NULL},
        {"tw-pingpong192", 0, 1, {TW_GEMM_V_PP_N192, 0, 0}, {0}, TW_BF16, 0, NULL},
        {"tw-queue", 0, 1, {-1, 1, 0}, {0}, TW_BF16, 0, NULL},
    };
    ADD_VARIANTS(extras);
  }
  if (fp32) { /* last: their speedups are over cublas-fp32out */
    const variant_t fp32out[] = {
        {"cublas-fp32out", 1, 0, {-1, 0, 0}, {0}, TW_FP32, 0, NULL},
        {"tilewire-fp32out", 0, 0, {-1, 0, 0}, {0}, TW_FP32, 0, NULL},
    };
    ADD_VARIANTS(fp32out);
    if (extra) {
      const variant_t fp32_extras[] = {
          {"tw-pingpong-fp32out", 0, 1, {TW_GEMM_V_PP_N128, 0, 0}, {0}, TW_FP32, 0, NULL},
          {"tw-pingpong192-fp32out", 0, 1, {TW_GEMM_V_PP_N192, 0, 0}, {0}, TW_FP32, 0, NULL},
      };
      ADD_VARIANTS(fp32_extras);
    }
  }
  return n;
}
#undef ADD_VARIANTS

/* Times every variant in `rounds` interleaved rounds (cuBLAS, tilewire, extras, cuBLAS, ...), so
 * that clock and power drift during the run falls on all of them alike: variants[v].t[r] is the
 * median of round r. */
static void time_variants(gemm_ctx_t *ctx, const bench_opts_t *opts, variant_t *variants,
                          int nvariants, int rounds) {
  for (int r = 0; r < rounds; r++)
    for (int v = 0; v < nvariants; v++) {
      ctx->use_opts = variants[v].use_opts;
      ctx->opts = variants[v].opts;
      ctx->c_dtype = variants[v].c_dtype;
      ctx->split_k = variants[v].split_k;
      bench_env_saved_t saved;
      variant_knobs(&saved, variants[v].swap);
      variants[v].t[r] = bench_time_ms(variants[v].cublas ? run_cublas : run_tilewire, ctx,
                                       ctx->stream, opts->warmup, opts->repeats, NULL, NULL);
      bench_env_restore(&saved);
    }
}

/* One row per variant: the median of the rounds' medians, p10/p90 the lowest and highest round
 * median. `ok` is the check of the default tilewire call; split and swap rows check their own. */
static void gemm_rows(gemm_ctx_t *ctx, const bench_opts_t *opts, variant_t *variants, int nvariants,
                      int rounds, int ok, bench_results_t *res) {
  const double flops = 2.0 * (double)ctx->m * (double)ctx->n * (double)ctx->k;
  double t_blas = 0;
  for (int v = 0; v < nvariants; v++) {
    double *t = variants[v].t;
    const double median = bench_median(t, rounds);
    if (v == 0 || !strcmp(variants[v].name, "cublas-fp32out"))
      t_blas = median; /* the fp32-out rows against cuBLAS with fp32 out */
    int row_ok = variants[v].cublas ? 1 : ok;
    if ((variants[v].split_k != 0 || variants[v].swap) && opts->check) { /* its own check */
      ctx->split_k = variants[v].split_k;
      ctx->c_dtype = TW_BF16;
      ctx->use_opts = 0;
      bench_env_saved_t saved;
      variant_knobs(&saved, variants[v].swap);
      row_ok = check_tilewire(ctx, ctx->c_bytes, ctx->label);
      bench_env_restore(&saved);
    }
    bench_add_timed_row(res, "gemm", variants[v].name, ctx->label, median, t[0], t[rounds - 1],
                        flops, t_blas, row_ok);
  }
}

static int gemm_run(const bench_opts_t *opts, const bench_shape_t *shape, bench_results_t *res) {
  static tw_ref_blas_t *blas = NULL;
  if (!blas && tw_ref_blas_create(&blas) != TW_SUCCESS)
    return 1;
  const char *fp32_env = getenv("TW_BENCH_GEMM_FP32");
  const int fp32 = fp32_env && atoi(fp32_env);
  gemm_ctx_t ctx;
  gemm_setup(&ctx, opts, shape, blas, fp32);
  const int ok = !opts->check || check_tilewire(&ctx, ctx.c_bytes, ctx.label);
  variant_t variants[kMaxVariants];
  const int nvariants = gemm_variants(&ctx, fp32, variants);
  const int rounds = bench_gemm_rounds();
  time_variants(&ctx, opts, variants, nvariants, rounds);
  gemm_rows(&ctx, opts, variants, nvariants, rounds, ok, res);
  gemm_teardown(&ctx);
  return 0;
}

static const bench_op_t gemm_op = {
    "gemm",     "C[M,N] = A[M,K] * B[N,K]^T bf16 (tw_gemm) vs cuBLAS; --sm-budget limits both",
    gemm_sweep, (int)(sizeof(gemm_sweep) / sizeof(gemm_sweep[0])),
    gemm_quick, (int)(sizeof(gemm_quick) / sizeof(gemm_quick[0])),
    gemm_run,
};
BENCH_OP_REGISTER(gemm, gemm_op, 10);
