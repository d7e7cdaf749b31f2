/*
 * tw_allgather: persistent SM-driven push. Work item (peer, chunk): copy this
 * rank's chunk into the peer's receive buffer at offset rank * bytes, then set
 * the peer's flag (src = this rank, chunk) to the call's epoch. Before the
 * first write into a peer, wait until the peer entered this call (its earlier
 * reads of the buffer are done). The kernel returns once every chunk of every
 * rank has landed in this rank's buffer, so stream order holds for consumers.
 * The same items and flags are the communication half of tw_ag_gemm.
 */
#include <cuda_runtime.h>

#include "device/copy.cuh"
#include "device/ptx_sm90.cuh"
#include "device/rail.cuh"
#include "device/signal.cuh"
#include "ops/allgather/allgather.h"

extern "C" {
#include "core/env.h"
#include "runtime/argcheck.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/comm_net.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

/* Items are ordered peer-major with peers rotated from rank + 1 and this rank
 * last, so every rank starts on a different peer. */
static __device__ __forceinline__ int item_peer(int item, int nchunks, int rank, int world) {
  return (rank + 1 + item / nchunks) % world;
}

/* Both allgather kernels let a kernel launched after them as a programmatic dependent start at
 * once (tw_ag_gemm's decode GEMM on GPUs of their own: its CTAs take the SMs this grid leaves idle
 * and stream B into L2, then wait for this grid's end before they load the gathered rows). Every
 * CTA of this grid is resident by the time the dependent starts, so it cannot keep one off. */
static __device__ __forceinline__ void allow_dependents() {
  if (threadIdx.x == 0)
    tw::ptx::griddep_launch_dependents();
}

__global__ void __launch_bounds__(TW_AG_THREADS, 1)
    tw_allgather_kernel(const __grid_constant__ tw_dev_comm_t dc,
                        const __grid_constant__ tw_ag_plan_t plan) {
  allow_dependents();
  const uint64_t epoch = tw_op_begin(dc, TW_CH_ALLGATHER);
  /* Decisions are made by thread 0 and spread with __syncthreads_and, so every thread of
   * the CTA leaves a loop at the same iteration (no shared flag read while it is written). */
  /* Every peer entered this call, with the same call, before this CTA writes into any. */
  int mine = 1;
  if (threadIdx.x == 0)
    mine =
        tw_kernel_enter(dc, TW_CH_ALLGATHER, epoch) && tw_wait_entries(dc, TW_CH_ALLGATHER, epoch);
  int ok = __syncthreads_and(mine);
  const int items = plan.world * plan.nchunks;
  for (int item = blockIdx.x; ok && item < items; item += gridDim.x) {
    const int peer = item_peer(item, plan.nchunks, dc.rank, plan.world);
    const int chunk = item % plan.nchunks;
    const size_t begin = (size_t)chunk * plan.chunk_bytes;
    const size_t len =
        begin + plan.chunk_bytes <= plan.bytes ? plan.chunk_bytes : plan.bytes - begin;
    char *dst = (char *)plan.recv_peer[peer] + (size_t)dc.rank * plan.bytes + begin;
    const char *src = (const char *)plan.send + begin;
    if (dst != src)
      tw_cta_copy(dst, src, len);
    __syncthreads();
    if (threadIdx.x == 0)
      tw_signal_set(tw_peer_flag(dc, peer, TW_CH_ALLGATHER, tw_ag_flag_index(dc.rank, chunk)),
                    epoch);
  }
  /* Receive side: this rank's buffer is complete once every (src, chunk) flag is set. */
  if (threadIdx.x == 0) {
    for (int item = blockIdx.x; ok && item < items; item += gridDim.x) {
      const int src = item / plan.nchunks, chunk = item % plan.nchunks;
      ok = tw_wait_geq(dc, TW_CH_ALLGATHER,
                       tw_own_flag(dc, TW_CH_ALLGATHER, tw_ag_flag_index(src, chunk)), epoch, src,
                       item);
    }
    tw_trace_stamp(dc, TW_TR_END);
    tw_op_finish(dc, TW_CH_ALLGATHER, epoch);
  }
}

/* Across nodes: the rail gather's data movement over recv (device/rail.cuh's Ops). */
struct AgRailOps {
  const tw_ag_plan_t &plan;
  const tw_dev_comm_t &dc;
  __device__ size_t begin(int chunk) const { return (size_t)chunk * plan.chunk_bytes; }
  __device__ uint64_t chunk_bytes(int chunk) const {
    const size_t b = begin(chunk);
    return b + plan.chunk_bytes <= plan.bytes ? plan.chunk_bytes : plan.bytes - b;
  }
  __device__ void copy(int target, int src, int chunk) const {
    const size_t off = (size_t)src * plan.bytes + begin(chunk);
    char *dst = (char *)plan.recv_peer[target] + off;
    const char *from = src == dc.rank ? (const char *)plan.send + begin(chunk)
                                      : (const char *)plan.recv_peer[dc.rank] + off;
    if (dst != from)
      tw_cta_copy(dst, from, chunk_bytes(chunk));
    __syncthreads();
  }
  __device__ uint64_t *flag(int target, int src, int chunk) const {
    const int index = tw_ag_flag_index(src, chunk);
    return target == dc.rank ? tw_own_flag(dc, TW_CH_ALLGATHER, index)
                             : tw_peer_flag(dc, target, TW_CH_ALLGATHER, index);
  }
  __device__ uint64_t chunk_off(int src, int chunk) const {
    return plan.recv_off + (uint64_t)src * plan.bytes + begin(chunk);
  }
};

/* tw_allgather across nodes: every CTA runs the rail gather's items, then waits for its share of
 * this rank's (src, chunk) arrivals, and for the proxy to have finished its own writes. */
__global__ void __launch_bounds__(TW_AG_THREADS, 1)
    tw_allgather_rail_kernel(const __grid_constant__ tw_dev_comm_t dc,
                             const __grid_constant__ tw_ag_plan_t plan) {
  allow_dependents();
  const int ch = TW_CH_ALLGATHER;
  const uint64_t epoch = tw_op_begin(dc, ch);
  int mine = 1;
  if (threadIdx.x == 0)
    mine = tw_kernel_enter(dc, ch, epoch) && tw_wait_entries(dc, ch, epoch);
  int ok = __syncthreads_and(mine);
  const AgRailOps ops{plan, dc};
  const uint64_t last = tw_rail_gather(plan.rail, dc, ch, epoch, plan.nchunks, (int)blockIdx.x,
                                       (int)gridDim.x, ok, ops);
  if (threadIdx.x == 0) {
    const int items = plan.world * plan.nchunks;
    for (int item = blockIdx.x; ok && item < items; item += gridDim.x) {
      const int src = item / plan.nchunks, chunk = item % plan.nchunks;
      const uint64_t *own = tw_own_flag(dc, ch, tw_ag_flag_index(src, chunk));
      ok = tw_wait_geq(dc, ch, tw_rail_ready_flag(plan.rail, dc, ch, src, chunk, own), epoch, src,
                       item);
    }
    if (last != ~0ull)
      tw_fifo_wait_done(dc.fifo, dc, ch, last);
    tw_trace_stamp(dc, TW_TR_END);
    tw_op_finish(dc, ch, epoch);
  }
}

/* tw_allgather through the comm's low-latency area (TW_AG_LL; the words and their sequence as
 * the unfused GEMM+RS pipeline's, gemm_rs_unfused.cu): call sequence q = ctrl->ll_seq + 1, flag
 * tw_ll_flag(q), half q & 1 of every area. Each thread stores 16-byte vectors of this rank's
 * shard into every peer's area (slot `rank`, two words a vector, tw_ll_put_item's layout) and
 * into its own recv slot, then copies every peer's vectors from its own area into recv as their
 * words arrive. No entry handshake, fence or flag store: a rank writes a peer's half q & 1 only
 * after it has all of call q - 1's words from that peer, stored after that peer's call q - 2 (the
 * same half) had read its area. Nobody touches another rank's recv, so recv need not be
 * symmetric here. */
constexpr int kAgLlThreads = 256;

typedef struct {
  const uint4 *send;
  uint4 *recv;                 /* this rank's, [world][vecs] */
  uint8_t *area[TW_MAX_WORLD]; /* every rank's low-latency area, mapped here */
  uint64_t half_bytes;         /* world slots of vecs x 32 bytes */
  int64_t vecs;                /* 16-byte vectors per rank */
} tw_ag_ll_params_t;

__global__ void __launch_bounds__(kAgLlThreads)
    tw_allgather_ll_kernel(const __grid_constant__ tw_dev_comm_t dc,
                           const __grid_constant__ tw_ag_ll_params_t p) {
  allow_dependents();
  const int world = dc.world, rank = dc.rank;
  const uint64_t epoch = tw_op_begin(dc, TW_CH_ALLGATHER);
  const uint64_t seq = tw_ll_next_seq(dc);
  const uint2 flag = tw_ll_flags(seq, dc.call.digest);
  const uint64_t half = tw_ll_half(seq, p.half_bytes), slot = (uint64_t)p.vecs * 32;
  bool ok = tw_op_usable(dc, TW_CH_ALLGATHER);
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_START);
    tw_trace_channel(dc, TW_CH_ALLGATHER);
    if (blockIdx.x == 0 && ok) {
      tw_call_publish(dc, TW_CH_ALLGATHER);
      tw_signal_current(dc, TW_CH_ALLGATHER, epoch);
      tw_ll_announce(dc, flag);
    }
  }
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  uint4 *own = p.recv + (int64_t)rank * p.vecs;
  for (int64_t i = first; ok && i < p.vecs; i += stride) {
    const uint4 v = __ldcg(p.send + i);
    for (int d = 0; d < world; d++)
      if (d != rank)
        tw_ll_put_item(p.area[d] + half + (uint64_t)rank * slot, (uint64_t)i, (uint64_t)p.vecs, v,
                       flag);
    if (own != p.send)
      own[i] = v;
  }
  const uint8_t *mine = p.area[rank] + half;
  const int64_t all = (int64_t)(world - 1) * p.vecs;
  for (int64_t j = first; ok && j < all; j += stride) {
    const int64_t k = j / p.vecs, i = j % p.vecs;
    const int s = (int)k + ((int)k >= rank ? 1 : 0); /* the peers in order, this rank skipped */
    uint4 w;
    ok = tw_ll_wait_item(dc, TW_CH_ALLGATHER, mine + (uint64_t)s * slot, (uint64_t)i,
                         (uint64_t)p.vecs, flag, s, &w);
    if (ok)
      p.recv[(int64_t)s * p.vecs + i] = w;
  }
  tw_ll_call_end(dc, TW_CH_ALLGATHER, epoch, seq);
}

