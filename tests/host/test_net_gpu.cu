/*
 * The inter-node path on the GPU, end to end, over the verbs test double: 4 ranks on one GPU as
 * 2 virtual nodes x 2 (TW_RANKS_PER_NODE through tw_config), each rank's kernel posting RDMA
 * writes of its symmetric buffer, with flags, through its command FIFO to its CPU proxy, which
 * carries them over the ib (RC) or efa (SRD) backend into the rail peer's buffer (device memory
 * on both sides); each kernel then waits, bounded, for its peer's flags and the host checks
 * every byte. Repeated calls check that the flags count on across calls. Then a peer whose NIC
 * stops answering: the kernel's wait ends and the comm reports TW_ERR_NETWORK naming the peer.
 * Among the host tests because it reaches the FIFO and the comm's internals; 77 without a Hopper
 * GPU or without the double.
 */
#include <cuda_runtime.h>

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/fifo.cuh"
#include "runtime/comm.h"
#include "tw_test.h"

#ifndef TW_VERBS_DOUBLE
int main(void) {
  printf("built without rdma-core's headers: no backends to test\n");
  return 77;
}
#else

/* one flag per chunk: on SRD a flag's value says only that the write carrying it landed */
enum { kWorld = 4, kPerNode = 2, kChunks = 32, kSlots = kChunks };
#define CHUNK (256u << 10)

/* One thread posts the writes to the rail peer, then waits for the peer's flags of this call. */
__global__ void exchange_kernel(const tw_dev_comm_t dc, int peer, uint64_t src_off,
                                uint64_t dst_off, uint64_t call, unsigned long long *failed) {
  if (threadIdx.x != 0)
    return;
  for (int k = 0; k < kChunks; k++) {
    tw_fifo_cmd_t c;
    memset(&c, 0, sizeof(c));
    c.op = TW_FIFO_OP_WRITE;
    c.peer = peer;
    c.local_off = src_off + (uint64_t)k * CHUNK;
    c.remote_off = dst_off + (uint64_t)k * CHUNK;
    c.bytes = CHUNK;
    c.flag_off = (uint64_t)(k % kSlots) + 1;
    /* the writes carrying a flag count from the comm's start */
    c.flag_value = call * (kChunks / kSlots) + (uint64_t)(k / kSlots) + 1;
    if (tw_fifo_post(dc.fifo, dc, TW_CH_TEST, c) == ~0ull) {
      atomicAdd(failed, 1ull);
      return;
    }
  }
  for (int s = 0; s < kSlots; s++)
    if (!tw_wait_geq(dc, TW_CH_TEST, &dc.net_flags[s], (call + 1) * (kChunks / kSlots), peer, s)) {
      atomicAdd(failed, 1ull);
      return;
    }
}

static uint64_t heap_off(tw_comm_t c, const void *p) {
  return (uint64_t)((uintptr_t)p - (uintptr_t)tw_group_slot(c->group, c->rank, 0));
}

static unsigned char pattern(int rank, int call, size_t i) {
  return (unsigned char)(rank * 37 + call * 11 + (int)(i * 7 + i / 4096));
}

typedef struct {
  tw_comm_t comms[kWorld];
  void *src[kWorld], *dst[kWorld];
  cudaStream_t stream[kWorld];
  unsigned long long *failed;
} setup_t;

static int bring_up(setup_t *s, int wait_timeout_ms) {
  int devices[kWorld] = {0, 0, 0, 0};
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = kPerNode;
  cfg.wait_timeout_ms = wait_timeout_ms;
  if (tw_comm_init_all(s->comms, kWorld, devices, &cfg) != TW_SUCCESS) {
    fprintf(stderr, "tw_comm_init_all: %s\n", tw_last_error());
    return 0;
  }
  const size_t bytes = (size_t)kChunks * CHUNK;
  for (int r = 0; r < kWorld; r++) {
    TEST_TW_OK(tw_mem_alloc(s->comms[r], bytes, &s->src[r]));
    TEST_TW_OK(tw_mem_alloc(s->comms[r], bytes, &s->dst[r]));
    cudaStreamCreateWithFlags(&s->stream[r], cudaStreamNonBlocking);
  }
  cudaMalloc(&s->failed, 8);
  cudaMemset(s->failed, 0, 8);
  return 1;
}

static void tear_down(setup_t *s) {
  for (int r = 0; r < kWorld; r++) {
    cudaStreamDestroy(s->stream[r]);
    TEST_TW_OK(tw_comm_destroy(s->comms[r]));
  }
  cudaFree(s->failed);
}

