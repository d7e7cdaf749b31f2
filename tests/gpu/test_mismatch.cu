/*
 * Ranks that disagree on a collective call (runtime/calldesc.h), and a rank that never calls.
 * Three virtual ranks (one process; with TW_TEST_DEVICES=distinct, one GPU each where there are
 * enough), a fresh comm per case, every output poisoned first. In each disagreeing case every
 * rank calls (the call is accepted: each rank's arguments are valid on their own); the kernels
 * then end well within the wait bound, every rank's tw_comm_async_error is TW_ERR_MISMATCH, its
 * message names the op and the first field that differs with both values, and no output a peer
 * writes into was written. The cases:
 *   - tw_gemm_rs with another n on rank 1, tw_gemm_ar with another symmetric workspace on rank 2;
 *   - the unfused pipeline (decode shapes, the low-latency area): tw_gemm_rs with another m,
 *     tw_gemm_ar with another n;
 *   - rank 1 calling tw_gemm_ar while its peers call tw_gemm_rs (the message names both ops);
 *   - tw_allgather (the SM push and the low-latency path) with other bytes on rank 1;
 *   - tw_ag_gemm with another a_gathered on rank 2;
 *   - tw_moe_dispatch (its count exchange through the low-latency area) with another hidden on
 *     rank 1: neither recv nor offsets written anywhere;
 *   - tw_gemm_rs with another n on rank 1, each rank's call captured into a CUDA graph (the
 *     description rides in the captured kernels' parameters).
 * Then a rank that never calls (tw_gemm_rs fused, tw_ag_gemm, tw_allgather): the others report
 * TW_ERR_DEVICE_TIMEOUT (or TW_ERR_ABORTED) after the wait bound, naming it as the rank that had
 * not entered the call, and every stream completes. Last, a comm made after all of these runs a
 * good call without an error. After a failure a comm's next call fails at once on the host with
 * the recorded status.
 */
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include "tw_test.h"

enum { kWorld = 3 };
static const int kBoundMs = 2000; /* TW_WAIT_TIMEOUT_MS for every case */

typedef struct {
  int devices[kWorld];
  tw_comm_t comms[kWorld];
  cudaStream_t streams[kWorld];
} world_t;

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  TEST_REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess, "cudaMalloc(%zu)", bytes);
  return p;
}

static void world_init(world_t *w) {
  tw_test_devices(kWorld, w->devices);
  TEST_REQUIRE(tw_comm_init_all(w->comms, kWorld, w->devices, NULL) == TW_SUCCESS, "init_all: %s",
               tw_last_error());
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w->devices[r]);
    TEST_REQUIRE(cudaStreamCreateWithFlags(&w->streams[r], cudaStreamNonBlocking) == cudaSuccess,
                 "stream");
  }
  cudaSetDevice(w->devices[0]);
}

static void world_fini(world_t *w) {
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w->devices[r]);
    cudaStreamDestroy(w->streams[r]);
  }
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_comm_destroy(w->comms[r]));
  cudaSetDevice(w->devices[0]);
}

/* Synchronises every rank's stream (no CUDA error may come of the case) and returns the seconds
 * since t0. */
static double world_sync(world_t *w, double t0, const char *what) {
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w->devices[r]);
    const cudaError_t e = cudaStreamSynchronize(w->streams[r]);
    TEST_REQUIRE(e == cudaSuccess, "%s: rank %d's stream: %s", what, r, cudaGetErrorString(e));
  }
  cudaSetDevice(w->devices[0]);
  return tw_test_now() - t0;
}

/* Every rank reports TW_ERR_MISMATCH within the bound, its message holding each needle. */
static void expect_mismatch(world_t *w, double t0, const char *what, const char *const *needles,
                            int nneedles) {
  const double waited = world_sync(w, t0, what);
  TEST_ASSERT(waited < 0.5 * kBoundMs / 1000.0, "%s: the kernels ended only after %.2f s", what,
              waited);
  for (int r = 0; r < kWorld; r++) {
    tw_status_t async = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(w->comms[r], &async));
    const char *msg = tw_comm_last_error(w->comms[r]);
    TEST_ASSERT(async == TW_ERR_MISMATCH, "%s: rank %d: async status %s (%s)", what, r,
                tw_status_string(async), msg);
    for (int i = 0; i < nneedles; i++)
      TEST_ASSERT(strstr(msg, needles[i]) != NULL, "%s: rank %d's message lacks \"%s\": %s", what,
                  r, needles[i], msg);
    if (r == 0)
      printf("  %s, after %.3f s: rank 0: %s\n", what, waited, msg);
  }
}

