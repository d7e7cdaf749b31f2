/*
 * tw-bench ag_gemm: AllGather+GEMM, side by side in one run on --world ranks
 * (default 8; virtual ranks sharing one GPU when there are fewer GPUs, each
 * with its SM budget). Shape: m = total rows (world * m_local), n = columns per
 * rank, k. Variants, each on every rank's stream:
 *   fused           tw_ag_gemm, in place (the shard written into its slot of a_gathered), in
 *                   the default mode (TW_AG_COMM_AUTO: the library picks the copy engine or
 *                   the SMs)
 *   fused-sm        (ranks on distinct GPUs only) the same with TW_AG_COMM_SM
 *   fused-nogather  (ranks sharing a GPU only) tw_ag_gemm with no_gathered_out = 1: the GEMM
 *                   reads the peers' shards in place, nothing is copied
 *   fused-ce-gather (ranks sharing a GPU, TW_BENCH_AG_CE_GATHER=1, eager only; a measurement)
 *                   fused-nogather while a side stream of each rank copies the peers' shards
 *                   into its a_gathered with cudaMemcpyAsync: what the gathered output would
 *                   cost if a copy engine wrote it beside the GEMM instead of the GEMM's
 *                   write-through
 *   copy-engine     (ranks on distinct GPUs, not with TW_BENCH_GRAPH) TW_AG_COMM_COPY_ENGINE:
 *                   cudaMemcpyAsync + stream-written flags on a side stream while every CTA
 *                   computes (Flux / PyTorch async-TP style)
 *   unfused         tw_allgather, then cuBLAS on the gathered A (limited to the rank's SMs)
 *   unfused-tw      tw_allgather, then tw_gemm (the same core as the fused op)
 *   gemm-alone      tw_gemm on an already-gathered A (the rank's SMs)
 *   allgather       tw_allgather alone
 *   nccl+cublas, nccl-allgather  with ranks on distinct GPUs and libnccl loadable
 *                   (src/ref/ref_nccl.h): NCCL's allgather then cuBLAS, and NCCL alone
 *   bound           (t_gemm + t_comm) / max(t_gemm, t_comm) in its speedup column: the best a
 *                   perfect overlap could give over the unfused pipeline
 * speedup = baseline time / this time, the baseline being nccl+cublas when present, else
 * unfused; overlap (fused rows) = max(t_gemm, t_comm) / t_fused with t_comm the baseline's
 * allgather. The check compares the fused C with unfused-tw's, bitwise, on every rank.
 */
#include <cuda_runtime.h>

#include <string.h>

#include "bench.h"
#include "bench_ranks.h"
#include "ref/ref_gemm.h"
#include "ref/ref_nccl.h"
#include "tw_test.h"

typedef struct ag_ctx {
  bench_ranks_t *rk;
  int64_t m_local, n, k;
  void *a[TW_MAX_WORLD], *b[TW_MAX_WORLD], *c[TW_MAX_WORLD], *c2[TW_MAX_WORLD];
  void *gathered[TW_MAX_WORLD], *gathered2[TW_MAX_WORLD];
  tw_ref_blas_t *blas[TW_MAX_WORLD];
  tw_ref_nccl_t *nccl;             /* ranks on distinct GPUs and libnccl loadable; else NULL */
  cudaStream_t side[TW_MAX_WORLD]; /* fused-ce-gather's copy streams */
  cudaEvent_t fork[TW_MAX_WORLD], join[TW_MAX_WORLD];
  int failed;
} ag_ctx;

static void note(ag_ctx *c, tw_status_t st, int r, const char *what) {
  if (st == TW_SUCCESS)
    return;
  fprintf(stderr, "%s (rank %d): %s\n", what, r, tw_comm_last_error(c->rk->comms[r]));
  c->failed = 1;
}

static void do_allgather(ag_ctx *c, int r) {
  note(c,
       tw_allgather(c->rk->comms[r], c->a[r], c->gathered2[r], (size_t)c->m_local * c->k * 2,
                    (tw_stream_t)c->rk->streams[r]),
       r, "tw_allgather");
}