/* calls exchanges; every byte checked after each. */
static void run_exchange(const char *what, int calls) {
  setup_t s;
  if (!bring_up(&s, 10000)) {
    TEST_ASSERT(0, "%s: the comm did not come up", what);
    return;
  }
  const size_t bytes = (size_t)kChunks * CHUNK;
  unsigned char *host = (unsigned char *)malloc(bytes);
  double best = 1e30;
  for (int call = 0; call < calls; call++) {
    for (int r = 0; r < kWorld; r++) {
      for (size_t i = 0; i < bytes; i++)
        host[i] = pattern(r, call, i);
      cudaMemcpy(s.src[r], host, bytes, cudaMemcpyHostToDevice);
      cudaMemset(s.dst[r], 0xee, bytes); /* poisoned */
    }
    cudaDeviceSynchronize();
    const double t0 = tw_test_now();
    for (int r = 0; r < kWorld; r++) {
      tw_comm_t c = s.comms[r];
      exchange_kernel<<<1, 32, 0, s.stream[r]>>>(c->dev, (r + kPerNode) % kWorld,
                                                 heap_off(c, s.src[r]), heap_off(c, s.dst[r]),
                                                 (uint64_t)call, s.failed);
    }
    TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "kernel: %s",
                 cudaGetErrorString(cudaGetLastError()));
    const double dt = tw_test_now() - t0;
    best = dt < best ? dt : best;
    unsigned long long failed = 0;
    cudaMemcpy(&failed, s.failed, 8, cudaMemcpyDeviceToHost);
    TEST_ASSERT(failed == 0, "%s call %d: %llu kernels failed", what, call, failed);
    for (int r = 0; r < kWorld; r++) {
      const int from = (r + kPerNode) % kWorld;
      cudaMemcpy(host, s.dst[r], bytes, cudaMemcpyDeviceToHost);
      size_t bad = 0;
      for (size_t i = 0; i < bytes; i++)
        bad += host[i] != pattern(from, call, i);
      TEST_ASSERT(bad == 0, "%s call %d: rank %d: %zu bytes from rank %d differ", what, call, r,
                  bad, from);
      tw_status_t async = TW_SUCCESS;
      TEST_TW_OK(tw_comm_async_error(s.comms[r], &async));
      TEST_ASSERT(async == TW_SUCCESS, "%s: rank %d async error %s", what, r,
                  tw_comm_last_error(s.comms[r]));
    }
  }
  printf("%s: %d ranks exchanged %zu KiB each in %.2f ms (best of %d calls)\n", what, kWorld,
         bytes >> 10, best * 1e3, calls);
  free(host);
  tear_down(&s);
}

/* The rail peer's NIC stops answering: the waits end and the comm names the peer. */
static void run_silent(int (*inject)(const char *)) {
  TEST_REQUIRE(inject("silent:dev=1:after=0") == 0, "tw_vd_inject");
  setup_t s;
  if (!bring_up(&s, 500)) {
    TEST_ASSERT(0, "silent: the comm did not come up");
    inject("clear");
    return;
  }
  const double t0 = tw_test_now();
  for (int r = 1; r < kWorld; r += 2) {
    tw_comm_t c = s.comms[r];
    exchange_kernel<<<1, 32, 0, s.stream[r]>>>(
        c->dev, (r + kPerNode) % kWorld, heap_off(c, s.src[r]), heap_off(c, s.dst[r]), 0, s.failed);
  }
  TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "kernel");
  TEST_ASSERT(tw_test_now() - t0 < 5.0, "the kernels took %.1f s to give up", tw_test_now() - t0);
  tw_status_t async = TW_SUCCESS;
  TEST_TW_OK(tw_comm_async_error(s.comms[1], &async));
  /* the proxy names the silent peer (at half the kernels' bound) before their waits give up */
  TEST_ASSERT(async == TW_ERR_NETWORK, "silent: async %s: %s", tw_status_string(async),
              tw_comm_last_error(s.comms[1]));
  const char *msg = tw_comm_last_error(s.comms[1]);
  TEST_ASSERT(strstr(msg, "rank 3") && strstr(msg, "stopped answering"), "silent: %s", msg);
  printf("silent peer: %s\n", msg);
  tear_down(&s);
  inject("clear");
}

/* NICs that cannot register GPU memory: tw_comm_init_all fails, naming the NIC and what is
 * missing. */
static void run_no_gpu_registration(void) {
  setenv("TW_VD_NO_GPU_MR", "1", 1);
  int devices[kWorld] = {0, 0, 0, 0};
  tw_comm_t comms[kWorld];
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = kPerNode;
  TEST_TW_FAILS(tw_comm_init_all(comms, kWorld, devices, &cfg), TW_ERR_NOT_SUPPORTED,
                "cannot register GPU memory");
  unsetenv("TW_VD_NO_GPU_MR");
}

int main(void) {
  tw_test_require_hopper();
  tw_test_use_verbs_double(TW_VERBS_DOUBLE, "mlx5:2");
  void *vd = dlopen(TW_VERBS_DOUBLE, RTLD_NOW | RTLD_LOCAL);
  TEST_REQUIRE(vd != NULL, "dlopen(%s): %s", TW_VERBS_DOUBLE, dlerror());
  int (*inject)(const char *) = (int (*)(const char *))dlsym(vd, "tw_vd_inject");
  TEST_REQUIRE(inject != NULL, "the double has no tw_vd_inject");
  setenv("TW_VD_NICS", "mlx5:2", 1);
  setenv("TW_NET", "ib", 1);
  run_exchange("ib (RC)", 3);
  setenv("TW_VD_NICS", "efa:4", 1);
  setenv("TW_NET", "efa", 1);
  run_exchange("efa (SRD)", 3);
  setenv("TW_VD_NICS", "mlx5:2", 1);
  setenv("TW_NET", "ib", 1);
  run_silent(inject);
  run_no_gpu_registration();
  return tw_test_finish();
}
#endif
