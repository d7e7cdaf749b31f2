/*
 * tw-bench moe_ffn: an MoE layer's whole expert FFN (expert parallelism inside a node), side by
 * side in one run on --world ranks (default 8; virtual ranks sharing one GPU when there are
 * fewer GPUs). Shape: m = tokens per rank, n = inter (the experts' intermediate size), k =
 * hidden; the experts and top-k from the sweep's label or TW_BENCH_MOE_EXPERTS / _TOPK, the
 * routing as tw-bench moe's (bench_moe_route.h; TW_BENCH_MOE_SKEW, TW_BENCH_MOE_SEED). Each
 * rank's weights: gate|up [local][2 inter, hidden] and down [local][hidden, inter], random.
 * Rows, each on every rank's stream:
 *   unfused   tw_moe_dispatch, tw_grouped_gemm (gate/up into h), tw_swiglu, tw_grouped_gemm
 *             (down into expert_out), tw_moe_combine: the baseline
 *   fused     tw_moe_ffn (its own recv, offsets, h, act, expert_out and out)
 *   comm      tw_moe_dispatch and tw_moe_combine alone
 *   compute   the two grouped GEMMs and tw_swiglu alone, on the recv the dispatch filled
 *   bound     (t_compute + t_comm) / max(t_compute, t_comm) in its speedup column
 * TFLOP/s per GPU from 6 * live rows * inter * hidden summed over the ranks, over the world.
 * The check (before timing, outputs poisoned): the fused call's offsets are the host's layout
 * and its out is bitwise the pipeline's on every rank (every token, every column) and finite.
 */
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_moe_route.h"
#include "bench_ranks.h"
#include "tw_test.h"

typedef struct ffn_ctx {
  bench_ranks_t *rk;
  bench_moe_route_t rt;
  int64_t tokens, hidden, inter, experts, top_k, local, recv_rows;
  void *x[TW_MAX_WORLD], *idx[TW_MAX_WORLD], *w13[TW_MAX_WORLD], *w2[TW_MAX_WORLD];
  float *topk_w[TW_MAX_WORLD];
  void *ws[TW_MAX_WORLD];
  void *recv[2][TW_MAX_WORLD], *eout[2][TW_MAX_WORLD]; /* symmetric; [0] unfused, [1] fused */
  void *h[2][TW_MAX_WORLD], *act[2][TW_MAX_WORLD], *out[2][TW_MAX_WORLD];
  int32_t *off[2][TW_MAX_WORLD];
  int failed;
} ffn_ctx;

static void note(ffn_ctx *c, tw_status_t st, int r, const char *what) {
  if (st == TW_SUCCESS)
    return;
  fprintf(stderr, "%s (rank %d): %s\n", what, r,
          c->rk->comms[r] ? tw_comm_last_error(c->rk->comms[r]) : tw_last_error());
  c->failed = 1;
}

static tw_moe_args_t args_of(const ffn_ctx *c, int r, int f) {
  tw_moe_args_t a = TW_MOE_ARGS_INIT;
  a.x = c->x[r], a.topk_idx = c->idx[r], a.topk_weights = c->topk_w[r];
  a.recv = c->recv[f][r], a.offsets = c->off[f][r], a.expert_out = c->eout[f][r];
  a.out = c->out[f][r], a.workspace = c->ws[r];
  a.tokens = c->tokens, a.max_tokens = c->tokens, a.hidden = c->hidden, a.n_out = c->hidden;
  a.experts = c->experts, a.top_k = c->top_k, a.recv_rows = c->recv_rows;
  a.weights = c->w13[r], a.weights2 = c->w2[r], a.h = c->h[f][r], a.act = c->act[f][r];
  a.inter = c->inter;
  return a;
}

/* The experts' part of the pipeline on rank r: gate/up, SwiGLU, down. */
static void do_compute(ffn_ctx *c, int r) {
  const tw_stream_t s = (tw_stream_t)c->rk->streams[r];
  tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
  g.a = c->recv[0][r], g.b = c->w13[r], g.out = c->h[0][r], g.offsets = c->off[0][r];
  g.m = c->recv_rows, g.n = 2 * c->inter, g.k = c->hidden, g.groups = c->local;
  g.sm_count = c->rk->sm_budget;
  note(c, tw_grouped_gemm(&g, s), r, "tw_grouped_gemm (gate/up)");
  note(c, tw_swiglu(c->h[0][r], c->act[0][r], c->recv_rows, c->inter, s), r, "tw_swiglu");
  g.a = c->act[0][r], g.b = c->w2[r], g.out = c->eout[0][r];
  g.n = c->hidden, g.k = c->inter;
  note(c, tw_grouped_gemm(&g, s), r, "tw_grouped_gemm (down)");
}