static void do_tw_gemm(ag_ctx *c, int r, void *out) {
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.a = c->gathered2[r], g.b = c->b[r], g.c = out;
  g.m = c->m_local * c->rk->world, g.n = c->n, g.k = c->k;
  g.sm_count = c->rk->sm_budget;
  /* K split by the shape where few tiles meet a long K, as tw_ag_gemm's own GEMM then does
   * (TW_AG_UNFUSED_SMALL=0: the fused kernel, unsplit) */
  const char *small = getenv("TW_AG_UNFUSED_SMALL");
  g.split_k = small && atoi(small) == 0 ? 0 : -1;
  if (tw_gemm(&g, (tw_stream_t)c->rk->streams[r]) != TW_SUCCESS) {
    fprintf(stderr, "tw_gemm: %s\n", tw_last_error());
    c->failed = 1;
  }
}

/* Pseudo comm mode of this file: TW_AG_COMM_SM with no_gathered_out = 1. */
#define BENCH_SM_NO_GATHER 100

static void run_fused_mode(ag_ctx *c, int comm_mode) {
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    tw_ag_gemm_args_t a = TW_AG_GEMM_ARGS_INIT;
    /* In place: the shard already sits in its slot of the symmetric buffer. */
    a.a = (char *)c->gathered[r] + (size_t)r * c->m_local * c->k * 2;
    a.b = c->b[r], a.c = c->c[r], a.a_gathered = c->gathered[r];
    a.m_local = c->m_local, a.n = c->n, a.k = c->k;
    a.comm_mode = comm_mode == BENCH_SM_NO_GATHER ? TW_AG_COMM_SM : comm_mode;
    a.no_gathered_out = comm_mode == BENCH_SM_NO_GATHER;
    note(c, tw_ag_gemm(c->rk->comms[r], &a, (tw_stream_t)c->rk->streams[r]), r, "tw_ag_gemm");
  }
}

static void run_fused(void *p, int iter) { /* the library's default mode */
  (void)iter;
  run_fused_mode((ag_ctx *)p, TW_AG_COMM_AUTO);
}

static void run_fused_sm(void *p, int iter) {
  (void)iter;
  run_fused_mode((ag_ctx *)p, TW_AG_COMM_SM);
}

static void run_fused_no_gather(void *p, int iter) {
  (void)iter;
  run_fused_mode((ag_ctx *)p, BENCH_SM_NO_GATHER);
}

/* fused-ce-gather: each rank's side stream copies the peers' shards (in their own slots of
 * their buffers, untouched by the in-place call) into its a_gathered while the no-gather call
 * runs; the rank's stream waits for the copies at the end. */
static void run_fused_ce_gather(void *p, int iter) {
  (void)iter;
  ag_ctx *c = (ag_ctx *)p;
  const size_t shard = (size_t)c->m_local * c->k * 2;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    BENCH_CUDA(cudaEventRecord(c->fork[r], c->rk->streams[r]));
    BENCH_CUDA(cudaStreamWaitEvent(c->side[r], c->fork[r], 0));
    for (int q = 1; q < c->rk->world; q++) {
      const int s = (r + q) % c->rk->world;
      BENCH_CUDA(cudaMemcpyAsync((char *)c->gathered[r] + (size_t)s * shard,
                                 (const char *)c->gathered[s] + (size_t)s * shard, shard,
                                 cudaMemcpyDeviceToDevice, c->side[r]));
    }
    BENCH_CUDA(cudaEventRecord(c->join[r], c->side[r]));
  }
  run_fused_mode(c, BENCH_SM_NO_GATHER);
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    BENCH_CUDA(cudaStreamWaitEvent(c->rk->streams[r], c->join[r], 0));
  }
}

static void run_copy_engine(void *p, int iter) {
  (void)iter;
  run_fused_mode((ag_ctx *)p, TW_AG_COMM_COPY_ENGINE);
}

static void run_unfused(void *p, int iter) {
  (void)iter;
  ag_ctx *c = (ag_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    do_allgather(c, r);
    if (tw_ref_cublas_gemm(c->blas[r], c->gathered2[r], c->b[r], c->c2[r], TW_BF16,
                           c->m_local * c->rk->world, c->n, c->k, c->k, c->k, c->n,
                           c->rk->sm_budget, c->rk->streams[r]) != TW_SUCCESS)
      c->failed = 1;
  }
}

