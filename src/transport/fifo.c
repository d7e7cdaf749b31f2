/* The command FIFO's host side (fifo.h). */
#include "transport/fifo.h"

#include <stdatomic.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/status.h"
#include "runtime/cuda_check.h"

tw_status_t tw_fifo_create(tw_fifo_t *f, uint64_t slots) {
  TW_ARG_CHECK(f != NULL, "f: NULL");
  TW_ARG_CHECK(slots >= 2 && slots <= (1u << 20) && (slots & (slots - 1)) == 0,
               "slots: %llu; expected a power of 2 in [2, 2^20]", (unsigned long long)slots);
  memset(f, 0, sizeof(*f));
  const size_t ring = (size_t)slots * sizeof(tw_fifo_cmd_t);
  void *host = NULL;
  /* the slots, then tail and done on cache lines of their own */
  tw_status_t st = tw_cuda_check(cudaHostAlloc(&host, ring + 128, cudaHostAllocMapped),
                                 "cudaHostAlloc(command FIFO)");
  if (st != TW_SUCCESS)
    return st;
  memset(host, 0, ring + 128);
  f->slots = (tw_fifo_cmd_t *)host;
  f->tail = (uint64_t *)((char *)host + ring);
  f->done = (uint64_t *)((char *)host + ring + 64);
  f->nslots = slots;
  void *dev_host = NULL;
  st = tw_cuda_check(cudaHostGetDevicePointer(&dev_host, host, 0), "cudaHostGetDevicePointer");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaMalloc(&f->device_words, 2 * sizeof(uint64_t)),
                       "cudaMalloc(command FIFO counters)");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaMemset(f->device_words, 0, 2 * sizeof(uint64_t)),
                       "cudaMemset(command FIFO counters)");
  if (st != TW_SUCCESS) {
    tw_fifo_destroy(f);
    return st;
  }
  f->dev.slots = (tw_fifo_cmd_t *)dev_host;
  f->dev.tail = (const uint64_t *)((char *)dev_host + ring);
  f->dev.done = (const uint64_t *)((char *)dev_host + ring + 64);
  f->dev.head = (uint64_t *)f->device_words;
  f->dev.tail_seen = (uint64_t *)f->device_words + 1;
  f->dev.slots_mask = slots - 1;
  return TW_SUCCESS;
}

void tw_fifo_destroy(tw_fifo_t *f) {
  if (!f)
    return;
  if (f->slots)
    cudaFreeHost(f->slots);
  if (f->device_words)
    cudaFree(f->device_words);
  memset(f, 0, sizeof(*f));
}

size_t tw_fifo_poll(tw_fifo_t *f, tw_fifo_cmd_t *out, size_t max) {
  size_t n = 0;
  while (n < max) {
    tw_fifo_cmd_t *slot = &f->slots[f->taken & (f->nslots - 1)];
    /* the acquire pairs with the poster's fence and release store of seq: the fields it wrote
     * before are visible once seq is */
    const uint64_t seq = atomic_load_explicit((_Atomic uint64_t *)&slot->seq, memory_order_acquire);
    if (seq != f->taken + 1)
      break;
    out[n] = *slot;
    n++;
    f->taken++;
  }
  if (n) /* the slots are free once their fields are copied out */
    atomic_store_explicit((_Atomic uint64_t *)f->tail, f->taken, memory_order_release);
  return n;
}
