/*
 * tw_attention against a double-precision CPU reference: head_dim 64 and 128, causal and not,
 * GQA ratios 1, 4 and 8 (and MQA), sequence lengths off the 128-row tiles (1, 77, 300, 1000),
 * seq_q != seq_kv, shard offsets (q_offset / kv_offset) with rows no key reaches (o == 0,
 * lse == -inf), batch > 1, few SMs (many tiles a CTA); fresh random inputs, poisoned outputs;
 * two calls bitwise equal; bad arguments refused naming them. 77 without a Hopper GPU.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test.h"

typedef struct {
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
  int causal;
  int64_t q_offset, kv_offset;
  float scale; /* 0: the default */
  int sm_count;
  const char *what;
} shape_t;

typedef struct {
  shape_t s;
  size_t q_elems, kv_elems, rows; /* rows: batch x heads_q x seq_q */
  void *q, *k, *v, *o, *o2;
  float *lse, *lse2;
  uint16_t *hq, *hk, *hv, *ho;
  float *hlse;
} case_t;

static uint16_t *to_host(const void *dev, size_t elems) {
  uint16_t *h = (uint16_t *)malloc(elems * 2);
  TEST_REQUIRE(h, "host memory");
  TEST_CUDA_OK(cudaMemcpy(h, dev, elems * 2, cudaMemcpyDeviceToHost));
  return h;
}

static void setup(case_t *c, const shape_t *s, uint64_t seed) {
  memset(c, 0, sizeof(*c));
  c->s = *s;
  c->q_elems = (size_t)(s->batch * s->seq_q * s->heads_q * s->head_dim);
  c->kv_elems = (size_t)(s->batch * s->seq_kv * s->heads_kv * s->head_dim);
  c->rows = (size_t)(s->batch * s->heads_q * s->seq_q);
  TEST_CUDA_OK(cudaMalloc(&c->q, c->q_elems * 2));
  TEST_CUDA_OK(cudaMalloc(&c->k, c->kv_elems * 2));
  TEST_CUDA_OK(cudaMalloc(&c->v, c->kv_elems * 2));
  TEST_CUDA_OK(cudaMalloc(&c->o, c->q_elems * 2));
  TEST_CUDA_OK(cudaMalloc(&c->o2, c->q_elems * 2));
  TEST_CUDA_OK(cudaMalloc(&c->lse, c->rows * 4));
  TEST_CUDA_OK(cudaMalloc(&c->lse2, c->rows * 4));
  tw_test_fill_bf16(c->q, c->q_elems, seed + 1, 0);
  tw_test_fill_bf16(c->k, c->kv_elems, seed + 2, 0);
  tw_test_fill_bf16(c->v, c->kv_elems, seed + 3, 0);
  tw_test_poison(c->o, c->q_elems * 2, 0);
  tw_test_poison(c->o2, c->q_elems * 2, 0);
  tw_test_poison(c->lse, c->rows * 4, 0);
  tw_test_poison(c->lse2, c->rows * 4, 0);
  TEST_CUDA_OK(cudaDeviceSynchronize());
  c->hq = to_host(c->q, c->q_elems);
  c->hk = to_host(c->k, c->kv_elems);
  c->hv = to_host(c->v, c->kv_elems);
}

static void teardown(case_t *c) {
  cudaFree(c->q), cudaFree(c->k), cudaFree(c->v), cudaFree(c->o), cudaFree(c->o2);
  cudaFree(c->lse), cudaFree(c->lse2);
  free(c->hq), free(c->hk), free(c->hv), free(c->ho), free(c->hlse);
}

static tw_attention_args_t args_of(const case_t *c, void *o, float *lse) {
  tw_attention_args_t a = TW_ATTENTION_ARGS_INIT;
  a.q = c->q, a.k = c->k, a.v = c->v, a.o = o, a.lse = lse;
  a.batch = c->s.batch, a.heads_q = c->s.heads_q, a.heads_kv = c->s.heads_kv;
  a.seq_q = c->s.seq_q, a.seq_kv = c->s.seq_kv, a.head_dim = c->s.head_dim;
  a.causal = c->s.causal, a.q_offset = c->s.q_offset, a.kv_offset = c->s.kv_offset;
  a.softmax_scale = c->s.scale, a.sm_count = c->s.sm_count;
  return a;
}

/* Compares row (b, i, h) against the reference in double; returns its mismatches (printing the
 * first few of the case, *printed counting them) and raises *max_err. */