/* A rank that never called: every other rank's kernels ended after the wait bound (the streams
 * completed), each reports TW_ERR_DEVICE_TIMEOUT or TW_ERR_ABORTED (a peer's timeout reached it
 * first), and each names the absent rank as the one that had not entered the call, whatever
 * flag its first failed wait was on. */
static void expect_absent(world_t *w, int absent, double waited, const char *what) {
  TEST_ASSERT(waited >= 0.9 * kBoundMs / 1000.0 && waited < 4.0 * kBoundMs / 1000.0 + 10.0,
              "%s: the kernels ended after %.2f s (wait bound %d ms)", what, waited, kBoundMs);
  char needle[80];
  snprintf(needle, sizeof(needle), "had not entered this call (#1 on its channel): %d.", absent);
  int named = 0;
  for (int r = 0; r < kWorld; r++) {
    if (r == absent)
      continue;
    tw_status_t async = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(w->comms[r], &async));
    const char *msg = tw_comm_last_error(w->comms[r]);
    TEST_ASSERT(async == TW_ERR_DEVICE_TIMEOUT || async == TW_ERR_ABORTED,
                "%s: rank %d: async status %s (%s)", what, r, tw_status_string(async), msg);
    named += strstr(msg, needle) != NULL;
    printf("  %s, after %.2f s: rank %d: %s\n", what, waited, r, msg);
  }
  TEST_ASSERT(named == kWorld - 1, "%s: %d of %d reports name rank %d", what, named, kWorld - 1,
              absent);
}

/* The bytes at p (device) are still the poison (0xFF). */
static void expect_poison(const void *p, size_t bytes, const char *what, int rank) {
  void *ref = dev_alloc(bytes);
  tw_test_poison(ref, bytes, NULL);
  const size_t diff = tw_test_count_diff(p, ref, bytes);
  TEST_ASSERT(diff == 0, "%s: rank %d: %zu bytes of an output were written", what, rank, diff);
  cudaFree(ref);
}

/* tw_gemm_rs / tw_gemm_ar on kWorld ranks at m x n x k, buffers sized for the largest variant.
 * odd: the rank that disagrees, with m_odd / n_odd, another workspace (other_ws) or the other op
 * (other_op); absent: a rank that does not call. */
typedef struct {
  const char *what;
  int all_reduce;
  int64_t m, n, k;
  int odd;
  int64_t m_odd, n_odd;
  int other_ws, other_op, absent;
  int graph; /* each rank's call captured into a CUDA graph, then the graphs launched */
} rs_case_t;

