/* Comm lifetime, queries, errors and the public symmetric-heap calls. */
#include "runtime/comm.h"
#include "runtime/calldesc.h"
#include "runtime/comm_net.h"
#include "runtime/trace.h"
#include "runtime/watchdog.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "core/env.h"
#include "core/log.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "runtime/registry.h"

tw_status_t tw_config_init(tw_config_t *cfg) {
  TW_ARG_CHECK(cfg != NULL, "cfg: NULL");
  tw_config_t init = TW_CONFIG_INIT;
  *cfg = init;
  return TW_SUCCESS;
}

tw_status_t tw_comm_result(tw_comm_t comm, tw_status_t st) {
  if (st != TW_SUCCESS && comm)
    tw_error_copy(comm->last_error);
  return st;
}

tw_status_t tw_comm_check(const struct tw_comm *comm) {
  TW_ARG_CHECK(comm != NULL, "comm: NULL");
  TW_ARG_CHECK(comm->group != NULL, "comm: destroyed or not initialised");
  return TW_SUCCESS;
}

tw_status_t tw_comm_check_call(const struct tw_comm *comm) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return st;
  const uint32_t code = comm->err_host ? comm->err_host->status : 0;
  if (code != TW_SUCCESS)
    return tw_fail((tw_status_t)code,
                   "comm: unusable since an earlier call failed on the device (%s); "
                   "tw_comm_async_error tells what happened; destroy the comm",
                   tw_status_string((tw_status_t)code));
  return TW_SUCCESS;
}

/* Copies the caller's (possibly older, shorter) config over the defaults and
 * resolves zeros from the environment. */
static tw_status_t resolve_config(const tw_config_t *user, tw_config_t *out) {
  tw_config_t cfg = TW_CONFIG_INIT;
  if (user) {
    TW_ARG_CHECK(user->size >= offsetof(tw_config_t, sm_budget) && user->size <= 65536,
                 "cfg->size: %zu; set it to sizeof(tw_config_t) (use TW_CONFIG_INIT)", user->size);
    TW_ARG_CHECK(user->version >= 1 && user->version <= TW_CONFIG_VERSION,
                 "cfg->version: %u; this library knows versions 1..%d (use TW_CONFIG_INIT)",
                 user->version, TW_CONFIG_VERSION);
    size_t n = user->size < sizeof(cfg) ? user->size : sizeof(cfg);
    memcpy(&cfg, user, n);
    cfg.size = sizeof(cfg);
    cfg.version = TW_CONFIG_VERSION;
  }
  TW_ARG_CHECK(cfg.sm_budget >= 0, "cfg->sm_budget: %d must be >= 0", cfg.sm_budget);
  TW_ARG_CHECK(cfg.ranks_per_node >= 0, "cfg->ranks_per_node: %d must be >= 0", cfg.ranks_per_node);
  TW_ARG_CHECK(cfg.bootstrap_timeout_ms >= 0, "cfg->bootstrap_timeout_ms: %d must be >= 0",
               cfg.bootstrap_timeout_ms);
  TW_ARG_CHECK(cfg.wait_timeout_ms >= 0, "cfg->wait_timeout_ms: %d must be >= 0",
               cfg.wait_timeout_ms);
  if (!cfg.sm_budget)
    cfg.sm_budget = (int32_t)tw_env_int(TW_SM_BUDGET_ID);
  if (!cfg.ranks_per_node)
    cfg.ranks_per_node = (int32_t)tw_env_int(TW_RANKS_PER_NODE_ID);
  if (!cfg.bootstrap_timeout_ms)
    cfg.bootstrap_timeout_ms = (int32_t)tw_env_int(TW_BOOTSTRAP_TIMEOUT_MS_ID);
  if (!cfg.wait_timeout_ms)
    cfg.wait_timeout_ms = (int32_t)tw_env_int(TW_WAIT_TIMEOUT_MS_ID);
  if (!cfg.heap_bytes)
    cfg.heap_bytes = (uint64_t)tw_env_int(TW_HEAP_BYTES_ID);
  TW_ARG_CHECK(cfg.sm_budget >= 0 && cfg.ranks_per_node >= 0 && cfg.bootstrap_timeout_ms > 0 &&
                   cfg.wait_timeout_ms > 0 && cfg.heap_bytes >= (4u << 20),
               "configuration out of range after applying TW_* knobs: sm_budget %d, "
               "ranks_per_node %d, bootstrap_timeout_ms %d, wait_timeout_ms %d, heap_bytes %llu "
               "(>= 4 MiB)",
               cfg.sm_budget, cfg.ranks_per_node, cfg.bootstrap_timeout_ms, cfg.wait_timeout_ms,
               (unsigned long long)cfg.heap_bytes);
  *out = cfg;
  return TW_SUCCESS;
}