static int check_row(const case_t *c, int64_t b, int64_t i, int64_t h, double *scores,
                     double *max_err, int *printed) {
  const shape_t *s = &c->s;
  const int64_t d = s->head_dim, hk = h / (s->heads_q / s->heads_kv);
  const double scale = s->scale > 0 ? s->scale : 1.0 / sqrt((double)d);
  const uint16_t *qr = c->hq + ((b * s->seq_q + i) * s->heads_q + h) * d;
  double mx = -INFINITY;
  for (int64_t j = 0; j < s->seq_kv; j++) {
    scores[j] = -INFINITY;
    if (s->causal && s->kv_offset + j > s->q_offset + i)
      continue;
    const uint16_t *kr = c->hk + ((b * s->seq_kv + j) * s->heads_kv + hk) * d;
    double dot = 0;
    for (int64_t x = 0; x < d; x++)
      dot += (double)tw_test_bf16_to_float(qr[x]) * tw_test_bf16_to_float(kr[x]);
    scores[j] = dot * scale;
    mx = scores[j] > mx ? scores[j] : mx;
  }
  double sum = 0;
  for (int64_t j = 0; j < s->seq_kv; j++)
    sum += mx == -INFINITY ? 0 : exp(scores[j] - mx);
  double out[128] = {0};
  for (int64_t j = 0; j < s->seq_kv && sum > 0; j++) {
    if (scores[j] == -INFINITY)
      continue;
    const double w = exp(scores[j] - mx) / sum;
    const uint16_t *vr = c->hv + ((b * s->seq_kv + j) * s->heads_kv + hk) * d;
    for (int64_t x = 0; x < d; x++)
      out[x] += w * tw_test_bf16_to_float(vr[x]);
  }
  int bad = 0;
  const uint16_t *orow = c->ho + ((b * s->seq_q + i) * s->heads_q + h) * d;
  for (int64_t x = 0; x < d; x++) {
    const double ref = out[x];
    const double got = tw_test_bf16_to_float(orow[x]);
    const double err = fabs(got - ref);
    const int ok = sum > 0 ? err <= 2e-2 * fmax(1.0, fabs(ref)) : got == 0.0 && !signbit(got);
    if (!(err <= *max_err) && got == got)
      *max_err = err;
    if (!ok) {
      bad++;
      if ((*printed)++ < 8)
        fprintf(stderr, "  %s: o[b %lld, i %lld, h %lld, d %lld] = %g, expected %g\n", s->what,
                (long long)b, (long long)i, (long long)h, (long long)x, got, ref);
    }
  }
  const double lse_ref = sum > 0 ? mx + log(sum) : -INFINITY;
  const double lse = c->hlse[(b * s->heads_q + h) * s->seq_q + i];
  const int lse_ok =
      sum > 0 ? fabs(lse - lse_ref) <= 1e-3 * fmax(1.0, fabs(lse_ref)) : lse == -INFINITY;
  if (!lse_ok) {
    bad++;
    if ((*printed)++ < 8)
      fprintf(stderr, "  %s: lse[b %lld, h %lld, i %lld] = %g, expected %g\n", s->what,
              (long long)b, (long long)h, (long long)i, lse, lse_ref);
  }
  return bad;
}

static void test_shape(const shape_t *s, uint64_t seed) {
  case_t c;
  setup(&c, s, seed);
  tw_attention_args_t a = args_of(&c, c.o, c.lse);
  TEST_TW_OK(tw_attention(&a, 0));
  tw_attention_args_t a2 = args_of(&c, c.o2, c.lse2);
  TEST_TW_OK(tw_attention(&a2, 0));
  cudaError_t e = cudaDeviceSynchronize();
  TEST_REQUIRE(e == cudaSuccess, "%s: kernel: %s", s->what, cudaGetErrorString(e));
  c.ho = to_host(c.o, c.q_elems);
  c.hlse = (float *)malloc(c.rows * 4);
  TEST_REQUIRE(c.hlse, "host memory");
  TEST_CUDA_OK(cudaMemcpy(c.hlse, c.lse, c.rows * 4, cudaMemcpyDeviceToHost));
  double *scores = (double *)malloc((size_t)s->seq_kv * sizeof(double));
  TEST_REQUIRE(scores, "host memory");
  double max_err = 0;
  int printed = 0;
  long long bad = 0;
  for (int64_t b = 0; b < s->batch; b++)
    for (int64_t h = 0; h < s->heads_q; h++)
      for (int64_t i = 0; i < s->seq_q; i++)
        bad += check_row(&c, b, i, h, scores, &max_err, &printed);
  free(scores);
  TEST_ASSERT(bad == 0, "%s: %lld mismatches (max |o err| %.3g)", s->what, bad, max_err);
  const size_t diff_o = tw_test_count_diff(c.o, c.o2, c.q_elems * 2);
  const size_t diff_lse = tw_test_count_diff(c.lse, c.lse2, c.rows * 4);
  TEST_ASSERT(diff_o == 0 && diff_lse == 0, "%s: two calls differ in %zu bytes of o, %zu of lse",
              s->what, diff_o, diff_lse);
  printf("%s: max |o err| %.3g, %lld mismatches\n", s->what, max_err, bad);
  teardown(&c);
}