static void run_rs(const rs_case_t *c) {
  world_t w;
  world_init(&w);
  const int64_t m_max = c->m_odd > c->m ? c->m_odd : c->m,
                n_max = c->n_odd > c->n ? c->n_odd : c->n;
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_gemm_rs_workspace_size(w.comms[0], m_max, n_max, &ws_bytes));
  void *ws[kWorld], *ws2[kWorld];
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_mem_alloc(w.comms[r], ws_bytes, &ws[r]));
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_mem_alloc(w.comms[r], ws_bytes, &ws2[r]));
  tw_gemm_rs_args_t args[kWorld];
  const size_t out_bytes = (size_t)(m_max * n_max * 2);
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w.devices[r]);
    tw_gemm_rs_args_t a = TW_GEMM_RS_ARGS_INIT;
    a.a = dev_alloc(m_max * c->k * 2), a.b = dev_alloc(n_max * c->k * 2);
    a.out = dev_alloc(out_bytes);
    a.workspace = ws[r];
    a.m = c->m, a.n = c->n, a.k = c->k;
    if (r == c->odd && c->m_odd)
      a.m = c->m_odd;
    if (r == c->odd && c->n_odd)
      a.n = c->n_odd;
    if (r == c->odd && c->other_ws)
      a.workspace = ws2[r];
    tw_test_fill_bf16((void *)a.a, m_max * c->k, 10 + r, NULL);
    tw_test_fill_bf16((void *)a.b, n_max * c->k, 20 + r, NULL);
    tw_test_poison(a.out, out_bytes, NULL);
    args[r] = a;
  }
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w.devices[r]);
    TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "inputs");
  }
  cudaGraphExec_t graphs[kWorld] = {NULL};
  for (int r = 0; c->graph && r < kWorld; r++) {
    cudaSetDevice(w.devices[r]);
    cudaGraph_t g = NULL;
    TEST_REQUIRE(cudaStreamBeginCapture(w.streams[r], cudaStreamCaptureModeThreadLocal) ==
                     cudaSuccess,
                 "begin capture");
    TEST_TW_OK(tw_gemm_rs(w.comms[r], &args[r], (tw_stream_t)w.streams[r]));
    TEST_REQUIRE(cudaStreamEndCapture(w.streams[r], &g) == cudaSuccess, "end capture");
    TEST_REQUIRE(cudaGraphInstantiate(&graphs[r], g, 0) == cudaSuccess, "instantiate");
    cudaGraphDestroy(g);
  }
  const double t0 = tw_test_now();
  for (int r = 0; r < kWorld; r++) {
    if (r == c->absent)
      continue;
    cudaSetDevice(w.devices[r]);
    const int ar = c->all_reduce ^ (r == c->odd && c->other_op);
    const tw_stream_t s = (tw_stream_t)w.streams[r];
    if (c->graph)
      TEST_REQUIRE(cudaGraphLaunch(graphs[r], w.streams[r]) == cudaSuccess, "graph launch");
    else
      TEST_TW_OK(ar ? tw_gemm_ar(w.comms[r], &args[r], s) : tw_gemm_rs(w.comms[r], &args[r], s));
  }
  if (c->absent >= 0) {
    expect_absent(&w, c->absent, world_sync(&w, t0, c->what), c->what);
  } else {
    char want_a[64] = "", want_b[64] = "";
    const char *needles[4];
    int n = 0;
    if (c->other_op) {
      needles[n++] = "different ops";
      needles[n++] = "tw_gemm_rs";
      needles[n++] = "tw_gemm_ar";
    } else {
      needles[n++] = c->all_reduce ? "tw_gemm_ar" : "tw_gemm_rs";
      if (c->n_odd) {
        snprintf(want_a, sizeof(want_a), "n = %lld", (long long)c->n);
        snprintf(want_b, sizeof(want_b), "n = %lld", (long long)c->n_odd);
      } else if (c->m_odd) {
        snprintf(want_a, sizeof(want_a), "m = %lld", (long long)c->m);
        snprintf(want_b, sizeof(want_b), "m = %lld", (long long)c->m_odd);
      } else {
        snprintf(want_a, sizeof(want_a), "workspace (heap offset)");
      }
      needles[n++] = want_a;
      if (want_b[0])
        needles[n++] = want_b;
    }
    expect_mismatch(&w, t0, c->what, needles, n);
    for (int r = 0; r < kWorld; r++)
      expect_poison(args[r].out, out_bytes, c->what, r);
  }
  for (int r = 0; r < kWorld; r++) {
    if (graphs[r])
      cudaGraphExecDestroy(graphs[r]);
    cudaFree((void *)args[r].a), cudaFree((void *)args[r].b), cudaFree(args[r].out);
    tw_mem_free(w.comms[r], ws[r]);
    tw_mem_free(w.comms[r], ws2[r]);
  }
  world_fini(&w);
}

/* tw_allgather of `bytes` a rank (rank 1: bytes_odd; absent: a rank that does not call) from a
 * separate send buffer into the symmetric recv. */
