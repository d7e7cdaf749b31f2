/*
 * tw_moe_ffn on virtual ranks of one GPU against the unfused pipeline built from the same cores
 * (tw_moe_dispatch, tw_grouped_gemm of the gate and up projections, tw_swiglu, tw_grouped_gemm
 * of the down projection, tw_moe_combine): at worlds 1 to 4, random, skewed (hot experts) and
 * empty-expert routings, top-k 1, 2 and 8, ranks with 0, 1 and up to max_tokens tokens, inter
 * sizes that are not a multiple of the tile: recv, offsets, h's, act's and expert_out's live
 * rows and every token's out are bitwise the pipeline's, and out is within bf16 tolerance of an
 * fp64 reference of the whole FFN (with h and act rounded to bf16 where the kernels round them).
 * Back-to-back calls with fresh routings, alternating with tw_moe_gemm_combine on the same comm
 * (the combine's counters are shared). tw_swiglu against the host's formula; argument
 * refusals of both. 77 without a Hopper GPU.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test_moe.h"

typedef struct {
  int world, experts, top_k;
  int64_t hidden, inter, max_tokens, recv_rows;
  int64_t tokens[TW_MAX_WORLD];
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *x[TW_MAX_WORLD], *idx[TW_MAX_WORLD], *w[TW_MAX_WORLD], *w13[TW_MAX_WORLD],
      *w2[TW_MAX_WORLD];
  void *recv[TW_MAX_WORLD], *eout[TW_MAX_WORLD], *out[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  void *h[TW_MAX_WORLD], *act[TW_MAX_WORLD];
  int32_t *offsets[TW_MAX_WORLD];
  int32_t *h_idx[TW_MAX_WORLD]; /* host routing, [tokens][top_k] */
  float *h_w[TW_MAX_WORLD];
} ffn_t;

static void ffn_init(ffn_t *m, int world, int experts, int top_k, int64_t hidden, int64_t inter,
                     int64_t max_tokens, int64_t recv_rows) {
  memset(m, 0, sizeof(*m));
  m->world = world, m->experts = experts, m->top_k = top_k;
  m->hidden = hidden, m->inter = inter, m->max_tokens = max_tokens, m->recv_rows = recv_rows;
  int devices[TW_MAX_WORLD] = {0};
  TEST_REQUIRE(tw_comm_init_all(m->comms, world, devices, NULL) == TW_SUCCESS, "init: %s",
               tw_last_error());
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_moe_workspace_size(m->comms[0], max_tokens, hidden, experts, top_k, &ws_bytes));
  const int local = experts / world;
  const size_t T = (size_t)(max_tokens ? max_tokens : 1), R = (size_t)recv_rows;
  for (int r = 0; r < world; r++) {
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&m->streams[r], cudaStreamNonBlocking));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], ws_bytes, &m->ws[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], R * hidden * 2, &m->recv[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], R * hidden * 2, &m->eout[r]));
    TEST_CUDA_OK(cudaMalloc(&m->x[r], T * hidden * 2));
    TEST_CUDA_OK(cudaMalloc(&m->idx[r], T * top_k * 4));
    TEST_CUDA_OK(cudaMalloc(&m->w[r], T * top_k * 4));
    TEST_CUDA_OK(cudaMalloc(&m->out[r], T * hidden * 2));
    TEST_CUDA_OK(cudaMalloc(&m->h[r], R * inter * 4));
    TEST_CUDA_OK(cudaMalloc(&m->act[r], R * inter * 2));
    TEST_CUDA_OK(cudaMalloc(&m->w13[r], (size_t)local * 2 * inter * hidden * 2));
    TEST_CUDA_OK(cudaMalloc(&m->w2[r], (size_t)local * hidden * inter * 2));
    TEST_CUDA_OK(cudaMalloc((void **)&m->offsets[r], (size_t)(local + 1) * 4));
    m->h_idx[r] = (int32_t *)malloc((T + 1) * top_k * 4);
    m->h_w[r] = (float *)malloc((T + 1) * top_k * 4);
    TEST_REQUIRE(m->h_idx[r] && m->h_w[r], "host memory");
    tw_test_fill_bf16(m->w13[r], (size_t)local * 2 * inter * hidden, 700 + r, 0);
    tw_test_fill_bf16(m->w2[r], (size_t)local * hidden * inter, 800 + r, 0);
  }
}

