/*
 * `tw-bench ring_attention`: context-parallel attention over --world ranks (default 4; virtual
 * ranks on one GPU when there are fewer GPUs), each holding S tokens of one sequence:
 *   tilewire      tw_ring_attention on every rank (one persistent kernel a rank, the peers' K/V
 *                 read in place)
 *   unfused-ring  what ring-flash-attention runs, on the same core: per ring step the KV chunk
 *                 of rank (r - step) mod W copied into rank r's buffers (cudaMemcpy2DAsync, a
 *                 segment at a time: the ring's send), tw_attention with lse for every pair of
 *                 a query segment and a key segment with a visible key, the partials merged in
 *                 fp32 (bench-local kernels); the baseline (speedup = its time / this time)
 *   whole         tw_attention over the whole sequence on rank 0's GPU: the one-GPU reference;
 *                 with ranks sharing one GPU the ring's ideal time (efficiency = whole / ring),
 *                 over distinct GPUs the ideal is whole / world
 *   whole fwd+bwd     tw_attention then tw_attention_backward over the whole sequence on rank
 *                 0's GPU: the fwd+bwd rows' baseline, and their ideal as whole is tilewire's
 *   tilewire fwd+bwd  a training step's attention: tw_ring_attention (with lse) then
 *                 tw_ring_attention_backward on every rank
 * Shape: m = S tokens a rank, n = heads (q and kv), k = head_dim; the label's first word the
 * layout ("zigzag": causal, rank r holding chunks r and 2W - 1 - r of S / 2; "contiguous": not
 * causal, positions [r S, (r + 1) S); TW_BENCH_RING_LAYOUT for a --m/--n/--k shape); batch
 * TW_BENCH_RING_BATCH (default 4). TFLOP/s: 4 B H
 * (W S)^2 D (halved for causal) over the time, per GPU of the ring (divided by the GPUs the
 * ranks use); fwd+bwd rows count the backward as 2.5 forwards (FlashAttention's convention). The
 * check (before timing): every rank's tilewire and unfused outputs, and its dq, dk and dv, within
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
#include "tw_test.h"

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
  void *uo[TW_MAX_WORLD];  /* the unfused output */
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

static int segs_of(const ring_ctx *c, int r, seg_t *out) {
  if (!c->zigzag) {
    out[0].row = 0, out[0].rows = c->s, out[0].pos = (int64_t)r * c->s;
    return 1;
  }
  const int64_t half = c->s / 2;
  out[0].row = 0, out[0].rows = half, out[0].pos = (int64_t)r * half;
  out[1].row = half, out[1].rows = half, out[1].pos = (int64_t)(2 * c->world - 1 - r) * half;
  return 2;
}

/* acc (fp32 o [B, rows, H, D], lse [B, H, rows]) merged with a partial (bf16 o, lse), or set
 * from it (first): o here, then lse by merge_lse_kernel (o reads the old lse); a row -inf on
 * both sides stays 0 / -inf. */
static __device__ __forceinline__ float merged_lse(float l1, float l2) {
  const float m = fmaxf(l1, l2);
  return m == -INFINITY ? -INFINITY : m + logf(expf(l1 - m) + expf(l2 - m));
}
static __global__ void merge_o_kernel(float *acc_o, const float *acc_lse,
                                      const __nv_bfloat16 *part_o, const float *part_lse,
                                      int64_t rows, int64_t h, int64_t d, int64_t n, int first) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t hh = (e / d) % h, i = (e / d / h) % rows, bb = e / d / h / rows;
    const int64_t l_at = (bb * h + hh) * rows + i;
    const float x2 = __bfloat162float(part_o[e]);
    if (first) {
      acc_o[e] = x2;
      continue;
    }
    const float l1 = acc_lse[l_at], l2 = part_lse[l_at], lse = merged_lse(l1, l2);
    const float w1 = l1 == -INFINITY ? 0.f : expf(l1 - lse);
    const float w2 = l2 == -INFINITY ? 0.f : expf(l2 - lse);
    acc_o[e] = acc_o[e] * w1 + x2 * w2;
  }
}
static __global__ void merge_lse_kernel(float *acc_lse, const float *part_lse, int64_t n,
                                        int first) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x)
    acc_lse[e] = first ? part_lse[e] : merged_lse(acc_lse[e], part_lse[e]);
}