static void run_allgather(const char *what, size_t bytes, size_t bytes_odd, int absent) {
  world_t w;
  world_init(&w);
  const size_t max = bytes_odd > bytes ? bytes_odd : bytes;
  void *recv[kWorld], *send[kWorld];
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_mem_alloc(w.comms[r], max * kWorld, &recv[r]));
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w.devices[r]);
    send[r] = dev_alloc(max);
    tw_test_fill_bytes(send[r], max, 30 + r, NULL);
    tw_test_poison(recv[r], max * kWorld, NULL);
    TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "inputs");
  }
  const double t0 = tw_test_now();
  for (int r = 0; r < kWorld; r++) {
    if (r == absent)
      continue;
    cudaSetDevice(w.devices[r]);
    TEST_TW_OK(tw_allgather(w.comms[r], send[r], recv[r], r == 1 && bytes_odd ? bytes_odd : bytes,
                            (tw_stream_t)w.streams[r]));
  }
  if (absent >= 0) {
    expect_absent(&w, absent, world_sync(&w, t0, what), what);
  } else {
    char a[64], b[64];
    snprintf(a, sizeof(a), "bytes = %zu", bytes);
    snprintf(b, sizeof(b), "bytes = %zu", bytes_odd);
    const char *needles[] = {"tw_allgather", a, b};
    expect_mismatch(&w, t0, what, needles, 3);
    /* the comm is unusable: the next call fails on the host, with the recorded status */
    for (int r = 0; r < kWorld; r++)
      TEST_TW_FAILS(tw_allgather(w.comms[r], send[r], recv[r],
                                 r == 1 && bytes_odd ? bytes_odd : bytes,
                                 (tw_stream_t)w.streams[r]),
                    TW_ERR_MISMATCH, "unusable since an earlier call failed");
    /* the peers' slots of recv: the low-latency path copies only the words it checked */
    for (int r = 0; r < kWorld; r++)
      for (int s = 0; s < kWorld; s++)
        if (s != r)
          expect_poison((const char *)recv[r] + (size_t)s * (r == 1 ? bytes_odd : bytes),
                        r == 1 ? bytes_odd : bytes, what, r);
  }
  for (int r = 0; r < kWorld; r++) {
    cudaFree(send[r]);
    tw_mem_free(w.comms[r], recv[r]);
  }
  world_fini(&w);
}

/* tw_moe_dispatch with another hidden on rank 1: the count exchange runs through the
 * low-latency area, whose words carry each rank's call digest, so every rank finds the mismatch
 * before it copies a row, and no rank's recv or offsets is written. */
static void run_moe(const char *what) {
  world_t w;
  world_init(&w);
  const int64_t experts = 2 * kWorld, top_k = 2, tokens = 32, hidden = 64, hidden_odd = 128;
  const int64_t recv_rows = kWorld * tokens * top_k + (experts / kWorld) * 128;
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_moe_workspace_size(w.comms[0], tokens, hidden_odd, experts, top_k, &ws_bytes));
  const size_t recv_bytes = (size_t)(recv_rows * hidden_odd * 2);
  const size_t off_bytes = (size_t)(experts / kWorld + 1) * 4;
  void *ws[kWorld], *recv[kWorld], *x[kWorld], *idx[kWorld];
  int32_t *offsets[kWorld];
  for (int r = 0; r < kWorld; r++) {
    TEST_TW_OK(tw_mem_alloc(w.comms[r], ws_bytes, &ws[r]));
    TEST_TW_OK(tw_mem_alloc(w.comms[r], recv_bytes, &recv[r]));
  }
  int32_t h_idx[32 * 2];
  for (int64_t t = 0; t < tokens; t++) /* two distinct experts a token, every rank's */
    h_idx[t * 2] = (int32_t)(t % experts), h_idx[t * 2 + 1] = (int32_t)((t + 1) % experts);
  tw_moe_args_t args[kWorld];
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w.devices[r]);
    x[r] = dev_alloc((size_t)(tokens * hidden_odd * 2));
    idx[r] = dev_alloc(sizeof(h_idx));
    offsets[r] = (int32_t *)dev_alloc(off_bytes);
    tw_test_fill_bf16(x[r], tokens * hidden_odd, 50 + r, NULL);
    TEST_REQUIRE(cudaMemcpy(idx[r], h_idx, sizeof(h_idx), cudaMemcpyHostToDevice) == cudaSuccess,
                 "topk_idx");
    tw_test_poison(recv[r], recv_bytes, NULL);
    tw_test_poison(offsets[r], off_bytes, NULL);
    TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "inputs");
    tw_moe_args_t a = TW_MOE_ARGS_INIT;
    a.x = x[r], a.topk_idx = idx[r], a.recv = recv[r], a.offsets = offsets[r], a.workspace = ws[r];
    a.tokens = tokens, a.max_tokens = tokens, a.hidden = r == 1 ? hidden_odd : hidden;
    a.experts = experts, a.top_k = top_k, a.recv_rows = recv_rows;
    args[r] = a;
  }
  const double t0 = tw_test_now();
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w.devices[r]);
    TEST_TW_OK(tw_moe_dispatch(w.comms[r], &args[r], (tw_stream_t)w.streams[r]));
  }
  const char *needles[] = {"tw_moe_dispatch", "hidden or n_out"};
  expect_mismatch(&w, t0, what, needles, 2);
  for (int r = 0; r < kWorld; r++) {
    expect_poison(recv[r], recv_bytes, what, r);
    expect_poison(offsets[r], off_bytes, what, r);
  }
  for (int r = 0; r < kWorld; r++) {
    cudaFree(x[r]), cudaFree(idx[r]), cudaFree(offsets[r]);
    tw_mem_free(w.comms[r], ws[r]);
    tw_mem_free(w.comms[r], recv[r]);
  }
  world_fini(&w);
}