static void run_unfused_tw(void *p, int iter) {
  (void)iter;
  ag_ctx *c = (ag_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    do_allgather(c, r);
    do_tw_gemm(c, r, c->c2[r]);
  }
}

static void run_gemm_alone(void *p, int iter) {
  (void)iter;
  ag_ctx *c = (ag_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    do_tw_gemm(c, r, c->c2[r]);
  }
}

static void run_nccl_allgather(void *p, int iter) {
  (void)iter;
  ag_ctx *c = (ag_ctx *)p;
  if (tw_ref_nccl_allgather(c->nccl, (const void *const *)c->a, c->gathered2,
                            (size_t)c->m_local * c->k * 2, c->rk->streams) != 0) {
    fprintf(stderr, "NCCL allgather: %s\n", tw_ref_nccl_error());
    c->failed = 1;
  }
}

static void run_nccl_cublas(void *p, int iter) {
  ag_ctx *c = (ag_ctx *)p;
  run_nccl_allgather(p, iter);
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    if (tw_ref_cublas_gemm(c->blas[r], c->gathered2[r], c->b[r], c->c2[r], TW_BF16,
                           c->m_local * c->rk->world, c->n, c->k, c->k, c->k, c->n,
                           c->rk->sm_budget, c->rk->streams[r]) != TW_SUCCESS)
      c->failed = 1;
  }
}

static void run_allgather(void *p, int iter) {
  (void)iter;
  ag_ctx *c = (ag_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    do_allgather(c, r);
  }
}

/* Pseudo comm mode of this file: fused-ce-gather. */
#define BENCH_CE_GATHER 101

/* Fused C (in the given mode) == unfused-tw C, bitwise, on every rank; for fused-ce-gather the
 * gathered A too (against tw_allgather's). */
static int check(ag_ctx *c, int comm_mode) {
  const bench_ranks_t *rk = c->rk;
  size_t c_bytes = (size_t)c->m_local * rk->world * c->n * 2;
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    tw_test_poison(c->c[r], c_bytes, (tw_stream_t)rk->streams[r]);
    tw_test_poison(c->c2[r], c_bytes, (tw_stream_t)rk->streams[r]);
  }
  const size_t g_bytes = (size_t)c->m_local * rk->world * c->k * 2;
  if (comm_mode == BENCH_CE_GATHER) {
    for (int r = 0; r < rk->world; r++) { /* poison the peers' slots it must fill */
      bench_ranks_use(rk, r);
      const size_t shard = g_bytes / rk->world;
      if (r > 0)
        tw_test_poison(c->gathered[r], (size_t)r * shard, (tw_stream_t)rk->streams[r]);
      if (r + 1 < rk->world)
        tw_test_poison((char *)c->gathered[r] + (size_t)(r + 1) * shard,
                       (size_t)(rk->world - r - 1) * shard, (tw_stream_t)rk->streams[r]);
    }
    for (int r = 0; r < rk->world; r++) { /* every rank's poison before any rank's copies */
      bench_ranks_use(rk, r);
      BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
    }
    run_fused_ce_gather(c, 0);
  } else {
    run_fused_mode(c, comm_mode);
  }
  run_unfused_tw(c, 0);
  int ok = !c->failed;
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
    size_t diff = tw_test_count_diff(c->c[r], c->c2[r], c_bytes);
    if (comm_mode == BENCH_CE_GATHER)
      diff += tw_test_count_diff(c->gathered[r], c->gathered2[r], g_bytes);
    tw_status_t async = TW_SUCCESS;
    tw_comm_async_error(rk->comms[r], &async);
    if (diff || async != TW_SUCCESS) {
      fprintf(stderr, "ag_gemm check, rank %d: %zu bytes differ from tw_allgather + tw_gemm; %s\n",
              r, diff, async ? tw_comm_last_error(rk->comms[r]) : "no async error");
      ok = 0;
    }
  }
  return ok;
}

/* Allocates and fills every rank's buffers (the shard in its slot of `gathered`, B, both Cs),
 * fills gathered2 once through the allgather and loads cuBLAS's kernels for the shape. Returns
 * 0, or 1 after printing why. */