void tw_assign_gpus(tw_comm_t comm, const uint64_t *host_of, const uint8_t (*uuid)[16],
                    const int *sm_count, const int *sm_budget_cfg) {
  const int world = comm->world, r = comm->rank;
  comm->ranks_on_device = 0, comm->gpu_shared = 0, comm->plan_sms = 0;
  for (int p = 0; p < world; p++) {
    comm->ranks_on_device += host_of[p] == host_of[r] && memcmp(uuid[p], uuid[r], 16) == 0;
    int on_p = 0; /* ranks on p's GPU */
    for (int q = 0; q < world; q++)
      on_p += host_of[p] == host_of[q] && memcmp(uuid[p], uuid[q], 16) == 0;
    comm->gpu_shared |= on_p > 1;
    const int budget = sm_budget_cfg[p] > 0 ? sm_budget_cfg[p] : sm_count[p] / on_p;
    if (p == 0 || budget < comm->plan_sms)
      comm->plan_sms = budget;
  }
}

/* The knobs every rank must set alike are the table's alike column (core/env_defs.h): each
 * fixes how ranks number, store, fetch or agree on each other's data, or which kernel or plan
 * runs where the peers run the same one. A rank that disagrees would wait for flags its peers
 * never set, or sum partials that had not landed. They travel in table order in
 * tw_peer_info_t.knobs. */
_Static_assert(TW_ENV_ALIKE_COUNT <= TW_PEER_KNOBS,
               "TW_PEER_KNOBS holds every knob that ranks must set alike");

void tw_alike_knobs(int64_t *knobs) {
  int slot = 0;
  for (int id = 0; id < TW_ENV_COUNT; id++)
    if (tw_env_alike((tw_env_id)id))
      knobs[slot++] = tw_env_int((tw_env_id)id);
  while (slot < TW_PEER_KNOBS)
    knobs[slot++] = 0;
}

tw_status_t tw_check_alike_knobs(const tw_peer_info_t *peers, int world) {
  int slot = 0;
  for (int id = 0; id < TW_ENV_COUNT; id++) {
    if (!tw_env_alike((tw_env_id)id))
      continue;
    for (int r = 1; r < world; r++)
      if (peers[r].knobs[slot] != peers[0].knobs[slot]) {
        const char *name = "?";
        tw_env_describe(id, &name, NULL, NULL, NULL, NULL);
        return tw_fail(TW_ERR_INVALID_ARGUMENT,
                       "%s is %lld on rank 0 but %lld on rank %d: every rank must set it alike "
                       "(it fixes how ranks number and exchange their data; the Alike column of "
                       "docs/ENV.md and docs/ENV-DEV.md)",
                       name, (long long)peers[0].knobs[slot], (long long)peers[r].knobs[slot], r);
      }
    slot++;
  }
  return TW_SUCCESS;
}

/* Node layout: virtual nodes of ranks_per_node consecutive ranks, or by host. */
void tw_assign_nodes(tw_comm_t comm, const uint64_t *host_of, int ranks_per_node) {
  int world = comm->world, r = comm->rank;
  if (ranks_per_node > 0) {
    comm->node = r / ranks_per_node;
    comm->nodes = (world + ranks_per_node - 1) / ranks_per_node;
    comm->local_rank = r % ranks_per_node;
    int first = comm->node * ranks_per_node;
    comm->local_size = (first + ranks_per_node <= world) ? ranks_per_node : world - first;
    for (int i = 0; i < world; i++)
      comm->node_of[i] = i / ranks_per_node;
    return;
  }
  /* Nodes numbered by first appearance of each host. */
  int node_of[TW_MAX_WORLD] = {0};
  int nodes = 0;
  for (int i = 0; i < world; i++) {
    node_of[i] = -1;
    for (int j = 0; j < i; j++)
      if (host_of[j] == host_of[i]) {
        node_of[i] = node_of[j];
        break;
      }
    if (node_of[i] < 0)
      node_of[i] = nodes++;
  }
  comm->node = node_of[r];
  comm->nodes = nodes;
  memcpy(comm->node_of, node_of, sizeof(node_of));
  comm->local_rank = 0;
  comm->local_size = 0;
  for (int i = 0; i < world; i++) {
    if (node_of[i] != node_of[r])
      continue;
    if (i < r)
      comm->local_rank++;
    comm->local_size++;
  }
}

