/*
 * tw_gemm_rs and tw_gemm_ar on virtual ranks (one GPU): for worlds 1, 2, 3, 4, 8
 * and shapes with tails (m / world = 1, 100, 300, ...) and one where tw_gemm_ar groups its
 * units (1024 x 8448), the fused output equals,
 * bitwise, the unfused pipeline built from the same core (tw_gemm with fp32
 * output on every rank, then the rank-ordered reduction of src/ref/ref_reduce.cu),
 * and is within bf16 tolerance of an fp32 reference (tw_ref_gemm_fp32 summed over
 * ranks); 1000 back-to-back calls of each op with changing inputs, each checked
 * on the GPU against the unfused pipeline; a CUDA graph replay; bad arguments.
 * The same with bf16 partials (TW_PARTIALS_BF16), against tw_gemm with bf16 output
 * and the same rank-ordered fp32 sum.
 * `--small` runs a reduced set (for compute-sanitizer). TW_TEST_DEVICES=distinct puts rank r on
 * GPU r % (number of GPUs) (the fp32 reference is then summed on rank 0's GPU from copies; the
 * graph replay runs on one GPU only).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "ref/ref_gemm.h"
#include "ref/ref_reduce.h"
#include "tw_test.h"

#define CUDA_OK(call)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    TEST_REQUIRE(e_ == cudaSuccess, "%s -> %s", #call, cudaGetErrorString(e_));                    \
  } while (0)

static __global__ void add_into(float *dst, const float *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] += src[i];
}

/* dst (+)= |src|: the sum over ranks of |partial|, the scale of the rounding of a sum of rounded
 * partials (a cancelling sum says nothing about it). */
static __global__ void add_abs_into(float *dst, const float *src, size_t n, int first) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = (first ? 0.f : dst[i]) + fabsf(src[i]);
}

/* tw_partials_t of every call (fused args and the unfused pipeline). */
static int g_partials = TW_PARTIALS_FP32;
/* TW_TEST_OUT_SYMMETRIC=1 (read by this test at each setup): the fused output is a symmetric
 * allocation passed with args.out_symmetric = 1 (tw_gemm_ar writes every rank's out). */
static int g_out_sym;

typedef struct {
  int world, budget;
  int64_t m, n, k; /* m: total rows */
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  cudaEvent_t events[TW_MAX_WORLD];
  void *a[TW_MAX_WORLD], *b[TW_MAX_WORLD];
  void *out[TW_MAX_WORLD];      /* fused, [m, n] (rs uses the first m / world rows) */
  void *out2[TW_MAX_WORLD];     /* unfused, symmetric [m, n] */
  float *partial[TW_MAX_WORLD]; /* unfused fp32 (or bf16) partials, symmetric [m, n] */
  void *ws[TW_MAX_WORLD];       /* fused workspace, symmetric */
  const void *partial_peers[TW_MAX_WORLD * TW_MAX_WORLD];
  void *out2_peers[TW_MAX_WORLD * TW_MAX_WORLD];
  unsigned long long *bad[TW_MAX_WORLD]; /* a counter per rank, on its GPU */
  int devices[TW_MAX_WORLD];
  int multi_gpu; /* ranks on distinct GPUs (TW_TEST_DEVICES=distinct) */
} fixture;

static void use(const fixture *f, int r) { CUDA_OK(cudaSetDevice(f->devices[r])); }

static void sync_all(const fixture *f) { tw_test_sync_devices(f->devices, f->world); }

static size_t out_bytes(const fixture *f, int all_reduce) {
  return (size_t)(all_reduce ? f->m : f->m / f->world) * f->n * 2;
}

static void setup(fixture *f, int world, int64_t m_local, int64_t n, int64_t k) {
  memset(f, 0, sizeof(*f));
  f->world = world, f->m = m_local * world, f->n = n, f->k = k;
  f->multi_gpu = tw_test_devices(world, f->devices);
  const char *sym = getenv("TW_TEST_OUT_SYMMETRIC");
  g_out_sym = sym && strcmp(sym, "1") == 0;
  tw_status_t st = tw_comm_init_all(f->comms, world, f->devices, NULL);
  TEST_REQUIRE(st == TW_SUCCESS, "init_all(%d): %s", world, tw_last_error());
  TEST_TW_OK(tw_comm_sm_budget(f->comms[0], &f->budget));
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_gemm_rs_workspace_size(f->comms[0], f->m, n, &ws_bytes));
  const size_t mn = (size_t)f->m * n;
  /* TW_AR_DIRECT=1 (tw_gemm_ar's direct scheme) takes effect with a world x m x n fp32
   * workspace. */
  const char *direct = getenv("TW_AR_DIRECT");
  if (direct && strcmp(direct, "1") == 0 && ws_bytes < (size_t)world * mn * 4)
    ws_bytes = (size_t)world * mn * 4;
  for (int r = 0; r < world; r++) {
    use(f, r);
    CUDA_OK(cudaStreamCreateWithFlags(&f->streams[r], cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreateWithFlags(&f->events[r], cudaEventDisableTiming));
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], ws_bytes, &f->ws[r]) == TW_SUCCESS, "alloc ws");
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], mn * 4, (void **)&f->partial[r]) == TW_SUCCESS, "alloc");
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], mn * 2, &f->out2[r]) == TW_SUCCESS, "alloc");
    CUDA_OK(cudaMalloc(&f->a[r], (size_t)f->m * k * 2));
    CUDA_OK(cudaMalloc(&f->b[r], (size_t)n * k * 2));
    if (g_out_sym)
      TEST_REQUIRE(tw_mem_alloc(f->comms[r], mn * 2, &f->out[r]) == TW_SUCCESS, "alloc out");
    else
      CUDA_OK(cudaMalloc(&f->out[r], mn * 2));
    CUDA_OK(cudaMalloc(&f->bad[r], sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(f->bad[r], 0, sizeof(unsigned long long)));
  }
  use(f, 0);
  for (int r = 0; r < world; r++)
    for (int s = 0; s < world; s++) {
      void *p;
      TEST_TW_OK(tw_mem_peer_ptr(f->comms[r], f->partial[r], s, &p));
      f->partial_peers[r * world + s] = p;
      TEST_TW_OK(tw_mem_peer_ptr(f->comms[r], f->out2[r], s, &p));
      f->out2_peers[r * world + s] = p;
    }
}

