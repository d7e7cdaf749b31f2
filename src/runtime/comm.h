/*
 * The comm: one rank's view of the group (runtime/group.h). Ranks driven by one process share
 * a tw_group_t that owns the symmetric heap (runtime/heap.h). Offset 0 of every rank's heap
 * holds the rank's control block (tw_ctrl_t).
 */
#ifndef TW_RUNTIME_COMM_H
#define TW_RUNTIME_COMM_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "core/status.h"
#include "runtime/bootstrap.h"
#include "runtime/cuda_check.h"
#include "runtime/devcomm.h"
#include "runtime/group.h"
#include "runtime/heap.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tw_comm {
  tw_group_t *group;
  int rank, world, device;
  int local_rank, local_size, node, nodes;
  int node_of[TW_MAX_WORLD]; /* every rank's node */
  /* The inter-node transport (runtime/comm_net.h): FIFO, backend and proxy; NULL in one node. */
  struct tw_comm_net *net;
  int sm_count;        /* SMs of the device */
  int ranks_on_device; /* ranks sharing this GPU, this one included */
  /* 1 where two ranks of the comm (on this host) share a GPU: the same on every rank, unlike
   * ranks_on_device (3 ranks on 2 GPUs: 2, 1, 2), so plans whose choice every rank must make
   * alike (tw_gemm_rs's unit numbering, tw_gemm_ar's gather) take this one. */
  int gpu_shared;
  /* 1 where every rank of the comm lives in this process (tw_comm_init_all): the same on every
   * rank; with all of them on one GPU, their ordinary device pointers are valid for each other
   * (tw_gemm_ar's peer outs, TW_AR_PEER_OUT). */
  int one_process;
  int sm_budget;
  /* The smallest sm_budget of any rank (its configured one, else its share of its GPU's SMs):
   * the same on every rank, for plan choices that every rank must make alike (tw_gemm_ar's
   * unit groups). */
  int plan_sms;
  tw_config_t config; /* effective (defaults resolved) */
  uint64_t alloc_seq; /* tw_mem_alloc calls made by this rank */
  tw_ctrl_t *ctrl;    /* this rank's control block (symmetric offset 0) */
  /* The low-latency area (TW_LL_BYTES; the allocation after ctrl, 0 bytes at world 1 or where
   * the heap is under 4 x TW_LL_BYTES): peers store 16-byte words with the call's flag in the
   * data into it (tw_gemm_rs / tw_gemm_ar's unfused pipeline, TW_RS_UNFUSED_LL). */
  void *ll;
  size_t ll_bytes;
  /* tw_ag_gemm's decode GEMM: tw_gemm's split-K workspace (TW_GEMM_WORKSPACE_BYTES, zeroed at
   * init) */
  void *gemm_ws;
  tw_err_block_t *err_host;
  tw_err_block_t *err_dev;
  tw_dev_comm_t dev; /* handed to kernels by value */
  /* Virtual ranks of one process: kernels run on this per-rank stream (created
   * consecutively for all ranks, so each rank has its own hardware queue),
   * joined to the caller's stream by events. See tw_launch_begin. */
  cudaStream_t launch_stream;
  cudaEvent_t launch_in, launch_out;
  /* Copy-engine mode of tw_ag_gemm (made on first use): the side stream the copies and
   * flag writes go on, its fork/join events, and the host-counted epoch of that mode. */
  cudaStream_t ce_stream;
  cudaEvent_t ce_in, ce_done;
  uint64_t ce_epoch;
  /* TW_TRACE=1: the kernels' trace (dev.trace) and its pinned copy, printed after each call.
   * TW_WATCHDOG_S: dev.trace is the device view of trace_live (host-mapped), which the
   * watchdog reads while kernels run; calls_enqueued / calls_done (atomic builtins) count the
   * calls given to the stream and those whose trace callback ran. */
  uint64_t *trace_host;
  uint64_t trace_calls;
  uint64_t *trace_live;
  int trace_print;
  uint64_t calls_enqueued, calls_done;
  char last_error[TW_ERRMSG_LEN];
};

/* Records the thread-local message into the comm when st is a failure; returns st. */
tw_status_t tw_comm_result(struct tw_comm *comm, tw_status_t st);