static tw_status_t pick_sm_budget(tw_comm_t comm) {
  int budget = comm->config.sm_budget;
  if (budget == 0)
    budget = comm->sm_count / comm->ranks_on_device;
  if (budget < 1 || budget * comm->ranks_on_device > comm->sm_count)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "sm_budget: %d SMs for each of the %d ranks sharing GPU %d does not fit its %d "
                   "SMs, so their kernels could not all be resident at once (lower "
                   "tw_config.sm_budget / TW_SM_BUDGET)",
                   budget, comm->ranks_on_device, comm->device, comm->sm_count);
  comm->sm_budget = budget;
  return TW_SUCCESS;
}

static tw_status_t device_identity(int device, int *sm_count, uint8_t uuid[16]) {
  struct cudaDeviceProp prop;
  tw_status_t st = tw_cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  if (st != TW_SUCCESS)
    return st;
  *sm_count = prop.multiProcessorCount;
  memcpy(uuid, prop.uuid.bytes, 16);
  return TW_SUCCESS;
}

/* This rank's next symmetric allocation (tw_mem_alloc is collective: every rank numbers its
 * allocations alike). */
static tw_status_t comm_alloc_locked(tw_comm_t comm, size_t bytes, void **ptr) {
  tw_status_t st = tw_heap_alloc_locked(comm->group, comm->rank, comm->alloc_seq, bytes, ptr);
  if (st == TW_SUCCESS)
    comm->alloc_seq++;
  return st;
}

/* Error block, control block and the kernels' view, once the group and heap exist. */
static tw_status_t setup_rank(tw_comm_t comm) {
  tw_status_t st;
  tw_group_t *g = comm->group;
  void *ctrl = NULL;
  int prev = -1;
  TW_CHECK(tw_set_device(comm->device, &prev));
  TW_CUDA(cudaHostAlloc((void **)&comm->err_host, sizeof(tw_err_block_t),
                        cudaHostAllocMapped | cudaHostAllocPortable));
  memset((void *)comm->err_host, 0, sizeof(tw_err_block_t));
  TW_CUDA(cudaHostGetDevicePointer((void **)&comm->err_dev, comm->err_host, 0));
  pthread_mutex_lock(&g->mu);
  st = comm_alloc_locked(comm, sizeof(tw_ctrl_t), &ctrl);
  pthread_mutex_unlock(&g->mu);
  if (st != TW_SUCCESS)
    goto fail;
  comm->ctrl = (tw_ctrl_t *)ctrl;
  TW_CUDA(cudaMemset(ctrl, 0, sizeof(tw_ctrl_t)));
  /* The low-latency area: allocated by every rank right after ctrl, the same size everywhere
   * where the ranks agree on TW_LL_BYTES (checked at init) and on heap_bytes (processes that
   * give different ones and so differ on the area fail the allocations' collective check) */
  comm->ll_bytes = comm->world > 1 ? (size_t)tw_env_int(TW_LL_BYTES_ID) : 0;
  if (comm->ll_bytes > comm->config.heap_bytes / 4)
    comm->ll_bytes = 0;
  if (comm->ll_bytes) {
    pthread_mutex_lock(&g->mu);
    st = comm_alloc_locked(comm, comm->ll_bytes, &comm->ll);
    pthread_mutex_unlock(&g->mu);
    if (st != TW_SUCCESS)
      goto fail;
    TW_CUDA(cudaMemset(comm->ll, 0, comm->ll_bytes));
  }
  TW_CUDA(cudaDeviceSynchronize());
  memset(&comm->dev, 0, sizeof(comm->dev));
  comm->dev.rank = comm->rank;
  comm->dev.world = comm->world;
  comm->dev.trap_on_timeout = (int32_t)tw_env_int(TW_WAIT_TRAP_ID);
  comm->dev.timeout_ns = (uint64_t)comm->config.wait_timeout_ms * 1000000ull;
  comm->dev.ctrl = comm->ctrl;
  for (int p = 0; p < comm->world; p++)
    comm->dev.peer_ctrl[p] = tw_heap_peer_ptr(comm, ctrl, p);
  comm->dev.err = comm->err_dev;
  comm->trace_print = tw_env_int(TW_TRACE_ID) != 0;
  const int watchdog = tw_env_int(TW_WATCHDOG_S_ID) > 0;
  if (comm->trace_print || watchdog) {
    const size_t bytes = TW_TRACE_BYTES;
    if (watchdog) { /* rows the host can read while a kernel runs */
      TW_CUDA(cudaHostAlloc((void **)&comm->trace_live, bytes,
                            cudaHostAllocMapped | cudaHostAllocPortable));
      memset(comm->trace_live, 0, bytes);
      TW_CUDA(cudaHostGetDevicePointer((void **)&comm->dev.trace, comm->trace_live, 0));
    } else {
      TW_CUDA(cudaMalloc((void **)&comm->dev.trace, bytes));
      TW_CUDA(cudaMemset(comm->dev.trace, 0, bytes));
    }
    TW_CUDA(cudaHostAlloc((void **)&comm->trace_host, bytes, cudaHostAllocPortable));
    if (comm->trace_live)
      tw_watchdog_add(comm);
  }
  TW_CUDA(cudaMalloc(&comm->gemm_ws, TW_GEMM_WORKSPACE_BYTES));
  TW_CUDA(cudaMemset(comm->gemm_ws, 0, TW_GEMM_WORKSPACE_BYTES));
  cudaSetDevice(prev);
  return TW_SUCCESS;
fail:
  if (prev >= 0)
    cudaSetDevice(prev);
  return st;
}

