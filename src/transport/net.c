/* The inter-node transport's shared half (net.h, net_impl.h). */
#include "transport/net.h"

#include <stdio.h>

#include "core/status.h"

int tw_net_local_index(const tw_net_config_t *cfg, int r) {
  int idx = 0;
  for (int i = 0; i < r; i++)
    idx += cfg->node_of[i] == cfg->node_of[r];
  return idx;
}

int tw_net_is_rail_peer(const tw_net_config_t *cfg, int r) {
  if (r < 0 || r >= cfg->world || cfg->node_of[r] == cfg->node_of[cfg->rank])
    return 0;
  return tw_net_local_index(cfg, r) == tw_net_local_index(cfg, cfg->rank);
}

#ifndef TW_HAVE_VERBS_H
/* Built without rdma-core's headers: no backend. */
tw_status_t tw_net_open(const tw_net_config_t *cfg, tw_net_t **out) {
  (void)cfg;
  *out = NULL;
  return tw_fail(TW_ERR_NOT_SUPPORTED,
                 "ranks on other nodes need the inter-node transport, and this libtilewire was "
                 "built without rdma-core's headers: install libibverbs-dev (rdma-core-devel) "
                 "and rebuild");
}

tw_status_t tw_net_list_devices(char *buf, size_t len) {
  snprintf(buf, len, "none: built without rdma-core's headers");
  return TW_ERR_NOT_SUPPORTED;
}
#else
#include "transport/net_impl.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "core/status.h"
#include "runtime/driver.h"

/* The sysfs path of a PCI device, resolved (NULL when unknown). */
static char *pci_path_of_gpu(const char *bus_id) {
  if (!bus_id || !*bus_id)
    return NULL;
  char link[128], lower[32];
  size_t i = 0;
  for (; bus_id[i] && i + 1 < sizeof(lower); i++)
    lower[i] = (char)((bus_id[i] >= 'A' && bus_id[i] <= 'F') ? bus_id[i] - 'A' + 'a' : bus_id[i]);
  lower[i] = 0;
  snprintf(link, sizeof(link), "/sys/bus/pci/devices/%s", lower);
  return realpath(link, NULL);
}

static char *pci_path_of_nic(struct ibv_device *dev) {
  if (!dev->ibdev_path[0])
    return NULL;
  char link[IBV_SYSFS_PATH_MAX + 16];
  snprintf(link, sizeof(link), "%s/device", dev->ibdev_path);
  return realpath(link, NULL);
}

/* Path components two sysfs device paths do not share: 0 the same device, small when they sit
 * under one PCIe switch, large across root complexes or sockets. */
static int pci_distance(const char *a, const char *b) {
  size_t common = 0, i = 0;
  for (; a[i] && a[i] == b[i]; i++)
    if (a[i] == '/')
      common = i;
  if (!a[i] && (!b[i] || b[i] == '/'))
    common = i;
  int d = 0;
  for (const char *p = a + common; *p; p++)
    d += *p == '/';
  for (const char *p = b + common; *p; p++)
    d += *p == '/';
  return d;
}

static int name_listed(const char *names, const char *name) {
  const size_t n = strlen(name);
  for (const char *p = names; *p;) {
    const char *end = strchr(p, ',');
    const size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len == n && strncmp(p, name, n) == 0)
      return 1;
    p += len + (end ? 1 : 0);
  }
  return 0;
}

int tw_net_pick_nearest(const char *gpu, const char *const *nic_paths, int ncand, int local_index,
                        int local_size, int *out, int max) {
  int dist[64], best = INT_MAX, count = 0;
  if (ncand > 64)
    ncand = 64;
  for (int i = 0; i < ncand; i++) {
    dist[i] = gpu && nic_paths[i] ? pci_distance(gpu, nic_paths[i]) : INT_MAX;
    if (dist[i] < best)
      best = dist[i];
  }
  if (best != INT_MAX) { /* the nearest devices */
    for (int i = 0; i < ncand && count < max; i++)
      if (dist[i] == best)
        out[count++] = i;
    return count;
  }
  if (ncand == 0)
    return 0;
  /* no topology (or the test double): the local ranks share the devices out in order, each
   * taking ncand / local_size of them (at least one) */
  int per = ncand / (local_size > 0 ? local_size : 1);
  if (per < 1)
    per = 1;
  if (per > max)
    per = max;
  const int first = (local_index * per) % ncand;
  for (int i = 0; i < per; i++)
    out[count++] = (first + i) % ncand;
  return count;
}

