/*
 * tw_moe_dispatch and tw_moe_combine across nodes, on virtual nodes of one GPU
 * (tw_config.ranks_per_node) over the verbs test double: a token crosses to each other node that
 * holds one of its experts once, on its rank's rail, and the rail peer forwards it over NVLink;
 * the combine sums each node's slots there and sends one partial back. With tw_grouped_gemm
 * between them (the unfused MoE layer), for layouts 2x2, 2x4, 3x2 and 4x2 (nodes x ranks per
 * node), top-k 1, 2 and 8, random, skewed and empty-expert routings, int32 and int64 indices, a
 * rank with no tokens and every rank at the bound: every rank's recv and offsets are bitwise the
 * one-node layout, out is bitwise the host's node-then-slot-order sum and within bf16 tolerance of
 * an fp64 reference, and a repeated call gives the same out bit for bit; a CUDA graph of the
 * layer replayed with fresh routings; the fused calls (tw_moe_dispatch_gemm, tw_moe_gemm_combine,
 * both) in the unfused calls' places, their out bitwise the unfused layer's, and tw_moe_ffn
 * bitwise the unfused FFN across nodes (layouts 2x2, 3x2, 2x4); routing errors reported on every
 * rank with nothing copied; refusals of what across nodes does not serve. 77 without a Hopper GPU
 * or without the double (built with rdma-core's headers).
 */
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include "tw_test_moe.h"

#ifndef TW_VERBS_DOUBLE
int main(void) {
  printf("built without rdma-core's headers: no inter-node backend to test\n");
  return 77;
}
#else

static size_t out_bytes(const moe_world_t *m, int r) { return (size_t)m->tokens[r] * m->n * 2; }

/* Room for every slot of every rank plus each expert's padding. */
static int64_t rows_for(int world, int experts, int top_k, int64_t max_tokens) {
  const int local = experts / world;
  return max_tokens * world * (top_k < local ? top_k : local) + 127 * local + 128;
}

/* Four calls with fresh routings (random counts; skewed with the last rank empty; unused slots;
 * every rank at the bound), each checked; the last repeated, bitwise. */
static void test_layout(int nodes, int per_node, int experts, int top_k, int64_t hidden, int64_t n,
                        int64_t max_tokens, int index_bits, uint64_t seed) {
  moe_world_t m;
  const int world = nodes * per_node;
  moe_world_init(&m, world, per_node, experts, top_k, hidden, n, max_tokens,
                 rows_for(world, experts, top_k, max_tokens), index_bits);
  uint64_t rng = seed | 1;
  const int kinds[4] = {kMoeRandom, kMoeSkewed, kMoeHoles, kMoeRandom};
  const char *names[4] = {"random", "skewed, last rank empty", "unused slots", "all at the bound"};
  double best = 1e30;
  for (int it = 0; it < 4; it++) {
    for (int r = 0; r < world; r++)
      m.tokens[r] = it == 3 ? max_tokens
                    : it == 1 && r == world - 1
                        ? 0
                        : (int64_t)(tw_test_xorshift(&rng) % max_tokens) + 1;
    moe_route(&m, kinds[it], &rng);
    const double t0 = tw_test_now();
    moe_run_layer(&m);
    const double dt = tw_test_now() - t0;
    best = dt < best ? dt : best;
    char what[160];
    snprintf(what, sizeof(what), "%dx%d, %d experts, top-%d, hidden %lld, n %lld, int%d, %s", nodes,
             per_node, experts, top_k, (long long)hidden, (long long)n, index_bits, names[it]);
    moe_check_layer(&m, what);
  }
  void *first[TW_MAX_WORLD];
  for (int r = 0; r < world; r++) {
    TEST_CUDA_OK(cudaMalloc(&first[r], out_bytes(&m, r)));
    TEST_CUDA_OK(cudaMemcpy(first[r], m.out[r], out_bytes(&m, r), cudaMemcpyDeviceToDevice));
    tw_test_poison(m.out[r], out_bytes(&m, r), 0);
  }
  moe_run_layer(&m);
  size_t diff = 0;
  for (int r = 0; r < world; r++) {
    diff += tw_test_count_diff(m.out[r], first[r], out_bytes(&m, r));
    cudaFree(first[r]);
  }
  TEST_ASSERT(diff == 0, "%dx%d: a repeated call's out differs in %zu bytes", nodes, per_node,
              diff);
  printf("  %dx%d %d experts top-%d hidden %lld n %lld int%d: 5 calls, best layer %.2f ms\n", nodes,
         per_node, experts, top_k, (long long)hidden, (long long)n, index_bits, best * 1e3);
  moe_world_fini(&m);
}