static void release_rank(tw_comm_t comm) {
  tw_comm_net_fini(comm);
  if (comm->trace_live) {
    tw_watchdog_remove(comm);
    cudaFreeHost(comm->trace_live);
  } else if (comm->dev.trace) {
    cudaFree(comm->dev.trace);
  }
  comm->trace_live = NULL;
  comm->dev.trace = NULL;
  if (comm->trace_host)
    cudaFreeHost(comm->trace_host);
  comm->trace_host = NULL;
  if (comm->ce_stream)
    cudaStreamDestroy(comm->ce_stream);
  if (comm->ce_in)
    cudaEventDestroy(comm->ce_in);
  if (comm->ce_done)
    cudaEventDestroy(comm->ce_done);
  comm->ce_stream = NULL;
  if (comm->launch_stream)
    cudaStreamDestroy(comm->launch_stream);
  if (comm->launch_in)
    cudaEventDestroy(comm->launch_in);
  if (comm->launch_out)
    cudaEventDestroy(comm->launch_out);
  comm->launch_stream = NULL;
  if (comm->err_host)
    cudaFreeHost(comm->err_host);
  comm->err_host = NULL;
  if (comm->gemm_ws)
    cudaFree(comm->gemm_ws);
  comm->gemm_ws = NULL;
}

static void group_release(tw_group_t *g) {
  tw_heap_group_fini(g);
  if (g->bs)
    tw_bootstrap_destroy(g->bs);
  pthread_mutex_destroy(&g->mu);
  free(g);
}

static tw_group_t *group_new(int world) {
  tw_group_t *g = calloc(1, sizeof(*g));
  if (!g)
    return NULL;
  pthread_mutex_init(&g->mu, NULL);
  g->world = world;
  for (int r = 0; r < TW_MAX_WORLD; r++)
    g->device_of[r] = -1;
  return g;
}

