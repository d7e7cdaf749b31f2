/*
 * `tw-bench ring_attention`: context-parallel attention over --world ranks (default 4; virtual
 * ranks on one GPU when there are fewer GPUs), each holding S tokens of one sequence:
 *   tilewire      tw_ring_attention on every rank (one persistent kernel a rank, the peers' K/V
 *                 read in place)
 *   unfused-ring  what ring-flash-attention runs, on the same core (bench_ring_unfused.cu):
 *                 per ring step the peer's KV chunk copied, tw_attention with lse per pair of
 *                 segments, the partials merged in fp32; the forward rows' baseline (speedup =
 *                 its time / this time)
 *   whole         tw_attention over the whole sequence on rank 0's GPU: the one-GPU reference;
 *                 with ranks sharing one GPU the ring's ideal time (efficiency = whole / ring),
 *                 over distinct GPUs the ideal is whole / world
 *   unfused-ring fwd+bwd  its forward then ring-flash-attention's backward: per step
 *                 tw_attention_backward per pair of segments, dq summed in fp32 on its rank, the
 *                 fp32 dk and dv of each chunk passed round the ring; the fwd+bwd rows' baseline
 *   whole fwd+bwd     tw_attention then tw_attention_backward over the whole sequence on rank
 *                 0's GPU: the fwd+bwd rows' ideal as whole is the forward's
 *   tilewire fwd+bwd  a training step's attention: tw_ring_attention (with lse) then
 *                 tw_ring_attention_backward on every rank
 * Shape: m = S tokens a rank, n = heads (q and kv), k = head_dim; the label's first word the
 * layout ("zigzag": causal, rank r holding chunks r and 2W - 1 - r of S / 2; "contiguous": not
 * causal, positions [r S, (r + 1) S); TW_BENCH_RING_LAYOUT for a --m/--n/--k shape); batch
 * TW_BENCH_RING_BATCH (default 4). TFLOP/s: 4 B H
 * (W S)^2 D (halved for causal) over the time, per GPU of the ring (divided by the GPUs the
 * ranks use); fwd+bwd rows count the backward as 2.5 forwards (FlashAttention's convention). The
 * check (before timing): every rank's tilewire and unfused outputs, and their dq, dk and dv, within
 * 2e-2 (relative to the largest) of the whole sequence's at its positions. Across virtual nodes
 * (TW_RANKS_PER_NODE, over the inter-node transport) the tilewire rows gather the other nodes'
 * shards first (their `gathered`); the unfused ring copies over the node's mappings as before.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_ranks.h"
#include "bench_ring.h"
#include "tw_test.h"

static void run_tilewire(void *p, int iter) {
  (void)iter;
  ring_ctx *c = (ring_ctx *)p;
  for (int r = 0; r < c->world; r++) {
    tw_ring_attention_args_t a = TW_RING_ATTENTION_ARGS_INIT;
    a.q = c->q[r], a.k = c->k[r], a.v = c->v[r], a.o = c->o[r];
    a.batch = c->b, a.heads_q = c->h, a.heads_kv = c->h, a.seq_local = c->s, a.head_dim = c->d;
    a.causal = c->causal, a.layout = c->zigzag ? TW_RING_ZIGZAG : TW_RING_CONTIGUOUS;
    a.gathered = c->fwd_gathered[r];
    if (tw_ring_attention(c->rk->comms[r], &a, (tw_stream_t)c->rk->streams[r]) != TW_SUCCESS) {
      fprintf(stderr, "tw_ring_attention: %s\n", tw_comm_last_error(c->rk->comms[r]));
      c->failed = 1;
    }
  }
}

static void run_whole(void *p, int iter) {
  (void)iter;
  ring_ctx *c = (ring_ctx *)p;
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  a.q = c->wq, a.k = c->wk, a.v = c->wv, a.o = c->wo;
  a.batch = c->b, a.heads_q = c->h, a.heads_kv = c->h, a.head_dim = c->d;
  a.seq_q = a.seq_kv = c->world * c->s, a.causal = c->causal;
  bench_ranks_use(c->rk, 0);
  if (tw_attention(&a, (tw_stream_t)c->rk->streams[0]) != TW_SUCCESS) {
    fprintf(stderr, "tw_attention: %s\n", tw_last_error());
    c->failed = 1;
  }
}

static void run_tilewire_step(void *p, int iter) {
  (void)iter;
  ring_ctx *c = (ring_ctx *)p;
  for (int r = 0; r < c->world && !c->failed; r++) {
    tw_ring_attention_args_t a = TW_RING_ATTENTION_ARGS_INIT;
    a.q = c->q[r], a.k = c->k[r], a.v = c->v[r], a.o = c->o[r], a.lse = c->lse[r];
    a.batch = c->b, a.heads_q = c->h, a.heads_kv = c->h, a.seq_local = c->s, a.head_dim = c->d;
    a.causal = c->causal, a.layout = c->zigzag ? TW_RING_ZIGZAG : TW_RING_CONTIGUOUS;
    a.gathered = c->fwd_gathered[r];
    tw_ring_attention_backward_args_t g = TW_RING_ATTENTION_BACKWARD_ARGS_INIT;
    g.q = a.q, g.k = a.k, g.v = a.v, g.o = a.o, g.lse = a.lse, g.dout = c->dout[r];
    g.dq = c->dq[r], g.dk = c->dk[r], g.dv = c->dv[r], g.workspace = c->ws[r];
    g.batch = a.batch, g.heads_q = a.heads_q, g.heads_kv = a.heads_kv, g.seq_local = a.seq_local;
    g.head_dim = a.head_dim, g.causal = a.causal, g.layout = a.layout;
    g.gathered = c->bwd_gathered[r];
    tw_stream_t st = (tw_stream_t)c->rk->streams[r];
    if (tw_ring_attention(c->rk->comms[r], &a, st) != TW_SUCCESS ||
        tw_ring_attention_backward(c->rk->comms[r], &g, st) != TW_SUCCESS) {
      fprintf(stderr, "tw_ring_attention(_backward): %s\n", tw_comm_last_error(c->rk->comms[r]));
      c->failed = 1;
    }
  }
}

static void run_whole_step(void *p, int iter) {
  (void)iter;
  ring_ctx *c = (ring_ctx *)p;
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  a.q = c->wq, a.k = c->wk, a.v = c->wv, a.o = c->wo, a.lse = c->wlse;
  a.batch = c->b, a.heads_q = c->h, a.heads_kv = c->h, a.head_dim = c->d;
  a.seq_q = a.seq_kv = c->world * c->s, a.causal = c->causal;
  tw_attention_backward_args_t g = TW_ATTENTION_BACKWARD_ARGS_INIT;
  g.q = a.q, g.k = a.k, g.v = a.v, g.o = a.o, g.lse = a.lse, g.dout = c->wdo;
  g.dq = c->wdq, g.dk = c->wdk, g.dv = c->wdv, g.workspace = c->wws;
  g.batch = a.batch, g.heads_q = a.heads_q, g.heads_kv = a.heads_kv, g.head_dim = a.head_dim;
  g.seq_q = a.seq_q, g.seq_kv = a.seq_kv, g.causal = a.causal;
  bench_ranks_use(c->rk, 0);
  tw_stream_t st = (tw_stream_t)c->rk->streams[0];
  if (tw_attention(&a, st) != TW_SUCCESS || tw_attention_backward(&g, st) != TW_SUCCESS) {
    fprintf(stderr, "tw_attention(_backward): %s\n", tw_last_error());
    c->failed = 1;
  }
}

/* ---- setup, check, rows -------------------------------------------------------------------- */

