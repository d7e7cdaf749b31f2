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
 * Across nodes (virtual nodes, TW_RANKS_PER_NODE, over the inter-node transport) the reduce
 * kernels cannot reach the other nodes, so the rows are:
 *   unfused-rail    the library's unfused pipeline over the same transport (TW_RS_UNFUSED_SMALL=1:
 *                   tw_gemm, then the rail kernel's reduce; the speedup baseline, and the
 *                   bitwise check of the fused rows)
 *   tw_gemm-alone   that pipeline's GEMM alone (tw_gemm, fp32 or bf16 partials out)
 *   gemm-alone      as above
 *   reduce-rail     unfused-rail - tw_gemm-alone: the reduce's time (derived, not timed; t_comm)
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
  int nodes; /* the comm's nodes (virtual nodes: the rows across nodes) */
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
  char layout[32] = "";
  if (c->nodes > 1)
    snprintf(layout, sizeof(layout), " nodes=%dx%d", c->nodes, c->world / c->nodes);
  snprintf(dst, len, "%s%sM=%lld N=%lld K/rank=%lld world=%d%s sms/rank=%d",
           shape->label ? shape->label : "", shape->label ? " " : "", (long long)c->m,
           (long long)c->n, (long long)c->k, c->world, layout, c->budget);
}

static void *fused_out(const rs_ctx *c, int r) {
  return c->use_out_sym ? c->out_sym[r] : c->out[r];
}

/* Every rank's tw_gemm_rs / tw_gemm_ar into out(c, r); `what` names the call in errors. */
static void call_op(rs_ctx *c, void *(*out)(const rs_ctx *, int), const char *what) {
  for (int r = 0; r < c->world; r++) {
    tw_gemm_rs_args_t a = TW_GEMM_RS_ARGS_INIT;
    a.a = c->a[r], a.b = c->b[r], a.out = out(c, r), a.workspace = c->ws[r];
    a.out_symmetric = out == fused_out ? c->use_out_sym : 0;
    a.partials = c->partials;
    a.m = c->m, a.n = c->n, a.k = c->k;
    a.reduce_sms = c->reduce_sms;
    tw_stream_t s = (tw_stream_t)c->streams[r];
    tw_status_t st =
        c->all_reduce ? tw_gemm_ar(c->comms[r], &a, s) : tw_gemm_rs(c->comms[r], &a, s);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "tw_gemm_%s%s: %s\n", c->all_reduce ? "ar" : "rs", what,
              tw_comm_last_error(c->comms[r]));
      c->failed = 1;
    }
  }
}

