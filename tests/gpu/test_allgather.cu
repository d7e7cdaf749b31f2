/*
 * tw_allgather on virtual ranks (one GPU): bitwise results for worlds 1, 2, 3,
 * 4, 8 and odd sizes; 100 back-to-back calls whose results each rank's stream
 * checks before the next call (a rank running ahead would corrupt them); a
 * captured CUDA graph replayed 10 times; a withheld signal that must end in an
 * async error within the timeout; argument errors. `--small` runs a reduced set
 * (for compute-sanitizer). TW_TEST_DEVICES=distinct puts rank r on GPU r % (number of GPUs).
 */
#include <cuda_runtime.h>

#include <string.h>

#include "tw_test.h"

static __device__ __forceinline__ uint32_t pattern(uint64_t seed, uint32_t iter, int src,
                                                   size_t word) {
  uint64_t x =
      seed ^ ((uint64_t)iter << 40) ^ ((uint64_t)src << 56) ^ (word * 0x9E3779B97F4A7C15ULL);
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 29;
  return (uint32_t)x;
}

/* iter_ptr: when non-NULL, the iteration is read from device memory (graph replays). */
static __global__ void fill_kernel(uint32_t *dst, size_t words, uint64_t seed, uint32_t iter,
                                   const uint32_t *iter_ptr, int src) {
  uint32_t it = iter_ptr ? *iter_ptr : iter;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = pattern(seed, it, src, i);
}

static __global__ void check_kernel(const uint32_t *recv, size_t words_per_rank, int world,
                                    uint64_t seed, uint32_t iter, const uint32_t *iter_ptr,
                                    unsigned long long *bad) {
  uint32_t it = iter_ptr ? *iter_ptr : iter;
  unsigned long long local = 0;
  size_t total = words_per_rank * (size_t)world;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x)
    local += recv[i] != pattern(seed, it, (int)(i / words_per_rank), i % words_per_rank);
  if (local)
    atomicAdd(bad, local);
}

static __global__ void bump_kernel(uint32_t *iter) { *iter += 1; }

typedef struct {
  int world;
  int multi_gpu; /* ranks on distinct GPUs (TW_TEST_DEVICES=distinct) */
  int devices[TW_MAX_WORLD];
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  void *recv[TW_MAX_WORLD];
  void *send[TW_MAX_WORLD];
  unsigned long long *bad[TW_MAX_WORLD]; /* a counter per rank, on its GPU */
  size_t bytes;
} fixture;

static void use(const fixture *f, int r) { TEST_CUDA_OK(cudaSetDevice(f->devices[r])); }

static void sync_all(const fixture *f) { tw_test_sync_devices(f->devices, f->world); }

static void setup(fixture *f, int world, size_t bytes, int in_place, int wait_timeout_ms) {
  memset(f, 0, sizeof(*f));
  f->world = world;
  f->bytes = bytes;
  f->multi_gpu = tw_test_devices(world, f->devices);
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.wait_timeout_ms = wait_timeout_ms;
  tw_status_t st = tw_comm_init_all(f->comms, world, f->devices, &cfg);
  TEST_REQUIRE(st == TW_SUCCESS, "init_all(%d): %s", world, tw_last_error());
  for (int r = 0; r < world; r++) {
    use(f, r);
    TEST_CUDA_OK(cudaStreamCreateWithFlags(&f->streams[r], cudaStreamNonBlocking));
    st = tw_mem_alloc(f->comms[r], bytes * world, &f->recv[r]);
    TEST_REQUIRE(st == TW_SUCCESS, "tw_mem_alloc: %s", tw_comm_last_error(f->comms[r]));
    if (in_place)
      f->send[r] = (char *)f->recv[r] + (size_t)r * bytes;
    else
      TEST_CUDA_OK(cudaMalloc(&f->send[r], bytes));
    TEST_CUDA_OK(cudaMalloc(&f->bad[r], sizeof(unsigned long long)));
    TEST_CUDA_OK(cudaMemset(f->bad[r], 0, sizeof(unsigned long long)));
  }
  use(f, 0);
}

static void teardown(fixture *f, int in_place) {
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    if (!in_place)
      cudaFree(f->send[r]);
    cudaFree(f->bad[r]);
    TEST_TW_OK(tw_mem_free(f->comms[r], f->recv[r]));
  }
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    cudaStreamDestroy(f->streams[r]);
    TEST_TW_OK(tw_comm_destroy(f->comms[r]));
  }
  use(f, 0);
}

