/*
 * The unfused MoE layer and its host check (tw_test_moe.h).
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tw_test_moe.h"

void moe_world_init(moe_world_t *m, int world, int per_node, int experts, int top_k, int64_t hidden,
                    int64_t n, int64_t max_tokens, int64_t recv_rows, int index_bits) {
  memset(m, 0, sizeof(*m));
  m->world = world, m->per_node = per_node, m->experts = experts, m->top_k = top_k;
  m->index_bits = index_bits;
  m->hidden = hidden, m->n = n, m->max_tokens = max_tokens, m->recv_rows = recv_rows;
  int devices[TW_MAX_WORLD] = {0};
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = per_node < world ? per_node : 0;
  TEST_REQUIRE(tw_comm_init_all(m->comms, world, devices, &cfg) == TW_SUCCESS, "init %d/%d: %s",
               world, per_node, tw_last_error());
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_moe_workspace_size(m->comms[0], max_tokens, hidden > n ? hidden : n, experts, top_k,
                                   &ws_bytes));
  const int local = experts / world;
  const int64_t T = max_tokens ? max_tokens : 1;
  for (int r = 0; r < world; r++) {
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&m->streams[r], cudaStreamNonBlocking));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], ws_bytes, &m->ws[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], (size_t)recv_rows * hidden * 2, &m->recv[r]));
    TEST_TW_OK(tw_mem_alloc(m->comms[r], (size_t)recv_rows * n * 2, &m->eout[r]));
    TEST_CUDA_OK(cudaMalloc(&m->x[r], (size_t)T * hidden * 2));
    TEST_CUDA_OK(cudaMalloc(&m->idx[r], (size_t)T * top_k * 8));
    TEST_CUDA_OK(cudaMalloc(&m->w[r], (size_t)T * top_k * 4));
    TEST_CUDA_OK(cudaMalloc(&m->out[r], (size_t)T * n * 2));
    TEST_CUDA_OK(cudaMalloc(&m->weights[r], (size_t)local * n * hidden * 2));
    TEST_CUDA_OK(cudaMalloc((void **)&m->offsets[r], (size_t)(local + 1) * 4));
    m->h_idx[r] = (int32_t *)malloc((size_t)(max_tokens + 1) * top_k * 4);
    m->h_w[r] = (float *)malloc((size_t)(max_tokens + 1) * top_k * 4);
    TEST_REQUIRE(m->h_idx[r] && m->h_w[r], "host memory");
    tw_test_fill_bf16(m->weights[r], (size_t)local * n * hidden, 900 + r, 0);
  }
}

void moe_world_fini(moe_world_t *m) {
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

int32_t moe_pick_expert(const int32_t *chosen, int j, int experts, int top_k, int skewed,
                        uint64_t *rng, int (*allowed)(const void *ctx, int32_t e),
                        const void *ctx) {
  const int hot = top_k + 1 < experts ? top_k + 1 : experts;
  for (;;) {
    const uint64_t u = tw_test_xorshift(rng);
    const int32_t e = skewed && u % 4 != 0 ? (int32_t)(u / 4 % (uint64_t)hot)
                                           : (int32_t)(u / 4 % (uint64_t)experts);
    int fresh = allowed ? allowed(ctx, e) : 1;
    for (int q = 0; q < j; q++)
      fresh &= chosen[q] != e;
    if (fresh)
      return e;
  }
}

void moe_fill_routing(int32_t *idx, float *w, int64_t T, int experts, int top_k, int skewed,
                      int holes, uint64_t *rng) {
  for (int64_t t = 0; t < T; t++)
    for (int j = 0; j < top_k; j++) {
      int32_t e = moe_pick_expert(idx + t * top_k, j, experts, top_k, skewed, rng, NULL, NULL);
      if (holes && tw_test_xorshift(rng) % 5 == 0)
        e = -1;
      idx[t * top_k + j] = e;
      w[t * top_k + j] = (float)(tw_test_xorshift(rng) % 1000) / 1000.0f;
    }
}

void moe_route(moe_world_t *m, int kind, uint64_t *rng) {
  for (int r = 0; r < m->world; r++) {
    const int64_t T = m->tokens[r];
    moe_fill_routing(m->h_idx[r], m->h_w[r], T, m->experts, m->top_k, kind == kMoeSkewed,
                     kind == kMoeHoles, rng);
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

tw_moe_args_t moe_args_of(const moe_world_t *m, int r) {
  tw_moe_args_t a = TW_MOE_ARGS_INIT;
  a.index_bits = m->index_bits;
  a.x = m->x[r], a.topk_idx = m->idx[r], a.topk_weights = (const float *)m->w[r];
  a.recv = m->recv[r], a.offsets = m->offsets[r], a.expert_out = m->eout[r], a.out = m->out[r];
  a.workspace = m->ws[r];
  a.tokens = m->tokens[r], a.max_tokens = m->max_tokens, a.hidden = m->hidden, a.n_out = m->n;
  a.experts = m->experts, a.top_k = m->top_k, a.recv_rows = m->recv_rows;
  return a;
}

void moe_run_layer(moe_world_t *m) {
  const int local = m->experts / m->world;
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = moe_args_of(m, r);
    TEST_TW_OK(tw_moe_dispatch(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < m->world; r++) {
    tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
    g.a = m->recv[r], g.b = m->weights[r], g.out = m->eout[r], g.offsets = m->offsets[r];
    g.m = m->recv_rows, g.n = m->n, g.k = m->hidden, g.groups = local;
    TEST_TW_OK(tw_grouped_gemm(&g, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = moe_args_of(m, r);
    TEST_TW_OK(tw_moe_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static float bf(uint16_t h) { return tw_test_bf16_to_float(h); }

void moe_check_layer(moe_world_t *m, const char *what) {
  const int W = m->world, local = m->experts / W, P = m->per_node, nodes = W / P;
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
  TEST_REQUIRE(out, "host memory");
  size_t out_bad = 0;
  double err = 0, scale = 0;
  for (int r = 0; r < W; r++) {
    TEST_CUDA_OK(cudaMemcpy(out, m->out[r], (size_t)m->tokens[r] * N * 2, cudaMemcpyDeviceToHost));
    const int home = r / P;
    for (int64_t t = 0; t < m->tokens[r]; t++)
      for (int64_t c = 0; c < N; c++) {
        float acc = 0;
        for (int q0 = 0; q0 < nodes; q0++) {
          const int q = q0 == 0 ? home : q0 <= home ? q0 - 1 : q0; /* home first, then in order */
          float part = 0;
          int any = 0;
          for (int j = 0; j < m->top_k; j++) {
            const int e = m->h_idx[r][t * m->top_k + j];
            if (e < 0 || e / local / P != q)
              continue;
            const int64_t at = row_of[r][t * m->top_k + j];
            part = fmaf(m->h_w[r][t * m->top_k + j],
                        bf(eout[at >> 40][(at & ((1ll << 40) - 1)) * N + c]), part);
            any = 1;
          }
          if (q == home)
            acc = part;
          else if (any)
            acc = fmaf(1.0f, bf(tw_test_float_to_bf16(part)), acc);
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
  free(recv), free(eout), free(x), free(row_of), free(out);
}