tw_status_t tw_comm_init_all(tw_comm_t *comms, int world, const int *devices,
                             const tw_config_t *user_cfg) {
  tw_status_t st;
  tw_group_t *g = NULL;
  tw_config_t cfg;
  int sm_count[TW_MAX_WORLD], budget_cfg[TW_MAX_WORLD];
  uint8_t uuid[TW_MAX_WORLD][16];
  uint64_t host_of[TW_MAX_WORLD] = {0};
  tw_error_clear();
  TW_ARG_CHECK(comms != NULL, "comms: NULL");
  TW_ARG_CHECK(world >= 1 && world <= TW_MAX_WORLD, "world: %d is outside [1, %d]", world,
               TW_MAX_WORLD);
  TW_ARG_CHECK(devices != NULL, "devices: NULL");
  for (int r = 0; r < world; r++)
    comms[r] = NULL;
  st = resolve_config(user_cfg, &cfg);
  if (st != TW_SUCCESS)
    return st;
  for (int r = 0; r < world; r++) {
    st = tw_check_device(devices[r]);
    if (st != TW_SUCCESS) {
      tw_error_prefix("devices[%d]", r);
      return st;
    }
    st = device_identity(devices[r], &sm_count[r], uuid[r]);
    if (st != TW_SUCCESS)
      return st;
    budget_cfg[r] = cfg.sm_budget;
  }
  /* Distinct GPUs must reach each other. */
  for (int r = 0; r < world; r++) {
    for (int p = 0; p < world; p++) {
      if (devices[r] == devices[p])
        continue;
      int can = 0;
      st = tw_cuda_check(cudaDeviceCanAccessPeer(&can, devices[r], devices[p]),
                         "cudaDeviceCanAccessPeer");
      if (st != TW_SUCCESS)
        return st;
      if (!can)
        return tw_fail(TW_ERR_NOT_SUPPORTED,
                       "devices: GPU %d (rank %d) cannot access GPU %d (rank %d): no peer access "
                       "between them (a missing NVLink/PCIe peer path)",
                       devices[r], r, devices[p], p);
    }
  }
  g = group_new(world);
  if (!g)
    return tw_fail(TW_ERR_SYSTEM, "out of host memory");
  g->nlocal = world;
  for (int r = 0; r < world; r++) {
    comms[r] = calloc(1, sizeof(struct tw_comm));
    if (!comms[r])
      TW_FAIL(TW_ERR_SYSTEM, "out of host memory");
    tw_comm_t c = comms[r];
    c->group = g;
    c->rank = r;
    c->world = world;
    c->device = devices[r];
    c->config = cfg;
    c->sm_count = sm_count[r];
    tw_assign_gpus(c, host_of, (const uint8_t(*)[16])uuid, sm_count, budget_cfg);
    TW_CHECK(pick_sm_budget(c));
    tw_assign_nodes(c, host_of, cfg.ranks_per_node);
    g->local[r] = c;
    g->mappable[r] = 1;
    g->device_of[r] = devices[r];
    g->live++;
  }
  for (int r = 0; r < world; r++) {
    int prev;
    TW_CHECK(tw_set_device(devices[r], &prev));
    TW_CUDA_CONTEXT(cudaFree(0)); /* create the primary context before cuMem calls */
    st = tw_ops_preload();
    cudaSetDevice(prev);
    if (st != TW_SUCCESS)
      goto fail;
  }
  TW_CHECK(tw_heap_group_init(g, cfg.heap_bytes));
  for (int r = 0; r < world; r++) {
    TW_CHECK(setup_rank(comms[r]));
    comms[r]->one_process = 1;
  }
  TW_CHECK(tw_make_launch_streams(comms, world));
  TW_CHECK(tw_comm_net_init(comms, world));
  if (comms[0]->ranks_on_device > 8 && !getenv("CUDA_DEVICE_MAX_CONNECTIONS"))
    TW_WARN("%d ranks share GPU %d: set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts, or "
            "ranks' kernels may share a hardware queue and wait on each other until the timeout",
            comms[0]->ranks_on_device, comms[0]->device);
  TW_INFO("tw_comm_init_all: %d ranks, sm_budget %d on rank 0, %d node(s)", world,
          comms[0]->sm_budget, comms[0]->nodes);
  return TW_SUCCESS;
fail:
  if (g) {
    for (int r = 0; r < world; r++) {
      if (!comms[r])
        continue;
      tw_comm_net_fini(comms[r]); /* before the memory its NICs registered goes */
      pthread_mutex_lock(&g->mu);
      tw_heap_free_all_locked(comms[r]->group, comms[r]->rank);
      pthread_mutex_unlock(&g->mu);
      release_rank(comms[r]);
      free(comms[r]);
      comms[r] = NULL;
    }
    group_release(g);
  }
  return st;
}

tw_status_t tw_get_unique_id(tw_unique_id_t *id) {
  tw_error_clear();
  TW_ARG_CHECK(id != NULL, "id: NULL");
  return tw_bootstrap_create_root(id);
}