static void teardown(fixture *f) {
  sync_all(f);
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    cudaFree(f->a[r]), cudaFree(f->b[r]), cudaFree(f->bad[r]);
    if (g_out_sym)
      TEST_TW_OK(tw_mem_free(f->comms[r], f->out[r]));
    else
      cudaFree(f->out[r]);
    TEST_TW_OK(tw_mem_free(f->comms[r], f->ws[r]));
    TEST_TW_OK(tw_mem_free(f->comms[r], f->partial[r]));
    TEST_TW_OK(tw_mem_free(f->comms[r], f->out2[r]));
  }
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    TEST_TW_OK(tw_comm_destroy(f->comms[r]));
    cudaStreamDestroy(f->streams[r]);
    cudaEventDestroy(f->events[r]);
  }
  use(f, 0);
}

static tw_gemm_rs_args_t fused_args(const fixture *f, int r) {
  tw_gemm_rs_args_t a = TW_GEMM_RS_ARGS_INIT;
  a.a = f->a[r], a.b = f->b[r], a.out = f->out[r], a.workspace = f->ws[r];
  a.m = f->m, a.n = f->n, a.k = f->k;
  a.partials = g_partials;
  a.out_symmetric = g_out_sym;
  return a;
}

static void enqueue_fused(fixture *f, int all_reduce, int reduce_sms) {
  for (int r = 0; r < f->world; r++) {
    tw_gemm_rs_args_t a = fused_args(f, r);
    a.reduce_sms = reduce_sms;
    tw_stream_t s = (tw_stream_t)f->streams[r];
    if (all_reduce)
      TEST_TW_OK(tw_gemm_ar(f->comms[r], &a, s));
    else
      TEST_TW_OK(tw_gemm_rs(f->comms[r], &a, s));
  }
}

/* Unfused pipeline from the same core: tw_gemm (fp32 out; bf16 with bf16 partials) per rank,
 * then the reduction. */
static void enqueue_unfused(fixture *f, int all_reduce) {
  const int bf16 = g_partials == TW_PARTIALS_BF16;
  for (int r = 0; r < f->world; r++) {
    tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
    g.c_dtype = bf16 ? TW_BF16 : TW_FP32;
    g.a = f->a[r], g.b = f->b[r], g.c = f->partial[r];
    g.m = f->m, g.n = f->n, g.k = f->k;
    g.sm_count = f->budget;
    use(f, r); /* tw_gemm runs on the current device */
    TEST_TW_OK(tw_gemm(&g, (tw_stream_t)f->streams[r]));
  }
  use(f, 0);
  cudaError_t e = all_reduce
                      ? tw_ref_all_reduce(f->world, f->partial_peers, bf16 ? 2 : 4, f->out2_peers,
                                          f->m, f->n, f->n, f->budget, f->streams, f->events)
                      : tw_ref_reduce_scatter(f->world, f->partial_peers, bf16 ? 2 : 4, f->out2,
                                              f->m, f->n, f->n, f->budget, f->streams, f->events);
  TEST_REQUIRE(e == cudaSuccess, "unfused reduction: %s", cudaGetErrorString(e));
}

static void fill_inputs(fixture *f, uint64_t seed) {
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    tw_stream_t s = (tw_stream_t)f->streams[r];
    tw_test_fill_bf16(f->a[r], (size_t)f->m * f->k, seed + 31 * r, s);
    tw_test_fill_bf16(f->b[r], (size_t)f->n * f->k, seed + 1000 + r, s);
    tw_test_poison(f->out[r], (size_t)f->m * f->n * 2, s);
    tw_test_poison(f->out2[r], (size_t)f->m * f->n * 2, s);
  }
  use(f, 0);
}

/* `bytes` at p, a buffer of rank r, as a pointer on rank 0's GPU: p itself, or a copy in
 * `stage` (rank 0's GPU) when rank r is on another GPU. */
static const void *on_rank0_gpu(const fixture *f, int r, const void *p, size_t bytes, void *stage) {
  if (f->devices[r] == f->devices[0])
    return p;
  CUDA_OK(cudaMemcpy(stage, p, bytes, cudaMemcpyDefault));
  return stage;
}

static void check_async_errors(fixture *f) {
  for (int r = 0; r < f->world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(f->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "rank %d: %s", r, tw_comm_last_error(f->comms[r]));
  }
}

