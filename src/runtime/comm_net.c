/* A comm's inter-node transport (comm_net.h). */
#include "runtime/comm_net.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/env.h"
#include "core/log.h"
#include "core/status.h"
#include "runtime/comm.h"
#include "transport/net.h"
#include "transport/proxy.h"

#define NET_FIFO_SLOTS 4096
#define NET_INFO_MAX 16384 /* bytes of a backend's connection blob */

struct tw_comm_net {
  tw_comm_t comm;
  tw_net_t *net;
  tw_fifo_t fifo;
  tw_proxy_t *proxy;
  uint64_t *host_flags; /* efa: the flag words, host memory mapped for the device */
  cudaStream_t abort_stream;
  uint32_t *abort_words; /* pinned {abort, err_claim} = {1, 1}, copied into ctrl on a failure */
  char error[TW_ERRMSG_LEN];
  char line[512];
};

/* An allocation whose keys are still being gathered from the ranks of this process. */
typedef struct tw_net_pending {
  struct tw_net_pending *next;
  uint64_t heap_off;
  int registered;
  tw_net_key_t keys[TW_MAX_WORLD];
} tw_net_pending_t;

/* The blob every rank gives every other at connect: its backend, then the backend's own. */
typedef struct net_blob {
  char backend[8];
  uint64_t info_bytes;
  unsigned char info[NET_INFO_MAX];
} net_blob_t;

static uint64_t heap_off_of(tw_comm_t comm, const void *ptr) {
  return (uint64_t)((uintptr_t)ptr - (uintptr_t)tw_group_slot(comm->group, comm->rank, 0));
}

/* The proxy's failure: the comm's async error, its kernels told to stop. */
static void on_proxy_error(void *ctx, tw_status_t status, int peer, const char *message) {
  struct tw_comm_net *cn = (struct tw_comm_net *)ctx;
  tw_comm_t comm = cn->comm;
  snprintf(cn->error, sizeof(cn->error), "%s: %s. The comm is unusable: destroy it.",
           tw_status_string(status), message);
  volatile tw_err_block_t *e = comm->err_host;
  if (e->status != 0)
    return; /* a kernel's failure came first */
  e->rank = comm->rank;
  e->op = -1;
  e->peer = peer;
  e->flag_offset = 0;
  e->flag_addr = 0;
  e->expected = e->seen = 0;
  e->block = -1;
  e->what = -1;
  __sync_synchronize();
  e->status = (uint32_t)status;
  /* abort and err_claim are adjacent in ctrl: the kernels stop waiting, and none overwrites the
   * error block */
  cudaSetDevice(comm->device);
  /* the stream is made only now: every stream takes one of the GPU's hardware queues
   * (CUDA_DEVICE_MAX_CONNECTIONS), which the ranks' persistent kernels need */
  if (!cn->abort_stream && cudaStreamCreateWithFlags(&cn->abort_stream, cudaStreamNonBlocking))
    return; /* the kernels' own waits still end, bounded */
  cudaMemcpyAsync(&comm->ctrl->abort, cn->abort_words, 2 * sizeof(uint32_t), cudaMemcpyHostToDevice,
                  cn->abort_stream);
  cudaStreamSynchronize(cn->abort_stream);
}

