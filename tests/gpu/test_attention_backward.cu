/*
 * tw_attention_backward against a double-precision CPU reference of the attention gradients:
 * head_dim 64 and 128, causal and not, GQA (group 1, 4) and MQA, sequence lengths off the tiles
 * (77, 150, 300), seq_q != seq_kv, shard offsets with rows no key reaches (their dq zero), batch
 * > 1, few SMs (several tiles a CTA). The forward's o and lse come from tw_attention; dq, dk and
 * dv (poisoned first) within bf16 tolerance of the reference (relative to each tensor's largest
 * value), every element finite; a second call bitwise equal; bad arguments refused naming them.
 * The one-pass backward (dq_accum set) on every case: dq within the same tolerance, dk and dv
 * bitwise equal to the default path's; an args struct of version 1's size runs the default
 * path. 77 without a Hopper GPU.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test.h"

typedef struct {
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, d;
  int causal;
  int64_t q_offset, kv_offset;
  int sm_count;
  const char *what;
} shape_t;

typedef struct {
  shape_t s;
  size_t q_elems, kv_elems, rows;
  void *q, *k, *v, *o, *dout, *dq, *dk, *dv;
  float *lse, *ws, *dq_accum;
  size_t accum_bytes;
} bufs_t;

static float bf(uint16_t h) { return tw_test_bf16_to_float(h); }

static uint16_t *host_of(const void *dev, size_t elems) {
  uint16_t *h = (uint16_t *)malloc(elems * 2);
  TEST_REQUIRE(h, "host memory");
  TEST_CUDA_OK(cudaMemcpy(h, dev, elems * 2, cudaMemcpyDeviceToHost));
  return h;
}

static void setup(bufs_t *b, const shape_t *s, uint64_t seed) {
  memset(b, 0, sizeof(*b));
  b->s = *s;
  b->q_elems = (size_t)(s->batch * s->seq_q * s->heads_q * s->d);
  b->kv_elems = (size_t)(s->batch * s->seq_kv * s->heads_kv * s->d);
  b->rows = (size_t)(s->batch * s->heads_q * s->seq_q);
  void **bf16s[8] = {&b->q, &b->k, &b->v, &b->o, &b->dout, &b->dq, &b->dk, &b->dv};
  const size_t elems[8] = {b->q_elems, b->kv_elems, b->kv_elems, b->q_elems,
                           b->q_elems, b->q_elems,  b->kv_elems, b->kv_elems};
  for (int i = 0; i < 8; i++)
    TEST_CUDA_OK(cudaMalloc(bf16s[i], elems[i] * 2));
  TEST_CUDA_OK(cudaMalloc(&b->lse, b->rows * 4));
  TEST_CUDA_OK(cudaMalloc(&b->ws, b->rows * 4));
  b->accum_bytes = (size_t)(s->batch * s->heads_q * ((s->seq_q + 127) / 128 * 128) * s->d) * 4;
  TEST_CUDA_OK(cudaMalloc(&b->dq_accum, b->accum_bytes));
  tw_test_fill_bf16(b->q, b->q_elems, seed + 1, 0);
  tw_test_fill_bf16(b->k, b->kv_elems, seed + 2, 0);
  tw_test_fill_bf16(b->v, b->kv_elems, seed + 3, 0);
  tw_test_fill_bf16(b->dout, b->q_elems, seed + 4, 0);
  tw_attention_args_t f = TW_ATTENTION_ARGS_INIT;
  f.q = b->q, f.k = b->k, f.v = b->v, f.o = b->o, f.lse = b->lse;
  f.batch = s->batch, f.heads_q = s->heads_q, f.heads_kv = s->heads_kv;
  f.seq_q = s->seq_q, f.seq_kv = s->seq_kv, f.head_dim = s->d, f.causal = s->causal;
  f.q_offset = s->q_offset, f.kv_offset = s->kv_offset;
  TEST_TW_OK(tw_attention(&f, 0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static void teardown(bufs_t *b) {
  cudaFree(b->q), cudaFree(b->k), cudaFree(b->v), cudaFree(b->o), cudaFree(b->dout);
  cudaFree(b->dq), cudaFree(b->dk), cudaFree(b->dv), cudaFree(b->lse), cudaFree(b->ws);
  cudaFree(b->dq_accum);
}

static tw_attention_backward_args_t args_of(const bufs_t *b) {
  tw_attention_backward_args_t a = TW_ATTENTION_BACKWARD_ARGS_INIT;
  const shape_t *s = &b->s;
  a.q = b->q, a.k = b->k, a.v = b->v, a.o = b->o, a.dout = b->dout, a.lse = b->lse;
  a.dq = b->dq, a.dk = b->dk, a.dv = b->dv, a.workspace = b->ws;
  a.batch = s->batch, a.heads_q = s->heads_q, a.heads_kv = s->heads_kv;
  a.seq_q = s->seq_q, a.seq_kv = s->seq_kv, a.head_dim = s->d, a.causal = s->causal;
  a.q_offset = s->q_offset, a.kv_offset = s->kv_offset, a.sm_count = s->sm_count;
  return a;
}

/* The reference gradients in double: dq [q_elems], dk and dv [kv_elems]. */
static void reference(const bufs_t *b, double *dq, double *dk, double *dv) {
  const shape_t *s = &b->s;
  const int64_t D = s->d, G = s->heads_q / s->heads_kv, SQ = s->seq_q, SK = s->seq_kv;
  const double scale = 1.0 / sqrt((double)D);
  uint16_t *q = host_of(b->q, b->q_elems), *k = host_of(b->k, b->kv_elems);
  uint16_t *v = host_of(b->v, b->kv_elems), *g = host_of(b->dout, b->q_elems);
  double *p = (double *)malloc((size_t)(SQ * SK) * 8), *o = (double *)malloc((size_t)D * 8);
  TEST_REQUIRE(p && o, "host memory");
  memset(dq, 0, b->q_elems * 8), memset(dk, 0, b->kv_elems * 8), memset(dv, 0, b->kv_elems * 8);
#define QI(bb, i, h) ((((bb)*SQ + (i)) * s->heads_q + (h)) * D)
#define KI(bb, j, h) ((((bb)*SK + (j)) * s->heads_kv + (h)) * D)
  for (int64_t bb = 0; bb < s->batch; bb++)
    for (int64_t h = 0; h < s->heads_q; h++) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < SQ; i++) { /* P row i, its softmax over the visible keys */
        double mx = -INFINITY;
        for (int64_t j = 0; j < SK; j++) {
          double dot = -INFINITY;
          if (!s->causal || s->kv_offset + j <= s->q_offset + i) {
            dot = 0;
            for (int64_t c = 0; c < D; c++)
              dot += (double)bf(q[QI(bb, i, h) + c]) * bf(k[KI(bb, j, hk) + c]);
            dot *= scale;
          }
          p[i * SK + j] = dot;
          mx = dot > mx ? dot : mx;
        }
        double sum = 0;
        for (int64_t j = 0; j < SK; j++)
          sum += mx == -INFINITY ? 0 : exp(p[i * SK + j] - mx);
        for (int64_t j = 0; j < SK; j++)
          p[i * SK + j] = sum > 0 ? exp(p[i * SK + j] - mx) / sum : 0;
        double dsum = 0;
        for (int64_t c = 0; c < D; c++) {
          o[c] = 0;
          for (int64_t j = 0; j < SK; j++)
            o[c] += p[i * SK + j] * bf(v[KI(bb, j, hk) + c]);
          dsum += o[c] * bf(g[QI(bb, i, h) + c]);
        }
        for (int64_t j = 0; j < SK; j++) {
          const double pij = p[i * SK + j];
          if (pij == 0)
            continue;
          double dp = 0;
          for (int64_t c = 0; c < D; c++)
            dp += (double)bf(g[QI(bb, i, h) + c]) * bf(v[KI(bb, j, hk) + c]);
          const double ds = pij * (dp - dsum) * scale;
          for (int64_t c = 0; c < D; c++) {
            dq[QI(bb, i, h) + c] += ds * bf(k[KI(bb, j, hk) + c]);
            dk[KI(bb, j, hk) + c] += ds * bf(q[QI(bb, i, h) + c]);
            dv[KI(bb, j, hk) + c] += pij * bf(g[QI(bb, i, h) + c]);
          }
        }
      }
    }
