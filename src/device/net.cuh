/*
 * Kernels and the inter-node transport (transport/net.h): RDMA writes to a rank on another node
 * are posted through the command FIFO (device/fifo.cuh) to this rank's CPU proxy, and announce
 * themselves with a flag word of the receiver (channel ch's slice of its net flags) that takes
 * the value the write carried, only after the write's data landed. A flag has one writer and
 * its values only grow (calls post their epoch), so a reader waits for `flag >= value`.
 *
 * Ranks on other nodes cannot see this rank's control block, so the entry handshake with them
 * is a net flag too: a call's kernel tells each peer it will write into that it entered the
 * call (tw_net_signal_entry: its writes of the previous call are read), and waits for the same
 * from the peer before its first write (tw_net_wait_entry).
 */
#ifndef TW_DEVICE_NET_CUH
#define TW_DEVICE_NET_CUH

#include "device/fifo.cuh"
#include "device/signal.cuh"

/* This rank's net flag `slot` of channel ch (set by peers on other nodes). */
static __device__ __forceinline__ const uint64_t *tw_net_flag(const tw_dev_comm_t &dc, int ch,
                                                              int slot) {
  return dc.net_flags + (size_t)ch * TW_NET_CH_FLAGS + (size_t)slot;
}

/* One thread: posts `bytes` from this rank's heap offset local_off to peer's remote_off, then
 * the peer's net flag (ch, slot) = value. Returns the ticket (~0 on failure, recorded). */
static __device__ __forceinline__ uint64_t tw_net_post_write(const tw_dev_comm_t &dc, int ch,
                                                             int peer, uint64_t local_off,
                                                             uint64_t remote_off, uint64_t bytes,
                                                             int slot, uint64_t value) {
  tw_fifo_cmd_t c;
  c.seq = 0;
  c.op = bytes ? TW_FIFO_OP_WRITE : TW_FIFO_OP_FLAG;
  c.peer = peer;
  c.local_off = local_off;
  c.remote_off = remote_off;
  c.bytes = bytes;
  c.flag_off = 1 + (uint64_t)ch * TW_NET_CH_FLAGS + (uint64_t)slot;
  c.flag_value = value;
  c.tag = 0;
  return tw_fifo_post(dc.fifo, dc, ch, c);
}

/* The entry flags of channel ch: slot TW_NET_ENTRY_SLOT(node of the signalling rank). */
#define TW_NET_ENTRY_SLOT(node) (TW_NET_CH_FLAGS - 64 + (node))

/* One thread: tells `peer` (on another node, node index my_node here) that this rank entered
 * call epoch on ch. */
static __device__ __forceinline__ uint64_t tw_net_signal_entry(const tw_dev_comm_t &dc, int ch,
                                                               int peer, int my_node,
                                                               uint64_t epoch) {
  return tw_net_post_write(dc, ch, peer, 0, 0, 0, TW_NET_ENTRY_SLOT(my_node), epoch);
}

/* One thread: waits, bounded, for `peer` (on node peer_node) to have entered call epoch on ch. */
static __device__ __forceinline__ bool tw_net_wait_entry(const tw_dev_comm_t &dc, int ch, int peer,
                                                         int peer_node, uint64_t epoch) {
  return tw_wait_geq(dc, ch, tw_net_flag(dc, ch, TW_NET_ENTRY_SLOT(peer_node)), epoch, peer, -1);
}

#endif