static void test_case(int world, int64_t m_local, int64_t n, int64_t k, int reduce_sms,
                      uint64_t seed) {
  fixture f;
  if (getenv("TW_TEST_VERBOSE"))
    fprintf(stderr, "case: world %d m_local %lld n %lld k %lld reduce_sms %d\n", world,
            (long long)m_local, (long long)n, (long long)k, reduce_sms);
  setup(&f, world, m_local, n, k);
  const size_t mn = (size_t)f.m * n;
  float *ref = NULL, *tmp = NULL, *scale = NULL;
  void *stage_a = NULL, *stage_b = NULL, *stage_out = NULL; /* rank 0's GPU */
  CUDA_OK(cudaMalloc(&ref, mn * 4));
  CUDA_OK(cudaMalloc(&tmp, mn * 4));
  CUDA_OK(cudaMalloc(&scale, mn * 4));
  if (f.multi_gpu) {
    CUDA_OK(cudaMalloc(&stage_a, (size_t)f.m * k * 2));
    CUDA_OK(cudaMalloc(&stage_b, (size_t)n * k * 2));
    CUDA_OK(cudaMalloc(&stage_out, mn * 2));
  }
  for (int ar = 0; ar < 2; ar++) {
    fill_inputs(&f, seed + 77 * ar);
    sync_all(&f);
    enqueue_fused(&f, ar, reduce_sms);
    enqueue_unfused(&f, ar);
    sync_all(&f);
    /* fp32 reference on rank 0's GPU: sum over ranks of the plain-loop GEMM. */
    for (int r = 0; r < world; r++) {
      const void *a_r = on_rank0_gpu(&f, r, f.a[r], (size_t)f.m * k * 2, stage_a);
      const void *b_r = on_rank0_gpu(&f, r, f.b[r], (size_t)n * k * 2, stage_b);
      TEST_REQUIRE(tw_ref_gemm_fp32(a_r, b_r, r ? tmp : ref, f.m, n, k, k, k, n, 0) == TW_SUCCESS,
                   "ref gemm");
      add_abs_into<<<512, 256>>>(scale, r ? tmp : ref, mn, r == 0);
      if (r)
        add_into<<<512, 256>>>(ref, tmp, mn);
      CUDA_OK(cudaDeviceSynchronize()); /* the stages are reused */
    }
    size_t diff = 0, nans = 0;
    double worst = 0;
    for (int r = 0; r < world; r++) {
      use(&f, r); /* compare on the rank's GPU */
      diff += tw_test_count_diff(f.out[r], f.out2[r], out_bytes(&f, ar));
      use(&f, 0);
      size_t rows = (size_t)(ar ? f.m : m_local), first = ar ? 0 : (size_t)r * m_local;
      size_t bad = 0;
      const void *out_r = on_rank0_gpu(&f, r, f.out[r], rows * n * 2, stage_out);
      double err =
          tw_test_rel_err_bf16_scaled(out_r, ref + first * n, 1, scale + first * n, rows * n, &bad);
      nans += bad;
      if (err > worst)
        worst = err;
    }
    TEST_ASSERT(diff == 0, "%s world %d m_local %lld n %lld k %lld: fused != unfused in %zu bytes",
                ar ? "ar" : "rs", world, (long long)m_local, (long long)n, (long long)k, diff);
    TEST_ASSERT(nans == 0, "%s world %d: %zu NaN/unwritten outputs", ar ? "ar" : "rs", world, nans);
    /* max |out - ref| / max sum_r |partial_r|: bf16 partials round each term (2^-9) and the output
     * once more, so this stays under 2^-8 whatever the cancellation */
    TEST_ASSERT(worst < 1e-2, "%s world %d: rel err %.3g vs fp32", ar ? "ar" : "rs", world, worst);
    check_async_errors(&f);
    printf("  %s world %d m_local %lld n %lld k %lld reduce_sms %d%s: diff %zu, rel err %.2e\n",
           ar ? "ar" : "rs", world, (long long)m_local, (long long)n, (long long)k, reduce_sms,
           g_partials == TW_PARTIALS_BF16 ? " bf16 partials" : "", diff, worst);
  }
  cudaFree(ref);
  cudaFree(tmp);
  cudaFree(scale);
  cudaFree(stage_a), cudaFree(stage_b), cudaFree(stage_out);
  teardown(&f);
}

/* One call with fresh inputs (no host sync), checked on the GPU against the unfused pipeline
 * into the ranks' bad counters. */
static void checked_call(fixture *f, int ar, int reduce_sms, uint64_t seed) {
  fill_inputs(f, seed);
  enqueue_fused(f, ar, reduce_sms);
  enqueue_unfused(f, ar);
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    tw_test_count_diff_async(f->out[r], f->out2[r], out_bytes(f, ar), f->bad[r],
                             (tw_stream_t)f->streams[r]);
  }
  use(f, 0);
}

/* The ranks' bad counters summed (after a sync), then zeroed. */
static unsigned long long take_bad(fixture *f) {
  return tw_test_take_counters(f->bad, f->devices, f->world);
}

/* Many calls with fresh inputs, no host sync in between; each call checked on the GPU. */
static void test_back_to_back_at(int world, int calls, int64_t m_local, uint64_t seed) {
  fixture f;
  setup(&f, world, m_local, 256, 256);
  double t0 = tw_test_now();
  for (int i = 0; i < calls; i++)
    checked_call(&f, i & 1, 0, seed + (uint64_t)i * 7919);
  const unsigned long long bad = take_bad(&f);
  TEST_ASSERT(bad == 0, "world %d: %d back-to-back calls: %llu words differ from unfused", world,
              calls, bad);
  check_async_errors(&f);
  printf("  world %d m_local %lld: %d back-to-back checked calls (rs and ar alternating) in %.2f "
         "s\n",
         world, (long long)m_local, calls, tw_test_now() - t0);
  teardown(&f);
}

static void test_back_to_back(int world, int calls, uint64_t seed) {
  test_back_to_back_at(world, calls, 200, seed);
}

/* Calls of different shapes on one comm (as a model's layers make them): tw_gemm_ar with one
 * unit group per owner, then with eight, then back. Until the fifth session the all-reduce's
 * ready flags sat right after the call's own counters, so a call with more groups found the
 * earlier calls' epochs in its counters and reduced before the partials landed. Enough calls
 * first that the stale epochs reach the counters' target (world), and as many reduce CTAs as
 * groups, so they all claim at once. */
