/*
 * tw_ag_gemm on virtual ranks (one GPU): for worlds 1, 2, 3, 4, 8 and shapes
 * with tails, the fused C equals, bitwise, the unfused pipeline built from the
 * same core (tw_allgather, then tw_gemm), the gathered A equals the shards, and C
 * is within bf16 tolerance of an fp32 reference; 1000 back-to-back calls with
 * changing inputs, each checked on the GPU against the unfused pipeline; a CUDA
 * graph replay; bad arguments. `--small` runs a reduced set. TW_TEST_DEVICES=distinct puts
 * rank r on GPU r % (number of GPUs).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "ref/ref_gemm.h"
#include "tw_test.h"

typedef struct {
  int world;
  int64_t m_local, n, k;
  tw_dtype_t c_dtype;
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *a[TW_MAX_WORLD];         /* shards (plain memory) */
  void *gathered[TW_MAX_WORLD];  /* symmetric, fused */
  void *gathered2[TW_MAX_WORLD]; /* symmetric, unfused allgather */
  void *b[TW_MAX_WORLD];
  void *c[TW_MAX_WORLD];
  void *c2[TW_MAX_WORLD];
  unsigned long long *bad[TW_MAX_WORLD]; /* a counter per rank, on its GPU */
  int devices[TW_MAX_WORLD];
  int multi_gpu; /* ranks on distinct GPUs (TW_TEST_DEVICES=distinct) */
} fixture;

static void use(const fixture *f, int r) { TEST_CUDA_OK(cudaSetDevice(f->devices[r])); }

static void sync_all(const fixture *f) { tw_test_sync_devices(f->devices, f->world); }

static size_t c_bytes(const fixture *f) {
  return (size_t)f->m_local * f->world * f->n * (f->c_dtype == TW_BF16 ? 2 : 4);
}

static void setup(fixture *f, int world, int64_t m_local, int64_t n, int64_t k, tw_dtype_t c_dtype,
                  int sm_budget) {
  memset(f, 0, sizeof(*f));
  f->world = world, f->m_local = m_local, f->n = n, f->k = k, f->c_dtype = c_dtype;
  f->multi_gpu = tw_test_devices(world, f->devices);
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.sm_budget = sm_budget;
  tw_status_t st = tw_comm_init_all(f->comms, world, f->devices, &cfg);
  TEST_REQUIRE(st == TW_SUCCESS, "init_all(%d): %s", world, tw_last_error());
  size_t shard = (size_t)m_local * k * 2;
  for (int r = 0; r < world; r++) {
    use(f, r);
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&f->streams[r], cudaStreamNonBlocking));
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], shard * world, &f->gathered[r]) == TW_SUCCESS, "alloc");
    TEST_REQUIRE(tw_mem_alloc(f->comms[r], shard * world, &f->gathered2[r]) == TW_SUCCESS, "alloc");
    TEST_CUDA_OK(cudaMalloc(&f->a[r], shard));
    TEST_CUDA_OK(cudaMalloc(&f->b[r], (size_t)n * k * 2));
    TEST_CUDA_OK(cudaMalloc(&f->c[r], c_bytes(f)));
    TEST_CUDA_OK(cudaMalloc(&f->c2[r], c_bytes(f)));
    TEST_CUDA_OK(cudaMalloc(&f->bad[r], sizeof(unsigned long long)));
    TEST_CUDA_OK(cudaMemset(f->bad[r], 0, sizeof(unsigned long long)));
  }
  use(f, 0);
}

static void teardown(fixture *f) {
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    cudaFree(f->a[r]), cudaFree(f->b[r]), cudaFree(f->c[r]), cudaFree(f->c2[r]),
        cudaFree(f->bad[r]);
    TEST_TW_OK(tw_mem_free(f->comms[r], f->gathered[r]));
    TEST_TW_OK(tw_mem_free(f->comms[r], f->gathered2[r]));
  }
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    cudaStreamDestroy(f->streams[r]);
    TEST_TW_OK(tw_comm_destroy(f->comms[r]));
  }
  use(f, 0);
}