static int ag_setup(ag_ctx *c, bench_ranks_t *rk, const bench_shape_t *shape) {
  const int world = rk->world;
  memset(c, 0, sizeof(*c));
  c->rk = rk;
  c->m_local = shape->m / world, c->n = shape->n, c->k = shape->k;
  size_t shard = (size_t)c->m_local * c->k * 2, c_bytes = (size_t)shape->m * c->n * 2;
  for (int r = 0; r < world; r++) {
    if (tw_mem_alloc(rk->comms[r], shard * world, &c->gathered[r]) != TW_SUCCESS ||
        tw_mem_alloc(rk->comms[r], shard * world, &c->gathered2[r]) != TW_SUCCESS) {
      fprintf(stderr, "tw_mem_alloc: %s\n", tw_comm_last_error(rk->comms[r]));
      return 1;
    }
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaMalloc(&c->a[r], shard));
    BENCH_CUDA(cudaMalloc(&c->b[r], (size_t)c->n * c->k * 2));
    BENCH_CUDA(cudaMalloc(&c->c[r], c_bytes));
    BENCH_CUDA(cudaMalloc(&c->c2[r], c_bytes));
    tw_test_fill_bf16(c->a[r], (size_t)c->m_local * c->k, 11 + r, (tw_stream_t)rk->streams[r]);
    BENCH_CUDA(cudaMemcpyAsync((char *)c->gathered[r] + (size_t)r * shard, c->a[r], shard,
                               cudaMemcpyDeviceToDevice, rk->streams[r]));
    tw_test_fill_bf16(c->b[r], (size_t)c->n * c->k, 1000 + r, (tw_stream_t)rk->streams[r]);
    if (tw_ref_blas_create(&c->blas[r]) != TW_SUCCESS)
      return 1;
  }
  /* gemm-alone reads gathered2: fill it once through the allgather. */
  run_allgather(c, 0);
  for (int r = 0; r < world; r++)
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
  /* Load cuBLAS's kernels for the timed shape before any persistent kernel spins: its lazy
   * module loading can wait for the device to go idle, which never happens while ranks wait
   * on each other (a first cuBLAS launch then stalls until the library's wait bound). */
  for (int r = 0; r < world; r++) {
    bench_ranks_use(rk, r);
    if (tw_ref_cublas_gemm(c->blas[r], c->gathered2[r], c->b[r], c->c2[r], TW_BF16, shape->m, c->n,
                           c->k, c->k, c->k, c->n, rk->sm_budget, rk->streams[r]) != TW_SUCCESS)
      return 1;
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
  }
  return 0;
}

static void ag_teardown(ag_ctx *c, int ce_gather) {
  bench_ranks_t *rk = c->rk;
  tw_ref_nccl_destroy(c->nccl);
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
    cudaFree(c->a[r]), cudaFree(c->b[r]), cudaFree(c->c[r]), cudaFree(c->c2[r]);
    tw_ref_blas_destroy(c->blas[r]);
    tw_mem_free(rk->comms[r], c->gathered[r]);
    tw_mem_free(rk->comms[r], c->gathered2[r]);
    if (ce_gather) {
      cudaStreamDestroy(c->side[r]);
      cudaEventDestroy(c->fork[r]), cudaEventDestroy(c->join[r]);
    }
  }
}

/* The variants of one shape in row order: unfused, unfused-tw, gemm-alone, allgather and fused
 * at fixed places, then the ones this machine has; i_* say where those landed (-1: absent). */
enum { kMaxVariants = 10, kUnfused = 0, kGemmAlone = 2, kAllgather = 3, kFused = 4 };
typedef struct {
  struct {
    const char *name;
    void (*fn)(void *, int);
  } v[kMaxVariants];
  int n, i_ce, i_nccl, i_ng, i_sm, i_cg;
} ag_variants_t;