static void test_shape_changes(int world, uint64_t seed) {
  fixture f;
  setup(&f, world, 128, 2048, 1024); /* room for the larger shape */
  const int reduce = f.budget > 8 ? 8 : f.budget - 1;
  unsigned long long bad[3];
  int calls = 0;
  for (int phase = 0; phase < 3; phase++) {
    f.n = phase == 1 ? 2048 : 256; /* 8 column blocks (8 groups per owner), then 1 */
    for (int i = 0; i < world + 3; i++, calls++)
      checked_call(&f, 1, reduce, seed + 131 * (uint64_t)calls);
    bad[phase] = take_bad(&f);
  }
  TEST_ASSERT(bad[0] + bad[1] + bad[2] == 0,
              "world %d: shapes changing on one comm: %llu / %llu / %llu words differ (n = 256, "
              "2048, 256)",
              world, bad[0], bad[1], bad[2]);
  check_async_errors(&f);
  printf("  world %d: %d checked all-reduce calls, n 256 -> 2048 -> 256 on one comm\n", world,
         calls);
  f.n = 2048; /* teardown frees what setup allocated */
  teardown(&f);
}

/* The unfused pipeline (TW_RS_UNFUSED_SMALL=1) and the fused kernel in turn on one comm and
 * one workspace, tw_gemm_rs and tw_gemm_ar alternating, no host sync: the unfused GEMM stores
 * into a workspace that the previous fused call's peers may still read (the pull, where more
 * than 2 ranks share a GPU), and the fused kernel stores into workspaces that the previous
 * unfused call's peers read. The unfused calls exchange through the low-latency area and by
 * the pull in turn (TW_RS_UNFUSED_LL). */
static void test_unfused_mixed(int world, int calls, uint64_t seed) {
  fixture f;
  setup(&f, world, 100, 1032, 264);
  for (int i = 0; i < calls; i++) {
    setenv("TW_RS_UNFUSED_SMALL", (i / 2) % 2 ? "1" : "0", 1); /* read when enqueued */
    setenv("TW_RS_UNFUSED_LL", (i / 4) % 2 ? "0" : "1", 1);    /* the pull or the area in turn */
    checked_call(&f, i & 1, 0, seed + (uint64_t)i * 104729);
  }
  unsetenv("TW_RS_UNFUSED_SMALL");
  unsetenv("TW_RS_UNFUSED_LL");
  const unsigned long long bad = take_bad(&f);
  TEST_ASSERT(bad == 0, "world %d: %d calls, fused and unfused in turn: %llu words differ", world,
              calls, bad);
  check_async_errors(&f);
  printf("  world %d: %d checked calls, the fused kernel and the unfused pipeline in turn\n", world,
         calls);
  teardown(&f);
}

/* What the graph holds: tw_gemm_rs then tw_gemm_ar on every rank's stream. */
static void graph_calls(void *p) {
  fixture *f = (fixture *)p;
  enqueue_fused(f, 0, 0);
  enqueue_fused(f, 1, 0);
}

static void test_graph(int world, int replays, uint64_t seed) {
  fixture f;
  setup(&f, world, 256, 512, 512);
  if (f.multi_gpu) { /* poisoning from one stream in the graph: a test for ranks of one GPU */
    printf("  graph replay: not run with ranks on distinct GPUs\n");
    teardown(&f);
    return;
  }
  fill_inputs(&f, seed);
  CUDA_OK(cudaDeviceSynchronize());
  cudaStream_t s0 = f.streams[0];
  cudaGraphExec_t exec = (cudaGraphExec_t)tw_test_capture((struct CUstream_st **)f.streams, world,
                                                          NULL, graph_calls, &f);
  for (int i = 0; i < replays; i++) {
    for (int r = 0; r < world; r++)
      tw_test_poison(f.out[r], (size_t)f.m * f.n * 2, (tw_stream_t)s0);
    CUDA_OK(cudaGraphLaunch(exec, s0));
  }
  CUDA_OK(cudaStreamSynchronize(s0));
  enqueue_unfused(&f, 1);
  CUDA_OK(cudaDeviceSynchronize());
  size_t diff = 0;
  for (int r = 0; r < world; r++)
    diff += tw_test_count_diff(f.out[r], f.out2[r], out_bytes(&f, 1));
  TEST_ASSERT(diff == 0, "graph replays: %zu bytes differ", diff);
  check_async_errors(&f);
  cudaGraphExecDestroy(exec);
  printf("  world %d: %d graph replays of rs + ar\n", world, replays);
  teardown(&f);
}