static tw_ag_gemm_args_t fused_args(const fixture *f, int r, int in_place) {
  tw_ag_gemm_args_t a = TW_AG_GEMM_ARGS_INIT;
  a.c_dtype = f->c_dtype;
  a.a = in_place ? (char *)f->gathered[r] + (size_t)r * f->m_local * f->k * 2 : f->a[r];
  a.b = f->b[r];
  a.c = f->c[r];
  a.a_gathered = f->gathered[r];
  a.m_local = f->m_local, a.n = f->n, a.k = f->k;
  return a;
}

/* tw_gemm's split_k in the unfused pipeline: the op's GEMM splits K by the shape (-1) where it
 * runs unfused itself (few tiles, long K) and at world 1, unless TW_AG_UNFUSED_SMALL=0. */
static int32_t ref_split_k(void) {
  const char *v = getenv("TW_AG_UNFUSED_SMALL");
  return v && atoi(v) == 0 ? 0 : -1;
}

/* Unfused pipeline from the same core: tw_allgather, then tw_gemm. */
static void enqueue_unfused(fixture *f, int r) {
  use(f, r); /* tw_gemm runs on the current device */
  TEST_TW_OK(tw_allgather(f->comms[r], f->a[r], f->gathered2[r], (size_t)f->m_local * f->k * 2,
                          (tw_stream_t)f->streams[r]));
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.c_dtype = f->c_dtype;
  g.a = f->gathered2[r], g.b = f->b[r], g.c = f->c2[r];
  g.m = f->m_local * f->world, g.n = f->n, g.k = f->k;
  g.split_k = ref_split_k();
  /* Virtual ranks share the GPU: the unfused GEMM keeps to the rank's SM budget like the
   * fused op does (a full-GPU kernel would only delay the other ranks' persistent kernels). */
  TEST_TW_OK(tw_comm_sm_budget(f->comms[r], &g.sm_count));
  TEST_TW_OK(tw_gemm(&g, (tw_stream_t)f->streams[r]));
}

static void fill_inputs(fixture *f, uint64_t seed, int in_place) {
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    tw_stream_t s = (tw_stream_t)f->streams[r];
    tw_test_fill_bf16(f->a[r], (size_t)f->m_local * f->k, seed + 31 * r, s);
    /* The gathered output is poisoned every call: the fused op must write all of it. */
    tw_test_poison(f->gathered[r], (size_t)f->m_local * f->world * f->k * 2, s);
    if (in_place)
      TEST_CUDA_OK(cudaMemcpyAsync((char *)f->gathered[r] + (size_t)r * f->m_local * f->k * 2,
                                   f->a[r], (size_t)f->m_local * f->k * 2, cudaMemcpyDeviceToDevice,
                                   f->streams[r]));
    tw_test_fill_bf16(f->b[r], (size_t)f->n * f->k, seed + 1000 + r, s);
    tw_test_poison(f->c[r], c_bytes(f), s);
    tw_test_poison(f->c2[r], c_bytes(f), s);
  }
}

