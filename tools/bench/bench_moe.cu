/*
 * tw-bench moe: an MoE layer's token dispatch and its experts' GEMM (expert parallelism inside a
 * node), side by side in one run on --world ranks (default 8; virtual ranks sharing one GPU when
 * there are fewer GPUs, each with its SM budget). Shape: m = tokens per rank, n = n_out (the
 * experts' output columns), k = hidden; the experts and top-k from the sweep's label
 * ("E=256 top=8 ...") or, for a shape given with --m/--n/--k, TW_BENCH_MOE_EXPERTS (default 256)
 * and TW_BENCH_MOE_TOPK (default 8): `tw-bench moe --m 512 --n 4096 --k 7168` is the sweep's
 * first shape. Rank r holds experts [r E / world, (r + 1) E / world); a shape whose experts are no
 * multiple of the world is skipped with a note in a sweep (an error when given alone).
 * Rows, each on every rank's stream:
 *   unfused       tw_moe_dispatch, then tw_grouped_gemm of the rank's local experts over its
 *                 recv (b = its weights [local][n_out, hidden], m = recv_rows, the dispatch's
 *                 offsets; the rank's SMs): the baseline
 *   fused         tw_moe_dispatch_gemm (the same weights, its own recv, offsets and expert_out)
 *   dispatch      tw_moe_dispatch alone; gbps = the bytes each rank sends to its peers (from the
 *                 routing, averaged over the ranks) over the time
 *   grouped-gemm  tw_grouped_gemm alone, on the recv the dispatch already filled
 *   bound         (t_gemm + t_dispatch) / max(t_gemm, t_dispatch) in its speedup column: the
 *                 best a perfect overlap could give over the unfused pipeline
 * Times are those of every rank's calls (bench_time_multi_rounds), medians over the repeats;
 * speedup = unfused time / this time; overlap (fused) = max(t_gemm, t_dispatch) / t_fused.
 * TFLOP/s per GPU from 2 * live rows * n_out * hidden summed over the ranks, over the world (the
 * live rows being tokens * top_k in all; the padding rows the GEMMs also compute not counted).
 * Routing (host, seed TW_BENCH_MOE_SEED, default 1): top_k distinct experts per token, uniform;
 * TW_BENCH_MOE_SKEW=1: hot experts (a random max(2 top_k, E / 16) of them take 3 of 4 slots).
 * recv_rows: the largest rank's padded need under that routing (each expert's rows rounded up
 * to 128), plus 128 rows, alike on every rank.
 * The check (before timing, inputs random, outputs poisoned, expert_out differently for each):
 * fused and unfused give bitwise the same recv and offsets on every rank, the offsets are the
 * host's layout, and expert_out's live rows (rows [offsets[e], offsets[e] + live rows of e),
 * counted on the host) agree bitwise, with no non-finite value in them or in recv's live rows.
 *
 * tw-bench moe_combine: the other half of the layer, the experts' second GEMM and the combine,
 * on the same ranks and routing (topk_weights random in [0, 1)). Shape: m = tokens per rank,
 * n = n_out (the combined output's columns, the model's hidden size), k = the GEMM's K (recv's
 * columns, the experts' intermediate size). One tw_moe_dispatch before timing lays recv out.
 *   unfused       tw_grouped_gemm of the local experts into expert_out, then tw_moe_combine
 *   fused         tw_moe_gemm_combine (its own expert_out and out)
 *   combine       tw_moe_combine alone, on the expert_out the GEMM already filled; gbps = the
 *                 bytes each rank reads from its peers' expert_out over the time
 *   grouped-gemm  tw_grouped_gemm alone
 *   bound         as above, with t_combine for t_dispatch
 * The check: expert_out's live rows and out (every token, every column) bitwise alike in both
 * pipelines, the offsets the host's, and no non-finite value in expert_out's live rows or out.
 */
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_moe_route.h"
#include "bench_ranks.h"
#include "tw_test.h"

enum { kDefaultExperts = 256, kDefaultTopK = 8 };