int tw_net_pick_devices(const tw_verbs_t *v, struct ibv_device **list, int n,
                        const tw_net_config_t *cfg, int (*keep)(struct ibv_device *, void *),
                        void *keep_arg, int *out, int max) {
  int cand[64], ncand = 0;
  char *paths[64];
  char *gpu = pci_path_of_gpu(cfg->gpu_bus_id);
  for (int i = 0; i < n && ncand < 64; i++) {
    if (cfg->devices && *cfg->devices && !name_listed(cfg->devices, v->get_device_name(list[i])))
      continue;
    if (keep && !keep(list[i], keep_arg))
      continue;
    paths[ncand] = gpu ? pci_path_of_nic(list[i]) : NULL;
    cand[ncand++] = i;
  }
  int pick[TW_NET_MAX_NICS * 16];
  const int count = tw_net_pick_nearest(gpu, (const char *const *)paths, ncand,
                                        tw_net_local_index(cfg, cfg->rank), cfg->local_size, pick,
                                        max < TW_NET_MAX_NICS * 16 ? max : TW_NET_MAX_NICS * 16);
  for (int i = 0; i < count; i++)
    out[i] = cand[pick[i]];
  for (int i = 0; i < ncand; i++)
    free(paths[i]);
  free(gpu);
  return count;
}

/* RoCE v2 GID of the port where sysfs lists one (the routable kind), else index 0. */
static int pick_gid_index(struct ibv_device *dev, int table_len) {
  for (int i = 0; i < table_len && i < 16 && dev->ibdev_path[0]; i++) {
    char path[IBV_SYSFS_PATH_MAX + 64], type[32] = "";
    snprintf(path, sizeof(path), "%s/ports/1/gid_attrs/types/%d", dev->ibdev_path, i);
    FILE *f = fopen(path, "r");
    if (!f)
      continue;
    const int got = fgets(type, sizeof(type), f) != NULL;
    fclose(f);
    if (got && strncmp(type, "RoCE v2", 7) == 0)
      return i;
  }
  return 0;
}

tw_status_t tw_nic_open(const tw_verbs_t *v, struct ibv_device *dev, int cqe, tw_nic_t *nic) {
  tw_status_t st;
  memset(nic, 0, sizeof(*nic));
  snprintf(nic->name, sizeof(nic->name), "%s", v->get_device_name(dev));
  nic->ctx = v->open_device(dev);
  if (!nic->ctx)
    TW_FAIL(TW_ERR_SYSTEM, "ibv_open_device(%s): %s", nic->name, strerror(errno));
  if (v->query_port(nic->ctx, 1, &nic->port) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "ibv_query_port(%s, 1): %s", nic->name, strerror(errno));
  if (nic->port.state != IBV_PORT_ACTIVE)
    TW_FAIL(TW_ERR_NOT_SUPPORTED, "RDMA device %s: port 1 is not active (state %d)", nic->name,
            (int)nic->port.state);
  nic->gid_index = pick_gid_index(dev, nic->port.gid_tbl_len);
  if (v->query_gid(nic->ctx, 1, nic->gid_index, &nic->gid) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "ibv_query_gid(%s, 1, %d): %s", nic->name, nic->gid_index,
            strerror(errno));
  nic->pd = v->alloc_pd(nic->ctx);
  if (!nic->pd)
    TW_FAIL(TW_ERR_SYSTEM, "ibv_alloc_pd(%s): %s", nic->name, strerror(errno));
  nic->cq = v->create_cq(nic->ctx, cqe, NULL, NULL, 0);
  if (!nic->cq)
    TW_FAIL(TW_ERR_SYSTEM, "ibv_create_cq(%s, %d): %s", nic->name, cqe, strerror(errno));
  return TW_SUCCESS;
fail:
  tw_nic_close(v, nic);
  return st;
}

void tw_nic_close(const tw_verbs_t *v, tw_nic_t *nic) {
  if (nic->cq)
    v->destroy_cq(nic->cq);
  if (nic->pd)
    v->dealloc_pd(nic->pd);
  if (nic->ctx)
    v->close_device(nic->ctx);
  nic->cq = NULL;
  nic->pd = NULL;
  nic->ctx = NULL;
}

/* The window of state `state` holding [off, off + bytes), or NULL. */
static tw_net_window_t *window_in(tw_net_window_t *w, int n, uint64_t off, uint64_t bytes,
                                  int state) {
  for (int i = 0; i < n; i++)
    if (atomic_load_explicit(&w[i].state, memory_order_acquire) == state && off >= w[i].heap_off &&
        off - w[i].heap_off <= w[i].bytes && bytes <= w[i].bytes - (off - w[i].heap_off))
      return &w[i];
  return NULL;
}

