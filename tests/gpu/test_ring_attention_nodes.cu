/*
 * tw_ring_attention and tw_ring_attention_backward across nodes, on virtual nodes of one GPU
 * (tw_config.ranks_per_node) over the verbs test double (both backends): the other nodes' shards
 * gathered by the rail path into `gathered`, then the ring's kernels. For layouts 2x1, 2x2, 3x2,
 * 2x3 and 4x2 (nodes x ranks a node), both shard layouts, causal and not, GQA and head_dim 64 /
 * 128, shards off the tiles: every rank's o, lse, dq, dk and dv equal, bitwise, the same call's on
 * one node of the same world (the in-node path, checked against references by
 * test_ring_attention and test_ring_attention_backward); two calls back to back alike; a NULL
 * `gathered` refused naming it. 77 without a Hopper GPU or without the double.
 */
#include <cuda_runtime.h>

#include <string.h>

#include "tw_test.h"

#ifndef TW_VERBS_DOUBLE
int main(void) {
  printf("built without rdma-core's headers: no inter-node backend to test\n");
  return 77;
}
#else

typedef struct {
  int nodes, per_node, layout, causal;
  int64_t batch, heads_q, heads_kv, seq, d;
} shape_t;

/* One world's buffers: the symmetric ones (q, k, v, dout, lse, workspace, gathered) and the
 * outputs, per rank. */
typedef struct {
  int world;
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *q[TW_MAX_WORLD], *k[TW_MAX_WORLD], *v[TW_MAX_WORLD], *dout[TW_MAX_WORLD];
  void *o[TW_MAX_WORLD], *dq[TW_MAX_WORLD], *dk[TW_MAX_WORLD], *dv[TW_MAX_WORLD];
  float *lse[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  void *fwd_gathered[TW_MAX_WORLD], *bwd_gathered[TW_MAX_WORLD];
  size_t q_bytes, kv_bytes, rows_bytes;
} world_t;

static void *sym(tw_comm_t c, size_t bytes) {
  void *p = NULL;
  TEST_REQUIRE(tw_mem_alloc(c, bytes ? bytes : 16, &p) == TW_SUCCESS, "alloc: %s",
               tw_comm_last_error(c));
  return p;
}

static void *dev(size_t bytes) {
  void *p = NULL;
  TEST_CUDA_OK(cudaMalloc(&p, bytes));
  return p;
}

/* per_node 0: one node. */
static void world_init(world_t *w, const shape_t *s, int per_node, uint64_t seed) {
  memset(w, 0, sizeof(*w));
  w->world = s->nodes * s->per_node;
  int devices[TW_MAX_WORLD] = {0};
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = per_node;
  TEST_REQUIRE(tw_comm_init_all(w->comms, w->world, devices, &cfg) == TW_SUCCESS, "init: %s",
               tw_last_error());
  w->q_bytes = (size_t)(s->batch * s->seq * s->heads_q * s->d) * 2;
  w->kv_bytes = (size_t)(s->batch * s->seq * s->heads_kv * s->d) * 2;
  w->rows_bytes = (size_t)(s->batch * s->heads_q * s->seq) * 4;
  for (int r = 0; r < w->world; r++) {
    tw_comm_t c = w->comms[r];
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&w->streams[r], cudaStreamNonBlocking));
    w->q[r] = sym(c, w->q_bytes), w->k[r] = sym(c, w->kv_bytes), w->v[r] = sym(c, w->kv_bytes);
    w->dout[r] = sym(c, w->q_bytes);
    w->lse[r] = (float *)sym(c, w->rows_bytes), w->ws[r] = (float *)sym(c, w->rows_bytes);
    size_t bwd = 0;
    TEST_TW_OK(tw_ring_attention_backward_gathered_bytes(c, s->batch, s->heads_q, s->heads_kv,
                                                         s->seq, s->d, &bwd));
    TEST_ASSERT((bwd > 0) == (per_node > 0), "gathered bytes %zu on %s", bwd,
                per_node ? "virtual nodes" : "one node");
    w->fwd_gathered[r] = per_node ? sym(c, 2 * (size_t)w->world * w->kv_bytes) : NULL;
    w->bwd_gathered[r] = per_node ? sym(c, bwd) : NULL;
    w->o[r] = dev(w->q_bytes), w->dq[r] = dev(w->q_bytes);
    w->dk[r] = dev(w->kv_bytes), w->dv[r] = dev(w->kv_bytes);
    tw_test_fill_bf16(w->q[r], w->q_bytes / 2, seed + 10 * r + 1, 0);
    tw_test_fill_bf16(w->k[r], w->kv_bytes / 2, seed + 10 * r + 2, 0);
    tw_test_fill_bf16(w->v[r], w->kv_bytes / 2, seed + 10 * r + 3, 0);
    tw_test_fill_bf16(w->dout[r], w->q_bytes / 2, seed + 10 * r + 4, 0);
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
}