static void test_case(int world, int64_t m_local, int64_t n, int64_t k, tw_dtype_t c_dtype,
                      int in_place, int comm_sms, uint64_t seed) {
  fixture f;
  setup(&f, world, m_local, n, k, c_dtype, 0);
  fill_inputs(&f, seed, in_place);
  for (int r = 0; r < world; r++) {
    tw_ag_gemm_args_t a = fused_args(&f, r, in_place);
    a.comm_sms = comm_sms;
    TEST_TW_OK(tw_ag_gemm(f.comms[r], &a, (tw_stream_t)f.streams[r]));
  }
  for (int r = 0; r < world; r++)
    enqueue_unfused(&f, r);
  sync_all(&f);
  const int64_t m = m_local * world;
  size_t worst_diff = 0, worst_gather = 0;
  double worst_err = 0;
  for (int r = 0; r < world; r++) {
    use(&f, r); /* compare on the rank's GPU */
    worst_diff += tw_test_count_diff(f.c[r], f.c2[r], c_bytes(&f));
    worst_gather += tw_test_count_diff(f.gathered[r], f.gathered2[r], (size_t)m * k * 2);
    if (r == 0 || r == world - 1) {
      float *ref = NULL;
      TEST_CUDA_OK(cudaMalloc(&ref, (size_t)m * n * sizeof(float)));
      TEST_REQUIRE(tw_ref_gemm_fp32(f.gathered2[r], f.b[r], ref, m, n, k, k, k, n, 0) == TW_SUCCESS,
                   "ref gemm");
      TEST_CUDA_OK(cudaDeviceSynchronize());
      size_t nans = 0;
      double err;
      if (c_dtype == TW_BF16) {
        err = tw_test_rel_err_bf16(f.c[r], ref, 1, (size_t)m * n, &nans);
      } else {
        /* fp32 C: compare on the host. */
        float *host = (float *)malloc((size_t)m * n * 4),
              *href = (float *)malloc((size_t)m * n * 4);
        TEST_CUDA_OK(cudaMemcpy(host, f.c[r], (size_t)m * n * 4, cudaMemcpyDeviceToHost));
        TEST_CUDA_OK(cudaMemcpy(href, ref, (size_t)m * n * 4, cudaMemcpyDeviceToHost));
        double md = 0, mr = 0;
        for (size_t i = 0; i < (size_t)m * n; i++) {
          if (host[i] != host[i])
            nans++;
          double d = host[i] - href[i];
          md = d < 0 ? (-d > md ? -d : md) : (d > md ? d : md);
          mr = href[i] < 0 ? (-href[i] > mr ? -href[i] : mr) : (href[i] > mr ? href[i] : mr);
        }
        err = mr > 0 ? md / mr : md;
        free(host), free(href);
      }
      TEST_ASSERT(nans == 0, "world %d rank %d: %zu NaN/unwritten outputs", world, r, nans);
      if (err > worst_err)
        worst_err = err;
      cudaFree(ref);
    }
  }
  use(&f, 0);
  TEST_ASSERT(worst_diff == 0,
              "world %d m_local %lld n %lld k %lld %s: fused != unfused in %zu bytes", world,
              (long long)m_local, (long long)n, (long long)k, c_dtype == TW_BF16 ? "bf16" : "fp32",
              worst_diff);
  TEST_ASSERT(worst_gather == 0, "world %d: gathered A differs in %zu bytes", world, worst_gather);
  TEST_ASSERT(worst_err < (c_dtype == TW_BF16 ? 1e-2 : 2e-3), "world %d: rel err %.3g", world,
              worst_err);
  for (int r = 0; r < world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(f.comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "rank %d: %s", r, tw_comm_last_error(f.comms[r]));
  }
  printf("  world %d m_local %lld n %lld k %lld %s%s comm_sms %d: diff %zu, rel err %.2e\n", world,
         (long long)m_local, (long long)n, (long long)k, c_dtype == TW_BF16 ? "bf16" : "fp32",
         in_place ? " in-place" : "", comm_sms, worst_diff, worst_err);
  teardown(&f);
}

/* `calls` calls on every rank with fresh inputs and no host sync in between, each checked on
 * the GPU against the unfused pipeline; args as fused_args makes them, then comm_mode and
 * no_gathered_out. Returns the words that differed over all calls, after asserting that no
 * rank recorded an async error. */