tw_status_t tw_comm_init_rank(tw_comm_t *out, int world, tw_unique_id_t id, int rank,
                              const tw_config_t *user_cfg) {
  tw_status_t st;
  tw_config_t cfg;
  tw_comm_t c = NULL;
  tw_group_t *g = NULL;
  tw_peer_info_t self;
  int device = -1;
  uint64_t host_of[TW_MAX_WORLD];
  tw_error_clear();
  TW_ARG_CHECK(out != NULL, "comm: NULL");
  *out = NULL;
  TW_ARG_CHECK(world >= 1 && world <= TW_MAX_WORLD, "world: %d is outside [1, %d]", world,
               TW_MAX_WORLD);
  TW_ARG_CHECK(rank >= 0 && rank < world, "rank: %d is outside [0, world=%d)", rank, world);
  st = resolve_config(user_cfg, &cfg);
  if (st != TW_SUCCESS)
    return st;
  st = tw_cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (st != TW_SUCCESS)
    return st;
  st = tw_check_device(device);
  if (st != TW_SUCCESS)
    return st;
  memset(&self, 0, sizeof(self));
  self.rank = rank;
  self.pid = (int32_t)getpid();
  self.cuda_device = device;
  st = device_identity(device, &self.sm_count, self.gpu_uuid);
  if (st != TW_SUCCESS)
    return st;
  self.sm_budget = cfg.sm_budget;
  tw_alike_knobs(self.knobs);
  g = group_new(world);
  if (!g)
    return tw_fail(TW_ERR_SYSTEM, "out of host memory");
  g->nlocal = 1;
  TW_CHECK(tw_bootstrap_init(&g->bs, &id, rank, world, cfg.bootstrap_timeout_ms, &self));
  const tw_peer_info_t *peers = tw_bootstrap_peers(g->bs);
  TW_CHECK(tw_check_alike_knobs(peers, world));
  c = calloc(1, sizeof(*c));
  if (!c)
    TW_FAIL(TW_ERR_SYSTEM, "out of host memory");
  c->group = g;
  c->rank = rank;
  c->world = world;
  c->device = device;
  c->config = cfg;
  c->sm_count = self.sm_count;
  uint8_t uuid[TW_MAX_WORLD][16];
  int sm_count[TW_MAX_WORLD], budget_cfg[TW_MAX_WORLD];
  for (int p = 0; p < world; p++) {
    host_of[p] = peers[p].host_hash;
    g->mappable[p] = peers[p].host_hash == peers[rank].host_hash;
    memcpy(uuid[p], peers[p].gpu_uuid, 16);
    sm_count[p] = peers[p].sm_count, budget_cfg[p] = peers[p].sm_budget;
  }
  tw_assign_gpus(c, host_of, (const uint8_t(*)[16])uuid, sm_count, budget_cfg);
  TW_CHECK(pick_sm_budget(c));
  tw_assign_nodes(c, host_of, cfg.ranks_per_node);
  g->local[rank] = c;
  g->device_of[rank] = device;
  g->live = 1;
  TW_CUDA_CONTEXT(cudaFree(0));
  TW_CHECK(tw_ops_preload());
  TW_CHECK(tw_heap_group_init(g, cfg.heap_bytes));
  TW_CHECK(setup_rank(c));
  TW_CHECK(tw_comm_net_init(&c, 1));
  /* No rank may signal a peer before that peer zeroed its control block. */
  TW_CHECK(tw_bootstrap_barrier(g->bs));
  *out = c;
  return TW_SUCCESS;
fail:
  if (c) {
    tw_comm_net_fini(c);
    pthread_mutex_lock(&g->mu);
    tw_heap_free_all_locked(c->group, c->rank);
    pthread_mutex_unlock(&g->mu);
    release_rank(c);
    free(c);
  }
  if (g)
    group_release(g);
  tw_error_prefix("rank %d of %d", rank, world);
  return st;
}

tw_status_t tw_comm_destroy(tw_comm_t comm) {
  tw_error_clear();
  if (!comm)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "comm: NULL");
  tw_group_t *g = comm->group;
  if (!g)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "comm: already destroyed");
  int prev;
  if (tw_set_device(comm->device, &prev) == TW_SUCCESS) {
    cudaDeviceSynchronize();
    cudaSetDevice(prev);
  }
  tw_comm_net_fini(comm); /* the proxy stops, the NICs let go of the memory, before it goes */
  pthread_mutex_lock(&g->mu);
  tw_heap_free_all_locked(comm->group, comm->rank);
  g->local[comm->rank] = NULL;
  int last = --g->live == 0;
  pthread_mutex_unlock(&g->mu);
  release_rank(comm);
  comm->group = NULL;
  free(comm);
  if (last)
    group_release(g);
  return TW_SUCCESS;
}

