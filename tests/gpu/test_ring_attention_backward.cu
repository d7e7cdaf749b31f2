/*
 * tw_ring_attention_backward on virtual ranks of one GPU (worlds 1, 2, 3, 4 and 8): the forward
 * by tw_ring_attention (its lse in symmetric memory), then every rank's backward; each rank's
 * dq, dk and dv (poisoned first, the dsum workspace too) scattered into global position order
 * and checked against a double-precision CPU reference of the attention gradients over the
 * whole sequence (causal by global position), within bf16 tolerance of each tensor's largest
 * value, every element finite. Where the fp64 reference would be slow it covers one (batch,
 * kv head) pair only and every element is also checked against tw_attention_backward over the
 * whole gathered sequence (tw_attention's o and lse). Contiguous and zigzag layouts, causal and
 * not, head_dim 64 and 128, GQA 1, 2, 4 and 8 (MQA), shards off the 128-row tiles (77, 150,
 * 200, 300), larger ones (512), one-row zigzag chunks, a softmax_scale of its own, sm_count 3 (the
 * comm's budget otherwise: every rank's CTAs resident together); two calls bitwise equal; bad
 * arguments (operands that must be symmetric in plain memory, head_dim 96, odd zigzag shards, a bad
 * layout, a NULL dq) refused on every rank naming them, the comm usable after. 77 without a Hopper
 * GPU.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test.h"

typedef struct {
  int world, layout, causal;
  int64_t batch, heads_q, heads_kv, seq_local, head_dim;
  float scale;  /* softmax_scale, forward and backward; 0: the default */
  int sm_count; /* 0: the comm's budget */
  /* 1: the fp64 reference over every batch and head. 0: over the last batch's last kv head
   * (and its q heads) only, and every element against tw_attention_backward as well. */
  int fp64_all;
  const char *what;
} ring_shape_t;

