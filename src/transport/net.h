/*
 * The inter-node transport: RDMA writes to ranks on other nodes, posted by a rank's kernels
 * through the command FIFO (fifo.h) and carried out by its CPU proxy (proxy.h) through a
 * backend (ib: libibverbs RC; efa: SRD through efadv), both over rdma-core loaded at run time
 * (verbs/verbs.h).
 *
 * Memory. The proxy moves bytes between symmetric-heap offsets: every allocation a rank makes
 * is registered with its NICs as a window (tw_net_reg), and the windows' remote keys and base
 * addresses are exchanged (tw_net_set_remote), so a command names only offsets.
 *
 * Flags. A rank owns TW_NET_FLAGS flag words that peers on other nodes set to say their data
 * landed (TW_NET_CH_FLAGS per channel). A command's flag (cmd.flag_off: 1 + the word's index, 0
 * for none) carries a value; a flag has one writer, and its values only grow, by less than 2^16
 * from one write to the next (epochs do). Then:
 *   ib:  the data write and an 8-byte inline write of the value into the peer's flag word are
 *        chained on one RC queue pair, and RC delivers them in order, so the value is there only
 *        after the data; a flag's writes always take one queue pair (index % qps), so the values
 *        land in order. The flag words are the peer's heap (tw_ctrl_t.net_flags).
 *   efa: SRD delivers out of order, so no flag write follows the data: the data goes as an RDMA
 *        write with immediate data (the flag's index and the value's low 17 bits), and the peer's
 *        backend raises its flag word to that value on the receive completion, which comes after
 *        the data is placed; a value that arrives after a larger one is dropped (the flag never
 *        goes back). The flag words live in host memory mapped for the peer's kernels
 *        (cfg.host_flags).
 * Either way a kernel waits for `flag >= value`: the data of the write that carried value landed.
 * Only that write's: on efa an earlier write to the same flag may land later, so an op writes a
 * flag once per call (its epoch), and every earlier call's writes were waited for by that call.
 *
 * Peers: a rank talks RDMA only to the ranks of its rail (the same local rank on the other
 * nodes); the rest of a route is NVLink inside the node. Commands to other ranks are refused.
 */
#ifndef TW_TRANSPORT_NET_H
#define TW_TRANSPORT_NET_H

#include <stddef.h>
#include <stdint.h>

#include "tilewire.h"
#include "transport/fifo.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_NET_MAX_QPS 8  /* per peer */
#define TW_NET_MAX_NICS 4 /* per rank */

typedef struct tw_net_config {
  int rank, world;
  const int *node_of; /* [world] */
  int local_rank, local_size;
  const char *gpu_bus_id; /* the rank's GPU ("0000:19:00.0"), NULL: none (host memory only) */
  const char *backend;    /* "auto", "ib" or "efa" */
  const char *devices;    /* comma-separated device names to use, "" to choose */
  int qps;                /* per peer, 1..TW_NET_MAX_QPS */
  uint64_t flags_off;     /* ib: the heap offset of every rank's TW_NET_FLAGS flag words */
  uint64_t *host_flags;   /* efa: this rank's TW_NET_FLAGS flag words in host memory */
} tw_net_config_t;

/* A command that finished (status TW_SUCCESS) or failed: `what` says how. */
typedef struct tw_net_done {
  uint64_t token;
  tw_status_t status;
  int peer;
  char what[160];
} tw_net_done_t;

/* A window's remote keys (one per NIC of the rank that registered it) and its address there. */
typedef struct tw_net_key {
  uint64_t base;
  uint32_t rkey[TW_NET_MAX_NICS];
} tw_net_key_t;

typedef struct tw_net tw_net_t;

typedef struct tw_net_ops {
  const char *name;
  /* Finds and opens this rank's NICs; TW_ERR_NOT_SUPPORTED naming what is missing. */
  tw_status_t (*open)(const tw_net_config_t *cfg, tw_net_t **out);
  /* The bytes of the blob every rank gives every other at connect (the same on every rank). */
  size_t (*info_bytes)(const tw_net_t *net);
  /* Creates the queue pairs and writes this rank's blob. */
  tw_status_t (*local_info)(tw_net_t *net, void *info);
  /* Brings the queue pairs up from every rank's blob (infos[r * info_bytes]). */
  tw_status_t (*connect)(tw_net_t *net, const void *infos);
  /* Registers [addr, addr + bytes), heap offset heap_off, with every NIC; *key: this rank's keys
   * and address for it (to exchange). on_device: CUDA device memory (dma-buf, else peer
   * memory). */
  tw_status_t (*reg)(tw_net_t *net, uint64_t heap_off, void *addr, size_t bytes, int on_device,
                     tw_net_key_t *key);
  /* Every rank's key of the window (keys[r]; this rank's own entry and those of ranks it does
   * not reach are ignored). */
  tw_status_t (*set_remote)(tw_net_t *net, uint64_t heap_off, const tw_net_key_t *keys);
  void (*dereg)(tw_net_t *net, uint64_t heap_off);
  /* Posts a command; 1 posted, 0 no room now (post it again later), -1 refused (*done says why). */
  int (*post)(tw_net_t *net, const tw_fifo_cmd_t *cmd, uint64_t token, tw_net_done_t *done);
  /* Reaps up to max finished commands; also sets efa's flags on receive completions. */
  int (*poll)(tw_net_t *net, tw_net_done_t *out, int max);
  /* One line: the backend, the NICs and the library (tw-info, logs). */
  void (*describe)(const tw_net_t *net, char *buf, size_t len);
  void (*close)(tw_net_t *net);
} tw_net_ops_t;

struct tw_net {
  const tw_net_ops_t *ops;
};

extern const tw_net_ops_t tw_net_ib;
extern const tw_net_ops_t tw_net_efa;

/* Opens the backend cfg->backend names ("auto": efa where an EFA device exists, else ib). */
tw_status_t tw_net_open(const tw_net_config_t *cfg, tw_net_t **out);

/* The devices the host has, for tw-info: one line per device into buf (kind, name, ports),
 * and rdma-core's version; TW_ERR_NOT_SUPPORTED when rdma-core cannot be loaded. */
tw_status_t tw_net_list_devices(char *buf, size_t len);

/* The rail peers of cfg's rank: 1 where rank r is on another node with the same local rank. */
int tw_net_is_rail_peer(const tw_net_config_t *cfg, int r);

#ifdef __cplusplus
}
#endif
#endif
