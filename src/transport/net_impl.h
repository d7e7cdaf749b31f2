/*
 * What the inter-node backends (ib/, efa/) share: device choice, the window table, the
 * records of posted work requests. Not for callers of net.h.
 */
#ifndef TW_TRANSPORT_NET_IMPL_H
#define TW_TRANSPORT_NET_IMPL_H

#include <infiniband/verbs.h>
#include <stdatomic.h>

#include "transport/net.h"
#include "transport/verbs/verbs.h"

#define TW_NET_WINDOWS 256 /* registered allocations per rank */

/* One opened NIC. */
typedef struct tw_nic {
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_cq *cq;
  struct ibv_port_attr port;
  union ibv_gid gid;
  int gid_index;
  char name[64];
} tw_nic_t;

/* A window's state. The caller's thread registers windows while the proxy thread reads them:
 * the fields are written before the state that publishes them (release) and read after it
 * (acquire). REGISTERING: this rank's MRs exist, not every rank's keys yet (with virtual ranks,
 * a later rank of this process has not allocated); LIVE: commands may name it. */
enum { TW_NET_WIN_FREE = 0, TW_NET_WIN_REGISTERING = 1, TW_NET_WIN_LIVE = 2 };

/* A registered allocation: its heap offset and bytes, this rank's MR on each NIC, and every
 * rank's keys. */
typedef struct tw_net_window {
  uint64_t heap_off, bytes;
  char *addr;
  struct ibv_mr *mr[TW_NET_MAX_NICS];
  tw_net_key_t *keys; /* [world] */
  _Atomic int state;  /* TW_NET_WIN_* */
} tw_net_window_t;

/* A posted command's work requests (wr_id is its index in the backend's record table). */
typedef struct tw_net_rec {
  uint64_t token;
  int32_t peer;
  int16_t qp;  /* the backend's queue-pair index */
  int16_t nwr; /* work requests it holds in the send queue */
} tw_net_rec_t;

/* The rank's local rank and rail peers from cfg (node_of) */
int tw_net_local_index(const tw_net_config_t *cfg, int r);

/* Chooses up to max devices for this rank from list[0..n): TW_NET_DEVICES names, else those at
 * the least PCIe distance to the GPU, else a share by local rank. Writes indices; returns how
 * many (0: none usable, with a message recorded). keep(i) filters (the backend's kind). */
int tw_net_pick_devices(const tw_verbs_t *v, struct ibv_device **list, int n,
                        const tw_net_config_t *cfg, int (*keep)(struct ibv_device *, void *),
                        void *keep_arg, int *out, int max);

/* The choice behind tw_net_pick_devices, on resolved sysfs paths (gpu, nic_paths[i]; NULL:
 * unknown): the candidates at the least PCIe distance (path components not shared), else a
 * share of ncand / local_size of them (at least one) by local index. Writes candidate indices;
 * returns how many. */
int tw_net_pick_nearest(const char *gpu, const char *const *nic_paths, int ncand, int local_index,
                        int local_size, int *out, int max);

/* Opens device dev into nic: context, PD, a CQ of cqe entries, port 1 and its GID. */
tw_status_t tw_nic_open(const tw_verbs_t *v, struct ibv_device *dev, int cqe, tw_nic_t *nic);
void tw_nic_close(const tw_verbs_t *v, tw_nic_t *nic);

/* The window holding [off, off + bytes), or NULL. */
tw_net_window_t *tw_net_window_find(tw_net_window_t *w, int n, uint64_t off, uint64_t bytes);

#define TW_NET_RECORDS 4096 /* commands in flight per rank */

/* What every backend has first in its state: the NICs, the windows of registered memory, the
 * records of posted commands (a work request's wr_id is its record's index). */
typedef struct tw_net_base {
  tw_net_t net;
  const tw_verbs_t *v;
  tw_net_config_t cfg;
  int node_of[TW_MAX_WORLD];
  int nnics;
  tw_nic_t nic[TW_NET_MAX_NICS];
  tw_net_window_t win[TW_NET_WINDOWS];
  int nwin; /* windows in use lie below it: what a command's lookups scan */
  tw_net_rec_t rec[TW_NET_RECORDS];
  uint32_t free_rec[TW_NET_RECORDS];
  int nfree;
  int failed; /* after an error completion nothing is posted, and no record is reused */
} tw_net_base_t;

void tw_net_base_init(tw_net_base_t *b, const tw_net_ops_t *ops, const tw_verbs_t *v,
                      const tw_net_config_t *cfg);
/* Opens the NICs tw_net_pick_devices chooses among the host's devices of the backend's kind
 * (keep), each with a CQ of cqe entries, into b->nic. *ndev: the devices the host has. Choosing
 * none is not an error here (b->nnics 0): the backend words that failure. */
tw_status_t tw_net_base_open_nics(tw_net_base_t *b, int (*keep)(struct ibv_device *, void *),
                                  void *keep_arg, int cqe, int *ndev);
/* rdma-core's version for messages ("of unknown version" where the file name has none). */
const char *tw_verbs_version(const tw_verbs_t *v);
/* Releases the windows and closes the NICs (the backend destroyed its queue pairs first). */
void tw_net_base_close(tw_net_base_t *b);
/* net.h's reg, set_remote and dereg, for every backend. */
tw_status_t tw_net_base_reg(tw_net_t *net, uint64_t heap_off, void *addr, size_t bytes,
                            int on_device, tw_net_key_t *key);
tw_status_t tw_net_base_set_remote(tw_net_t *net, uint64_t heap_off, const tw_net_key_t *keys);
void tw_net_base_dereg(tw_net_t *net, uint64_t heap_off);

/* A command the backend will not post: *done says why (TW_ERR_NETWORK); returns -1. */
int tw_net_refuse(tw_net_done_t *done, const tw_fifo_cmd_t *c, uint64_t token, const char *why);
/* The checks every backend makes of a command: no earlier failure, a rail peer, a flag inside
 * TW_NET_FLAGS, something to do, its bytes inside registered windows (*lw, *rw: local and
 * remote; NULL without bytes). 0; 1 not yet (a window it names is still being registered: the
 * backend posts it later, as when its queue is full); or -1 refused (*done says why). */
int tw_net_base_check(tw_net_base_t *b, const tw_fifo_cmd_t *c, uint64_t token, tw_net_done_t *done,
                      tw_net_window_t **lw, tw_net_window_t **rw);
/* A free record for the command (the caller checked nfree > 0). */
tw_net_rec_t *tw_net_rec_take(tw_net_base_t *b, const tw_fifo_cmd_t *c, uint64_t token, int qp,
                              int nwr, uint32_t *index);
/* One TW_ERR_NETWORK completion: the transport has failed (b->failed). */
void tw_net_fail_done(tw_net_base_t *b, tw_net_done_t *d, uint64_t token, int peer,
                      const char *what);

/* Registers [addr, addr + bytes) on nic: dma-buf for device memory where the driver gives one,
 * else plain (host memory, or device memory through the peer-memory module). */
tw_status_t tw_net_reg_mr(const tw_verbs_t *v, tw_nic_t *nic, void *addr, size_t bytes,
                          int on_device, struct ibv_mr **mr);

#endif
