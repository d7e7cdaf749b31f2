/*
 * Posting a command into the FIFO to the CPU proxy (transport/fifo.h holds the protocol).
 */
#ifndef TW_DEVICE_FIFO_CUH
#define TW_DEVICE_FIFO_CUH

#include "device/signal.cuh"
#include "transport/fifo.h"

/* The host's tail, read over PCIe (system scope): commands the proxy has taken. */
static __device__ __forceinline__ uint64_t tw_fifo_read_tail(const tw_fifo_dev_t &f) {
  const uint64_t t = tw_ld_acquire_sys(f.tail);
  atomicMax((unsigned long long *)f.tail_seen, (unsigned long long)t);
  return t;
}

/* One thread: posts `cmd` (its seq is set here) and returns its ticket. Waits, bounded by
 * dc.timeout_ns, while the ring is full; on expiry or abort the failure is recorded under channel
 * op (the item: the ticket's slot) and it returns ~0 without posting: the proxy then never sees
 * the ticket, so a comm that timed out must be destroyed, as after any failed wait. */
static __device__ __forceinline__ uint64_t tw_fifo_post(const tw_fifo_dev_t &f,
                                                        const tw_dev_comm_t &dc, int op,
                                                        tw_fifo_cmd_t cmd) {
  const uint64_t ticket = atomicAdd((unsigned long long *)f.head, 1ull);
  const uint64_t slots = f.slots_mask + 1;
  uint64_t tail = *(volatile uint64_t *)f.tail_seen;
  if (ticket >= tail + slots) {
    tail = tw_fifo_read_tail(f);
    if (ticket >= tail + slots) {
      const uint64_t start = tw_globaltimer();
      uint64_t *row = tw_trace_wait_begin(dc, op, dc.rank, (int)(ticket & f.slots_mask), start);
      uint32_t backoff = 64;
      while (ticket >= (tail = tw_fifo_read_tail(f)) + slots) {
        __nanosleep(backoff);
        if (backoff < 1024)
          backoff <<= 1;
        const bool aborted = tw_aborted(dc);
        if (aborted || tw_globaltimer() - start > dc.timeout_ns) {
          tw_wait_failed(dc, row, aborted, op, f.tail, ticket - slots + 1, tail, dc.rank,
                         (int)(ticket & f.slots_mask));
          return ~0ull;
        }
      }
      tw_trace_wait_end(row, start);
    }
  }
  tw_fifo_cmd_t *slot = &f.slots[ticket & f.slots_mask];
  volatile uint64_t *w = (volatile uint64_t *)slot;
  const uint64_t *c = (const uint64_t *)&cmd;
#pragma unroll
  for (unsigned i = 1; i < sizeof(tw_fifo_cmd_t) / 8; i++) /* every field but seq */
    w[i] = c[i];
  tw_fence_acq_rel_sys();
  tw_signal_put(&slot->seq, ticket + 1); /* with the fence, a release of the fields */
  return ticket;
}

/* One thread: waits, bounded, until every command up to `ticket` has finished (the proxy's
 * done count passed it); false on timeout or abort (recorded under channel op). */
static __device__ __forceinline__ bool
tw_fifo_wait_done(const tw_fifo_dev_t &f, const tw_dev_comm_t &dc, int op, uint64_t ticket) {
  return tw_wait_geq(dc, op, f.done, ticket + 1, dc.rank, -3);
}

#endif