typedef struct moe_ctx {
  bench_ranks_t *rk;
  int64_t tokens, hidden, n_out, experts, top_k, local, recv_rows;
  int skew, combine; /* combine: moe_combine's pipelines (GEMM then combine) */
  void *x[TW_MAX_WORLD], *idx[TW_MAX_WORLD], *weights[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  void *recv[TW_MAX_WORLD], *recv_f[TW_MAX_WORLD]; /* symmetric: unfused's, fused's */
  void *eout[TW_MAX_WORLD], *eout_f[TW_MAX_WORLD]; /* [recv_rows, n_out] */
  int32_t *off[TW_MAX_WORLD], *off_f[TW_MAX_WORLD];
  float *topk_w[TW_MAX_WORLD];                   /* combine: [tokens][top_k] */
  void *out[TW_MAX_WORLD], *out_f[TW_MAX_WORLD]; /* combine: [tokens, n_out] */
  bench_moe_route_t rt;                          /* the host routing */
  int failed;
} moe_ctx;

/* ---- one call of each op, on every rank's stream --------------------------------------------- */

static void note(moe_ctx *c, tw_status_t st, int r, const char *what) {
  if (st == TW_SUCCESS)
    return;
  fprintf(stderr, "%s (rank %d): %s\n", what, r, tw_comm_last_error(c->rk->comms[r]));
  c->failed = 1;
}

static tw_moe_args_t args_of(const moe_ctx *c, int r, int fused) {
  tw_moe_args_t a = TW_MOE_ARGS_INIT;
  a.index_bits = 32;
  a.x = c->x[r], a.topk_idx = c->idx[r];
  const int own = fused && !c->combine; /* the fused dispatch's own recv and offsets */
  a.recv = own ? c->recv_f[r] : c->recv[r];
  a.offsets = own ? c->off_f[r] : c->off[r];
  a.workspace = c->ws[r];
  a.tokens = c->tokens, a.max_tokens = c->tokens, a.hidden = c->hidden, a.n_out = c->n_out;
  a.experts = c->experts, a.top_k = c->top_k, a.recv_rows = c->recv_rows;
  if (fused)
    a.weights = c->weights[r], a.expert_out = c->eout_f[r];
  if (c->combine) {
    a.topk_weights = c->topk_w[r];
    a.expert_out = fused ? c->eout_f[r] : c->eout[r];
    a.out = fused ? c->out_f[r] : c->out[r];
  }
  return a;
}

static void do_dispatch(moe_ctx *c, int r) {
  const tw_moe_args_t a = args_of(c, r, 0);
  note(c, tw_moe_dispatch(c->rk->comms[r], &a, (tw_stream_t)c->rk->streams[r]), r,
       "tw_moe_dispatch");
}

static void do_grouped(moe_ctx *c, int r) {
  tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
  g.a = c->recv[r], g.b = c->weights[r], g.out = c->eout[r], g.offsets = c->off[r];
  g.m = c->recv_rows, g.n = c->n_out, g.k = c->hidden, g.groups = c->local;
  g.sm_count = c->rk->sm_budget;
  if (tw_grouped_gemm(&g, (tw_stream_t)c->rk->streams[r]) != TW_SUCCESS) {
    fprintf(stderr, "tw_grouped_gemm (rank %d): %s\n", r, tw_last_error());
    c->failed = 1;
  }
}

static void do_combine(moe_ctx *c, int r) {
  const tw_moe_args_t a = args_of(c, r, 0);
  note(c, tw_moe_combine(c->rk->comms[r], &a, (tw_stream_t)c->rk->streams[r]), r, "tw_moe_combine");
}

/* moe: dispatch, then the GEMM; moe_combine: the GEMM, then the combine */
static void run_unfused(void *p, int iter) {
  (void)iter;
  moe_ctx *c = (moe_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    if (c->combine) {
      do_grouped(c, r);
      do_combine(c, r);
    } else {
      do_dispatch(c, r);
      do_grouped(c, r);
    }
  }
}

static void run_fused(void *p, int iter) {
  (void)iter;
  moe_ctx *c = (moe_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    const tw_moe_args_t a = args_of(c, r, 1);
    const tw_stream_t s = (tw_stream_t)c->rk->streams[r];
    if (c->combine)
      note(c, tw_moe_gemm_combine(c->rk->comms[r], &a, s), r, "tw_moe_gemm_combine");
    else
      note(c, tw_moe_dispatch_gemm(c->rk->comms[r], &a, s), r, "tw_moe_dispatch_gemm");
  }
}

/* the communication alone: the dispatch (moe) or the combine (moe_combine) */
static void run_comm(void *p, int iter) {
  (void)iter;
  moe_ctx *c = (moe_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    if (c->combine)
      do_combine(c, r);
    else
      do_dispatch(c, r);
  }
}

static void run_grouped(void *p, int iter) {
  (void)iter;
  moe_ctx *c = (moe_ctx *)p;
  for (int r = 0; r < c->rk->world; r++) {
    bench_ranks_use(c->rk, r);
    do_grouped(c, r);
  }
}

/* ---- routing -----------------------------------------------------------------------------------
 */

/* ---- setup ------------------------------------------------------------------------------------
 */

/* moe_combine's buffers of rank r (the current device): topk_weights random in [0, 1), out and
 * out_f. 0, or 1 out of host memory. */
static int setup_combine(moe_ctx *c, int r, uint64_t seed) {
  const size_t entries = (size_t)(c->tokens * c->top_k), t = (size_t)(c->tokens ? c->tokens : 1);
  float *h = (float *)malloc((entries ? entries : 1) * sizeof(float));
  if (!h) {
    fprintf(stderr, "tw-bench: out of host memory\n");
    return 1;
  }
  uint64_t rng = seed * 7919 + 17 + (uint64_t)r;
  for (size_t i = 0; i < entries; i++)
    h[i] = (float)(tw_test_xorshift(&rng) >> 40) / (float)(1 << 24);
  BENCH_CUDA(cudaMalloc((void **)&c->topk_w[r], (entries ? entries : 1) * sizeof(float)));
  BENCH_CUDA(cudaMemcpy(c->topk_w[r], h, entries * sizeof(float), cudaMemcpyHostToDevice));
  free(h);
  BENCH_CUDA(cudaMalloc(&c->out[r], t * (size_t)c->n_out * 2));
  BENCH_CUDA(cudaMalloc(&c->out_f[r], t * (size_t)c->n_out * 2));
  return 0;
}

/* Allocates and fills every rank's buffers (x, the routing, the weights; recv, offsets and
 * expert_out for each pipeline; the workspace). Returns 0, or 1 after printing why. */
static int moe_setup(moe_ctx *c, uint64_t seed) {
  const bench_ranks_t *rk = c->rk;
  const int world = rk->world;
  size_t ws_bytes = 0;
  if (tw_moe_workspace_size(rk->comms[0], c->tokens, c->hidden > c->n_out ? c->hidden : c->n_out,
                            c->experts, c->top_k, &ws_bytes) != TW_SUCCESS) {
    fprintf(stderr, "tw_moe_workspace_size: %s\n", tw_comm_last_error(rk->comms[0]));
    return 1;
  }
  const size_t recv_bytes = (size_t)c->recv_rows * (size_t)c->hidden * 2;
  const size_t eout_bytes = (size_t)c->recv_rows * (size_t)c->n_out * 2;
  const size_t w_count = (size_t)c->local * (size_t)c->n_out * (size_t)c->hidden;
  const size_t entries = (size_t)(c->tokens * c->top_k);
  for (int r = 0; r < world; r++) {
    /* expert_out symmetric: the combines read it in place from the experts' ranks */
    if (tw_mem_alloc(rk->comms[r], ws_bytes, &c->ws[r]) != TW_SUCCESS ||
        tw_mem_alloc(rk->comms[r], recv_bytes, &c->recv[r]) != TW_SUCCESS ||
        tw_mem_alloc(rk->comms[r], recv_bytes, &c->recv_f[r]) != TW_SUCCESS ||
        tw_mem_alloc(rk->comms[r], eout_bytes, &c->eout[r]) != TW_SUCCESS ||
        tw_mem_alloc(rk->comms[r], eout_bytes, &c->eout_f[r]) != TW_SUCCESS) {
      fprintf(stderr, "tw_mem_alloc: %s\n", tw_comm_last_error(rk->comms[r]));
      return 1;
    }
    bench_ranks_use(rk, r);
    const tw_stream_t s = (tw_stream_t)rk->streams[r];
    BENCH_CUDA(cudaMalloc(&c->x[r], (size_t)(c->tokens ? c->tokens : 1) * c->hidden * 2));
    BENCH_CUDA(cudaMalloc(&c->idx[r], (entries ? entries : 1) * sizeof(int32_t)));
    BENCH_CUDA(cudaMalloc(&c->weights[r], w_count * 2));
    BENCH_CUDA(cudaMalloc((void **)&c->off[r], (size_t)(c->local + 1) * sizeof(int32_t)));
    BENCH_CUDA(cudaMalloc((void **)&c->off_f[r], (size_t)(c->local + 1) * sizeof(int32_t)));
    BENCH_CUDA(cudaMemcpyAsync(c->idx[r], c->rt.h_idx[r], entries * sizeof(int32_t),
                               cudaMemcpyHostToDevice, rk->streams[r]));
    tw_test_fill_bf16(c->x[r], (size_t)c->tokens * c->hidden, seed * 131 + 11 + r, s);
    tw_test_fill_bf16(c->weights[r], w_count, seed * 131 + 1000 + r, s);
    if (c->combine && setup_combine(c, r, seed))
      return 1;
  }
  for (int r = 0; r < world; r++) {
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
  }
  if (c->combine) { /* the layout the combines use: one dispatch of x */
    for (int r = 0; r < world; r++) {
      bench_ranks_use(rk, r);
      do_dispatch(c, r);
    }
    for (int r = 0; r < world; r++) {
      bench_ranks_use(rk, r);
      BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
    }
    if (c->failed)
      return 1;
  }
  bench_ranks_use(rk, 0);
  return 0;
}

static void moe_teardown(moe_ctx *c) {
  const bench_ranks_t *rk = c->rk;
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
    cudaFree(c->x[r]), cudaFree(c->idx[r]), cudaFree(c->weights[r]);
    cudaFree(c->off[r]), cudaFree(c->off_f[r]);
    cudaFree(c->topk_w[r]), cudaFree(c->out[r]), cudaFree(c->out_f[r]);
    if (c->eout[r])
      tw_mem_free(rk->comms[r], c->eout[r]);
    if (c->eout_f[r])
      tw_mem_free(rk->comms[r], c->eout_f[r]);
    if (c->ws[r])
      tw_mem_free(rk->comms[r], c->ws[r]);
    if (c->recv[r])
      tw_mem_free(rk->comms[r], c->recv[r]);
    if (c->recv_f[r])
      tw_mem_free(rk->comms[r], c->recv_f[r]);
  }
  bench_moe_route_free(&c->rt);
  bench_ranks_use(rk, 0);
}

