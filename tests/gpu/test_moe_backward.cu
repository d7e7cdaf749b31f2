/*
 * tw_moe_combine_backward on virtual ranks of one GPU: at worlds 1, 2, 3 and 4, random, skewed
 * (hot experts), unused-slot (-1) and empty-expert routings (experts, and whole ranks, with no
 * rows), top-k 1, 2 and 8, ranks with 0, 1 and max_tokens tokens, n_out not a multiple of 32.
 * Each step runs dispatch -> combine (the forward; tw_moe_combine over expert_out filled with
 * random values, or tw_moe_gemm_combine) -> combine_backward (expert_grad poisoned first) ->
 * tw_moe_combine of expert_grad with topk_weights all 1 (the dispatch's backward), and the next
 * step starts with the next dispatch. Checks, every rank: each live row of expert_grad bitwise
 * bf16(fp32 w * grad[t]) (the host's product, rounded to nearest even); the padding rows of every
 * local expert exactly zero; rows from offsets[local] on untouched (still the poison);
 * weights_grad bitwise the host's fp32 column-order sum of the bf16 products (fmaf: a product of
 * two bf16 values is exact in fp32), 0 for a -1 slot, and within its rounding bound of an fp64
 * sum; weights_grad NULL leaves the buffer alone; the forward combine's out bitwise the host's
 * slot-order sum (so each dispatch after a backward still works, and tw_moe_gemm_combine's
 * cumulative block counters stay exact across a backward and a second combine); the second
 * combine's out bitwise the host's slot-order sum of the expert_grad rows. A step repeated with
 * the same inputs gives the same bits. Version-2-sized args for the forward calls. Then
 * argument refusals, each naming the argument. Then the same cases across virtual nodes over the
 * verbs test double (both backends; layouts 2x2, 3x2, 2x4, 4x1): the same checks, bitwise, with
 * the combines' sums in their across-nodes order (own node, then each other node's partial). 77
 * without a Hopper GPU.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test_moe.h"

typedef struct {
  int world, per_node, experts, top_k, fused; /* per_node < world: virtual nodes of per_node */
  int64_t hidden, n, max_tokens, recv_rows;
  int64_t tokens[TW_MAX_WORLD];
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *x[TW_MAX_WORLD], *idx[TW_MAX_WORLD], *w[TW_MAX_WORLD], *ones[TW_MAX_WORLD];
  void *weights[TW_MAX_WORLD], *grad[TW_MAX_WORLD], *out[TW_MAX_WORLD], *out2[TW_MAX_WORLD];
  void *recv[TW_MAX_WORLD], *eout[TW_MAX_WORLD], *egrad[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  float *wgrad[TW_MAX_WORLD];
  int32_t *offsets[TW_MAX_WORLD];
  int32_t *h_idx[TW_MAX_WORLD]; /* host routing, [tokens][top_k] */
  float *h_w[TW_MAX_WORLD];
} bwd_t;

