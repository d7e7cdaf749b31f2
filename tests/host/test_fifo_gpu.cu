/*
 * The command FIFO (transport/fifo.h) between a kernel and this thread as its proxy: 64 CTAs of
 * 4 posting threads each post 2000 commands through a ring of 256 slots while the host polls;
 * every command arrives exactly once, in ticket order, whole, each poster's in its own order
 * (the rate is printed). Then a ring nobody polls: the posters' bounded wait gives up after
 * TW_WAIT_TIMEOUT_MS, the kernel ends, and the comm reports the timeout. Among the host tests
 * because it links the library's internal objects (the FIFO is not exported); exits 77 without a
 * Hopper GPU.
 */
#include <cuda_runtime.h>

#include <string.h>

#include "device/fifo.cuh"
#include "runtime/comm.h"
#include "tw_test.h"

enum { kCtas = 64, kPostersPerCta = 4, kPerPoster = 2000 };

__global__ void post_kernel(const tw_fifo_dev_t f, const tw_dev_comm_t dc, int per_poster,
                            unsigned long long *failed) {
  if (threadIdx.x >= kPostersPerCta)
    return;
  const int poster = blockIdx.x * kPostersPerCta + threadIdx.x;
  for (int i = 0; i < per_poster; i++) {
    tw_fifo_cmd_t c;
    memset(&c, 0, sizeof(c));
    c.op = TW_FIFO_OP_TEST_ECHO;
    c.peer = poster;
    c.local_off = (uint64_t)i;
    c.bytes = (uint64_t)i * 5 + (uint64_t)poster;
    c.tag = (uint64_t)poster << 32 | (uint64_t)i;
    if (tw_fifo_post(f, dc, TW_CH_TEST, c) == ~0ull) {
      atomicAdd(failed, 1ull);
      return;
    }
  }
}

static tw_comm_t make_comm(void) {
  int device = 0;
  tw_comm_t comm = NULL;
  TEST_REQUIRE(tw_comm_init_all(&comm, 1, &device, NULL) == TW_SUCCESS, "init: %s",
               tw_last_error());
  return comm;
}

static void test_stream(void) {
  tw_comm_t comm = make_comm();
  tw_fifo_t f;
  TEST_TW_OK(tw_fifo_create(&f, 256));
  unsigned long long *failed = NULL;
  TEST_REQUIRE(cudaMalloc(&failed, 8) == cudaSuccess && cudaMemset(failed, 0, 8) == cudaSuccess,
               "counter");
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const int posters = kCtas * kPostersPerCta;
  const uint64_t want = (uint64_t)posters * kPerPoster;
  int *next = (int *)calloc((size_t)posters, sizeof(int));
  const double t0 = tw_test_now();
  post_kernel<<<kCtas, 32, 0, s>>>(f.dev, comm->dev, kPerPoster, failed);
  TEST_REQUIRE(cudaGetLastError() == cudaSuccess, "launch");
  uint64_t total = 0, bad = 0;
  tw_fifo_cmd_t got[64];
  while (total < want && tw_test_now() - t0 < 30.0) {
    const size_t n = tw_fifo_poll(&f, got, 64);
    for (size_t i = 0; i < n; i++, total++) {
      const tw_fifo_cmd_t *c = &got[i];
      const int p = c->peer;
      if (c->seq != total + 1 || p < 0 || p >= posters || c->local_off != (uint64_t)next[p] ||
          c->bytes != c->local_off * 5 + (uint64_t)p ||
          c->tag != ((uint64_t)p << 32 | c->local_off) || c->op != TW_FIFO_OP_TEST_ECHO)
        bad++;
      else
        next[p]++;
    }
  }
  const double took = tw_test_now() - t0;
  TEST_REQUIRE(cudaStreamSynchronize(s) == cudaSuccess, "the posting kernel");
  unsigned long long nfailed = 0;
  cudaMemcpy(&nfailed, failed, 8, cudaMemcpyDeviceToHost);
  TEST_ASSERT(total == want, "took %llu of %llu commands", (unsigned long long)total,
              (unsigned long long)want);
  TEST_ASSERT(bad == 0, "%llu commands out of order or torn", (unsigned long long)bad);
  TEST_ASSERT(nfailed == 0, "%llu posters gave up", nfailed);
  TEST_ASSERT(tw_fifo_poll(&f, got, 64) == 0, "a command past the last");
  tw_status_t async = TW_SUCCESS;
  TEST_TW_OK(tw_comm_async_error(comm, &async));
  TEST_ASSERT(async == TW_SUCCESS, "async: %s", tw_comm_last_error(comm));
  printf("  %d posters x %d commands through 256 slots: %.3f s, %.2f M commands/s\n", posters,
         kPerPoster, took, (double)total / took / 1e6);
  free(next);
  cudaFree(failed);
  cudaStreamDestroy(s);
  tw_fifo_destroy(&f);
  TEST_TW_OK(tw_comm_destroy(comm));
}

static void test_nobody_polls(void) {
  setenv("TW_WAIT_TIMEOUT_MS", "500", 1);
  tw_comm_t comm = make_comm();
  tw_fifo_t f;
  TEST_TW_OK(tw_fifo_create(&f, 4));
  unsigned long long *failed = NULL;
  TEST_REQUIRE(cudaMalloc(&failed, 8) == cudaSuccess && cudaMemset(failed, 0, 8) == cudaSuccess,
               "counter");
  const double t0 = tw_test_now();
  post_kernel<<<1, 32, 0>>>(f.dev, comm->dev, 4, failed); /* 16 commands, 4 slots */
  const cudaError_t e = cudaDeviceSynchronize();
  const double waited = tw_test_now() - t0;
  unsigned long long nfailed = 0;
  cudaMemcpy(&nfailed, failed, 8, cudaMemcpyDeviceToHost);
  TEST_ASSERT(e == cudaSuccess, "the kernel: %s", cudaGetErrorString(e));
  TEST_ASSERT(waited >= 0.45 && waited < 10.0, "the posters gave up after %.2f s (bound 0.5 s)",
              waited);
  TEST_ASSERT(nfailed == kPostersPerCta, "%llu of %d posters gave up", nfailed, kPostersPerCta);
  tw_fifo_cmd_t got[16];
  TEST_ASSERT(tw_fifo_poll(&f, got, 16) == 4, "the ring did not hold its 4 commands");
  tw_status_t async = TW_SUCCESS;
  TEST_TW_OK(tw_comm_async_error(comm, &async));
  TEST_ASSERT(async == TW_ERR_DEVICE_TIMEOUT || async == TW_ERR_ABORTED, "async %s: %s",
              tw_status_string(async), tw_comm_last_error(comm));
  printf("  a ring nobody polls: gave up after %.2f s: %s\n", waited, tw_comm_last_error(comm));
  cudaFree(failed);
  tw_fifo_destroy(&f);
  TEST_TW_OK(tw_comm_destroy(comm));
}

int main(void) {
  tw_test_require_hopper();
  test_stream();
  test_nobody_polls();
  return tw_test_finish();
}