/* ---- the check ---------------------------------------------------------------------------------
 */

static void sync_all(const bench_ranks_t *rk) {
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
  }
  bench_ranks_use(rk, 0);
}

/* Rank r: the offsets of both pipelines against the host's, recv bitwise, and each expert's live
 * rows of expert_out bitwise, recv's and expert_out's live rows finite. 1 when they agree. */
static int check_rank(const moe_ctx *c, int r) {
  const int64_t H = c->hidden, N = c->n_out, L = c->local;
  int32_t *off = (int32_t *)malloc((size_t)(L + 1) * 2 * sizeof(int32_t));
  if (!off) {
    fprintf(stderr, "tw-bench: out of host memory\n");
    exit(3);
  }
  BENCH_CUDA(cudaMemcpy(off, c->off[r], (size_t)(L + 1) * 4, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(off + L + 1, c->off_f[r], (size_t)(L + 1) * 4, cudaMemcpyDeviceToHost));
  size_t off_bad = 0, eout_diff = 0, bad_recv = 0, bad_eout = 0;
  for (int64_t el = 0; el <= L; el++) { /* moe_combine: the setup dispatch's offsets only */
    const int64_t want = bench_moe_offset(&c->rt, r, el);
    off_bad += off[el] != want || (!c->combine && off[L + 1 + el] != want);
  }
  size_t recv_diff = 0, out_diff = 0, bad_out = 0;
  if (c->combine) {
    const size_t n = (size_t)c->tokens * (size_t)N;
    out_diff = tw_test_count_diff(c->out[r], c->out_f[r], n * 2);
    (void)tw_test_rel_err_bf16(c->out[r], c->out_f[r], 0, n, &bad_out);
  } else {
    recv_diff = tw_test_count_diff(c->recv[r], c->recv_f[r], (size_t)c->recv_rows * (size_t)H * 2);
  }
  for (int64_t el = 0; el < L && off_bad == 0; el++) {
    const size_t live = (size_t)c->rt.live[r * L + el], at = (size_t)off[el];
    if (live == 0)
      continue;
    const char *eu = (const char *)c->eout[r] + at * (size_t)N * 2;
    const char *ef = (const char *)c->eout_f[r] + at * (size_t)N * 2;
    const char *ru = (const char *)c->recv[r] + at * (size_t)H * 2;
    eout_diff += tw_test_count_diff(eu, ef, live * (size_t)N * 2);
    size_t nan = 0;
    (void)tw_test_rel_err_bf16(eu, ef, 0, live * (size_t)N, &nan);
    bad_eout += nan;
    (void)tw_test_rel_err_bf16(ru, ru, 0, live * (size_t)H, &nan);
    bad_recv += nan;
  }
  BENCH_CUDA(cudaGetLastError());
  free(off);
  if (off_bad || recv_diff || eout_diff || bad_recv || bad_eout || out_diff || bad_out) {
    fprintf(stderr,
            "moe check, rank %d: fused vs unfused: %zu offsets off the host's layout, %zu recv "
            "bytes, %zu expert_out live-row bytes and %zu out bytes differ; %zu / %zu / %zu "
            "non-finite values in recv's / expert_out's live rows / out\n",
            r, off_bad, recv_diff, eout_diff, out_diff, bad_recv, bad_eout, bad_out);
    return 0;
  }
  return 1;
}

/* tw_moe_dispatch_gemm against tw_moe_dispatch + tw_grouped_gemm (moe_combine:
 * tw_moe_gemm_combine against tw_grouped_gemm + tw_moe_combine), on every rank. */
static int moe_check(moe_ctx *c) {
  const bench_ranks_t *rk = c->rk;
  const size_t recv_bytes = (size_t)c->recv_rows * (size_t)c->hidden * 2;
  const size_t eout_bytes = (size_t)c->recv_rows * (size_t)c->n_out * 2;
  const size_t off_bytes = (size_t)(c->local + 1) * sizeof(int32_t);
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    const tw_stream_t s = (tw_stream_t)rk->streams[r];
    BENCH_CUDA(cudaMemsetAsync(c->eout[r], 0xFF, eout_bytes, rk->streams[r]));
    BENCH_CUDA(cudaMemsetAsync(c->eout_f[r], 0xFE, eout_bytes, rk->streams[r]));
    if (c->combine) { /* recv and offsets: the setup dispatch's, read by both pipelines */
      const size_t out_bytes = (size_t)(c->tokens ? c->tokens : 1) * (size_t)c->n_out * 2;
      BENCH_CUDA(cudaMemsetAsync(c->out[r], 0xFF, out_bytes, rk->streams[r]));
      BENCH_CUDA(cudaMemsetAsync(c->out_f[r], 0xFE, out_bytes, rk->streams[r]));
      continue;
    }
    tw_test_poison(c->recv[r], recv_bytes, s);
    tw_test_poison(c->recv_f[r], recv_bytes, s); /* alike: padding rows stay as they were */
    BENCH_CUDA(cudaMemsetAsync(c->off[r], 0xFF, off_bytes, rk->streams[r]));
    BENCH_CUDA(cudaMemsetAsync(c->off_f[r], 0xFF, off_bytes, rk->streams[r]));
  }
  sync_all(rk); /* every rank's poison before any rank's copies into it */
  run_unfused(c, 0);
  sync_all(rk);
  run_fused(c, 0);
  sync_all(rk);
  int ok = !c->failed;
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    tw_status_t async = TW_SUCCESS;
    tw_comm_async_error(rk->comms[r], &async);
    if (async != TW_SUCCESS) {
      fprintf(stderr, "moe check, rank %d: %s\n", r, tw_comm_last_error(rk->comms[r]));
      ok = 0;
      continue;
    }
    ok &= check_rank(c, r);
  }
  bench_ranks_use(rk, 0);
  return ok;
}