static void bwd_init(bwd_t *m, int world, int per_node, int experts, int top_k, int64_t hidden,
                     int64_t n, int64_t max_tokens, int fused) {
  memset(m, 0, sizeof(*m));
  const int local = experts / world;
  m->world = world, m->per_node = per_node, m->experts = experts, m->top_k = top_k;
  m->fused = fused;
  m->hidden = hidden, m->n = n, m->max_tokens = max_tokens;
  /* room for every slot of every rank plus each expert's padding, and rows past it */
  m->recv_rows = max_tokens * world * (top_k < local ? top_k : local) + 127 * local + 256;
  int devices[TW_MAX_WORLD] = {0};
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = per_node < world ? per_node : 0;
  TEST_REQUIRE(tw_comm_init_all(m->comms, world, devices, &cfg) == TW_SUCCESS, "init %d/%d: %s",
               world, per_node, tw_last_error());
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_moe_workspace_size(m->comms[0], max_tokens, hidden > n ? hidden : n, experts, top_k,
                                   &ws_bytes));
  const size_t T = (size_t)(max_tokens ? max_tokens : 1), R = (size_t)m->recv_rows;
  float *ones = (float *)malloc(T * top_k * 4);
  TEST_REQUIRE(ones, "host memory");
  for (size_t i = 0; i < T * top_k; i++)
    ones[i] = 1.0f;
  for (int r = 0; r < world; r++) {
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&m->streams[r], cudaStreamNonBlocking));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], ws_bytes, &m->ws[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], R * hidden * 2, &m->recv[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], R * n * 2, &m->eout[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], R * n * 2, &m->egrad[r]));
    TEST_CUDA_OK(cudaMalloc(&m->x[r], T * hidden * 2));
    TEST_CUDA_OK(cudaMalloc(&m->idx[r], T * top_k * 4));
    TEST_CUDA_OK(cudaMalloc(&m->w[r], T * top_k * 4));
    TEST_CUDA_OK(cudaMalloc(&m->ones[r], T * top_k * 4));
    TEST_CUDA_OK(cudaMalloc((void **)&m->wgrad[r], T * top_k * 4));
    TEST_CUDA_OK(cudaMalloc(&m->grad[r], T * n * 2));
    TEST_CUDA_OK(cudaMalloc(&m->out[r], T * n * 2));
    TEST_CUDA_OK(cudaMalloc(&m->out2[r], T * n * 2));
    TEST_CUDA_OK(cudaMalloc(&m->weights[r], (size_t)local * n * hidden * 2));
    TEST_CUDA_OK(cudaMalloc((void **)&m->offsets[r], (size_t)(local + 1) * 4));
    TEST_CUDA_OK(cudaMemcpy(m->ones[r], ones, T * top_k * 4, cudaMemcpyHostToDevice));
    m->h_idx[r] = (int32_t *)malloc(T * top_k * 4);
    m->h_w[r] = (float *)malloc(T * top_k * 4);
    TEST_REQUIRE(m->h_idx[r] && m->h_w[r], "host memory");
    tw_test_fill_bf16(m->weights[r], (size_t)local * n * hidden, 700 + r, 0);
  }
  free(ones);
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static void bwd_fini(bwd_t *m) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < m->world; r++) {
    TEST_TW_OK(tw_mem_free(m->comms[r], m->ws[r]));
    TEST_TW_OK(tw_mem_free(m->comms[r], m->recv[r]));
    TEST_TW_OK(tw_mem_free(m->comms[r], m->eout[r]));
    TEST_TW_OK(tw_mem_free(m->comms[r], m->egrad[r]));
    cudaFree(m->x[r]), cudaFree(m->idx[r]), cudaFree(m->w[r]), cudaFree(m->ones[r]);
    cudaFree(m->wgrad[r]), cudaFree(m->grad[r]), cudaFree(m->out[r]), cudaFree(m->out2[r]);
    cudaFree(m->weights[r]), cudaFree(m->offsets[r]);
    free(m->h_idx[r]), free(m->h_w[r]);
    cudaStreamDestroy(m->streams[r]);
  }
  for (int r = 0; r < m->world; r++)
    TEST_TW_OK(tw_comm_destroy(m->comms[r]));
}

enum { kRandom, kSkewed, kHoles, kEmpty };
static const char *const kind_names[] = {"random", "skewed", "unused slots", "empty experts"};

/* Whether routing `kind` may pick expert e: kEmpty leaves the odd experts and, where enough
 * remain for top_k, the experts of the upper half of the ranks without rows. */
static int allowed(const bwd_t *m, int kind, int e) {
  if (kind != kEmpty)
    return 1;
  int lower = 0;
  for (int q = 0; q < m->experts; q++)
    lower += q % 2 == 0 && (q < m->experts / 2 || m->world == 1);
  if (lower >= m->top_k)
    return e % 2 == 0 && (e < m->experts / 2 || m->world == 1);
  return e % 2 == 0;
}

typedef struct {
  const bwd_t *m;
  int kind;
} allowed_ctx;
static int allowed_of(const void *ctx, int32_t e) {
  const allowed_ctx *c = (const allowed_ctx *)ctx;
  return allowed(c->m, c->kind, e);
}

