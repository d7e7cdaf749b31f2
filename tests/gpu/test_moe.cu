/*
 * tw_moe_dispatch and tw_moe_combine on virtual ranks of one GPU, with tw_grouped_gemm as the
 * experts' GEMM between them (the unfused MoE pipeline): at worlds 1, 2, 3 and 4, random,
 * skewed (hot experts) and empty-expert routings, top-k 1, 2 and 8, unused slots (-1), int32 and
 * int64 indices, ranks with different token counts (0 included): every rank's recv holds, bitwise,
 * each local expert's rows from every source in rank order, each source's in token order, at
 * offsets padded to 128 (padding rows untouched); the offsets are exact; every rank's combine is
 * bitwise the host's slot-order fp32 sum of the weighted expert outputs it read, and within bf16
 * tolerance of an fp64 reference of the whole layer; tw_moe_dispatch_gemm then gives the same
 * recv, offsets, experts' rows and combined out, bitwise, and so does tw_moe_gemm_combine, also
 * when calls of two n_out alternate on one comm (two layers).
 * Back-to-back calls with fresh routings; then an expert index out of range and a too-small recv,
 * each reported on every rank as TW_ERR_INVALID_ARGUMENT naming it, with nothing copied; and
 * argument refusals. 77 without a Hopper GPU.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test.h"

typedef struct {
  int world, experts, top_k, index_bits;
  int64_t hidden, n, max_tokens, recv_rows;
  int64_t tokens[TW_MAX_WORLD];
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *x[TW_MAX_WORLD], *idx[TW_MAX_WORLD], *w[TW_MAX_WORLD], *weights[TW_MAX_WORLD];
  void *recv[TW_MAX_WORLD], *eout[TW_MAX_WORLD], *out[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  int32_t *offsets[TW_MAX_WORLD];
  int32_t *h_idx[TW_MAX_WORLD]; /* host routing, [tokens][top_k] */
  float *h_w[TW_MAX_WORLD];
} world_t;

static void world_init(world_t *m, int world, int experts, int top_k, int64_t hidden, int64_t n,
                       int64_t max_tokens, int64_t recv_rows, int index_bits) {
  memset(m, 0, sizeof(*m));
  m->world = world, m->experts = experts, m->top_k = top_k, m->index_bits = index_bits;
  m->hidden = hidden, m->n = n, m->max_tokens = max_tokens, m->recv_rows = recv_rows;
  int devices[TW_MAX_WORLD] = {0};
  TEST_REQUIRE(tw_comm_init_all(m->comms, world, devices, NULL) == TW_SUCCESS, "init: %s",
               tw_last_error());
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_moe_workspace_size(m->comms[0], max_tokens, experts, top_k, &ws_bytes));
  const int local = experts / world;
  for (int r = 0; r < world; r++) {
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&m->streams[r], cudaStreamNonBlocking));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], ws_bytes, &m->ws[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], (size_t)recv_rows * hidden * 2, &m->recv[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], (size_t)recv_rows * n * 2, &m->eout[r]));
    TEST_CUDA_OK(cudaMalloc(&m->x[r], (size_t)(max_tokens ? max_tokens : 1) * hidden * 2));
    TEST_CUDA_OK(cudaMalloc(&m->idx[r], (size_t)(max_tokens ? max_tokens : 1) * top_k * 8));
    TEST_CUDA_OK(cudaMalloc(&m->w[r], (size_t)(max_tokens ? max_tokens : 1) * top_k * 4));
    TEST_CUDA_OK(cudaMalloc(&m->out[r], (size_t)(max_tokens ? max_tokens : 1) * n * 2));
    TEST_CUDA_OK(cudaMalloc(&m->weights[r], (size_t)local * n * hidden * 2));
    TEST_CUDA_OK(cudaMalloc((void **)&m->offsets[r], (size_t)(local + 1) * 4));
    m->h_idx[r] = (int32_t *)malloc((size_t)(max_tokens + 1) * top_k * 4);
    m->h_w[r] = (float *)malloc((size_t)(max_tokens + 1) * top_k * 4);
    TEST_REQUIRE(m->h_idx[r] && m->h_w[r], "host memory");
    tw_test_fill_bf16(m->weights[r], (size_t)local * n * hidden, 900 + r, 0);
  }
}