void moe_test_routing_error(int world, int per_node, int which) {
  moe_world_t m;
  const int experts = 2 * world;
  moe_world_init(&m, world, per_node, experts, 2, 64, 64, 256, which ? 130 : 4096, 32);
  uint64_t rng = 99;
  for (int r = 0; r < world; r++)
    m.tokens[r] = 200;
  moe_route(&m, kMoeSkewed, &rng);
  if (which == 0) {
    m.h_idx[1][57] = experts + 3;
    TEST_CUDA_OK(cudaMemcpy(m.idx[1], m.h_idx[1], 200 * 2 * 4, cudaMemcpyHostToDevice));
  }
  for (int r = 0; r < world; r++) {
    tw_moe_args_t a = moe_args_of(&m, r);
    TEST_TW_OK(tw_moe_dispatch(m.comms[r], &a, (tw_stream_t)m.streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  char needle[64];
  if (which == 0)
    snprintf(needle, sizeof(needle), "holds expert %d at entry 57", experts + 3);
  else
    snprintf(needle, sizeof(needle), "whose args->recv_rows is 130");
  for (int r = 0; r < world; r++) {
    tw_status_t async = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(m.comms[r], &async));
    const char *msg = tw_comm_last_error(m.comms[r]);
    TEST_ASSERT(async == TW_ERR_INVALID_ARGUMENT && strstr(msg, needle), "rank %d: %s (%s)", r,
                tw_status_string(async), msg);
    if (r == 0)
      printf("  %s, world %d in nodes of %d: rank 0: %s\n", which == 0 ? "bad index" : "small recv",
             world, per_node, msg);
    uint16_t *h = (uint16_t *)malloc((size_t)m.recv_rows * 64 * 2);
    TEST_REQUIRE(h, "host memory");
    TEST_CUDA_OK(cudaMemcpy(h, m.recv[r], (size_t)m.recv_rows * 64 * 2, cudaMemcpyDeviceToHost));
    size_t written = 0;
    for (int64_t i = 0; i < m.recv_rows * 64; i++)
      written += h[i] != 0xffff;
    TEST_ASSERT(written == 0, "rank %d: %zu recv elements written after the error", r, written);
    free(h);
  }
  moe_world_fini(&m);
}