/* tw_ag_gemm: rank 2 gathers into another symmetric buffer (other), or never calls (absent). */
static void run_ag_gemm(const char *what, int other, int absent) {
  world_t w;
  world_init(&w);
  const int64_t m_local = 256, n = 512, k = 512, m = m_local * kWorld;
  void *gathered[kWorld], *gathered2[kWorld];
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_mem_alloc(w.comms[r], (size_t)(m * k * 2), &gathered[r]));
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_mem_alloc(w.comms[r], (size_t)(m * k * 2), &gathered2[r]));
  tw_ag_gemm_args_t args[kWorld];
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(w.devices[r]);
    tw_ag_gemm_args_t a = TW_AG_GEMM_ARGS_INIT;
    a.a = dev_alloc(m_local * k * 2), a.b = dev_alloc(n * k * 2), a.c = dev_alloc(m * n * 2);
    a.a_gathered = r == 2 && other ? gathered2[r] : gathered[r];
    a.m_local = m_local, a.n = n, a.k = k;
    tw_test_fill_bf16((void *)a.a, m_local * k, 10 + r, NULL);
    tw_test_fill_bf16((void *)a.b, n * k, 20 + r, NULL);
    tw_test_poison(gathered[r], (size_t)(m * k * 2), NULL);
    tw_test_poison(gathered2[r], (size_t)(m * k * 2), NULL);
    TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "inputs");
    args[r] = a;
  }
  const double t0 = tw_test_now();
  for (int r = 0; r < kWorld; r++) {
    if (r == absent)
      continue;
    cudaSetDevice(w.devices[r]);
    TEST_TW_OK(tw_ag_gemm(w.comms[r], &args[r], (tw_stream_t)w.streams[r]));
  }
  if (absent >= 0) {
    expect_absent(&w, absent, world_sync(&w, t0, what), what);
  } else {
    const char *needles[] = {"tw_ag_gemm", "a_gathered (heap offset)"};
    expect_mismatch(&w, t0, what, needles, 2);
    /* no rank's slot of a peer's buffers was written (each rank's own slot may be) */
    const size_t shard = (size_t)(m_local * k * 2);
    for (int r = 0; r < kWorld; r++)
      for (int s = 0; s < kWorld; s++)
        if (s != r) {
          expect_poison((const char *)gathered[r] + s * shard, shard, what, r);
          expect_poison((const char *)gathered2[r] + s * shard, shard, what, r);
        }
  }
  for (int r = 0; r < kWorld; r++) {
    cudaFree((void *)args[r].a), cudaFree((void *)args[r].b), cudaFree(args[r].c);
    tw_mem_free(w.comms[r], gathered[r]);
    tw_mem_free(w.comms[r], gathered2[r]);
  }
  world_fini(&w);
}