static tw_status_t open_one(tw_comm_t c, net_blob_t *blob) {
  tw_status_t st;
  struct tw_comm_net *cn = calloc(1, sizeof(*cn));
  if (!cn)
    return tw_fail(TW_ERR_SYSTEM, "out of host memory");
  c->net = cn;
  cn->comm = c;
  const char *backend = tw_env_str(TW_NET_ID);
  if (strcmp(backend, "none") == 0)
    TW_FAIL(TW_ERR_NOT_SUPPORTED,
            "rank %d has ranks on %d other node(s) and TW_NET=none: set TW_NET=auto, ib or efa",
            c->rank, c->nodes - 1);
  char bus_id[32] = "";
  TW_CUDA(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), c->device));
  TW_CUDA(cudaHostAlloc((void **)&cn->host_flags, TW_NET_FLAGS * sizeof(uint64_t),
                        cudaHostAllocMapped | cudaHostAllocPortable));
  memset(cn->host_flags, 0, TW_NET_FLAGS * sizeof(uint64_t));
  TW_CUDA(cudaHostAlloc((void **)&cn->abort_words, 2 * sizeof(uint32_t), cudaHostAllocPortable));
  cn->abort_words[0] = cn->abort_words[1] = 1;
  tw_net_config_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.rank = c->rank;
  cfg.world = c->world;
  cfg.node_of = c->node_of;
  cfg.local_rank = c->local_rank;
  cfg.local_size = c->local_size;
  cfg.gpu_bus_id = bus_id;
  cfg.backend = backend;
  cfg.devices = tw_env_str(TW_NET_DEVICES_ID);
  cfg.qps = (int)tw_env_int(TW_NET_QPS_ID);
  cfg.flags_off = offsetof(tw_ctrl_t, net_flags);
  cfg.host_flags = cn->host_flags;
  TW_CHECK(tw_net_open(&cfg, &cn->net));
  memset(blob, 0, sizeof(*blob));
  snprintf(blob->backend, sizeof(blob->backend), "%s", cn->net->ops->name);
  blob->info_bytes = cn->net->ops->info_bytes(cn->net);
  if (blob->info_bytes > NET_INFO_MAX)
    TW_FAIL(TW_ERR_INTERNAL, "backend blob of %llu bytes", (unsigned long long)blob->info_bytes);
  TW_CHECK(cn->net->ops->local_info(cn->net, blob->info));
  TW_CHECK(tw_fifo_create(&cn->fifo, NET_FIFO_SLOTS));
  c->dev.fifo = cn->fifo.dev;
  if (strcmp(cn->net->ops->name, "efa") == 0)
    TW_CUDA(cudaHostGetDevicePointer((void **)&c->dev.net_flags, cn->host_flags, 0));
  else
    c->dev.net_flags = &c->ctrl->net_flags[0][0];
  return TW_SUCCESS;
fail:
  tw_error_prefix("rank %d, inter-node transport", c->rank);
  return st;
}

/* Every rail peer must run the same backend. */
static tw_status_t connect_one(tw_comm_t c, const net_blob_t *blobs) {
  struct tw_comm_net *cn = c->net;
  const size_t bytes = cn->net->ops->info_bytes(cn->net);
  unsigned char *infos = calloc((size_t)c->world, bytes);
  if (!infos)
    return tw_fail(TW_ERR_SYSTEM, "out of host memory");
  for (int r = 0; r < c->world; r++) {
    if (c->node_of[r] == c->node) {
      memset(infos + (size_t)r * bytes, 0, bytes);
      continue;
    }
    if (!blobs[r].backend[0]) {
      free(infos);
      return tw_fail(TW_ERR_REMOTE,
                     "rank %d could not open its inter-node transport (its own error says why)", r);
    }
    if (strcmp(blobs[r].backend, cn->net->ops->name) != 0 || blobs[r].info_bytes != bytes) {
      free(infos);
      return tw_fail(TW_ERR_NOT_SUPPORTED,
                     "ranks disagree on the inter-node transport: rank %d uses %s, rank %d %s "
                     "(TW_NET=auto found different NICs; set TW_NET to one backend everywhere)",
                     c->rank, cn->net->ops->name, r, blobs[r].backend);
    }
    memcpy(infos + (size_t)r * bytes, blobs[r].info, bytes);
  }
  tw_status_t st = cn->net->ops->connect(cn->net, infos);
  free(infos);
  return st;
}