/* A routing: top_k distinct experts per token, some slots -1 (kHoles), fresh weights and x. */
static void route(bwd_t *m, int kind, uint64_t *rng) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  int choices = 0; /* moe_pick_expert needs top_k experts to pick from */
  for (int e = 0; e < m->experts; e++)
    choices += allowed(m, kind, e);
  TEST_REQUIRE(choices >= m->top_k, "routing %s leaves %d experts of %d for top-%d",
               kind_names[kind], choices, m->experts, m->top_k);
  for (int r = 0; r < m->world; r++) {
    const int64_t T = m->tokens[r];
    for (int64_t t = 0; t < T; t++)
      for (int j = 0; j < m->top_k; j++) {
        const allowed_ctx ctx = {m, kind};
        int32_t e = moe_pick_expert(m->h_idx[r] + t * m->top_k, j, m->experts, m->top_k,
                                    kind == kSkewed, rng, allowed_of, &ctx);
        if (kind == kHoles && tw_test_xorshift(rng) % 4 == 0)
          e = -1;
        m->h_idx[r][t * m->top_k + j] = e;
        /* weights in (-2, 2), not all exact in bf16, so the products round */
        m->h_w[r][t * m->top_k + j] =
            (float)((int64_t)(tw_test_xorshift(rng) % 40001) - 20000) / 10007.0f;
      }
    if (T) {
      TEST_CUDA_OK(
          cudaMemcpy(m->idx[r], m->h_idx[r], (size_t)T * m->top_k * 4, cudaMemcpyHostToDevice));
      TEST_CUDA_OK(
          cudaMemcpy(m->w[r], m->h_w[r], (size_t)T * m->top_k * 4, cudaMemcpyHostToDevice));
    }
    tw_test_fill_bf16(m->x[r], (size_t)(T ? T : 1) * m->hidden, tw_test_xorshift(rng), 0);
    tw_test_poison(m->recv[r], (size_t)m->recv_rows * m->hidden * 2, 0);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static tw_moe_args_t args_of(const bwd_t *m, int r) {
  tw_moe_args_t a = TW_MOE_ARGS_INIT;
  a.x = m->x[r], a.topk_idx = m->idx[r], a.topk_weights = (const float *)m->w[r];
  a.recv = m->recv[r], a.offsets = m->offsets[r], a.expert_out = m->eout[r], a.out = m->out[r];
  a.workspace = m->ws[r];
  a.tokens = m->tokens[r], a.max_tokens = m->max_tokens, a.hidden = m->hidden, a.n_out = m->n;
  a.experts = m->experts, a.top_k = m->top_k, a.recv_rows = m->recv_rows;
  a.grad = m->grad[r], a.expert_grad = m->egrad[r], a.weights_grad = m->wgrad[r];
  return a;
}

/* A version-2 caller's args: the struct up to inter. */
static tw_moe_args_t as_v2(tw_moe_args_t a) {
  a.size = offsetof(tw_moe_args_t, grad);
  a.version = 2;
  return a;
}

/* One step on every rank's stream: dispatch, the forward combine, combine_backward, the second
 * combine of expert_grad with weights 1. Seeds fix expert_out (unfused) and grad. */
static void run_step(bwd_t *m, uint64_t seed, int with_wgrad, int v2) {
  const int W = m->world;
  for (int r = 0; r < W; r++) {
    tw_moe_args_t a = args_of(m, r);
    a = v2 ? as_v2(a) : a;
    TEST_TW_OK(tw_moe_dispatch(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < W; r++) {
    const tw_stream_t s = (tw_stream_t)m->streams[r];
    tw_test_poison(m->out[r], (size_t)(m->max_tokens ? m->max_tokens : 1) * m->n * 2, s);
    if (!m->fused) /* expert_out: any finite rows will do as the experts' outputs */
      tw_test_fill_bf16(m->eout[r], (size_t)m->recv_rows * m->n, seed + 31 * r, s);
    else
      tw_test_poison(m->eout[r], (size_t)m->recv_rows * m->n * 2, s);
  }
  for (int r = 0; r < W; r++) {
    tw_moe_args_t a = args_of(m, r);
    a.weights = m->weights[r];
    a = v2 ? as_v2(a) : a;
    TEST_TW_OK(m->fused ? tw_moe_gemm_combine(m->comms[r], &a, (tw_stream_t)m->streams[r])
                        : tw_moe_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < W; r++) {
    const tw_stream_t s = (tw_stream_t)m->streams[r];
    const size_t T = (size_t)(m->max_tokens ? m->max_tokens : 1);
    tw_test_fill_bf16(m->grad[r], T * m->n, seed + 1000 + 17 * r, s);
    tw_test_poison(m->egrad[r], (size_t)m->recv_rows * m->n * 2, s);
    tw_test_poison(m->wgrad[r], T * m->top_k * 4, s);
    tw_test_poison(m->out2[r], T * m->n * 2, s);
  }
  for (int r = 0; r < W; r++) {
    tw_moe_args_t a = args_of(m, r);
    if (!with_wgrad)
      a.weights_grad = NULL;
    TEST_TW_OK(tw_moe_combine_backward(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < W; r++) { /* the dispatch's backward: recv's gradient combined, weights 1 */
    tw_moe_args_t a = args_of(m, r);
    a.topk_weights = (const float *)m->ones[r], a.expert_out = m->egrad[r], a.out = m->out2[r];
    TEST_TW_OK(tw_moe_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static float bf(uint16_t h) { return tw_test_bf16_to_float(h); }

/* Prints the first few of a check's mismatches (the test's failure detail). */
static int g_shown;
#define SHOW(...)                                                                                  \
  do {                                                                                             \
    if (g_shown++ < 12) {                                                                          \
      fprintf(stderr, "  mismatch: ");                                                             \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fprintf(stderr, "\n");                                                                       \
    }                                                                                              \
  } while (0)

typedef struct {
  uint16_t *eout[TW_MAX_WORLD], *egrad[TW_MAX_WORLD], *grad[TW_MAX_WORLD], *out[TW_MAX_WORLD],
      *out2[TW_MAX_WORLD];
  float *wgrad[TW_MAX_WORLD];
  int64_t *row_of[TW_MAX_WORLD]; /* [s][t * top_k + j]: rank << 40 | row, -1 none */
  int64_t need[TW_MAX_WORLD];
} host_t;

static void host_read(const bwd_t *m, host_t *h) {
  const int64_t R = m->recv_rows, N = m->n;
  for (int r = 0; r < m->world; r++) {
    const int64_t T = m->tokens[r] + 1, E = T * m->top_k;
    h->eout[r] = (uint16_t *)malloc((size_t)R * N * 2);
    h->egrad[r] = (uint16_t *)malloc((size_t)R * N * 2);
    h->grad[r] = (uint16_t *)malloc((size_t)T * N * 2);
    h->out[r] = (uint16_t *)malloc((size_t)T * N * 2);
    h->out2[r] = (uint16_t *)malloc((size_t)T * N * 2);
    h->wgrad[r] = (float *)malloc((size_t)E * 4);
    h->row_of[r] = (int64_t *)malloc((size_t)E * 8);
    TEST_REQUIRE(h->eout[r] && h->egrad[r] && h->grad[r] && h->out[r] && h->out2[r] &&
                     h->wgrad[r] && h->row_of[r],
                 "host memory");
    TEST_CUDA_OK(cudaMemcpy(h->eout[r], m->eout[r], (size_t)R * N * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(cudaMemcpy(h->egrad[r], m->egrad[r], (size_t)R * N * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(
        cudaMemcpy(h->grad[r], m->grad[r], (size_t)(T - 1) * N * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(cudaMemcpy(h->out[r], m->out[r], (size_t)(T - 1) * N * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(
        cudaMemcpy(h->out2[r], m->out2[r], (size_t)(T - 1) * N * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(
        cudaMemcpy(h->wgrad[r], m->wgrad[r], (size_t)(E - m->top_k) * 4, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < E; i++)
      h->row_of[r][i] = -1;
  }
  /* the layout: each local expert's rows from every source in rank order, each source's in
   * token order, experts at multiples of 128 */
  const int L = m->experts / m->world;
  for (int d = 0; d < m->world; d++) {
    int64_t row = 0;
    for (int el = 0; el < L; el++) {
      const int e = d * L + el;
      const int64_t start = row;
      for (int s = 0; s < m->world; s++)
        for (int64_t i = 0; i < m->tokens[s] * m->top_k; i++)
          if (m->h_idx[s][i] == e)
            h->row_of[s][i] = (int64_t)d << 40 | row++;
      row = start + (row - start + 127) / 128 * 128;
    }
    h->need[d] = row;
  }
}

static void host_free(const bwd_t *m, host_t *h) {
  for (int r = 0; r < m->world; r++)
    free(h->eout[r]), free(h->egrad[r]), free(h->grad[r]), free(h->out[r]), free(h->out2[r]),
        free(h->wgrad[r]), free(h->row_of[r]);
}

static const int64_t kRowMask = (1ll << 40) - 1;

/* out[t] of a combine of `rows` (every rank's [recv_rows, n]) with weights w (NULL: 1), bitwise
 * the host's slot-order fp32 sum; across nodes t's own node's slots in slot order, then each
 * other node's partial (its slots in slot order, rounded to bf16) in node order. Returns the
 * elements that differ. */
static size_t check_combined(const bwd_t *m, const host_t *h, uint16_t *const *rows,
                             uint16_t *const *got, int unit_weights, const char *what,
                             const char *which) {
  size_t bad = 0;
  const int64_t N = m->n;
  for (int s = 0; s < m->world; s++)
    for (int64_t t = 0; t < m->tokens[s]; t++)
      for (int64_t c = 0; c < N; c++) {
        float acc = 0;
        const int P = m->per_node, own = s / P;
        for (int node = -1; node < m->world / P; node++) { /* -1: t's own node */
          if (node == own)
            continue;
          float part = 0;
          int any = 0;
          for (int j = 0; j < m->top_k; j++) {
            const int64_t at = h->row_of[s][t * m->top_k + j];
            if (at < 0 || (int)(at >> 40) / P != (node < 0 ? own : node))
              continue;
            const float w = unit_weights ? 1.0f : m->h_w[s][t * m->top_k + j];
            part = fmaf(w, bf(rows[at >> 40][(at & kRowMask) * N + c]), part);
            any = 1;
          }
          if (node < 0)
            acc = part;
          else if (any)
            acc = fmaf(1.0f, bf(tw_test_float_to_bf16(part)), acc);
        }
        const uint16_t want = tw_test_float_to_bf16(acc), have = got[s][t * N + c];
        if (have != want) {
          bad++;
          SHOW("%s: %s: rank %d, token %lld, column %lld: got 0x%04x (%g), expected 0x%04x (%g)",
               what, which, s, (long long)t, (long long)c, have, bf(have), want, bf(want));
        }
      }
  return bad;
}

static void check_step(const bwd_t *m, const char *what, int with_wgrad) {
  host_t h;
  host_read(m, &h);
  const int W = m->world, L = m->experts / W, K = m->top_k;
  const int64_t N = m->n, R = m->recv_rows;
  g_shown = 0;
  /* the forward combine: the dispatch before it worked */
  size_t bad = check_combined(m, &h, h.eout, h.out, 0, what, "forward combine out");
  TEST_ASSERT(bad == 0, "%s: %zu elements of the forward combine's out differ from the host's sum",
              what, bad);
  /* live rows of expert_grad */
  g_shown = 0;
  size_t live_bad = 0, wg_bad = 0, wg_far = 0;
  double worst = 0;
  for (int s = 0; s < W; s++)
    for (int64_t t = 0; t < m->tokens[s]; t++)
      for (int j = 0; j < K; j++) {
        const int64_t i = t * K + j, at = h.row_of[s][i];
        const int d = (int)(at >> 40);
        const int64_t row = at & kRowMask;
        const float w = m->h_w[s][i];
        float acc = 0;
        double ref = 0, mag = 0;
        for (int64_t c = 0; at >= 0 && c < N; c++) {
          const uint16_t g = h.grad[s][t * N + c];
          const uint16_t want = tw_test_float_to_bf16(w * bf(g));
          const uint16_t have = h.egrad[d][row * N + c];
          if (have != want) {
            live_bad++;
            SHOW("%s: expert_grad: rank %d token %lld slot %d (expert %d, rank %d row %lld), "
                 "column %lld: got 0x%04x (%g), expected 0x%04x (%g) = bf16(%.9g * %g)",
                 what, s, (long long)t, j, m->h_idx[s][i], d, (long long)row, (long long)c, have,
                 bf(have), want, bf(want), w, bf(g));
          }
          const float y = bf(h.eout[d][row * N + c]);
          acc = fmaf(bf(g), y, acc);
          ref += (double)bf(g) * y;
          mag += fabs((double)bf(g) * y);
        }
        if (!with_wgrad)
          continue;
        uint32_t have_bits, want_bits;
        memcpy(&have_bits, &h.wgrad[s][i], 4);
        memcpy(&want_bits, &acc, 4);
        if (have_bits != want_bits) {
          wg_bad++;
          SHOW("%s: weights_grad: rank %d token %lld slot %d (expert %d): got %.9g (0x%08x), "
               "expected %.9g (0x%08x)",
               what, s, (long long)t, j, m->h_idx[s][i], h.wgrad[s][i], have_bits, acc, want_bits);
        }
        /* fp32 column-order sum of exact products: within (N - 1) u sum|products| */
        const double err = fabs((double)h.wgrad[s][i] - ref),
                     bound = (double)N * ldexp(1.0, -24) * mag + 1e-30;
        worst = fmax(worst, err / bound);
        if (!(err <= bound)) {
          wg_far++;
          SHOW("%s: weights_grad: rank %d token %lld slot %d: %.9g is %.3g off the fp64 sum "
               "%.12g (bound %.3g)",
               what, s, (long long)t, j, h.wgrad[s][i], err, ref, bound);
        }
      }
  TEST_ASSERT(live_bad == 0, "%s: %zu live expert_grad elements differ from bf16(w * grad)", what,
              live_bad);
  TEST_ASSERT(wg_bad == 0 && wg_far == 0,
              "%s: %zu weights_grad values differ from the host's column-order fp32 sum, %zu "
              "outside the rounding bound of an fp64 sum (worst %.3g of it)",
              what, wg_bad, wg_far, worst);
  /* padding rows zero, rows past the layout untouched; weights_grad NULL: left alone */
  g_shown = 0;
  size_t pad_bad = 0, past_bad = 0, wg_written = 0;
  for (int d = 0; d < W; d++) {
    int64_t row = 0;
    for (int el = 0; el < L; el++) {
      int64_t live = 0;
      for (int s = 0; s < W; s++)
        for (int64_t i = 0; i < m->tokens[s] * K; i++)
          live += m->h_idx[s][i] == d * L + el;
      const int64_t end = row + (live + 127) / 128 * 128;
      for (int64_t q = row + live; q < end; q++)
        for (int64_t c = 0; c < N; c++)
          if (h.egrad[d][q * N + c] != 0) {
            pad_bad++;
            SHOW("%s: expert_grad padding: rank %d, expert %d (rows %lld + %lld live), row "
                 "%lld, column %lld: got 0x%04x, expected 0x0000",
                 what, d, d * L + el, (long long)row, (long long)live, (long long)q, (long long)c,
                 h.egrad[d][q * N + c]);
          }
      row = end;
    }
    TEST_ASSERT(row == h.need[d], "layout");
    for (int64_t q = row; q < R; q++)
      for (int64_t c = 0; c < N; c++)
        if (h.egrad[d][q * N + c] != 0xffff) {
          past_bad++;
          SHOW("%s: expert_grad past offsets[local] (%lld): rank %d row %lld column %lld: got "
               "0x%04x, expected the poison 0xffff",
               what, (long long)row, d, (long long)q, (long long)c, h.egrad[d][q * N + c]);
        }
    for (int64_t i = 0; !with_wgrad && i < m->tokens[d] * K; i++) {
      uint32_t bits;
      memcpy(&bits, &h.wgrad[d][i], 4);
      wg_written += bits != 0xffffffffu;
    }
  }
  TEST_ASSERT(pad_bad == 0 && past_bad == 0 && wg_written == 0,
              "%s: %zu padding elements not zero, %zu elements past the layout written, %zu "
              "weights_grad values written with weights_grad NULL",
              what, pad_bad, past_bad, wg_written);
  /* the second combine: sum over slots of the expert_grad rows */
  g_shown = 0;
  bad = check_combined(m, &h, h.egrad, h.out2, 1, what, "second combine (weights 1) out");
  TEST_ASSERT(bad == 0,
              "%s: %zu elements of the second combine's out differ from the slot sum of the "
              "expert_grad rows",
              what, bad);
  for (int r = 0; r < W; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(m->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "%s: rank %d: %s", what, r, tw_comm_last_error(m->comms[r]));
  }
  host_free(m, &h);
}

/* The device buffers a step writes, saved, then compared after the same step again. */
static void check_repeat(bwd_t *m, uint64_t seed, const char *what) {
  const int W = m->world;
  const size_t T = (size_t)(m->max_tokens ? m->max_tokens : 1), R = (size_t)m->recv_rows;
  void *saved[TW_MAX_WORLD][3];
  const size_t bytes[3] = {R * m->n * 2, T * m->top_k * 4, T * m->n * 2};
  for (int r = 0; r < W; r++) {
    void *src[3] = {m->egrad[r], m->wgrad[r], m->out2[r]};
    for (int b = 0; b < 3; b++) {
      TEST_CUDA_OK(cudaMalloc(&saved[r][b], bytes[b]));
      TEST_CUDA_OK(cudaMemcpy(saved[r][b], src[b], bytes[b], cudaMemcpyDeviceToDevice));
    }
  }
  run_step(m, seed, 1, 0);
  for (int r = 0; r < W; r++) {
    void *now[3] = {m->egrad[r], m->wgrad[r], m->out2[r]};
    const char *names[3] = {"expert_grad", "weights_grad", "the second combine's out"};
    for (int b = 0; b < 3; b++) {
      const size_t diff = tw_test_count_diff(now[b], saved[r][b], bytes[b]);
      TEST_ASSERT(diff == 0, "%s, repeated: rank %d: %zu bytes of %s differ from the first run",
                  what, r, diff, names[b]);
      cudaFree(saved[r][b]);
    }
  }
}

/* Steps of one comm: each a routing kind and token counts (`pattern`: 0 random 1..max, 1 the
 * last rank none, 2 every rank max_tokens, 3 every rank 1, 4 every rank none). */
static void test_case(int world, int per_node, int experts, int top_k, int64_t n,
                      int64_t max_tokens, int fused, uint64_t seed) {
  bwd_t m;
  bwd_init(&m, world, per_node, experts, top_k, fused ? 128 : 64, n, max_tokens, fused);
  uint64_t rng = seed | 1;
  const int kinds[6] = {kRandom, kSkewed, kHoles, kEmpty, kHoles, kRandom};
  const int patterns[6] = {0, 1, 2, 3, 0, 4};
  const int steps = fused ? 5 : 6; /* every rank without tokens: the unfused calls */
  for (int it = 0; it < steps; it++) {
    for (int r = 0; r < world; r++) {
      const int64_t any = (int64_t)(tw_test_xorshift(&rng) % (uint64_t)max_tokens) + 1;
      m.tokens[r] = patterns[it] == 0   ? any
                    : patterns[it] == 1 ? (r == world - 1 && world > 1 ? 0 : any)
                    : patterns[it] == 2 ? max_tokens
                    : patterns[it] == 3 ? 1
                                        : 0;
    }
    route(&m, kinds[it], &rng);
    char what[192];
    snprintf(what, sizeof(what),
             "world %d (nodes of %d), %d experts, top-%d, n_out %lld, max_tokens %lld, %s, step %d "
             "(%s, tokens %lld..)",
             world, per_node, experts, top_k, (long long)n, (long long)max_tokens,
             fused ? "tw_moe_gemm_combine forward" : "tw_moe_combine forward", it,
             kind_names[kinds[it]], (long long)m.tokens[0]);
    const int with_wgrad = it != 3;
    const uint64_t step_seed = tw_test_xorshift(&rng);
    run_step(&m, step_seed, with_wgrad, it == 1);
    check_step(&m, what, with_wgrad);
    if (it == 2)
      check_repeat(&m, step_seed, what);
  }
  bwd_fini(&m);
}

/* A refused call: status and both needles in the message, which names the entry point. */
static void expect_refused(tw_status_t st, const char *a, const char *b, const char *what) {
  const char *msg = tw_last_error();
  TEST_ASSERT(st == TW_ERR_INVALID_ARGUMENT && strstr(msg, "tw_moe_combine_backward") &&
                  strstr(msg, a) && (!b || strstr(msg, b)),
              "%s: %s (%s); expected TW_ERR_INVALID_ARGUMENT naming \"%s\"%s%s", what,
              tw_status_string(st), msg, a, b ? " and " : "", b ? b : "");
}

static void test_refusals(void) {
  bwd_t m;
  bwd_init(&m, 2, 2, 4, 2, 64, 64, 16, 0);
  m.tokens[0] = m.tokens[1] = 4;
  void *plain = NULL;
  TEST_CUDA_OK(cudaMalloc(&plain, (size_t)m.recv_rows * m.n * 2));
  const tw_comm_t c = m.comms[0];
  tw_moe_args_t a;
  a = args_of(&m, 0), a.grad = NULL;
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->grad", "NULL", "grad NULL");
  a = as_v2(args_of(&m, 0)); /* a version-2 struct has no grad */
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->grad", "NULL", "version-2 size");
  a = args_of(&m, 0), a.expert_grad = NULL;
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->expert_grad", "NULL",
                 "expert_grad NULL");
  a = args_of(&m, 0), a.expert_grad = plain;
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->expert_grad", "tw_mem_alloc",
                 "expert_grad not symmetric");
  a = args_of(&m, 0), a.expert_out = plain;
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->expert_out", "tw_mem_alloc",
                 "expert_out not symmetric");
  a = args_of(&m, 0), a.expert_grad = m.eout[0];
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->expert_grad", "overlaps expert_out",
                 "expert_grad = expert_out");
  a = args_of(&m, 0), a.grad = m.egrad[0];
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->expert_grad", "overlaps grad",
                 "grad inside expert_grad");
  a = args_of(&m, 0), a.expert_grad = m.ws[0];
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->expert_grad", "workspace",
                 "expert_grad = workspace");
  a = args_of(&m, 0), a.weights_grad = (float *)m.grad[0];
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->weights_grad", "overlaps grad",
                 "weights_grad inside grad");
  a = args_of(&m, 0), a.weights_grad = (float *)m.w[0];
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->weights_grad", "overlaps topk_weights",
                 "weights_grad = topk_weights");
  a = args_of(&m, 0), a.weights_grad = (float *)m.egrad[0];
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->weights_grad", "expert_grad",
                 "weights_grad inside expert_grad");
  a = args_of(&m, 0), a.n_out = 60;
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->n_out", "multiple of 8", "n_out 60");
  a = args_of(&m, 0), a.grad = (const char *)m.grad[0] + 8, a.tokens = 2;
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->grad", "16-byte aligned",
                 "grad misaligned");
  a = args_of(&m, 0), a.topk_weights = NULL;
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->topk_weights", NULL,
                 "topk_weights NULL");
  a = args_of(&m, 0), a.recv_rows = m.recv_rows * 4; /* past the symmetric allocations */
  expect_refused(tw_moe_combine_backward(c, &a, 0), "args->expert_out", "past the end",
                 "recv_rows too large");
  cudaFree(plain);
  bwd_fini(&m);
}

#ifdef TW_VERBS_DOUBLE
/* Virtual nodes over the verbs test double (nodes x ranks per node): 2x2, an odd 3x2 with top-8
 * and an n_out tail, 2x4 with top-1, the fused forward, 4x1 (every rank its own node). */
static void across_nodes(const char *backend, uint64_t seed) {
  printf("across nodes, backend %s:\n", backend);
  const int cases[5][7] = {{4, 2, 8, 2, 128, 200, 0},
                           {6, 2, 24, 8, 136, 150, 0},
                           {8, 4, 16, 1, 256, 130, 0},
                           {4, 2, 8, 2, 256, 200, 1},
                           {4, 1, 8, 2, 64, 100, 0}};
  for (int i = 0; i < 5; i++) {
    const int *c = cases[i];
    test_case(c[0], c[1], c[2], c[3], c[4], c[5], c[6], seed + (uint64_t)i);
    printf("  %dx%d, %d experts, top-%d, n_out %d%s: checked\n", c[0] / c[1], c[1], c[2], c[3],
           c[4], c[6] ? ", tw_moe_gemm_combine forward" : "");
    fflush(stdout);
  }
}
#endif

int main(void) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  test_case(1, 1, 8, 2, 128, 300, 0, seed);
  test_case(2, 2, 16, 8, 256, 200, 0, seed + 1);
  test_case(3, 3, 6, 1, 136, 200, 0, seed + 2);
  test_case(4, 4, 32, 8, 264, 150, 0, seed + 3);
  test_case(4, 4, 8, 2, 128, 256, 0, seed + 4);
  test_case(2, 2, 4, 2, 256, 200, 1, seed + 5);
  test_case(3, 3, 6, 2, 136, 120, 1, seed + 6);
  test_refusals();
#ifdef TW_VERBS_DOUBLE
  tw_test_on_both_backends(TW_VERBS_DOUBLE, across_nodes, NULL, seed + 7);
#else
  printf("built without rdma-core's headers: the cases across nodes are not run\n");
#endif
  return tw_test_finish();
}
