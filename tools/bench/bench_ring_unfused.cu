/*
 * `tw-bench ring_attention`'s baseline: ring-flash-attention's loops on tilewire's attention core.
 * Forward: per ring step the KV chunk of rank (r - step) mod W copied into rank r's buffers
 * (cudaMemcpy2DAsync a segment at a time: the ring's send), tw_attention with lse for every pair
 * of a query segment and a key segment with a visible key, the partials merged in fp32.
 * Backward: the same pass with tw_attention_backward per pair (its forward's o and lse of the
 * query segment); dq summed in fp32 on its rank, the fp32 dk and dv of each chunk carried round
 * the ring (received from the previous rank, this rank's partials added, read by the next: W
 * copies), the own chunk's received last. The passes' copies wait on events of the neighbours'
 * previous step, as the ring's receives wait on the sends.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>

#include "bench.h"
#include "bench_ring.h"

void *ring_dev_alloc(size_t bytes) {
  void *p = NULL;
  BENCH_CUDA(cudaMalloc(&p, bytes));
  return p;
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

/* acc rows [row, row + rows) of each batch (fp32 [B, S, H, D]) += part (bf16 [B, rows, H, D]). */
static __global__ void add_rows_kernel(float *acc, const __nv_bfloat16 *part, int64_t s,
                                       int64_t row, int64_t rows, int64_t hd, int64_t n) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t x = e % hd, i = (e / hd) % rows, bb = e / hd / rows;
    acc[(bb * s + row + i) * hd + x] += __bfloat162float(part[e]);
  }
}

/* Rows [row, row + rows) of every batch of src [B, S, H, D] into dst [B, rows, H, D]. */
static void copy_rows(const ring_ctx *c, void *dst, const void *src, int64_t src_seq, int64_t row,
                      int64_t rows, cudaStream_t st) {
  const size_t line = (size_t)(c->h * c->d * 2);
  BENCH_CUDA(cudaMemcpy2DAsync(dst, rows * line, (const char *)src + row * line, src_seq * line,
                               rows * line, (size_t)c->b, cudaMemcpyDefault, st));
}

/* 1 when query segment q sees a key of segment k (causal by global position). */
static int visible(const ring_ctx *c, const seg_t *q, const seg_t *k) {
  return !c->causal || k->pos <= q->pos + q->rows - 1;
}

/* Rank r's copy of src's K/V segments: the ring's send of src's chunk. */
static void sources_of(const ring_ctx *c, int r, int src, const seg_t *ks, int nk,
                       cudaStream_t st) {
  for (int j = 0; j < nk; j++) {
    copy_rows(c, c->ks[r][j], c->k[src], c->s, ks[j].row, ks[j].rows, st);
    copy_rows(c, c->vs[r][j], c->v[src], c->s, ks[j].row, ks[j].rows, st);
  }
}

static tw_status_t part_attention(const ring_ctx *c, int r, const seg_t *qs, int qi,
                                  const seg_t *ks, int ki, cudaStream_t st) {
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  a.q = c->qs[r][qi], a.k = c->ks[r][ki], a.v = c->vs[r][ki], a.o = c->part_o[r];
  a.lse = c->part_lse[r];
  a.batch = c->b, a.heads_q = c->h, a.heads_kv = c->h, a.head_dim = c->d;
  a.seq_q = qs[qi].rows, a.seq_kv = ks[ki].rows, a.causal = c->causal;
  a.q_offset = qs[qi].pos, a.kv_offset = ks[ki].pos;
  return tw_attention(&a, (tw_stream_t)st);
}