/* out rows [row, row + rows) of each batch (bf16 [B, S, H, D]) = acc (fp32 [B, rows, H, D]). */
static __global__ void finish_kernel(__nv_bfloat16 *out, const float *acc, int64_t s, int64_t row,
                                     int64_t rows, int64_t hd, int64_t n) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t x = e % hd, i = (e / hd) % rows, bb = e / hd / rows;
    out[(bb * s + row + i) * hd + x] = __float2bfloat16(acc[e]);
  }
}

/* Rows [row, row + rows) of every batch of src [B, S, H, D] into dst [B, rows, H, D]. */
static void copy_rows(const ring_ctx *c, void *dst, const void *src, int64_t src_seq, int64_t row,
                      int64_t rows, cudaStream_t st) {
  const size_t line = (size_t)(c->h * c->d * 2);
  BENCH_CUDA(cudaMemcpy2DAsync(dst, rows * line, (const char *)src + row * line, src_seq * line,
                               rows * line, (size_t)c->b, cudaMemcpyDefault, st));
}

static tw_status_t part_attention(const ring_ctx *c, int r, int qi, const seg_t *qs, int ki,
                                  const seg_t *ks, cudaStream_t st) {
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  a.q = c->qs[r][qi], a.k = c->ks[r][ki], a.v = c->vs[r][ki], a.o = c->part_o[r];
  a.lse = c->part_lse[r];
  a.batch = c->b, a.heads_q = c->h, a.heads_kv = c->h, a.head_dim = c->d;
  a.seq_q = qs[qi].rows, a.seq_kv = ks[ki].rows, a.causal = c->causal;
  a.q_offset = qs[qi].pos, a.kv_offset = ks[ki].pos;
  return tw_attention(&a, (tw_stream_t)st);
}

static void run_unfused(void *p, int iter) {
  (void)iter;
  ring_ctx *c = (ring_ctx *)p;
  for (int r = 0; r < c->world; r++) {
    bench_ranks_use(c->rk, r);
    cudaStream_t st = c->rk->streams[r];
    seg_t qs[kMaxSegs];
    const int nq = segs_of(c, r, qs);
    for (int i = 0; i < nq; i++)
      copy_rows(c, c->qs[r][i], c->q[r], c->s, qs[i].row, qs[i].rows, st);
    int merged[kMaxSegs] = {0, 0};
    for (int step = 0; step < c->world; step++) {
      const int src = (r - step + c->world) % c->world;
      seg_t ks[kMaxSegs];
      const int nk = segs_of(c, src, ks);
      for (int j = 0; j < nk; j++) { /* the ring's send of src's chunk */
        copy_rows(c, c->ks[r][j], c->k[src], c->s, ks[j].row, ks[j].rows, st);
        copy_rows(c, c->vs[r][j], c->v[src], c->s, ks[j].row, ks[j].rows, st);
      }
      for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
          if (c->causal && ks[j].pos > qs[i].pos + qs[i].rows - 1)
            continue; /* no key of the segment is visible to any row */
          if (part_attention(c, r, i, qs, j, ks, st) != TW_SUCCESS) {
            fprintf(stderr, "tw_attention: %s\n", tw_last_error());
            c->failed = 1;
            return;
          }
          const int64_t n = c->b * qs[i].rows * c->h * c->d, rows = c->b * c->h * qs[i].rows;
          merge_o_kernel<<<1024, 256, 0, st>>>(c->acc_o[r][i], c->acc_lse[r][i],
                                               (const __nv_bfloat16 *)c->part_o[r], c->part_lse[r],
                                               qs[i].rows, c->h, c->d, n, !merged[i]);
          merge_lse_kernel<<<256, 256, 0, st>>>(c->acc_lse[r][i], c->part_lse[r], rows, !merged[i]);
          merged[i] = 1;
        }
    }
    for (int i = 0; i < nq; i++)
      finish_kernel<<<1024, 256, 0, st>>>((__nv_bfloat16 *)c->uo[r], c->acc_o[r][i], c->s,
                                          qs[i].row, qs[i].rows, c->h * c->d,
                                          c->b * qs[i].rows * c->h * c->d);
  }
  bench_ranks_use(c->rk, 0);
}

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

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  BENCH_CUDA(cudaMalloc(&p, bytes));
  return p;
}