typedef struct {
  ring_shape_t s;
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  /* symmetric (tw_mem_alloc): what the peers read in place */
  void *q[TW_MAX_WORLD], *k[TW_MAX_WORLD], *v[TW_MAX_WORLD], *dout[TW_MAX_WORLD];
  float *lse[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  /* this rank's device memory */
  void *o[TW_MAX_WORLD], *dq[TW_MAX_WORLD], *dk[TW_MAX_WORLD], *dv[TW_MAX_WORLD];
  size_t q_elems, kv_elems, rows; /* a rank's */
} ring_world_t;

/* Whole-sequence arrays in global position order: [batch, W S, heads, head_dim] bf16 bits. */
typedef struct {
  uint16_t *q, *k, *v, *dout; /* the ranks' inputs */
  uint16_t *dq, *dk, *dv;     /* the ranks' gradients */
} full_t;

static float bf(uint16_t h) { return tw_test_bf16_to_float(h); }

static double scale_of(const ring_shape_t *s) {
  return s->scale > 0.f ? (double)s->scale : 1.0 / sqrt((double)s->head_dim);
}

/* Global position of local row i of rank r. */
static int64_t position(const ring_shape_t *s, int r, int64_t i) {
  if (s->layout == TW_RING_CONTIGUOUS)
    return r * s->seq_local + i;
  const int64_t h = s->seq_local / 2;
  return i < h ? r * h + i : (2 * s->world - 1 - r) * h + (i - h);
}

static void world_init(ring_world_t *w, const ring_shape_t *s, uint64_t seed) {
  memset(w, 0, sizeof(*w));
  w->s = *s;
  int devices[TW_MAX_WORLD] = {0};
  TEST_REQUIRE(tw_comm_init_all(w->comms, s->world, devices, NULL) == TW_SUCCESS, "init %d: %s",
               s->world, tw_last_error());
  w->q_elems = (size_t)(s->batch * s->seq_local * s->heads_q * s->head_dim);
  w->kv_elems = (size_t)(s->batch * s->seq_local * s->heads_kv * s->head_dim);
  w->rows = (size_t)(s->batch * s->heads_q * s->seq_local);
  for (int r = 0; r < s->world; r++) {
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&w->streams[r], cudaStreamNonBlocking));
    TEST_TW_OK(tw_mem_alloc(w->comms[r], w->q_elems * 2, &w->q[r]));
    TEST_TW_OK(tw_mem_alloc(w->comms[r], w->kv_elems * 2, &w->k[r]));
    TEST_TW_OK(tw_mem_alloc(w->comms[r], w->kv_elems * 2, &w->v[r]));
    TEST_TW_OK(tw_mem_alloc(w->comms[r], w->q_elems * 2, &w->dout[r]));
    TEST_TW_OK(tw_mem_alloc(w->comms[r], w->rows * 4, (void **)&w->lse[r]));
    TEST_TW_OK(tw_mem_alloc(w->comms[r], w->rows * 4, (void **)&w->ws[r]));
    TEST_CUDA_OK(cudaMalloc(&w->o[r], w->q_elems * 2));
    TEST_CUDA_OK(cudaMalloc(&w->dq[r], w->q_elems * 2));
    TEST_CUDA_OK(cudaMalloc(&w->dk[r], w->kv_elems * 2));
    TEST_CUDA_OK(cudaMalloc(&w->dv[r], w->kv_elems * 2));
    tw_test_fill_bf16(w->q[r], w->q_elems, seed + 10 * r + 1, 0);
    tw_test_fill_bf16(w->k[r], w->kv_elems, seed + 10 * r + 2, 0);
    tw_test_fill_bf16(w->v[r], w->kv_elems, seed + 10 * r + 3, 0);
    tw_test_fill_bf16(w->dout[r], w->q_elems, seed + 10 * r + 4, 0);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static void world_fini(ring_world_t *w) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < w->s.world; r++) {
    void *sym[6] = {w->q[r], w->k[r], w->v[r], w->dout[r], w->lse[r], w->ws[r]};
    for (int i = 0; i < 6; i++)
      TEST_TW_OK(tw_mem_free(w->comms[r], sym[i]));
    cudaFree(w->o[r]), cudaFree(w->dq[r]), cudaFree(w->dk[r]), cudaFree(w->dv[r]);
    cudaStreamDestroy(w->streams[r]);
  }
  for (int r = 0; r < w->s.world; r++)
    TEST_TW_OK(tw_comm_destroy(w->comms[r]));
}

static tw_ring_attention_backward_args_t bwd_args(const ring_world_t *w, int r) {
  tw_ring_attention_backward_args_t a;
  TEST_REQUIRE(tw_ring_attention_backward_args_init(&a) == TW_SUCCESS, "%s", tw_last_error());
  a.q = w->q[r], a.k = w->k[r], a.v = w->v[r], a.o = w->o[r], a.dout = w->dout[r];
  a.lse = w->lse[r], a.dq = w->dq[r], a.dk = w->dk[r], a.dv = w->dv[r], a.workspace = w->ws[r];
  a.batch = w->s.batch, a.heads_q = w->s.heads_q, a.heads_kv = w->s.heads_kv;
  a.seq_local = w->s.seq_local, a.head_dim = w->s.head_dim;
  a.causal = w->s.causal, a.layout = w->s.layout;
  a.softmax_scale = w->s.scale, a.sm_count = w->s.sm_count;
  return a;
}

/* Every rank's streams synchronised, then no rank reports a kernel-side error. */
static void sync_ranks(const ring_world_t *w, const char *op) {
  for (int r = 0; r < w->s.world; r++)
    TEST_CUDA_OK(cudaStreamSynchronize(w->streams[r]));
  for (int r = 0; r < w->s.world; r++) {
    tw_status_t st = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(w->comms[r], &st));
    TEST_ASSERT(st == TW_SUCCESS, "%s: %s: rank %d reports %s (%s)", w->s.what, op, r,
                tw_status_string(st), tw_comm_last_error(w->comms[r]));
  }
}