static unsigned long long checked_calls(fixture *f, int calls, uint64_t seed, uint64_t seed_step,
                                        int in_place, int comm_mode, int no_gathered_out) {
  for (int i = 0; i < calls; i++) {
    fill_inputs(f, seed + (uint64_t)i * seed_step, in_place);
    for (int r = 0; r < f->world; r++) {
      tw_ag_gemm_args_t a = fused_args(f, r, in_place);
      a.comm_mode = comm_mode;
      a.no_gathered_out = no_gathered_out;
      TEST_TW_OK(tw_ag_gemm(f->comms[r], &a, (tw_stream_t)f->streams[r]));
      enqueue_unfused(f, r); /* leaves rank r's GPU current */
      tw_test_count_diff_async(f->c[r], f->c2[r], c_bytes(f), f->bad[r],
                               (tw_stream_t)f->streams[r]);
      if (!no_gathered_out) /* the gathered A too */
        tw_test_count_diff_async(f->gathered[r], f->gathered2[r],
                                 (size_t)f->m_local * f->world * f->k * 2, f->bad[r],
                                 (tw_stream_t)f->streams[r]);
    }
  }
  const unsigned long long bad = tw_test_take_counters(f->bad, f->devices, f->world);
  for (int r = 0; r < f->world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(f->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "rank %d: %s", r, tw_comm_last_error(f->comms[r]));
  }
  use(f, 0);
  return bad;
}

/* Many calls with fresh inputs, no host sync in between; each call checked on the GPU. */
static void test_back_to_back(int world, int calls, int64_t m_local, int64_t n, int64_t k,
                              uint64_t seed) {
  fixture f;
  setup(&f, world, m_local, n, k, TW_BF16, 0);
  double t0 = tw_test_now();
  const unsigned long long bad = checked_calls(&f, calls, seed, 7919, 0, TW_AG_COMM_SM, 0);
  TEST_ASSERT(bad == 0, "world %d: %d back-to-back calls: %llu words differ from unfused", world,
              calls, bad);
  printf("  world %d: %d back-to-back checked calls (m_local %lld n %lld k %lld) in %.2f s\n",
         world, calls, (long long)m_local, (long long)n, (long long)k, tw_test_now() - t0);
  teardown(&f);
}

/* The decode path (tw_allgather then the split-K tw_gemm, its slices through the comm's
 * workspace as single CTAs; on GPUs of their own the GEMM a programmatic dependent of the
 * allgather), bitwise the unfused pipeline: both allgathers (the low-latency area at <= 512 KiB
 * shards, the SM push at 1 MiB), 16- and 64-wide swap tiles, 8 and 4 slices, unswapped, in
 * place, and back-to-back decode calls (the workspace's counters turn over every call). */
static void test_decode(int small, uint64_t seed) {
  printf("decode path:\n");
  test_case(2, 8, 1024, 8192, TW_BF16, 0, 0, seed);
  test_case(2, 16, 1024, 8192, TW_BF16, 0, 0, seed + 10);
  test_case(2, 64, 1024, 8192, TW_FP32, 1, 0, seed + 20);
  test_case(3, 16, 2048, 4096, TW_FP32, 0, 0, seed + 30);
  test_case(3, 32, 2048, 4096, TW_BF16, 0, 0, seed + 40);
  test_case(4, 16, 1024, 8192, TW_BF16, 1, 0, seed + 50);
  test_back_to_back(2, small ? 10 : 200, 16, 1024, 8192, seed + 60);
}

/* no_gathered_out = 1: with every rank on one GPU and whole 128-row shards the GEMM reads the
 * peers' slots in place (else the push path runs). Fresh inputs every call, written into the
 * own slot in place when `in_place` while peers may still be reading the previous call's (the
 * exit barrier must prevent that): C bitwise equal to the unfused pipeline every call, and the
 * own slot holds the shard afterwards. */