tw_net_window_t *tw_net_window_find(tw_net_window_t *w, int n, uint64_t off, uint64_t bytes) {
  return window_in(w, n, off, bytes, TW_NET_WIN_LIVE);
}

static tw_net_window_t *window_at(tw_net_window_t *win, uint64_t heap_off) {
  for (int i = 0; i < TW_NET_WINDOWS; i++)
    if (win[i].keys && win[i].heap_off == heap_off)
      return &win[i];
  return NULL;
}

static void window_release(const tw_verbs_t *v, tw_net_window_t *w) {
  atomic_store_explicit(&w->state, TW_NET_WIN_FREE, memory_order_release);
  for (int i = 0; i < TW_NET_MAX_NICS; i++)
    if (w->mr[i])
      v->dereg_mr(w->mr[i]);
  free(w->keys);
  w->keys = NULL, w->addr = NULL, w->heap_off = 0, w->bytes = 0;
  memset(w->mr, 0, sizeof(w->mr));
}

void tw_net_base_init(tw_net_base_t *b, const tw_net_ops_t *ops, const tw_verbs_t *v,
                      const tw_net_config_t *cfg) {
  b->net.ops = ops;
  b->v = v;
  b->cfg = *cfg;
  memcpy(b->node_of, cfg->node_of, sizeof(int) * (size_t)cfg->world);
  b->cfg.node_of = b->node_of;
  for (int i = 0; i < TW_NET_RECORDS; i++)
    b->free_rec[i] = (uint32_t)(TW_NET_RECORDS - 1 - i);
  b->nfree = TW_NET_RECORDS;
}

tw_status_t tw_net_base_open_nics(tw_net_base_t *b, int (*keep)(struct ibv_device *, void *),
                                  void *keep_arg, int cqe, int *ndev) {
  *ndev = 0;
  struct ibv_device **list = b->v->get_device_list(ndev);
  if (!list)
    return TW_SUCCESS;
  int pick[TW_NET_MAX_NICS];
  const int npick =
      tw_net_pick_devices(b->v, list, *ndev, &b->cfg, keep, keep_arg, pick, TW_NET_MAX_NICS);
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < npick && st == TW_SUCCESS; i++) {
    st = tw_nic_open(b->v, list[pick[i]], cqe, &b->nic[i]);
    if (st == TW_SUCCESS)
      b->nnics++;
  }
  b->v->free_device_list(list);
  return st;
}

const char *tw_verbs_version(const tw_verbs_t *v) {
  return v->version[0] ? v->version : "of unknown version";
}

void tw_net_base_close(tw_net_base_t *b) {
  for (int i = 0; i < TW_NET_WINDOWS; i++)
    if (b->win[i].keys)
      window_release(b->v, &b->win[i]);
  for (int i = 0; i < b->nnics; i++)
    tw_nic_close(b->v, &b->nic[i]);
}

tw_status_t tw_net_base_reg(tw_net_t *net, uint64_t heap_off, void *addr, size_t bytes,
                            int on_device, tw_net_key_t *key) {
  tw_net_base_t *b = (tw_net_base_t *)net;
  tw_net_window_t *w = NULL;
  for (int i = 0; i < TW_NET_WINDOWS && !w; i++)
    if (!b->win[i].keys) {
      w = &b->win[i];
      if (i >= b->nwin)
        b->nwin = i + 1;
    }
  if (!w)
    return tw_fail(TW_ERR_OUT_OF_MEMORY,
                   "more than %d symmetric allocations registered with the NICs", TW_NET_WINDOWS);
  memset(key, 0, sizeof(*key));
  w->keys = calloc((size_t)b->cfg.world, sizeof(tw_net_key_t));
  if (!w->keys)
    return tw_fail(TW_ERR_SYSTEM, "out of host memory");
  w->heap_off = heap_off;
  w->bytes = bytes;
  w->addr = (char *)addr;
  for (int i = 0; i < b->nnics; i++) {
    tw_status_t st = tw_net_reg_mr(b->v, &b->nic[i], addr, bytes, on_device, &w->mr[i]);
    if (st != TW_SUCCESS) {
      window_release(b->v, w);
      return st;
    }
    key->rkey[i] = w->mr[i]->rkey;
  }
  key->base = (uint64_t)(uintptr_t)addr;
  atomic_store_explicit(&w->state, TW_NET_WIN_REGISTERING, memory_order_release);
  return TW_SUCCESS;
}

