/*
 * Host bootstrap between processes: a TCP rendezvous at the address inside a
 * tw_unique_id_t, then a star (rank 0 as hub) for small host collectives, and
 * a unix-domain socket per process for passing file descriptors (cuMem POSIX
 * fd handles) between processes on one host.
 *
 * Every blocking call is bounded by the timeout given at init and fails with
 * TW_ERR_TIMEOUT naming what it waited for (e.g. "ranks 3, 5 never arrived").
 * Errors are reported through tw_fail (core/status.h).
 */
#ifndef TW_RUNTIME_BOOTSTRAP_H
#define TW_RUNTIME_BOOTSTRAP_H

#include <stddef.h>
#include <stdint.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_bootstrap tw_bootstrap_t;

/* What tw_bootstrap_create_root writes into tw_unique_id_t.internal (the rest
 * is zero). Internal: callers treat the id as opaque; tests forge bad ones. */
#define TW_BOOTSTRAP_ID_MAGIC 0x31444957454c4954ULL /* "TILEWID1" */
typedef struct tw_bootstrap_id {
  uint64_t magic;   /* TW_BOOTSTRAP_ID_MAGIC */
  uint64_t nonce;   /* random: names this group's sockets, rejects stale ids */
  uint32_t addr_be; /* root's IPv4 address, network byte order */
  uint16_t port_be; /* root's TCP port, network byte order */
  uint16_t reserved;
} tw_bootstrap_id_t;

/* Room for the knobs that every rank must set alike (the Alike column of core/env_defs.h). */
#define TW_PEER_KNOBS 20

/* What every rank learns about every other at init. */
typedef struct tw_peer_info {
  int32_t rank;
  int32_t pid;
  uint64_t host_hash; /* hash of hostname + boot id: equal => same host */
  int32_t cuda_device;
  int32_t sm_count;  /* SMs of the rank's GPU */
  int32_t sm_budget; /* the rank's tw_config.sm_budget after TW_SM_BUDGET (0: its share) */
  int32_t reserved;
  uint8_t gpu_uuid[16]; /* equal uuid => the ranks share one GPU (virtual ranks / MPS) */
  char hostname[64];
  /* The rank's values of the knobs every rank must set alike (tw_alike_knobs, comm.h). */
  int64_t knobs[TW_PEER_KNOBS];
} tw_peer_info_t;

/* Fills id with {magic, nonce, root IPv4 address:port} and starts a detached
 * root thread in this process that serves one group's rendezvous, then exits. */
tw_status_t tw_bootstrap_create_root(tw_unique_id_t *id);

/* Joins the group: connects to the root, exchanges tw_peer_info_t, sets up the
 * star to rank 0 and this process's unix socket for fd passing.
 * `self` is this rank's info (rank, pid, device, sm_count, sm_budget, gpu_uuid set by the caller;
 * host_hash and hostname filled in by the bootstrap). */
tw_status_t tw_bootstrap_init(tw_bootstrap_t **bs, const tw_unique_id_t *id, int rank, int world,
                              int timeout_ms, tw_peer_info_t *self);
/* Info of every rank, indexed by rank (valid until destroy). */
const tw_peer_info_t *tw_bootstrap_peers(const tw_bootstrap_t *bs);

/* data holds world * bytes; this rank's slot data + rank * bytes is filled in
 * by the caller; on return every slot holds that rank's contribution. */
tw_status_t tw_bootstrap_allgather(tw_bootstrap_t *bs, void *data, size_t bytes);
tw_status_t tw_bootstrap_barrier(tw_bootstrap_t *bs);

/* Sends fd to every rank set in `to_ranks` (a world-sized 0/1 array, own rank
 * ignored) and receives one fd from every rank set in `from_ranks`, into
 * fds_out[rank] (others left as -1). `tag` (the same on every rank for one
 * exchange) guards against mixing two exchanges. Received fds are owned by the
 * caller. Bounded by the init timeout. */
tw_status_t tw_bootstrap_exchange_fds(tw_bootstrap_t *bs, int fd, const uint8_t *to_ranks,
                                      const uint8_t *from_ranks, uint64_t tag, int *fds_out);

void tw_bootstrap_destroy(tw_bootstrap_t *bs);

/* Host identity of the calling process (hostname + boot id hash). */
uint64_t tw_host_hash(char *hostname_out, size_t len);

#ifdef __cplusplus
}
#endif
#endif
