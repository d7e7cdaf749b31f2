/*
 * tw-bench gemm_rs / gemm_ar: the fused GEMM + ReduceScatter (AllReduce) against
 * the unfused pipelines and the pieces alone, all on the same --world ranks
 * (default 8; virtual ranks on one GPU when there are fewer GPUs), every rank
 * timed together (bench_time_multi_ms). Shape: m = total rows of the product,
 * n = columns, k = K per rank (each rank holds A [m, k] and B [n, k]).
 *
 *   tilewire        tw_gemm_rs / tw_gemm_ar
 *   tilewire-bf16p  the same with bf16 partials (TW_PARTIALS_BF16), checked bitwise against
 *                   unfused-tw with bf16 GEMM output; with NCCL, its speedup and overlap are
 *                   against the bf16 NCCL pipeline (nccl-bf16+cublas, nccl-bf16-reduce), the
 *                   same bytes on the wire, and the bound-bf16 row is that pipeline's bound
 *   unfused-cublas  cuBLAS GEMM (fp32 out, the rank's SM budget) then the rank-ordered
 *                   reduce kernels of src/ref/ref_reduce.cu (the speedup baseline)
 *   unfused-tw      the same with tw_gemm (bitwise equal to the fused result)
 *   tilewire-bf16p-direct  (gemm_ar, m <= 4096) the direct scheme with bf16 partials
 *   tilewire-outsym, tilewire-bf16p-outsym  (gemm_ar) out in the symmetric heap with
 *                   args.out_symmetric = 1: the owners write every rank's out, no gather copy
 *   unfused-tw-bf16p  tw_gemm with bf16 output, then the same reduce of bf16 partials (the
 *                   pipeline tilewire-bf16p equals bitwise; its speedup is against the bf16
 *                   NCCL pipeline)
 *   gemm-alone      cuBLAS GEMM, bf16 out, budget-limited (t_gemm)
 *   reduce-alone    the reduce kernels alone (t_comm)
 * TFLOP/s per rank = 2 m n k / t; overlap = max(t_gemm, t_comm) / t_fused.
 * Each rank's working set (A, B, fp32 partials) is far above L2 at these shapes,
 * so inputs are not rotated.
 */
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ref/ref_gemm.h"
#include "ref/ref_reduce.h"
#include "tw_test.h"

typedef struct rs_ctx {
  int world, budget, all_reduce, failed, reduce_sms, partials;
  int64_t m, n, k;
  int devices[TW_MAX_WORLD];
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  cudaEvent_t events[TW_MAX_WORLD];
  tw_ref_blas_t *blas[TW_MAX_WORLD];
  void *a[TW_MAX_WORLD], *b[TW_MAX_WORLD];
  void *out[TW_MAX_WORLD];     /* fused, [m, n] */
  void *out_sym[TW_MAX_WORLD]; /* gemm_ar: fused into symmetric outputs, [m, n] */
  int use_out_sym;             /* run_fused writes out_sym with args.out_symmetric = 1 */
  void *out2[TW_MAX_WORLD];    /* unfused, symmetric [m, n] */
  float *partial[TW_MAX_WORLD];
  void *ws[TW_MAX_WORLD];
  const void *partial_peers[TW_MAX_WORLD * TW_MAX_WORLD];
  void *out2_peers[TW_MAX_WORLD * TW_MAX_WORLD];
  tw_ref_nccl_t *nccl;          /* ranks on distinct GPUs and libnccl loadable; else NULL */
  float *scratch[TW_MAX_WORLD]; /* NCCL's fp32 result */
} rs_ctx;

static void rs_shape(char *dst, size_t len, const bench_shape_t *shape, const rs_ctx *c) {
  snprintf(dst, len, "%s%sM=%lld N=%lld K/rank=%lld world=%d sms/rank=%d",
           shape->label ? shape->label : "", shape->label ? " " : "", (long long)c->m,
           (long long)c->n, (long long)c->k, c->world, c->budget);
}