#define COMM_QUERY(fn, field)                                                                      \
  tw_status_t fn(tw_comm_t comm, int *value) {                                                     \
    tw_status_t st = tw_comm_check(comm);                                                          \
    if (st == TW_SUCCESS && !value)                                                                \
      st = tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: NULL output", #fn);                               \
    if (st != TW_SUCCESS)                                                                          \
      return tw_comm_result(comm, st);                                                             \
    *value = comm->field;                                                                          \
    return TW_SUCCESS;                                                                             \
  }
COMM_QUERY(tw_comm_rank, rank)
COMM_QUERY(tw_comm_size, world)
COMM_QUERY(tw_comm_device, device)
COMM_QUERY(tw_comm_local_rank, local_rank)
COMM_QUERY(tw_comm_local_size, local_size)
COMM_QUERY(tw_comm_node, node)
COMM_QUERY(tw_comm_nodes, nodes)
COMM_QUERY(tw_comm_sm_budget, sm_budget)
#undef COMM_QUERY

const char *tw_comm_last_error(tw_comm_t comm) {
  if (!comm)
    return "comm: NULL";
  return comm->last_error;
}

static const char *channel_name(int ch) {
  const char *name = tw_channel_name(ch);
  return name ? name : "unknown";
}

void tw_err_block_format(const volatile tw_err_block_t *e, int wait_timeout_ms, char *buf,
                         size_t len) {
  const uint32_t code = e->status;
  if (e->peer == TW_ERR_PEER_PIPELINE) {
    static const char *const roles[] = {"?",
                                        "producer waiting for a free stage",
                                        "consumer waiting for a stage's loads",
                                        "signal warp waiting for a tile",
                                        "consumer waiting for a signal-ring entry",
                                        "split-K reader waiting for its sender",
                                        "split-K sender waiting for its reader"};
    const int nroles = (int)(sizeof(roles) / sizeof(roles[0]));
    const int role = e->what / 16;
    char bound[96];
    if (tw_env_int(TW_FAULT_STALL_TILE_ID) >= 0) /* the test's injected stall (gemm_launch.cuh) */
      snprintf(bound, sizeof(bound), "%d ms: TW_FAULT_STALL_TILE is set", TW_FAULT_STALL_BOUND_MS);
    else
      snprintf(bound, sizeof(bound), "2 x TW_WAIT_TIMEOUT_MS = %d ms, + 10 s", 2 * wait_timeout_ms);
    snprintf(buf, len,
             "%s: rank %d, op %s, block %d: internal stall in the GEMM pipeline (%s, stage %d) "
             "for longer than its bound (%s); the kernel trapped. Please report it. The comm is "
             "unusable: destroy it.",
             tw_status_string((tw_status_t)code), e->rank, channel_name(e->op), e->block,
             roles[role >= 1 && role < nroles ? role : 0], e->what % 16, bound);
    return;
  }
  if (e->peer == TW_ERR_PEER_MOE_INDEX || e->peer == TW_ERR_PEER_MOE_CAPACITY) {
    if (e->peer == TW_ERR_PEER_MOE_INDEX)
      snprintf(buf, len,
               "%s: rank %d, op %s: rank %d's args->topk_idx holds expert %lld at entry %llu "
               "(token %llu x top_k + slot); expected -1 .. experts - 1. No rank copied "
               "anything. The comm is unusable: destroy it.",
               tw_status_string((tw_status_t)code), e->rank, channel_name(e->op), e->what,
               (long long)(int64_t)e->expected, (unsigned long long)e->seen,
               (unsigned long long)e->seen);
    else
      snprintf(buf, len,
               "%s: rank %d, op %s: this routing sends %llu rows (each expert's padded to 128) "
               "to rank %d, whose args->recv_rows is %llu: give every rank a larger recv (at "
               "most max_tokens x world x min(top_k, local experts) + 127 x local experts rows "
               "are ever needed). No rank copied anything. The comm is unusable: destroy it.",
               tw_status_string((tw_status_t)code), e->rank, channel_name(e->op),
               (unsigned long long)e->expected, e->what, (unsigned long long)e->seen);
    return;
  }
  char peer[32] = "unknown";
  if (e->peer >= 0)
    snprintf(peer, sizeof(peer), "%d", e->peer);
  snprintf(buf, len,
           "%s: rank %d, op %s, block %d, item %d: waited for flag at %#llx (%s offset "
           "%#llx) to reach %llu, last saw %llu; peer expected to signal: %s; wait bound %d ms "
           "(TW_WAIT_TIMEOUT_MS). The comm is unusable: destroy it.",
           tw_status_string((tw_status_t)code), e->rank, channel_name(e->op), e->block, e->what,
           (unsigned long long)e->flag_addr,
           e->flag_offset < sizeof(tw_ctrl_t)
               ? "control-block"
               : "outside the control block (a low-latency word, or the command FIFO's tail):",
           (unsigned long long)e->flag_offset, (unsigned long long)e->expected,
           (unsigned long long)e->seen, peer, wait_timeout_ms);
}

tw_status_t tw_comm_async_error(tw_comm_t comm, tw_status_t *async_status) {
  tw_status_t st = tw_comm_check(comm);
  if (st == TW_SUCCESS && !async_status)
    st = tw_fail(TW_ERR_INVALID_ARGUMENT, "async_status: NULL");
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const volatile tw_err_block_t *e = comm->err_host;
  uint32_t code = e->status;
  *async_status = (tw_status_t)code;
  if (code == TW_SUCCESS)
    return TW_SUCCESS;
  __sync_synchronize();
  if (code == TW_ERR_NETWORK)
    snprintf(comm->last_error, sizeof(comm->last_error), "%s", tw_comm_net_error(comm));
  else if (code == TW_ERR_MISMATCH)
    tw_call_format_mismatch(comm, e, comm->last_error, sizeof(comm->last_error));
  else {
    tw_err_block_format(e, comm->config.wait_timeout_ms, comm->last_error,
                        sizeof(comm->last_error));
    if (e->peer != TW_ERR_PEER_PIPELINE && e->peer != TW_ERR_PEER_MOE_INDEX &&
        e->peer != TW_ERR_PEER_MOE_CAPACITY)
      tw_call_format_absent(comm, e, comm->last_error, sizeof(comm->last_error));
  }
  return TW_SUCCESS;
}

tw_status_t tw_mem_alloc(tw_comm_t comm, size_t bytes, void **ptr) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (!ptr)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "ptr: NULL"));
  *ptr = NULL;
  if (bytes == 0)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "bytes: 0"));
  int prev;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  pthread_mutex_lock(&comm->group->mu);
  st = comm_alloc_locked(comm, bytes, ptr);
  pthread_mutex_unlock(&comm->group->mu);
  if (st == TW_SUCCESS) {
    st = tw_comm_net_alloc(comm, *ptr, bytes);
    if (st != TW_SUCCESS) {
      tw_comm_net_free(comm, *ptr);
      pthread_mutex_lock(&comm->group->mu);
      tw_heap_free_locked(comm->group, comm->rank, *ptr);
      pthread_mutex_unlock(&comm->group->mu);
      *ptr = NULL;
    }
  }
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}

