/*
 * The state of `tw-bench ring_attention` (bench_ring_attention.cu) and its unfused ring
 * (bench_ring_unfused.cu): the ranks' shards, the unfused ring's segment buffers and
 * accumulators, and the whole sequence on rank 0's GPU.
 */
#ifndef TW_BENCH_RING_H
#define TW_BENCH_RING_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "bench_ranks.h"
#include "tilewire.h"

enum { kMaxSegs = 2 };

typedef struct seg {
  int64_t row, rows, pos; /* local first row, rows, global position of the first */
} seg_t;

typedef struct ring_ctx {
  bench_ranks_t *rk;
  int world, zigzag, causal, gpus;
  int64_t b, s, h, d;
  void *q[TW_MAX_WORLD], *k[TW_MAX_WORLD], *v[TW_MAX_WORLD], *o[TW_MAX_WORLD];
  /* the unfused ring's, per rank: each query segment contiguous, the received K/V segments, a
   * partial (o, lse), and the fp32 running (o, lse) of each query segment */
  void *qs[TW_MAX_WORLD][kMaxSegs], *ks[TW_MAX_WORLD][kMaxSegs], *vs[TW_MAX_WORLD][kMaxSegs];
  void *part_o[TW_MAX_WORLD];
  float *part_lse[TW_MAX_WORLD], *acc_o[TW_MAX_WORLD][kMaxSegs], *acc_lse[TW_MAX_WORLD][kMaxSegs];
  void *uo[TW_MAX_WORLD]; /* the unfused output */
  /* the unfused ring's backward, per rank: each query segment's o and dout contiguous, a pair's
   * partial gradients and dsum workspace, the fp32 dq of each query segment, the fp32 dk and dv
   * of the chunk being passed round (two by step parity: one received while the other is read
   * by the next rank), the received own chunk's, the events ordering the pass and its end, the
   * gradients */
  void *os[TW_MAX_WORLD][kMaxSegs], *dos[TW_MAX_WORLD][kMaxSegs];
  void *part_dq[TW_MAX_WORLD], *part_dk[TW_MAX_WORLD], *part_dv[TW_MAX_WORLD];
  float *part_ws[TW_MAX_WORLD], *acc_dq[TW_MAX_WORLD][kMaxSegs];
  float *acc_dk[TW_MAX_WORLD][2], *acc_dv[TW_MAX_WORLD][2], *own_dk[TW_MAX_WORLD],
      *own_dv[TW_MAX_WORLD];
  cudaEvent_t passed[TW_MAX_WORLD][2], finished[TW_MAX_WORLD];
  void *udq[TW_MAX_WORLD], *udk[TW_MAX_WORLD], *udv[TW_MAX_WORLD];
  void *wq, *wk, *wv, *wo; /* the whole sequence, global order, on rank 0's GPU */
  /* the backward's: dout, lse and dsum symmetric (with q, k and v: the peers read them), the
   * gradients; and the whole sequence's */
  void *dout[TW_MAX_WORLD], *dq[TW_MAX_WORLD], *dk[TW_MAX_WORLD], *dv[TW_MAX_WORLD];
  float *lse[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  void *wdo, *wdq, *wdk, *wdv;
  float *wlse, *wws;
  /* across nodes (virtual nodes: TW_RANKS_PER_NODE): the forward's and the backward's gathered */
  void *fwd_gathered[TW_MAX_WORLD], *bwd_gathered[TW_MAX_WORLD];
  int nodes;
  int failed;
} ring_ctx;

/* Rank r's query (and key) segments: one contiguous, or zigzag's two halves. Returns how many. */
static inline int segs_of(const ring_ctx *c, int r, seg_t *out) {
  if (!c->zigzag) {
    out[0].row = 0, out[0].rows = c->s, out[0].pos = (int64_t)r * c->s;
    return 1;
  }
  const int64_t half = c->s / 2;
  out[0].row = 0, out[0].rows = half, out[0].pos = (int64_t)r * half;
  out[1].row = half, out[1].rows = half, out[1].pos = (int64_t)(2 * c->world - 1 - r) * half;
  return 2;
}

void *ring_dev_alloc(size_t bytes);
/* The unfused ring's buffers on every rank's GPU (dev_alloc exits on failure); freed. */
void ring_alloc_unfused(ring_ctx *c);
void ring_free_unfused(ring_ctx *c);
/* ring-flash-attention's forward (uo, and each query segment's fp32 lse in acc_lse), and its
 * forward then backward (udq, udk, udv), on every rank's stream; c->failed on an error. */
void ring_run_unfused(void *ctx, int iter);
void ring_run_unfused_step(void *ctx, int iter);

#endif