static int alloc_ranks(ring_ctx *c) {
  const size_t shard = (size_t)(c->b * c->s * c->h * c->d) * 2, seg = shard / (c->zigzag ? 2 : 1);
  const size_t seg_rows = (size_t)(c->b * c->h * c->s / (c->zigzag ? 2 : 1));
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
    c->o[r] = dev_alloc(shard), c->uo[r] = dev_alloc(shard);
    c->dq[r] = dev_alloc(shard), c->dk[r] = dev_alloc(shard), c->dv[r] = dev_alloc(shard);
    c->part_o[r] = dev_alloc(seg);
    c->part_lse[r] = (float *)dev_alloc(seg_rows * 4);
    for (int i = 0; i < kMaxSegs; i++) {
      c->qs[r][i] = dev_alloc(seg), c->ks[r][i] = dev_alloc(seg), c->vs[r][i] = dev_alloc(seg);
      c->acc_o[r][i] = (float *)dev_alloc(seg * 2);
      c->acc_lse[r][i] = (float *)dev_alloc(seg_rows * 4);
    }
  }
  bench_ranks_use(c->rk, 0);
  const size_t whole = shard * (size_t)c->world;
  c->wq = dev_alloc(whole), c->wk = dev_alloc(whole), c->wv = dev_alloc(whole);
  c->wo = dev_alloc(whole);
  c->wdo = dev_alloc(whole), c->wdq = dev_alloc(whole), c->wdk = dev_alloc(whole);
  c->wdv = dev_alloc(whole);
  c->wlse = (float *)dev_alloc(whole / (size_t)c->d * 2),
  c->wws = (float *)dev_alloc(whole / (size_t)c->d * 2);
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
    cudaFree(c->o[r]), cudaFree(c->uo[r]), cudaFree(c->part_o[r]);
    cudaFree(c->part_lse[r]);
    for (int i = 0; i < kMaxSegs; i++) {
      cudaFree(c->qs[r][i]), cudaFree(c->ks[r][i]), cudaFree(c->vs[r][i]);
      cudaFree(c->acc_o[r][i]), cudaFree(c->acc_lse[r][i]);
    }
  }
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
  void *want = dev_alloc(shard_elems * 2), *got = dev_alloc(shard_elems * 2);
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
  void *const *grads[3] = {c.dq, c.dk, c.dv};
  const void *whole_grads[3] = {c.wdq, c.wdk, c.wdv};
  struct {
    const char *name;
    void (*fn)(void *, int);
    void *const *outs; /* checked against wo; NULL: not checked */
    int step;          /* fwd+bwd: the gradients checked too, 3.5 forwards of FLOPs */
    int whole;         /* on rank 0's GPU alone */
  } variants[] = {{"unfused-ring", run_unfused, c.uo, 0, 0},
                  {"tilewire", run_tilewire, c.o, 0, 0},
                  {"whole", run_whole, NULL, 0, 1},
                  {"whole fwd+bwd", run_whole_step, NULL, 1, 1},
                  {"tilewire fwd+bwd", run_tilewire_step, c.o, 1, 0}};
  double ms[5] = {0};
  for (int v = 0; v < 5; v++) {
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
      for (int g = 0; g < 3 && variants[v].step && row.ok; g++)
        row.ok = check(&c, grads[g], whole_grads[g], g == 0 ? "dq" : g == 1 ? "dk" : "dv");
    }
    row.ms = bench_time_multi_ms(variants[v].fn, &c, rk.streams[0], rk.streams, c.world, o->warmup,
                                 o->repeats, &row.ms_p10, &row.ms_p90);
    const int per_gpu = variants[v].whole ? 1 : c.gpus;
    row.tflops = flops * (variants[v].step ? 3.5 : 1.0) / per_gpu / (row.ms * 1e-3) / 1e12;
    row.ok = row.ok && !c.failed && bench_ranks_async_ok(&rk, variants[v].name);
    ms[v] = row.ms;
    /* the forward rows against the unfused ring, the fwd+bwd rows against the whole step */
    row.speedup = (v < 3 ? ms[0] : ms[3]) / row.ms;
    bench_add_row(res, &row);
  }
  printf("  ring_attention %s: efficiency (whole / %d GPU(s) / ring) forward %.2f, fwd+bwd %.2f\n",
         c.zigzag ? "causal zigzag" : "full contiguous", c.gpus, ms[2] / c.gpus / ms[1],
         ms[3] / c.gpus / ms[4]);
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
