/*
 * Public API checks that need no GPU (run in CI): argument validation names
 * the bad argument, status strings, config defaults and versioning, node
 * topology, and that a machine without a GPU gets TW_ERR_NO_DEVICE, not a crash.
 */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/env.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
#include "tw_test.h"

static void test_status_strings(void) {
  for (int s = 0; s <= TW_ERR_NETWORK; s++) {
    const char *text = tw_status_string((tw_status_t)s);
    TEST_ASSERT(text && strncmp(text, "TW_", 3) == 0, "status %d -> %s", s, text ? text : "NULL");
  }
  TEST_ASSERT(strstr(tw_status_string((tw_status_t)999), "UNKNOWN") != NULL, "unknown status");
  TEST_ASSERT(tw_version() == TW_VERSION_CODE, "version %d", tw_version());
}

static void test_config(void) {
  tw_config_t a = TW_CONFIG_INIT, b;
  memset(&b, 0x5a, sizeof(b));
  TEST_TW_OK(tw_config_init(&b));
  TEST_ASSERT(memcmp(&a, &b, sizeof(a)) == 0, "tw_config_init differs from TW_CONFIG_INIT");
  TEST_ASSERT(a.size == sizeof(tw_config_t) && a.version == TW_CONFIG_VERSION, "size/version");
  TEST_TW_FAILS(tw_config_init(NULL), TW_ERR_INVALID_ARGUMENT, "cfg");
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  TEST_ASSERT(g.size == sizeof(tw_gemm_args_t) && g.version == TW_GEMM_ARGS_VERSION,
              "gemm args init");
}