static int alloc_ranks(ring_ctx *c) {
  const size_t shard = (size_t)(c->b * c->s * c->h * c->d) * 2;
  for (int r = 0; r < c->world; r++) {
    const size_t rows_bytes = (size_t)(c->b * c->h * c->s) * 4;
    if (tw_mem_alloc(c->rk->comms[r], shard, &c->k[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->rk->comms[r], shard, &c->v[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->rk->comms[r], shard, &c->q[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->rk->comms[r], shard, &c->dout[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->rk->comms[r], rows_bytes, (void **)&c->lse[r]) != TW_SUCCESS ||
        tw_mem_alloc(c->rk->comms[r], rows_bytes, (void **)&c->ws[r]) != TW_SUCCESS) {
      fprintf(stderr, "tw_mem_alloc: %s\n", tw_comm_last_error(c->rk->comms[r]));
      return 1;
    }
    size_t bwd = 0;
    if (tw_ring_attention_backward_gathered_bytes(c->rk->comms[r], c->b, c->h, c->h, c->s, c->d,
                                                  &bwd) != TW_SUCCESS ||
        (bwd && (tw_mem_alloc(c->rk->comms[r], 2 * shard * (size_t)c->world, &c->fwd_gathered[r]) !=
                     TW_SUCCESS ||
                 tw_mem_alloc(c->rk->comms[r], bwd, &c->bwd_gathered[r]) != TW_SUCCESS))) {
      fprintf(stderr, "gathered: %s\n", tw_comm_last_error(c->rk->comms[r]));
      return 1;
    }
    bench_ranks_use(c->rk, r);
    c->o[r] = ring_dev_alloc(shard);
    c->dq[r] = ring_dev_alloc(shard), c->dk[r] = ring_dev_alloc(shard),
    c->dv[r] = ring_dev_alloc(shard);
  }
  ring_alloc_unfused(c);
  bench_ranks_use(c->rk, 0);
  const size_t whole = shard * (size_t)c->world;
  c->wq = ring_dev_alloc(whole), c->wk = ring_dev_alloc(whole), c->wv = ring_dev_alloc(whole);
  c->wo = ring_dev_alloc(whole);
  c->wdo = ring_dev_alloc(whole), c->wdq = ring_dev_alloc(whole), c->wdk = ring_dev_alloc(whole);
  c->wdv = ring_dev_alloc(whole);
  c->wlse = (float *)ring_dev_alloc(whole / (size_t)c->d * 2),
  c->wws = (float *)ring_dev_alloc(whole / (size_t)c->d * 2);
  return 0;
}

static void free_ranks(ring_ctx *c) {
  for (int r = 0; r < c->world; r++) {
    bench_ranks_use(c->rk, r);
    tw_mem_free(c->rk->comms[r], c->k[r]), tw_mem_free(c->rk->comms[r], c->v[r]);
    tw_mem_free(c->rk->comms[r], c->q[r]), tw_mem_free(c->rk->comms[r], c->dout[r]);
    tw_mem_free(c->rk->comms[r], c->lse[r]), tw_mem_free(c->rk->comms[r], c->ws[r]);
    if (c->fwd_gathered[r])
      tw_mem_free(c->rk->comms[r], c->fwd_gathered[r]);
    if (c->bwd_gathered[r])
      tw_mem_free(c->rk->comms[r], c->bwd_gathered[r]);
    cudaFree(c->dq[r]), cudaFree(c->dk[r]), cudaFree(c->dv[r]);
    cudaFree(c->o[r]);
  }
  ring_free_unfused(c);
  bench_ranks_use(c->rk, 0);
  cudaFree(c->wq), cudaFree(c->wk), cudaFree(c->wv), cudaFree(c->wo);
  cudaFree(c->wdo), cudaFree(c->wdq), cudaFree(c->wdk), cudaFree(c->wdv);
  cudaFree(c->wlse), cudaFree(c->wws);
}

/* Random whole-sequence q, k, v on rank 0's GPU, and each rank's shards copied from it. */
static void fill(ring_ctx *c) {
  const size_t whole = (size_t)(c->world * c->b * c->s * c->h * c->d);
  bench_ranks_use(c->rk, 0);
  tw_test_fill_bf16(c->wq, whole, 31, 0);
  tw_test_fill_bf16(c->wk, whole, 32, 0);
  tw_test_fill_bf16(c->wv, whole, 33, 0);
  tw_test_fill_bf16(c->wdo, whole, 34, 0);
  BENCH_CUDA(cudaDeviceSynchronize());
  const size_t line = (size_t)(c->h * c->d * 2), seq = (size_t)(c->world * c->s);
  for (int r = 0; r < c->world; r++) {
    seg_t sg[kMaxSegs];
    const int n = segs_of(c, r, sg);
    void *dst[4] = {c->q[r], c->k[r], c->v[r], c->dout[r]};
    const void *src[4] = {c->wq, c->wk, c->wv, c->wdo};
    for (int t = 0; t < 4; t++)
      for (int i = 0; i < n; i++)
        BENCH_CUDA(cudaMemcpy2D((char *)dst[t] + sg[i].row * line, (size_t)c->s * line,
                                (const char *)src[t] + sg[i].pos * line, seq * line,
                                sg[i].rows * line, (size_t)c->b, cudaMemcpyDefault));
  }
  BENCH_CUDA(cudaDeviceSynchronize());
}

/* Every rank's out (tilewire's o or the unfused uo, a gradient) against the whole sequence's
 * (`whole`) at its positions, on rank 0's GPU; 1 when all are within 2e-2. */
static int check(ring_ctx *c, void *const *outs, const void *whole, const char *what) {
  const size_t line = (size_t)(c->h * c->d * 2), seq = (size_t)(c->world * c->s);
  const size_t shard_elems = (size_t)(c->b * c->s * c->h * c->d);
  bench_ranks_use(c->rk, 0);
  void *want = ring_dev_alloc(shard_elems * 2), *got = ring_dev_alloc(shard_elems * 2);
  int ok = 1;
  for (int r = 0; r < c->world && ok; r++) {
    seg_t sg[kMaxSegs];
    const int n = segs_of(c, r, sg);
    for (int i = 0; i < n; i++)
      BENCH_CUDA(cudaMemcpy2D((char *)want + sg[i].row * line, (size_t)c->s * line,
                              (const char *)whole + sg[i].pos * line, seq * line, sg[i].rows * line,
                              (size_t)c->b, cudaMemcpyDefault));
    BENCH_CUDA(cudaMemcpy(got, outs[r], shard_elems * 2, cudaMemcpyDefault));
    size_t nans = 0;
    const double err = tw_test_rel_err_bf16(got, want, 0, shard_elems, &nans);
    if (nans || !(err <= 2e-2)) {
      fprintf(stderr, "%s: rank %d: error %.3g of the largest, %zu non-finite\n", what, r, err,
              nans);
      ok = 0;
    }
  }
  cudaFree(want), cudaFree(got);
  return ok;
}

static int run_ring(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res) {
  const char *env = getenv("TW_BENCH_RING_BATCH");
  ring_ctx c;
  memset(&c, 0, sizeof(c));
  c.world = o->world ? o->world : 4;
  const char *layout = shape->label ? shape->label : getenv("TW_BENCH_RING_LAYOUT");
  c.zigzag = !(layout && strncmp(layout, "contiguous", 10) == 0);
  c.causal = c.zigzag;
  c.b = env && atoi(env) > 0 ? atoi(env) : 4;
  c.s = shape->m, c.h = shape->n, c.d = shape->k;
  if (c.zigzag && c.s % 2) {
    fprintf(stderr, "tw-bench ring_attention: zigzag needs an even S (m = %lld)\n", (long long)c.s);
    return 1;
  }
  bench_ranks_t rk;
  if (bench_ranks_init(&rk, c.world, o->sm_budget))
    return 1;
  c.rk = &rk;
  c.gpus = 0; /* the distinct GPUs the ranks use */
  for (int r = 0; r < c.world; r++) {
    int seen = 0;
    for (int q = 0; q < r; q++)
      seen |= rk.devices[q] == rk.devices[r];
    c.gpus += !seen;
  }
  if (tw_comm_nodes(rk.comms[0], &c.nodes) != TW_SUCCESS)
    c.nodes = 1;
  if (alloc_ranks(&c)) {
    bench_ranks_fini(&rk);
    return 1;
  }
  fill(&c);
  run_whole_step(&c, 0); /* the references: o, dq, dk, dv of the whole sequence */
  BENCH_CUDA(cudaDeviceSynchronize());
  const double whole_seq = (double)(c.world * c.s);
  const double flops = 4.0 * c.b * c.h * whole_seq * whole_seq * c.d / (c.causal ? 2 : 1);
  void *const *grads[3] = {c.dq, c.dk, c.dv}, *const * ugrads[3] = {c.udq, c.udk, c.udv};
  const void *whole_grads[3] = {c.wdq, c.wdk, c.wdv};
  struct {
    const char *name;
    void (*fn)(void *, int);
    void *const *outs;         /* checked against wo; NULL: not checked */
    void *const *const *grads; /* with outs, a fwd+bwd's dq, dk, dv checked too */
    int step;                  /* fwd+bwd: 3.5 forwards of FLOPs */
    int whole;                 /* on rank 0's GPU alone */
  } variants[] = {{"unfused-ring", ring_run_unfused, c.uo, NULL, 0, 0},
                  {"tilewire", run_tilewire, c.o, NULL, 0, 0},
                  {"whole", run_whole, NULL, NULL, 0, 1},
                  {"unfused-ring fwd+bwd", ring_run_unfused_step, c.uo, ugrads, 1, 0},
                  {"whole fwd+bwd", run_whole_step, NULL, NULL, 1, 1},
                  {"tilewire fwd+bwd", run_tilewire_step, c.o, grads, 1, 0}};
  double ms[6] = {0}; /* one a variant */
  for (int v = 0; v < 6; v++) {
    const int step = variants[v].step;
    bench_row_t row;
    memset(&row, 0, sizeof(row));
    snprintf(row.op, sizeof(row.op), "ring_attention");
    snprintf(row.variant, sizeof(row.variant), "%s", variants[v].name);
    char layout[32] = ""; /* virtual nodes (TW_RANKS_PER_NODE): nodes x ranks per node */
    if (c.nodes > 1)
      snprintf(layout, sizeof(layout), " nodes=%dx%d", c.nodes, c.world / c.nodes);
    snprintf(row.shape, sizeof(row.shape), "B%lld H%lld S%dx%lld D%lld %s%s", (long long)c.b,
             (long long)c.h, c.world, (long long)c.s, (long long)c.d,
             c.zigzag ? "causal zigzag" : "full contiguous", layout);
    row.ok = 1;
    if (o->check && variants[v].outs) {
      variants[v].fn(&c, 0);
      for (int r = 0; r < c.world; r++)
        BENCH_CUDA(cudaStreamSynchronize(rk.streams[r]));
      row.ok = !c.failed && check(&c, variants[v].outs, c.wo, variants[v].name);
      for (int g = 0; g < 3 && variants[v].grads && row.ok; g++)
        row.ok = check(&c, variants[v].grads[g], whole_grads[g],
                       g == 0   ? "dq"
                       : g == 1 ? "dk"
                                : "dv");
    }
    row.ms = bench_time_multi_ms(variants[v].fn, &c, rk.streams[0], rk.streams, c.world, o->warmup,
                                 o->repeats, &row.ms_p10, &row.ms_p90);
    const int per_gpu = variants[v].whole ? 1 : c.gpus;
    row.tflops = flops * (step ? 3.5 : 1.0) / per_gpu / (row.ms * 1e-3) / 1e12;
    row.ok = row.ok && !c.failed && bench_ranks_async_ok(&rk, variants[v].name);
    ms[v] = row.ms;
    /* the forward rows against the unfused ring's forward, the fwd+bwd rows against its step */
    row.speedup = (step ? ms[3] : ms[0]) / row.ms;
    bench_add_row(res, &row);
  }
  printf("  ring_attention %s: efficiency (whole / %d GPU(s) / ring) forward %.2f, fwd+bwd %.2f\n",
         c.zigzag ? "causal zigzag" : "full contiguous", c.gpus, ms[2] / c.gpus / ms[1],
         ms[4] / c.gpus / ms[5]);
  free_ranks(&c);
  bench_ranks_fini(&rk);
  return 0;
}

/* mKernel's shapes: B4 H16 D128, 768 to 12288 tokens a rank. */
static const bench_shape_t ring_sweep[] = {
    {768, 16, 128, "zigzag"},     {3072, 16, 128, "zigzag"},     {12288, 16, 128, "zigzag"},
    {768, 16, 128, "contiguous"}, {3072, 16, 128, "contiguous"}, {12288, 16, 128, "contiguous"},
};
static const bench_shape_t ring_quick[] = {{768, 16, 128, "zigzag"}, {768, 16, 128, "contiguous"}};

static const bench_op_t ring_op = {
    "ring_attention",
    "tw_ring_attention vs the unfused ring and whole-sequence attention; m = tokens a rank, n = "
    "heads, k = head_dim, label zigzag (causal) / contiguous; --world ranks (4)",
    ring_sweep,
    6,
    ring_quick,
    2,
    run_ring};
BENCH_OP_REGISTER(ring_attention, ring_op, 95);