static void test_no_gather(int world, int64_t m_local, int64_t n, int64_t k, int in_place,
                           int calls, uint64_t seed) {
  fixture f;
  setup(&f, world, m_local, n, k, TW_BF16, 0);
  const unsigned long long bad = checked_calls(&f, calls, seed, 7727, in_place, TW_AG_COMM_SM, 1);
  size_t own_diff = 0;
  const size_t shard = (size_t)m_local * k * 2;
  for (int r = 0; r < world; r++) {
    use(&f, r);
    own_diff += tw_test_count_diff((char *)f.gathered[r] + (size_t)r * shard, f.a[r], shard);
  }
  use(&f, 0);
  TEST_ASSERT(bad == 0, "no_gathered_out, world %d m_local %lld%s: %llu words differ over %d calls",
              world, (long long)m_local, in_place ? " in place" : "", bad, calls);
  TEST_ASSERT(own_diff == 0, "no_gathered_out, world %d: own slot differs in %zu bytes", world,
              own_diff);
  printf("  no_gathered_out: world %d m_local %lld n %lld k %lld%s, %d checked calls\n", world,
         (long long)m_local, (long long)n, (long long)k, in_place ? " in place" : "", calls);
  teardown(&f);
}

/* What the graph holds: one tw_ag_gemm per rank, each on its stream. */
static int graph_no_gather; /* the graph's calls set no_gathered_out */

static void graph_calls(void *p) {
  fixture *f = (fixture *)p;
  for (int r = 0; r < f->world; r++) {
    tw_ag_gemm_args_t a = fused_args(f, r, 0);
    a.no_gathered_out = graph_no_gather;
    TEST_TW_OK(tw_ag_gemm(f->comms[r], &a, (tw_stream_t)f->streams[r]));
  }
}

static void test_graph(int world, int replays, int no_gather, uint64_t seed) {
  graph_no_gather = no_gather;
  fixture f;
  setup(&f, world, 256, 512, 512, TW_BF16, 0);
  if (f.multi_gpu) { /* poisoning from one stream in the graph: a test for ranks of one GPU */
    printf("  graph replay: not run with ranks on distinct GPUs\n");
    teardown(&f);
    return;
  }
  fill_inputs(&f, seed, 0);
  sync_all(&f);
  cudaStream_t s0 = f.streams[0];
  cudaGraphExec_t exec = (cudaGraphExec_t)tw_test_capture((struct CUstream_st **)f.streams, world,
                                                          NULL, graph_calls, &f);
  for (int i = 0; i < replays; i++) {
    for (int r = 0; r < world; r++)
      tw_test_poison(f.c[r], c_bytes(&f), (tw_stream_t)s0);
    TEST_CUDA_OK(cudaGraphLaunch(exec, s0));
  }
  TEST_CUDA_OK(cudaStreamSynchronize(s0));
  for (int r = 0; r < world; r++)
    enqueue_unfused(&f, r);
  TEST_CUDA_OK(cudaDeviceSynchronize());
  size_t diff = 0;
  for (int r = 0; r < world; r++)
    diff += tw_test_count_diff(f.c[r], f.c2[r], c_bytes(&f));
  TEST_ASSERT(diff == 0, "graph replays: %zu bytes differ", diff);
  for (int r = 0; r < world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(f.comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "rank %d: %s", r, tw_comm_last_error(f.comms[r]));
  }
  cudaGraphExecDestroy(exec);
  teardown(&f);
}

/* Copy-engine mode: same result as the unfused pipeline, call after call; refused under
 * graph capture. */
