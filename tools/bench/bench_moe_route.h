/*
 * The host routing and the rows of the MoE benches (bench_moe.cu, bench_moe_ffn.cu): top_k distinct
 * experts per token, uniform, or with skew hot experts (a random max(2 top_k, E / 16) of them take
 * 3 of 4 slots); the live rows of each expert, the rows that cross to peers, and recv_rows (the
 * largest rank's padded need, each expert's rows rounded up to 128, plus 128 rows).
 */
#ifndef TW_BENCH_MOE_ROUTE_H
#define TW_BENCH_MOE_ROUTE_H

#include <stdint.h>

#include "bench.h"
#include "bench_ranks.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { kMoeRowBlock = 128, kMoeMaxExperts = 1024, kMoeMaxTopK = 16 };

typedef struct bench_moe_route {
  int world, skew;
  int64_t tokens, experts, top_k, local;
  int32_t *h_idx[TW_MAX_WORLD]; /* [tokens][top_k] per rank */
  int64_t *live;                /* [experts]: rows of each expert, from every rank */
  int64_t live_total, remote_rows, recv_rows;
} bench_moe_route_t;

/* Fills rt's routing for its world, tokens, experts, top_k and skew. 0, or 1 out of host
 * memory. */
int bench_moe_route(bench_moe_route_t *rt, uint64_t seed);
void bench_moe_route_free(bench_moe_route_t *rt);
/* The row local expert el of rank d starts at in d's recv (each expert's rows padded to 128, in
 * expert order); el = local gives d's padded need. */
int64_t bench_moe_offset(const bench_moe_route_t *rt, int d, int64_t el);
/* An integer: the label's "<key>N" if it has one, else the environment variable, else dflt; -1
 * when malformed. */
int64_t bench_moe_param(const bench_shape_t *shape, const char *key, const char *env, int64_t dflt);

/* One MoE bench shape's rows: the variants unfused (the baseline), fused, comm and compute,
 * timed together (bench_time_multi_rounds), TFLOP/s from flops (per GPU) except comm's GB/s
 * from comm_bytes (per GPU), the TW_BENCH_AB rows of the fused op, and the bound row
 * (t_compute + t_comm) / max(t_compute, t_comm). *failed: set by the variants' calls. */
typedef struct bench_moe_rows {
  const char *op, *shape;
  const char *names[4];
  void (*fns[4])(void *ctx, int iter);
  void *ctx;
  const int *failed;
  double flops, comm_bytes;
  int ok_fused;
} bench_moe_rows_t;
void bench_moe_add_rows(const bench_moe_rows_t *in, bench_ranks_t *rk, const bench_opts_t *o,
                        bench_results_t *res);

#ifdef __cplusplus
}
#endif
#endif
