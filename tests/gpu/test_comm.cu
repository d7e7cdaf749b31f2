/*
 * Comm and symmetric heap on one GPU: queries, virtual nodes, SM budgets,
 * tw_mem_alloc / peer pointers / free, and the errors of bad calls.
 */
#include <cuda_runtime.h>

#include <string.h>
#include <unistd.h>

#include "tw_test.h"

static __global__ void write_rank(int *dst, int value, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    dst[i] = value * 1000 + i;
}

/* Ranks on other nodes need the inter-node transport: the verbs test double's NICs, where the
 * tests were built with rdma-core's headers (0 without). */
static int use_verbs_double(void) {
#ifdef TW_VERBS_DOUBLE
  tw_test_use_verbs_double(TW_VERBS_DOUBLE, "mlx5:4");
  return 1;
#else
  return 0;
#endif
}

static void test_queries(void) {
  int devices[6] = {0, 0, 0, 0, 0, 0};
  tw_comm_t comms[6];
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = 4; /* virtual nodes {0..3}, {4, 5} */
  if (!use_verbs_double()) {
    TEST_TW_FAILS(tw_comm_init_all(comms, 6, devices, &cfg), TW_ERR_NOT_SUPPORTED, "rdma-core");
    return;
  }
  TEST_TW_OK(tw_comm_init_all(comms, 6, devices, &cfg));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int r = 0; r < 6; r++) {
    int v = -1;
    TEST_TW_OK(tw_comm_rank(comms[r], &v));
    TEST_ASSERT(v == r, "rank %d", v);
    TEST_TW_OK(tw_comm_size(comms[r], &v));
    TEST_ASSERT(v == 6, "size %d", v);
    TEST_TW_OK(tw_comm_node(comms[r], &v));
    TEST_ASSERT(v == r / 4, "rank %d node %d", r, v);
    TEST_TW_OK(tw_comm_nodes(comms[r], &v));
    TEST_ASSERT(v == 2, "nodes %d", v);
    TEST_TW_OK(tw_comm_local_rank(comms[r], &v));
    TEST_ASSERT(v == r % 4, "rank %d local rank %d", r, v);
    TEST_TW_OK(tw_comm_local_size(comms[r], &v));
    TEST_ASSERT(v == (r < 4 ? 4 : 2), "rank %d local size %d", r, v);
    TEST_TW_OK(tw_comm_sm_budget(comms[r], &v));
    TEST_ASSERT(v == sms / 6, "sm budget %d, expected %d", v, sms / 6);
    TEST_TW_OK(tw_comm_device(comms[r], &v));
    TEST_ASSERT(v == 0, "device %d", v);
  }
  TEST_TW_FAILS(tw_comm_rank(comms[0], NULL), TW_ERR_INVALID_ARGUMENT, "NULL");
  TEST_ASSERT(strstr(tw_comm_last_error(comms[0]), "NULL") != NULL, "last error: %s",
              tw_comm_last_error(comms[0]));
  for (int r = 0; r < 6; r++)
    TEST_TW_OK(tw_comm_destroy(comms[r]));
}