/* ---- the rows ----------------------------------------------------------------------------------
 */

/* Times the variants together and adds their rows (bench_moe_add_rows). */
static void moe_rows(moe_ctx *c, const bench_opts_t *o, const bench_shape_t *shape, int ok_fused,
                     bench_results_t *res) {
  const int world = c->rk->world;
  char text[sizeof(((bench_row_t *)0)->shape)];
  snprintf(text, sizeof(text), "T=%lld/rank H=%lld N=%lld E=%lld top%lld w=%d sms=%d%s",
           (long long)c->tokens, (long long)c->hidden, (long long)c->n_out, (long long)c->experts,
           (long long)c->top_k, world, c->rk->sm_budget, c->skew ? " skew" : "");
  if (shape->label) { /* the label's name, past its "E=... top=..." */
    const char *name = strrchr(shape->label, ' ');
    name = name ? name + 1 : shape->label;
    if (strncmp(name, "E=", 2) && strncmp(name, "top=", 4)) {
      const size_t used = strlen(text);
      snprintf(text + used, sizeof(text) - used, " %s", name);
    }
  }
  bench_moe_rows_t in = {
      c->combine ? "moe_combine" : "moe",
      text,
      {"unfused", "fused", c->combine ? "combine" : "dispatch", "grouped-gemm"},
      {run_unfused, run_fused, run_comm, run_grouped},
      c,
      &c->failed,
      2.0 * (double)c->rt.live_total * (double)c->n_out * (double)c->hidden / world,
      /* the rows crossing ranks: recv's (dispatch) or expert_out's (combine) */
      (double)c->rt.remote_rows * (double)(c->combine ? c->n_out : c->hidden) * 2 / world,
      ok_fused};
  bench_moe_add_rows(&in, c->rk, o, res);
}