static void world_fini(world_t *m) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < m->world; r++) {
    TEST_TW_OK(tw_mem_free(m->comms[r], m->ws[r]));
    TEST_TW_OK(tw_mem_free(m->comms[r], m->recv[r]));
    TEST_TW_OK(tw_mem_free(m->comms[r], m->eout[r]));
    cudaFree(m->x[r]), cudaFree(m->idx[r]), cudaFree(m->w[r]), cudaFree(m->out[r]);
    cudaFree(m->weights[r]), cudaFree(m->offsets[r]);
    free(m->h_idx[r]), free(m->h_w[r]);
    cudaStreamDestroy(m->streams[r]);
  }
  for (int r = 0; r < m->world; r++)
    TEST_TW_OK(tw_comm_destroy(m->comms[r]));
}

enum { kRandom, kSkewed, kHoles };

/* A routing: top_k distinct experts per token (skewed: mostly the first few), some slots -1
 * (kHoles), fresh token values and weights. */
static void route(world_t *m, int kind, uint64_t *rng) {
  for (int r = 0; r < m->world; r++) {
    const int64_t T = m->tokens[r];
    for (int64_t t = 0; t < T; t++)
      for (int j = 0; j < m->top_k; j++) {
        int32_t e;
        int fresh;
        do {
          const uint64_t u = tw_test_xorshift(rng);
          const int hot = m->top_k + 1 < m->experts ? m->top_k + 1 : m->experts;
          e = kind == kSkewed && u % 4 != 0 ? (int32_t)(u / 4 % (uint64_t)hot)
                                            : (int32_t)(u / 4 % (uint64_t)m->experts);
          fresh = 1;
          for (int q = 0; q < j; q++)
            fresh &= m->h_idx[r][t * m->top_k + q] != e;
        } while (!fresh);
        if (kind == kHoles && tw_test_xorshift(rng) % 5 == 0)
          e = -1;
        m->h_idx[r][t * m->top_k + j] = e;
        m->h_w[r][t * m->top_k + j] = (float)(tw_test_xorshift(rng) % 1000) / 1000.0f;
      }
    if (m->index_bits == 64) {
      int64_t *wide = (int64_t *)malloc((size_t)(T + 1) * m->top_k * 8);
      TEST_REQUIRE(wide, "host memory");
      for (int64_t i = 0; i < T * m->top_k; i++)
        wide[i] = m->h_idx[r][i];
      TEST_CUDA_OK(cudaMemcpy(m->idx[r], wide, (size_t)T * m->top_k * 8, cudaMemcpyHostToDevice));
      free(wide);
    } else {
      TEST_CUDA_OK(
          cudaMemcpy(m->idx[r], m->h_idx[r], (size_t)T * m->top_k * 4, cudaMemcpyHostToDevice));
    }
    TEST_CUDA_OK(cudaMemcpy(m->w[r], m->h_w[r], (size_t)T * m->top_k * 4, cudaMemcpyHostToDevice));
    tw_test_fill_bf16(m->x[r], (size_t)(T ? T : 1) * m->hidden, tw_test_xorshift(rng), 0);
    tw_test_poison(m->recv[r], (size_t)m->recv_rows * m->hidden * 2, 0);
    tw_test_poison(m->out[r], (size_t)(m->max_tokens ? m->max_tokens : 1) * m->n * 2, 0);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static tw_moe_args_t args_of(const world_t *m, int r) {
  tw_moe_args_t a = TW_MOE_ARGS_INIT;
  a.index_bits = m->index_bits;
  a.x = m->x[r], a.topk_idx = m->idx[r], a.topk_weights = (const float *)m->w[r];
  a.recv = m->recv[r], a.offsets = m->offsets[r], a.expert_out = m->eout[r], a.out = m->out[r];
  a.workspace = m->ws[r];
  a.tokens = m->tokens[r], a.max_tokens = m->max_tokens, a.hidden = m->hidden, a.n_out = m->n;
  a.experts = m->experts, a.top_k = m->top_k, a.recv_rows = m->recv_rows;
  return a;
}

/* dispatch, grouped GEMM and combine on every rank's stream. */
static void run_layer(world_t *m) {
  const int local = m->experts / m->world;
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = args_of(m, r);
    TEST_TW_OK(tw_moe_dispatch(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < m->world; r++) {
    tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
    g.a = m->recv[r], g.b = m->weights[r], g.out = m->eout[r], g.offsets = m->offsets[r];
    g.m = m->recv_rows, g.n = m->n, g.k = m->hidden, g.groups = local;
    TEST_TW_OK(tw_grouped_gemm(&g, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = args_of(m, r);
    TEST_TW_OK(tw_moe_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static float bf(uint16_t h) { return tw_test_bf16_to_float(h); }

/* recv and offsets against the host's layout, combine against the host's sum of what recv and
 * expert_out hold, and the whole layer against an fp64 reference. */
static void check_layer(world_t *m, const char *what) {
  const int W = m->world, local = m->experts / W;
  const int64_t H = m->hidden, N = m->n;
  uint16_t *recv = (uint16_t *)malloc((size_t)m->recv_rows * H * 2);
  uint16_t **eout = (uint16_t **)calloc(W, sizeof(uint16_t *));
  uint16_t **x = (uint16_t **)calloc(W, sizeof(uint16_t *));
  int64_t **row_of = (int64_t **)calloc(W, sizeof(int64_t *)); /* [r][t * top_k + j]: d, row */
  TEST_REQUIRE(recv && eout && x && row_of, "host memory");
  for (int r = 0; r < W; r++) {
    x[r] = (uint16_t *)malloc((size_t)(m->tokens[r] + 1) * H * 2);
    eout[r] = (uint16_t *)malloc((size_t)m->recv_rows * N * 2);
    row_of[r] = (int64_t *)malloc((size_t)(m->tokens[r] + 1) * m->top_k * 8);
    TEST_REQUIRE(x[r] && eout[r] && row_of[r], "host memory");
    TEST_CUDA_OK(cudaMemcpy(x[r], m->x[r], (size_t)m->tokens[r] * H * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(
        cudaMemcpy(eout[r], m->eout[r], (size_t)m->recv_rows * N * 2, cudaMemcpyDeviceToHost));
  }
  size_t recv_bad = 0, off_bad = 0, pad_bad = 0;
  for (int d = 0; d < W; d++) {
    TEST_CUDA_OK(
        cudaMemcpy(recv, m->recv[d], (size_t)m->recv_rows * H * 2, cudaMemcpyDeviceToHost));
    int32_t off[1025];
    TEST_CUDA_OK(cudaMemcpy(off, m->offsets[d], (size_t)(local + 1) * 4, cudaMemcpyDeviceToHost));
    int64_t row = 0;
    for (int el = 0; el < local; el++) {
      const int e = d * local + el;
      off_bad += off[el] != row;
      const int64_t start = row;
      for (int s = 0; s < W; s++)
        for (int64_t t = 0; t < m->tokens[s]; t++)
          for (int j = 0; j < m->top_k; j++)
            if (m->h_idx[s][t * m->top_k + j] == e) {
              recv_bad += memcmp(recv + row * H, x[s] + t * H, (size_t)H * 2) != 0;
              row_of[s][t * m->top_k + j] = (int64_t)d << 40 | row;
              row++;
            }
      const int64_t padded = start + (row - start + 127) / 128 * 128;
      for (; row < padded; row++)
        for (int64_t c = 0; c < H; c++)
          pad_bad += recv[row * H + c] != 0xffff;
    }
    off_bad += off[local] != row;
  }
  TEST_ASSERT(recv_bad == 0 && off_bad == 0 && pad_bad == 0,
              "%s: %zu recv rows differ, %zu offsets differ, %zu padding elements written", what,
              recv_bad, off_bad, pad_bad);
  uint16_t *out = (uint16_t *)malloc((size_t)(m->max_tokens + 1) * N * 2);
  uint16_t *wt = (uint16_t *)malloc((size_t)local * N * H * 2);
  TEST_REQUIRE(out && wt, "host memory");
  size_t out_bad = 0;
  double err = 0, scale = 0;
  for (int r = 0; r < W; r++) {
    TEST_CUDA_OK(cudaMemcpy(out, m->out[r], (size_t)m->tokens[r] * N * 2, cudaMemcpyDeviceToHost));
    for (int64_t t = 0; t < m->tokens[r]; t++)
      for (int64_t c = 0; c < N; c++) {
        float acc = 0;
        for (int j = 0; j < m->top_k; j++) {
          if (m->h_idx[r][t * m->top_k + j] < 0)
            continue;
          const int64_t at = row_of[r][t * m->top_k + j];
          acc = fmaf(m->h_w[r][t * m->top_k + j],
                     bf(eout[at >> 40][(at & ((1ll << 40) - 1)) * N + c]), acc);
        }
        out_bad += out[t * N + c] != tw_test_float_to_bf16(acc);
      }
  }
  TEST_ASSERT(out_bad == 0, "%s: %zu combine outputs differ from the slot-order sum", what,
              out_bad);
  /* fp64 reference of a few tokens of every rank: sum_j w * (x . weights[e]) */
  for (int r = 0; r < W; r++)
    for (int64_t t = 0; t < m->tokens[r]; t += 1 + m->tokens[r] / 7) {
      TEST_CUDA_OK(
          cudaMemcpy(out, (uint16_t *)m->out[r] + t * N, (size_t)N * 2, cudaMemcpyDeviceToHost));
      for (int64_t c = 0; c < N; c += 1 + N / 16) {
        double ref = 0;
        for (int j = 0; j < m->top_k; j++) {
          const int e = m->h_idx[r][t * m->top_k + j];
          if (e < 0)
            continue;
          uint16_t wrow[8192];
          TEST_REQUIRE(H <= 8192, "hidden");
          TEST_CUDA_OK(cudaMemcpy(
              wrow, (uint16_t *)m->weights[e / local] + ((int64_t)(e % local) * N + c) * H,
              (size_t)H * 2, cudaMemcpyDeviceToHost));
          double dot = 0;
          for (int64_t q = 0; q < H; q++)
            dot += (double)bf(x[r][t * H + q]) * bf(wrow[q]);
          ref += m->h_w[r][t * m->top_k + j] * dot;
        }
        err = fmax(err, fabs(bf(out[c]) - ref));
        scale = fmax(scale, fabs(ref));
      }
    }
  TEST_ASSERT(err <= 2e-2 * fmax(scale, 1e-3), "%s: %.3g off an fp64 reference (scale %.3g)", what,
              err, scale);
  for (int r = 0; r < W; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(m->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "%s: rank %d: %s", what, r, tw_comm_last_error(m->comms[r]));
    free(x[r]), free(eout[r]), free(row_of[r]);
  }
  free(recv), free(eout), free(x), free(row_of), free(out), free(wt);
}

/* tw_moe_dispatch_gemm (then the combine) against the unfused pipeline just run: recv and the
 * offsets bitwise, expert_out's live rows bitwise, out bitwise. */
static void check_fused(world_t *m, const char *what) {
  const int W = m->world, local = m->experts / W;
  const int64_t H = m->hidden, N = m->n, R = m->recv_rows;
  uint16_t *recv0[TW_MAX_WORLD], *eout0[TW_MAX_WORLD], *out0[TW_MAX_WORLD];
  int32_t off0[TW_MAX_WORLD][1025];
  for (int r = 0; r < W; r++) {
    recv0[r] = (uint16_t *)malloc((size_t)R * H * 2);
    eout0[r] = (uint16_t *)malloc((size_t)R * N * 2);
    out0[r] = (uint16_t *)malloc((size_t)(m->tokens[r] + 1) * N * 2);
    TEST_REQUIRE(recv0[r] && eout0[r] && out0[r], "host memory");
    TEST_CUDA_OK(cudaMemcpy(recv0[r], m->recv[r], (size_t)R * H * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(cudaMemcpy(eout0[r], m->eout[r], (size_t)R * N * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(
        cudaMemcpy(out0[r], m->out[r], (size_t)m->tokens[r] * N * 2, cudaMemcpyDeviceToHost));
    TEST_CUDA_OK(
        cudaMemcpy(off0[r], m->offsets[r], (size_t)(local + 1) * 4, cudaMemcpyDeviceToHost));
    tw_test_poison(m->recv[r], (size_t)R * H * 2, 0);
    tw_test_poison(m->eout[r], (size_t)R * N * 2, 0);
    tw_test_poison(m->out[r], (size_t)(m->max_tokens ? m->max_tokens : 1) * N * 2, 0);
    TEST_CUDA_OK(cudaMemset(m->offsets[r], 0xff, (size_t)(local + 1) * 4));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < W; r++) {
    tw_moe_args_t a = args_of(m, r);
    a.weights = m->weights[r];
    TEST_TW_OK(tw_moe_dispatch_gemm(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < W; r++) {
    tw_moe_args_t a = args_of(m, r);
    TEST_TW_OK(tw_moe_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  size_t recv_bad = 0, eout_bad = 0, out_bad = 0, off_bad = 0;
  uint16_t *h = (uint16_t *)malloc((size_t)R * (H > N ? H : N) * 2);
  TEST_REQUIRE(h, "host memory");
  for (int r = 0; r < W; r++) {
    int32_t off[1025];
    TEST_CUDA_OK(cudaMemcpy(off, m->offsets[r], (size_t)(local + 1) * 4, cudaMemcpyDeviceToHost));
    off_bad += memcmp(off, off0[r], (size_t)(local + 1) * 4) != 0;
    TEST_CUDA_OK(cudaMemcpy(h, m->recv[r], (size_t)R * H * 2, cudaMemcpyDeviceToHost));
    recv_bad += memcmp(h, recv0[r], (size_t)R * H * 2) != 0;
    TEST_CUDA_OK(cudaMemcpy(h, m->eout[r], (size_t)R * N * 2, cudaMemcpyDeviceToHost));
    for (int el = 0; el < local; el++) {
      int64_t live = 0; /* the expert's rows from every rank */
      for (int s = 0; s < W; s++)
        for (int64_t i = 0; i < m->tokens[s] * m->top_k; i++)
          live += m->h_idx[s][i] == r * local + el;
      eout_bad += memcmp(h + (size_t)off0[r][el] * N, eout0[r] + (size_t)off0[r][el] * N,
                         (size_t)live * N * 2) != 0;
    }
    TEST_CUDA_OK(cudaMemcpy(h, m->out[r], (size_t)m->tokens[r] * N * 2, cudaMemcpyDeviceToHost));
    out_bad += memcmp(h, out0[r], (size_t)m->tokens[r] * N * 2) != 0;
  }
  /* tw_moe_gemm_combine over the same recv and weights: the same experts' rows and out */
  size_t gc_eout_bad = 0, gc_out_bad = 0;
  for (int r = 0; r < W; r++) {
    tw_test_poison(m->eout[r], (size_t)R * N * 2, 0);
    tw_test_poison(m->out[r], (size_t)(m->max_tokens ? m->max_tokens : 1) * N * 2, 0);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < W; r++) {
    tw_moe_args_t a = args_of(m, r);
    a.weights = m->weights[r];
    TEST_TW_OK(tw_moe_gemm_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < W; r++) {
    TEST_CUDA_OK(cudaMemcpy(h, m->eout[r], (size_t)R * N * 2, cudaMemcpyDeviceToHost));
    for (int el = 0; el < local; el++) {
      int64_t live = 0;
      for (int s = 0; s < W; s++)
        for (int64_t i = 0; i < m->tokens[s] * m->top_k; i++)
          live += m->h_idx[s][i] == r * local + el;
      gc_eout_bad += memcmp(h + (size_t)off0[r][el] * N, eout0[r] + (size_t)off0[r][el] * N,
                            (size_t)live * N * 2) != 0;
    }
    TEST_CUDA_OK(cudaMemcpy(h, m->out[r], (size_t)m->tokens[r] * N * 2, cudaMemcpyDeviceToHost));
    gc_out_bad += memcmp(h, out0[r], (size_t)m->tokens[r] * N * 2) != 0;
  }
  TEST_ASSERT(gc_eout_bad == 0 && gc_out_bad == 0,
              "%s, tw_moe_gemm_combine: ranks whose experts' rows (%zu) or out (%zu) differ from "
              "tw_grouped_gemm + tw_moe_combine",
              what, gc_eout_bad, gc_out_bad);
  for (int r = 0; r < W; r++)
    free(recv0[r]), free(eout0[r]), free(out0[r]);
  free(h);
  TEST_ASSERT(recv_bad == 0 && off_bad == 0 && eout_bad == 0 && out_bad == 0,
              "%s, fused: ranks whose recv (%zu), offsets (%zu), experts' rows (%zu) or combined "
              "out (%zu) differ from the unfused pipeline",
              what, recv_bad, off_bad, eout_bad, out_bad);
  for (int r = 0; r < W; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(m->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "%s, fused: rank %d: %s", what, r,
                tw_comm_last_error(m->comms[r]));
  }
}

static void test_layer(int world, int experts, int top_k, int64_t hidden, int64_t n,
                       int64_t max_tokens, int index_bits, uint64_t seed) {
  world_t m;
  /* room for every slot of every rank plus each expert's padding */
  const int local = experts / world;
  const int64_t rows = max_tokens * world * (top_k < local ? top_k : local) + 127 * local + 128;
  world_init(&m, world, experts, top_k, hidden, n, max_tokens, rows, index_bits);
  uint64_t rng = seed | 1;
  const int kinds[3] = {kRandom, kSkewed, kHoles};
  for (int it = 0; it < 3; it++) {
    for (int r = 0; r < world; r++) /* ranks with different counts; the last may have none */
      m.tokens[r] = r == world - 1 && world > 1 && it == 1
                        ? 0
                        : (int64_t)(tw_test_xorshift(&rng) % (uint64_t)max_tokens) + 1;
    route(&m, kinds[it], &rng);
    run_layer(&m);
    char what[128];
    snprintf(what, sizeof(what), "world %d, %d experts, top-%d, hidden %lld, n %lld, %s, call %d",
             world, experts, top_k, (long long)hidden, (long long)n,
             it == 0   ? "random"
             : it == 1 ? "skewed"
                       : "with unused slots",
             it);
    check_layer(&m, what);
    check_fused(&m, what);
  }
  world_fini(&m);
}

/* Device-found errors: an index out of range on one rank, and a recv too small for a hot
 * expert; every rank reports TW_ERR_INVALID_ARGUMENT naming it and no rank's recv was written. */
/* tw_moe_gemm_combine as two layers of one comm would call it: after each dispatch, calls of
 * another n_out (and so another count of column blocks) in turn, each bitwise tw_grouped_gemm +
 * tw_moe_combine; its block counters must stay exact across them. */
static void test_gemm_combine_layers(uint64_t seed) {
  world_t m;
  const int64_t n_big = 640; /* 3 column blocks of 256 against the world's n of 128: 1 */
  world_init(&m, 2, 4, 2, 128, n_big, 200, 2048, 32);
  const int local = 2;
  void *wide[2], *eout_ref[2], *out_ref[2];
  for (int r = 0; r < 2; r++) {
    TEST_CUDA_OK(cudaMalloc(&wide[r], (size_t)local * n_big * 128 * 2));
    TEST_CUDA_OK(cudaMalloc(&eout_ref[r], (size_t)2048 * n_big * 2));
    TEST_CUDA_OK(cudaMalloc(&out_ref[r], (size_t)200 * n_big * 2));
    tw_test_fill_bf16(wide[r], (size_t)local * n_big * 128, seed + 70 + r, 0);
  }
  uint64_t rng = seed | 1;
  for (int call = 0; call < 4; call++) {
    for (int r = 0; r < 2; r++)
      m.tokens[r] = (int64_t)(tw_test_xorshift(&rng) % 200) + 1;
    route(&m, call % 2 ? kSkewed : kRandom, &rng);
    for (int r = 0; r < 2; r++) {
      tw_moe_args_t a = args_of(&m, r);
      TEST_TW_OK(tw_moe_dispatch(m.comms[r], &a, (tw_stream_t)m.streams[r]));
    }
    const int64_t n = call % 2 ? n_big : 128; /* the layers alternate */
    size_t bad = 0;
    for (int pass = 0; pass < 2; pass++) { /* the unfused pipeline, then the fused call */
      for (int r = 0; r < 2; r++) {
        tw_test_poison(m.eout[r], (size_t)2048 * n_big * 2, (tw_stream_t)m.streams[r]);
        tw_test_poison(m.out[r], (size_t)200 * n_big * 2, (tw_stream_t)m.streams[r]);
      }
      for (int r = 0; r < 2; r++) {
        tw_moe_args_t a = args_of(&m, r);
        a.n_out = n;
        a.weights = call % 2 ? wide[r] : m.weights[r];
        if (pass == 0) {
          tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
          g.a = m.recv[r], g.b = a.weights, g.out = m.eout[r], g.offsets = m.offsets[r];
          g.m = m.recv_rows, g.n = n, g.k = m.hidden, g.groups = local;
          TEST_TW_OK(tw_grouped_gemm(&g, (tw_stream_t)m.streams[r]));
        }
      }
      for (int r = 0; r < 2; r++) {
        tw_moe_args_t a = args_of(&m, r);
        a.n_out = n;
        a.weights = call % 2 ? wide[r] : m.weights[r];
        TEST_TW_OK(pass == 0 ? tw_moe_combine(m.comms[r], &a, (tw_stream_t)m.streams[r])
                             : tw_moe_gemm_combine(m.comms[r], &a, (tw_stream_t)m.streams[r]));
      }
      TEST_CUDA_OK(cudaDeviceSynchronize());
      for (int r = 0; r < 2; r++) {
        const size_t bytes = (size_t)m.tokens[r] * n * 2;
        if (pass == 0)
          TEST_CUDA_OK(cudaMemcpy(out_ref[r], m.out[r], bytes, cudaMemcpyDeviceToDevice));
        else
          bad += tw_test_count_diff(m.out[r], out_ref[r], bytes);
      }
    }
    TEST_ASSERT(bad == 0,
                "layer call %d (n_out %lld): %zu bytes of out differ from the unfused "
                "pipeline",
                call, (long long)n, bad);
  }
  for (int r = 0; r < 2; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(m.comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "layers: rank %d: %s", r, tw_comm_last_error(m.comms[r]));
    cudaFree(wide[r]), cudaFree(eout_ref[r]), cudaFree(out_ref[r]);
  }
  world_fini(&m);
}

static void test_routing_errors(void) {
  for (int which = 0; which < 2; which++) {
    world_t m;
    world_init(&m, 2, 4, 2, 64, 64, 256, which ? 130 : 4096, 32);
    uint64_t rng = 99;
    for (int r = 0; r < 2; r++)
      m.tokens[r] = 200;
    route(&m, kSkewed, &rng);
    if (which == 0) {
      m.h_idx[1][57] = 7; /* expert 7 of 4 */
      TEST_CUDA_OK(cudaMemcpy(m.idx[1], m.h_idx[1], 200 * 2 * 4, cudaMemcpyHostToDevice));
    }
    for (int r = 0; r < 2; r++) {
      tw_moe_args_t a = args_of(&m, r);
      TEST_TW_OK(tw_moe_dispatch(m.comms[r], &a, (tw_stream_t)m.streams[r]));
    }
    TEST_CUDA_OK(cudaDeviceSynchronize());
    for (int r = 0; r < 2; r++) {
      tw_status_t async = TW_SUCCESS;
      TEST_TW_OK(tw_comm_async_error(m.comms[r], &async));
      const char *msg = tw_comm_last_error(m.comms[r]);
      const char *needle =
          which == 0 ? "holds expert 7 at entry 57" : "whose args->recv_rows is 130";
      TEST_ASSERT(async == TW_ERR_INVALID_ARGUMENT && strstr(msg, needle), "rank %d: %s (%s)", r,
                  tw_status_string(async), msg);
      if (r == 0)
        printf("  %s: rank 0: %s\n", which == 0 ? "bad index" : "small recv", msg);
      uint16_t *h = (uint16_t *)malloc((size_t)m.recv_rows * 64 * 2);
      TEST_CUDA_OK(cudaMemcpy(h, m.recv[r], (size_t)m.recv_rows * 64 * 2, cudaMemcpyDeviceToHost));
      size_t written = 0;
      for (int64_t i = 0; i < m.recv_rows * 64; i++)
        written += h[i] != 0xffff;
      TEST_ASSERT(written == 0, "rank %d: %zu recv elements written after the error", r, written);
      free(h);
    }
    world_fini(&m);
  }
}

static void test_refusals(void) {
  world_t m;
  world_init(&m, 2, 4, 2, 64, 64, 16, 2048, 32);
  m.tokens[0] = m.tokens[1] = 4;
  tw_moe_args_t a;
  a = args_of(&m, 0), a.experts = 5;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->experts");
  a = args_of(&m, 0), a.top_k = 17;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->top_k");
  a = args_of(&m, 0), a.tokens = 17;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->tokens");
  a = args_of(&m, 0), a.hidden = 60;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->hidden");
  a = args_of(&m, 0), a.index_bits = 16;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->index_bits");
  a = args_of(&m, 0), a.recv = m.x[0]; /* not symmetric */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->recv");
  a = args_of(&m, 0), a.recv_rows = 4096; /* larger than the allocation */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->recv");
  a = args_of(&m, 0), a.workspace = m.x[0]; /* not symmetric */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->workspace");
  a = args_of(&m, 0), a.offsets = NULL;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->offsets");
  a = args_of(&m, 0), a.workspace = m.recv[0]; /* recv and the workspace overlap */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "overlaps workspace");
  a = args_of(&m, 0), a.out = m.eout[0];
  TEST_TW_FAILS(tw_moe_combine(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->out");
  a = args_of(&m, 0), a.size = 4;
  TEST_TW_FAILS(tw_moe_combine(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->size");
  world_fini(&m);
}

int main(void) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  tw_test_require_hopper();
  const uint64_t seed = tw_test_seed();
  test_layer(1, 8, 2, 256, 128, 300, 32, seed);
  test_layer(2, 8, 2, 512, 256, 260, 64, seed + 1);
  test_layer(3, 6, 1, 128, 136, 200, 32, seed + 2);
  test_layer(4, 32, 8, 256, 128, 150, 32, seed + 3);
  test_gemm_combine_layers(seed + 4);
  test_routing_errors();
  test_refusals();
  return tw_test_finish();
}