#undef QI
#undef KI
  free(q), free(k), free(v), free(g), free(p), free(o);
}

/* max |got - want| over max |want| (non-finite elements counted apart). */
static double rel_error(const void *dev, const double *want, size_t n, size_t *bad) {
  uint16_t *got = host_of(dev, n);
  double worst = 0, top = 1e-30;
  *bad = 0;
  for (size_t i = 0; i < n; i++) {
    const double x = bf(got[i]);
    if (!isfinite(x)) {
      (*bad)++;
      continue;
    }
    worst = fmax(worst, fabs(x - want[i]));
    top = fmax(top, fabs(want[i]));
  }
  free(got);
  return worst / top;
}

static void run_case(const shape_t *s, uint64_t seed) {
  bufs_t b;
  setup(&b, s, seed);
  double *dq = (double *)malloc(b.q_elems * 8), *dk = (double *)malloc(b.kv_elems * 8);
  double *dv = (double *)malloc(b.kv_elems * 8);
  TEST_REQUIRE(dq && dk && dv, "host memory");
  reference(&b, dq, dk, dv);
  tw_test_poison(b.dq, b.q_elems * 2, 0);
  tw_test_poison(b.dk, b.kv_elems * 2, 0);
  tw_test_poison(b.dv, b.kv_elems * 2, 0);
  tw_attention_backward_args_t a = args_of(&b);
  TEST_TW_OK(tw_attention_backward(&a, 0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  const struct {
    const void *dev;
    const double *want;
    size_t n;
    const char *name;
  } outs[3] = {
      {b.dq, dq, b.q_elems, "dq"}, {b.dk, dk, b.kv_elems, "dk"}, {b.dv, dv, b.kv_elems, "dv"}};
  void *first[3];
  for (int i = 0; i < 3; i++) {
    size_t bad = 0;
    const double err = rel_error(outs[i].dev, outs[i].want, outs[i].n, &bad);
    TEST_ASSERT(bad == 0 && err <= 2.5e-2, "%s: %s: %zu non-finite, max error %.3g of its largest",
                s->what, outs[i].name, bad, err);
    printf("  %-44s %s max error %.2e\n", s->what, outs[i].name, err);
    TEST_CUDA_OK(cudaMalloc(&first[i], outs[i].n * 2));
    TEST_CUDA_OK(cudaMemcpy(first[i], outs[i].dev, outs[i].n * 2, cudaMemcpyDeviceToDevice));
  }
  TEST_TW_OK(tw_attention_backward(&a, 0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int i = 0; i < 3; i++) {
    const size_t diff = tw_test_count_diff(first[i], outs[i].dev, outs[i].n * 2);
    TEST_ASSERT(diff == 0, "%s: %s: a second call differs in %zu bytes", s->what, outs[i].name,
                diff);
  }
  /* the one pass: dq to the same tolerance; dk and dv the default path's bits, every call */
  tw_attention_backward_args_t one = a;
  one.dq_accum = b.dq_accum;
  tw_test_poison(b.dq_accum, b.accum_bytes, 0);
  for (int call = 0; call < 2; call++) {
    for (int i = 0; i < 3; i++)
      tw_test_poison((void *)outs[i].dev, outs[i].n * 2, 0);
    TEST_TW_OK(tw_attention_backward(&one, 0));
    TEST_CUDA_OK(cudaDeviceSynchronize());
    size_t bad = 0;
    const double err = rel_error(b.dq, dq, b.q_elems, &bad);
    TEST_ASSERT(bad == 0 && err <= 2.5e-2,
                "%s: one pass: dq: %zu non-finite, max error %.3g of its largest", s->what, bad,
                err);
    if (call == 0)
      printf("  %-44s dq (one pass) max error %.2e\n", s->what, err);
    for (int i = 1; i < 3; i++) {
      const size_t diff = tw_test_count_diff(first[i], outs[i].dev, outs[i].n * 2);
      TEST_ASSERT(diff == 0, "%s: one pass: %s differs from the default path's in %zu bytes",
                  s->what, outs[i].name, diff);
    }
  }
  for (int i = 0; i < 3; i++)
    cudaFree(first[i]);
  free(dq), free(dk), free(dv);
  teardown(&b);
}

static void expect_refused(tw_attention_backward_args_t a, const char *needle, const char *what) {
  TEST_TW_FAILS(tw_attention_backward(&a, 0), TW_ERR_INVALID_ARGUMENT, needle);
  (void)what;
}

static void test_refusals(void) {
  const shape_t s = {1, 4, 2, 64, 64, 64, 0, 0, 0, 0, "refusals"};
  bufs_t b;
  setup(&b, &s, 99);
  tw_attention_backward_args_t a;
  TEST_TW_FAILS(tw_attention_backward(NULL, 0), TW_ERR_INVALID_ARGUMENT, "args");
  a = args_of(&b), a.dq = NULL;
  expect_refused(a, "dq is NULL", "dq NULL");
  a = args_of(&b), a.workspace = NULL;
  expect_refused(a, "workspace is NULL", "workspace NULL");
  a = args_of(&b), a.head_dim = 96;
  expect_refused(a, "head_dim", "head_dim 96");
  a = args_of(&b), a.heads_q = 3;
  expect_refused(a, "heads_q", "heads_q 3");
  a = args_of(&b), a.dk = (char *)b.dk + 8;
  expect_refused(a, "dk", "dk misaligned");
  a = args_of(&b), a.dv = b.dk;
  expect_refused(a, "dv", "dv = dk");
  a = args_of(&b), a.dq = b.dout;
  expect_refused(a, "dq", "dq = dout");
  a = args_of(&b), a.seq_kv = 0;
  expect_refused(a, "seq_kv", "seq_kv 0");
  a = args_of(&b), a.sm_count = -1;
  expect_refused(a, "sm_count", "sm_count -1");
  a = args_of(&b), a.dq_accum = (float *)((char *)b.dq_accum + 4);
  expect_refused(a, "dq_accum", "dq_accum misaligned");
  a = args_of(&b), a.dq_accum = (float *)b.dq;
  expect_refused(a, "dq_accum", "dq_accum over dq");
  float *small = NULL; /* half the bytes the shape needs */
  TEST_CUDA_OK(cudaMalloc(&small, b.accum_bytes / 2));
  a = args_of(&b), a.dq_accum = small;
  expect_refused(a, "dq_accum", "dq_accum too small");
  cudaFree(small);
  /* a caller built against version 1 (no dq_accum): the default path */
  a = args_of(&b);
  a.size = offsetof(tw_attention_backward_args_t, dq_accum);
  a.version = 1;
  TEST_TW_OK(tw_attention_backward(&a, 0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  teardown(&b);
}

int main(void) {
  tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  const shape_t cases[] = {
      {1, 2, 2, 128, 128, 64, 0, 0, 0, 0, "B1 H2 S128 D64"},
      {2, 4, 1, 300, 300, 128, 1, 0, 0, 0, "B2 H4/1 S300 D128 causal (MQA)"},
      {1, 8, 2, 77, 200, 64, 0, 0, 0, 0, "B1 H8/2 S77x200 D64 (GQA 4)"},
      {1, 4, 4, 150, 350, 128, 1, 200, 0, 0, "B1 H4 S150x350 D128 causal shard"},
      {1, 2, 2, 160, 200, 64, 1, 0, 100, 0, "B1 H2 S160x200 D64 causal, dead rows"},
      {2, 4, 2, 300, 300, 128, 1, 0, 0, 3, "B2 H4/2 S300 D128 causal, 3 SMs"},
      {1, 4, 4, 600, 600, 128, 0, 0, 0, 0, "B1 H4 S600 D128"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    run_case(&cases[i], seed + 10 * i);
  test_refusals();
  return tw_test_finish();
}