static void world_fini(world_t *w) {
  TEST_CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < w->world; r++) {
    tw_comm_t c = w->comms[r];
    void *syms[8] = {
        w->q[r],           w->k[r], w->v[r], w->dout[r], w->lse[r], w->ws[r], w->fwd_gathered[r],
        w->bwd_gathered[r]};
    for (int i = 0; i < 8; i++)
      if (syms[i])
        TEST_TW_OK(tw_mem_free(c, syms[i]));
    cudaFree(w->o[r]), cudaFree(w->dq[r]), cudaFree(w->dk[r]), cudaFree(w->dv[r]);
    cudaStreamDestroy(w->streams[r]);
    TEST_TW_OK(tw_comm_destroy(c));
  }
}

/* The forward then the backward on every rank (outputs poisoned first); 1 when every call and
 * the comms' async state are fine. */
static int step(world_t *w, const shape_t *s) {
  for (int r = 0; r < w->world; r++) {
    tw_stream_t st = (tw_stream_t)w->streams[r];
    tw_test_poison(w->o[r], w->q_bytes, st), tw_test_poison(w->dq[r], w->q_bytes, st);
    tw_test_poison(w->dk[r], w->kv_bytes, st), tw_test_poison(w->dv[r], w->kv_bytes, st);
  }
  for (int r = 0; r < w->world; r++) {
    tw_ring_attention_args_t a = TW_RING_ATTENTION_ARGS_INIT;
    a.q = w->q[r], a.k = w->k[r], a.v = w->v[r], a.o = w->o[r], a.lse = w->lse[r];
    a.batch = s->batch, a.heads_q = s->heads_q, a.heads_kv = s->heads_kv, a.seq_local = s->seq;
    a.head_dim = s->d, a.causal = s->causal, a.layout = s->layout;
    a.gathered = w->fwd_gathered[r];
    tw_ring_attention_backward_args_t g = TW_RING_ATTENTION_BACKWARD_ARGS_INIT;
    g.q = a.q, g.k = a.k, g.v = a.v, g.o = a.o, g.lse = a.lse, g.dout = w->dout[r];
    g.dq = w->dq[r], g.dk = w->dk[r], g.dv = w->dv[r], g.workspace = w->ws[r];
    g.batch = a.batch, g.heads_q = a.heads_q, g.heads_kv = a.heads_kv, g.seq_local = a.seq_local;
    g.head_dim = a.head_dim, g.causal = a.causal, g.layout = a.layout;
    g.gathered = w->bwd_gathered[r];
    tw_stream_t st = (tw_stream_t)w->streams[r];
    if (tw_ring_attention(w->comms[r], &a, st) != TW_SUCCESS ||
        tw_ring_attention_backward(w->comms[r], &g, st) != TW_SUCCESS) {
      TEST_ASSERT(0, "rank %d: %s", r, tw_comm_last_error(w->comms[r]));
      return 0;
    }
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  int ok = 1;
  for (int r = 0; r < w->world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(w->comms[r], &async));
    ok &= async == TW_SUCCESS;
    TEST_ASSERT(async == TW_SUCCESS, "rank %d: %s", r, tw_comm_last_error(w->comms[r]));
  }
  return ok;
}