static void *fused_out(const rs_ctx *c, int r) {
  return c->use_out_sym ? c->out_sym[r] : c->out[r];
}

static void run_fused(void *p, int iter) {
  (void)iter;
  rs_ctx *c = (rs_ctx *)p;
  for (int r = 0; r < c->world; r++) {
    tw_gemm_rs_args_t a = TW_GEMM_RS_ARGS_INIT;
    a.a = c->a[r], a.b = c->b[r], a.out = fused_out(c, r), a.workspace = c->ws[r];
    a.out_symmetric = c->use_out_sym;
    a.partials = c->partials;
    a.m = c->m, a.n = c->n, a.k = c->k;
    a.reduce_sms = c->reduce_sms;
    tw_stream_t s = (tw_stream_t)c->streams[r];
    tw_status_t st =
        c->all_reduce ? tw_gemm_ar(c->comms[r], &a, s) : tw_gemm_rs(c->comms[r], &a, s);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "tw_gemm_%s: %s\n", c->all_reduce ? "ar" : "rs",
              tw_comm_last_error(c->comms[r]));
      c->failed = 1;
    }
  }
}

static void run_reduce(void *p, int iter) {
  (void)iter;
  rs_ctx *c = (rs_ctx *)p;
  const int bytes = c->partials ? 2 : 4;
  BENCH_CUDA(c->all_reduce ? tw_ref_all_reduce(c->world, c->partial_peers, bytes, c->out2_peers,
                                               c->m, c->n, c->n, c->budget, c->streams, c->events)
                           : tw_ref_reduce_scatter(c->world, c->partial_peers, bytes, c->out2, c->m,
                                                   c->n, c->n, c->budget, c->streams, c->events));
}

static void gemm_cublas(rs_ctx *c, int fp32_out) {
  for (int r = 0; r < c->world; r++) {
    BENCH_CUDA(cudaSetDevice(c->devices[r]));
    void *dst = fp32_out ? (void *)c->partial[r] : c->out[r];
    if (tw_ref_cublas_gemm(c->blas[r], c->a[r], c->b[r], dst, fp32_out ? TW_FP32 : TW_BF16, c->m,
                           c->n, c->k, c->k, c->k, c->n, c->budget, c->streams[r]) != TW_SUCCESS) {
      fprintf(stderr, "cuBLAS: %s\n", tw_last_error());
      c->failed = 1;
    }
  }
  BENCH_CUDA(cudaSetDevice(c->devices[0]));
}

static void run_gemm_alone(void *p, int iter) {
  (void)iter;
  gemm_cublas((rs_ctx *)p, 0);
}

static void run_unfused_cublas(void *p, int iter) {
  gemm_cublas((rs_ctx *)p, 1);
  run_reduce(p, iter);
}

/* NCCL's reduction of the fp32 partials (then bf16), the baseline on distinct GPUs. */
static void run_nccl_reduce(void *p, int iter) {
  (void)iter;
  rs_ctx *c = (rs_ctx *)p;
  if (tw_ref_nccl_reduce_fp32(c->nccl, c->world, c->devices, (const float *const *)c->partial,
                              c->scratch, c->out2, c->all_reduce, c->m, c->n, c->n,
                              c->streams) != cudaSuccess) {
    fprintf(stderr, "NCCL reduce: %s\n", tw_ref_nccl_error());
    c->failed = 1;
  }
  BENCH_CUDA(cudaSetDevice(c->devices[0]));
}

static void run_nccl_cublas(void *p, int iter) {
  gemm_cublas((rs_ctx *)p, 1);
  run_nccl_reduce(p, iter);
}

/* What a PyTorch TP layer does: cuBLAS writes bf16 (into the partial buffer's first half), NCCL
 * sums bf16 (into scratch). Half the bytes of the fp32 pipeline and a bf16-rounded sum, so
 * it is the faster, less exact baseline; its result is not checked. */