__global__ void tw_barrier_kernel(const __grid_constant__ tw_dev_comm_t dc) {
  const uint64_t epoch = tw_op_begin(dc, TW_CH_BARRIER);
  const int p = threadIdx.x;
  if (p < dc.world && dc.peer_ctrl[p] && tw_op_usable(dc, TW_CH_BARRIER)) {
    tw_signal_set(tw_peer_flag(dc, p, TW_CH_BARRIER, dc.rank), epoch);
    tw_wait_geq(dc, TW_CH_BARRIER, tw_own_flag(dc, TW_CH_BARRIER, p), epoch, p, 0);
  }
  __syncthreads();
  if (threadIdx.x == 0)
    tw_op_finish(dc, TW_CH_BARRIER, epoch);
}

static tw_status_t tw_allgather_preload(void) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, tw_allgather_kernel);
  if (e == cudaSuccess)
    e = cudaFuncGetAttributes(&attr, tw_allgather_ll_kernel);
  if (e == cudaSuccess)
    e = cudaFuncGetAttributes(&attr, tw_allgather_rail_kernel);
  if (e == cudaSuccess)
    e = cudaFuncGetAttributes(&attr, tw_barrier_kernel);
  return tw_cuda_check(e, "loading the allgather kernels");
}

/* tw_allgather, registered with the runtime (runtime/registry.h). */
/* What tw_allgather's calls must have alike (tw_allgather sets them). */
static const tw_call_fields_t allgather_calls[] = {
    {TW_CH_ALLGATHER,
     "tw_allgather",
     {"bytes", "path (0 the SM push, 1 the low-latency area, 2 the rail gather across nodes)",
      "recv (heap offset)", "chunk_bytes"}}};
