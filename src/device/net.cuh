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

/* One thread, after tw_kernel_enter published this rank's call (ctrl->call[ch], at heap offset
 * 0 with the rest of the control block): tells `peer` (on another node, node index my_node
 * here) that this rank entered call epoch on ch. One write carries the call's digest into the
 * peer's ctrl->call_digest[ch][rank] with the entry flag behind it (RC orders the flag after the
 * data; SRD sets the flag on the write's own receive completion), so the peer compares calls
 * as ranks of one node do (tw_wait_entry). */
static __device__ __forceinline__ uint64_t tw_net_signal_entry(const tw_dev_comm_t &dc, int ch,
                                                               int peer, int my_node,
                                                               uint64_t epoch) {
  const uint64_t mine = offsetof(tw_ctrl_t, call) + (uint64_t)ch * sizeof(tw_call_desc_t) +
                        offsetof(tw_call_desc_t, digest);
  const uint64_t theirs =
      offsetof(tw_ctrl_t, call_digest) + ((uint64_t)ch * TW_MAX_WORLD + (uint64_t)dc.rank) * 8;
  return tw_net_post_write(dc, ch, peer, mine, theirs, dc.call.digest ? 8 : 0,
                           TW_NET_ENTRY_SLOT(my_node), epoch);
}

/* One thread: waits, bounded, for `peer` (on node peer_node) to have entered call epoch on ch,
 * then compares its call's digest with this rank's (false, TW_ERR_MISMATCH recorded, where
 * they differ). The digest read is this call's: the peer's next call's comes only after this
 * call's writes, which follow this check. */
static __device__ __forceinline__ bool tw_net_wait_entry(const tw_dev_comm_t &dc, int ch, int peer,
                                                         int peer_node, uint64_t epoch) {
  if (!tw_wait_geq(dc, ch, tw_net_flag(dc, ch, TW_NET_ENTRY_SLOT(peer_node)), epoch, peer, -1))
    return false;
  const uint64_t *slot = &dc.ctrl->call_digest[ch][peer];
  const uint64_t theirs = *(const volatile uint64_t *)slot;
  if (dc.call.digest && theirs != dc.call.digest && !tw_aborted(dc)) {
    tw_call_mismatch(dc, ch, slot, peer, theirs);
    return false;
  }
  return true;
}

#endif