static void test_bad_arguments(void) {
  fixture f;
  setup(&f, 2, 128, 256, 256);
  tw_stream_t s = (tw_stream_t)f.streams[0];
  tw_gemm_rs_args_t a = fused_args(&f, 0);
  TEST_TW_FAILS(tw_gemm_rs(NULL, &a, s), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], NULL, s), TW_ERR_INVALID_ARGUMENT, "args");
  a.m = 255;
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "divisible");
  a = fused_args(&f, 0);
  a.k = 100;
  TEST_TW_FAILS(tw_gemm_ar(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->k");
  a = fused_args(&f, 0);
  a.n = 12;
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->n");
  a = fused_args(&f, 0);
  a.workspace = NULL;
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->workspace");
  a = fused_args(&f, 0);
  a.workspace = f.a[0]; /* not symmetric */
  TEST_TW_FAILS(tw_gemm_ar(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "workspace");
  a = fused_args(&f, 0);
  a.out_symmetric = 1; /* out from cudaMalloc */
  TEST_TW_FAILS(tw_gemm_ar(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "out_symmetric");
  a.out = f.out2[0], a.out_symmetric = 2;
  TEST_TW_FAILS(tw_gemm_ar(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "out_symmetric");
  a = fused_args(&f, 0);
  a.m = 4096; /* workspace too small */
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "past the end");
  a = fused_args(&f, 0);
  a.b = (char *)f.b[0] + 2;
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->b");
  a = fused_args(&f, 0);
  a.out = NULL;
  TEST_TW_FAILS(tw_gemm_ar(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->out");
  a = fused_args(&f, 0);
  a.out_dtype = TW_FP32;
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->out_dtype");
  a = fused_args(&f, 0);
  a.ldo = 100;
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->ldo");
  a = fused_args(&f, 0);
  a.reduce_sms = 100000;
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->reduce_sms");
  a = fused_args(&f, 0);
  a.partials = 2;
  TEST_TW_FAILS(tw_gemm_ar(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->partials");
  a = fused_args(&f, 0);
  a.size = 8;
  TEST_TW_FAILS(tw_gemm_rs(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->size");
  size_t bytes = 0;
  TEST_TW_FAILS(tw_gemm_rs_workspace_size(f.comms[0], 255, 256, &bytes), TW_ERR_INVALID_ARGUMENT,
                "m:");
  /* Nothing was launched: valid calls on both ranks still complete. */
  enqueue_fused(&f, 0, 0);
  enqueue_fused(&f, 1, 0);
  sync_all(&f);
  check_async_errors(&f);
  teardown(&f);
}

/* A knob setting (name = value; name NULL: none), optionally with bands of `band` column blocks
 * (TW_RS_BAND) and with bf16 partials: test_case on worlds 2, 3, 4, 8 (the first shape always,
 * the others unless --small), back-to-back calls, optionally a graph replay; then unset. */
typedef struct {
  const char *name, *value;
  const char *band; /* TW_RS_BAND for the cases, or NULL */
  int partials;     /* tw_partials_t of the cases */
  struct {
    int64_t m_local, n, k;
    int reduce_sms;
  } shapes[3];
  uint64_t seed_step;
  int b2b_world; /* then 200 back-to-back calls on this world (20 on 2 with --small) */
  int graph;     /* and a graph replay test */
} env_cases_t;

static void run_env_cases(const env_cases_t *c, int small, uint64_t seed) {
  static const int worlds[] = {2, 3, 4, 8};
  if (c->name)
    setenv(c->name, c->value, 1);
  if (c->band)
    setenv("TW_RS_BAND", c->band, 1);
  g_partials = c->partials;
  printf("%s=%s%s%s%s:\n", c->name ? c->name : "(no knob)", c->value,
         c->band ? ", TW_RS_BAND=" : "", c->band ? c->band : "",
         g_partials == TW_PARTIALS_BF16 ? ", bf16 partials" : "");
  for (int wi = 0; wi < 4; wi++)
    for (int i = 0; i < (small ? 1 : 3); i++)
      test_case(worlds[wi], c->shapes[i].m_local, c->shapes[i].n, c->shapes[i].k,
                c->shapes[i].reduce_sms, seed + (c->seed_step + (uint64_t)i) * worlds[wi]);
  test_back_to_back(small ? 2 : c->b2b_world, small ? 20 : 200, seed + 100 * c->seed_step);
  if (c->graph)
    test_graph(small ? 2 : 4, 10, seed + 100 * c->seed_step + 50);
  if (c->name)
    unsetenv(c->name);
  if (c->band)
    unsetenv("TW_RS_BAND");
  g_partials = TW_PARTIALS_FP32;
}

int main(int argc, char **argv) {
  tw_test_require_hopper();
  int small = argc > 1 && strcmp(argv[1], "--small") == 0;
  uint64_t seed = tw_test_seed();
  static const int worlds[] = {1, 2, 3, 4, 8};
  for (int wi = 0; wi < 5; wi++) {
    int w = worlds[wi];
    test_case(w, 128, 256, 256, 0, seed + w);
    test_case(w, 100, 264, 200, 0, seed + 10 * w); /* tiles straddle owners, N/K tails */
    if (small)
      continue;
    test_case(w, 1, 8, 8, 0, seed + 20 * w);
    test_case(w, 300, 520, 1032, 0, seed + 30 * w);
    test_case(w, 1024, 1024, 512, 0, seed + 40 * w);
    if (w > 1) {
      test_case(w, 1000, 512, 256, 3, seed + 50 * w);
      /* 264 units per owner: tw_gemm_ar's plan puts 2 or 4 behind each flag (2 groups per CTA
       * of the rank with the fewest SMs; with 3 ranks on 2 GPUs, 66 and 132 SMs, every rank
       * must count 66 or the groups disagree). */
      test_case(w, 1024, 8448, 64, 0, seed + 60 * w);
      /* a decode shape: owners' rows start inside a 64-row box, so the plan pulls */
      test_case(w, 32 / (w > 4 ? 4 : 1), 8192, 1024, 0, seed + 65 * w);
    }
    /* m 2048 n 8192: 512 tiles, at least 3 waves of 132 CTAs, so on 2 ranks the rule takes the
     * owner epilogue for both ops (fp32 partials, K < 4096); same bits. */
    if (w == 2) {
      test_case(w, 1024, 8192, 256, 0, seed + 70 * w);
      /* and into symmetric outputs: the own tiles' second store goes into the peer's out */
      setenv("TW_TEST_OUT_SYMMETRIC", "1", 1);
      test_case(w, 1024, 8192, 256, 0, seed + 71 * w);
      unsetenv("TW_TEST_OUT_SYMMETRIC");
    }
    /* m 4096 K 512 on 4 ranks (the plain-out case is above): where they share a GPU the rule
     * runs the unfused pipeline for GEMM+RS and for GEMM+AR into symmetric outputs with fp32
     * partials (tw_gemm_rs_want_unfused), and into plain outs where they share this process
     * too (the peers' outs, TW_AR_PEER_OUT); same bits. */
    if (w == 4) {
      setenv("TW_TEST_OUT_SYMMETRIC", "1", 1);
      test_case(w, 1024, 1024, 512, 0, seed + 72 * w);
      unsetenv("TW_TEST_OUT_SYMMETRIC");
    }
  }
  test_back_to_back(small ? 2 : 4, small ? 20 : 1000, seed + 5000);
  for (int wi = 1; wi < (small ? 2 : 5); wi++) /* worlds 2, 3, 4, 8 */
    test_shape_changes(worlds[wi], seed + 5500 + wi);
  test_graph(small ? 2 : 4, 10, seed + 6000);
  static const env_cases_t cases[] = {
      /* TW_RS_PULL=1: partials stored locally, owners read them when reducing; same bits. */
      {"TW_RS_PULL",
       "1",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {1, 8, 8, 0}},
       100,
       4,
       1},
      /* TW_RS_BLOCK_N=128: 128 x 128 tiles (units of 128 columns, 6 stages) at every shape, not
       * only where the plan takes them (few tiles); same bits, fp32 and bf16 partials. */
      {"TW_RS_BLOCK_N",
       "128",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {32, 8192, 1024, 0}},
       240,
       4,
       1},
      {"TW_RS_BLOCK_N",
       "128",
       NULL,
       TW_PARTIALS_BF16,
       {{128, 520, 256, 0}, {300, 1032, 264, 1}, {1, 8, 8, 0}},
       250,
       2,
       0},
      /* TW_RS_BLOCK_N=192: the ping-pong loop's 128 x 192 tiles (units of 192 columns, tails
       * in n); same bits, fp32 and bf16 partials, with and without bands; the long-K bf16
       * shape (m 320 on 2 ranks: fused, not the decode pipeline) takes tw_gemm_ar's direct scheme
       * on 2 distinct GPUs. */
      {"TW_RS_BLOCK_N",
       "192",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {512, 3000, 1032, 1}},
       270,
       4,
       1},
      {"TW_RS_BLOCK_N",
       "192",
       "8",
       TW_PARTIALS_BF16,
       {{128, 520, 256, 0}, {1024, 2056, 264, 1}, {160, 1032, 4104, 0}},
       280,
       2,
       0},
      /* TW_RS_PULL=0: the push where the default pulls (more than 2 ranks sharing a GPU). */
      {"TW_RS_PULL",
       "0",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {300, 520, 1032, 0}},
       105,
       4,
       1},
      /* Symmetric outputs (args.out_symmetric, set by the test): the owners write every
       * rank's out; same bits, fp32 and bf16 partials (tw_gemm_rs ignores it). */
      {"TW_TEST_OUT_SYMMETRIC",
       "1",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {1, 8, 8, 0}},
       210,
       4,
       1},
      {"TW_TEST_OUT_SYMMETRIC",
       "1",
       NULL,
       TW_PARTIALS_BF16,
       {{128, 520, 256, 0}, {300, 1032, 264, 1}, {1, 8, 8, 0}},
       220,
       3,
       0},
      /* bf16 partials with a long K: on 2 distinct GPUs the default takes tw_gemm_ar's direct
       * scheme there (tw_gemm_ar_want_direct); same bits. */
      {NULL,
       "",
       NULL,
       TW_PARTIALS_BF16,
       {{256, 264, 4096, 0}, {100, 520, 4104, 1}, {1, 8, 4096, 0}},
       230,
       2,
       0},
      /* TW_AR_DIRECT=1: tw_gemm_ar's direct scheme (small m); the same bits as the unfused
       * pipeline (tw_gemm_rs is unaffected). */
      {"TW_AR_DIRECT",
       "1",
       NULL,
       TW_PARTIALS_FP32,
       {{16, 264, 200, 0}, {1, 8, 8, 0}, {100, 520, 1032, 2}},
       90,
       8,
       1},
      /* Bands narrower than the column blocks (last band partial, owners straddling tiles),
       * and band 1 (column sweeps); same bits. */
      {NULL,
       "",
       "3",
       TW_PARTIALS_FP32,
       {{100, 2056, 200, 0}, {300, 1800, 264, 2}, {1, 1032, 8, 0}},
       150,
       8,
       1},
      {NULL,
       "",
       "1",
       TW_PARTIALS_FP32,
       {{100, 1032, 200, 0}, {1024, 1024, 512, 1}, {3, 520, 64, 0}},
       160,
       3,
       0},
      /* Bands of 3 with whole row blocks per owner (no box straddles owners); same bits. */
      {NULL,
       "",
       "3",
       TW_PARTIALS_FP32,
       {{128, 2056, 200, 0}, {1024, 1800, 264, 2}, {256, 1032, 8, 0}},
       200,
       3,
       0},
      /* Bands of 3 with pull and with the direct all-reduce (their unit numbering follows the
       * band order too). */
      {"TW_RS_PULL",
       "1",
       "3",
       TW_PARTIALS_FP32,
       {{100, 2056, 200, 0}, {256, 1800, 128, 2}, {1, 1032, 8, 0}},
       180,
       3,
       0},
      {"TW_AR_DIRECT",
       "1",
       "3",
       TW_PARTIALS_FP32,
       {{16, 2056, 200, 0}, {100, 1032, 64, 2}, {1, 1032, 8, 0}},
       190,
       2,
       0},
      /* TW_RS_INTERLEAVE=1 / 0: the owners' row blocks interleaved in each band (the default
       * for fp32 partials on distinct GPUs only) and not (shapes of whole row blocks per
       * owner, where it applies; bands of 3 for several bands); same bits. */
      {"TW_RS_INTERLEAVE",
       "1",
       "3",
       TW_PARTIALS_FP32,
       {{128, 256, 256, 0}, {1024, 1800, 512, 2}, {256, 1032, 128, 0}},
       177,
       4,
       0},
      {"TW_RS_INTERLEAVE",
       "0",
       NULL,
       TW_PARTIALS_FP32,
       {{128, 256, 256, 0}, {1024, 1024, 512, 2}, {256, 1032, 128, 0}},
       178,
       2,
       0},
      /* TW_AR_PUSH=1 / 0: tw_gemm_ar's owners store their reduced rows into every rank's
       * workspace (the default on distinct GPUs, forced here where ranks share one), or the
       * ranks load them from the owners (the default on a shared GPU, and what a workspace
       * below tw_gemm_rs_workspace_size() gets); same bits. */
      {"TW_AR_PUSH",
       "1",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {128, 1032, 128, 0}},
       176,
       4,
       1},
      {"TW_AR_PUSH",
       "0",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {128, 1032, 128, 0}},
       179,
       4,
       1},
      /* TW_RS_GROUP_UNITS=3: three units behind each flag (a last group short), where the
       * plan takes one; the reduce and gather items cover three units; same bits. At world 2
       * the owner epilogue, which needs one unit per counter, gives way to the reduce CTAs. */
      {"TW_RS_GROUP_UNITS",
       "3",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {300, 520, 1032, 0}},
       186,
       4,
       1},
      /* TW_RS_OWNER_EPI=1: on 2 ranks with whole row blocks per owner and one unit per
       * counter, each rank's own tiles come after the peer's partials of them and are reduced
       * in their epilogue, whatever K, the partials and the tile count (by default: fp32 below
       * K 4096 with at least 3 waves of tiles, as the m 2048 n 8192 default case); same bits.
       * Other worlds and shapes fall back to the reduce CTAs. */
      {"TW_RS_OWNER_EPI",
       "1",
       NULL,
       TW_PARTIALS_FP32,
       {{128, 264, 200, 0}, {1024, 1024, 4096, 2}, {256, 1032, 128, 0}},
       187,
       2,
       1},
      {"TW_RS_OWNER_EPI",
       "1",
       "3",
       TW_PARTIALS_BF16,
       {{128, 264, 200, 0}, {512, 1800, 512, 0}, {100, 264, 200, 0}},
       188,
       2,
       1},
      /* TW_RS_OWNER_EPI=0: the reduce CTAs where the default takes the owner epilogue. */
      {"TW_RS_OWNER_EPI",
       "0",
       NULL,
       TW_PARTIALS_FP32,
       {{128, 264, 200, 0}, {1024, 1024, 512, 0}, {256, 1032, 128, 0}},
       189,
       2,
       1},
      /* TW_RS_REDUCE_CTAS=0: no CTA starts on the reduction; every CTA runs its GEMM tiles,
       * then reduces (and gathers) through the queues; same bits. */
      {"TW_RS_REDUCE_CTAS",
       "0",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {1024, 1024, 512, 0}, {1, 8, 8, 0}},
       181,
       4,
       1},
      /* TW_PARTIALS_BF16: bf16 partials, fp32 rank-ordered sum; bitwise the unfused pipeline
       * with bf16 GEMM output. The default path, then pull and the direct all-reduce. */
      {NULL,
       "",
       NULL,
       TW_PARTIALS_BF16,
       {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {1, 8, 8, 0}},
       110,
       4,
       1},
      {"TW_RS_PULL",
       "1",
       NULL,
       TW_PARTIALS_BF16,
       {{300, 520, 1032, 0}, {1000, 512, 256, 3}, {128, 256, 256, 0}},
       120,
       3,
       0},
      {"TW_AR_DIRECT",
       "1",
       NULL,
       TW_PARTIALS_BF16,
       {{16, 264, 200, 0}, {100, 520, 1032, 2}, {1, 8, 8, 0}},
       130,
       2,
       0},
      /* TW_RS_UNFUSED_SMALL=1: tw_gemm into the workspace, then the reduce kernel, at every
       * shape (the default takes it at m <= 256 on distinct GPUs); same bits, fp32 and bf16
       * partials; =0: the fused kernel where the default would not. */
      {"TW_RS_UNFUSED_SMALL",
       "1",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
       260,
       4,
       1},
      {"TW_RS_UNFUSED_SMALL",
       "1",
       NULL,
       TW_PARTIALS_BF16,
       {{128, 520, 256, 0}, {300, 1032, 264, 1}, {1, 8, 8, 0}},
       270,
       3,
       0},
      {"TW_RS_UNFUSED_SMALL",
       "0",
       NULL,
       TW_PARTIALS_FP32,
       {{16, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
       280,
       2,
       1},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    run_env_cases(&cases[i], small, seed);
  /* the unfused pipeline into symmetric outputs (tw_gemm_ar pushes into every rank's out); same
   * bits */
  setenv("TW_RS_UNFUSED_SMALL", "1", 1);
  static const env_cases_t unfused_cases[] = {
      {"TW_TEST_OUT_SYMMETRIC",
       "1",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
       290,
       3,
       1},
      {NULL,
       "",
       NULL,
       TW_PARTIALS_BF16,
       {{100, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
       297,
       3,
       1},
      /* tw_gemm_ar into plain outs through a gather area and a copy where every rank shares
       * this process and GPU (the default there stores into the peers' outs, TW_AR_PEER_OUT;
       * the first two shapes are too large for the low-latency area, so the reduce kernel runs) */
      {"TW_AR_PEER_OUT",
       "0",
       NULL,
       TW_PARTIALS_FP32,
       {{300, 1032, 264, 0}, {256, 1024, 512, 0}, {1, 8, 8, 0}},
       296,
       3,
       1},
      /* the pull (the default exchanges through the comm's low-latency area where the rows
       * fit: here at world 2-4 for the first two shapes, world 8 for the first) */
      {"TW_RS_UNFUSED_LL",
       "0",
       NULL,
       TW_PARTIALS_FP32,
       {{100, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
       298,
       3,
       1},
      {"TW_RS_UNFUSED_LL",
       "0",
       NULL,
       TW_PARTIALS_BF16,
       {{64, 1032, 264, 0}, {8, 8192, 520, 0}, {1, 8, 8, 0}},
       299,
       2,
       0},
      /* through the area at swap-AB shapes (m <= 64 up to world 4): the GEMM's epilogue stores
       * the words; both partials */
      {NULL,
       "",
       NULL,
       TW_PARTIALS_FP32,
       {{8, 1032, 264, 0}, {16, 8192, 520, 0}, {3, 1000, 72, 0}},
       300,
       2,
       1},
      {NULL,
       "",
       NULL,
       TW_PARTIALS_BF16,
       {{16, 8192, 1032, 0}, {5, 520, 4104, 0}, {1, 8, 8, 0}},
       301,
       2,
       1},
      /* tw_gemm_rs's own rows summed in that epilogue (TW_RS_LL_REDUCE=1; tw_gemm_ar as
       * before), both partials, back-to-back calls (rs and ar in turn) and a graph */
      {"TW_RS_LL_REDUCE",
       "1",
       NULL,
       TW_PARTIALS_FP32,
       {{8, 1032, 264, 0}, {16, 8192, 520, 0}, {3, 1000, 72, 0}},
       303,
       2,
       1},
      {"TW_RS_LL_REDUCE",
       "1",
       NULL,
       TW_PARTIALS_BF16,
       {{16, 8192, 1032, 0}, {5, 520, 4104, 0}, {1, 8, 8, 0}},
       304,
       4,
       1},
  };
  for (size_t i = 0; i < sizeof(unfused_cases) / sizeof(unfused_cases[0]); i++)
    run_env_cases(&unfused_cases[i], small, seed);
  /* swap-AB forced past m 64 (TW_GEMM_SWAP=1 or 2 reach m 128: at world 2 the shapes' m 128, 100
   * and 66 run two 64-wide tiles of tokens), its low-latency epilogue through the area wherever
   * the rows fit (TW_RS_UNFUSED_LL=1); larger worlds' m past 128 unswapped */
  static const env_cases_t swap_cases[] = {
      {"TW_GEMM_SWAP",
       "1",
       NULL,
       TW_PARTIALS_BF16,
       {{64, 8192, 1032, 0}, {50, 520, 264, 0}, {33, 1000, 72, 0}},
       305,
       2,
       1},
      {"TW_GEMM_SWAP",
       "2",
       NULL,
       TW_PARTIALS_FP32,
       {{64, 1032, 264, 0}, {40, 8192, 520, 0}, {3, 1000, 72, 0}},
       306,
       2,
       0},
  };
  setenv("TW_RS_UNFUSED_LL", "1", 1);
  for (size_t i = 0; i < sizeof(swap_cases) / sizeof(swap_cases[0]); i++)
    run_env_cases(&swap_cases[i], small, seed);
  unsetenv("TW_RS_UNFUSED_LL");
  /* 1000 back-to-back calls of the unfused pipeline with fresh inputs (rs and ar alternating),
   * on 2 ranks: the distinct GPUs under TW_TEST_DEVICES=distinct */
  test_back_to_back(2, small ? 20 : 1000, seed + 7500);
  /* and at a swap-AB shape (m 32: the GEMM's epilogue stores the low-latency words), so the
   * area's two halves turn over hundreds of times with fresh data */
  test_back_to_back_at(2, small ? 20 : 500, 16, seed + 7600);
  /* the same with tw_gemm_rs's own rows summed in the GEMM's epilogue (TW_RS_LL_REDUCE=1),
   * rs and ar in turn on one comm, on 2 and 8 ranks (m 64: 8 rows a rank) */
  setenv("TW_RS_LL_REDUCE", "1", 1);
  test_back_to_back_at(2, small ? 20 : 500, 16, seed + 7700);
  test_back_to_back_at(small ? 2 : 8, small ? 20 : 200, 8, seed + 7800);
  unsetenv("TW_RS_LL_REDUCE");
  unsetenv("TW_RS_UNFUSED_SMALL");
  for (int wi = 1; wi < (small ? 2 : 5); wi++) /* worlds 2, 3, 4, 8 */
    test_unfused_mixed(worlds[wi], small ? 16 : 64, seed + 7000 + wi);
  g_partials = TW_PARTIALS_BF16;
  test_case(1, 300, 520, 1032, 0, seed + 140); /* world 1: the plain GEMM either way */
  g_partials = TW_PARTIALS_FP32;
  /* TW_RS_FUSED_W1=1: world 1 through the fused kernel (for profiling); the same bits, fp32
   * and bf16 partials, with and without reduce CTAs at the start. */
  setenv("TW_RS_FUSED_W1", "1", 1);
  test_case(1, 300, 520, 1032, 0, seed + 150);
  test_case(1, 1024, 1024, 512, 2, seed + 151);
  setenv("TW_RS_REDUCE_CTAS", "0", 1);
  test_case(1, 1000, 512, 256, 0, seed + 152);
  unsetenv("TW_RS_REDUCE_CTAS");
  g_partials = TW_PARTIALS_BF16;
  test_case(1, 300, 520, 1032, 0, seed + 153);
  g_partials = TW_PARTIALS_FP32;
  unsetenv("TW_RS_FUSED_W1");
  test_bad_arguments();
  return tw_test_finish();
}