static const tw_op_desc_t allgather_registration = {"allgather", tw_allgather_preload,
                                                    allgather_calls, 1};
TW_OP_REGISTER(allgather, allgather_registration);

extern "C" tw_status_t tw_ag_make_plan(tw_comm_t comm, const void *send, void *recv, size_t bytes,
                                       int max_ctas, tw_ag_plan_t *plan) {
  TW_ARG_CHECK(send != NULL, "send: NULL");
  TW_ARG_CHECK(recv != NULL, "recv: NULL");
  TW_ARG_CHECK(bytes > 0, "bytes: 0");
  TW_ARG_CHECK(bytes % 16 == 0, "bytes: %zu is not a multiple of 16", bytes);
  TW_ARG_CHECK((uintptr_t)send % 16 == 0, "send: %p is not 16-byte aligned", send);
  TW_ARG_CHECK((uintptr_t)recv % 16 == 0, "recv: %p is not 16-byte aligned", recv);
  const int world = comm->world;
  TW_ARG_CHECK(bytes <= (size_t)INT64_MAX / (size_t)world, "bytes: %zu overflows", bytes);
  tw_status_t st = tw_heap_lookup(comm, recv, bytes * (size_t)world, "recv", NULL);
  if (st != TW_SUCCESS)
    return st;
  const char *r0 = (const char *)recv, *s0 = (const char *)send;
  const char *own = r0 + (size_t)comm->rank * bytes;
  TW_ARG_CHECK(s0 == own || s0 + bytes <= r0 || s0 >= r0 + bytes * (size_t)world,
               "send: %p overlaps recv but is not recv + rank * bytes (%p)", send,
               (const void *)own);
  if (s0 != own && (st = tw_comm_check_range(comm, send, bytes, "send")) != TW_SUCCESS)
    return st;
  memset(plan, 0, sizeof(*plan));
  plan->send = send;
  plan->bytes = bytes;
  plan->world = world;
  plan->inter = comm->nodes > 1;
  if (plan->inter) {
    if ((st = tw_comm_rail(comm, "tw_allgather", &plan->rail)) != TW_SUCCESS)
      return st;
    plan->recv_off =
        (uint64_t)((const char *)recv - (const char *)tw_group_slot(comm->group, comm->rank, 0));
  }
  for (int p = 0; p < world; p++) {
    plan->recv_peer[p] = tw_heap_peer_ptr(comm, recv, p);
    if (!plan->recv_peer[p] && comm->node_of[p] == comm->node)
      return tw_fail(TW_ERR_NOT_SUPPORTED,
                     "recv: rank %d's allocation is not mapped here (a rank of this node in "
                     "another process that cannot share GPU memory?)",
                     p);
  }
  /* Chunks: about TW_AG_TARGET_ITEMS items in all (two per CTA of a full H200), each at least
   * 64 KiB, at most TW_AG_MAX_CHUNKS per rank (the flag slice). TW_AG_CHUNK_BYTES overrides.
   * The chunking must be the same on every rank (a receiver waits for the sender's chunk
   * flags), so it depends on bytes and world only, never on this rank's SM budget: ranks on
   * distinct GPUs may have different budgets (3 ranks on 2 GPUs: 66, 132, 66 SMs), and a
   * budget-derived chunking would leave a receiver waiting for chunks its sender never cuts. */
  size_t chunk = (size_t)tw_env_int(TW_AG_CHUNK_BYTES_ID);
  if (chunk == 0) {
    size_t want_items_per_peer = ((size_t)TW_AG_TARGET_ITEMS + world - 1) / world;
    chunk = (bytes + want_items_per_peer - 1) / want_items_per_peer;
    /* across nodes every chunk is an RDMA write, whose cost per write favours large ones */
    const size_t least = plan->inter ? (size_t)TW_AG_RAIL_MIN_CHUNK : (size_t)(64u << 10);
    if (chunk < least)
      chunk = least;
  }
  chunk = (chunk + 15) / 16 * 16;
  /* across nodes one net flag per (node, chunk) */
  const int max_chunks = plan->inter ? TW_RAIL_MAX_CHUNKS : TW_AG_MAX_CHUNKS;
  size_t min_chunk = (bytes + max_chunks - 1) / max_chunks;
  if (chunk < min_chunk)
    chunk = (min_chunk + 15) / 16 * 16;
  if (chunk > bytes)
    chunk = bytes;
  plan->chunk_bytes = chunk;
  plan->nchunks = (int)((bytes + chunk - 1) / chunk);
  int items = world * plan->nchunks;
  plan->ctas = items < max_ctas ? items : max_ctas; /* grid-strided: any count is correct */
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_allgather(tw_comm_t comm, const void *send, void *recv, size_t bytes,
                                    tw_stream_t stream) {
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_ag_plan_t plan;
  int max_ctas = comm->sm_budget;
  int knob = (int)tw_env_int(TW_AG_COMM_SMS_ID);
  if (knob > 0 && knob < max_ctas)
    max_ctas = knob;
  st = tw_ag_make_plan(comm, send, recv, bytes, max_ctas, &plan);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  int prev, smem = 0;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  cudaStream_t launch = NULL;
  /* (the low-latency area reaches the ranks of one node only) */
  const int ll = !plan.inter && tw_ag_want_ll((int)tw_env_int(TW_AG_LL_ID), comm->world,
                                              comm->gpu_shared, bytes, comm->ll_bytes);
  /* The low-latency path touches no peer's recv, so recv need not be alike there. */
  const uint64_t path = ll ? 1 : plan.inter ? 2 : 0;
  const uint64_t fields[] = {(uint64_t)bytes, path, ll ? 0 : tw_call_heap_field(comm, recv),
                             ll ? 0 : (uint64_t)plan.chunk_bytes};
  const tw_call_desc_t outer = tw_call_begin(comm, TW_CH_ALLGATHER, 4, fields);
  if (!ll)
    st = tw_sm_exclusive_smem(plan.inter ? (const void *)tw_allgather_rail_kernel
                                         : (const void *)tw_allgather_kernel,
                              &smem);
  if (st == TW_SUCCESS)
    st = tw_launch_begin(comm, stream, &launch);
  if (st == TW_SUCCESS && ll) {
    tw_ag_ll_params_t p;
    memset(&p, 0, sizeof(p));
    p.send = (const uint4 *)send;
    p.recv = (uint4 *)recv;
    for (int r = 0; r < comm->world; r++)
      p.area[r] = (uint8_t *)tw_heap_peer_ptr(comm, comm->ll, r);
    /* halves of the whole area, whatever the call's size: consecutive calls of the area (any
     * op) then never share bytes, however their sizes differ */
    p.half_bytes = comm->ll_bytes / 2;
    p.vecs = (int64_t)(bytes / 16);
    const int64_t items = (int64_t)(comm->world - 1) * p.vecs;
    int64_t grid = (items + kAgLlThreads - 1) / kAgLlThreads;
    if (grid > max_ctas)
      grid = max_ctas;
    if (grid < 1)
      grid = 1;
    tw_allgather_ll_kernel<<<(unsigned)grid, kAgLlThreads, 0, launch>>>(comm->dev, p);
    st = tw_cuda_check(cudaGetLastError(), "launching tw_allgather_ll_kernel");
  } else if (st == TW_SUCCESS && plan.inter) {
    tw_allgather_rail_kernel<<<plan.ctas, TW_AG_THREADS, smem, launch>>>(comm->dev, plan);
    st = tw_cuda_check(cudaGetLastError(), "launching tw_allgather_rail_kernel");
  } else if (st == TW_SUCCESS) {
    tw_allgather_kernel<<<plan.ctas, TW_AG_THREADS, smem, launch>>>(comm->dev, plan);
    st = tw_cuda_check(cudaGetLastError(), "launching tw_allgather_kernel");
  }
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  tw_call_end(comm, outer);
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}

extern "C" tw_status_t tw_barrier(tw_comm_t comm, tw_stream_t stream) {
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  for (int p = 0; p < comm->world; p++)
    if (!comm->dev.peer_ctrl[p])
      return tw_comm_result(comm, tw_fail(TW_ERR_NOT_SUPPORTED,
                                          "rank %d is on another host; the inter-node barrier (the "
                                          "proxy path) is not implemented yet",
                                          p));
  int prev;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  cudaStream_t launch = NULL;
  st = tw_launch_begin(comm, stream, &launch);
  if (st == TW_SUCCESS) {
    tw_barrier_kernel<<<1, TW_MAX_WORLD, 0, launch>>>(comm->dev);
    st = tw_cuda_check(cudaGetLastError(), "launching tw_barrier_kernel");
  }
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}