/* One iteration on every rank's stream: fill send, allgather, check recv. */
static void enqueue_iteration(fixture *f, uint64_t seed, uint32_t iter, const uint32_t *iter_ptr) {
  size_t words = f->bytes / 4;
  for (int r = 0; r < f->world; r++) {
    use(f, r);
    fill_kernel<<<64, 256, 0, f->streams[r]>>>((uint32_t *)f->send[r], words, seed, iter, iter_ptr,
                                               r);
    TEST_TW_OK(
        tw_allgather(f->comms[r], f->send[r], f->recv[r], f->bytes, (tw_stream_t)f->streams[r]));
    check_kernel<<<64, 256, 0, f->streams[r]>>>((const uint32_t *)f->recv[r], words, f->world, seed,
                                                iter, iter_ptr, f->bad[r]);
  }
  use(f, 0);
}

static unsigned long long collect_bad(fixture *f) {
  return tw_test_take_counters(f->bad, f->devices, f->world);
}

static void expect_no_async_error(fixture *f) {
  for (int r = 0; r < f->world; r++) {
    tw_status_t async = TW_ERR_INTERNAL;
    TEST_TW_OK(tw_comm_async_error(f->comms[r], &async));
    TEST_ASSERT(async == TW_SUCCESS, "rank %d async error: %s", r, tw_comm_last_error(f->comms[r]));
  }
}

static void test_correctness(int world, size_t bytes, int in_place, uint64_t seed) {
  fixture f;
  setup(&f, world, bytes, in_place, 10000);
  for (int r = 0; r < world; r++) {
    use(&f, r);
    tw_test_poison(f.recv[r], bytes * world, (tw_stream_t)f.streams[r]);
  }
  sync_all(&f);
  enqueue_iteration(&f, seed, 0, NULL);
  unsigned long long bad = collect_bad(&f);
  TEST_ASSERT(bad == 0, "world %d bytes %zu in_place %d: %llu words differ", world, bytes, in_place,
              bad);
  expect_no_async_error(&f);
  teardown(&f, in_place);
}

/* mix: the low-latency area (TW_AG_LL=1) and the SM push (=0) in turn, two calls each */
static void test_back_to_back_mix(int world, size_t bytes, int calls, uint64_t seed, int mix) {
  fixture f;
  setup(&f, world, bytes, 0, 10000);
  double t0 = tw_test_now();
  for (int i = 0; i < calls; i++) {
    if (mix)
      setenv("TW_AG_LL", (i / 2) % 2 ? "0" : "1", 1); /* read when enqueued */
    enqueue_iteration(&f, seed, (uint32_t)i, NULL);
  }
  if (mix)
    unsetenv("TW_AG_LL");
  unsigned long long bad = collect_bad(&f);
  TEST_ASSERT(bad == 0, "world %d: %d back-to-back calls: %llu words wrong", world, calls, bad);
  printf("  world %d: %d back-to-back calls of %zu bytes in %.1f ms\n", world, calls, bytes,
         1e3 * (tw_test_now() - t0));
  expect_no_async_error(&f);
  teardown(&f, 0);
}

static void test_back_to_back(int world, size_t bytes, int calls, uint64_t seed) {
  test_back_to_back_mix(world, bytes, calls, seed, 0);
}

typedef struct {
  fixture *f;
  uint64_t seed;
  uint32_t *iter;
} graph_job;

/* Each replay first advances the iteration (read by every rank's fill and check)... */
static void graph_bump(void *p) {
  graph_job *j = (graph_job *)p;
  bump_kernel<<<1, 1, 0, j->f->streams[0]>>>(j->iter);
}

/* ...then every rank fills its shard, allgathers and checks. */
static void graph_iteration(void *p) {
  graph_job *j = (graph_job *)p;
  enqueue_iteration(j->f, j->seed, 0, j->iter);
}