/* Argument check for a public entry point taking a comm. */
tw_status_t tw_comm_check(const struct tw_comm *comm);
/* tw_comm_check, then for a collective call: the comm's kernels recorded no failure (after one the
 * comm is unusable; the call fails with the recorded status at once instead of enqueuing a
 * kernel that would give up at its start). */
tw_status_t tw_comm_check_call(const struct tw_comm *comm);

/* The symmetric heap as the ops see it: this rank's pointers (runtime/heap.h). */

/* Peer p's address for a pointer inside this rank's heap, or NULL if p's memory is
 * not mapped here. */
static inline void *tw_heap_peer_ptr(const struct tw_comm *comm, const void *local_ptr, int peer) {
  /* a rank on another node is reached through the inter-node transport only, also where it is
   * mapped here (virtual nodes of one host) */
  if (peer >= 0 && peer < comm->world && comm->node_of[peer] != comm->node)
    return NULL;
  return tw_heap_peer_addr(comm->group, comm->rank, local_ptr, peer);
}

/* Bytes from ptr to the end of its symmetric allocation on this rank; 0 if none holds it. */
static inline size_t tw_heap_avail(const struct tw_comm *comm, const void *ptr) {
  return tw_heap_span(comm->group, comm->rank, ptr);
}

/* TW_ERR_INVALID_ARGUMENT naming arg_name unless [ptr, ptr + bytes) lies inside one live
 * allocation of this rank (returned in *alloc_out when not NULL). */
static inline tw_status_t tw_heap_lookup(const struct tw_comm *comm, const void *ptr, size_t bytes,
                                         const char *arg_name, tw_alloc_t **alloc_out) {
  return tw_heap_find(comm->group, comm->rank, ptr, bytes, arg_name, alloc_out);
}

/* Fills node, nodes, local_rank, local_size of comm (rank and world set) from
 * the ranks' host hashes, or virtual nodes of ranks_per_node ranks when > 0. */
void tw_assign_nodes(struct tw_comm *comm, const uint64_t *host_of, int ranks_per_node);

/* Fills ranks_on_device and gpu_shared of comm (rank and world set) from every rank's host
 * hash and GPU UUID: ranks of one host whose UUIDs match share a GPU. */
void tw_assign_gpus(struct tw_comm *comm, const uint64_t *host_of, const uint8_t (*uuid)[16],
                    const int *sm_count, const int *sm_budget_cfg);
/* The values of the knobs every rank must set alike (the alike column of core/env_defs.h:
 * TW_RS_BAND, TW_RS_GROUP_UNITS, TW_AR_PUSH, ...), in table order, into knobs[0,
 * TW_PEER_KNOBS) (unused slots 0). */
void tw_alike_knobs(int64_t *knobs);
/* TW_ERR_INVALID_ARGUMENT, naming the knob and two ranks, where ranks' values differ
 * (peers[r].knobs is rank r's tw_alike_knobs); every rank sees every rank's values, so all
 * fail alike. */
tw_status_t tw_check_alike_knobs(const tw_peer_info_t *peers, int world);

/* The stream an op launches its kernel on: the caller's, or (virtual ranks) the
 * rank's own stream made to wait for the caller's. Pair with tw_launch_end. */
/* Creates comm->ce_stream and its events once (tw_ag_gemm's copy-engine mode). */
tw_status_t tw_comm_ce_stream(struct tw_comm *comm);
/* Gives every comm of comms[0, world) whose GPU other ranks share its own launch stream, made
 * one after another so that they land on distinct hardware queues (two streams on one queue
 * serialise, and a waiting kernel would block its peer). */
tw_status_t tw_make_launch_streams(struct tw_comm **comms, int world);
tw_status_t tw_launch_begin(struct tw_comm *comm, tw_stream_t user, cudaStream_t *launch);
/* Makes the caller's stream wait for the launch stream. */
tw_status_t tw_launch_end(struct tw_comm *comm, tw_stream_t user);

/* The message of a recorded device error (tw_comm_async_error's last_error): a flag wait that
 * expired, or (peer TW_ERR_PEER_PIPELINE) a stalled GEMM pipeline. */
void tw_err_block_format(const volatile tw_err_block_t *e, int wait_timeout_ms, char *buf,
                         size_t len);

#ifdef __cplusplus
}
#endif
#endif
