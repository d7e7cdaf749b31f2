/* The MoE benches' host routing and rows (bench_moe_route.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_moe_route.h"
#include "tw_test.h"

static int64_t pad_rows(int64_t rows) {
  return (rows + kMoeRowBlock - 1) / kMoeRowBlock * kMoeRowBlock;
}

int64_t bench_moe_offset(const bench_moe_route_t *rt, int d, int64_t el) {
  int64_t row = 0;
  for (int64_t e = 0; e < el; e++)
    row += pad_rows(rt->live[d * rt->local + e]);
  return row;
}

int bench_moe_route(bench_moe_route_t *rt, uint64_t seed) {
  const int world = rt->world;
  const int64_t E = rt->experts, K = rt->top_k;
  uint64_t rng = seed * 0x9E3779B97F4A7C15ULL + 1;
  int32_t *hot = (int32_t *)malloc((size_t)E * sizeof(int32_t));
  rt->live = (int64_t *)calloc((size_t)E, sizeof(int64_t));
  rt->live_total = rt->remote_rows = 0;
  if (!hot || !rt->live) {
    free(hot);
    return 1;
  }
  for (int64_t e = 0; e < E; e++) /* a random permutation; its first n_hot are the hot ones */
    hot[e] = (int32_t)e;
  for (int64_t e = E - 1; e > 0; e--) {
    const int64_t q = (int64_t)(tw_test_xorshift(&rng) % (uint64_t)(e + 1));
    const int32_t t = hot[e];
    hot[e] = hot[q], hot[q] = t;
  }
  int64_t n_hot = 2 * K > E / 16 ? 2 * K : E / 16;
  n_hot = n_hot < E ? n_hot : E;
  for (int r = 0; r < world; r++) {
    rt->h_idx[r] = (int32_t *)malloc((size_t)(rt->tokens * K + 1) * sizeof(int32_t));
    if (!rt->h_idx[r]) {
      free(hot);
      return 1;
    }
    for (int64_t t = 0; t < rt->tokens; t++)
      for (int64_t j = 0; j < K; j++) {
        int32_t e;
        int fresh;
        do {
          const uint64_t u = tw_test_xorshift(&rng);
          e = rt->skew && u % 4 != 0 ? hot[u / 4 % (uint64_t)n_hot]
                                     : (int32_t)(u / 4 % (uint64_t)E);
          fresh = 1;
          for (int64_t q = 0; q < j; q++)
            fresh &= rt->h_idx[r][t * K + q] != e;
        } while (!fresh);
        rt->h_idx[r][t * K + j] = e;
        rt->live[e]++;
        rt->live_total++;
        rt->remote_rows += e / rt->local != r;
      }
  }
  free(hot);
  int64_t need = 0;
  for (int d = 0; d < world; d++) {
    const int64_t n = bench_moe_offset(rt, d, rt->local);
    need = n > need ? n : need;
  }
  rt->recv_rows = need + kMoeRowBlock;
  return 0;
}

void bench_moe_route_free(bench_moe_route_t *rt) {
  for (int r = 0; r < TW_MAX_WORLD; r++)
    free(rt->h_idx[r]), rt->h_idx[r] = NULL;
  free(rt->live), rt->live = NULL;
}

/* An integer: the label's "<key>N" if it has one, else the environment variable, else dflt;
 * -1 when malformed. */
int64_t bench_moe_param(const bench_shape_t *shape, const char *key, const char *env,
                        int64_t dflt) {
  const char *at = shape->label ? strstr(shape->label, key) : NULL;
  const char *text = at ? at + strlen(key) : getenv(env);
  if (!text || !*text)
    return dflt;
  char *end = NULL;
  const long long v = strtoll(text, &end, 10);
  if (end == text || (*end && *end != ' ') || v < 1)
    return -1;
  return (int64_t)v;
}

void bench_moe_add_rows(const bench_moe_rows_t *in, bench_ranks_t *rk, const bench_opts_t *o,
                        bench_results_t *res) {
  enum { kUnfused, kFused, kComm, kCompute, kVariants };
  const int world = rk->world;
  double ms[kVariants] = {0}, p10[kVariants] = {0}, p90[kVariants] = {0};
  bench_time_multi_rounds(in->fns, kVariants, in->ctx, rk->streams[0], rk->streams, world,
                          o->warmup, o->repeats, ms, p10, p90);
  const double t_max = ms[kCompute] > ms[kComm] ? ms[kCompute] : ms[kComm];
  bench_row_t rows[kVariants];
  for (int v = 0; v < kVariants; v++) {
    bench_row_t *row = &rows[v];
    memset(row, 0, sizeof(*row));
    snprintf(row->op, sizeof(row->op), "%s", in->op);
    snprintf(row->variant, sizeof(row->variant), "%s", in->names[v]);
    snprintf(row->shape, sizeof(row->shape), "%s", in->shape);
    row->ms = ms[v], row->ms_p10 = p10[v], row->ms_p90 = p90[v];
    if (v == kComm)
      row->gbps = in->comm_bytes / (ms[v] * 1e-3) / 1e9;
    else
      row->tflops = in->flops / (ms[v] * 1e-3) / 1e12;
    row->speedup = ms[kUnfused] / ms[v];
    row->ok = !*in->failed && bench_ranks_async_ok(rk, in->names[v]);
    if (v == kFused) {
      row->overlap = t_max / ms[v];
      row->ok = row->ok && in->ok_fused;
    }
    bench_add_row(res, row);
  }
  /* TW_BENCH_AB: interleaved rows of the fused op under each value of one knob (bench.h). */
  bench_ab_rows(res, &rows[kFused], "fused", in->flops, ms[kUnfused], t_max, in->fns[kFused],
                in->ctx, rk->streams[0], rk->streams, world, o);
  bench_row_t bound = rows[kFused];
  snprintf(bound.variant, sizeof(bound.variant), "bound");
  bound.ms = bound.ms_p10 = bound.ms_p90 = t_max;
  bound.tflops = 0, bound.overlap = 0, bound.ok = 1;
  bound.speedup = (ms[kCompute] + ms[kComm]) / t_max;
  bench_add_row(res, &bound);
}