static void test_graph(int world, size_t bytes, int replays, uint64_t seed) {
  fixture f;
  setup(&f, world, bytes, 0, 10000);
  if (f.multi_gpu) { /* the replay counter lives on GPU 0: this test is for ranks of one GPU */
    printf("  graph replay: not run with ranks on distinct GPUs\n");
    teardown(&f, 0);
    return;
  }
  uint32_t *iter;
  TEST_CUDA_OK(cudaMalloc(&iter, sizeof(uint32_t)));
  TEST_CUDA_OK(cudaMemset(iter, 0, sizeof(uint32_t)));
  graph_job job = {&f, seed, iter};
  cudaStream_t s0 = f.streams[0];
  cudaGraphExec_t exec = (cudaGraphExec_t)tw_test_capture((struct CUstream_st **)f.streams, world,
                                                          graph_bump, graph_iteration, &job);
  for (int i = 0; i < replays; i++)
    TEST_CUDA_OK(cudaGraphLaunch(exec, s0));
  unsigned long long bad = collect_bad(&f);
  uint32_t host_iter = 0;
  TEST_CUDA_OK(cudaMemcpy(&host_iter, iter, sizeof(host_iter), cudaMemcpyDeviceToHost));
  TEST_ASSERT(host_iter == (uint32_t)replays, "graph ran %u times, expected %d", host_iter,
              replays);
  TEST_ASSERT(bad == 0, "world %d: graph replayed %d times: %llu words wrong", world, replays, bad);
  expect_no_async_error(&f);
  cudaGraphExecDestroy(exec);
  cudaFree(iter);
  teardown(&f, 0);
}

/* Rank 1 never calls: rank 0's wait for its entry (its words, with TW_AG_LL=1) must time out,
 * not hang. */
static void test_withheld_signal(size_t bytes) {
  fixture f;
  const int timeout_ms = 500;
  setup(&f, 2, bytes, 0, timeout_ms);
  double t0 = tw_test_now();
  TEST_TW_OK(tw_allgather(f.comms[0], f.send[0], f.recv[0], f.bytes, (tw_stream_t)f.streams[0]));
  cudaError_t err = cudaStreamSynchronize(f.streams[0]);
  double waited = tw_test_now() - t0;
  TEST_ASSERT(err == cudaSuccess, "kernel should return, not trap: %s", cudaGetErrorString(err));
  TEST_ASSERT(waited < 5.0 * timeout_ms / 1e3 + 1.0, "returned after %.2f s (bound %d ms)", waited,
              timeout_ms);
  TEST_ASSERT(waited >= 0.9 * timeout_ms / 1e3, "returned after %.3f s, before the %d ms bound",
              waited, timeout_ms);
  tw_status_t async = TW_SUCCESS;
  TEST_TW_OK(tw_comm_async_error(f.comms[0], &async));
  const char *msg = tw_comm_last_error(f.comms[0]);
  TEST_ASSERT(async == TW_ERR_DEVICE_TIMEOUT, "async status %s (%s)", tw_status_string(async), msg);
  TEST_ASSERT(strstr(msg, "rank 0") && strstr(msg, "allgather") &&
                  strstr(msg, "peer expected to signal: 1"),
              "message lacks rank/op/peer: %s", msg);
  printf("  withheld signal -> after %.3f s: %s\n", waited, msg);
  /* The abort reached rank 1: its next call gives up at once instead of waiting. */
  t0 = tw_test_now();
  TEST_TW_OK(tw_allgather(f.comms[1], f.send[1], f.recv[1], f.bytes, (tw_stream_t)f.streams[1]));
  TEST_CUDA_OK(cudaStreamSynchronize(f.streams[1]));
  TEST_TW_OK(tw_comm_async_error(f.comms[1], &async));
  TEST_ASSERT(async == TW_ERR_ABORTED, "rank 1: %s", tw_comm_last_error(f.comms[1]));
  TEST_ASSERT(tw_test_now() - t0 < timeout_ms / 1e3, "rank 1 waited %.3f s after the abort",
              tw_test_now() - t0);
  teardown(&f, 0);
}