static void run_nccl_bf16(void *p, int iter) {
  (void)iter;
  rs_ctx *c = (rs_ctx *)p;
  int rc = c->all_reduce ? tw_ref_nccl_all_reduce(c->nccl, (const void *const *)c->partial,
                                                  (void *const *)c->scratch, (size_t)(c->m * c->n),
                                                  1, c->streams)
                         : tw_ref_nccl_reduce_scatter(c->nccl, (const void *const *)c->partial,
                                                      (void *const *)c->scratch,
                                                      (size_t)(c->m * c->n), 1, c->streams);
  if (rc != 0) {
    fprintf(stderr, "NCCL bf16 reduce: %s\n", tw_ref_nccl_error());
    c->failed = 1;
  }
  BENCH_CUDA(cudaSetDevice(c->devices[0]));
}

static void run_nccl_bf16_cublas(void *p, int iter) {
  rs_ctx *c = (rs_ctx *)p;
  for (int r = 0; r < c->world; r++) {
    BENCH_CUDA(cudaSetDevice(c->devices[r]));
    if (tw_ref_cublas_gemm(c->blas[r], c->a[r], c->b[r], c->partial[r], TW_BF16, c->m, c->n, c->k,
                           c->k, c->k, c->n, c->budget, c->streams[r]) != TW_SUCCESS) {
      fprintf(stderr, "cuBLAS: %s\n", tw_last_error());
      c->failed = 1;
    }
  }
  run_nccl_bf16(p, iter);
}

static void run_unfused_tw(void *p, int iter) {
  rs_ctx *c = (rs_ctx *)p;
  for (int r = 0; r < c->world; r++) {
    tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
    g.c_dtype = c->partials ? TW_BF16 : TW_FP32;
    g.a = c->a[r], g.b = c->b[r], g.c = c->partial[r];
    g.m = c->m, g.n = c->n, g.k = c->k;
    g.sm_count = c->budget;
    BENCH_CUDA(cudaSetDevice(c->devices[r]));
    if (tw_gemm(&g, (tw_stream_t)c->streams[r]) != TW_SUCCESS) {
      fprintf(stderr, "tw_gemm: %s\n", tw_last_error());
      c->failed = 1;
    }
  }
  BENCH_CUDA(cudaSetDevice(c->devices[0]));
  run_reduce(p, iter);
}

/* Fused vs unfused-tw, bitwise, on every rank. */
static int check_bitwise(rs_ctx *c) {
  for (int r = 0; r < c->world; r++) {
    BENCH_CUDA(cudaSetDevice(c->devices[r]));
    tw_test_poison(fused_out(c, r), (size_t)c->m * c->n * 2, (tw_stream_t)c->streams[r]);
    tw_test_poison(c->out2[r], (size_t)c->m * c->n * 2, (tw_stream_t)c->streams[r]);
  }
  run_fused(c, 0);
  run_unfused_tw(c, 0);
  BENCH_CUDA(cudaDeviceSynchronize());
  const size_t bytes = (size_t)(c->all_reduce ? c->m : c->m / c->world) * c->n * 2;
  for (int r = 0; r < c->world; r++) {
    BENCH_CUDA(cudaSetDevice(c->devices[r]));
    BENCH_CUDA(cudaDeviceSynchronize());
    size_t diff = tw_test_count_diff(fused_out(c, r), c->out2[r], bytes);
    if (diff) {
      fprintf(stderr, "gemm_%s rank %d: fused != unfused in %zu bytes\n",
              c->all_reduce ? "ar" : "rs", r, diff);
      return 0;
    }
    tw_status_t async = TW_SUCCESS;
    tw_comm_async_error(c->comms[r], &async);
    if (async != TW_SUCCESS) {
      fprintf(stderr, "rank %d: %s\n", r, tw_comm_last_error(c->comms[r]));
      return 0;
    }
  }
  return !c->failed;
}

/* The rows after the main ones: row i timed into t / p10 / p90[i], its kind in code[i] (reduce
 * CTAs, or a negative row code). */
typedef struct {
  double *t, *p10, *p90;
  int code[16]; /* up to 8 reduce-CTA rows, direct, bf16 (2-3), out_symmetric (2) */
  int n;
} extra_rows_t;