void ring_run_unfused(void *p, int iter) {
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
      sources_of(c, r, src, ks, nk, st);
      for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
          if (!visible(c, &qs[i], &ks[j]))
            continue;
          if (part_attention(c, r, qs, i, ks, j, st) != TW_SUCCESS) {
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

static tw_status_t part_backward(const ring_ctx *c, int r, const seg_t *qs, int qi, const seg_t *ks,
                                 int ki, cudaStream_t st) {
  tw_attention_backward_args_t g = TW_ATTENTION_BACKWARD_ARGS_INIT;
  g.q = c->qs[r][qi], g.k = c->ks[r][ki], g.v = c->vs[r][ki], g.o = c->os[r][qi];
  g.dout = c->dos[r][qi], g.lse = c->acc_lse[r][qi];
  g.dq = c->part_dq[r], g.dk = c->part_dk[r], g.dv = c->part_dv[r], g.workspace = c->part_ws[r];
  g.batch = c->b, g.heads_q = c->h, g.heads_kv = c->h, g.head_dim = c->d;
  g.seq_q = qs[qi].rows, g.seq_kv = ks[ki].rows, g.causal = c->causal;
  g.q_offset = qs[qi].pos, g.kv_offset = ks[ki].pos;
  return tw_attention_backward(&g, (tw_stream_t)st);
}

/* One ring step of rank r's backward: the chunk of rank (r - step) mod W and its running dk, dv
 * received, every visible segment pair's partial gradients added. 0, or 1 on an error. */
static int backward_step(ring_ctx *c, int r, int step) {
  const int w = c->world, prev = (r - 1 + w) % w, next = (r + 1) % w, par = step & 1;
  const int src = (r - step + w) % w;
  const size_t acc_bytes = (size_t)(c->b * c->s * c->h * c->d) * 4;
  const int64_t hd = c->h * c->d;
  bench_ranks_use(c->rk, r);
  cudaStream_t st = c->rk->streams[r];
  if (step == 0) {
    BENCH_CUDA(cudaMemsetAsync(c->acc_dk[r][0], 0, acc_bytes, st));
    BENCH_CUDA(cudaMemsetAsync(c->acc_dv[r][0], 0, acc_bytes, st));
  } else { /* the next rank has read this parity's buffer (step - 2's), the previous written its */
    BENCH_CUDA(cudaStreamWaitEvent(st, c->passed[next][par ^ 1], 0));
    BENCH_CUDA(cudaStreamWaitEvent(st, c->passed[prev][par ^ 1], 0));
    BENCH_CUDA(cudaMemcpyAsync(c->acc_dk[r][par], c->acc_dk[prev][par ^ 1], acc_bytes,
                               cudaMemcpyDefault, st));
    BENCH_CUDA(cudaMemcpyAsync(c->acc_dv[r][par], c->acc_dv[prev][par ^ 1], acc_bytes,
                               cudaMemcpyDefault, st));
  }
  seg_t qs[kMaxSegs], ks[kMaxSegs];
  const int nq = segs_of(c, r, qs), nk = segs_of(c, src, ks);
  sources_of(c, r, src, ks, nk, st);
  for (int i = 0; i < nq; i++)
    for (int j = 0; j < nk; j++) {
      if (!visible(c, &qs[i], &ks[j]))
        continue;
      if (part_backward(c, r, qs, i, ks, j, st) != TW_SUCCESS) {
        fprintf(stderr, "tw_attention_backward: %s\n", tw_last_error());
        return 1;
      }
      const int64_t nqe = c->b * qs[i].rows * hd, nke = c->b * ks[j].rows * hd;
      add_rows_kernel<<<1024, 256, 0, st>>>(c->acc_dq[r][i], (const __nv_bfloat16 *)c->part_dq[r],
                                            qs[i].rows, 0, qs[i].rows, hd, nqe);
      add_rows_kernel<<<1024, 256, 0, st>>>(c->acc_dk[r][par], (const __nv_bfloat16 *)c->part_dk[r],
                                            c->s, ks[j].row, ks[j].rows, hd, nke);
      add_rows_kernel<<<1024, 256, 0, st>>>(c->acc_dv[r][par], (const __nv_bfloat16 *)c->part_dv[r],
                                            c->s, ks[j].row, ks[j].rows, hd, nke);
    }
  BENCH_CUDA(cudaEventRecord(c->passed[r][par], st));
  return 0;
}

static void run_unfused_backward(ring_ctx *c) {
  const int w = c->world;
  const int64_t hd = c->h * c->d;
  for (int r = 0; r < w; r++) { /* each query segment's o and dout contiguous, dq zeroed */
    bench_ranks_use(c->rk, r);
    cudaStream_t st = c->rk->streams[r];
    seg_t qs[kMaxSegs];
    const int nq = segs_of(c, r, qs);
    for (int i = 0; i < nq; i++) {
      copy_rows(c, c->os[r][i], c->uo[r], c->s, qs[i].row, qs[i].rows, st);
      copy_rows(c, c->dos[r][i], c->dout[r], c->s, qs[i].row, qs[i].rows, st);
      BENCH_CUDA(cudaMemsetAsync(c->acc_dq[r][i], 0, (size_t)(c->b * qs[i].rows * hd) * 4, st));
    }
  }
  for (int step = 0; step < w && !c->failed; step++)
    for (int r = 0; r < w && !c->failed; r++)
      c->failed = backward_step(c, r, step);
  if (c->failed) {
    bench_ranks_use(c->rk, 0);
    return;
  }
  const size_t acc_bytes = (size_t)(c->b * c->s * hd) * 4;
  const int last = (w - 1) & 1;
  for (int r = 0; r < w; r++) { /* the own chunk's dk, dv from the previous rank; dq */
    const int prev = (r - 1 + w) % w;
    bench_ranks_use(c->rk, r);
    cudaStream_t st = c->rk->streams[r];
    BENCH_CUDA(cudaStreamWaitEvent(st, c->passed[prev][last], 0));
    BENCH_CUDA(
        cudaMemcpyAsync(c->own_dk[r], c->acc_dk[prev][last], acc_bytes, cudaMemcpyDefault, st));
    BENCH_CUDA(
        cudaMemcpyAsync(c->own_dv[r], c->acc_dv[prev][last], acc_bytes, cudaMemcpyDefault, st));
    const int64_t n = c->b * c->s * hd;
    finish_kernel<<<1024, 256, 0, st>>>((__nv_bfloat16 *)c->udk[r], c->own_dk[r], c->s, 0, c->s, hd,
                                        n);
    finish_kernel<<<1024, 256, 0, st>>>((__nv_bfloat16 *)c->udv[r], c->own_dv[r], c->s, 0, c->s, hd,
                                        n);
    seg_t qs[kMaxSegs];
    const int nq = segs_of(c, r, qs);
    for (int i = 0; i < nq; i++)
      finish_kernel<<<1024, 256, 0, st>>>((__nv_bfloat16 *)c->udq[r], c->acc_dq[r][i], c->s,
                                          qs[i].row, qs[i].rows, hd, c->b * qs[i].rows * hd);
    BENCH_CUDA(cudaEventRecord(c->finished[r], st));
  }
  /* A rank's next call rewrites its dk / dv buffers, which the next rank reads up to its end:
   * each stream waits for its next rank's end (calls run back to back between two joins with
   * TW_BENCH_BLOCK). */
  for (int r = 0; r < w; r++) {
    bench_ranks_use(c->rk, r);
    BENCH_CUDA(cudaStreamWaitEvent(c->rk->streams[r], c->finished[(r + 1) % w], 0));
  }
  bench_ranks_use(c->rk, 0);
}

void ring_run_unfused_step(void *p, int iter) {
  ring_ctx *c = (ring_ctx *)p;
  ring_run_unfused(c, iter);
  if (!c->failed)
    run_unfused_backward(c);
}

void ring_alloc_unfused(ring_ctx *c) {
  const size_t shard = (size_t)(c->b * c->s * c->h * c->d) * 2, seg = shard / (c->zigzag ? 2 : 1);
  const size_t seg_rows = (size_t)(c->b * c->h * c->s / (c->zigzag ? 2 : 1));
  for (int r = 0; r < c->world; r++) {
    bench_ranks_use(c->rk, r);
    c->uo[r] = ring_dev_alloc(shard);
    c->part_o[r] = ring_dev_alloc(seg);
    c->part_lse[r] = (float *)ring_dev_alloc(seg_rows * 4);
    c->part_dq[r] = ring_dev_alloc(seg), c->part_dk[r] = ring_dev_alloc(seg);
    c->part_dv[r] = ring_dev_alloc(seg), c->part_ws[r] = (float *)ring_dev_alloc(seg_rows * 4);
    c->udq[r] = ring_dev_alloc(shard), c->udk[r] = ring_dev_alloc(shard);
    c->udv[r] = ring_dev_alloc(shard);
    c->own_dk[r] = (float *)ring_dev_alloc(shard * 2);
    c->own_dv[r] = (float *)ring_dev_alloc(shard * 2);
    for (int i = 0; i < kMaxSegs; i++) {
      c->qs[r][i] = ring_dev_alloc(seg), c->ks[r][i] = ring_dev_alloc(seg);
      c->vs[r][i] = ring_dev_alloc(seg);
      c->os[r][i] = ring_dev_alloc(seg), c->dos[r][i] = ring_dev_alloc(seg);
      c->acc_o[r][i] = (float *)ring_dev_alloc(seg * 2);
      c->acc_lse[r][i] = (float *)ring_dev_alloc(seg_rows * 4);
      c->acc_dq[r][i] = (float *)ring_dev_alloc(seg * 2);
    }
    BENCH_CUDA(cudaEventCreateWithFlags(&c->finished[r], cudaEventDisableTiming));
    for (int par = 0; par < 2; par++) {
      c->acc_dk[r][par] = (float *)ring_dev_alloc(shard * 2);
      c->acc_dv[r][par] = (float *)ring_dev_alloc(shard * 2);
      BENCH_CUDA(cudaEventCreateWithFlags(&c->passed[r][par], cudaEventDisableTiming));
    }
  }
  bench_ranks_use(c->rk, 0);
}

void ring_free_unfused(ring_ctx *c) {
  for (int r = 0; r < c->world; r++) {
    bench_ranks_use(c->rk, r);
    cudaFree(c->uo[r]), cudaFree(c->part_o[r]), cudaFree(c->part_lse[r]);
    cudaFree(c->part_dq[r]), cudaFree(c->part_dk[r]), cudaFree(c->part_dv[r]);
    cudaFree(c->part_ws[r]);
    cudaFree(c->udq[r]), cudaFree(c->udk[r]), cudaFree(c->udv[r]);
    cudaFree(c->own_dk[r]), cudaFree(c->own_dv[r]);
    for (int i = 0; i < kMaxSegs; i++) {
      cudaFree(c->qs[r][i]), cudaFree(c->ks[r][i]), cudaFree(c->vs[r][i]);
      cudaFree(c->os[r][i]), cudaFree(c->dos[r][i]);
      cudaFree(c->acc_o[r][i]), cudaFree(c->acc_lse[r][i]), cudaFree(c->acc_dq[r][i]);
    }
    cudaEventDestroy(c->finished[r]);
    for (int par = 0; par < 2; par++) {
      cudaFree(c->acc_dk[r][par]), cudaFree(c->acc_dv[r][par]);
      cudaEventDestroy(c->passed[r][par]);
    }
  }
  bench_ranks_use(c->rk, 0);
}
