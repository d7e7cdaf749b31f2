/*
 * tw_ag_gemm across nodes (included by ag_gemm_sm90.cu): the comm CTAs run the rail gather
 * (device/rail.cuh) of the shards into a_gathered, whose chunks are the push mode's, and a
 * tile's readiness wait reads, for rows of a rail peer, the net flag (AgWait::before_tile).
 */
#ifndef TW_OPS_AG_GEMM_RAIL_CUH
#define TW_OPS_AG_GEMM_RAIL_CUH

#include "device/rail.cuh"

/* The rail gather's data movement over a_gathered (device/rail.cuh's Ops). */
template <class Out> struct AgRailOps {
  const AgParams<Out> &p;
  __device__ int64_t row0(int chunk) const { return (int64_t)chunk * p.gemm.wait.rows_per_chunk; }
  __device__ int64_t rows(int chunk) const {
    return min((int64_t)p.gemm.wait.rows_per_chunk, (int64_t)p.gemm.wait.m_local - row0(chunk));
  }
  __device__ void copy(int target, int src, int chunk) const {
    const AgWait::Params &w = p.gemm.wait;
    if (src == w.dc.rank) { /* from the shard */
      copy_chunk(p, target, chunk);
      return;
    }
    const int64_t off = ((int64_t)src * w.m_local + row0(chunk)) * p.row_bytes;
    copy_rows(p, p.gathered[target] + off, p.gathered[w.dc.rank] + off, rows(chunk));
  }
  __device__ uint64_t *flag(int target, int src, int chunk) const {
    const AgWait::Params &w = p.gemm.wait;
    const int index = tw_ag_gemm_flag_index(src, chunk);
    return target == w.dc.rank ? tw_own_flag(w.dc, w.ch, index)
                               : tw_peer_flag(w.dc, target, w.ch, index);
  }
  __device__ uint64_t chunk_off(int src, int chunk) const {
    const AgWait::Params &w = p.gemm.wait;
    return w.gathered_off + (uint64_t)(((int64_t)src * w.m_local + row0(chunk)) * p.row_bytes);
  }
  __device__ uint64_t chunk_bytes(int chunk) const { return (uint64_t)(rows(chunk) * p.row_bytes); }
};

template <class Out>
__device__ __forceinline__ uint64_t rail_items(const AgParams<Out> &p, uint64_t epoch, int ok) {
  const AgWait::Params &w = p.gemm.wait;
  const AgRailOps<Out> ops{p};
  return tw_rail_gather(w.rail, w.dc, w.ch, epoch, p.nchunks, (int)blockIdx.x, p.comm_ctas, ok,
                        ops);
}

#endif