/* The forward: o and lse of every rank (every rank's call launched before any sync). */
static void run_forward(ring_world_t *w) {
  for (int r = 0; r < w->s.world; r++) {
    tw_ring_attention_args_t a = TW_RING_ATTENTION_ARGS_INIT;
    a.q = w->q[r], a.k = w->k[r], a.v = w->v[r], a.o = w->o[r], a.lse = w->lse[r];
    a.batch = w->s.batch, a.heads_q = w->s.heads_q, a.heads_kv = w->s.heads_kv;
    a.seq_local = w->s.seq_local, a.head_dim = w->s.head_dim;
    a.causal = w->s.causal, a.layout = w->s.layout;
    a.softmax_scale = w->s.scale, a.sm_count = w->s.sm_count;
    TEST_TW_OK(tw_ring_attention(w->comms[r], &a, w->streams[r]));
  }
  sync_ranks(w, "tw_ring_attention");
}

/* The backward on every rank, its outputs and workspace poisoned first (NaN bf16 / fp32). */
static void run_backward(ring_world_t *w) {
  for (int r = 0; r < w->s.world; r++) {
    tw_test_poison(w->dq[r], w->q_elems * 2, w->streams[r]);
    tw_test_poison(w->dk[r], w->kv_elems * 2, w->streams[r]);
    tw_test_poison(w->dv[r], w->kv_elems * 2, w->streams[r]);
    tw_test_poison(w->ws[r], w->rows * 4, w->streams[r]);
  }
  for (int r = 0; r < w->s.world; r++) {
    const tw_ring_attention_backward_args_t a = bwd_args(w, r);
    TEST_TW_OK(tw_ring_attention_backward(w->comms[r], &a, w->streams[r]));
  }
  sync_ranks(w, "tw_ring_attention_backward");
}

static uint16_t *host_alloc(size_t elems) {
  uint16_t *h = (uint16_t *)malloc(elems * 2);
  TEST_REQUIRE(h, "host memory");
  return h;
}

/* Every rank's shard (dev[r]: rank r's) copied into `full` at the rows' global positions. */
static void gather(const ring_world_t *w, void *const *dev, int64_t heads, uint16_t *full) {
  const ring_shape_t *s = &w->s;
  const int64_t row = heads * s->head_dim, seq = s->world * s->seq_local;
  const size_t elems = (size_t)(s->batch * s->seq_local * row);
  uint16_t *h = host_alloc(elems);
  for (int r = 0; r < s->world; r++) {
    TEST_CUDA_OK(cudaMemcpy(h, dev[r], elems * 2, cudaMemcpyDeviceToHost));
    for (int64_t b = 0; b < s->batch; b++)
      for (int64_t i = 0; i < s->seq_local; i++)
        memcpy(full + (b * seq + position(s, r, i)) * row, h + (b * s->seq_local + i) * row,
               (size_t)row * 2);
  }
  free(h);
}

static void gather_grads(const ring_world_t *w, full_t *f) {
  gather(w, w->dq, w->s.heads_q, f->dq);
  gather(w, w->dk, w->s.heads_kv, f->dk);
  gather(w, w->dv, w->s.heads_kv, f->dv);
}

static void full_init(const ring_world_t *w, full_t *f) {
  const size_t qn = w->q_elems * w->s.world, kn = w->kv_elems * w->s.world;
  f->q = host_alloc(qn), f->k = host_alloc(kn), f->v = host_alloc(kn), f->dout = host_alloc(qn);
  f->dq = host_alloc(qn), f->dk = host_alloc(kn), f->dv = host_alloc(kn);
  gather(w, w->q, w->s.heads_q, f->q);
  gather(w, w->k, w->s.heads_kv, f->k);
  gather(w, w->v, w->s.heads_kv, f->v);
  gather(w, w->dout, w->s.heads_q, f->dout);
}

static void full_free(full_t *f) {
  free(f->q), free(f->k), free(f->v), free(f->dout), free(f->dq), free(f->dk), free(f->dv);
}

/* Global-order bf16 [batch, W S, heads, head_dim] as fp64 [batch, heads, W S, head_dim]: a head's
 * rows contiguous (the reference sweeps one kv head's rows per query row). */