static void test_copy_engine(int world, int64_t m_local, int64_t n, int64_t k, int calls,
                             uint64_t seed) {
  fixture f;
  setup(&f, world, m_local, n, k, TW_BF16, 0);
  int shared = 0; /* some ranks share a GPU: the mode is refused there */
  for (int r = 0; r < world; r++)
    for (int q = 0; q < r; q++)
      shared |= f.devices[q] == f.devices[r];
  if (shared) {
    tw_ag_gemm_args_t a = fused_args(&f, 0, 0);
    a.comm_mode = TW_AG_COMM_COPY_ENGINE;
    use(&f, 0);
    TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, (tw_stream_t)f.streams[0]), TW_ERR_NOT_SUPPORTED,
                  "own GPU");
    printf("  copy engine: world %d with ranks sharing a GPU: refused\n", world);
    teardown(&f);
    return;
  }
  const unsigned long long bad =
      checked_calls(&f, calls, seed, 104729, 0, TW_AG_COMM_COPY_ENGINE, 0);
  size_t gather_diff = 0;
  for (int r = 0; r < world; r++) {
    use(&f, r);
    gather_diff +=
        tw_test_count_diff(f.gathered[r], f.gathered2[r], (size_t)m_local * world * k * 2);
  }
  use(&f, 0);
  TEST_ASSERT(bad == 0,
              "copy engine, world %d m_local %lld: %llu words differ from unfused over %d calls",
              world, (long long)m_local, bad, calls);
  TEST_ASSERT(gather_diff == 0, "copy engine, world %d: gathered A differs in %zu bytes", world,
              gather_diff);
  printf("  copy engine: world %d m_local %lld n %lld k %lld, %d checked calls\n", world,
         (long long)m_local, (long long)n, (long long)k, calls);
  /* The default mode (TW_AG_COMM_AUTO) made to take the copy engine (TW_AG_AUTO_CE=1): the
   * same results. */
  setenv("TW_AG_AUTO_CE", "1", 1);
  const unsigned long long bad_auto =
      checked_calls(&f, calls, seed + 1, 104723, 0, TW_AG_COMM_AUTO, 0);
  TEST_ASSERT(bad_auto == 0, "auto (copy engine), world %d: %llu words differ over %d calls", world,
              bad_auto, calls);
  /* A stream under capture: the copy-engine mode is refused and nothing is enqueued; the default
   * mode keeps the SMs there and is captured (the graph is not launched: its peers do not run). */
  cudaStream_t s0 = f.streams[0];
  use(&f, 0);
  TEST_CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeThreadLocal));
  tw_ag_gemm_args_t a = fused_args(&f, 0, 0);
  a.comm_mode = TW_AG_COMM_COPY_ENGINE;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, (tw_stream_t)s0), TW_ERR_NOT_SUPPORTED, "graph");
  a.comm_mode = TW_AG_COMM_AUTO;
  TEST_TW_OK(tw_ag_gemm(f.comms[0], &a, (tw_stream_t)s0));
  cudaGraph_t graph;
  TEST_CUDA_OK(cudaStreamEndCapture(s0, &graph));
  size_t nodes = 0;
  TEST_CUDA_OK(cudaGraphGetNodes(graph, NULL, &nodes));
  TEST_ASSERT(nodes > 0, "auto under capture: the graph holds %zu nodes", nodes);
  cudaGraphDestroy(graph);
  unsetenv("TW_AG_AUTO_CE");
  printf("  auto mode with TW_AG_AUTO_CE=1: %d checked calls by copy engine, SMs under capture\n",
         calls);
  teardown(&f);
}

static void test_bad_arguments(void) {
  fixture f;
  setup(&f, 2, 128, 256, 256, TW_BF16, 0);
  tw_stream_t s = (tw_stream_t)f.streams[0];
  tw_ag_gemm_args_t a = fused_args(&f, 0, 0);
  TEST_TW_FAILS(tw_ag_gemm(NULL, &a, s), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], NULL, s), TW_ERR_INVALID_ARGUMENT, "args");
  a.k = 100;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->k");
  a = fused_args(&f, 0, 0);
  a.n = 12;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->n");
  a = fused_args(&f, 0, 0);
  a.m_local = 0;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->m_local");
  a = fused_args(&f, 0, 0);
  a.a_gathered = f.a[1]; /* not symmetric */
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "a_gathered");
  a = fused_args(&f, 0, 0);
  a.m_local = 4096; /* gathered buffer too small */
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "past the end");
  a = fused_args(&f, 0, 0);
  a.b = (char *)f.b[0] + 2;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->b");
  a = fused_args(&f, 0, 0);
  a.c = NULL;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->c");
  a = fused_args(&f, 0, 0);
  a.comm_mode = 7;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->comm_mode");
  a = fused_args(&f, 0, 0);
  a.size = 8;
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "args->size");
  a = fused_args(&f, 0, 0);
  a.a = (char *)f.gathered[0] + 64; /* overlaps the gathered buffer, wrong place */
  TEST_TW_FAILS(tw_ag_gemm(f.comms[0], &a, s), TW_ERR_INVALID_ARGUMENT, "overlaps");
  /* Nothing was launched: a valid call on both ranks still completes. */
  for (int r = 0; r < 2; r++) {
    a = fused_args(&f, r, 0);
    TEST_TW_OK(tw_ag_gemm(f.comms[r], &a, (tw_stream_t)f.streams[r]));
  }
  sync_all(&f);
  teardown(&f);
}

