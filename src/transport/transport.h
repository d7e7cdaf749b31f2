/*
 * Transports: how the memory of a symmetric allocation reaches the ranks that use it.
 *
 * The heap (runtime/heap.h) creates each local rank's physical memory, then hands the
 * allocation to every transport in turn: `import` obtains handles to the memory of ranks in
 * other processes that the transport reaches (a->handle[r]), `map` makes what the process
 * holds addressable by its devices at each rank's slot of the symmetric range (a->mapped[r]),
 * and `unmap` undoes map when the allocation goes (the heap then releases every handle).
 * A transport that cannot reach a rank leaves its handle 0: tw_heap_peer_addr then answers
 * NULL for it, and an op that needs that peer refuses the call.
 *
 * Today's one transport is nvlink.c: ranks of one host, peers over NVLink or the same GPU.
 * Backends for peers on other nodes (RDMA through a CPU proxy) add a table here.
 */
#ifndef TW_TRANSPORT_TRANSPORT_H
#define TW_TRANSPORT_TRANSPORT_H

#include "runtime/group.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_transport {
  const char *name;
  /* Called with g->mu held by the local rank `rank` that creates allocation a, after every
   * local rank's handle exists. */
  tw_status_t (*import)(tw_group_t *g, int rank, tw_alloc_t *a);
  tw_status_t (*map)(tw_group_t *g, tw_alloc_t *a);
  void (*unmap)(tw_group_t *g, tw_alloc_t *a);
} tw_transport_t;

/* Ranks of one host: cuMem POSIX file descriptors passed between processes over the
 * bootstrap's unix sockets, mapped with access for every GPU of this process. */
extern const tw_transport_t tw_transport_nvlink;

#ifdef __cplusplus
}
#endif
#endif