/* ---- the op ------------------------------------------------------------------------------------
 */

/* The shape's contract (the MoE calls' and the grouped GEMM's): 0, or -1 saying why not. */
static int shape_ok(const bench_shape_t *s, int64_t experts, int64_t top_k) {
  if (experts < 1 || experts > kMoeMaxExperts || top_k < 1 || top_k > kMoeMaxTopK ||
      top_k > experts) {
    fprintf(stderr,
            "tw-bench moe: experts %lld (TW_BENCH_MOE_EXPERTS, 1 .. %d), top-k %lld "
            "(TW_BENCH_MOE_TOPK, 1 .. %d and at most the experts)\n",
            (long long)experts, kMoeMaxExperts, (long long)top_k, kMoeMaxTopK);
    return -1;
  }
  if (s->m < 1 || s->m > (int64_t)INT32_MAX / kMoeMaxTopK || s->n < 8 || s->n % 8 ||
      s->n > (int64_t)INT32_MAX || s->k < 8 || s->k % 8 || s->k > (int64_t)INT32_MAX) {
    fprintf(stderr,
            "tw-bench moe: m (tokens per rank) %lld: 1 .. 2^27; n (n_out) %lld and k (hidden) "
            "%lld: multiples of 8\n",
            (long long)s->m, (long long)s->n, (long long)s->k);
    return -1;
  }
  return 0;
}