static double *to_f64(const ring_world_t *w, const uint16_t *h, int64_t heads) {
  const ring_shape_t *s = &w->s;
  const int64_t N = s->world * s->seq_local, D = s->head_dim;
  double *d = (double *)malloc((size_t)(s->batch * heads * N * D) * sizeof(double));
  TEST_REQUIRE(d, "host memory");
  for (int64_t b = 0; b < s->batch; b++)
    for (int64_t i = 0; i < N; i++)
      for (int64_t hh = 0; hh < heads; hh++)
        for (int64_t c = 0; c < D; c++)
          d[((b * heads + hh) * N + i) * D + c] = bf(h[((b * N + i) * heads + hh) * D + c]);
  return d;
}

/* Four partial sums: the loop is not bound by one add chain's latency. */
static double dot(const double *a, const double *b, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t c = 0; c < n; c += 4)
    s0 += a[c] * b[c], s1 += a[c + 1] * b[c + 1], s2 += a[c + 2] * b[c + 2],
        s3 += a[c + 3] * b[c + 3];
  return (s0 + s1) + (s2 + s3);
}

/* y += a x (y and x disjoint: the loop vectorises) */
static void axpy(double *__restrict__ y, double a, const double *__restrict__ x, int64_t n) {
  for (int64_t c = 0; c < n; c++)
    y[c] += a * x[c];
}

typedef struct {
  double *q, *k, *v, *g;   /* the inputs, [batch, heads, W S, head_dim] (to_f64) */
  double *dq, *dk, *dv;    /* the reference gradients, the same layout */
  double *p;               /* one row of P, then one of dout v^T: [2][W S] */
  int64_t seq, hq, hkv, d; /* whole sequence, heads, head_dim */
} ref64_t;

/* fp64 gradients of batch b's kv head hk (dk, dv) and of its group's q heads (dq) over the whole
 * sequence, causal by global position: tw_attention_backward's formulas with P and o exact. */
static void reference_pair(const ring_shape_t *s, ref64_t *x, int64_t b, int64_t hk) {
  const int64_t D = x->d, N = x->seq, G = x->hq / x->hkv, kv0 = (b * x->hkv + hk) * N * D;
  const double scale = scale_of(s);
  const double *k = x->k + kv0, *v = x->v + kv0;
  double *dk = x->dk + kv0, *dv = x->dv + kv0, *p = x->p, *dp = x->p + N;
  for (int64_t h = hk * G; h < (hk + 1) * G; h++)
    for (int64_t i = 0; i < N; i++) {
      const int64_t qi = ((b * x->hq + h) * N + i) * D, n = s->causal ? i + 1 : N;
      double mx = -INFINITY, sum = 0, dsum = 0;
      for (int64_t j = 0; j < n; j++) {
        p[j] = scale * dot(x->q + qi, k + j * D, D);
        mx = p[j] > mx ? p[j] : mx;
      }
      for (int64_t j = 0; j < n; j++)
        sum += p[j] = exp(p[j] - mx);
      for (int64_t j = 0; j < n; j++) { /* dp = dout v^T; dsum = dout . o = sum_j P dp */
        p[j] /= sum;
        dp[j] = dot(x->g + qi, v + j * D, D);
        dsum += p[j] * dp[j];
      }
      for (int64_t j = 0; j < n; j++) {
        const double ds = p[j] * (dp[j] - dsum) * scale;
        axpy(x->dq + qi, ds, k + j * D, D);
        axpy(dk + j * D, ds, x->q + qi, D);
        axpy(dv + j * D, p[j], x->g + qi, D);
      }
    }
}

