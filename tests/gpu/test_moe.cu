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

#include "tw_test_moe.h"

/* tw_moe_dispatch_gemm (then the combine) against the unfused pipeline just run: recv and the
 * offsets bitwise, expert_out's live rows bitwise, out bitwise. */
static void check_fused(moe_world_t *m, const char *what) {
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
    tw_moe_args_t a = moe_args_of(m, r);
    a.weights = m->weights[r];
    TEST_TW_OK(tw_moe_dispatch_gemm(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < W; r++) {
    tw_moe_args_t a = moe_args_of(m, r);
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
    tw_moe_args_t a = moe_args_of(m, r);
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
  moe_world_t m;
  /* room for every slot of every rank plus each expert's padding */
  const int local = experts / world;
  const int64_t rows = max_tokens * world * (top_k < local ? top_k : local) + 127 * local + 128;
  moe_world_init(&m, world, world, experts, top_k, hidden, n, max_tokens, rows, index_bits);
  uint64_t rng = seed | 1;
  const int kinds[3] = {kMoeRandom, kMoeSkewed, kMoeHoles};
  for (int it = 0; it < 3; it++) {
    for (int r = 0; r < world; r++) /* ranks with different counts; the last may have none */
      m.tokens[r] = r == world - 1 && world > 1 && it == 1
                        ? 0
                        : (int64_t)(tw_test_xorshift(&rng) % (uint64_t)max_tokens) + 1;
    moe_route(&m, kinds[it], &rng);
    moe_run_layer(&m);
    char what[128];
    snprintf(what, sizeof(what), "world %d, %d experts, top-%d, hidden %lld, n %lld, %s, call %d",
             world, experts, top_k, (long long)hidden, (long long)n,
             it == 0   ? "random"
             : it == 1 ? "skewed"
                       : "with unused slots",
             it);
    moe_check_layer(&m, what);
    check_fused(&m, what);
  }
  moe_world_fini(&m);
}

/* tw_moe_gemm_combine as two layers of one comm would call it: after each dispatch, calls of
 * another n_out (and so another count of column blocks) in turn, each bitwise tw_grouped_gemm +
 * tw_moe_combine; its block counters must stay exact across them. */
static void test_gemm_combine_layers(uint64_t seed) {
  moe_world_t m;
  const int64_t n_big = 640; /* 3 column blocks of 256 against the world's n of 128: 1 */
  moe_world_init(&m, 2, 2, 4, 2, 128, n_big, 200, 2048, 32);
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
    moe_route(&m, call % 2 ? kMoeSkewed : kMoeRandom, &rng);
    for (int r = 0; r < 2; r++) {
      tw_moe_args_t a = moe_args_of(&m, r);
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
        tw_moe_args_t a = moe_args_of(&m, r);
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
        tw_moe_args_t a = moe_args_of(&m, r);
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
  moe_world_fini(&m);
}

static void test_refusals(void) {
  moe_world_t m;
  moe_world_init(&m, 2, 2, 4, 2, 64, 64, 16, 2048, 32);
  m.tokens[0] = m.tokens[1] = 4;
  tw_moe_args_t a;
  a = moe_args_of(&m, 0), a.experts = 5;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->experts");
  a = moe_args_of(&m, 0), a.top_k = 17;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->top_k");
  a = moe_args_of(&m, 0), a.tokens = 17;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->tokens");
  a = moe_args_of(&m, 0), a.hidden = 60;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->hidden");
  a = moe_args_of(&m, 0), a.index_bits = 16;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->index_bits");
  a = moe_args_of(&m, 0), a.recv = m.x[0]; /* not symmetric */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->recv");
  a = moe_args_of(&m, 0), a.recv_rows = 4096; /* larger than the allocation */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->recv");
  a = moe_args_of(&m, 0), a.workspace = m.x[0]; /* not symmetric */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->workspace");
  a = moe_args_of(&m, 0), a.offsets = NULL;
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->offsets");
  a = moe_args_of(&m, 0), a.workspace = m.recv[0]; /* recv and the workspace overlap */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "overlaps workspace");
  a = moe_args_of(&m, 0), a.out = m.eout[0];
  TEST_TW_FAILS(tw_moe_combine(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->out");
  a = moe_args_of(&m, 0), a.size = 4;
  TEST_TW_FAILS(tw_moe_combine(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->size");
  moe_world_fini(&m);
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
  moe_test_routing_error(2, 2, 0);
  moe_test_routing_error(2, 2, 1);
  test_refusals();
  return tw_test_finish();
}