/* shared: some ranks share a GPU; ce_gather: the fused-ce-gather row is on. */
static void ag_variants(ag_variants_t *vs, int shared, int ce_gather, int have_nccl) {
  memset(vs, 0, sizeof(*vs));
  vs->v[0] = {"unfused", run_unfused};
  vs->v[1] = {"unfused-tw", run_unfused_tw};
  vs->v[kGemmAlone] = {"gemm-alone", run_gemm_alone};
  vs->v[kAllgather] = {"allgather", run_allgather};
  vs->v[kFused] = {"fused", run_fused};
  int nv = 5;
  vs->i_ce = vs->i_nccl = vs->i_ng = vs->i_sm = vs->i_cg = -1;
  if (shared) /* ranks share a GPU: the in-place peer reads of no_gathered_out = 1 */
    vs->i_ng = nv, vs->v[nv++] = {"fused-nogather", run_fused_no_gather};
  if (ce_gather)
    vs->i_cg = nv, vs->v[nv++] = {"fused-ce-gather", run_fused_ce_gather};
  if (!shared) /* the default mode may take the copy engine there: the SM-driven one too */
    vs->i_sm = nv, vs->v[nv++] = {"fused-sm", run_fused_sm};
  if (!shared && !bench_graph_mode()) /* eager only */
    vs->i_ce = nv, vs->v[nv++] = {"copy-engine", run_copy_engine};
  if (have_nccl) {
    vs->i_nccl = nv;
    vs->v[nv++] = {"nccl+cublas", run_nccl_cublas};
    vs->v[nv++] = {"nccl-allgather", run_nccl_allgather};
  }
  vs->n = nv;
}

/* The checks of the fused variants (1: passed or not run). */
typedef struct {
  int fused, sm, ce, ng, cg;
} ag_checks_t;

/* Times every variant together (bench_time_multi_rounds) and adds their rows, the TW_BENCH_AB
 * rows of the fused op and the bound row. */
static void ag_rows(ag_ctx *c, const bench_opts_t *o, const bench_shape_t *shape,
                    const ag_variants_t *vs, const ag_checks_t *ok, bench_results_t *res) {
  bench_ranks_t *rk = c->rk;
  const int world = rk->world, nv = vs->n;
  const size_t shard = (size_t)c->m_local * c->k * 2;
  double ms[kMaxVariants] = {0}, p10[kMaxVariants] = {0}, p90[kMaxVariants] = {0};
  bench_row_t rows[kMaxVariants + 1];
  {
    void (*fns[kMaxVariants])(void *, int);
    for (int v = 0; v < nv; v++)
      fns[v] = vs->v[v].fn;
    bench_time_multi_rounds(fns, nv, c, rk->streams[0], rk->streams, world, o->warmup, o->repeats,
                            ms, p10, p90);
  }
  for (int v = 0; v < nv; v++) {
    bench_row_t *row = &rows[v];
    memset(row, 0, sizeof(*row));
    snprintf(row->op, sizeof(row->op), "ag_gemm");
    snprintf(row->variant, sizeof(row->variant), "%s", vs->v[v].name);
    int nodes = 1;
    tw_comm_nodes(rk->comms[0], &nodes);
    char layout[32] = ""; /* virtual nodes (TW_RANKS_PER_NODE): nodes x ranks per node */
    if (nodes > 1)
      snprintf(layout, sizeof(layout), " nodes=%dx%d", nodes, world / nodes);
    snprintf(row->shape, sizeof(row->shape), "M=%lld N=%lld/rank K=%lld w=%d%s sms=%d%s%s",
             (long long)shape->m, (long long)c->n, (long long)c->k, world, layout, rk->sm_budget,
             shape->label ? " " : "", shape->label ? shape->label : "");
    row->ms = ms[v], row->ms_p10 = p10[v], row->ms_p90 = p90[v];
    const int is_comm = v == kAllgather || (vs->i_nccl >= 0 && v == vs->i_nccl + 1);
    if (is_comm)
      row->gbps = (double)shard * world / (ms[v] * 1e-3) * (world - 1) / world / 1e9;
    else
      row->tflops = 2.0 * shape->m * c->n * c->k / (ms[v] * 1e-3) / 1e12;
    row->ok = !c->failed && bench_ranks_async_ok(rk, vs->v[v].name);
  }
  /* Baseline and communication time: NCCL's when present. */
  const double t_base = vs->i_nccl >= 0 ? ms[vs->i_nccl] : ms[kUnfused];
  const double t_comm = vs->i_nccl >= 0 ? ms[vs->i_nccl + 1] : ms[kAllgather];
  const double t_gemm = ms[kGemmAlone], t_max = t_gemm > t_comm ? t_gemm : t_comm;
  for (int v = 0; v < nv; v++) {
    rows[v].speedup = t_base / ms[v];
    if (v == kFused || v == vs->i_ce || v == vs->i_ng || v == vs->i_sm ||
        v == vs->i_cg) { /* the fused variants */
      rows[v].overlap = t_max / ms[v];
      rows[v].ok = rows[v].ok && (v == kFused     ? ok->fused
                                  : v == vs->i_ce ? ok->ce
                                  : v == vs->i_sm ? ok->sm
                                  : v == vs->i_cg ? ok->cg
                                                  : ok->ng);
    }
    bench_add_row(res, &rows[v]);
  }
  /* TW_BENCH_AB: interleaved rows of the fused op under each value of one knob (bench.h). */
  bench_ab_rows(res, &rows[kFused], "fused", 2.0 * shape->m * c->n * c->k, t_base, t_max, run_fused,
                c, rk->streams[0], rk->streams, world, o);
  bench_row_t bound = rows[kFused];
  snprintf(bound.variant, sizeof(bound.variant), "bound");
  bound.ms = bound.ms_p10 = bound.ms_p90 = t_max;
  bound.tflops = 0, bound.overlap = 0, bound.ok = 1;
  bound.speedup = (t_gemm + t_comm) / t_max;
  bench_add_row(res, &bound);
}

