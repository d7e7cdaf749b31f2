/*
 * Rail-aligned gathers across nodes, for the ops whose ranks each contribute a slot of one
 * symmetric buffer (tw_allgather, tw_ag_gemm). A rank's slot, cut in chunks, travels:
 *   send     into the rank's own slot (where its source is elsewhere: the NIC reads the heap),
 *            then by RDMA to each rail peer (tw_rail_t: the ranks of its local index on the other
 *            nodes), carrying net flag (this node, chunk) = epoch, once that peer entered the call;
 *   push     over NVLink into each peer of the node, with that peer's flag (this rank, chunk);
 *   forward  each chunk a rail peer sent, once its net flag says it landed, over NVLink into
 *            each peer of the node at the sender's slot, with the peer's flag (sender, chunk).
 * So every byte crosses the network once per node, on its sender's rail, and NVLink once per
 * peer. A reader of rank src's chunk waits for the net flag where src is its rail peer (the data
 * landed here by RDMA) and for the ordinary flag otherwise (tw_rail_ready_flag).
 *
 * The op gives the data movement (Ops):
 *   __device__ void copy(int target, int src, int chunk) const   the whole CTA: src's chunk from
 *       this rank's buffer (src == this rank: from its send buffer) into target's buffer (target
 *       == this rank: the own slot), then a CTA barrier
 *   __device__ uint64_t *flag(int target, int src, int chunk) const   target's flag for it
 *   __device__ uint64_t chunk_off(int src, int chunk) const, chunk_bytes(int chunk) const
 *       the chunk's heap offset (the buffer's is the same on every rank) and size
 */
#ifndef TW_DEVICE_RAIL_CUH
#define TW_DEVICE_RAIL_CUH

#include "device/net.cuh"

static __host__ __device__ __forceinline__ int tw_rail_net_slot(int node, int chunk) {
  return node * TW_RAIL_MAX_CHUNKS + chunk;
}

/* Items of the rail gather (send, push, forward; nchunks each per destination) from `first` in
 * steps of `stride`, by the whole CTA; returns the last ticket thread 0 posted (~0: none), which
 * the CTA must see done (tw_fifo_wait_done) before the call ends. ok: thread 0's decision to go
 * on (false after a failed wait; the items stop). */
template <class Ops>
static __device__ __noinline__ uint64_t tw_rail_gather(const tw_rail_t &r, const tw_dev_comm_t &dc,
                                                       int ch, uint64_t epoch, int nchunks,
                                                       int first, int stride, int ok,
                                                       const Ops ops) {
  __shared__ int s_ok;
  const int rank = dc.rank, locals = r.local_size - 1, remotes = r.nodes - 1;
  uint64_t last = ~0ull;
  if (threadIdx.x == 0 && first == 0 && ok)
    for (int n = 0; n < r.nodes; n++)
      if (n != r.node)
        last = tw_net_signal_entry(dc, ch, r.rail[n], r.node, epoch);
  int entered = 0; /* thread 0: the rail peers' entries were seen */
  const int items = nchunks * (1 + locals + remotes);
  for (int item = first; ok && item < items; item += stride) {
    const int chunk = item % nchunks, kind = item / nchunks;
    if (kind == 0) { /* send */
      ops.copy(rank, rank, chunk);
      if (threadIdx.x == 0) {
        tw_signal_set(ops.flag(rank, rank, chunk), epoch);
        const uint64_t off = ops.chunk_off(rank, chunk);
        for (int n = 0; n < r.nodes && ok; n++) {
          if (n == r.node)
            continue;
          if (!entered)
            ok = tw_net_wait_entry(dc, ch, r.rail[n], n, epoch);
          if (ok) {
            last = tw_net_post_write(dc, ch, r.rail[n], off, off, ops.chunk_bytes(chunk),
                                     tw_rail_net_slot(r.node, chunk), epoch);
            ok = last != ~0ull;
          }
        }
        entered = 1;
      }
    } else if (kind <= locals) { /* push to the kind-th next peer of the node */
      const int target = r.local_rank[(r.local + kind) % r.local_size];
      ops.copy(target, rank, chunk);
      if (threadIdx.x == 0)
        tw_signal_set(ops.flag(target, rank, chunk), epoch);
    } else { /* forward what the rail peer of the (kind - locals)-th next node sent */
      const int n = (r.node + kind - locals) % r.nodes;
      const int src = r.rail[n];
      if (threadIdx.x == 0) {
        ok =
            tw_wait_geq(dc, ch, tw_net_flag(dc, ch, tw_rail_net_slot(n, chunk)), epoch, src, chunk);
        s_ok = ok;
      }
      __syncthreads();
      for (int j = 1; s_ok && j < r.local_size; j++) {
        const int target = r.local_rank[(r.local + j) % r.local_size];
        ops.copy(target, src, chunk);
        if (threadIdx.x == 0)
          tw_signal_set(ops.flag(target, src, chunk), epoch);
      }
    }
    if (threadIdx.x == 0)
      s_ok = ok;
    __syncthreads();
    ok = s_ok;
  }
  return last;
}

/* The flag a reader of rank src's chunk waits on: the net flag where src is a rail peer, else
 * `ordinary` (this rank's flag for it). */
static __device__ __forceinline__ const uint64_t *tw_rail_ready_flag(const tw_rail_t &r,
                                                                     const tw_dev_comm_t &dc,
                                                                     int ch, int src, int chunk,
                                                                     const uint64_t *ordinary) {
  if (r.node_of[src] == r.node || r.local_of[src] != r.local)
    return ordinary;
  return tw_net_flag(dc, ch, tw_rail_net_slot(r.node_of[src], chunk));
}

#endif