/* TW_AG_PEER_GATHER=1, 2 and 0 (every rank on one GPU, shards of whole 128-row blocks): the GEMM
 * reads the peers' slots in place and column block 0's tiles write the A boxes they load through to
 * a_gathered; same bits (C and the gathered output, poisoned before every call). K tails (a
 * last A box partly out of bounds), one column block, fp32 output; m_local 100 and 300 fall
 * back to the push (tests/host/test_plans_gemm.c checks where the plan takes it); in place,
 * no_gather and graph cases too. */
static void test_peer_gather(int small, uint64_t seed) {
  static const struct {
    int world;
    int64_t m_local, n, k;
    tw_dtype_t dtype;
    int in_place, comm_sms;
  } cases[] = {{2, 128, 256, 256, TW_BF16, 0, 0},    {4, 256, 520, 1032, TW_BF16, 1, 0},
               {8, 384, 256, 512, TW_FP32, 0, 3},    {8, 256, 512, 256, TW_BF16, 0, 0},
               {3, 100, 264, 200, TW_BF16, 0, 0},    {8, 300, 256, 1032, TW_BF16, 0, 0},
               {2, 1024, 1024, 2048, TW_FP32, 0, 3}, {3, 256, 136, 1000, TW_BF16, 0, 0}};
  /* 1 forces it at every N; 0 the push (the default takes the write-through at N <= 4096, so
   * the other tests cover it too where ranks share the GPU). */
  static const char *const modes[] = {"1", "2", "0"}; /* 2: every tile stores its share */
  for (int m = 0; m < 3; m++) {
    setenv("TW_AG_PEER_GATHER", modes[m], 1);
    printf("TW_AG_PEER_GATHER=%s:\n", modes[m]);
    const uint64_t base = seed + 100 * (uint64_t)m;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
      test_case(cases[i].world, cases[i].m_local, cases[i].n, cases[i].k, cases[i].dtype,
                cases[i].in_place, cases[i].comm_sms, base + i);
    test_no_gather(4, 100, 256, 256, 1, small ? 5 : 20, base + 50);
    test_graph(small ? 2 : 4, 10, 0, base + 60);
  }
  unsetenv("TW_AG_PEER_GATHER");
}