static void ffn_fini(ffn_t *m) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < m->world; r++) {
    TEST_TW_OK(tw_mem_free(m->comms[r], m->ws[r]));
    TEST_TW_OK(tw_mem_free(m->comms[r], m->recv[r]));
    TEST_TW_OK(tw_mem_free(m->comms[r], m->eout[r]));
    cudaFree(m->x[r]), cudaFree(m->idx[r]), cudaFree(m->w[r]), cudaFree(m->out[r]);
    cudaFree(m->h[r]), cudaFree(m->act[r]), cudaFree(m->w13[r]), cudaFree(m->w2[r]);
    cudaFree(m->offsets[r]);
    free(m->h_idx[r]), free(m->h_w[r]);
    cudaStreamDestroy(m->streams[r]);
  }
  for (int r = 0; r < m->world; r++)
    TEST_TW_OK(tw_comm_destroy(m->comms[r]));
}

enum { kRandom, kSkewed, kHoles };

static void poison(ffn_t *m);

/* top_k distinct experts per token (skewed: mostly the first few; holes: some slots -1), fresh
 * tokens and weights; every output poisoned. */
static void route(ffn_t *m, int kind, uint64_t *rng) {
  for (int r = 0; r < m->world; r++) {
    const int64_t n = m->tokens[r];
    moe_fill_routing(m->h_idx[r], m->h_w[r], n, m->experts, m->top_k, kind == kSkewed,
                     kind == kHoles, rng);
    TEST_CUDA_OK(
        cudaMemcpy(m->idx[r], m->h_idx[r], (size_t)n * m->top_k * 4, cudaMemcpyHostToDevice));
    TEST_CUDA_OK(cudaMemcpy(m->w[r], m->h_w[r], (size_t)n * m->top_k * 4, cudaMemcpyHostToDevice));
    tw_test_fill_bf16(m->x[r], (size_t)(n ? n : 1) * m->hidden, tw_test_xorshift(rng), 0);
  }
  poison(m);
}