static void test_budget_errors(void) {
  int devices[4] = {0, 0, 0, 0};
  tw_comm_t comms[4];
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.sm_budget = 100; /* 4 x 100 SMs cannot be co-resident */
  TEST_TW_FAILS(tw_comm_init_all(comms, 4, devices, &cfg), TW_ERR_INVALID_ARGUMENT, "sm_budget");
  for (int r = 0; r < 4; r++)
    TEST_ASSERT(comms[r] == NULL, "comms[%d] left set", r);
  cfg.sm_budget = 16;
  TEST_TW_OK(tw_comm_init_all(comms, 4, devices, &cfg));
  int v = 0;
  TEST_TW_OK(tw_comm_sm_budget(comms[2], &v));
  TEST_ASSERT(v == 16, "budget %d", v);
  for (int r = 0; r < 4; r++)
    TEST_TW_OK(tw_comm_destroy(comms[r]));
  int bad_devices[2] = {0, 99};
  TEST_TW_FAILS(tw_comm_init_all(comms, 2, bad_devices, NULL), TW_ERR_INVALID_ARGUMENT,
                "devices[1]");
  tw_config_t old = TW_CONFIG_INIT;
  old.size = 3; /* not even the header */
  TEST_TW_FAILS(tw_comm_init_all(comms, 2, devices, &old), TW_ERR_INVALID_ARGUMENT, "cfg->size");
  old = (tw_config_t)TW_CONFIG_INIT;
  old.version = 99;
  TEST_TW_FAILS(tw_comm_init_all(comms, 2, devices, &old), TW_ERR_INVALID_ARGUMENT, "cfg->version");
  /* A caller built against the first 24 bytes of the struct (an older, shorter config). */
  old = (tw_config_t)TW_CONFIG_INIT;
  old.size = offsetof(tw_config_t, bootstrap_timeout_ms);
  old.sm_budget = 8;
  TEST_TW_OK(tw_comm_init_all(comms, 2, devices, &old));
  TEST_TW_OK(tw_comm_sm_budget(comms[1], &v));
  TEST_ASSERT(v == 8, "budget from short config %d", v);
  for (int r = 0; r < 2; r++)
    TEST_TW_OK(tw_comm_destroy(comms[r]));
}