static int run_ag_gemm(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res) {
  bench_ranks_t rk;
  int world = o->world ? o->world : 8;
  if (shape->m % world) {
    fprintf(stderr, "ag_gemm: m=%lld is not divisible by world=%d\n", (long long)shape->m, world);
    return 1;
  }
  if (bench_ranks_init(&rk, world, o->sm_budget))
    return 1;
  ag_ctx c;
  if (ag_setup(&c, &rk, shape))
    return 1;
  /* The copy-engine mode needs every rank on its own GPU (tw_ag_gemm refuses it otherwise). */
  int shared = 0;
  for (int r = 0; r < world; r++)
    for (int q = 0; q < r; q++)
      shared |= rk.devices[q] == rk.devices[r];
  ag_checks_t ok;
  ok.fused = o->check ? check(&c, TW_AG_COMM_AUTO) : 1;
  ok.sm = o->check && !shared ? check(&c, TW_AG_COMM_SM) : 1;
  ok.ce = o->check && !shared ? check(&c, TW_AG_COMM_COPY_ENGINE) : 1;
  ok.ng = o->check && shared ? check(&c, BENCH_SM_NO_GATHER) : 1;
  const char *ce_env = getenv("TW_BENCH_AG_CE_GATHER");
  const int ce_gather = shared && !bench_graph_mode() && ce_env && atoi(ce_env);
  for (int r = 0; ce_gather && r < world; r++) {
    bench_ranks_use(&rk, r);
    BENCH_CUDA(cudaStreamCreateWithFlags(&c.side[r], cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreateWithFlags(&c.fork[r], cudaEventDisableTiming));
    BENCH_CUDA(cudaEventCreateWithFlags(&c.join[r], cudaEventDisableTiming));
  }
  ok.cg = o->check && ce_gather ? check(&c, BENCH_CE_GATHER) : 1;
  char why[256] = "";
  if (tw_ref_nccl_create(&c.nccl, world, rk.devices, why, sizeof(why)) != 0)
    fprintf(stderr, "ag_gemm: no NCCL rows: %s\n", why);
  ag_variants_t vs;
  ag_variants(&vs, shared, ce_gather, c.nccl != NULL);
  ag_rows(&c, o, shape, &vs, &ok, res);
  ag_teardown(&c, ce_gather);
  bench_ranks_fini(&rk);
  return 0;
}

/* m = total rows, n = columns per rank, k. */
static const bench_shape_t ag_sweep[] = {
    {4096, 6144, 12288, "flux-tp8"},
    {4096, 512, 4096, NULL},
    {8192, 1024, 8192, NULL},
    {16384, 2048, 16384, NULL},
};
static const bench_shape_t ag_quick[] = {{4096, 512, 4096, NULL}, {8192, 1024, 8192, NULL}};

static const bench_op_t ag_gemm_op = {
    "ag_gemm",
    "AllGather+GEMM: fused vs allgather+cuBLAS vs GEMM alone; m = total rows, n = cols per rank",
    ag_sweep,
    4,
    ag_quick,
    2,
    run_ag_gemm};
BENCH_OP_REGISTER(ag_gemm, ag_gemm_op, 40);