/* The layer with fused calls on every rank's stream (expert_out poisoned first, so the fused
 * GEMM must write it), then a sync: mode 0 tw_moe_dispatch_gemm then tw_moe_combine; 1
 * tw_moe_dispatch then tw_moe_gemm_combine; 2 tw_moe_dispatch_gemm then tw_moe_gemm_combine. */
static const char *const kModes[3] = {"dispatch_gemm + combine", "dispatch + gemm_combine",
                                      "dispatch_gemm + gemm_combine"};
static void run_fused_layer(moe_world_t *m, int mode) {
  for (int r = 0; r < m->world; r++)
    tw_test_poison(m->eout[r], (size_t)m->recv_rows * m->n * 2, (tw_stream_t)m->streams[r]);
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = moe_args_of(m, r);
    a.weights = m->weights[r];
    const tw_stream_t s = (tw_stream_t)m->streams[r];
    TEST_TW_OK(mode == 1 ? tw_moe_dispatch(m->comms[r], &a, s)
                         : tw_moe_dispatch_gemm(m->comms[r], &a, s));
  }
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = moe_args_of(m, r);
    a.weights = m->weights[r];
    const tw_stream_t s = (tw_stream_t)m->streams[r];
    TEST_TW_OK(mode == 0 ? tw_moe_combine(m->comms[r], &a, s)
                         : tw_moe_gemm_combine(m->comms[r], &a, s));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

/* The fused calls across nodes: per routing the unfused layer first (its out kept), then for
 * each mode of run_fused_layer recv and out poisoned again and the layer with the fused calls:
 * recv, offsets and out checked as the unfused layer's (moe_check_layer), and out bitwise the
 * unfused layer's. */
static void test_fused(int nodes, int per_node, int experts, int top_k, int64_t hidden, int64_t n,
                       int64_t max_tokens, uint64_t seed) {
  moe_world_t m;
  const int world = nodes * per_node;
  moe_world_init(&m, world, per_node, experts, top_k, hidden, n, max_tokens,
                 rows_for(world, experts, top_k, max_tokens), 32);
  uint64_t rng = seed | 1;
  const int kinds[3] = {kMoeRandom, kMoeSkewed, kMoeHoles};
  void *first[TW_MAX_WORLD];
  for (int r = 0; r < world; r++)
    TEST_CUDA_OK(cudaMalloc(&first[r], (size_t)max_tokens * n * 2 + 16));
  for (int it = 0; it < 3; it++) {
    for (int r = 0; r < world; r++)
      m.tokens[r] = it == 1 && r == 0 ? 0 : (int64_t)(tw_test_xorshift(&rng) % max_tokens) + 1;
    moe_route(&m, kinds[it], &rng);
    moe_run_layer(&m);
    for (int r = 0; r < world; r++)
      TEST_CUDA_OK(cudaMemcpy(first[r], m.out[r], out_bytes(&m, r), cudaMemcpyDeviceToDevice));
    for (int mode = 0; mode < 3; mode++) {
      for (int r = 0; r < world; r++) {
        tw_test_poison(m.out[r], out_bytes(&m, r), 0);
        tw_test_poison(m.recv[r], (size_t)m.recv_rows * hidden * 2, 0);
      }
      run_fused_layer(&m, mode);
      char what[160];
      snprintf(what, sizeof(what), "%s %dx%d, %d experts, top-%d, hidden %lld, n %lld, routing %d",
               kModes[mode], nodes, per_node, experts, top_k, (long long)hidden, (long long)n, it);
      moe_check_layer(&m, what);
      size_t diff = 0;
      for (int r = 0; r < world; r++)
        diff += tw_test_count_diff(m.out[r], first[r], out_bytes(&m, r));
      TEST_ASSERT(diff == 0, "%s: out differs from the unfused layer's in %zu bytes", what, diff);
    }
  }
  for (int r = 0; r < world; r++)
    cudaFree(first[r]);
  printf("  fused calls %dx%d %d experts top-%d hidden %lld n %lld: 3 routings x 3 modes checked\n",
         nodes, per_node, experts, top_k, (long long)hidden, (long long)n);
  moe_world_fini(&m);
}