static void run_unfused(void *p, int iter) {
  (void)iter;
  ffn_ctx *c = (ffn_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    const tw_moe_args_t a = args_of(c, r, 0);
    const tw_stream_t s = (tw_stream_t)c->rk->streams[r];
    note(c, tw_moe_dispatch(c->rk->comms[r], &a, s), r, "tw_moe_dispatch");
    do_compute(c, r);
    note(c, tw_moe_combine(c->rk->comms[r], &a, s), r, "tw_moe_combine");
  }
}

static void run_fused(void *p, int iter) {
  (void)iter;
  ffn_ctx *c = (ffn_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    const tw_moe_args_t a = args_of(c, r, 1);
    note(c, tw_moe_ffn(c->rk->comms[r], &a, (tw_stream_t)c->rk->streams[r]), r, "tw_moe_ffn");
  }
}

static void run_comm(void *p, int iter) {
  (void)iter;
  ffn_ctx *c = (ffn_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    const tw_moe_args_t a = args_of(c, r, 0);
    const tw_stream_t s = (tw_stream_t)c->rk->streams[r];
    note(c, tw_moe_dispatch(c->rk->comms[r], &a, s), r, "tw_moe_dispatch");
    note(c, tw_moe_combine(c->rk->comms[r], &a, s), r, "tw_moe_combine");
  }
}

static void run_compute(void *p, int iter) {
  (void)iter;
  ffn_ctx *c = (ffn_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    do_compute(c, r);
  }
}

static void sync_all(const bench_ranks_t *rk) {
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
  }
  bench_ranks_use(rk, 0);
}

/* Every rank's buffers. 0, or 1 after printing why. */
static int ffn_setup(ffn_ctx *c, uint64_t seed) {
  const bench_ranks_t *rk = c->rk;
  size_t ws_bytes = 0;
  if (tw_moe_workspace_size(rk->comms[0], c->tokens, c->hidden, c->experts, c->top_k, &ws_bytes) !=
      TW_SUCCESS) {
    fprintf(stderr, "tw_moe_workspace_size: %s\n", tw_comm_last_error(rk->comms[0]));
    return 1;
  }
  const size_t R = (size_t)c->recv_rows, H = (size_t)c->hidden, I = (size_t)c->inter;
  const size_t T = (size_t)(c->tokens ? c->tokens : 1), entries = (size_t)(c->tokens * c->top_k);
  const size_t w_count = (size_t)c->local * 2 * I * H;
  float *hw = (float *)malloc((entries ? entries : 1) * sizeof(float));
  if (!hw) {
    fprintf(stderr, "tw-bench: out of host memory\n");
    return 1;
  }
  for (int r = 0; r < rk->world; r++) {
    for (int f = 0; f < 2; f++)
      if (tw_mem_alloc(rk->comms[r], R * H * 2, &c->recv[f][r]) != TW_SUCCESS ||
          tw_mem_alloc(rk->comms[r], R * H * 2, &c->eout[f][r]) != TW_SUCCESS) {
        fprintf(stderr, "tw_mem_alloc: %s\n", tw_comm_last_error(rk->comms[r]));
        free(hw);
        return 1;
      }
    if (tw_mem_alloc(rk->comms[r], ws_bytes, &c->ws[r]) != TW_SUCCESS) {
      fprintf(stderr, "tw_mem_alloc: %s\n", tw_comm_last_error(rk->comms[r]));
      free(hw);
      return 1;
    }
    bench_ranks_use(rk, r);
    const tw_stream_t s = (tw_stream_t)rk->streams[r];
    BENCH_CUDA(cudaMalloc(&c->x[r], T * H * 2));
    BENCH_CUDA(cudaMalloc(&c->idx[r], (entries ? entries : 1) * sizeof(int32_t)));
    BENCH_CUDA(cudaMalloc((void **)&c->topk_w[r], (entries ? entries : 1) * sizeof(float)));
    BENCH_CUDA(cudaMalloc(&c->w13[r], w_count * 2));
    BENCH_CUDA(cudaMalloc(&c->w2[r], w_count));
    for (int f = 0; f < 2; f++) {
      BENCH_CUDA(cudaMalloc(&c->h[f][r], R * I * 4));
      BENCH_CUDA(cudaMalloc(&c->act[f][r], R * I * 2));
      BENCH_CUDA(cudaMalloc(&c->out[f][r], T * H * 2));
      BENCH_CUDA(cudaMalloc((void **)&c->off[f][r], (size_t)(c->local + 1) * sizeof(int32_t)));
    }
    uint64_t rng = seed * 7919 + 17 + (uint64_t)r;
    for (size_t i = 0; i < entries; i++)
      hw[i] = (float)(tw_test_xorshift(&rng) >> 40) / (float)(1 << 24);
    BENCH_CUDA(cudaMemcpy(c->topk_w[r], hw, entries * sizeof(float), cudaMemcpyHostToDevice));
    BENCH_CUDA(
        cudaMemcpy(c->idx[r], c->rt.h_idx[r], entries * sizeof(int32_t), cudaMemcpyHostToDevice));
    tw_test_fill_bf16(c->x[r], (size_t)c->tokens * H, seed * 131 + 11 + r, s);
    tw_test_fill_bf16(c->w13[r], w_count, seed * 131 + 1000 + r, s);
    tw_test_fill_bf16(c->w2[r], w_count / 2, seed * 131 + 2000 + r, s);
  }
  free(hw);
  sync_all(rk);
  return 0;
}

