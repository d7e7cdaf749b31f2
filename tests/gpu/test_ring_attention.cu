/*
 * tw_ring_attention on virtual ranks of one GPU (worlds 1 to 4, odd included): each rank's
 * output and lse against tw_attention over the whole sequence gathered on the host in global
 * order (bf16 tolerance: the blocks' order differs), one small case also against a
 * double-precision CPU reference; contiguous and zigzag layouts, causal and not, head_dim 64
 * and 128, GQA 1 and 4, shards off the 128-row tiles (77, zigzag 200) and larger (512); two
 * calls bitwise equal; bad arguments refused naming them. 77 without a Hopper GPU.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test.h"

typedef struct {
  int world, layout, causal;
  int64_t batch, heads_q, heads_kv, seq_local, head_dim;
  int cpu_ref; /* also check a few rows against the fp64 reference */
  const char *what;
} ring_shape_t;

typedef struct {
  ring_shape_t s;
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *q[TW_MAX_WORLD], *k[TW_MAX_WORLD], *v[TW_MAX_WORLD], *o[TW_MAX_WORLD];
  float *lse[TW_MAX_WORLD];
  size_t q_elems, kv_elems, rows; /* a rank's */
} ring_world_t;

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
    TEST_TW_OK(tw_mem_alloc(w->comms[r], w->kv_elems * 2, &w->k[r]));
    TEST_TW_OK(tw_mem_alloc(w->comms[r], w->kv_elems * 2, &w->v[r]));
    TEST_CUDA_OK(cudaMalloc(&w->q[r], w->q_elems * 2));
    TEST_CUDA_OK(cudaMalloc(&w->o[r], w->q_elems * 2));
    TEST_CUDA_OK(cudaMalloc((void **)&w->lse[r], w->rows * 4));
    tw_test_fill_bf16(w->q[r], w->q_elems, seed + 10 * r + 1, 0);
    tw_test_fill_bf16(w->k[r], w->kv_elems, seed + 10 * r + 2, 0);
    tw_test_fill_bf16(w->v[r], w->kv_elems, seed + 10 * r + 3, 0);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static void world_fini(ring_world_t *w) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < w->s.world; r++) {
    TEST_TW_OK(tw_mem_free(w->comms[r], w->k[r]));
    TEST_TW_OK(tw_mem_free(w->comms[r], w->v[r]));
    cudaFree(w->q[r]), cudaFree(w->o[r]), cudaFree(w->lse[r]);
    cudaStreamDestroy(w->streams[r]);
  }
  for (int r = 0; r < w->s.world; r++)
    TEST_TW_OK(tw_comm_destroy(w->comms[r]));
}

static tw_ring_attention_args_t ring_args(const ring_world_t *w, int r) {
  tw_ring_attention_args_t a = TW_RING_ATTENTION_ARGS_INIT;
  a.q = w->q[r], a.k = w->k[r], a.v = w->v[r], a.o = w->o[r], a.lse = w->lse[r];
  a.batch = w->s.batch, a.heads_q = w->s.heads_q, a.heads_kv = w->s.heads_kv;
  a.seq_local = w->s.seq_local, a.head_dim = w->s.head_dim;
  a.causal = w->s.causal, a.layout = w->s.layout;
  return a;
}

/* Every rank's call launched before any sync (the ranks' kernels meet on the GPU). */
static void run_ring(ring_world_t *w) {
  for (int r = 0; r < w->s.world; r++) {
    tw_test_poison(w->o[r], w->q_elems * 2, w->streams[r]);
    tw_test_poison(w->lse[r], w->rows * 4, w->streams[r]);
  }
  for (int r = 0; r < w->s.world; r++) {
    const tw_ring_attention_args_t a = ring_args(w, r);
    TEST_TW_OK(tw_ring_attention(w->comms[r], &a, w->streams[r]));
  }
  for (int r = 0; r < w->s.world; r++)
    TEST_CUDA_OK(cudaStreamSynchronize(w->streams[r]));
  for (int r = 0; r < w->s.world; r++) {
    tw_status_t st = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(w->comms[r], &st));
    TEST_ASSERT(st == TW_SUCCESS, "%s: rank %d reports %s (%s)", w->s.what, r, tw_status_string(st),
                tw_comm_last_error(w->comms[r]));
  }
}

typedef struct {
  uint16_t *q, *k, *v; /* whole sequence, global order: [batch, W S, heads, head_dim] */
  uint16_t *o;
  float *lse; /* [batch, heads_q, W S] */
} full_t;