static tw_status_t start_proxy(tw_comm_t c) {
  struct tw_comm_net *cn = c->net;
  char bus_id[32] = "";
  cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), c->device);
  tw_proxy_config_t pc;
  memset(&pc, 0, sizeof(pc));
  pc.fifo = &cn->fifo;
  pc.net = cn->net;
  pc.rank = c->rank;
  /* half the kernels' bound: a peer that stopped answering is named (TW_ERR_NETWORK) before the
   * kernel's wait for its data gives up on its own */
  pc.timeout_ns = (uint64_t)c->config.wait_timeout_ms * 500000ull;
  pc.gpu_bus_id = bus_id;
  pc.on_error = on_proxy_error;
  pc.ctx = cn;
  tw_status_t st = tw_proxy_start(&pc, &cn->proxy);
  if (st == TW_SUCCESS) {
    cn->net->ops->describe(cn->net, cn->line, sizeof(cn->line));
    TW_INFO("rank %d (node %d of %d): %s", c->rank, c->node, c->nodes, cn->line);
  }
  return st;
}

/* Registers ptr (bytes) of comm and, when every rank of this process has, gives each the keys
 * of all (gathered from the other processes first). */
static tw_status_t reg_locked(tw_comm_t comm, void *ptr, size_t bytes) {
  tw_group_t *g = comm->group;
  const uint64_t off = heap_off_of(comm, ptr);
  tw_net_pending_t *p = g->net_pending;
  while (p && p->heap_off != off)
    p = p->next;
  if (!p) {
    p = calloc(1, sizeof(*p));
    if (!p)
      return tw_fail(TW_ERR_SYSTEM, "out of host memory");
    p->heap_off = off;
    p->next = g->net_pending;
    g->net_pending = p;
  }
  struct tw_comm_net *cn = comm->net;
  tw_status_t st = cn->net->ops->reg(cn->net, off, ptr, bytes, 1, &p->keys[comm->rank]);
  if (st != TW_SUCCESS && !g->bs)
    return st;
  /* across processes the exchange happens even after a failure (key base 0), so no process
   * waits for this one */
  char failed_why[TW_ERRMSG_LEN] = "";
  if (st != TW_SUCCESS)
    tw_error_copy(failed_why);
  if (++p->registered < g->nlocal)
    return TW_SUCCESS;
  tw_status_t xs = g->bs ? tw_bootstrap_allgather(g->bs, p->keys, sizeof(tw_net_key_t)) : st;
  if (st == TW_SUCCESS)
    st = xs;
  for (int r = 0; r < g->world && st == TW_SUCCESS; r++)
    if (comm->node_of[r] != comm->node && p->keys[r].base == 0)
      st = tw_fail(TW_ERR_REMOTE,
                   "rank %d could not register symmetric allocation at heap offset "
                   "%#llx with its NICs (its own error says why)",
                   r, (unsigned long long)off);
  for (int r = 0; r < g->world && st == TW_SUCCESS; r++)
    if (g->local[r] && g->local[r]->net)
      st = g->local[r]->net->net->ops->set_remote(g->local[r]->net->net, off, p->keys);
  if (failed_why[0])
    st = tw_fail(TW_ERR_NOT_SUPPORTED, "%s", failed_why);
  /* unlink */
  tw_net_pending_t **link = &g->net_pending;
  while (*link != p)
    link = &(*link)->next;
  *link = p->next;
  free(p);
  return st;
}