static void ffn_teardown(ffn_ctx *c) {
  const bench_ranks_t *rk = c->rk;
  sync_all(rk);
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    cudaFree(c->x[r]), cudaFree(c->idx[r]), cudaFree(c->topk_w[r]);
    cudaFree(c->w13[r]), cudaFree(c->w2[r]);
    for (int f = 0; f < 2; f++) {
      cudaFree(c->h[f][r]), cudaFree(c->act[f][r]), cudaFree(c->out[f][r]);
      cudaFree(c->off[f][r]);
      if (c->recv[f][r])
        tw_mem_free(rk->comms[r], c->recv[f][r]);
      if (c->eout[f][r])
        tw_mem_free(rk->comms[r], c->eout[f][r]);
    }
    if (c->ws[r])
      tw_mem_free(rk->comms[r], c->ws[r]);
  }
  bench_moe_route_free(&c->rt);
  bench_ranks_use(rk, 0);
}

/* tw_moe_ffn against the pipeline on every rank: the offsets the host's, out bitwise and
 * finite. 1 when they agree. */
static int ffn_check(ffn_ctx *c) {
  const bench_ranks_t *rk = c->rk;
  const size_t out_bytes = (size_t)(c->tokens ? c->tokens : 1) * (size_t)c->hidden * 2;
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaMemsetAsync(c->out[0][r], 0xFF, out_bytes, rk->streams[r]));
    BENCH_CUDA(cudaMemsetAsync(c->out[1][r], 0xFE, out_bytes, rk->streams[r]));
    BENCH_CUDA(cudaMemsetAsync(c->off[1][r], 0xFF, (size_t)(c->local + 1) * 4, rk->streams[r]));
  }
  sync_all(rk);
  run_unfused(c, 0);
  sync_all(rk);
  run_fused(c, 0);
  sync_all(rk);
  int ok = !c->failed;
  int32_t off[kMoeMaxExperts + 1];
  for (int r = 0; r < rk->world && ok; r++) {
    bench_ranks_use(rk, r);
    ok &= bench_ranks_async_ok(rk, "moe_ffn check");
    BENCH_CUDA(cudaMemcpy(off, c->off[1][r], (size_t)(c->local + 1) * 4, cudaMemcpyDeviceToHost));
    size_t off_bad = 0, nan = 0;
    for (int64_t el = 0; el <= c->local; el++)
      off_bad += off[el] != bench_moe_offset(&c->rt, r, el);
    const size_t n = (size_t)c->tokens * (size_t)c->hidden;
    const size_t diff = tw_test_count_diff(c->out[0][r], c->out[1][r], n * 2);
    (void)tw_test_rel_err_bf16(c->out[1][r], c->out[0][r], 0, n, &nan);
    if (off_bad || diff || nan) {
      fprintf(stderr,
              "moe_ffn check, rank %d: %zu offsets off the host's layout, %zu out bytes differ "
              "from the pipeline's, %zu non-finite\n",
              r, off_bad, diff, nan);
      ok = 0;
    }
  }
  bench_ranks_use(rk, 0);
  return ok;
}

static void ffn_rows(ffn_ctx *c, const bench_opts_t *o, const bench_shape_t *shape, int ok_fused,
                     bench_results_t *res) {
  const int world = c->rk->world;
  const char *name = shape->label ? strrchr(shape->label, ' ') : NULL;
  char text[sizeof(((bench_row_t *)0)->shape)];
  snprintf(text, sizeof(text), "T=%lld/rank H=%lld I=%lld E=%lld top%lld w=%d sms=%d%s%s",
           (long long)c->tokens, (long long)c->hidden, (long long)c->inter, (long long)c->experts,
           (long long)c->top_k, world, c->rk->sm_budget, c->rt.skew ? " skew" : "",
           name ? name : "");
  bench_moe_rows_t in = {"moe_ffn",
                         text,
                         {"unfused", "fused", "comm", "compute"},
                         {run_unfused, run_fused, run_comm, run_compute},
                         c,
                         &c->failed,
                         6.0 * (double)c->rt.live_total * (double)c->inter * (double)c->hidden /
                             world,
                         /* the rows crossing ranks, both ways */
                         2.0 * (double)c->rt.remote_rows * (double)c->hidden * 2 / world,
                         ok_fused};
  bench_moe_add_rows(&in, c->rk, o, res);
}