/* The fp64 reference: every (batch, kv head) pair, or (fp64_all 0) the last one only. */
static ref64_t reference(const ring_world_t *w, const full_t *f) {
  const ring_shape_t *s = &w->s;
  const size_t qn = w->q_elems * s->world, kn = w->kv_elems * s->world;
  ref64_t x;
  x.seq = s->world * s->seq_local, x.hq = s->heads_q, x.hkv = s->heads_kv, x.d = s->head_dim;
  x.q = to_f64(w, f->q, s->heads_q), x.k = to_f64(w, f->k, s->heads_kv);
  x.v = to_f64(w, f->v, s->heads_kv), x.g = to_f64(w, f->dout, s->heads_q);
  x.dq = (double *)calloc(qn, sizeof(double)), x.dk = (double *)calloc(kn, sizeof(double));
  x.dv = (double *)calloc(kn, sizeof(double));
  x.p = (double *)malloc((size_t)x.seq * 2 * sizeof(double));
  TEST_REQUIRE(x.dq && x.dk && x.dv && x.p, "host memory");
  for (int64_t b = 0; b < s->batch; b++)
    for (int64_t hk = 0; hk < s->heads_kv; hk++)
      if (s->fp64_all || (b == s->batch - 1 && hk == s->heads_kv - 1))
        reference_pair(s, &x, b, hk);
  return x;
}

static void ref64_free(ref64_t *x) {
  free(x->q), free(x->k), free(x->v), free(x->g), free(x->dq), free(x->dk), free(x->dv);
  free(x->p);
}

/* max |got - want| over max |want|, over the elements of the checked (batch, kv head) pairs
 * (all: every element); *bad: got's non-finite elements, all of them. group: q heads per kv
 * head of the tensor's heads (G for dq, 1 for dk and dv). */
static double rel_error(const ring_world_t *w, const uint16_t *got, const double *want,
                        int64_t heads, int64_t group, int all, size_t *bad) {
  const ring_shape_t *s = &w->s;
  const int64_t N = s->world * s->seq_local, D = s->head_dim;
  double worst = 0, top = 1e-30;
  *bad = 0;
  for (int64_t b = 0; b < s->batch; b++)
    for (int64_t i = 0; i < N; i++)
      for (int64_t h = 0; h < heads; h++) {
        const bool checked = all || (b == s->batch - 1 && h / group == s->heads_kv - 1);
        const int64_t e0 = ((b * N + i) * heads + h) * D, w0 = ((b * heads + h) * N + i) * D;
        for (int64_t c = 0; c < D; c++) {
          const double x = bf(got[e0 + c]);
          if (!isfinite(x)) {
            (*bad)++;
            continue;
          }
          if (!checked)
            continue;
          worst = fmax(worst, fabs(x - want[w0 + c]));
          top = fmax(top, fabs(want[w0 + c]));
        }
      }
  return worst / top;
}

/* dq, dk, dv (gathered) against want (fp64, to_f64's layout): each within 2.5e-2 of the tensor's
 * largest value, every element finite. err[3]: the three errors. */
static void check_grads(const ring_world_t *w, const full_t *f, double *const want[3], int all,
                        const char *against, double err[3]) {
  const ring_shape_t *s = &w->s;
  const uint16_t *got[3] = {f->dq, f->dk, f->dv};
  const int64_t heads[3] = {s->heads_q, s->heads_kv, s->heads_kv};
  const int64_t group[3] = {s->heads_q / s->heads_kv, 1, 1};
  const char *names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; i++) {
    size_t bad = 0;
    err[i] = rel_error(w, got[i], want[i], heads[i], group[i], all, &bad);
    TEST_ASSERT(bad == 0 && err[i] <= 2.5e-2,
                "%s: %s: %zu non-finite, max error %.3g of its largest (against %s)", s->what,
                names[i], bad, err[i], against);
  }
}