tw_status_t tw_net_base_set_remote(tw_net_t *net, uint64_t heap_off, const tw_net_key_t *keys) {
  tw_net_base_t *b = (tw_net_base_t *)net;
  tw_net_window_t *w = window_at(b->win, heap_off);
  if (!w)
    return tw_fail(TW_ERR_INTERNAL, "no window registered at heap offset %#llx",
                   (unsigned long long)heap_off);
  memcpy(w->keys, keys, sizeof(tw_net_key_t) * (size_t)b->cfg.world);
  atomic_store_explicit(&w->state, TW_NET_WIN_LIVE, memory_order_release);
  return TW_SUCCESS;
}

void tw_net_base_dereg(tw_net_t *net, uint64_t heap_off) {
  tw_net_base_t *b = (tw_net_base_t *)net;
  tw_net_window_t *w = window_at(b->win, heap_off);
  if (w)
    window_release(b->v, w);
}

int tw_net_base_check(tw_net_base_t *b, const tw_fifo_cmd_t *c, uint64_t token, tw_net_done_t *done,
                      tw_net_window_t **lw, tw_net_window_t **rw) {
  char why[160];
  *lw = *rw = NULL;
  if (b->failed)
    return tw_net_refuse(done, c, token, "the transport failed earlier");
  if (c->peer < 0 || c->peer >= b->cfg.world || !tw_net_is_rail_peer(&b->cfg, c->peer)) {
    snprintf(why, sizeof(why), "command to rank %d, which is not a peer of this rank's rail",
             c->peer);
    return tw_net_refuse(done, c, token, why);
  }
  if (c->flag_off > TW_NET_FLAGS)
    return tw_net_refuse(done, c, token, "flag index past TW_NET_FLAGS");
  if (c->flag_off == 0 && c->bytes == 0)
    return tw_net_refuse(done, c, token, "command with no bytes and no flag");
  if (c->bytes == 0)
    return 0;
  /* offsets are symmetric: the remote range is looked up in the same table */
  *lw = tw_net_window_find(b->win, b->nwin, c->local_off, c->bytes);
  *rw = tw_net_window_find(b->win, b->nwin, c->remote_off, c->bytes);
  if (*lw && *rw)
    return 0;
  /* virtual ranks: a rank's call can run before a later rank of this process allocated what it
   * names; the window goes live at that rank's tw_mem_alloc (the proxy's bound covers a rank
   * that never does) */
  if ((*lw || window_in(b->win, b->nwin, c->local_off, c->bytes, TW_NET_WIN_REGISTERING)) &&
      (*rw || window_in(b->win, b->nwin, c->remote_off, c->bytes, TW_NET_WIN_REGISTERING)))
    return 1;
  snprintf(why, sizeof(why),
           "%llu bytes at %s offset %#llx: not inside one registered symmetric allocation",
           (unsigned long long)c->bytes, !*lw ? "local" : "remote",
           (unsigned long long)(!*lw ? c->local_off : c->remote_off));
  return tw_net_refuse(done, c, token, why);
}

tw_net_rec_t *tw_net_rec_take(tw_net_base_t *b, const tw_fifo_cmd_t *c, uint64_t token, int qp,
                              int nwr, uint32_t *index) {
  *index = b->free_rec[--b->nfree];
  tw_net_rec_t *rec = &b->rec[*index];
  memset(rec, 0, sizeof(*rec));
  rec->token = token;
  rec->peer = c->peer;
  rec->qp = (int16_t)qp;
  rec->nwr = (int16_t)nwr;
  return rec;
}

void tw_net_fail_done(tw_net_base_t *b, tw_net_done_t *d, uint64_t token, int peer,
                      const char *what) {
  b->failed = 1;
  d->token = token;
  d->status = TW_ERR_NETWORK;
  d->peer = peer;
  snprintf(d->what, sizeof(d->what), "%s", what);
}

int tw_net_refuse(tw_net_done_t *done, const tw_fifo_cmd_t *c, uint64_t token, const char *why) {
  done->token = token;
  done->status = TW_ERR_NETWORK;
  done->peer = c->peer;
  snprintf(done->what, sizeof(done->what), "%s", why);
  return -1;
}

