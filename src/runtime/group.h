/*
 * The group: what the ranks driven by one process share (all of them with tw_comm_init_all,
 * one with tw_comm_init_rank). It owns the symmetric heap's address space and its allocation
 * list (runtime/heap.h); every field is guarded by mu.
 *
 * Symmetric heap layout, the same in every process: one virtual range of world * heap_va
 * bytes; rank r's heap lives at va_base + r * heap_va. An allocation has the same offset in
 * every rank's heap, so peer p's copy of a local pointer is va_base + p * heap_va + offset.
 */
#ifndef TW_RUNTIME_GROUP_H
#define TW_RUNTIME_GROUP_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>

#include "runtime/bootstrap.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_alloc {
  struct tw_alloc *next;
  uint64_t seq;                                      /* allocation number, the same on every rank */
  size_t offset;                                     /* in every rank's heap */
  size_t size;                                       /* rounded to the granularity */
  size_t bytes;                                      /* as asked */
  CUmemGenericAllocationHandle handle[TW_MAX_WORLD]; /* mapped in this process; 0 = none */
  uint8_t mapped[TW_MAX_WORLD];
  uint8_t freed[TW_MAX_WORLD];     /* local ranks that called tw_mem_free */
  void **peer_table[TW_MAX_WORLD]; /* per local rank: device array of world peer pointers */
} tw_alloc_t;

typedef struct tw_free_range {
  size_t offset, size;
} tw_free_range_t;

#define TW_MAX_FREE_RANGES 4096

typedef struct tw_group {
  pthread_mutex_t mu;
  int world;
  int nlocal;                          /* ranks driven by this process */
  int live;                            /* local comms not yet destroyed */
  struct tw_comm *local[TW_MAX_WORLD]; /* by rank; NULL for ranks of other processes */
  uint8_t mappable[TW_MAX_WORLD];      /* rank's memory can be mapped here (same host) */
  int device_of[TW_MAX_WORLD];         /* CUDA device of local ranks, -1 otherwise */
  tw_bootstrap_t *bs;                  /* NULL when every rank is in this process */
  CUdeviceptr va_base;
  size_t heap_va;
  size_t granularity;
  size_t bump;
  tw_free_range_t free_ranges[TW_MAX_FREE_RANGES];
  int nfree;
  tw_alloc_t *allocs;
  /* allocations whose remote keys the inter-node transport still gathers (runtime/comm_net.c) */
  struct tw_net_pending *net_pending;
} tw_group_t;

/* Rank r's address of heap offset `offset`. */
static inline void *tw_group_slot(const tw_group_t *g, int rank, size_t offset) {
  return (void *)(uintptr_t)(g->va_base + (CUdeviceptr)rank * g->heap_va + offset);
}

#ifdef __cplusplus
}
#endif
#endif