static void run_fused(void *p, int iter) {
  (void)iter;
  call_op((rs_ctx *)p, fused_out, "");
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

/* tw_gemm of every rank's partial (fp32, or bf16 with bf16 partials): the unfused pipelines'
 * GEMM, alone. */
static void run_tw_gemm_alone(void *p, int iter) {
  (void)iter;
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
}

static void run_unfused_tw(void *p, int iter) {
  run_tw_gemm_alone(p, iter);
  run_reduce(p, iter);
}

/* Across nodes: the library's unfused pipeline (tw_gemm, then the rail kernel's reduce) into
 * out2, through the knob that forces it. */
static void *unfused_out(const rs_ctx *c, int r) { return c->out2[r]; }

static void run_unfused_rail(void *p, int iter) {
  (void)iter;
  setenv("TW_RS_UNFUSED_SMALL", "1", 1);
  call_op((rs_ctx *)p, unfused_out, " (unfused)");
  unsetenv("TW_RS_UNFUSED_SMALL");
}

static void run_nothing(void *p, int iter) { (void)p, (void)iter; }

/* Fused vs unfused-tw (across nodes: unfused-rail), bitwise, on every rank. */
static int check_bitwise(rs_ctx *c) {
  for (int r = 0; r < c->world; r++) {
    BENCH_CUDA(cudaSetDevice(c->devices[r]));
    tw_test_poison(fused_out(c, r), (size_t)c->m * c->n * 2, (tw_stream_t)c->streams[r]);
    tw_test_poison(c->out2[r], (size_t)c->m * c->n * 2, (tw_stream_t)c->streams[r]);
  }
  run_fused(c, 0);
  if (c->nodes > 1)
    run_unfused_rail(c, 0);
  else
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

/* Ranks (rank r on GPU r % GPUs, every rank on GPU 0 with TW_BENCH_VIRTUAL=1, as bench_ranks.h
 * does), every rank's buffers filled, the peers' pointers, and cuBLAS's kernels loaded. Returns
 * 0, or 1 after printing why. direct_row: the workspace also holds the direct scheme's. */
static int rs_setup(rs_ctx *c, const bench_opts_t *o, int direct_row) {
  const int world = c->world;
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
    return 1;
  }
  tw_comm_sm_budget(c->comms[0], &c->budget);
  c->nodes = 1;
  tw_comm_nodes(c->comms[0], &c->nodes);
  size_t ws_bytes = 0;
  if (tw_gemm_rs_workspace_size(c->comms[0], c->m, c->n, &ws_bytes) != TW_SUCCESS) {
    fprintf(stderr, "workspace: %s\n", tw_comm_last_error(c->comms[0]));
    return 1;
  }
  const size_t mn = (size_t)c->m * c->n;
  if (direct_row && ws_bytes < (size_t)world * mn * 4)
    ws_bytes = (size_t)world * mn * 4;
  for (int r = 0; r < world; r++) {
    if (tw_mem_alloc(c->comms[r], ws_bytes, &c->ws[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->comms[r], mn * 4, (void **)&c->partial[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->comms[r], mn * 2, &c->out2[r]) != TW_SUCCESS ||
        (c->all_reduce && world > 1 &&
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
  for (int r = 0; r < world && c->nodes == 1; r++) /* the reduce kernels' peers */
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
  return 0;
}

/* NCCL rows where the ranks are on distinct GPUs and libnccl loads (ref_nccl.h): c->nccl and
 * the scratch for its fp32 result; else c->nccl stays NULL and the reason is printed. */
static void rs_nccl_setup(rs_ctx *c) {
  char why[256] = "";
  if (tw_ref_nccl_create(&c->nccl, c->world, c->devices, why, sizeof(why)) == 0) {
    const size_t rows = (size_t)(c->all_reduce ? c->m : c->m / c->world);
    for (int r = 0; r < c->world; r++) {
      BENCH_CUDA(cudaSetDevice(c->devices[r]));
      BENCH_CUDA(cudaMalloc(&c->scratch[r], rows * (size_t)c->n * sizeof(float)));
    }
    BENCH_CUDA(cudaSetDevice(c->devices[0]));
  } else {
    fprintf(stderr, "gemm_%s: no NCCL rows: %s\n", c->all_reduce ? "ar" : "rs", why);
  }
}

static void rs_teardown(rs_ctx *c) {
  for (int r = 0; r < c->world; r++) {
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
}

/* The main rows, in table order; the fused one last. */
static const struct {
  const char *name;
  void (*fn)(void *, int);
} main_variants[] = {{"unfused-cublas", run_unfused_cublas},
                     {"unfused-tw", run_unfused_tw},
                     {"gemm-alone", run_gemm_alone},
                     {"reduce-alone", run_reduce},
                     {"tilewire", run_fused}};
enum {
  kMain = (int)(sizeof(main_variants) / sizeof(main_variants[0])),
  kGemmAlone = 2,
  kReduceAlone = 3,
  kNccl = 4, /* nccl+cublas, nccl-reduce, nccl-bf16+cublas, nccl-bf16-reduce */
};
static const char *const nccl_names[kNccl] = {"nccl+cublas", "nccl-reduce", "nccl-bf16+cublas",
                                              "nccl-bf16-reduce"};

/* What one shape measured and checked. The rows' times in table order: t[0, kMain) the main
 * rows, then x.n extra rows, then nnccl NCCL rows. */
typedef struct rs_run {
  double t[24], p10[24], p90[24];
  extra_rows_t x; /* points into t, p10, p90 after the main rows */
  double tm[kMain + kNccl], tm10[kMain + kNccl], tm90[kMain + kNccl]; /* main and NCCL */
  int nnccl;
  int sweep_partials; /* the TW_BENCH_RS_REDUCE_SMS rows' partials */
  int nodes;          /* rs_ctx.nodes: the row names across nodes */
  int ok, ok_direct, ok_direct_bf16, ok_bf16p, ok_sym[2];
  double t_nccl, t_nccl_reduce, t_nccl_bf16, t_nccl_bf16_reduce;
  double flops, t_gemm, t_comm, t_base;
} rs_run_t;

/* The main rows and NCCL's four timed together (bench.h): tm[0, kMain) are copied into t now,
 * tm[kMain, kMain + 4) after the extra rows (place_nccl). */
static void time_main(rs_ctx *c, const bench_opts_t *o, rs_run_t *run) {
  void (*fns[kMain + kNccl])(void *, int);
  for (int v = 0; v < kMain; v++)
    fns[v] = main_variants[v].fn;
  if (c->nodes > 1) /* rows across nodes (the top); reduce-rail is derived below */
    fns[0] = run_unfused_rail, fns[1] = run_tw_gemm_alone, fns[kReduceAlone] = run_nothing;
  const int nn = c->nccl ? kNccl : 0;
  if (nn)
    fns[kMain] = run_nccl_cublas, fns[kMain + 1] = run_nccl_reduce,
    fns[kMain + 2] = run_nccl_bf16_cublas, fns[kMain + 3] = run_nccl_bf16;
  bench_time_multi_rounds(fns, kMain + nn, c, c->streams[0], c->streams, c->world, o->warmup,
                          o->repeats, run->tm, run->tm10, run->tm90);
  for (int v = 0; v < kMain; v++)
    run->t[v] = run->tm[v], run->p10[v] = run->tm10[v], run->p90[v] = run->tm90[v];
  if (c->nodes > 1) {
    const double d = run->t[0] - run->t[1];
    run->t[kReduceAlone] = run->p10[kReduceAlone] = run->p90[kReduceAlone] = d > 0 ? d : 0;
  }
}

/* The extra rows, each timed alone after the main ones: TW_BENCH_RS_REDUCE_SMS, the direct
 * scheme, bf16 partials, symmetric outputs; each fused variant checked bitwise first. */
static void time_extras(rs_ctx *c, const bench_opts_t *o, rs_run_t *run, int direct_row) {
  extra_rows_t *x = &run->x;
  /* TW_BENCH_RS_REDUCE_SMS=2,4,6: extra fused rows with that many reduce CTAs per rank
   * (TW_BENCH_RS_SWEEP_BF16=1: with bf16 partials, rows tilewire-bf16p-rN). */
  const char *list = getenv("TW_BENCH_RS_REDUCE_SMS");
  const char *sweep_bf16 = getenv("TW_BENCH_RS_SWEEP_BF16");
  run->sweep_partials = sweep_bf16 && *sweep_bf16 == '1' ? TW_PARTIALS_BF16 : TW_PARTIALS_FP32;
  c->partials = run->sweep_partials;
  for (const char *q = list; q && *q && x->n < 8;) {
    int v = atoi(q);
    if (v > 0 && v < c->budget) {
      c->reduce_sms = v;
      time_extra(c, o, x, v, run_fused);
    }
    q = strchr(q, ',');
    q = q ? q + 1 : NULL;
  }
  c->reduce_sms = 0;
  c->partials = TW_PARTIALS_FP32;
  /* tw_gemm_ar's direct scheme (TW_AR_DIRECT=1), checked bitwise like the default. */
  run->ok_direct = 1, run->ok_direct_bf16 = 1;
  if (direct_row) {
    time_direct(c, o, x, -1, &run->ok_direct);
  }
  /* bf16 partials (extra row code -2), checked bitwise against unfused-tw with bf16 partials. */
  run->ok_bf16p = 1;
  if (c->world > 1) {
    c->partials = TW_PARTIALS_BF16;
    run->ok_bf16p = o->check ? check_bitwise(c) : 1;
    time_extra(c, o, x, -2, run_fused);
    /* The unfused pipeline with bf16 partials (tw_gemm bf16 out, then the rank-ordered
     * reduce): what a fallback inside the library would cost where the fused op loses. */
    time_extra(c, o, x, -3, c->nodes > 1 ? run_unfused_rail : run_unfused_tw);
    /* The direct scheme with bf16 partials (row tilewire-bf16p-direct): one hop of bf16 tiles,
     * no gather phase. */
    if (direct_row) {
      time_direct(c, o, x, -4, &run->ok_direct_bf16);
    }
    c->partials = TW_PARTIALS_FP32;
  }
  /* gemm_ar into symmetric outputs (rows tilewire-outsym, tilewire-bf16p-outsym), checked
   * bitwise like the default. */
  run->ok_sym[0] = run->ok_sym[1] = 1;
  for (int bf16 = 0; c->all_reduce && c->world > 1 && c->nodes == 1 && bf16 < 2; bf16++) {
    c->use_out_sym = 1;
    c->partials = bf16 ? TW_PARTIALS_BF16 : TW_PARTIALS_FP32;
    run->ok_sym[bf16] = o->check ? check_bitwise(c) : 1;
    time_extra(c, o, x, bf16 ? -6 : -5, run_fused);
    c->use_out_sym = 0;
    c->partials = TW_PARTIALS_FP32;
  }
}

/* With NCCL: its rows go after the extra ones, its pipeline is the baseline and its reduction
 * the communication time. Then the figures every row is measured against. */
static void place_nccl(const rs_ctx *c, rs_run_t *run) {
  const int nn = c->nccl ? kNccl : 0;
  run->nnccl = 0;
  run->t_nccl = run->t_nccl_reduce = run->t_nccl_bf16 = run->t_nccl_bf16_reduce = 0;
  if (nn) { /* timed with the main rows */
    const int at = kMain + run->x.n;
    for (int i = 0; i < nn; i++)
      run->t[at + i] = run->tm[kMain + i], run->p10[at + i] = run->tm10[kMain + i],
                  run->p90[at + i] = run->tm90[kMain + i];
    run->t_nccl = run->tm[kMain], run->t_nccl_reduce = run->tm[kMain + 1],
    run->t_nccl_bf16 = run->tm[kMain + 2], run->t_nccl_bf16_reduce = run->tm[kMain + 3];
    run->nnccl = nn;
  }
  run->flops = 2.0 * (double)c->m * (double)c->n * (double)c->k;
  run->t_gemm = run->t[kGemmAlone];
  run->t_comm = c->nccl ? run->t_nccl_reduce : run->t[kReduceAlone];
  run->t_base = c->nccl ? run->t_nccl : run->t[0];
}

/* A row of this op and shape, all figures zero. */
static void rs_row_init(bench_row_t *row, const rs_ctx *c, const bench_shape_t *shape) {
  memset(row, 0, sizeof(*row));
  snprintf(row->op, sizeof(row->op), "gemm_%s", c->all_reduce ? "ar" : "rs");
  rs_shape(row->shape, sizeof(row->shape), shape, c);
}

/* Row v's variant name: a main row, an extra row (by its code), or an NCCL row. */
static void rs_variant_name(char *dst, size_t len, const rs_run_t *run, int v) {
  const extra_rows_t *x = &run->x;
  static const char *const nodes_names[kMain] = {"unfused-rail", "tw_gemm-alone", "gemm-alone",
                                                 "reduce-rail", "tilewire"};
  if (v < kMain)
    snprintf(dst, len, "%s", run->nodes > 1 ? nodes_names[v] : main_variants[v].name);
  else if (v < kMain + x->n)
    snprintf(dst, len,
             x->code[v - kMain] == -3 && run->nodes > 1 ? "unfused-rail-bf16p"
             : x->code[v - kMain] == -6                 ? "tilewire-bf16p-outsym"
             : x->code[v - kMain] == -5                 ? "tilewire-outsym"
             : x->code[v - kMain] == -4                 ? "tilewire-bf16p-direct"
             : x->code[v - kMain] == -3                 ? "unfused-tw-bf16p"
             : x->code[v - kMain] == -2                 ? "tilewire-bf16p"
             : x->code[v - kMain] == -1                 ? "tilewire-direct"
             : run->sweep_partials                      ? "tilewire-bf16p-r%d"
                                                        : "tilewire-r%d",
             x->code[v - kMain]);
  else
    snprintf(dst, len, "%s", nccl_names[v - kMain - x->n]);
}

/* The timed rows: main, extra, NCCL. bf16-partial rows are against the bf16 NCCL pipeline. */
static void rs_rows(const rs_ctx *c, const bench_shape_t *shape, const rs_run_t *run,
                    bench_results_t *res) {
  const extra_rows_t *x = &run->x;
  const double *t = run->t;
  for (int v = 0; v < kMain + x->n + run->nnccl; v++) {
    bench_row_t row;
    rs_row_init(&row, c, shape);
    rs_variant_name(row.variant, sizeof(row.variant), run, v);
    row.ms = t[v], row.ms_p10 = run->p10[v], row.ms_p90 = run->p90[v];
    const int is_comm = v == kReduceAlone || v == kMain + x->n + 1 || v == kMain + x->n + 3;
    const int is_fused =
        v == kMain - 1 || (v >= kMain && v < kMain + x->n && x->code[v - kMain] != -3);
    row.tflops = is_comm ? 0 : run->flops / (t[v] * 1e-3) / 1e12;
    const int code = v >= kMain && v < kMain + x->n ? x->code[v - kMain] : 0;
    const int is_bf16p = code == -2 || code == -3 || code == -4 || code == -6;
    row.speedup = (is_bf16p && c->nccl ? run->t_nccl_bf16 : run->t_base) / t[v];
    if (is_fused) {
      const double t_c = is_bf16p && c->nccl ? run->t_nccl_bf16_reduce : run->t_comm;
      row.overlap = (run->t_gemm > t_c ? run->t_gemm : t_c) / t[v];
    }
    row.ok = (is_fused || v == 1 ? run->ok : 1) && (code != -1 || run->ok_direct) &&
             (!is_bf16p || run->ok_bf16p) && (code != -4 || run->ok_direct_bf16) &&
             (code != -5 || run->ok_sym[0]) && (code != -6 || run->ok_sym[1]) && !c->failed;
    bench_add_row(res, &row);
  }
}

/* TW_BENCH_AB: interleaved rows of the fused op (fp32 and bf16 partials) under each value of
 * one knob (bench.h); with TW_BENCH_AB_OUTSYM=1 also of gemm_ar into symmetric outputs. */
static void rs_ab_rows(rs_ctx *c, const bench_opts_t *o, const bench_shape_t *shape,
                       const rs_run_t *run, bench_results_t *res) {
  const char *ab_sym = getenv("TW_BENCH_AB_OUTSYM");
  const int ab_rows = !getenv("TW_BENCH_AB")                                ? 0
                      : c->world == 1                                       ? 1
                      : c->all_reduce && ab_sym && strcmp(ab_sym, "1") == 0 ? 4
                                                                            : 2;
  for (int v = 0; v < ab_rows; v++) {
    const int bf16 = v & 1, sym = v >> 1;
    static const char *prefixes[] = {"tilewire", "tilewire-bf16p", "tilewire-outsym",
                                     "tilewire-bf16p-outsym"};
    bench_row_t tmpl;
    rs_row_init(&tmpl, c, shape);
    tmpl.ok = (sym ? run->ok_sym[bf16] : bf16 ? run->ok_bf16p : run->ok) && !c->failed;
    const double t_c = bf16 && c->nccl ? run->t_nccl_bf16_reduce : run->t_comm;
    c->partials = bf16 ? TW_PARTIALS_BF16 : TW_PARTIALS_FP32;
    c->use_out_sym = sym;
    bench_ab_rows(res, &tmpl, prefixes[v], run->flops,
                  bf16 && c->nccl ? run->t_nccl_bf16 : run->t_base,
                  run->t_gemm > t_c ? run->t_gemm : t_c, run_fused, c, c->streams[0], c->streams,
                  c->world, o);
    c->partials = TW_PARTIALS_FP32;
    c->use_out_sym = 0;
  }
}

/* The overlap bound, (t_gemm + t_comm) / max(t_gemm, t_comm): the best a perfect overlap could
 * give over the unfused pipeline, of the fp32 NCCL pipeline (bound) and of the bf16 one
 * (bound-bf16). */
static void rs_bound_rows(const rs_ctx *c, const bench_shape_t *shape, const rs_run_t *run,
                          bench_results_t *res) {
  for (int b = 0; c->nccl && b < 2; b++) {
    bench_row_t bound;
    rs_row_init(&bound, c, shape);
    snprintf(bound.variant, sizeof(bound.variant), b ? "bound-bf16" : "bound");
    const double t_c = b ? run->t_nccl_bf16_reduce : run->t_comm;
    const double t_max = run->t_gemm > t_c ? run->t_gemm : t_c;
    bound.ms = bound.ms_p10 = bound.ms_p90 = t_max;
    bound.speedup = (run->t_gemm + t_c) / t_max;
    bound.ok = 1;
    bench_add_row(res, &bound);
  }
}

static int run_op(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res,
                  int all_reduce) {
  rs_ctx *c = (rs_ctx *)calloc(1, sizeof(rs_ctx));
  const int world = o->world ? o->world : 8;
  c->world = world, c->all_reduce = all_reduce;
  c->m = shape->m, c->n = shape->n, c->k = shape->k;
  /* gemm_ar with m <= 4096: room for the direct scheme too (row tilewire-direct). */
  int direct_row = all_reduce && c->m <= 4096 && world > 1;
  if (rs_setup(c, o, direct_row)) {
    free(c);
    return 1;
  }
  direct_row = direct_row && c->nodes == 1; /* a scheme of one node */
  rs_run_t run;
  memset(&run, 0, sizeof(run));
  run.nodes = c->nodes;
  run.ok = o->check ? check_bitwise(c) : 1;
  rs_nccl_setup(c);
  run.x = {run.t + kMain, run.p10 + kMain, run.p90 + kMain, {0}, 0};
  time_main(c, o, &run);
  time_extras(c, o, &run, direct_row);
  place_nccl(c, &run);
  BENCH_CUDA(cudaDeviceSynchronize());
  rs_rows(c, shape, &run, res);
  rs_ab_rows(c, o, shape, &run, res);
  rs_bound_rows(c, shape, &run, res);
  rs_teardown(c);
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