static int run_moe_mode(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res,
                        int combine) {
  const int world = o->world ? o->world : 8;
  const int64_t experts = bench_moe_param(shape, "E=", "TW_BENCH_MOE_EXPERTS", kDefaultExperts);
  const int64_t top_k = bench_moe_param(shape, "top=", "TW_BENCH_MOE_TOPK", kDefaultTopK);
  if (shape_ok(shape, experts, top_k) != 0)
    return 1;
  if (experts % world) {
    fprintf(stderr, "moe: %lld experts are no multiple of world=%d: %s\n", (long long)experts,
            world, o->have_shape ? "cannot run the shape" : "shape skipped");
    return o->have_shape ? 1 : 0;
  }
  const char *skew_env = getenv("TW_BENCH_MOE_SKEW");
  const char *seed_env = getenv("TW_BENCH_MOE_SEED");
  const uint64_t seed = seed_env && *seed_env ? strtoull(seed_env, NULL, 10) : 1;
  bench_ranks_t rk;
  if (bench_ranks_init(&rk, world, o->sm_budget))
    return 1;
  moe_ctx *c = (moe_ctx *)calloc(1, sizeof(moe_ctx));
  if (!c) {
    fprintf(stderr, "tw-bench: out of host memory\n");
    exit(3);
  }
  c->rk = &rk;
  c->tokens = shape->m, c->hidden = shape->k, c->n_out = shape->n;
  c->experts = experts, c->top_k = top_k, c->local = experts / world;
  c->skew = skew_env && atoi(skew_env) == 1;
  c->combine = combine;
  c->rt.world = world, c->rt.skew = c->skew, c->rt.tokens = c->tokens;
  c->rt.experts = experts, c->rt.top_k = top_k, c->rt.local = c->local;
  int rc = bench_moe_route(&c->rt, seed);
  c->recv_rows = c->rt.recv_rows;
  if (rc)
    fprintf(stderr, "tw-bench: out of host memory (the routing)\n");
  if (!rc) {
    fprintf(stderr, "moe: recv_rows %lld, %lld live rows, %lld of them to peers%s\n",
            (long long)c->recv_rows, (long long)c->rt.live_total, (long long)c->rt.remote_rows,
            c->skew ? " (skewed routing)" : "");
    rc = moe_setup(c, seed);
  }
  if (!rc) {
    const int ok_fused = o->check ? moe_check(c) : 1;
    rc = c->failed;         /* a refused call: the shape's setup error, not timed */
    if (!rc && !o->check) { /* one call of each before timing: a refused call is a setup error */
      run_unfused(c, 0);
      run_fused(c, 0);
      sync_all(&rk);
      rc = c->failed;
    }
    if (!rc)
      moe_rows(c, o, shape, ok_fused, res);
  }
  moe_teardown(c);
  free(c);
  bench_ranks_fini(&rk);
  return rc;
}