/* Bytes of a and b (device) equal. */
static int same(const void *a, const void *b, size_t bytes) {
  uint8_t *ha = (uint8_t *)malloc(bytes), *hb = (uint8_t *)malloc(bytes);
  TEST_CUDA_OK(cudaMemcpy(ha, a, bytes, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(hb, b, bytes, cudaMemcpyDeviceToHost));
  const int eq = memcmp(ha, hb, bytes) == 0;
  free(ha), free(hb);
  return eq;
}

static void test_shape(const shape_t *s, uint64_t seed) {
  world_t one, many;
  world_init(&one, s, 0, seed);
  world_init(&many, s, s->per_node, seed);
  char what[96];
  snprintf(what, sizeof(what), "%dx%d %s%s b%lld h%lld/%lld s%lld d%lld", s->nodes, s->per_node,
           s->layout == TW_RING_ZIGZAG ? "zigzag" : "contiguous", s->causal ? " causal" : "",
           (long long)s->batch, (long long)s->heads_q, (long long)s->heads_kv, (long long)s->seq,
           (long long)s->d);
  if (step(&one, s)) {
    for (int call = 0; call < 2 && step(&many, s); call++) {
      int eq = 1;
      for (int r = 0; r < one.world; r++) {
        const struct {
          const void *a, *b;
          size_t bytes;
          const char *name;
        } t[5] = {{one.o[r], many.o[r], one.q_bytes, "o"},
                  {one.lse[r], many.lse[r], one.rows_bytes, "lse"},
                  {one.dq[r], many.dq[r], one.q_bytes, "dq"},
                  {one.dk[r], many.dk[r], one.kv_bytes, "dk"},
                  {one.dv[r], many.dv[r], one.kv_bytes, "dv"}};
        for (int i = 0; i < 5; i++) {
          const int e = same(t[i].a, t[i].b, t[i].bytes);
          eq &= e;
          TEST_ASSERT(e, "%s: rank %d %s differs from the one-node call's", what, r, t[i].name);
        }
      }
      printf("  %-44s call %d: o, lse, dq, dk, dv %s the one-node call's\n", what, call,
             eq ? "bitwise" : "NOT");
    }
  }
  world_fini(&many);
  world_fini(&one);
}

/* Across nodes a NULL gathered is refused, naming it (forward and backward), on every rank. */
static void test_refusals(uint64_t seed) {
  const shape_t s = {2, 1, TW_RING_ZIGZAG, 1, 1, 4, 4, 64, 64};
  world_t w;
  world_init(&w, &s, 1, seed);
  for (int r = 0; r < w.world; r++) {
    tw_ring_attention_args_t a = TW_RING_ATTENTION_ARGS_INIT;
    a.q = w.q[r], a.k = w.k[r], a.v = w.v[r], a.o = w.o[r], a.lse = w.lse[r];
    a.batch = s.batch, a.heads_q = s.heads_q, a.heads_kv = s.heads_kv, a.seq_local = s.seq;
    a.head_dim = s.d, a.causal = 1;
    TEST_ASSERT(tw_ring_attention(w.comms[r], &a, (tw_stream_t)w.streams[r]) ==
                        TW_ERR_INVALID_ARGUMENT &&
                    strstr(tw_comm_last_error(w.comms[r]), "gathered"),
                "forward without gathered: %s", tw_comm_last_error(w.comms[r]));
    tw_ring_attention_backward_args_t g = TW_RING_ATTENTION_BACKWARD_ARGS_INIT;
    g.q = a.q, g.k = a.k, g.v = a.v, g.o = a.o, g.lse = a.lse, g.dout = w.dout[r];
    g.dq = w.dq[r], g.dk = w.dk[r], g.dv = w.dv[r], g.workspace = w.ws[r];
    g.batch = a.batch, g.heads_q = a.heads_q, g.heads_kv = a.heads_kv, g.seq_local = a.seq_local;
    g.head_dim = a.head_dim, g.causal = 1;
    TEST_ASSERT(tw_ring_attention_backward(w.comms[r], &g, (tw_stream_t)w.streams[r]) ==
                        TW_ERR_INVALID_ARGUMENT &&
                    strstr(tw_comm_last_error(w.comms[r]), "gathered"),
                "backward without gathered: %s", tw_comm_last_error(w.comms[r]));
  }
  TEST_ASSERT(step(&w, &s), "a valid call after the refusals");
  world_fini(&w);
}

static void run(const char *backend, uint64_t seed) {
  printf("backend %s\n", backend);
  const shape_t shapes[] = {
      {2, 1, TW_RING_ZIGZAG, 1, 1, 4, 4, 200, 64},     {2, 2, TW_RING_ZIGZAG, 1, 2, 8, 2, 150, 128},
      {2, 2, TW_RING_CONTIGUOUS, 0, 1, 4, 1, 77, 64},  {3, 2, TW_RING_ZIGZAG, 1, 1, 4, 4, 128, 128},
      {2, 3, TW_RING_CONTIGUOUS, 1, 1, 8, 2, 100, 64}, {4, 2, TW_RING_ZIGZAG, 1, 1, 8, 8, 64, 128},
  };
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
    test_shape(&shapes[i], seed + 100 * i);
  test_refusals(seed);
}

static void between(void) {}

int main(void) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0); /* 8 ranks' kernels on one GPU, before CUDA */
  tw_test_require_hopper();
  tw_test_on_both_backends(TW_VERBS_DOUBLE, run, between, tw_test_seed());
  return tw_test_finish();
}
#endif