static void time_extra(rs_ctx *c, const bench_opts_t *o, extra_rows_t *x, int code,
                       void (*fn)(void *, int)) {
  x->code[x->n] = code;
  x->t[x->n] = bench_time_multi_ms(fn, c, c->streams[0], c->streams, c->world, o->warmup,
                                   o->repeats, &x->p10[x->n], &x->p90[x->n]);
  x->n++;
}

/* The fused op with TW_AR_DIRECT=1 (tw_gemm_ar's direct scheme), checked bitwise like the
 * default, then timed; the caller's TW_AR_DIRECT is restored. */
static void time_direct(rs_ctx *c, const bench_opts_t *o, extra_rows_t *x, int code, int *ok) {
  bench_env_saved_t saved;
  bench_env_save(&saved, "TW_AR_DIRECT");
  setenv("TW_AR_DIRECT", "1", 1);
  *ok = o->check ? check_bitwise(c) : 1;
  time_extra(c, o, x, code, run_fused);
  bench_env_restore(&saved);
}

static int run_op(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res,
                  int all_reduce) {
  rs_ctx *c = (rs_ctx *)calloc(1, sizeof(rs_ctx));
  const int world = o->world ? o->world : 8;
  c->world = world, c->all_reduce = all_reduce;
  c->m = shape->m, c->n = shape->n, c->k = shape->k;
  int ngpu = 0;
  BENCH_CUDA(cudaGetDeviceCount(&ngpu));
  const char *virt = getenv("TW_BENCH_VIRTUAL"); /* 1: every rank on GPU 0 (bench_ranks.h) */
  if (virt && *virt == '1')
    ngpu = 1;
  for (int r = 0; r < world; r++)
    c->devices[r] = r % ngpu;
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.sm_budget = o->sm_budget;
  if (tw_comm_init_all(c->comms, world, c->devices, &cfg) != TW_SUCCESS) {
    fprintf(stderr, "tw_comm_init_all(world=%d): %s\n", world, tw_last_error());
    free(c);
    return 1;
  }
  tw_comm_sm_budget(c->comms[0], &c->budget);
  size_t ws_bytes = 0;
  if (tw_gemm_rs_workspace_size(c->comms[0], c->m, c->n, &ws_bytes) != TW_SUCCESS) {
    fprintf(stderr, "workspace: %s\n", tw_comm_last_error(c->comms[0]));
    return 1;
  }
  const size_t mn = (size_t)c->m * c->n;
  /* gemm_ar with m <= 4096: room for the direct scheme too (row tilewire-direct). */
  const int direct_row = all_reduce && c->m <= 4096 && world > 1;
  if (direct_row && ws_bytes < (size_t)world * mn * 4)
    ws_bytes = (size_t)world * mn * 4;
  for (int r = 0; r < world; r++) {
    if (tw_mem_alloc(c->comms[r], ws_bytes, &c->ws[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->comms[r], mn * 4, (void **)&c->partial[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->comms[r], mn * 2, &c->out2[r]) != TW_SUCCESS ||
        (all_reduce && world > 1 &&
         tw_mem_alloc(c->comms[r], mn * 2, &c->out_sym[r]) != TW_SUCCESS)) {
      fprintf(stderr, "tw_mem_alloc: %s\n", tw_comm_last_error(c->comms[r]));
      return 1;
    }
    BENCH_CUDA(cudaSetDevice(c->devices[r]));
    BENCH_CUDA(cudaStreamCreateWithFlags(&c->streams[r], cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreateWithFlags(&c->events[r], cudaEventDisableTiming));
    BENCH_CUDA(cudaMalloc(&c->a[r], (size_t)c->m * c->k * 2));
    BENCH_CUDA(cudaMalloc(&c->b[r], (size_t)c->n * c->k * 2));
    BENCH_CUDA(cudaMalloc(&c->out[r], mn * 2));
    if (tw_ref_blas_create(&c->blas[r]) != TW_SUCCESS)
      return 1;
    tw_test_fill_bf16(c->a[r], (size_t)c->m * c->k, 11 + r, (tw_stream_t)c->streams[r]);
    tw_test_fill_bf16(c->b[r], (size_t)c->n * c->k, 1011 + r, (tw_stream_t)c->streams[r]);
  }
  for (int r = 0; r < world; r++)
    for (int s = 0; s < world; s++) {
      void *p;
      if (tw_mem_peer_ptr(c->comms[r], c->partial[r], s, &p) != TW_SUCCESS)
        return 1;
      c->partial_peers[r * world + s] = p;
      if (tw_mem_peer_ptr(c->comms[r], c->out2[r], s, &p) != TW_SUCCESS)
        return 1;
      c->out2_peers[r * world + s] = p;
    }
  /* Load cuBLAS's kernels (both outputs) while nothing spins: its lazy module loading can
   * wait for the device to go idle, which never happens while ranks wait on each other. */
  gemm_cublas(c, 1);
  gemm_cublas(c, 0);
  for (int r = 0; r < world; r++) {
    BENCH_CUDA(cudaSetDevice(c->devices[r]));
    BENCH_CUDA(cudaDeviceSynchronize());
  }
  BENCH_CUDA(cudaSetDevice(c->devices[0]));
  const int ok = o->check ? check_bitwise(c) : 1;
  /* NCCL rows where the ranks are on distinct GPUs and libnccl loads (ref_nccl.h). */
  char why[256] = "";
  if (tw_ref_nccl_create(&c->nccl, world, c->devices, why, sizeof(why)) == 0) {
    const size_t rows = (size_t)(all_reduce ? c->m : c->m / world);
    for (int r = 0; r < world; r++) {
      BENCH_CUDA(cudaSetDevice(c->devices[r]));
      BENCH_CUDA(cudaMalloc(&c->scratch[r], rows * (size_t)c->n * sizeof(float)));
    }
    BENCH_CUDA(cudaSetDevice(c->devices[0]));
  } else {
    fprintf(stderr, "gemm_%s: no NCCL rows: %s\n", all_reduce ? "ar" : "rs", why);
  }

  struct {
    const char *name;
    void (*fn)(void *, int);
  } variants[] = {{"unfused-cublas", run_unfused_cublas},
                  {"unfused-tw", run_unfused_tw},
                  {"gemm-alone", run_gemm_alone},
                  {"reduce-alone", run_reduce},
                  {"tilewire", run_fused}};
  const int nv = (int)(sizeof(variants) / sizeof(variants[0]));
  double t[24], p10[24], p90[24];
  /* The main rows and NCCL's four timed together (bench.h): tm[0, nv) are copied into t now,
   * tm[nv, nv + 4) after the extra rows below. */
  void (*fns[9])(void *, int);
  double tm[9], tm10[9], tm90[9];
  for (int v = 0; v < nv; v++)
    fns[v] = variants[v].fn;
  const int nn = c->nccl ? 4 : 0;
  if (nn)
    fns[nv] = run_nccl_cublas, fns[nv + 1] = run_nccl_reduce, fns[nv + 2] = run_nccl_bf16_cublas,
    fns[nv + 3] = run_nccl_bf16;
  bench_time_multi_rounds(fns, nv + nn, c, c->streams[0], c->streams, world, o->warmup, o->repeats,
                          tm, tm10, tm90);
  for (int v = 0; v < nv; v++)
    t[v] = tm[v], p10[v] = tm10[v], p90[v] = tm90[v];
  /* TW_BENCH_RS_REDUCE_SMS=2,4,6: extra fused rows with that many reduce CTAs per rank
   * (TW_BENCH_RS_SWEEP_BF16=1: with bf16 partials, rows tilewire-bf16p-rN). */
  extra_rows_t x = {t + nv, p10 + nv, p90 + nv, {0}, 0};
  const char *list = getenv("TW_BENCH_RS_REDUCE_SMS");
  const char *sweep_bf16 = getenv("TW_BENCH_RS_SWEEP_BF16");
  const int sweep_partials = sweep_bf16 && *sweep_bf16 == '1' ? TW_PARTIALS_BF16 : TW_PARTIALS_FP32;
  c->partials = sweep_partials;
  for (const char *q = list; q && *q && x.n < 8;) {
    int v = atoi(q);
    if (v > 0 && v < c->budget) {
      c->reduce_sms = v;
      time_extra(c, o, &x, v, run_fused);
    }
    q = strchr(q, ',');
    q = q ? q + 1 : NULL;
  }
  c->reduce_sms = 0;
  c->partials = TW_PARTIALS_FP32;
  /* tw_gemm_ar's direct scheme (TW_AR_DIRECT=1), checked bitwise like the default. */
  int ok_direct = 1, ok_direct_bf16 = 1;
  if (direct_row) {
    time_direct(c, o, &x, -1, &ok_direct);
  }
  /* bf16 partials (extra row code -2), checked bitwise against unfused-tw with bf16 partials. */
  int ok_bf16p = 1;
  if (world > 1) {
    c->partials = TW_PARTIALS_BF16;
    ok_bf16p = o->check ? check_bitwise(c) : 1;
    time_extra(c, o, &x, -2, run_fused);
    /* The unfused pipeline with bf16 partials (tw_gemm bf16 out, then the rank-ordered
     * reduce): what a fallback inside the library would cost where the fused op loses. */
    time_extra(c, o, &x, -3, run_unfused_tw);
    /* The direct scheme with bf16 partials (row tilewire-bf16p-direct): one hop of bf16 tiles,
     * no gather phase. */
    if (direct_row) {
      time_direct(c, o, &x, -4, &ok_direct_bf16);
    }
    c->partials = TW_PARTIALS_FP32;
  }
  /* gemm_ar into symmetric outputs (rows tilewire-outsym, tilewire-bf16p-outsym), checked
   * bitwise like the default. */
  int ok_sym[2] = {1, 1};
  for (int bf16 = 0; all_reduce && world > 1 && bf16 < 2; bf16++) {
    c->use_out_sym = 1;
    c->partials = bf16 ? TW_PARTIALS_BF16 : TW_PARTIALS_FP32;
    ok_sym[bf16] = o->check ? check_bitwise(c) : 1;
    time_extra(c, o, &x, bf16 ? -6 : -5, run_fused);
    c->use_out_sym = 0;
    c->partials = TW_PARTIALS_FP32;
  }
  /* With NCCL: its pipeline is the baseline and its reduction the communication time. */
  int nnccl = 0;
  double t_nccl = 0, t_nccl_reduce = 0, t_nccl_bf16 = 0, t_nccl_bf16_reduce = 0;
  if (nn) { /* timed with the main rows above */
    for (int i = 0; i < nn; i++)
      t[nv + x.n + i] = tm[nv + i], p10[nv + x.n + i] = tm10[nv + i],
                   p90[nv + x.n + i] = tm90[nv + i];
    t_nccl = tm[nv], t_nccl_reduce = tm[nv + 1], t_nccl_bf16 = tm[nv + 2],
    t_nccl_bf16_reduce = tm[nv + 3];
    nnccl = nn;
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  const double flops = 2.0 * (double)c->m * (double)c->n * (double)c->k;
  const double t_gemm = t[2], t_comm = c->nccl ? t_nccl_reduce : t[3];
  const double t_base = c->nccl ? t_nccl : t[0];
  for (int v = 0; v < nv + x.n + nnccl; v++) {
    bench_row_t row;
    memset(&row, 0, sizeof(row));
    snprintf(row.op, sizeof(row.op), "gemm_%s", all_reduce ? "ar" : "rs");
    if (v < nv)
      snprintf(row.variant, sizeof(row.variant), "%s", variants[v].name);
    else if (v < nv + x.n)
      snprintf(row.variant, sizeof(row.variant),
               x.code[v - nv] == -6   ? "tilewire-bf16p-outsym"
               : x.code[v - nv] == -5 ? "tilewire-outsym"
               : x.code[v - nv] == -4 ? "tilewire-bf16p-direct"
               : x.code[v - nv] == -3 ? "unfused-tw-bf16p"
               : x.code[v - nv] == -2 ? "tilewire-bf16p"
               : x.code[v - nv] == -1 ? "tilewire-direct"
               : sweep_partials       ? "tilewire-bf16p-r%d"
                                      : "tilewire-r%d",
               x.code[v - nv]);
    else {
      static const char *nccl_names[] = {"nccl+cublas", "nccl-reduce", "nccl-bf16+cublas",
                                         "nccl-bf16-reduce"};
      snprintf(row.variant, sizeof(row.variant), "%s", nccl_names[v - nv - x.n]);
    }
    rs_shape(row.shape, sizeof(row.shape), shape, c);
    row.ms = t[v], row.ms_p10 = p10[v], row.ms_p90 = p90[v];
    const int is_comm = v == 3 || v == nv + x.n + 1 || v == nv + x.n + 3;
    const int is_fused = v == nv - 1 || (v >= nv && v < nv + x.n && x.code[v - nv] != -3);
    row.tflops = is_comm ? 0 : flops / (t[v] * 1e-3) / 1e12;
    const int code = v >= nv && v < nv + x.n ? x.code[v - nv] : 0;
    const int is_bf16p = code == -2 || code == -3 || code == -4 || code == -6;
    row.speedup = (is_bf16p && c->nccl ? t_nccl_bf16 : t_base) / t[v];
    if (is_fused) {
      const double t_c = is_bf16p && c->nccl ? t_nccl_bf16_reduce : t_comm;
      row.overlap = (t_gemm > t_c ? t_gemm : t_c) / t[v];
    }
    row.ok = (is_fused || v == 1 ? ok : 1) && (code != -1 || ok_direct) &&
             (!is_bf16p || ok_bf16p) && (code != -4 || ok_direct_bf16) &&
             (code != -5 || ok_sym[0]) && (code != -6 || ok_sym[1]) && !c->failed;
    bench_add_row(res, &row);
  }
  /* TW_BENCH_AB: interleaved rows of the fused op (fp32 and bf16 partials) under each value of
   * one knob (bench.h); with TW_BENCH_AB_OUTSYM=1 also of gemm_ar into symmetric outputs. */
  const char *ab_sym = getenv("TW_BENCH_AB_OUTSYM");
  const int ab_rows = !getenv("TW_BENCH_AB")                             ? 0
                      : world == 1                                       ? 1
                      : all_reduce && ab_sym && strcmp(ab_sym, "1") == 0 ? 4
                                                                         : 2;
  for (int v = 0; v < ab_rows; v++) {
    const int bf16 = v & 1, sym = v >> 1;
    static const char *prefixes[] = {"tilewire", "tilewire-bf16p", "tilewire-outsym",
                                     "tilewire-bf16p-outsym"};
    bench_row_t tmpl;
    memset(&tmpl, 0, sizeof(tmpl));
    snprintf(tmpl.op, sizeof(tmpl.op), "gemm_%s", all_reduce ? "ar" : "rs");
    rs_shape(tmpl.shape, sizeof(tmpl.shape), shape, c);
    tmpl.ok = (sym ? ok_sym[bf16] : bf16 ? ok_bf16p : ok) && !c->failed;
    const double t_c = bf16 && c->nccl ? t_nccl_bf16_reduce : t_comm;
    c->partials = bf16 ? TW_PARTIALS_BF16 : TW_PARTIALS_FP32;
    c->use_out_sym = sym;
    bench_ab_rows(res, &tmpl, prefixes[v], flops, bf16 && c->nccl ? t_nccl_bf16 : t_base,
                  t_gemm > t_c ? t_gemm : t_c, run_fused, c, c->streams[0], c->streams, world, o);
    c->partials = TW_PARTIALS_FP32;
    c->use_out_sym = 0;
  }
  /* The overlap bound of issue 7, (t_gemm + t_comm) / max(t_gemm, t_comm): of the fp32 NCCL
   * pipeline (bound) and of the bf16 one (bound-bf16). */
  for (int b = 0; c->nccl && b < 2; b++) {
    bench_row_t bound;
    memset(&bound, 0, sizeof(bound));
    snprintf(bound.op, sizeof(bound.op), "gemm_%s", all_reduce ? "ar" : "rs");
    snprintf(bound.variant, sizeof(bound.variant), b ? "bound-bf16" : "bound");
    rs_shape(bound.shape, sizeof(bound.shape), shape, c);
    const double t_c = b ? t_nccl_bf16_reduce : t_comm;
    const double t_max = t_gemm > t_c ? t_gemm : t_c;
    bound.ms = bound.ms_p10 = bound.ms_p90 = t_max;
    bound.speedup = (t_gemm + t_c) / t_max;
    bound.ok = 1;
    bench_add_row(res, &bound);
  }
  for (int r = 0; r < world; r++) {
    cudaSetDevice(c->devices[r]);
    cudaFree(c->a[r]), cudaFree(c->b[r]), cudaFree(c->out[r]);
    tw_mem_free(c->comms[r], c->ws[r]);
    tw_mem_free(c->comms[r], c->partial[r]);
    tw_mem_free(c->comms[r], c->out2[r]);
    if (c->out_sym[r])
      tw_mem_free(c->comms[r], c->out_sym[r]);
    tw_ref_blas_destroy(c->blas[r]);
    if (c->scratch[r])
      cudaFree(c->scratch[r]);
    cudaStreamDestroy(c->streams[r]);
    cudaEventDestroy(c->events[r]);
    tw_comm_destroy(c->comms[r]);
  }
  cudaSetDevice(c->devices[0]);
  tw_ref_nccl_destroy(c->nccl);
  free(c);
  return 0;
}

static int run_rs(const bench_opts_t *o, const bench_shape_t *s, bench_results_t *res) {
  return run_op(o, s, res, 0);
}
static int run_ar(const bench_opts_t *o, const bench_shape_t *s, bench_results_t *res) {
  return run_op(o, s, res, 1);
}

/* m total, n, k per rank. */
static const bench_shape_t rs_sweep[] = {{4096, 12288, 6144, "flux-tp8"},
                                         {4096, 4096, 512, NULL},
                                         {8192, 8192, 1024, NULL},
                                         {16384, 16384, 2048, NULL},
                                         {64, 8192, 1024, "decode"}};
static const bench_shape_t rs_quick[] = {{1024, 1024, 256, NULL}, {4096, 4096, 512, NULL}};
/* decode: 64 tokens through a TP=8 Llama-70B attention-out projection (hidden 8192, K 1024 per
 * rank; owners' rows start inside 64-row boxes, so the plan pulls). gemm_ar adds a small-m
 * shape: 128 rows per rank on 8 ranks. */
static const bench_shape_t ar_sweep[] = {
    {4096, 12288, 6144, "flux-tp8"}, {4096, 4096, 512, NULL},    {8192, 8192, 1024, NULL},
    {16384, 16384, 2048, NULL},      {64, 8192, 1024, "decode"}, {1024, 8192, 2048, "small-m"}};

static const bench_op_t gemm_rs_op = {
    "gemm_rs",
    "fused GEMM+ReduceScatter vs unfused (cuBLAS/tw_gemm + reduce) and the pieces; m = total "
    "rows, k = K per rank, --world ranks (8)",
    rs_sweep,
    5,
    rs_quick,
    2,
    run_rs};
BENCH_OP_REGISTER(gemm_rs, gemm_rs_op, 50);

static const bench_op_t gemm_ar_op = {
    "gemm_ar",
    "fused GEMM+AllReduce vs unfused (cuBLAS/tw_gemm + reduce) and the pieces; m = total rows, "
    "k = K per rank, --world ranks (8)",
    ar_sweep,
    6,
    rs_quick,
    2,
    run_ar};
BENCH_OP_REGISTER(gemm_ar, gemm_ar_op, 60);
