/*
 * The symmetric heap: cuMem VMM allocations at the same offset in every rank's slot of the
 * group's address range (runtime/group.h). Physical memory is created on each local rank's
 * GPU; the memory of ranks in other processes reaches this one through the transports
 * (transport/transport.h). Every rank makes the same sequence of allocations (tw_mem_alloc is
 * collective), so offsets agree; across processes that is checked.
 *
 * Functions named _locked are called with g->mu held; the others take it.
 */
#ifndef TW_RUNTIME_HEAP_H
#define TW_RUNTIME_HEAP_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/group.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reserves world * heap_va bytes of address space (heap_va rounded to the granularity). */
tw_status_t tw_heap_group_init(tw_group_t *g, size_t heap_va);
void tw_heap_group_fini(tw_group_t *g);

/* Rank `rank`'s allocation number `seq` of `bytes`: made (for every rank this process drives)
 * by the first local rank that asks, found by the others; *ptr is rank's own address. */
tw_status_t tw_heap_alloc_locked(tw_group_t *g, int rank, uint64_t seq, size_t bytes, void **ptr);
/* Frees rank's share of the allocation at ptr; the memory goes once every local rank freed it. */
tw_status_t tw_heap_free_locked(tw_group_t *g, int rank, void *ptr);
/* tw_heap_free_locked of every allocation of rank. */
void tw_heap_free_all_locked(tw_group_t *g, int rank);

/* Peer p's address for a pointer inside rank's heap, or NULL if p's memory is not mapped here. */
void *tw_heap_peer_addr(const tw_group_t *g, int rank, const void *local_ptr, int peer);
/* Bytes from ptr to the end of rank's live allocation holding it; 0 if none holds it. */
size_t tw_heap_span(tw_group_t *g, int rank, const void *ptr);
/* TW_ERR_INVALID_ARGUMENT naming arg_name unless [ptr, ptr + bytes) lies inside one live
 * allocation of rank (returned in *alloc_out when not NULL). */
tw_status_t tw_heap_find(tw_group_t *g, int rank, const void *ptr, size_t bytes,
                         const char *arg_name, tw_alloc_t **alloc_out);

#ifdef __cplusplus
}
#endif
#endif