tw_status_t tw_mem_free(tw_comm_t comm, void *ptr) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (!ptr)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "ptr: NULL"));
  if (ptr == (void *)comm->ctrl || (comm->ll && ptr == comm->ll))
    return tw_comm_result(
        comm, tw_fail(TW_ERR_INVALID_ARGUMENT,
                      "ptr: %p is the comm's %s, not a tw_mem_alloc "
                      "allocation",
                      ptr, ptr == (void *)comm->ctrl ? "control block" : "low-latency area"));
  tw_comm_net_free(comm, ptr); /* nothing where ptr is no allocation's start */
  pthread_mutex_lock(&comm->group->mu);
  st = tw_heap_free_locked(comm->group, comm->rank, ptr);
  pthread_mutex_unlock(&comm->group->mu);
  return tw_comm_result(comm, st);
}

tw_status_t tw_mem_peer_ptrs(tw_comm_t comm, const void *ptr, void *const **peer_ptrs_device) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (!peer_ptrs_device)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "peer_ptrs_device: NULL"));
  tw_alloc_t *a = NULL;
  st = tw_heap_lookup(comm, ptr, 1, "ptr", &a);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  uintptr_t base =
      (uintptr_t)comm->group->va_base + (uintptr_t)comm->rank * comm->group->heap_va + a->offset;
  if ((uintptr_t)ptr != base)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT,
                                        "ptr: %p is %zu bytes inside its allocation; the device "
                                        "peer table is kept for the allocation's base %p",
                                        ptr, (size_t)((uintptr_t)ptr - base), (void *)base));
  *peer_ptrs_device = (void *const *)a->peer_table[comm->rank];
  return TW_SUCCESS;
}

tw_status_t tw_mem_peer_ptr(tw_comm_t comm, const void *ptr, int peer, void **peer_ptr) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (!peer_ptr)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "peer_ptr: NULL"));
  if (peer < 0 || peer >= comm->world)
    return tw_comm_result(
        comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "peer: %d is outside [0, %d)", peer, comm->world));
  st = tw_heap_lookup(comm, ptr, 1, "ptr", NULL);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  *peer_ptr = tw_heap_peer_ptr(comm, ptr, peer);
  if (!*peer_ptr)
    return tw_comm_result(comm, tw_fail(TW_ERR_NOT_SUPPORTED,
                                        "peer: rank %d's memory is not mapped in this process "
                                        "(another host)",
                                        peer));
  return TW_SUCCESS;
}