/* Each bad argument is refused with TW_ERR_INVALID_ARGUMENT and a message naming it. */
static void test_bad_args(uint64_t seed) {
  const shape_t s = {1, 4, 2, 130, 130, 64, 1, 0, 0, 0.f, 0, "args"};
  case_t c;
  setup(&c, &s, seed);
  const tw_attention_args_t good = args_of(&c, c.o, c.lse);
  tw_attention_args_t a;
  const tw_status_t inv = TW_ERR_INVALID_ARGUMENT;
  TEST_TW_FAILS(tw_attention(NULL, 0), inv, "args is NULL");
  TEST_TW_FAILS(tw_attention_args_init(NULL), inv, "args is NULL");
#define BAD(field, value, needle)                                                                  \
  do {                                                                                             \
    a = good;                                                                                      \
    a.field = value;                                                                               \
    TEST_TW_FAILS(tw_attention(&a, 0), inv, needle);                                               \
  } while (0)
  BAD(size, 0, "args->size");
  BAD(head_dim, 96, "head_dim");
  BAD(head_dim, 256, "head_dim");
  BAD(heads_q, 3, "heads_q");
  BAD(heads_kv, 0, "heads_kv");
  BAD(batch, 0, "batch");
  BAD(seq_q, 0, "seq_q");
  BAD(seq_kv, -5, "seq_kv");
  BAD(causal, 2, "causal");
  BAD(softmax_scale, -1.f, "softmax_scale");
  BAD(softmax_scale, NAN, "softmax_scale");
  BAD(q_offset, -1, "q_offset");
  BAD(kv_offset, -7, "kv_offset");
  BAD(sm_count, 1 << 20, "sm_count");
  BAD(sm_count, -1, "sm_count");
  BAD(q, NULL, "q is NULL");
  BAD(k, NULL, "k is NULL");
  BAD(v, NULL, "v is NULL");
  BAD(o, NULL, "o is NULL");
  BAD(q, (const char *)c.q + 2, "q (");
  BAD(k, (const char *)c.k + 8, "k (");
  BAD(o, (char *)c.o + 2, "o (");
  BAD(lse, (float *)((char *)c.lse + 2), "lse (");
  BAD(o, c.q, "overlaps q");
  BAD(lse, (float *)c.v, "overlaps v");
#undef BAD
  tw_attention_args_t init;
  memset(&init, 0x5a, sizeof(init));
  TEST_TW_OK(tw_attention_args_init(&init));
  const tw_attention_args_t want = TW_ATTENTION_ARGS_INIT;
  TEST_ASSERT(init.size == want.size && init.version == want.version && init.q == NULL &&
                  init.head_dim == 0 && init.softmax_scale == 0.f && init.sm_count == 0,
              "tw_attention_args_init fills TW_ATTENTION_ARGS_INIT");
  teardown(&c);
}

int main(void) {
  tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  const shape_t shapes[] = {
      {1, 1, 1, 1, 1, 64, 0, 0, 0, 0.f, 0, "d64 one row, one key"},
      {2, 4, 4, 77, 300, 64, 0, 0, 0, 0.f, 0, "d64 b2 sq77 skv300"},
      {2, 4, 1, 300, 77, 128, 0, 0, 0, 0.f, 0, "d128 mqa sq300 skv77"},
      {1, 8, 2, 1000, 1000, 128, 1, 0, 0, 0.f, 0, "d128 causal gqa4 s1000"},
      {2, 8, 1, 300, 300, 64, 1, 0, 0, 0.f, 0, "d64 causal gqa8 s300"},
      {1, 4, 4, 256, 384, 128, 1, 300, 100, 0.f, 0, "d128 causal shard offsets"},
      {1, 2, 2, 200, 256, 128, 1, 0, 100, 0.f, 0, "d128 causal dead rows"},
      {1, 2, 1, 300, 300, 64, 1, 0, 200, 0.f, 0, "d64 causal dead tile"},
      {1, 4, 4, 1, 1000, 128, 1, 999, 0, 0.f, 0, "d128 causal decode row"},
      {1, 2, 2, 513, 700, 128, 0, 0, 0, 0.5f, 0, "d128 peaked scores"},
      {2, 4, 2, 1000, 500, 64, 1, 500, 0, 0.3f, 3, "d64 causal 3 SMs"},
      {1, 4, 4, 640, 640, 128, 1, 0, 0, 0.f, 2, "d128 causal 2 SMs"},
      {3, 2, 2, 129, 1000, 128, 0, 0, 0, 0.f, 5, "d128 b3 5 SMs"},
  };
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
    test_shape(&shapes[i], seed + 100 * i);
  test_bad_args(seed + 9000);
  printf("test_attention: %d passed, %d failed\n", tw_test_passed, tw_test_failed);
  return tw_test_finish();
}