tw_status_t tw_comm_net_init(tw_comm_t *comms, int n) {
  tw_status_t st = TW_SUCCESS;
  if (comms[0]->nodes <= 1)
    return TW_SUCCESS;
  tw_group_t *g = comms[0]->group;
  const int world = comms[0]->world;
  net_blob_t *blobs = calloc((size_t)world, sizeof(net_blob_t));
  if (!blobs)
    return tw_fail(TW_ERR_SYSTEM, "out of host memory");
  int prev = -1;
  for (int i = 0; i < n && st == TW_SUCCESS; i++) {
    st = tw_set_device(comms[i]->device, &prev);
    if (st == TW_SUCCESS)
      st = open_one(comms[i], &blobs[comms[i]->rank]);
    cudaSetDevice(prev);
  }
  /* every process takes part in the exchange, a failed one with an empty blob, so none waits
   * for it: the others then fail on the backend check */
  if (g->bs) {
    tw_status_t xs = tw_bootstrap_allgather(g->bs, blobs, sizeof(net_blob_t));
    if (st == TW_SUCCESS)
      st = xs;
  }
  for (int i = 0; i < n && st == TW_SUCCESS; i++)
    st = connect_one(comms[i], blobs);
  free(blobs);
  for (int i = 0; i < n && st == TW_SUCCESS; i++) {
    pthread_mutex_lock(&g->mu);
    st = reg_locked(comms[i], comms[i]->ctrl, sizeof(tw_ctrl_t));
    pthread_mutex_unlock(&g->mu);
  }
  for (int i = 0; i < n && st == TW_SUCCESS; i++)
    if (comms[i]->ll_bytes) {
      pthread_mutex_lock(&g->mu);
      st = reg_locked(comms[i], comms[i]->ll, comms[i]->ll_bytes);
      pthread_mutex_unlock(&g->mu);
    }
  for (int i = 0; i < n && st == TW_SUCCESS; i++)
    st = start_proxy(comms[i]);
  return st;
}

tw_status_t tw_comm_net_alloc(tw_comm_t comm, void *ptr, size_t bytes) {
  if (!comm->net)
    return TW_SUCCESS;
  pthread_mutex_lock(&comm->group->mu);
  tw_status_t st = reg_locked(comm, ptr, bytes);
  pthread_mutex_unlock(&comm->group->mu);
  return st;
}

void tw_comm_net_free(tw_comm_t comm, void *ptr) {
  if (comm->net && comm->net->net)
    comm->net->net->ops->dereg(comm->net->net, heap_off_of(comm, ptr));
}

void tw_comm_net_fini(tw_comm_t comm) {
  struct tw_comm_net *cn = comm->net;
  if (!cn)
    return;
  tw_proxy_stop(cn->proxy);
  if (cn->net)
    cn->net->ops->close(cn->net);
  tw_fifo_destroy(&cn->fifo);
  if (cn->abort_stream)
    cudaStreamDestroy(cn->abort_stream);
  if (cn->abort_words)
    cudaFreeHost(cn->abort_words);
  if (cn->host_flags)
    cudaFreeHost(cn->host_flags);
  free(cn);
  comm->net = NULL;
}

const char *tw_comm_net_error(const struct tw_comm *comm) {
  return comm->net ? comm->net->error : "";
}

tw_status_t tw_transport_info(char *buf, size_t len) {
  tw_error_clear();
  if (!buf || len == 0)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "buf: %s", !buf ? "NULL" : "0 bytes");
  return tw_net_list_devices(buf, len);
}

tw_status_t tw_comm_rail(const struct tw_comm *comm, const char *op, tw_rail_t *r) {
  if (comm->nodes > TW_RAIL_MAX_NODES)
    return tw_fail(TW_ERR_NOT_SUPPORTED, "%s across nodes: %d nodes; at most %d", op, comm->nodes,
                   TW_RAIL_MAX_NODES);
  memset(r, 0, sizeof(*r));
  r->nodes = comm->nodes;
  r->node = comm->node;
  r->local = comm->local_rank;
  r->local_size = comm->local_size;
  int count[TW_MAX_WORLD] = {0};
  for (int q = 0; q < comm->world; q++) {
    const int n = comm->node_of[q], l = count[n]++;
    r->node_of[q] = (int8_t)n;
    r->local_of[q] = (int8_t)l;
    if (n == comm->node)
      r->local_rank[l] = (int16_t)q;
    if (l == comm->local_rank)
      r->rail[n] = (int16_t)q;
  }
  for (int n = 0; n < comm->nodes; n++)
    if (count[n] != comm->local_size)
      return tw_fail(TW_ERR_NOT_SUPPORTED,
                     "%s across nodes needs as many ranks on every node (rail peers): node %d "
                     "has %d, node %d has %d",
                     op, comm->node, comm->local_size, n, count[n]);
  return TW_SUCCESS;
}