int main(void) {
  tw_test_require_hopper();
  char bound[16];
  snprintf(bound, sizeof(bound), "%d", kBoundMs);
  setenv("TW_WAIT_TIMEOUT_MS", bound, 1);
  const rs_case_t rs_cases[] = {
      {"tw_gemm_rs, rank 1 with another n", 0, 768, 512, 512, 1, 0, 256, 0, 0, -1},
      {"tw_gemm_ar, rank 2 with another workspace", 1, 768, 512, 512, 2, 0, 0, 1, 0, -1},
      {"tw_gemm_rs at a decode shape, rank 1 with another m", 0, 48, 1024, 1024, 1, 96, 0, 0, 0,
       -1},
      {"tw_gemm_ar at a decode shape, rank 1 with another n", 1, 48, 1024, 1024, 1, 0, 512, 0, 0,
       -1},
      {"rank 1 calls tw_gemm_ar, its peers tw_gemm_rs", 0, 768, 512, 512, 1, 0, 0, 0, 1, -1},
      {"tw_gemm_rs, rank 2 never calls", 0, 768, 512, 512, -1, 0, 0, 0, 0, 2},
      {"tw_gemm_rs from CUDA graphs, rank 1 with another n", 0, 768, 512, 512, 1, 0, 256, 0, 0, -1,
       1},
  };
  for (size_t i = 0; i < sizeof(rs_cases) / sizeof(rs_cases[0]); i++)
    run_rs(&rs_cases[i]);
  run_allgather("tw_allgather (the SM push), rank 1 with other bytes", 1 << 20, 512 << 10, -1);
  run_allgather("tw_allgather (the low-latency path), rank 1 with other bytes", 8 << 10, 4 << 10,
                -1);
  run_allgather("tw_allgather, rank 2 never calls", 1 << 20, 0, 2);
  run_ag_gemm("tw_ag_gemm, rank 2 with another a_gathered", 1, -1);
  run_ag_gemm("tw_ag_gemm, rank 2 never calls", 0, 2);
  run_moe("tw_moe_dispatch (the low-latency count exchange), rank 1 with another hidden");
  /* A comm made after all of these works. */
  {
    world_t w;
    world_init(&w);
    const size_t bytes = 256 << 10;
    void *recv[kWorld];
    for (int r = 0; r < kWorld; r++)
      TEST_TW_OK(tw_mem_alloc(w.comms[r], bytes * kWorld, &recv[r]));
    for (int r = 0; r < kWorld; r++) {
      cudaSetDevice(w.devices[r]);
      tw_test_fill_bytes((char *)recv[r] + r * bytes, bytes, 40 + r, NULL);
      TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "inputs");
    }
    for (int r = 0; r < kWorld; r++) {
      cudaSetDevice(w.devices[r]);
      TEST_TW_OK(tw_allgather(w.comms[r], (char *)recv[r] + r * bytes, recv[r], bytes,
                              (tw_stream_t)w.streams[r]));
    }
    world_sync(&w, tw_test_now(), "the good call");
    for (int r = 0; r < kWorld; r++) {
      tw_status_t async = TW_SUCCESS;
      TEST_TW_OK(tw_comm_async_error(w.comms[r], &async));
      TEST_ASSERT(async == TW_SUCCESS, "the good call: rank %d: %s", r,
                  tw_comm_last_error(w.comms[r]));
      for (int s = 0; s < kWorld; s++)
        TEST_ASSERT(tw_test_count_diff((char *)recv[r] + s * bytes, (char *)recv[s] + s * bytes,
                                       bytes) == 0,
                    "the good call: rank %d's slot %d differs from rank %d's shard", r, s, s);
    }
    for (int r = 0; r < kWorld; r++)
      tw_mem_free(w.comms[r], recv[r]);
    world_fini(&w);
  }
  return tw_test_finish();
}
