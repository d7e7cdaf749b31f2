/*
 * The pointer-argument checks (src/runtime/argcheck.h). Overlap rules run anywhere; with a
 * Hopper GPU also the device-memory rules (host, freed, foreign-device and too-small pointers
 * refused, device and managed memory accepted) and the checks' host cost, printed per call.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/status.h"
#include "runtime/argcheck.h"
#include "tw_test.h"

static void disjoint_cases(void) {
  char buf[256] = {0};
  TEST_TW_OK(tw_check_disjoint(buf, 64, "out", buf + 64, 64, "a"));
  TEST_TW_OK(tw_check_disjoint(buf + 64, 64, "out", buf, 64, "a"));
  TEST_TW_FAILS(tw_check_disjoint(buf, 65, "out", buf + 64, 64, "a"), TW_ERR_INVALID_ARGUMENT,
                "out");
  TEST_TW_FAILS(tw_check_disjoint(buf + 100, 8, "out", buf, 128, "a"), TW_ERR_INVALID_ARGUMENT,
                "overlaps a");
  TEST_TW_FAILS(tw_check_disjoint(buf, 256, "c", buf, 256, "b"), TW_ERR_INVALID_ARGUMENT, "c");
  TEST_TW_OK(tw_check_disjoint(NULL, 64, "out", buf, 64, "a")); /* NULLs are refused elsewhere */
  TEST_TW_OK(tw_check_disjoint(buf, 0, "out", buf, 64, "a"));
}

static int have_gpu(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    return 0;
  struct cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9;
}

static void device_cases(void) {
  const size_t bytes = 1 << 20;
  void *dev = NULL, *freed = NULL, *managed = NULL, *pinned = NULL;
  TEST_REQUIRE(cudaSetDevice(0) == cudaSuccess, "cudaSetDevice");
  TEST_REQUIRE(cudaMalloc(&dev, bytes) == cudaSuccess, "cudaMalloc");
  TEST_REQUIRE(cudaMalloc(&freed, bytes) == cudaSuccess, "cudaMalloc");
  TEST_REQUIRE(cudaFree(freed) == cudaSuccess, "cudaFree");
  TEST_REQUIRE(cudaMallocManaged(&managed, bytes, cudaMemAttachGlobal) == cudaSuccess, "managed");
  TEST_REQUIRE(cudaMallocHost(&pinned, bytes) == cudaSuccess, "cudaMallocHost");
  void *pageable = malloc(bytes);
  TEST_TW_OK(tw_check_device_range(0, dev, bytes, "a"));
  TEST_TW_OK(tw_check_device_range(0, (char *)dev + 4096, bytes - 4096, "a"));
  TEST_TW_OK(tw_check_device_range(0, managed, bytes, "a"));
  TEST_TW_FAILS(tw_check_device_range(0, dev, bytes + 16, "args->a"), TW_ERR_INVALID_ARGUMENT,
                "args->a");
  TEST_TW_FAILS(tw_check_device_range(0, (char *)dev + 16, bytes, "c"), TW_ERR_INVALID_ARGUMENT,
                "past the end");
  TEST_TW_FAILS(tw_check_device_range(0, pageable, 64, "args->b"), TW_ERR_INVALID_ARGUMENT,
                "args->b");
  TEST_TW_FAILS(tw_check_device_range(0, pinned, 64, "out"), TW_ERR_INVALID_ARGUMENT,
                "pinned host memory");
  TEST_TW_FAILS(tw_check_device_range(0, freed, 64, "send"), TW_ERR_INVALID_ARGUMENT, "send");
  TEST_TW_FAILS(tw_check_device_range(1, dev, 64, "a"), TW_ERR_INVALID_ARGUMENT, "device 0");
  TEST_TW_FAILS(tw_check_device_range(0, NULL, 64, "a"), TW_ERR_INVALID_ARGUMENT, "NULL");
  /* none of the refusals left a CUDA error behind */
  TEST_ASSERT(cudaGetLastError() == cudaSuccess, "a sticky CUDA error after the checks");
  TEST_ASSERT(cudaDeviceSynchronize() == cudaSuccess, "the context still works");
  /* host cost of one check of a valid range: what every pointer argument of a call costs */
  enum { kCalls = 20000 };
  tw_status_t st = TW_SUCCESS;
  double t0 = tw_test_now();
  for (int i = 0; i < kCalls; i++)
    st |= tw_check_device_range(0, (char *)dev + 256, 4096, "a");
  double ns = (tw_test_now() - t0) * 1e9 / kCalls;
  TEST_ASSERT(st == TW_SUCCESS, "valid ranges");
  printf("tw_check_device_range: %.0f ns per pointer (cudaMalloc memory)\n", ns);
  free(pageable);
  cudaFreeHost(pinned);
  cudaFree(managed);
  cudaFree(dev);
}

int main(void) {
  disjoint_cases();
  if (have_gpu())
    device_cases();
  else
    printf("no Hopper GPU: the device-memory cases are skipped\n");
  return tw_test_finish();
}