/* Every rank's shard (dev: the ranks' pointers) copied into `full` at the rows' global positions.
 */
static void gather(const ring_world_t *w, const void *dev, int64_t heads, uint16_t *full) {
  const ring_shape_t *s = &w->s;
  const int64_t row = heads * s->head_dim, seq = s->world * s->seq_local;
  const size_t elems = (size_t)(s->batch * s->seq_local * row);
  uint16_t *h = (uint16_t *)malloc(elems * 2);
  TEST_REQUIRE(h, "host memory");
  for (int r = 0; r < s->world; r++) {
    TEST_CUDA_OK(cudaMemcpy(h, ((const void *const *)dev)[r], elems * 2, cudaMemcpyDeviceToHost));
    for (int64_t b = 0; b < s->batch; b++)
      for (int64_t i = 0; i < s->seq_local; i++)
        memcpy(full + (b * seq + position(s, r, i)) * row, h + (b * s->seq_local + i) * row,
               (size_t)row * 2);
  }
  free(h);
}

/* tw_attention over the gathered sequence: the reference o and lse. */
static void reference(const ring_world_t *w, full_t *f) {
  const ring_shape_t *s = &w->s;
  const int64_t seq = s->world * s->seq_local;
  const size_t qn = (size_t)(s->batch * seq * s->heads_q * s->head_dim);
  const size_t kn = (size_t)(s->batch * seq * s->heads_kv * s->head_dim);
  const size_t ln = (size_t)(s->batch * s->heads_q * seq);
  f->q = (uint16_t *)malloc(qn * 2), f->k = (uint16_t *)malloc(kn * 2);
  f->v = (uint16_t *)malloc(kn * 2), f->o = (uint16_t *)malloc(qn * 2);
  f->lse = (float *)malloc(ln * 4);
  TEST_REQUIRE(f->q && f->k && f->v && f->o && f->lse, "host memory");
  gather(w, w->q, s->heads_q, f->q);
  gather(w, w->k, s->heads_kv, f->k);
  gather(w, w->v, s->heads_kv, f->v);
  void *dq, *dk, *dv, *dout;
  float *dlse;
  TEST_CUDA_OK(cudaMalloc(&dq, qn * 2));
  TEST_CUDA_OK(cudaMalloc(&dk, kn * 2));
  TEST_CUDA_OK(cudaMalloc(&dv, kn * 2));
  TEST_CUDA_OK(cudaMalloc(&dout, qn * 2));
  TEST_CUDA_OK(cudaMalloc((void **)&dlse, ln * 4));
  TEST_CUDA_OK(cudaMemcpy(dq, f->q, qn * 2, cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemcpy(dk, f->k, kn * 2, cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemcpy(dv, f->v, kn * 2, cudaMemcpyHostToDevice));
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  a.q = dq, a.k = dk, a.v = dv, a.o = dout, a.lse = dlse;
  a.batch = s->batch, a.heads_q = s->heads_q, a.heads_kv = s->heads_kv;
  a.seq_q = seq, a.seq_kv = seq, a.head_dim = s->head_dim, a.causal = s->causal;
  TEST_TW_OK(tw_attention(&a, 0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  TEST_CUDA_OK(cudaMemcpy(f->o, dout, qn * 2, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(f->lse, dlse, ln * 4, cudaMemcpyDeviceToHost));
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dout), cudaFree(dlse);
}

static void full_free(full_t *f) { free(f->q), free(f->k), free(f->v), free(f->o), free(f->lse); }

/* fp64 attention of query row (b, pos, h) over the gathered sequence: out[D] and the lse. */
static double cpu_row(const ring_world_t *w, const full_t *f, int64_t b, int64_t pos, int64_t h,
                      double *out) {
  const ring_shape_t *s = &w->s;
  const int64_t seq = s->world * s->seq_local, D = s->head_dim;
  const int64_t kvh = h / (s->heads_q / s->heads_kv);
  const double scale = 1.0 / sqrt((double)D);
  const int64_t n = s->causal ? pos + 1 : seq;
  double *sc = (double *)malloc((size_t)n * sizeof(double)), mx = -INFINITY, sum = 0.0;
  TEST_REQUIRE(sc, "host memory");
  const uint16_t *qr = f->q + ((b * seq + pos) * s->heads_q + h) * D;
  for (int64_t j = 0; j < n; j++) {
    const uint16_t *kr = f->k + ((b * seq + j) * s->heads_kv + kvh) * D;
    double dot = 0.0;
    for (int64_t d = 0; d < D; d++)
      dot += (double)tw_test_bf16_to_float(qr[d]) * tw_test_bf16_to_float(kr[d]);
    sc[j] = dot * scale;
    mx = sc[j] > mx ? sc[j] : mx;
  }
  for (int64_t d = 0; d < D; d++)
    out[d] = 0.0;
  for (int64_t j = 0; j < n; j++) {
    const double p = exp(sc[j] - mx);
    sum += p;
    const uint16_t *vr = f->v + ((b * seq + j) * s->heads_kv + kvh) * D;
    for (int64_t d = 0; d < D; d++)
      out[d] += p * tw_test_bf16_to_float(vr[d]);
  }
  for (int64_t d = 0; d < D; d++)
    out[d] /= sum;
  free(sc);
  return mx + log(sum);
}

/* Rank r's o and lse against the reference (and, where asked, a few rows against fp64). */
static void check_rank(const ring_world_t *w, const full_t *f, int r) {
  const ring_shape_t *s = &w->s;
  const int64_t seq = s->world * s->seq_local, D = s->head_dim, H = s->heads_q;
  uint16_t *o = (uint16_t *)malloc(w->q_elems * 2);
  float *lse = (float *)malloc(w->rows * 4);
  double *row = (double *)malloc((size_t)D * sizeof(double));
  TEST_REQUIRE(o && lse && row, "host memory");
  TEST_CUDA_OK(cudaMemcpy(o, w->o[r], w->q_elems * 2, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(lse, w->lse[r], w->rows * 4, cudaMemcpyDeviceToHost));
  size_t bad_o = 0, bad_lse = 0, bad_cpu = 0;
  double worst = 0.0;
  for (int64_t b = 0; b < s->batch; b++)
    for (int64_t i = 0; i < s->seq_local; i++) {
      const int64_t pos = position(s, r, i);
      for (int64_t h = 0; h < H; h++) {
        const uint16_t *got = o + ((b * s->seq_local + i) * H + h) * D;
        const uint16_t *ref = f->o + ((b * seq + pos) * H + h) * D;
        for (int64_t d = 0; d < D; d++) {
          const double g = tw_test_bf16_to_float(got[d]), e = tw_test_bf16_to_float(ref[d]);
          const double err = fabs(g - e) / fmax(1.0, fabs(e));
          worst = err > worst || isnan(err) ? err : worst;
          bad_o += !(err <= 2e-2);
        }
        const double gl = lse[(b * H + h) * s->seq_local + i];
        const double el = f->lse[(b * H + h) * seq + pos];
        bad_lse += !(fabs(gl - el) <= 1e-3 * fmax(1.0, fabs(el)));
        const bool probe = s->cpu_ref && (i % 7 == 0 || i == s->seq_local - 1) && h % 3 == 0;
        if (!probe)
          continue;
        const double cl = cpu_row(w, f, b, pos, h, row);
        bad_lse += !(fabs(gl - cl) <= 1e-3 * fmax(1.0, fabs(cl)));
        for (int64_t d = 0; d < D; d++)
          bad_cpu +=
              !(fabs(tw_test_bf16_to_float(got[d]) - row[d]) <= 2e-2 * fmax(1.0, fabs(row[d])));
      }
    }
  TEST_ASSERT(bad_o == 0 && bad_lse == 0 && bad_cpu == 0,
              "%s: rank %d: %zu o values off tw_attention (worst %.3g), %zu lse off, %zu o values "
              "off the fp64 reference",
              s->what, r, bad_o, worst, bad_lse, bad_cpu);
  free(o), free(lse), free(row);
}

static void test_shape(const ring_shape_t *s, uint64_t seed) {
  ring_world_t w;
  world_init(&w, s, seed);
  full_t f;
  reference(&w, &f);
  run_ring(&w);
  for (int r = 0; r < s->world; r++)
    check_rank(&w, &f, r);
  /* determinism: a second call gives the same bits */
  uint16_t *first[TW_MAX_WORLD];
  for (int r = 0; r < s->world; r++) {
    first[r] = (uint16_t *)malloc(w.q_elems * 2);
    TEST_REQUIRE(first[r], "host memory");
    TEST_CUDA_OK(cudaMemcpy(first[r], w.o[r], w.q_elems * 2, cudaMemcpyDeviceToHost));
  }
  run_ring(&w);
  for (int r = 0; r < s->world; r++) {
    uint16_t *again = (uint16_t *)malloc(w.q_elems * 2);
    TEST_REQUIRE(again, "host memory");
    TEST_CUDA_OK(cudaMemcpy(again, w.o[r], w.q_elems * 2, cudaMemcpyDeviceToHost));
    TEST_ASSERT(memcmp(first[r], again, w.q_elems * 2) == 0, "%s: rank %d: two calls differ",
                s->what, r);
    free(again), free(first[r]);
  }
  full_free(&f);
  world_fini(&w);
}

static void test_bad_args(uint64_t seed) {
  const ring_shape_t s = {2, TW_RING_ZIGZAG, 1, 1, 4, 2, 200, 64, 0, "bad args"};
  ring_world_t w;
  world_init(&w, &s, seed);
  void *plain = NULL;
  TEST_CUDA_OK(cudaMalloc(&plain, w.kv_elems * 2));
  tw_ring_attention_args_t a = ring_args(&w, 0);
#define BAD(field, value, needle)                                                                  \
  do {                                                                                             \
    tw_ring_attention_args_t b_ = a;                                                               \
    b_.field = value;                                                                              \
    TEST_TW_FAILS(tw_ring_attention(w.comms[0], &b_, w.streams[0]), TW_ERR_INVALID_ARGUMENT,       \
                  needle);                                                                         \
  } while (0)
  BAD(k, plain, "k (must be symmetric");
  BAD(v, plain, "v (must be symmetric");
  BAD(seq_local, 77, "seq_local");
  BAD(head_dim, 96, "head_dim");
  BAD(heads_q, 3, "heads_q");
  BAD(layout, 2, "layout");
  BAD(causal, 2, "causal");
  BAD(softmax_scale, -1.f, "softmax_scale");
  BAD(sm_count, 1 << 20, "sm_count");
  BAD(q, NULL, "q is NULL");
  BAD(o, w.q[0], "overlaps q");
#undef BAD
  TEST_TW_FAILS(tw_ring_attention(w.comms[0], NULL, w.streams[0]), TW_ERR_INVALID_ARGUMENT,
                "args is NULL");
  tw_ring_attention_args_t init;
  memset(&init, 0x5a, sizeof(init));
  TEST_TW_OK(tw_ring_attention_args_init(&init));
  TEST_ASSERT(init.size == sizeof(init) && init.version == TW_RING_ATTENTION_ARGS_VERSION &&
                  init.q == NULL && init.layout == TW_RING_ZIGZAG && init.sm_count == 0,
              "tw_ring_attention_args_init fills TW_RING_ATTENTION_ARGS_INIT");
  cudaFree(plain);
  world_fini(&w);
}

int main(void) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  const int Z = TW_RING_ZIGZAG, C = TW_RING_CONTIGUOUS;
  const ring_shape_t shapes[] = {
      {2, Z, 1, 1, 3, 3, 40, 64, 1, "w2 zigzag causal d64 s40 (fp64 too)"},
      {1, C, 0, 2, 4, 4, 77, 64, 0, "w1 contiguous d64 s77"},
      {1, Z, 1, 1, 4, 1, 200, 128, 0, "w1 zigzag causal d128 mqa s200"},
      {2, C, 1, 1, 4, 4, 77, 128, 0, "w2 contiguous causal d128 s77"},
      {2, Z, 0, 2, 8, 2, 200, 64, 0, "w2 zigzag d64 gqa4 s200"},
      {3, Z, 1, 1, 8, 2, 200, 128, 0, "w3 zigzag causal d128 gqa4 s200"},
      {3, C, 0, 1, 4, 4, 77, 64, 0, "w3 contiguous d64 s77"},
      {3, C, 1, 1, 4, 1, 512, 64, 0, "w3 contiguous causal d64 s512"},
      {4, Z, 1, 1, 8, 2, 512, 128, 0, "w4 zigzag causal d128 gqa4 s512"},
      {4, C, 1, 2, 4, 4, 200, 64, 0, "w4 contiguous causal d64 s200"},
      {4, Z, 0, 1, 4, 4, 512, 128, 0, "w4 zigzag d128 s512"},
      {4, Z, 1, 1, 4, 4, 2, 64, 0, "w4 zigzag causal one-row chunks"},
  };
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
    test_shape(&shapes[i], seed + 100 * i);
  test_bad_args(seed + 9000);
  printf("test_ring_attention: %d passed, %d failed\n", tw_test_passed, tw_test_failed);
  return tw_test_finish();
}
