/* The symmetric heap (heap.h). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "runtime/heap.h"

#include "core/log.h"
#include "core/status.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "transport/transport.h"

static CUmemAllocationProp alloc_prop(int device, int exportable) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes =
      exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

/* Every transport sees every allocation, in this order. */
static const tw_transport_t *const transports[] = {&tw_transport_nvlink};

tw_status_t tw_heap_group_init(tw_group_t *g, size_t heap_va) {
  const tw_driver_api_t *cu;
  tw_status_t st = tw_driver(&cu);
  if (st != TW_SUCCESS)
    return st;
  size_t gran = 0;
  for (int r = 0; r < g->world; r++) {
    if (g->device_of[r] < 0)
      continue;
    CUmemAllocationProp prop = alloc_prop(g->device_of[r], g->bs != NULL);
    size_t rg = 0;
    st = tw_cu_check(
        cu->cuMemGetAllocationGranularity(&rg, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity");
    if (st != TW_SUCCESS)
      return st;
    if (rg > gran)
      gran = rg;
  }
  if (gran == 0)
    gran = 2u << 20;
  g->granularity = gran;
  g->heap_va = (heap_va + gran - 1) / gran * gran;
  st = tw_cu_check(cu->cuMemAddressReserve(&g->va_base, g->heap_va * (size_t)g->world, gran, 0, 0),
                   "cuMemAddressReserve for the symmetric heap");
  if (st != TW_SUCCESS) {
    tw_error_prefix("reserving %zu bytes of address space (%d ranks x TW_HEAP_BYTES=%zu)",
                    g->heap_va * (size_t)g->world, g->world, g->heap_va);
    g->va_base = 0;
  }
  return st;
}

void tw_heap_group_fini(tw_group_t *g) {
  const tw_driver_api_t *cu;
  if (!g->va_base || tw_driver(&cu) != TW_SUCCESS)
    return;
  cu->cuMemAddressFree(g->va_base, g->heap_va * (size_t)g->world);
  g->va_base = 0;
}

/* First fit in the free list, else bump. Every process runs the same sequence
 * of calls, so every rank gets the same offset (checked for multi-process). */
static int take_range(tw_group_t *g, size_t size, size_t *offset) {
  for (int i = 0; i < g->nfree; i++) {
    if (g->free_ranges[i].size < size)
      continue;
    *offset = g->free_ranges[i].offset;
    g->free_ranges[i].offset += size;
    g->free_ranges[i].size -= size;
    if (g->free_ranges[i].size == 0)
      g->free_ranges[i] = g->free_ranges[--g->nfree];
    return 0;
  }
  if (g->bump + size > g->heap_va)
    return -1;
  *offset = g->bump;
  g->bump += size;
  return 0;
}

static void give_range(tw_group_t *g, size_t offset, size_t size) {
  if (offset + size == g->bump) {
    g->bump = offset;
  } else if (g->nfree < TW_MAX_FREE_RANGES) {
    g->free_ranges[g->nfree].offset = offset;
    g->free_ranges[g->nfree].size = size;
    g->nfree++;
  } else {
    TW_WARN("symmetric heap free list full: %zu bytes at offset %zu are not reused", size, offset);
  }
  /* Merge ranges ending at the bump pointer back into it. */
  for (int again = 1; again;) {
    again = 0;
    for (int i = 0; i < g->nfree; i++) {
      if (g->free_ranges[i].offset + g->free_ranges[i].size == g->bump) {
        g->bump = g->free_ranges[i].offset;
        g->free_ranges[i] = g->free_ranges[--g->nfree];
        again = 1;
        break;
      }
    }
  }
}

static void destroy_alloc(tw_group_t *g, tw_alloc_t *a) {
  const tw_driver_api_t *cu;
  if (tw_driver(&cu) != TW_SUCCESS)
    return;
  for (size_t t = 0; t < sizeof(transports) / sizeof(transports[0]); t++)
    transports[t]->unmap(g, a);
  for (int r = 0; r < g->world; r++) {
    if (a->handle[r])
      cu->cuMemRelease(a->handle[r]);
    if (a->peer_table[r]) {
      int prev;
      if (tw_set_device(g->device_of[r], &prev) == TW_SUCCESS) {
        cudaFree(a->peer_table[r]);
        cudaSetDevice(prev);
      }
    }
  }
  give_range(g, a->offset, a->size);
  free(a);
}

/* Maps and exchanges a new allocation for every rank this process can reach. */
static tw_status_t create_alloc(tw_group_t *g, int rank, uint64_t seq, size_t bytes,
                                tw_alloc_t **out) {
  const tw_driver_api_t *cu;
  tw_status_t st;
  tw_alloc_t *a = NULL;
  TW_CHECK(tw_driver(&cu));
  a = calloc(1, sizeof(*a));
  if (!a)
    TW_FAIL(TW_ERR_SYSTEM, "out of host memory");
  a->seq = seq;
  a->bytes = bytes;
  a->size = (bytes + g->granularity - 1) / g->granularity * g->granularity;
  if (take_range(g, a->size, &a->offset) != 0) {
    size_t size = a->size;
    free(a);
    a = NULL;
    TW_FAIL(TW_ERR_OUT_OF_MEMORY,
            "bytes: %zu does not fit in the symmetric heap (%zu bytes per rank, %zu in use at the "
            "top); raise TW_HEAP_BYTES or tw_config.heap_bytes",
            size, g->heap_va, g->bump);
  }
  if (g->bs) {
    /* Every process must have picked the same offset. */
    uint64_t *mine = calloc((size_t)g->world * 3, sizeof(uint64_t));
    if (!mine)
      TW_FAIL(TW_ERR_SYSTEM, "out of host memory");
    mine[rank * 3 + 0] = a->seq;
    mine[rank * 3 + 1] = a->offset;
    mine[rank * 3 + 2] = a->bytes;
    st = tw_bootstrap_allgather(g->bs, mine, 3 * sizeof(uint64_t));
    if (st == TW_SUCCESS) {
      for (int r = 0; r < g->world; r++) {
        if (mine[r * 3] != a->seq || mine[r * 3 + 1] != a->offset || mine[r * 3 + 2] != a->bytes) {
          st = tw_fail(TW_ERR_INVALID_ARGUMENT,
                       "tw_mem_alloc is collective: rank %d made allocation #%llu of %llu bytes "
                       "(offset %llu) but rank %d made #%llu of %llu bytes (offset %llu)",
                       rank, (unsigned long long)a->seq, (unsigned long long)a->bytes,
                       (unsigned long long)a->offset, r, (unsigned long long)mine[r * 3],
                       (unsigned long long)mine[r * 3 + 2], (unsigned long long)mine[r * 3 + 1]);
          break;
        }
      }
    }
    free(mine);
    if (st != TW_SUCCESS)
      goto fail;
  }
  for (int r = 0; r < g->world; r++) {
    if (!g->local[r])
      continue;
    CUmemAllocationProp prop = alloc_prop(g->device_of[r], g->bs != NULL);
    TW_CHECK(tw_cu_check(cu->cuMemCreate(&a->handle[r], a->size, &prop, 0), "cuMemCreate"));
  }
  for (size_t t = 0; t < sizeof(transports) / sizeof(transports[0]); t++) {
    st = transports[t]->import(g, rank, a);
    if (st == TW_SUCCESS)
      st = transports[t]->map(g, a);
    if (st != TW_SUCCESS) {
      tw_error_prefix("transport %s", transports[t]->name);
      goto fail;
    }
  }
  /* Device-visible peer tables, one per local rank. */
  for (int r = 0; r < g->world; r++) {
    if (!g->local[r])
      continue;
    void *host_table[TW_MAX_WORLD];
    for (int p = 0; p < g->world; p++)
      host_table[p] = a->mapped[p] ? tw_group_slot(g, p, a->offset) : NULL;
    int prev;
    TW_CHECK(tw_set_device(g->device_of[r], &prev));
    st = tw_cuda_check(cudaMalloc((void **)&a->peer_table[r], sizeof(void *) * (size_t)g->world),
                       "cudaMalloc(peer table)");
    if (st == TW_SUCCESS)
      st = tw_cuda_check(cudaMemcpy(a->peer_table[r], host_table, sizeof(void *) * (size_t)g->world,
                                    cudaMemcpyHostToDevice),
                         "cudaMemcpy(peer table)");
    cudaSetDevice(prev);
    if (st != TW_SUCCESS)
      goto fail;
  }
  a->next = g->allocs;
  g->allocs = a;
  *out = a;
  return TW_SUCCESS;
fail:
  if (a)
    destroy_alloc(g, a);
  return st;
}

tw_status_t tw_heap_alloc_locked(tw_group_t *g, int rank, uint64_t seq, size_t bytes, void **ptr) {
  tw_alloc_t *a;
  tw_status_t st = TW_SUCCESS;
  for (a = g->allocs; a; a = a->next)
    if (a->seq == seq)
      break;
  if (a) {
    /* Another rank of this process made this allocation already. */
    if (a->bytes != bytes)
      return tw_fail(TW_ERR_INVALID_ARGUMENT,
                     "bytes: tw_mem_alloc is collective: rank %d asked %zu bytes for allocation "
                     "#%llu but another rank asked %zu",
                     rank, bytes, (unsigned long long)a->seq, a->bytes);
  } else {
    st = create_alloc(g, rank, seq, bytes, &a);
    if (st != TW_SUCCESS)
      return st;
  }
  *ptr = tw_group_slot(g, rank, a->offset);
  return TW_SUCCESS;
}

static tw_alloc_t *find_by_base(tw_group_t *g, int rank, const void *ptr, tw_alloc_t **prev_out) {
  tw_alloc_t *prev = NULL;
  for (tw_alloc_t *a = g->allocs; a; prev = a, a = a->next) {
    if (tw_group_slot(g, rank, a->offset) == ptr) {
      if (prev_out)
        *prev_out = prev;
      return a;
    }
  }
  return NULL;
}

static int all_local_freed(const tw_group_t *g, const tw_alloc_t *a) {
  for (int r = 0; r < g->world; r++)
    if (g->local[r] && !a->freed[r])
      return 0;
  return 1;
}

static void unlink_alloc(tw_group_t *g, tw_alloc_t *a, tw_alloc_t *prev) {
  if (prev)
    prev->next = a->next;
  else
    g->allocs = a->next;
}

tw_status_t tw_heap_free_locked(tw_group_t *g, int rank, void *ptr) {
  tw_alloc_t *prev = NULL;
  tw_alloc_t *a = find_by_base(g, rank, ptr, &prev);
  if (!a || a->freed[rank])
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "ptr: %p is not a live tw_mem_alloc pointer of rank %d",
                   ptr, rank);
  a->freed[rank] = 1;
  if (all_local_freed(g, a)) {
    /* No kernel of this process may still use it. */
    for (int r = 0; r < g->world; r++) {
      if (!g->local[r] || g->local[r] == NULL)
        continue;
      int prev_dev;
      if (tw_set_device(g->device_of[r], &prev_dev) == TW_SUCCESS) {
        cudaDeviceSynchronize();
        cudaSetDevice(prev_dev);
      }
    }
    unlink_alloc(g, a, prev);
    destroy_alloc(g, a);
  }
  return TW_SUCCESS;
}

void tw_heap_free_all_locked(tw_group_t *g, int rank) {
  for (tw_alloc_t *a = g->allocs; a; a = a->next)
    a->freed[rank] = 1;
  tw_alloc_t *prev = NULL, *a = g->allocs;
  while (a) {
    tw_alloc_t *next = a->next;
    if (all_local_freed(g, a)) {
      unlink_alloc(g, a, prev);
      destroy_alloc(g, a);
    } else {
      prev = a;
    }
    a = next;
  }
}

void *tw_heap_peer_addr(const tw_group_t *g, int rank, const void *local_ptr, int peer) {
  uintptr_t base = (uintptr_t)tw_group_slot(g, rank, 0);
  uintptr_t p = (uintptr_t)local_ptr;
  if (p < base || p >= base + g->heap_va || peer < 0 || peer >= g->world || !g->mappable[peer])
    return NULL;
  return (char *)tw_group_slot(g, peer, 0) + (p - base);
}

/* With g->mu held: this rank's live allocation holding ptr (and its base here), or NULL. */
static tw_alloc_t *find_locked(const tw_group_t *g, int rank, uintptr_t p, uintptr_t *base_out) {
  for (tw_alloc_t *a = g->allocs; a; a = a->next) {
    uintptr_t base = (uintptr_t)tw_group_slot(g, rank, a->offset);
    if (p >= base && p < base + a->bytes && !a->freed[rank]) {
      *base_out = base;
      return a;
    }
  }
  return NULL;
}

size_t tw_heap_span(tw_group_t *g, int rank, const void *ptr) {
  uintptr_t base = 0;
  pthread_mutex_lock(&g->mu);
  tw_alloc_t *a = find_locked(g, rank, (uintptr_t)ptr, &base);
  const size_t avail = a ? (size_t)(base + a->bytes - (uintptr_t)ptr) : 0;
  pthread_mutex_unlock(&g->mu);
  return avail;
}

tw_status_t tw_heap_find(tw_group_t *g, int rank, const void *ptr, size_t bytes,
                         const char *arg_name, tw_alloc_t **alloc_out) {
  const uintptr_t p = (uintptr_t)ptr;
  uintptr_t base = 0;
  pthread_mutex_lock(&g->mu);
  tw_alloc_t *a = find_locked(g, rank, p, &base);
  const size_t alloc_bytes = a ? a->bytes : 0;
  pthread_mutex_unlock(&g->mu);
  if (!a)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: %p (+%zu bytes) is not inside a tw_mem_alloc allocation of rank %d",
                   arg_name, ptr, bytes, rank);
  if (p + bytes > base + alloc_bytes)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: %zu bytes at offset %zu run past the end of its %zu-byte symmetric "
                   "allocation",
                   arg_name, bytes, (size_t)(p - base), alloc_bytes);
  if (alloc_out)
    *alloc_out = a;
  return TW_SUCCESS;
}