static int run_moe_ffn(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res) {
  const int world = o->world ? o->world : 8;
  const int64_t experts = bench_moe_param(shape, "E=", "TW_BENCH_MOE_EXPERTS", 256);
  const int64_t top_k = bench_moe_param(shape, "top=", "TW_BENCH_MOE_TOPK", 8);
  if (experts < 1 || experts > kMoeMaxExperts || top_k < 1 || top_k > kMoeMaxTopK ||
      top_k > experts || shape->m < 1 || shape->m > (int64_t)INT32_MAX / kMoeMaxTopK ||
      shape->n < 8 || shape->n % 8 || shape->k < 8 || shape->k % 8) {
    fprintf(stderr,
            "tw-bench moe_ffn: experts %lld (1 .. %d), top-k %lld (1 .. %d, at most the "
            "experts), m (tokens per rank) %lld (1 .. 2^27), n (inter) %lld and k (hidden) %lld "
            "(multiples of 8)\n",
            (long long)experts, kMoeMaxExperts, (long long)top_k, kMoeMaxTopK, (long long)shape->m,
            (long long)shape->n, (long long)shape->k);
    return 1;
  }
  if (experts % world) {
    fprintf(stderr, "moe_ffn: %lld experts are no multiple of world=%d: %s\n", (long long)experts,
            world, o->have_shape ? "cannot run the shape" : "shape skipped");
    return o->have_shape ? 1 : 0;
  }
  const char *skew_env = getenv("TW_BENCH_MOE_SKEW"), *seed_env = getenv("TW_BENCH_MOE_SEED");
  const uint64_t seed = seed_env && *seed_env ? strtoull(seed_env, NULL, 10) : 1;
  bench_ranks_t rk;
  if (bench_ranks_init(&rk, world, o->sm_budget))
    return 1;
  ffn_ctx *c = (ffn_ctx *)calloc(1, sizeof(ffn_ctx));
  if (!c) {
    fprintf(stderr, "tw-bench: out of host memory\n");
    exit(3);
  }
  c->rk = &rk;
  c->tokens = shape->m, c->inter = shape->n, c->hidden = shape->k;
  c->experts = experts, c->top_k = top_k, c->local = experts / world;
  c->rt.world = world, c->rt.skew = skew_env && atoi(skew_env) == 1, c->rt.tokens = c->tokens;
  c->rt.experts = experts, c->rt.top_k = top_k, c->rt.local = c->local;
  int rc = bench_moe_route(&c->rt, seed);
  if (rc)
    fprintf(stderr, "tw-bench: out of host memory (the routing)\n");
  c->recv_rows = c->rt.recv_rows;
  if (!rc)
    rc = ffn_setup(c, seed);
  if (!rc) {
    const int ok_fused = o->check ? ffn_check(c) : 1;
    rc = c->failed;
    if (!rc && !o->check) {
      run_unfused(c, 0);
      run_fused(c, 0);
      sync_all(&rk);
      rc = c->failed;
    }
    if (!rc)
      ffn_rows(c, o, shape, ok_fused, res);
  }
  ffn_teardown(c);
  free(c);
  bench_ranks_fini(&rk);
  return rc;
}

/* m = tokens per rank, n = inter, k = hidden; E and top-k in the label. */
static const bench_shape_t ffn_sweep[] = {
    {512, 2048, 7168, "E=256 top=8 dsv3"},    {2048, 2048, 7168, "E=256 top=8 dsv3"},
    {1024, 14336, 4096, "E=8 top=2 mixtral"}, {1, 2048, 7168, "E=256 top=8 decode"},
    {64, 2048, 7168, "E=256 top=8 decode"},   {256, 2048, 7168, "E=256 top=8 decode"},
};
static const bench_shape_t ffn_quick[] = {
    {512, 2048, 7168, "E=256 top=8 dsv3"},
    {64, 2048, 7168, "E=256 top=8 decode"},
};

static const bench_op_t moe_ffn_op = {
    "moe_ffn",
    "MoE expert FFN (dispatch, gate/up, SwiGLU, down, combine): fused vs the unfused pipeline "
    "and the pieces; m = tokens per rank, n = inter, k = hidden, E/top-k in the label",
    ffn_sweep,
    (int)(sizeof(ffn_sweep) / sizeof(ffn_sweep[0])),
    ffn_quick,
    (int)(sizeof(ffn_quick) / sizeof(ffn_quick[0])),
    run_moe_ffn,
};
BENCH_OP_REGISTER(moe_ffn, moe_ffn_op, 72);