static void test_bad_arguments(void) {
  tw_comm_t comms[4];
  int devices[4] = {0, 0, 0, 0};
  TEST_TW_FAILS(tw_comm_init_all(NULL, 2, devices, NULL), TW_ERR_INVALID_ARGUMENT, "comms");
  TEST_TW_FAILS(tw_comm_init_all(comms, 0, devices, NULL), TW_ERR_INVALID_ARGUMENT, "world");
  TEST_TW_FAILS(tw_comm_init_all(comms, TW_MAX_WORLD + 1, devices, NULL), TW_ERR_INVALID_ARGUMENT,
                "world");
  TEST_TW_FAILS(tw_comm_init_all(comms, 2, NULL, NULL), TW_ERR_INVALID_ARGUMENT, "devices");
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.sm_budget = -1;
  TEST_TW_FAILS(tw_comm_init_all(comms, 2, devices, &cfg), TW_ERR_INVALID_ARGUMENT, "sm_budget");
  cfg = (tw_config_t)TW_CONFIG_INIT;
  cfg.size = 0;
  TEST_TW_FAILS(tw_comm_init_all(comms, 2, devices, &cfg), TW_ERR_INVALID_ARGUMENT, "cfg->size");
  tw_unique_id_t id;
  memset(&id, 0, sizeof(id));
  tw_comm_t comm;
  TEST_TW_FAILS(tw_comm_init_rank(NULL, 2, id, 0, NULL), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_TW_FAILS(tw_comm_init_rank(&comm, 2, id, 2, NULL), TW_ERR_INVALID_ARGUMENT, "rank");
  TEST_TW_FAILS(tw_comm_init_rank(&comm, -1, id, 0, NULL), TW_ERR_INVALID_ARGUMENT, "world");
  TEST_TW_FAILS(tw_get_unique_id(NULL), TW_ERR_INVALID_ARGUMENT, "id");
  TEST_TW_FAILS(tw_comm_destroy(NULL), TW_ERR_INVALID_ARGUMENT, "comm");
  int v;
  TEST_TW_FAILS(tw_comm_rank(NULL, &v), TW_ERR_INVALID_ARGUMENT, "comm");
  tw_status_t async;
  TEST_TW_FAILS(tw_comm_async_error(NULL, &async), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_ASSERT(strcmp(tw_comm_last_error(NULL), "comm: NULL") == 0, "last error of NULL comm");
  void *p;
  TEST_TW_FAILS(tw_mem_alloc(NULL, 16, &p), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_TW_FAILS(tw_mem_free(NULL, &v), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_TW_FAILS(tw_allgather(NULL, &v, &v, 16, NULL), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_TW_FAILS(tw_barrier(NULL, NULL), TW_ERR_INVALID_ARGUMENT, "comm");
  TEST_TW_FAILS(tw_gemm(NULL, NULL), TW_ERR_INVALID_ARGUMENT, "args");
  /* split_k: 0, 1, 2, 4, 8 or -1; anything else names the argument (checked before the device) */
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  static char a[64], b[64], c[64];
  g.a = a, g.b = b, g.c = c, g.m = 1, g.n = 8, g.k = 8;
  const int32_t bad_splits[] = {-2, 3, 5, 16};
  for (size_t i = 0; i < sizeof(bad_splits) / sizeof(bad_splits[0]); i++) {
    g.split_k = bad_splits[i];
    TEST_TW_FAILS(tw_gemm(&g, NULL), TW_ERR_INVALID_ARGUMENT, "split_k");
  }
  tw_gemm_args_t v3 = TW_GEMM_ARGS_INIT;
  TEST_ASSERT(v3.split_k == 0 && v3.version == 3 && v3.workspace == NULL && v3.workspace_bytes == 0,
              "TW_GEMM_ARGS_INIT: version 3, split_k 0, no workspace");
  /* the workspace: 256-byte aligned and at least TW_GEMM_WORKSPACE_BYTES, named when not */
  static _Alignas(256) char ws[512];
  g.split_k = -1;
  g.workspace = ws + 16, g.workspace_bytes = TW_GEMM_WORKSPACE_BYTES;
  TEST_TW_FAILS(tw_gemm(&g, NULL), TW_ERR_INVALID_ARGUMENT, "workspace");
  g.workspace = ws, g.workspace_bytes = sizeof(ws);
  TEST_TW_FAILS(tw_gemm(&g, NULL), TW_ERR_INVALID_ARGUMENT, "workspace_bytes");
}

static void test_no_gpu(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    printf("a GPU is present: skipping the no-GPU checks\n");
    return;
  }
  tw_comm_t comms[2];
  int devices[2] = {0, 0};
  TEST_TW_FAILS(tw_comm_init_all(comms, 2, devices, NULL), TW_ERR_NO_DEVICE, "no CUDA device");
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  static char a[64], b[64], c[64];
  g.a = a, g.b = b, g.c = c, g.m = 1, g.n = 8, g.k = 8;
  TEST_TW_FAILS(tw_gemm(&g, NULL), TW_ERR_NO_DEVICE, "");
  /* a caller built against version 1: its struct ends before split_k, so what lies there is
   * not read (the call gets as far as the device) */
  g.size = offsetof(tw_gemm_args_t, split_k), g.version = 1, g.split_k = 3;
  TEST_TW_FAILS(tw_gemm(&g, NULL), TW_ERR_NO_DEVICE, "");
  /* version 2: its struct ends before the workspace, which is not read either */
  g.size = offsetof(tw_gemm_args_t, workspace), g.version = 2, g.split_k = -1;
  g.workspace = (void *)1, g.workspace_bytes = 1;
  TEST_TW_FAILS(tw_gemm(&g, NULL), TW_ERR_NO_DEVICE, "");
}

static void expect_nodes(int world, const uint64_t *hosts, int rpn, int rank, int node, int nodes,
                         int local_rank, int local_size) {
  struct tw_comm c;
  memset(&c, 0, sizeof(c));
  c.rank = rank;
  c.world = world;
  tw_assign_nodes(&c, hosts, rpn);
  TEST_ASSERT(c.node == node && c.nodes == nodes && c.local_rank == local_rank &&
                  c.local_size == local_size,
              "world %d rpn %d rank %d: node %d/%d local %d/%d, expected %d/%d %d/%d", world, rpn,
              rank, c.node, c.nodes, c.local_rank, c.local_size, node, nodes, local_rank,
              local_size);
}

static void test_topology(void) {
  uint64_t same[8] = {7, 7, 7, 7, 7, 7, 7, 7};
  expect_nodes(8, same, 0, 5, 0, 1, 5, 8);
  expect_nodes(8, same, 4, 5, 1, 2, 1, 4);
  expect_nodes(5, same, 2, 4, 2, 3, 0, 1); /* last virtual node is partial */
  expect_nodes(5, same, 2, 3, 1, 3, 1, 2);
  uint64_t two_hosts[6] = {9, 3, 9, 3, 9, 3}; /* interleaved hosts: numbered by first rank */
  expect_nodes(6, two_hosts, 0, 0, 0, 2, 0, 3);
  expect_nodes(6, two_hosts, 0, 3, 1, 2, 1, 3);
  expect_nodes(6, two_hosts, 0, 4, 0, 2, 2, 3);
  expect_nodes(1, same, 0, 0, 0, 1, 0, 1);
}

/* ranks_on_device is the rank's own count; gpu_shared and plan_sms are the same on every rank
 * (plans that all ranks must choose alike take them): 3 ranks on 2 GPUs give 2 / 1 / 2 and 1
 * everywhere, and the smallest budget (132 SMs per GPU, shared by 2: 66) everywhere. */
static void expect_gpus(int world, const uint64_t *hosts, const int *gpu, const int *budget_cfg,
                        int rank, int on_device, int shared, int plan_sms) {
  uint8_t uuid[TW_MAX_WORLD][16];
  int sm_count[TW_MAX_WORLD];
  memset(uuid, 0, sizeof(uuid));
  for (int p = 0; p < world; p++)
    uuid[p][5] = (uint8_t)(1 + gpu[p]), sm_count[p] = 132;
  struct tw_comm c;
  memset(&c, 0, sizeof(c));
  c.rank = rank, c.world = world;
  tw_assign_gpus(&c, hosts, (const uint8_t(*)[16])uuid, sm_count, budget_cfg);
  TEST_ASSERT(c.ranks_on_device == on_device && c.gpu_shared == shared && c.plan_sms == plan_sms,
              "world %d rank %d: %d on its GPU, shared %d, plan_sms %d; expected %d, %d, %d", world,
              rank, c.ranks_on_device, c.gpu_shared, c.plan_sms, on_device, shared, plan_sms);
}

static void test_gpus(void) {
  uint64_t one[8] = {7, 7, 7, 7, 7, 7, 7, 7};
  const int none[8] = {0}, one_set[3] = {0, 0, 40};
  const int three_on_two[3] = {0, 1, 0};
  expect_gpus(3, one, three_on_two, none, 0, 2, 1, 66);
  expect_gpus(3, one, three_on_two, none, 1, 1, 1, 66);    /* alone on its GPU, yet shares */
  expect_gpus(3, one, three_on_two, one_set, 1, 1, 1, 40); /* rank 2 configured 40 SMs */
  const int distinct[4] = {0, 1, 2, 3};
  expect_gpus(4, one, distinct, none, 2, 1, 0, 132);
  const int all_one[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  expect_gpus(8, one, all_one, none, 7, 8, 1, 16);
  expect_gpus(1, one, all_one, none, 0, 1, 0, 132);
  uint64_t two_hosts[2] = {3, 9}; /* the same GPU index on two hosts is two GPUs */
  const int same_index[2] = {0, 0};
  expect_gpus(2, two_hosts, same_index, none, 0, 1, 0, 132);
}

/* Knobs that every rank must set alike: tw_comm_init_rank compares every rank's values (each
 * rank sees all of them, so all fail alike) and names the first that differs. */
static void test_alike_knobs(void) {
  tw_peer_info_t peers[3];
  memset(peers, 0, sizeof(peers));
  unsetenv("TW_RS_BAND");
  unsetenv("TW_AR_PUSH");
  for (int r = 0; r < 3; r++)
    tw_alike_knobs(peers[r].knobs);
  TEST_TW_OK(tw_check_alike_knobs(peers, 3));
  setenv("TW_RS_BAND", "3", 1);
  tw_alike_knobs(peers[2].knobs);
  TEST_TW_FAILS(tw_check_alike_knobs(peers, 3), TW_ERR_INVALID_ARGUMENT,
                "TW_RS_BAND is 0 on rank 0 but 3 on rank 2");
  unsetenv("TW_RS_BAND");
  TEST_TW_OK(tw_check_alike_knobs(peers, 2)); /* ranks 0, 1 */
  setenv("TW_AR_PUSH", "0", 1);               /* -1 by default */
  tw_alike_knobs(peers[1].knobs);
  TEST_TW_FAILS(tw_check_alike_knobs(peers, 2), TW_ERR_INVALID_ARGUMENT,
                "TW_AR_PUSH is -1 on rank 0 but 0 on rank 1");
  unsetenv("TW_AR_PUSH");
  setenv("TW_RS_REDUCE_CTAS", "4", 1); /* a rank's own CTA count may differ */
  tw_alike_knobs(peers[1].knobs);
  TEST_TW_OK(tw_check_alike_knobs(peers, 2));
  unsetenv("TW_RS_REDUCE_CTAS");
  /* tw_gemm_ar's owner epilogue changes how its gather items are numbered */
  setenv("TW_RS_OWNER_EPI", "0", 1); /* -1 by default */
  tw_alike_knobs(peers[1].knobs);
  TEST_TW_FAILS(tw_check_alike_knobs(peers, 2), TW_ERR_INVALID_ARGUMENT,
                "TW_RS_OWNER_EPI is -1 on rank 0 but 0 on rank 1");
  unsetenv("TW_RS_OWNER_EPI");
  /* the unfused pipeline or the fused kernel: the ranks must run the same one */
  setenv("TW_RS_UNFUSED_SMALL", "1", 1); /* -1 by default */
  tw_alike_knobs(peers[1].knobs);
  TEST_TW_FAILS(tw_check_alike_knobs(peers, 2), TW_ERR_INVALID_ARGUMENT,
                "TW_RS_UNFUSED_SMALL is -1 on rank 0 but 1 on rank 1");
  unsetenv("TW_RS_UNFUSED_SMALL");
  tw_alike_knobs(peers[1].knobs);
  TEST_TW_OK(tw_check_alike_knobs(peers, 2));
  /* Every knob of the table: a rank that sets it differently fails the check exactly where the
   * table's alike column says so. */
  for (int id = 0; id < TW_ENV_COUNT; id++) {
    const char *name = NULL, *type = NULL;
    TEST_TW_OK(tw_env_describe(id, &name, &type, NULL, NULL, NULL));
    if (!strcmp(type, "str"))
      continue; /* no str knob is alike (tw_alike_knobs reads integers) */
    char *saved = getenv(name) ? strdup(getenv(name)) : NULL;
    unsetenv(name);
    tw_alike_knobs(peers[0].knobs);
    const int64_t def = tw_env_int((tw_env_id)id);
    setenv(name, def == 1 ? "0" : "1", 1);
    tw_alike_knobs(peers[1].knobs);
    const tw_status_t st = tw_check_alike_knobs(peers, 2);
    TEST_ASSERT((st != TW_SUCCESS) == tw_env_alike((tw_env_id)id),
                "%s set on one rank only: the check says %d, alike %d", name, (int)st,
                tw_env_alike((tw_env_id)id));
    if (saved)
      setenv(name, saved, 1);
    else
      unsetenv(name);
    free(saved);
  }
  tw_alike_knobs(peers[0].knobs);
  tw_alike_knobs(peers[1].knobs);
  TEST_TW_OK(tw_check_alike_knobs(peers, 2));
}

/* A context that could not be created for lack of memory, while CUDA_DEVICE_MAX_CONNECTIONS asks
 * for more than the default queues, names the variable (MPS clients share one pool of them);
 * otherwise the plain message. */
static void test_context_hint(void) {
  const char *saved = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  char *keep = saved ? strdup(saved) : NULL;
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  TEST_ASSERT(tw_cuda_check_context(cudaErrorMemoryAllocation, "cudaFree(0)") ==
                  TW_ERR_OUT_OF_MEMORY,
              "status");
  TEST_ASSERT(strstr(tw_last_error(), "cudaFree(0): cudaErrorMemoryAllocation") &&
                  strstr(tw_last_error(), "CUDA_DEVICE_MAX_CONNECTIONS=32") &&
                  strstr(tw_last_error(), "MPS"),
              "the hint: %s", tw_last_error());
  TEST_ASSERT(tw_cuda_check_context(cudaErrorInvalidValue, "cudaSetDevice") == TW_ERR_CUDA &&
                  !strstr(tw_last_error(), "CUDA_DEVICE_MAX_CONNECTIONS"),
              "another error has no hint: %s", tw_last_error());
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8", 1);
  TEST_ASSERT(tw_cuda_check_context(cudaErrorMemoryAllocation, "cudaSetDevice") ==
                      TW_ERR_OUT_OF_MEMORY &&
                  !strstr(tw_last_error(), "CUDA_DEVICE_MAX_CONNECTIONS"),
              "the default count has no hint: %s", tw_last_error());
  unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  TEST_ASSERT(tw_cuda_check_context(cudaErrorMemoryAllocation, "cudaSetDevice") ==
                      TW_ERR_OUT_OF_MEMORY &&
                  !strstr(tw_last_error(), "CUDA_DEVICE_MAX_CONNECTIONS"),
              "unset has no hint: %s", tw_last_error());
  TEST_ASSERT(tw_cuda_check_context(cudaSuccess, "cudaSetDevice") == TW_SUCCESS, "success");
  if (keep) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", keep, 1);
    free(keep);
  }
}

int main(void) {
  test_status_strings();
  test_config();
  test_bad_arguments();
  test_no_gpu();
  test_topology();
  test_gpus();
  test_alike_knobs();
  test_context_hint();
  return tw_test_finish();
}