/* Every output poisoned (NaN bits), the offsets too. */
static void poison(ffn_t *m) {
  const size_t T = (size_t)(m->max_tokens ? m->max_tokens : 1), R = (size_t)m->recv_rows;
  for (int r = 0; r < m->world; r++) {
    tw_test_poison(m->recv[r], R * m->hidden * 2, 0);
    tw_test_poison(m->eout[r], R * m->hidden * 2, 0);
    tw_test_poison(m->h[r], R * m->inter * 4, 0);
    tw_test_poison(m->act[r], R * m->inter * 2, 0);
    tw_test_poison(m->out[r], T * m->hidden * 2, 0);
    TEST_CUDA_OK(cudaMemset(m->offsets[r], 0xff, (size_t)(m->experts / m->world + 1) * 4));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static tw_moe_args_t args_of(const ffn_t *m, int r) {
  tw_moe_args_t a = TW_MOE_ARGS_INIT;
  a.x = m->x[r], a.topk_idx = m->idx[r], a.topk_weights = (const float *)m->w[r];
  a.recv = m->recv[r], a.offsets = m->offsets[r], a.expert_out = m->eout[r], a.out = m->out[r];
  a.workspace = m->ws[r];
  a.tokens = m->tokens[r], a.max_tokens = m->max_tokens, a.hidden = m->hidden;
  a.experts = m->experts, a.top_k = m->top_k, a.recv_rows = m->recv_rows;
  a.weights = m->w13[r], a.weights2 = m->w2[r], a.h = m->h[r], a.act = m->act[r];
  a.inter = m->inter;
  return a;
}

/* The unfused pipeline on every rank's stream. */
static void run_unfused(ffn_t *m) {
  const int local = m->experts / m->world;
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = args_of(m, r);
    TEST_TW_OK(tw_moe_dispatch(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < m->world; r++) {
    const tw_stream_t s = (tw_stream_t)m->streams[r];
    tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
    g.a = m->recv[r], g.b = m->w13[r], g.out = m->h[r], g.offsets = m->offsets[r];
    g.m = m->recv_rows, g.n = 2 * m->inter, g.k = m->hidden, g.groups = local;
    TEST_TW_OK(tw_grouped_gemm(&g, s));
    TEST_TW_OK(tw_swiglu(m->h[r], m->act[r], m->recv_rows, m->inter, s));
    g.a = m->act[r], g.b = m->w2[r], g.out = m->eout[r];
    g.n = m->hidden, g.k = m->inter;
    TEST_TW_OK(tw_grouped_gemm(&g, s));
  }
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = args_of(m, r);
    a.n_out = m->hidden;
    TEST_TW_OK(tw_moe_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static void run_fused(ffn_t *m) {
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = args_of(m, r);
    TEST_TW_OK(tw_moe_ffn(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

/* One rank's results on the host: offsets, recv, h, act, expert_out and out. */
typedef struct {
  int32_t off[1025];
  uint16_t *recv, *h, *act, *eout, *out;
} snap_t;

static void snap_take(const ffn_t *m, int r, snap_t *s) {
  const size_t R = (size_t)m->recv_rows, H = (size_t)m->hidden, I = (size_t)m->inter;
  const size_t T = (size_t)m->tokens[r];
  s->recv = (uint16_t *)malloc(R * H * 2), s->eout = (uint16_t *)malloc(R * H * 2);
  s->h = (uint16_t *)malloc(R * I * 4), s->act = (uint16_t *)malloc(R * I * 2);
  s->out = (uint16_t *)malloc((T + 1) * H * 2);
  TEST_REQUIRE(s->recv && s->eout && s->h && s->act && s->out, "host memory");
  TEST_CUDA_OK(cudaMemcpy(s->off, m->offsets[r], (size_t)(m->experts / m->world + 1) * 4,
                          cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(s->recv, m->recv[r], R * H * 2, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(s->eout, m->eout[r], R * H * 2, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(s->h, m->h[r], R * I * 4, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(s->act, m->act[r], R * I * 2, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(s->out, m->out[r], T * H * 2, cudaMemcpyDeviceToHost));
}

static void snap_free(snap_t *s) {
  free(s->recv), free(s->h), free(s->act), free(s->eout), free(s->out);
}

static float bf(uint16_t v) { return tw_test_bf16_to_float(v); }

/* The rows expert el of rank r holds: [off[el], off[el] + live). */
static int64_t live_rows(const ffn_t *m, int r, int el) {
  int64_t live = 0;
  for (int s = 0; s < m->world; s++)
    for (int64_t i = 0; i < m->tokens[s] * m->top_k; i++)
      live += m->h_idx[s][i] == r * (m->experts / m->world) + el;
  return live;
}

/* The fused call's results against the unfused pipeline's (ref), bitwise. */
static void check_bitwise(const ffn_t *m, snap_t *ref, const char *what) {
  const int local = m->experts / m->world;
  const size_t H = (size_t)m->hidden, I = (size_t)m->inter;
  size_t bad[6] = {0, 0, 0, 0, 0, 0};
  for (int r = 0; r < m->world; r++) {
    snap_t s;
    snap_take(m, r, &s);
    bad[0] += memcmp(s.off, ref[r].off, (size_t)(local + 1) * 4) != 0;
    bad[1] += memcmp(s.recv, ref[r].recv, (size_t)m->recv_rows * H * 2) != 0;
    for (int el = 0; el < local; el++) {
      const size_t at = (size_t)ref[r].off[el], n = (size_t)live_rows(m, r, el);
      bad[2] += memcmp(s.h + at * 2 * I, ref[r].h + at * 2 * I, n * 2 * I * 2) != 0;
      bad[3] += memcmp(s.act + at * I, ref[r].act + at * I, n * I * 2) != 0;
      bad[4] += memcmp(s.eout + at * H, ref[r].eout + at * H, n * H * 2) != 0;
    }
    bad[5] += memcmp(s.out, ref[r].out, (size_t)m->tokens[r] * H * 2) != 0;
    snap_free(&s);
  }
  TEST_ASSERT(bad[0] + bad[1] + bad[2] + bad[3] + bad[4] + bad[5] == 0,
              "%s: differs from the unfused pipeline: offsets %zu ranks, recv %zu, h %zu experts, "
              "act %zu, expert_out %zu, out %zu ranks",
              what, bad[0], bad[1], bad[2], bad[3], bad[4], bad[5]);
  for (int r = 0; r < m->world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(m->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "%s: rank %d: %s", what, r, tw_comm_last_error(m->comms[r]));
  }
}

/* A few tokens of every rank against fp64: out = sum_j w_j * w2_e . act_e, act_e = bf16(silu(g)
 * u) with g, u the bf16-rounded gate and up products (what the pipeline rounds). */
static void check_reference(const ffn_t *m, const char *what) {
  const int local = m->experts / m->world;
  const int64_t H = m->hidden, I = m->inter;
  uint16_t *x = (uint16_t *)malloc((size_t)H * 2), *out = (uint16_t *)malloc((size_t)H * 2);
  uint16_t *w13 = (uint16_t *)malloc((size_t)2 * I * H * 2),
           *w2 = (uint16_t *)malloc((size_t)H * I * 2);
  double *act = (double *)malloc((size_t)I * sizeof(double));
  TEST_REQUIRE(x && out && w13 && w2 && act, "host memory");
  double err = 0, scale = 0;
  for (int r = 0; r < m->world; r++)
    for (int64_t t = 0; t < m->tokens[r]; t += 1 + m->tokens[r] / 5) {
      TEST_CUDA_OK(
          cudaMemcpy(x, (uint16_t *)m->x[r] + t * H, (size_t)H * 2, cudaMemcpyDeviceToHost));
      TEST_CUDA_OK(
          cudaMemcpy(out, (uint16_t *)m->out[r] + t * H, (size_t)H * 2, cudaMemcpyDeviceToHost));
      double ref[1024];
      TEST_REQUIRE(H <= 1024, "hidden");
      for (int64_t c = 0; c < H; c++)
        ref[c] = 0;
      for (int j = 0; j < m->top_k; j++) {
        const int e = m->h_idx[r][t * m->top_k + j];
        if (e < 0)
          continue;
        const int d = e / local, el = e % local;
        TEST_CUDA_OK(cudaMemcpy(w13, (uint16_t *)m->w13[d] + (size_t)el * 2 * I * H,
                                (size_t)2 * I * H * 2, cudaMemcpyDeviceToHost));
        TEST_CUDA_OK(cudaMemcpy(w2, (uint16_t *)m->w2[d] + (size_t)el * H * I, (size_t)H * I * 2,
                                cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < I; i++) {
          double g = 0, u = 0;
          for (int64_t q = 0; q < H; q++) {
            g += (double)bf(x[q]) * bf(w13[i * H + q]);
            u += (double)bf(x[q]) * bf(w13[(I + i) * H + q]);
          }
          const double gb = bf(tw_test_float_to_bf16((float)g)),
                       ub = bf(tw_test_float_to_bf16((float)u));
          act[i] = bf(tw_test_float_to_bf16((float)(gb / (1 + exp(-gb)) * ub)));
        }
        for (int64_t c = 0; c < H; c++) {
          double y = 0;
          for (int64_t i = 0; i < I; i++)
            y += act[i] * bf(w2[c * I + i]);
          ref[c] += m->h_w[r][t * m->top_k + j] * bf(tw_test_float_to_bf16((float)y));
        }
      }
      for (int64_t c = 0; c < H; c++) {
        err = fmax(err, fabs(bf(out[c]) - ref[c]));
        scale = fmax(scale, fabs(ref[c]));
      }
    }
  TEST_ASSERT(err <= 2e-2 * fmax(scale, 1e-3), "%s: %.3g off an fp64 reference (scale %.3g)", what,
              err, scale);
  free(x), free(out), free(w13), free(w2), free(act);
}

/* tw_moe_gemm_combine over act and weights2 (the FFN's second half) after the fused call: the
 * same expert_out rows and out as the pipeline's, through the combine counters both ops share. */
static void check_gemm_combine(ffn_t *m, snap_t *ref, const char *what) {
  const int local = m->experts / m->world;
  const size_t H = (size_t)m->hidden;
  for (int r = 0; r < m->world; r++) {
    tw_test_poison(m->eout[r], (size_t)m->recv_rows * H * 2, 0);
    tw_test_poison(m->out[r], (size_t)(m->max_tokens ? m->max_tokens : 1) * H * 2, 0);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = args_of(m, r);
    a.recv = m->act[r], a.hidden = m->inter, a.weights = m->w2[r], a.n_out = m->hidden;
    TEST_TW_OK(tw_moe_gemm_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  size_t bad = 0;
  for (int r = 0; r < m->world; r++) {
    snap_t s;
    snap_take(m, r, &s);
    for (int el = 0; el < local; el++) {
      const size_t at = (size_t)ref[r].off[el], n = (size_t)live_rows(m, r, el);
      bad += memcmp(s.eout + at * H, ref[r].eout + at * H, n * H * 2) != 0;
    }
    bad += memcmp(s.out, ref[r].out, (size_t)m->tokens[r] * H * 2) != 0;
    snap_free(&s);
  }
  TEST_ASSERT(bad == 0, "%s: tw_moe_gemm_combine after tw_moe_ffn: %zu parts differ", what, bad);
}

/* Per routing: the pipeline; the fused call, bitwise; tw_moe_gemm_combine on the same comm;
 * the fused call again (the same bits after the other op's calls); the fp64 reference. */
static void test_ffn(int world, int experts, int top_k, int64_t hidden, int64_t inter,
                     int64_t max_tokens, uint64_t seed) {
  ffn_t m;
  const int64_t recv_rows = world * max_tokens * top_k + experts * 128;
  ffn_init(&m, world, experts, top_k, hidden, inter, max_tokens, recv_rows);
  uint64_t rng = seed;
  for (int kind = kRandom; kind <= kHoles; kind++) {
    for (int r = 0; r < world; r++) /* the bound, 1, 0, and in between */
      m.tokens[r] = r == 0   ? max_tokens
                    : r == 1 ? 1
                    : r == 2 ? 0
                             : (int64_t)(tw_test_xorshift(&rng) % (uint64_t)(max_tokens + 1));
    if (world == 1)
      m.tokens[0] = kind == kSkewed ? 1 : max_tokens;
    char what[128];
    snprintf(what, sizeof(what), "world %d E %d top-%d H %lld I %lld %s", world, experts, top_k,
             (long long)hidden, (long long)inter,
             kind == kRandom   ? "random"
             : kind == kSkewed ? "skewed"
                               : "holes");
    route(&m, kind, &rng);
    run_unfused(&m);
    snap_t ref[TW_MAX_WORLD];
    for (int r = 0; r < world; r++)
      snap_take(&m, r, &ref[r]);
    poison(&m);
    run_fused(&m);
    check_bitwise(&m, ref, what);
    check_gemm_combine(&m, ref, what);
    poison(&m);
    run_fused(&m);
    check_bitwise(&m, ref, what);
    if (kind == kRandom)
      check_reference(&m, what);
    for (int r = 0; r < world; r++)
      snap_free(&ref[r]);
    printf("  %s: bitwise the pipeline\n", what);
  }
  ffn_fini(&m);
}

/* tw_swiglu against the host's formula (expf may differ by an ulp between host and device:
 * within one bf16 ulp of the host's). */
static void test_swiglu(uint64_t seed) {
  const int64_t rows = 300, inter = 136;
  void *h = NULL, *act = NULL;
  TEST_CUDA_OK(cudaMalloc(&h, (size_t)rows * inter * 4));
  TEST_CUDA_OK(cudaMalloc(&act, (size_t)rows * inter * 2));
  tw_test_fill_bf16(h, (size_t)rows * inter * 2, seed, 0);
  TEST_TW_OK(tw_swiglu(h, act, rows, inter, 0));
  TEST_CUDA_OK(cudaDeviceSynchronize());
  uint16_t *hh = (uint16_t *)malloc((size_t)rows * inter * 4);
  uint16_t *ha = (uint16_t *)malloc((size_t)rows * inter * 2);
  TEST_REQUIRE(hh && ha, "host memory");
  TEST_CUDA_OK(cudaMemcpy(hh, h, (size_t)rows * inter * 4, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(ha, act, (size_t)rows * inter * 2, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = 0; i < inter; i++) {
      const float g = bf(hh[r * 2 * inter + i]), u = bf(hh[r * 2 * inter + inter + i]);
      const uint16_t want = tw_test_float_to_bf16(g / (1.0f + expf(-g)) * u);
      const int d = (int)ha[r * inter + i] - (int)want;
      bad += d < -1 || d > 1;
    }
  TEST_ASSERT(bad == 0, "tw_swiglu: %zu of %lld outputs off the host's by more than an ulp", bad,
              (long long)(rows * inter));
  TEST_TW_FAILS(tw_swiglu(h, act, rows, 12, 0), TW_ERR_INVALID_ARGUMENT, "inter");
  TEST_TW_FAILS(tw_swiglu(NULL, act, rows, inter, 0), TW_ERR_INVALID_ARGUMENT, "h");
  TEST_TW_FAILS(tw_swiglu(h, h, rows, inter, 0), TW_ERR_INVALID_ARGUMENT, "overlaps h");
  TEST_TW_FAILS(tw_swiglu(h, hh, rows, inter, 0), TW_ERR_INVALID_ARGUMENT, "act");
  TEST_TW_OK(tw_swiglu(NULL, NULL, 0, inter, 0));
  free(hh), free(ha);
  cudaFree(h), cudaFree(act);
}

static void test_refusals(void) {
  ffn_t m;
  ffn_init(&m, 2, 4, 2, 64, 64, 16, 1024);
  m.tokens[0] = m.tokens[1] = 4;
  tw_moe_args_t a;
  a = args_of(&m, 0), a.inter = 0;
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->inter");
  a = args_of(&m, 0), a.inter = 60;
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->inter");
  a = args_of(&m, 0), a.weights2 = NULL;
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->weights2");
  a = args_of(&m, 0), a.act = NULL;
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->act");
  a = args_of(&m, 0), a.act = m.h[0]; /* act inside h */
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->h");
  a = args_of(&m, 0), a.h = m.eout[0]; /* h over expert_out */
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->h");
  a = args_of(&m, 0), a.inter = 128; /* weights and h smaller than that */
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->weights");
  a = args_of(&m, 0), a.expert_out = m.out[0]; /* not symmetric */
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->expert_out");
  a = args_of(&m, 0), a.top_k = 17;
  TEST_TW_FAILS(tw_moe_ffn(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->top_k");
  ffn_fini(&m);
}

int main(void) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  test_swiglu(seed);
  test_ffn(1, 4, 2, 256, 128, 300, seed + 1);
  test_ffn(2, 8, 2, 512, 256, 260, seed + 2);
  test_ffn(3, 6, 1, 128, 136, 200, seed + 3);
  test_ffn(4, 32, 8, 256, 200, 150, seed + 4);
  test_refusals();
  return tw_test_finish();
}
