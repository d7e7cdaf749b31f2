/*
 * The command FIFO from a rank's kernels to its CPU proxy (the inter-node path's first half).
 *
 * Kernels post fixed-size commands (an RDMA write of `bytes` from a local heap offset to a peer's
 * remote heap offset, then a flag) into a ring in pinned, device-mapped host
 * memory; the proxy thread polls the ring in ticket order and hands each command to its
 * backend. The protocol, for any number of posting threads:
 *
 *   post (one thread, device/fifo.cuh):
 *     ticket = atomicAdd(head, 1)                      head: device memory, shared by posters
 *     wait until ticket < tail + slots                 tail: host memory, written by the proxy;
 *                                                      bounded like every wait, and read over
 *                                                      PCIe only when the ring looks full
 *     slot[ticket % slots] = the command's fields      plain stores into host memory
 *     fence.sys; st.release.sys slot.seq = ticket + 1  the slot is the proxy's from here
 *   poll (the proxy, fifo.c):
 *     while slot[tail % slots].seq == tail + 1 (acquire): copy it out, tail++
 *     then one release store of tail                   frees the slots for posters
 *
 * A slot is reused by ticket t + slots only after the proxy moved tail past t, i.e. after it
 * copied t's fields out, so a poster never overwrites a command the proxy has not read. seq
 * never repeats for a slot (it is the ticket + 1), so a stale slot is never taken for a new one.
 * Backpressure is the bounded wait in post: a proxy that stops polling makes posters fail with
 * the comm's async error, never hang.
 *
 * Completion: the proxy also publishes `done`, the count of tickets below which every command
 * has finished (its bytes were read by the NIC and placed at the peer). A kernel that must not
 * end while its writes still read its memory waits for done > its last ticket
 * (tw_fifo_wait_done).
 */
#ifndef TW_TRANSPORT_FIFO_H
#define TW_TRANSPORT_FIFO_H

#include <stddef.h>
#include <stdint.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Flag words per rank that peers on other nodes set (transport/net.h): TW_NET_CH_FLAGS for each
 * of the 9 channels (runtime/devcomm.h). */
#define TW_NET_CH_FLAGS 2048
#define TW_NET_FLAGS (9 * TW_NET_CH_FLAGS)

/* What a command asks of the proxy. */
enum {
  TW_FIFO_OP_WRITE = 1,      /* bytes from local_off to the peer's remote_off, then the flag */
  TW_FIFO_OP_FLAG = 2,       /* the flag alone (value at the peer's flag_off) */
  TW_FIFO_OP_TEST_ECHO = 100 /* tests: the proxy only records the command */
};

/* One command: 64 bytes, one slot. Offsets are into the symmetric heap (the same on every rank). */
typedef struct tw_fifo_cmd {
  uint64_t seq; /* ticket + 1 once the command is complete; written last */
  uint32_t op;
  int32_t peer;
  uint64_t local_off;
  uint64_t remote_off;
  uint64_t bytes;
  uint64_t flag_off; /* 1 + the index of the peer's flag word to set after the data, 0: none */
  uint64_t flag_value;
  uint64_t tag; /* the poster's: a tile id, or a test's check value */
} tw_fifo_cmd_t;

/* The ring as the kernels see it (passed by value in their parameters). */
typedef struct tw_fifo_dev {
  tw_fifo_cmd_t *slots; /* host memory, mapped for the device */
  const uint64_t *tail; /* host memory, mapped: commands the proxy has taken */
  const uint64_t *done; /* host memory, mapped: tickets below it have finished */
  uint64_t *head;       /* device memory: tickets handed out */
  uint64_t *tail_seen;  /* device memory: the largest tail a poster read (fewer PCIe reads) */
  uint64_t slots_mask;  /* slots - 1 (slots a power of 2) */
} tw_fifo_dev_t;

/* The ring as the proxy sees it. */
typedef struct tw_fifo {
  tw_fifo_cmd_t *slots; /* host memory */
  uint64_t *tail;       /* host memory */
  uint64_t *done;       /* host memory (NULL: not published) */
  uint64_t taken;       /* the proxy's own count of commands taken (tail's value) */
  uint64_t nslots;
  void *device_words; /* head and tail_seen, device memory */
  tw_fifo_dev_t dev;
} tw_fifo_t;

/* Creates a ring of `slots` commands (a power of 2, 2 to 2^20) for the current device. */
tw_status_t tw_fifo_create(tw_fifo_t *f, uint64_t slots);
void tw_fifo_destroy(tw_fifo_t *f);

/* The proxy: copies up to `max` complete commands, in ticket order, into out, frees their slots
 * and returns how many. Never blocks. One thread at a time per ring. */
size_t tw_fifo_poll(tw_fifo_t *f, tw_fifo_cmd_t *out, size_t max);

#ifdef __cplusplus
}
#endif
#endif