static void test_bad_arguments(void) {
  fixture f;
  setup(&f, 2, 4096, 0, 10000);
  tw_stream_t s = (tw_stream_t)f.streams[0];
  void *plain;
  TEST_CUDA_OK(cudaMalloc(&plain, 1 << 16));
  TEST_TW_FAILS(tw_allgather(NULL, f.send[0], f.recv[0], 4096, s), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_TW_FAILS(tw_allgather(f.comms[0], NULL, f.recv[0], 4096, s), TW_ERR_INVALID_ARGUMENT,
                "send");
  TEST_TW_FAILS(tw_allgather(f.comms[0], f.send[0], NULL, 4096, s), TW_ERR_INVALID_ARGUMENT,
                "recv");
  TEST_TW_FAILS(tw_allgather(f.comms[0], f.send[0], f.recv[0], 4000 + 8, s),
                TW_ERR_INVALID_ARGUMENT, "multiple of 16");
  TEST_TW_FAILS(tw_allgather(f.comms[0], (char *)f.send[0] + 8, f.recv[0], 1024, s),
                TW_ERR_INVALID_ARGUMENT, "aligned");
  TEST_TW_FAILS(tw_allgather(f.comms[0], f.send[0], plain, 1024, s), TW_ERR_INVALID_ARGUMENT,
                "tw_mem_alloc");
  TEST_TW_FAILS(tw_allgather(f.comms[0], f.send[0], f.recv[0], 1 << 20, s), TW_ERR_INVALID_ARGUMENT,
                "past the end");
  TEST_TW_FAILS(tw_allgather(f.comms[0], (char *)f.recv[0] + 4096, f.recv[0], 4096, s),
                TW_ERR_INVALID_ARGUMENT, "overlaps");
  TEST_ASSERT(strstr(tw_comm_last_error(f.comms[0]), "overlaps") != NULL, "comm message: %s",
              tw_comm_last_error(f.comms[0]));
  /* Nothing was launched: a valid call still works on both ranks. */
  for (int r = 0; r < 2; r++)
    TEST_TW_OK(tw_allgather(f.comms[r], f.send[r], f.recv[r], 4096, (tw_stream_t)f.streams[r]));
  sync_all(&f);
  expect_no_async_error(&f);
  cudaFree(plain);
  teardown(&f, 0);
}

static void test_barrier(int world) {
  fixture f;
  setup(&f, world, 4096, 0, 10000);
  for (int i = 0; i < 50; i++)
    for (int r = 0; r < world; r++)
      TEST_TW_OK(tw_barrier(f.comms[r], (tw_stream_t)f.streams[r]));
  sync_all(&f);
  expect_no_async_error(&f);
  teardown(&f, 0);
}

int main(int argc, char **argv) {
  tw_test_require_hopper();
  int small = argc > 1 && strcmp(argv[1], "--small") == 0;
  uint64_t seed = tw_test_seed();
  static const int worlds[] = {1, 2, 3, 4, 8};
  static const size_t sizes[] = {16, 4096 + 16, (3u << 20) + 48, 64u << 20};
  for (int wi = 0; wi < 5; wi++) {
    for (int si = 0; si < (small ? 2 : 4); si++) {
      test_correctness(worlds[wi], sizes[si], 0, seed + wi * 16 + si);
      test_correctness(worlds[wi], sizes[si], 1, seed + wi * 16 + si + 7);
    }
    printf("world %d: correctness done\n", worlds[wi]);
  }
  test_back_to_back(small ? 2 : 8, small ? 65536 : (1u << 20) + 16, small ? 10 : 100, seed + 1000);
  test_back_to_back(3, 65536 + 32, small ? 10 : 100, seed + 1001);
  test_graph(small ? 2 : 8, (1u << 20), 10, seed + 2000);
  test_barrier(small ? 2 : 8);
  test_bad_arguments();
  test_withheld_signal(1 << 20);
  /* through the low-latency area (TW_AG_LL=1; the default takes it for shards up to 512 KiB on
   * GPUs of their own): every world, in place or not, tails; calls mixed with the SM push on one
   * comm; graph replays; a peer that never calls */
  setenv("TW_AG_LL", "1", 1);
  static const size_t ll_sizes[] = {16, 4096 + 16, (256u << 10) + 48, 512u << 10};
  for (int wi = 1; wi < 5; wi++) {
    for (int si = 0; si < (small ? 2 : 4); si++) {
      test_correctness(worlds[wi], ll_sizes[si], 0, seed + 3000 + wi * 16 + si);
      test_correctness(worlds[wi], ll_sizes[si], 1, seed + 3000 + wi * 16 + si + 7);
    }
    printf("world %d: correctness through the low-latency area done\n", worlds[wi]);
  }
  test_graph(small ? 2 : 8, 65536, 10, seed + 3500);
  test_withheld_signal(65536);
  unsetenv("TW_AG_LL");
  test_back_to_back_mix(small ? 2 : 4, 65536 + 16, small ? 16 : 200, seed + 3600, 1);
  test_back_to_back_mix(3, 4096 + 32, small ? 16 : 200, seed + 3700, 1);
  return tw_test_finish();
}