static void test_heap(int world) {
  int devices[8] = {0};
  tw_comm_t comms[8];
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.heap_bytes = 64u << 20;
  TEST_TW_OK(tw_comm_init_all(comms, world, devices, &cfg));
  const int n = 4096;
  int *buf[8];
  for (int r = 0; r < world; r++)
    TEST_TW_OK(tw_mem_alloc(comms[r], n * sizeof(int) * world, (void **)&buf[r]));
  /* Each rank writes its slot of every peer's buffer through the peer pointers. */
  for (int r = 0; r < world; r++) {
    void *const *table = NULL;
    TEST_TW_OK(tw_mem_peer_ptrs(comms[r], buf[r], &table));
    void *host_table[8];
    TEST_CUDA_OK(cudaMemcpy(host_table, table, sizeof(void *) * world, cudaMemcpyDeviceToHost));
    for (int p = 0; p < world; p++) {
      void *peer = NULL;
      TEST_TW_OK(tw_mem_peer_ptr(comms[r], buf[r], p, &peer));
      TEST_ASSERT(peer == host_table[p], "rank %d peer %d: host %p device table %p", r, p, peer,
                  host_table[p]);
      TEST_ASSERT(p != r || peer == buf[r], "own peer pointer %p != %p", peer, (void *)buf[r]);
      write_rank<<<1, 256>>>((int *)peer + r * n, r, n);
    }
  }
  TEST_CUDA_OK(cudaDeviceSynchronize());
  int *host = (int *)malloc(n * sizeof(int) * world);
  for (int p = 0; p < world; p++) {
    TEST_CUDA_OK(cudaMemcpy(host, buf[p], n * sizeof(int) * world, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int r = 0; r < world; r++)
      for (int i = 0; i < n; i++)
        bad += host[r * n + i] != r * 1000 + i;
    TEST_ASSERT(bad == 0, "rank %d's buffer: %d wrong values", p, bad);
  }
  free(host);
  /* Inner pointers map too; the device table only for the base. */
  void *inner = NULL;
  TEST_TW_OK(tw_mem_peer_ptr(comms[0], buf[0] + 5, world - 1, &inner));
  void *peer_base = NULL;
  TEST_TW_OK(tw_mem_peer_ptr(comms[0], buf[0], world - 1, &peer_base));
  TEST_ASSERT(inner == (void *)((int *)peer_base + 5), "inner %p, base %p", inner, peer_base);
  void *const *table = NULL;
  TEST_TW_FAILS(tw_mem_peer_ptrs(comms[0], buf[0] + 5, &table), TW_ERR_INVALID_ARGUMENT, "inside");
  /* Collective mismatch: rank 1 asks another size for the same allocation. */
  void *x0 = NULL, *x1 = NULL;
  if (world > 1) {
    TEST_TW_OK(tw_mem_alloc(comms[0], 1000, &x0));
    TEST_TW_FAILS(tw_mem_alloc(comms[1], 2000, &x1), TW_ERR_INVALID_ARGUMENT, "collective");
    TEST_TW_OK(tw_mem_alloc(comms[1], 1000, &x1));
    for (int r = 2; r < world; r++) {
      void *x;
      TEST_TW_OK(tw_mem_alloc(comms[r], 1000, &x));
      TEST_TW_OK(tw_mem_free(comms[r], x));
    }
    TEST_TW_OK(tw_mem_free(comms[0], x0));
    TEST_TW_OK(tw_mem_free(comms[1], x1));
  }
  /* Too large for the heap; a pointer that is not from the heap; double free. */
  void *big = NULL;
  TEST_TW_FAILS(tw_mem_alloc(comms[0], 1ull << 30, &big), TW_ERR_OUT_OF_MEMORY, "TW_HEAP_BYTES");
  TEST_TW_FAILS(tw_mem_alloc(comms[0], 0, &big), TW_ERR_INVALID_ARGUMENT, "bytes");
  void *plain;
  TEST_CUDA_OK(cudaMalloc(&plain, 256));
  TEST_TW_FAILS(tw_mem_free(comms[0], plain), TW_ERR_INVALID_ARGUMENT, "not a live");
  TEST_TW_FAILS(tw_mem_peer_ptr(comms[0], plain, 0, &inner), TW_ERR_INVALID_ARGUMENT, "not inside");
  cudaFree(plain);
  for (int r = 0; r < world; r++)
    TEST_TW_OK(tw_mem_free(comms[r], buf[r]));
  TEST_TW_FAILS(tw_mem_free(comms[0], buf[0]), TW_ERR_INVALID_ARGUMENT, "not a live");
  /* Freed space is reused: allocate and free repeatedly, far beyond the heap's size. */
  for (int i = 0; i < 40; i++) {
    void *y[8];
    for (int r = 0; r < world; r++)
      TEST_TW_OK(tw_mem_alloc(comms[r], 8u << 20, &y[r]));
    for (int r = 0; r < world; r++)
      TEST_TW_OK(tw_mem_free(comms[r], y[r]));
  }
  for (int r = 0; r < world; r++)
    TEST_TW_OK(tw_comm_destroy(comms[r]));
}

/* Ranks on other nodes and no way to reach them: tw_comm_init_all fails naming what is missing,
 * and leaves nothing behind (a good init follows). */
static void test_no_transport(void) {
#ifdef TW_VERBS_DOUBLE
  int devices[4] = {0, 0, 0, 0};
  tw_comm_t comms[4];
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.ranks_per_node = 2;
  setenv("TW_NET", "none", 1);
  TEST_TW_FAILS(tw_comm_init_all(comms, 4, devices, &cfg), TW_ERR_NOT_SUPPORTED, "TW_NET=none");
  setenv("TW_NET", "efa", 1); /* the double's NICs here are RC ones */
  TEST_TW_FAILS(tw_comm_init_all(comms, 4, devices, &cfg), TW_ERR_NOT_SUPPORTED,
                "no usable EFA device");
  setenv("TW_NET", "ib", 1);
  setenv("TW_NET_DEVICES", "mlx5_7", 1);
  TEST_TW_FAILS(tw_comm_init_all(comms, 4, devices, &cfg), TW_ERR_NOT_SUPPORTED,
                "TW_NET_DEVICES=mlx5_7");
  unsetenv("TW_NET_DEVICES");
  unsetenv("TW_NET");
  TEST_TW_OK(tw_comm_init_all(comms, 4, devices, &cfg));
  for (int r = 0; r < 4; r++)
    TEST_TW_OK(tw_comm_destroy(comms[r]));
#endif
}

int main(void) {
  tw_test_require_hopper();
  test_queries();
  test_no_transport();
  test_budget_errors();
  test_heap(1);
  test_heap(3);
  test_heap(8);
  return tw_test_finish();
}