static void *dev_copy(const void *host, size_t bytes) {
  void *d = NULL;
  TEST_CUDA_OK(cudaMalloc(&d, bytes));
  if (host)
    TEST_CUDA_OK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

/* tw_attention then tw_attention_backward over the whole gathered sequence: want[0..3) get its
 * dq, dk, dv in to_f64's layout. */
static void gpu_reference(const ring_world_t *w, const full_t *f, double *want[3]) {
  const ring_shape_t *s = &w->s;
  const int64_t N = s->world * s->seq_local;
  const size_t qn = w->q_elems * s->world, kn = w->kv_elems * s->world, ln = w->rows * s->world;
  void *q = dev_copy(f->q, qn * 2), *k = dev_copy(f->k, kn * 2), *v = dev_copy(f->v, kn * 2);
  void *g = dev_copy(f->dout, qn * 2), *o = dev_copy(NULL, qn * 2);
  void *dq = dev_copy(NULL, qn * 2), *dk = dev_copy(NULL, kn * 2), *dv = dev_copy(NULL, kn * 2);
  float *lse = (float *)dev_copy(NULL, ln * 4), *ws = (float *)dev_copy(NULL, ln * 4);
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse;
  a.batch = s->batch, a.heads_q = s->heads_q, a.heads_kv = s->heads_kv;
  a.seq_q = N, a.seq_kv = N, a.head_dim = s->head_dim, a.causal = s->causal;
  a.softmax_scale = s->scale;
  TEST_TW_OK(tw_attention(&a, 0));
  tw_attention_backward_args_t b = TW_ATTENTION_BACKWARD_ARGS_INIT;
  b.q = q, b.k = k, b.v = v, b.o = o, b.dout = g, b.lse = lse;
  b.dq = dq, b.dk = dk, b.dv = dv, b.workspace = ws;
  b.batch = s->batch, b.heads_q = s->heads_q, b.heads_kv = s->heads_kv;
  b.seq_q = N, b.seq_kv = N, b.head_dim = s->head_dim, b.causal = s->causal;
  b.softmax_scale = s->scale;
  TEST_TW_OK(tw_attention_backward(&b, 0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  void *outs[3] = {dq, dk, dv};
  const size_t n[3] = {qn, kn, kn};
  for (int i = 0; i < 3; i++) {
    uint16_t *h = host_alloc(n[i]);
    TEST_CUDA_OK(cudaMemcpy(h, outs[i], n[i] * 2, cudaMemcpyDeviceToHost));
    want[i] = to_f64(w, h, i ? s->heads_kv : s->heads_q);
    free(h);
  }
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(g), cudaFree(o);
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(lse), cudaFree(ws);
}

/* The gathered gradients of two calls bitwise equal. */
static void check_repeat(const ring_world_t *w, const full_t *first, const full_t *again,
                         const char *when) {
  const size_t qn = w->q_elems * w->s.world, kn = w->kv_elems * w->s.world;
  TEST_ASSERT(memcmp(first->dq, again->dq, qn * 2) == 0, "%s: dq differs %s", w->s.what, when);
  TEST_ASSERT(memcmp(first->dk, again->dk, kn * 2) == 0, "%s: dk differs %s", w->s.what, when);
  TEST_ASSERT(memcmp(first->dv, again->dv, kn * 2) == 0, "%s: dv differs %s", w->s.what, when);
}

static void test_shape(const ring_shape_t *s, uint64_t seed) {
  ring_world_t w;
  world_init(&w, s, seed);
  run_forward(&w);
  run_backward(&w);
  full_t f;
  full_init(&w, &f);
  gather_grads(&w, &f);
  ref64_t x = reference(&w, &f);
  double *want64[3] = {x.dq, x.dk, x.dv}, err[3], gerr[3] = {0, 0, 0};
  check_grads(&w, &f, want64, s->fp64_all, "the fp64 reference", err);
  ref64_free(&x);
  if (!s->fp64_all) {
    double *want[3];
    gpu_reference(&w, &f, want);
    check_grads(&w, &f, want, 1, "tw_attention_backward over the whole sequence", gerr);
    for (int i = 0; i < 3; i++)
      free(want[i]);
  }
  printf("  %-46s dq %.2e dk %.2e dv %.2e", s->what, err[0], err[1], err[2]);
  if (!s->fp64_all)
    printf("  (whole-sequence tw_attention_backward: %.2e %.2e %.2e)", gerr[0], gerr[1], gerr[2]);
  printf("\n");
  /* determinism: a second call gives the same bits */
  full_t again = f;
  const size_t qn = w.q_elems * s->world, kn = w.kv_elems * s->world;
  again.dq = host_alloc(qn), again.dk = host_alloc(kn), again.dv = host_alloc(kn);
  run_backward(&w);
  gather_grads(&w, &again);
  check_repeat(&w, &f, &again, "between two calls");
  free(again.dq), free(again.dk), free(again.dv);
  full_free(&f);
  world_fini(&w);
}

/* `name` in msg as a word (no identifier character either side). */
static bool names(const char *msg, const char *name) {
  const size_t n = strlen(name);
  for (const char *p = strstr(msg, name); p; p = strstr(p + 1, name)) {
    const char before = p == msg ? ' ' : p[-1], after = p[n];
    const bool ident_before = before == '_' || (before >= '0' && before <= '9') ||
                              (before >= 'a' && before <= 'z') || (before >= 'A' && before <= 'Z');
    const bool ident_after = after == '_' || (after >= '0' && after <= '9') ||
                             (after >= 'a' && after <= 'z') || (after >= 'A' && after <= 'Z');
    if (!ident_before && !ident_after)
      return true;
  }
  return false;
}

/* A refusal: TW_ERR_INVALID_ARGUMENT or TW_ERR_NOT_SUPPORTED, tw_last_error() and the comm's
 * message naming `name` (and containing `also` unless NULL). */
static void expect_refused(tw_status_t st, tw_comm_t comm, const char *name, const char *also,
                           int rank) {
  const char *msg = tw_last_error(), *cmsg = tw_comm_last_error(comm);
  TEST_ASSERT((st == TW_ERR_INVALID_ARGUMENT || st == TW_ERR_NOT_SUPPORTED) && names(msg, name) &&
                  (!also || strstr(msg, also)) && names(cmsg, name),
              "rank %d: bad %s -> %s (%s; the comm's: %s); expected TW_ERR_INVALID_ARGUMENT or "
              "TW_ERR_NOT_SUPPORTED naming %s%s%s",
              rank, name, tw_status_string(st), msg, cmsg, name, also ? " and saying " : "",
              also ? also : "");
}

/* Every bad argument refused on every rank before anything is enqueued; the comm then still
 * runs a valid call, bitwise the one before the refusals. */
static void test_refusals(uint64_t seed) {
  /* head_dim 128: the bad head_dim 96 stays inside the buffers, only its value is wrong */
  const ring_shape_t s = {2, TW_RING_ZIGZAG, 1, 1, 4, 2, 200, 128, 0.f, 0, 1, "refusals"};
  ring_world_t w;
  world_init(&w, &s, seed);
  run_forward(&w);
  run_backward(&w);
  full_t before, after;
  full_init(&w, &before);
  gather_grads(&w, &before);
  after = before;
  after.dq = host_alloc(w.q_elems * s.world), after.dk = host_alloc(w.kv_elems * s.world);
  after.dv = host_alloc(w.kv_elems * s.world);
  void *plain = NULL; /* device memory of the rank's device, but no symmetric allocation */
  TEST_CUDA_OK(cudaMalloc(&plain, w.q_elems * 2));
  const char *sym = "symmetric";
#define BAD(field, value, name, also)                                                              \
  for (int r = 0; r < s.world; r++) {                                                              \
    tw_ring_attention_backward_args_t b_ = bwd_args(&w, r);                                        \
    b_.field = value;                                                                              \
    expect_refused(tw_ring_attention_backward(w.comms[r], &b_, w.streams[r]), w.comms[r], name,    \
                   also, r);                                                                       \
  }
  BAD(q, plain, "q", sym);
  BAD(k, plain, "k", sym);
  BAD(v, plain, "v", sym);
  BAD(dout, plain, "dout", sym);
  BAD(lse, (const float *)plain, "lse", sym);
  BAD(workspace, (float *)plain, "workspace", sym);
  BAD(head_dim, 96, "head_dim", NULL);
  BAD(seq_local, 199, "seq_local", NULL); /* odd, zigzag */
  BAD(layout, 2, "layout", NULL);
  BAD(dq, NULL, "dq", NULL);
  BAD(causal, 2, "causal", NULL);
  BAD(heads_q, 3, "heads_q", NULL);
  BAD(sm_count, 1 << 20, "sm_count", NULL);
#undef BAD
  for (int r = 0; r < s.world; r++)
    expect_refused(tw_ring_attention_backward(w.comms[r], NULL, w.streams[r]), w.comms[r], "args",
                   NULL, r);
  for (int r = 0; r < s.world; r++)
    TEST_CUDA_OK(cudaStreamSynchronize(w.streams[r]));
  TEST_ASSERT(cudaGetLastError() == cudaSuccess, "a CUDA error is left after the refusals");
  run_backward(&w);
  gather_grads(&w, &after);
  check_repeat(&w, &before, &after, "after the refusals");
  tw_ring_attention_backward_args_t init;
  memset(&init, 0x5a, sizeof(init));
  TEST_TW_OK(tw_ring_attention_backward_args_init(&init));
  TEST_ASSERT(init.size == sizeof(init) &&
                  init.version == TW_RING_ATTENTION_BACKWARD_ARGS_VERSION && init.q == NULL &&
                  init.dq == NULL && init.workspace == NULL && init.softmax_scale == 0.f &&
                  init.layout == TW_RING_ZIGZAG && init.sm_count == 0,
              "tw_ring_attention_backward_args_init fills TW_RING_ATTENTION_BACKWARD_ARGS_INIT");
  free(after.dq), free(after.dk), free(after.dv);
  full_free(&before);
  cudaFree(plain);
  world_fini(&w);
}

int main(void) {
  tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  const int Z = TW_RING_ZIGZAG, C = TW_RING_CONTIGUOUS;
  /* world, layout, causal, batch, heads_q, heads_kv, seq_local, head_dim, softmax_scale,
   * sm_count, fp64 over everything. The fp64 reference costs batch x heads_q x (W S)^2 x
   * head_dim (half of it causal): the shapes past about 10^9 check one kv head against it. */
  const ring_shape_t shapes[] = {
      {1, C, 0, 2, 4, 4, 77, 64, 0.f, 0, 1, "w1 contiguous d64 b2 s77"},
      {1, Z, 1, 1, 4, 1, 200, 128, 0.f, 0, 1, "w1 zigzag causal d128 mqa s200"},
      {2, Z, 1, 1, 3, 3, 40, 64, 0.f, 0, 1, "w2 zigzag causal d64 s40"},
      {2, C, 1, 1, 4, 4, 77, 128, 0.f, 0, 1, "w2 contiguous causal d128 s77"},
      {2, Z, 0, 2, 8, 2, 200, 64, 0.f, 0, 1, "w2 zigzag d64 gqa4 b2 s200"},
      {2, C, 1, 2, 4, 2, 300, 128, 0.f, 3, 1, "w2 contiguous causal d128 gqa2 s300 3 SMs"},
      {3, Z, 1, 1, 8, 2, 150, 128, 0.f, 0, 1, "w3 zigzag causal d128 gqa4 s150"},
      {3, C, 0, 1, 4, 4, 77, 64, 0.25f, 0, 1, "w3 contiguous d64 s77 scale 0.25"},
      {3, C, 1, 1, 4, 1, 512, 64, 0.f, 0, 1, "w3 contiguous causal d64 mqa s512"},
      {4, Z, 1, 1, 8, 2, 200, 128, 0.f, 0, 1, "w4 zigzag causal d128 gqa4 s200"},
      {4, C, 1, 2, 4, 4, 200, 64, 0.f, 0, 1, "w4 contiguous causal d64 b2 s200"},
      {4, Z, 1, 1, 8, 2, 512, 128, 0.f, 0, 0, "w4 zigzag causal d128 gqa4 s512"},
      {4, Z, 0, 1, 4, 4, 512, 128, 0.f, 0, 0, "w4 zigzag d128 s512"},
      {4, Z, 1, 1, 4, 4, 2, 64, 0.f, 0, 1, "w4 zigzag causal one-row chunks"},
      {8, Z, 1, 1, 8, 1, 150, 64, 0.f, 0, 1, "w8 zigzag causal d64 gqa8 mqa s150"},
      {8, C, 0, 1, 8, 1, 77, 128, 0.f, 0, 1, "w8 contiguous d128 gqa8 mqa s77"},
  };
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
    test_shape(&shapes[i], seed + 100 * i);
  test_refusals(seed + 9000);
  return tw_test_finish();
}