int main(int argc, char **argv) {
  tw_test_require_hopper();
  int small = argc > 1 && strcmp(argv[1], "--small") == 0;
  uint64_t seed = tw_test_seed();
  static const int worlds[] = {1, 2, 3, 4, 8};
  for (int wi = 0; wi < 5; wi++) {
    int w = worlds[wi];
    test_case(w, 128, 256, 256, TW_BF16, 0, 0, seed + w);
    test_case(w, 100, 264, 200, TW_BF16, 0, 0,
              seed + 10 * w); /* tiles straddle shards, N/K tails */
    if (small)
      continue;
    test_case(w, 1, 8, 8, TW_BF16, 0, 0, seed + 20 * w);
    test_case(w, 300, 520, 1032, TW_FP32, 0, 0, seed + 30 * w);
    test_case(w, 1024, 1024, 2048, TW_BF16, 1, 0, seed + 40 * w);
    test_case(w, 1000, 512, 512, TW_BF16, 0, 3, seed + 50 * w);
  }
  if (!small) {
    test_case(2, 8192, 1024, 1024, TW_BF16, 0, 0, seed + 99); /* more chunks than CTAs */
    /* decode-sized (8 tiles of 128 x 128, K 8192): tw_allgather then a split-K tw_gemm */
    for (int wi = 1; wi < 5; wi++)
      test_case(worlds[wi], 64 / worlds[wi], 1024, 8192, TW_BF16, 0, 0, seed + 98 + wi);
  }
  test_back_to_back(small ? 2 : 4, small ? 20 : 1000, 200, 256, 256, seed + 5000);
  test_decode(small, seed + 9601);
  test_no_gather(2, 256, 264, 200, 1, small ? 10 : 200, seed + 5500);
  if (!small) {
    test_no_gather(3, 128, 512, 1032, 0, 100, seed + 5600);
    test_no_gather(8, 384, 256, 256, 1, 200, seed + 5700);
    test_no_gather(4, 100, 256, 256, 1, 50, seed + 5800); /* not whole row blocks: push */
  }
  test_graph(small ? 2 : 4, 10, 0, seed + 6000);
  test_graph(small ? 2 : 4, 10, 1, seed + 6100);
  test_copy_engine(2, 300, 256, 512, small ? 5 : 50, seed + 7000);
  if (!small) {
    test_copy_engine(3, 1000, 520, 1032, 20, seed + 7100);
    test_copy_engine(8, 256, 1024, 2048, 20, seed + 7200);
  }
  /* The kernel variants (TW_AG_VARIANT; the plan picks 1 on one GPU, 0 on distinct GPUs):
   * bitwise the same results. */
  for (int v = 0; v <= 1; v++) {
    char value[4];
    snprintf(value, sizeof(value), "%d", v);
    setenv("TW_AG_VARIANT", value, 1);
    printf("TW_AG_VARIANT=%d:\n", v);
    test_case(4, 100, 264, 200, TW_BF16, 0, 0, seed + 9000 + v);
    test_case(2, 1024, 1024, 2048, TW_FP32, 1, 3, seed + 9100 + v);
    test_no_gather(4, 256, 512, 512, 1, small ? 5 : 50, seed + 9200 + v);
  }
  unsetenv("TW_AG_VARIANT");
  /* TW_AG_OWN_COPY_CE=1: a copy engine fills the own slot beside the kernel where no tile
   * straddles shards (the CTAs still copy where one does: m_local 100); same bits, graphs
   * included. */
  setenv("TW_AG_OWN_COPY_CE", "1", 1);
  printf("TW_AG_OWN_COPY_CE=1:\n");
  test_graph(small ? 2 : 4, 10, 0, seed + 9303);
  test_case(1, 300, 264, 200, TW_BF16, 0, 0, seed + 9300);
  test_case(3, 100, 264, 200, TW_BF16, 0, 0, seed + 9301);
  test_case(2, 1024, 1024, 2048, TW_FP32, 0, 3, seed + 9302);
  test_case(4, 256, 512, 512, TW_BF16, 0, 0, seed + 9304);
  unsetenv("TW_AG_OWN_COPY_CE");
  /* TW_AG_UNFUSED_SMALL=0: the fused kernel where the op would run unfused (K tails, few
   * tiles; the peers' shards read in place), against the unsplit pipeline. */
  setenv("TW_AG_UNFUSED_SMALL", "0", 1);
  printf("TW_AG_UNFUSED_SMALL=0:\n");
  for (int wi = 0; wi < (small ? 2 : 5); wi++)
    test_case(worlds[wi], 300, 520, 1032, TW_FP32, 0, 0, seed + 9500 + wi);
  test_case(2, 32, 1024, 8192, TW_BF16, 0, 0, seed + 9510);
  test_no_gather(3, 128, 512, 1032, 0, small ? 10 : 100, seed + 9520);
  unsetenv("TW_AG_UNFUSED_SMALL");
  test_peer_gather(small, seed + 9400);
  test_bad_arguments();
  return tw_test_finish();
}