static int run_moe(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res) {
  return run_moe_mode(o, shape, res, 0);
}

static int run_moe_combine(const bench_opts_t *o, const bench_shape_t *shape,
                           bench_results_t *res) {
  return run_moe_mode(o, shape, res, 1);
}

/* m = tokens per rank, n = n_out, k = hidden; E and top-k in the label. */
static const bench_shape_t moe_sweep[] = {
    {512, 4096, 7168, "E=256 top=8 dsv3-gate-up"},  /* DeepSeek-V3 gate+up */
    {2048, 4096, 7168, "E=256 top=8 dsv3-gate-up"}, /* the same, prefill-sized */
    {1024, 14336, 4096, "E=8 top=2 mixtral"},       /* Mixtral 8x7B w1+w3 */
    {1, 4096, 7168, "E=256 top=8 decode"},          /* decode-sized: 1 to 256 tokens a rank */
    {64, 4096, 7168, "E=256 top=8 decode"},
    {256, 4096, 7168, "E=256 top=8 decode"},
    {64, 14336, 4096, "E=8 top=2 mixtral-decode"},
    {16384, 4096, 7168, "E=256 top=8 dsv3-131k"}, /* 131072 tokens in all on 8 ranks */
    {16384, 14336, 4096, "E=8 top=2 mixtral-131k"},
};
static const bench_shape_t moe_quick[] = {
    {512, 4096, 7168, "E=256 top=8 dsv3-gate-up"},
    {64, 4096, 7168, "E=256 top=8 decode"},
};

static const bench_op_t moe_op = {
    "moe",
    "MoE dispatch+expert GEMM: fused vs dispatch+grouped GEMM and the pieces; m = tokens per "
    "rank, n = n_out, k = hidden, E/top-k in the label or TW_BENCH_MOE_EXPERTS/_TOPK (256/8)",
    moe_sweep,
    (int)(sizeof(moe_sweep) / sizeof(moe_sweep[0])),
    moe_quick,
    (int)(sizeof(moe_quick) / sizeof(moe_quick[0])),
    run_moe,
};
BENCH_OP_REGISTER(moe, moe_op, 70);

/* m = tokens per rank, n = n_out (the model's hidden size), k = the experts' intermediate size */
static const bench_shape_t moe_combine_sweep[] = {
    {512, 7168, 2048, "E=256 top=8 dsv3-down"},        {2048, 7168, 2048, "E=256 top=8 dsv3-down"},
    {1024, 4096, 14336, "E=8 top=2 mixtral-down"},     {64, 7168, 2048, "E=256 top=8 decode-down"},
    {16384, 7168, 2048, "E=256 top=8 dsv3-down-131k"}, /* 131072 tokens in all on 8 ranks */
    {1, 7168, 2048, "E=256 top=8 decode-down"},        {256, 7168, 2048, "E=256 top=8 decode-down"},
};
static const bench_shape_t moe_combine_quick[] = {
    {512, 7168, 2048, "E=256 top=8 dsv3-down"},
    {64, 7168, 2048, "E=256 top=8 decode-down"},
};

static const bench_op_t moe_combine_op = {
    "moe_combine",
    "MoE expert GEMM+combine: fused vs grouped GEMM+combine and the pieces; m = tokens per rank, "
    "n = n_out, k = the GEMM's K, E/top-k in the label or TW_BENCH_MOE_EXPERTS/_TOPK (256/8)",
    moe_combine_sweep,
    (int)(sizeof(moe_combine_sweep) / sizeof(moe_combine_sweep[0])),
    moe_combine_quick,
    (int)(sizeof(moe_combine_quick) / sizeof(moe_combine_quick[0])),
    run_moe_combine,
};
BENCH_OP_REGISTER(moe_combine, moe_combine_op, 71);