/* tw_moe_ffn's buffers beside a moe_world_t whose n is its hidden (expert_out [recv_rows,
 * hidden]): h, act and each rank's gate/up and down weights. */
typedef struct {
  int64_t inter;
  void *h[TW_MAX_WORLD], *act[TW_MAX_WORLD], *w13[TW_MAX_WORLD], *w2[TW_MAX_WORLD];
} ffn_bufs_t;

static tw_moe_args_t ffn_args(const moe_world_t *m, const ffn_bufs_t *f, int r) {
  tw_moe_args_t a = moe_args_of(m, r);
  a.weights = f->w13[r], a.weights2 = f->w2[r], a.h = f->h[r], a.act = f->act[r];
  a.inter = f->inter;
  return a;
}

/* The unfused FFN across nodes on every rank's stream: tw_moe_dispatch, tw_grouped_gemm (gate and
 * up), tw_swiglu, tw_grouped_gemm (down), tw_moe_combine; then a sync. */
static void run_ffn_unfused(moe_world_t *m, const ffn_bufs_t *f) {
  const int local = m->experts / m->world;
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = ffn_args(m, f, r);
    TEST_TW_OK(tw_moe_dispatch(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  for (int r = 0; r < m->world; r++) {
    const tw_stream_t s = (tw_stream_t)m->streams[r];
    tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
    g.a = m->recv[r], g.b = f->w13[r], g.out = f->h[r], g.offsets = m->offsets[r];
    g.m = m->recv_rows, g.n = 2 * f->inter, g.k = m->hidden, g.groups = local;
    TEST_TW_OK(tw_grouped_gemm(&g, s));
    TEST_TW_OK(tw_swiglu(f->h[r], f->act[r], m->recv_rows, f->inter, s));
    g.a = f->act[r], g.b = f->w2[r], g.out = m->eout[r];
    g.n = m->hidden, g.k = f->inter;
    TEST_TW_OK(tw_grouped_gemm(&g, s));
  }
  for (int r = 0; r < m->world; r++) {
    tw_moe_args_t a = ffn_args(m, f, r);
    TEST_TW_OK(tw_moe_combine(m->comms[r], &a, (tw_stream_t)m->streams[r]));
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

/* tw_moe_ffn across nodes against the unfused FFN across nodes: per routing (random, skewed
 * with a rank of no tokens, unused slots) out and offsets bitwise the pipeline's, and a second
 * fused call bitwise the first. */
static void test_ffn(int nodes, int per_node, int experts, int top_k, int64_t hidden, int64_t inter,
                     int64_t max_tokens, uint64_t seed) {
  moe_world_t m;
  ffn_bufs_t f;
  const int world = nodes * per_node, local = experts / world;
  const int64_t R = rows_for(world, experts, top_k, max_tokens);
  moe_world_init(&m, world, per_node, experts, top_k, hidden, hidden, max_tokens, R, 32);
  f.inter = inter;
  for (int r = 0; r < world; r++) {
    TEST_CUDA_OK(cudaMalloc(&f.h[r], (size_t)R * inter * 4));
    TEST_CUDA_OK(cudaMalloc(&f.act[r], (size_t)R * inter * 2));
    TEST_CUDA_OK(cudaMalloc(&f.w13[r], (size_t)local * 2 * inter * hidden * 2));
    TEST_CUDA_OK(cudaMalloc(&f.w2[r], (size_t)local * hidden * inter * 2));
    tw_test_fill_bf16(f.w13[r], (size_t)local * 2 * inter * hidden, 700 + r, 0);
    tw_test_fill_bf16(f.w2[r], (size_t)local * hidden * inter, 800 + r, 0);
  }
  uint64_t rng = seed | 1;
  const int kinds[3] = {kMoeRandom, kMoeSkewed, kMoeHoles};
  void *first[TW_MAX_WORLD];
  int32_t *offs[TW_MAX_WORLD];
  for (int r = 0; r < world; r++) {
    TEST_CUDA_OK(cudaMalloc(&first[r], (size_t)max_tokens * hidden * 2 + 16));
    TEST_CUDA_OK(cudaMalloc((void **)&offs[r], (size_t)(local + 1) * 4));
  }
  for (int it = 0; it < 3; it++) {
    for (int r = 0; r < world; r++)
      m.tokens[r] = it == 1 && r == 0 ? 0 : (int64_t)(tw_test_xorshift(&rng) % max_tokens) + 1;
    moe_route(&m, kinds[it], &rng);
    run_ffn_unfused(&m, &f);
    for (int r = 0; r < world; r++) {
      TEST_CUDA_OK(cudaMemcpy(first[r], m.out[r], out_bytes(&m, r), cudaMemcpyDeviceToDevice));
      TEST_CUDA_OK(
          cudaMemcpy(offs[r], m.offsets[r], (size_t)(local + 1) * 4, cudaMemcpyDeviceToDevice));
    }
    for (int rep = 0; rep < 2; rep++) {
      for (int r = 0; r < world; r++) {
        tw_test_poison(m.out[r], out_bytes(&m, r), 0);
        tw_test_poison(m.offsets[r], (size_t)(local + 1) * 4, 0);
        tw_test_poison(m.eout[r], (size_t)R * hidden * 2, 0);
      }
      for (int r = 0; r < world; r++) {
        tw_moe_args_t a = ffn_args(&m, &f, r);
        TEST_TW_OK(tw_moe_ffn(m.comms[r], &a, (tw_stream_t)m.streams[r]));
      }
      TEST_CUDA_OK(cudaDeviceSynchronize());
      size_t diff = 0, odiff = 0;
      for (int r = 0; r < world; r++) {
        diff += tw_test_count_diff(m.out[r], first[r], out_bytes(&m, r));
        odiff += tw_test_count_diff(m.offsets[r], offs[r], (size_t)(local + 1) * 4);
      }
      for (int r = 0; r < world; r++) {
        tw_status_t async = TW_SUCCESS;
        TEST_TW_OK(tw_comm_async_error(m.comms[r], &async));
        TEST_ASSERT(async == TW_SUCCESS, "tw_moe_ffn %dx%d: rank %d: %s", nodes, per_node, r,
                    tw_comm_last_error(m.comms[r]));
      }
      TEST_ASSERT(diff == 0 && odiff == 0,
                  "tw_moe_ffn %dx%d, %d experts, top-%d, hidden %lld, inter %lld, routing %d, "
                  "call %d: out differs from the unfused FFN's in %zu bytes, offsets in %zu",
                  nodes, per_node, experts, top_k, (long long)hidden, (long long)inter, it, rep,
                  diff, odiff);
    }
  }
  for (int r = 0; r < world; r++) {
    cudaFree(first[r]), cudaFree(offs[r]);
    cudaFree(f.h[r]), cudaFree(f.act[r]), cudaFree(f.w13[r]), cudaFree(f.w2[r]);
  }
  printf("  tw_moe_ffn %dx%d %d experts top-%d hidden %lld inter %lld: 3 routings x 2 calls\n",
         nodes, per_node, experts, top_k, (long long)hidden, (long long)inter);
  moe_world_fini(&m);
}

/* One graph per rank of dispatch, grouped GEMM and combine, replayed with fresh routings of the
 * same token counts: the device epochs carry on and every replay checks. */
static void test_graph(int nodes, int per_node, int replays, uint64_t seed) {
  moe_world_t m;
  const int world = nodes * per_node, experts = 4 * world, local = 4;
  moe_world_init(&m, world, per_node, experts, 2, 256, 128, 128, rows_for(world, experts, 2, 128),
                 32);
  uint64_t rng = seed | 1;
  for (int r = 0; r < world; r++)
    m.tokens[r] = 100 + 7 * r;
  cudaGraphExec_t exec[TW_MAX_WORLD];
  for (int r = 0; r < world; r++) {
    cudaGraph_t g;
    TEST_CUDA_OK(cudaStreamBeginCapture(m.streams[r], cudaStreamCaptureModeThreadLocal));
    tw_moe_args_t a = moe_args_of(&m, r);
    TEST_TW_OK(tw_moe_dispatch(m.comms[r], &a, (tw_stream_t)m.streams[r]));
    tw_grouped_gemm_args_t gg = TW_GROUPED_GEMM_ARGS_INIT;
    gg.a = m.recv[r], gg.b = m.weights[r], gg.out = m.eout[r], gg.offsets = m.offsets[r];
    gg.m = m.recv_rows, gg.n = m.n, gg.k = m.hidden, gg.groups = local;
    TEST_TW_OK(tw_grouped_gemm(&gg, (tw_stream_t)m.streams[r]));
    TEST_TW_OK(tw_moe_combine(m.comms[r], &a, (tw_stream_t)m.streams[r]));
    TEST_CUDA_OK(cudaStreamEndCapture(m.streams[r], &g));
    TEST_CUDA_OK(cudaGraphInstantiate(&exec[r], g, 0));
    cudaGraphDestroy(g);
  }
  for (int i = 0; i < replays; i++) {
    moe_route(&m, i % 2 ? kMoeSkewed : kMoeRandom, &rng);
    for (int r = 0; r < world; r++)
      TEST_CUDA_OK(cudaGraphLaunch(exec[r], m.streams[r]));
    TEST_CUDA_OK(cudaDeviceSynchronize());
    char what[64];
    snprintf(what, sizeof(what), "graph %dx%d, replay %d", nodes, per_node, i);
    moe_check_layer(&m, what);
  }
  printf("  graph %dx%d: %d replays checked\n", nodes, per_node, replays);
  for (int r = 0; r < world; r++)
    cudaGraphExecDestroy(exec[r]);
  moe_world_fini(&m);
}

static void run(const char *backend, uint64_t seed) {
  printf("backend %s:\n", backend);
  test_layout(2, 2, 8, 2, 256, 128, 300, 32, seed);
  test_layout(2, 4, 16, 1, 512, 256, 260, 64, seed + 1);
  test_layout(3, 2, 12, 2, 128, 136, 200, 32, seed + 2); /* an odd number of nodes */
  test_layout(4, 2, 32, 8, 256, 128, 150, 32, seed + 3);
  test_graph(2, 2, 3, seed + 4);
  test_fused(2, 2, 8, 2, 256, 256, 300, seed + 5);
  test_fused(3, 2, 12, 8, 512, 136, 200, seed + 6); /* odd nodes, top-8, an n tail */
  test_fused(2, 4, 16, 1, 128, 512, 260, seed + 7);
  test_ffn(2, 2, 8, 2, 256, 384, 300, seed + 8);
  test_ffn(3, 2, 12, 8, 128, 200, 200, seed + 9); /* odd nodes, top-8, an inter tail */
  test_ffn(2, 4, 16, 1, 512, 256, 130, seed + 10);
  for (int which = 0; which < 2; which++)
    moe_test_routing_error(4, 2, which);
}

/* What across nodes refuses: a workspace sized without the row width, a call wider than its
 * workspace was sized for, nodes of unequal size. */
static void test_refusals(void) {
  moe_world_t m;
  moe_world_init(&m, 4, 2, 8, 2, 64, 64, 4096, 2048, 32);
  m.tokens[0] = 4;
  tw_moe_args_t a = moe_args_of(&m, 0);
  a.weights = m.weights[0];
  size_t bytes = 0;
  TEST_TW_FAILS(tw_moe_workspace_size(m.comms[0], 4096, 0, 8, 2, &bytes), TW_ERR_INVALID_ARGUMENT,
                "hidden");
  TEST_TW_FAILS(tw_moe_workspace_size(m.comms[0], 4096, 100, 8, 2, &bytes), TW_ERR_INVALID_ARGUMENT,
                "hidden");
  a = moe_args_of(&m, 0);
  a.hidden = 4096, a.recv_rows = 32; /* recv still fits; the staged rows do not */
  TEST_TW_FAILS(tw_moe_dispatch(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->workspace");
  a = moe_args_of(&m, 0);
  a.n_out = 4096, a.recv_rows = 32; /* expert_out still fits; the staged partials do not */
  TEST_TW_FAILS(tw_moe_combine(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT, "args->workspace");
  a.grad = m.out[0], a.expert_grad = m.recv[0]; /* the staged gradient rows do not fit either */
  TEST_TW_FAILS(tw_moe_combine_backward(m.comms[0], &a, 0), TW_ERR_INVALID_ARGUMENT,
                "args->workspace");
  moe_world_fini(&m);
  moe_world_t u; /* nodes {0..3}, {4, 5} */
  moe_world_init(&u, 6, 4, 12, 2, 64, 64, 16, 2048, 32);
  u.tokens[0] = 4;
  a = moe_args_of(&u, 0);
  TEST_TW_FAILS(tw_moe_dispatch(u.comms[0], &a, 0), TW_ERR_NOT_SUPPORTED,
                "as many ranks on every node");
  moe_world_fini(&u);
}

int main(void) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0); /* 8 ranks' kernels on one GPU, before CUDA */
  tw_test_require_hopper();
  tw_test_on_both_backends(TW_VERBS_DOUBLE, run, test_refusals, tw_test_seed());
  return tw_test_finish();
}
#endif