tw_status_t tw_net_reg_mr(const tw_verbs_t *v, tw_nic_t *nic, void *addr, size_t bytes,
                          int on_device, struct ibv_mr **mr) {
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  *mr = NULL;
  int dmabuf_errno = 0;
  if (on_device && v->reg_dmabuf_mr) {
    const tw_driver_api_t *cu;
    int fd = -1;
    if (tw_driver(&cu) == TW_SUCCESS &&
        cu->cuMemGetHandleForAddressRange(&fd, (CUdeviceptr)(uintptr_t)addr, bytes,
                                          CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) == CUDA_SUCCESS &&
        fd >= 0) {
      *mr = v->reg_dmabuf_mr(nic->pd, 0, bytes, (uint64_t)(uintptr_t)addr, fd, access);
      dmabuf_errno = *mr ? 0 : errno;
      close(fd);
    }
  }
  if (!*mr) /* host memory; device memory through nvidia-peermem */
    *mr = v->reg_mr(nic->pd, addr, bytes, access);
  if (!*mr)
    return tw_fail(on_device ? TW_ERR_NOT_SUPPORTED : TW_ERR_SYSTEM,
                   "RDMA device %s cannot register %s memory (%zu bytes at %p): %s%s%s", nic->name,
                   on_device ? "GPU" : "host", bytes, addr, strerror(errno),
                   on_device ? "; GPU memory needs dma-buf (a 5.12+ kernel and an open GPU driver) "
                               "or the nvidia-peermem module"
                             : "",
                   dmabuf_errno ? " (dma-buf registration failed too)" : "");
  return TW_SUCCESS;
}

static int has_efa_device(const tw_verbs_t *v) {
  if (!v->efadv_query_device)
    return 0;
  int n = 0, found = 0;
  struct ibv_device **list = v->get_device_list(&n);
  for (int i = 0; list && i < n && !found; i++) {
    struct ibv_context *ctx = v->open_device(list[i]);
    if (!ctx)
      continue;
    uint64_t attr[8] = {0}; /* struct efadv_device_attr, whose size differs by version */
    found = v->efadv_query_device(ctx, (struct efadv_device_attr *)attr, sizeof(attr)) == 0;
    v->close_device(ctx);
  }
  if (list)
    v->free_device_list(list);
  return found;
}

tw_status_t tw_net_open(const tw_net_config_t *cfg, tw_net_t **out) {
  *out = NULL;
  const char *want = cfg->backend && *cfg->backend ? cfg->backend : "auto";
  if (strcmp(want, "ib") == 0)
    return tw_net_ib.open(cfg, out);
  if (strcmp(want, "efa") == 0)
    return tw_net_efa.open(cfg, out);
  if (strcmp(want, "auto") != 0)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "TW_NET=%s: expected auto, ib, efa or none", want);
  const tw_verbs_t *v;
  tw_status_t st = tw_verbs_load(&v);
  if (st != TW_SUCCESS)
    return st;
  return has_efa_device(v) ? tw_net_efa.open(cfg, out) : tw_net_ib.open(cfg, out);
}

tw_status_t tw_net_list_devices(char *buf, size_t len) {
  const tw_verbs_t *v;
  tw_status_t st = tw_verbs_load(&v);
  if (st != TW_SUCCESS) {
    snprintf(buf, len, "none: %s", tw_last_error());
    return st;
  }
  int n = 0;
  struct ibv_device **list = v->get_device_list(&n);
  int used = snprintf(buf, len, "rdma-core %s (%s): %d device(s)", tw_verbs_version(v), v->path,
                      list ? n : 0);
  for (int i = 0; list && i < n && used > 0 && (size_t)used < len; i++) {
    const char *kind = "RC";
    struct ibv_context *ctx = v->open_device(list[i]);
    struct ibv_port_attr port;
    memset(&port, 0, sizeof(port));
    if (ctx) {
      uint64_t attr[8] = {0};
      if (v->efadv_query_device &&
          v->efadv_query_device(ctx, (struct efadv_device_attr *)attr, sizeof(attr)) == 0)
        kind = "EFA (SRD)";
      v->query_port(ctx, 1, &port);
      v->close_device(ctx);
    }
    used += snprintf(buf + used, len - (size_t)used, "\n  %s: %s, port 1 %s%s",
                     v->get_device_name(list[i]), kind,
                     port.state == IBV_PORT_ACTIVE ? "active" : "not active",
                     port.link_layer == IBV_LINK_LAYER_ETHERNET ? " (RoCE)" : "");
  }
  if (list)
    v->free_device_list(list);
  return TW_SUCCESS;
}
#endif
