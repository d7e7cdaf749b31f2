/*
 * The checks of tw_gemm_rs and tw_gemm_ar on virtual ranks (tw_test_gemm_rs.h says what each
 * does), shared by test_gemm_rs.cu (the fused kernel) and test_gemm_rs_unfused.cu (the
 * pipeline at small m).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "ref/ref_gemm.h"
#include "ref/ref_reduce.h"
#include "tw_test.h"
#include "tw_test_gemm_rs.h"

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

int rs_partials = TW_PARTIALS_FP32;
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

static void use(const fixture *f, int r) { TEST_CUDA_OK(cudaSetDevice(f->devices[r])); }

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
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&f->streams[r], cudaStreamNonBlocking));
    TEST_CUDA_OK(cudaEventCreateWithFlags(&f->events[r], cudaEventDisableTiming));
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], ws_bytes, &f->ws[r]) == TW_SUCCESS, "alloc ws");
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], mn * 4, (void **)&f->partial[r]) == TW_SUCCESS, "alloc");
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], mn * 2, &f->out2[r]) == TW_SUCCESS, "alloc");
    TEST_CUDA_OK(cudaMalloc(&f->a[r], (size_t)f->m * k * 2));
    TEST_CUDA_OK(cudaMalloc(&f->b[r], (size_t)n * k * 2));
    if (g_out_sym)
      TEST_REQUIRE(tw_mem_alloc(f->comms[r], mn * 2, &f->out[r]) == TW_SUCCESS, "alloc out");
    else
      TEST_CUDA_OK(cudaMalloc(&f->out[r], mn * 2));
    TEST_CUDA_OK(cudaMalloc(&f->bad[r], sizeof(unsigned long long)));
    TEST_CUDA_OK(cudaMemset(f->bad[r], 0, sizeof(unsigned long long)));
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
  a.partials = rs_partials;
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
  const int bf16 = rs_partials == TW_PARTIALS_BF16;
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
  TEST_CUDA_OK(cudaMemcpy(stage, p, bytes, cudaMemcpyDefault));
  return stage;
}

static void check_async_errors(fixture *f) {
  for (int r = 0; r < f->world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(f->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "rank %d: %s", r, tw_comm_last_error(f->comms[r]));
  }
}

void rs_test_case(int world, int64_t m_local, int64_t n, int64_t k, int reduce_sms, uint64_t seed) {
  fixture f;
  if (getenv("TW_TEST_VERBOSE"))
    fprintf(stderr, "case: world %d m_local %lld n %lld k %lld reduce_sms %d\n", world,
            (long long)m_local, (long long)n, (long long)k, reduce_sms);
  setup(&f, world, m_local, n, k);
  const size_t mn = (size_t)f.m * n;
  float *ref = NULL, *tmp = NULL, *scale = NULL;
  void *stage_a = NULL, *stage_b = NULL, *stage_out = NULL; /* rank 0's GPU */
  TEST_CUDA_OK(cudaMalloc(&ref, mn * 4));
  TEST_CUDA_OK(cudaMalloc(&tmp, mn * 4));
  TEST_CUDA_OK(cudaMalloc(&scale, mn * 4));
  if (f.multi_gpu) {
    TEST_CUDA_OK(cudaMalloc(&stage_a, (size_t)f.m * k * 2));
    TEST_CUDA_OK(cudaMalloc(&stage_b, (size_t)n * k * 2));
    TEST_CUDA_OK(cudaMalloc(&stage_out, mn * 2));
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
      TEST_CUDA_OK(cudaDeviceSynchronize()); /* the stages are reused */
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
           rs_partials == TW_PARTIALS_BF16 ? " bf16 partials" : "", diff, worst);
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
void rs_test_back_to_back_at(int world, int calls, int64_t m_local, uint64_t seed) {
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

void rs_test_back_to_back(int world, int calls, uint64_t seed) {
  rs_test_back_to_back_at(world, calls, 200, seed);
}

/* Calls of different shapes on one comm (as a model's layers make them): tw_gemm_ar with one
 * unit group per owner, then with eight, then back. Until the fifth session the all-reduce's
 * ready flags sat right after the call's own counters, so a call with more groups found the
 * earlier calls' epochs in its counters and reduced before the partials landed. Enough calls
 * first that the stale epochs reach the counters' target (world), and as many reduce CTAs as
 * groups, so they all claim at once. */
void rs_test_shape_changes(int world, uint64_t seed) {
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
void rs_test_unfused_mixed(int world, int calls, uint64_t seed) {
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

void rs_test_graph(int world, int replays, uint64_t seed) {
  fixture f;
  setup(&f, world, 256, 512, 512);
  if (f.multi_gpu) { /* poisoning from one stream in the graph: a test for ranks of one GPU */
    printf("  graph replay: not run with ranks on distinct GPUs\n");
    teardown(&f);
    return;
  }
  fill_inputs(&f, seed);
  TEST_CUDA_OK(cudaDeviceSynchronize());
  cudaStream_t s0 = f.streams[0];
  cudaGraphExec_t exec = (cudaGraphExec_t)tw_test_capture((struct CUstream_st **)f.streams, world,
                                                          NULL, graph_calls, &f);
  for (int i = 0; i < replays; i++) {
    for (int r = 0; r < world; r++)
      tw_test_poison(f.out[r], (size_t)f.m * f.n * 2, (tw_stream_t)s0);
    TEST_CUDA_OK(cudaGraphLaunch(exec, s0));
  }
  TEST_CUDA_OK(cudaStreamSynchronize(s0));
  enqueue_unfused(&f, 1);
  TEST_CUDA_OK(cudaDeviceSynchronize());
  size_t diff = 0;
  for (int r = 0; r < world; r++)
    diff += tw_test_count_diff(f.out[r], f.out2[r], out_bytes(&f, 1));
  TEST_ASSERT(diff == 0, "graph replays: %zu bytes differ", diff);
  check_async_errors(&f);
  cudaGraphExecDestroy(exec);
  printf("  world %d: %d graph replays of rs + ar\n", world, replays);
  teardown(&f);
}

void rs_test_bad_arguments(void) {
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

void rs_run_env_cases(const rs_env_cases_t *c, int small, uint64_t seed) {
  static const int worlds[] = {2, 3, 4, 8};
  if (c->name)
    setenv(c->name, c->value, 1);
  if (c->band)
    setenv("TW_RS_BAND", c->band, 1);
  rs_partials = c->partials;
  printf("%s=%s%s%s%s:\n", c->name ? c->name : "(no knob)", c->value,
         c->band ? ", TW_RS_BAND=" : "", c->band ? c->band : "",
         rs_partials == TW_PARTIALS_BF16 ? ", bf16 partials" : "");
  for (int wi = 0; wi < 4; wi++)
    for (int i = 0; i < (small ? 1 : 3); i++)
      rs_test_case(worlds[wi], c->shapes[i].m_local, c->shapes[i].n, c->shapes[i].k,
                   c->shapes[i].reduce_sms, seed + (c->seed_step + (uint64_t)i) * worlds[wi]);
  rs_test_back_to_back(small ? 2 : c->b2b_world, small ? 20 : 200, seed + 100 * c->seed_step);
  if (c->graph)
    rs_test_graph(small ? 2 : 4, 10, seed + 100 * c->seed_step + 50);
  if (c->name)
    unsetenv(c->name);
  if (c->band)
    unsetenv("TW_RS_BAND");
  rs_partials = TW_PARTIALS_FP32;
}
