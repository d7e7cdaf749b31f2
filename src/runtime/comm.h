/*
 * The comm: one rank's view of the group. Ranks driven by one process (all of
 * them with tw_comm_init_all, one with tw_comm_init_rank) share a tw_group_t
 * that owns the symmetric heap's address space and the allocation list.
 *
 * Symmetric heap layout, the same in every process: one virtual range of
 * world * heap_va bytes; rank r's heap lives at va_base + r * heap_va. An
 * allocation has the same offset in every rank's heap, so peer p's copy of a
 * local pointer is va_base + p * heap_va + offset. Physical memory (cuMemCreate
 * on the rank's GPU) is mapped at the rank's own slot; ranks of other
 * processes on the same host are mapped there too, from POSIX fds passed over
 * unix sockets. Offset 0 holds the rank's control block (tw_ctrl_t).
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
#include "runtime/devcomm.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_alloc {
  struct tw_alloc *next;
  uint64_t seq;                                      /* allocation number, the same on every rank */
  size_t offset;                                     /* in every rank's heap */
  size_t size;                                       /* rounded to the granularity */
  size_t bytes;                                      /* as asked */
  CUmemGenericAllocationHandle handle[TW_MAX_WORLD]; /* mapped in this process; 0 = none */
  uint8_t mapped[TW_MAX_WORLD];
  uint8_t freed[TW_MAX_WORLD];     /* local ranks that called tw_mem_free */
  void **peer_table[TW_MAX_WORLD]; /* per local rank: device array of world peer pointers */
} tw_alloc_t;

typedef struct tw_free_range {
  size_t offset, size;
} tw_free_range_t;

#define TW_MAX_FREE_RANGES 4096

typedef struct tw_group {
  pthread_mutex_t mu;
  int world;
  int nlocal;                          /* ranks driven by this process */
  int live;                            /* local comms not yet destroyed */
  struct tw_comm *local[TW_MAX_WORLD]; /* by rank; NULL for ranks of other processes */
  uint8_t mappable[TW_MAX_WORLD];      /* rank's memory can be mapped here (same host) */
  int device_of[TW_MAX_WORLD];         /* CUDA device of local ranks, -1 otherwise */
  tw_bootstrap_t *bs;                  /* NULL when every rank is in this process */
  CUdeviceptr va_base;
  size_t heap_va;
  size_t granularity;
  size_t bump;
  tw_free_range_t free_ranges[TW_MAX_FREE_RANGES];
  int nfree;
  tw_alloc_t *allocs;
} tw_group_t;

struct tw_comm {
  tw_group_t *group;
  int rank, world, device;
  int local_rank, local_size, node, nodes;
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
   * init; TW_AG_GEMM_WS) */
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

/* Peer p's address for a pointer inside this rank's heap, or NULL if p's memory is
 * not mapped here. *offset_out (optional) is the offset in the heap. */
void *tw_heap_peer_ptr(const struct tw_comm *comm, const void *local_ptr, int peer);

/* Finds the allocation holding [ptr, ptr+bytes) in this rank's heap. */
/* Bytes from ptr to the end of its symmetric allocation on this rank; 0 if none holds it. */
size_t tw_heap_avail(const struct tw_comm *comm, const void *ptr);
tw_status_t tw_heap_lookup(const struct tw_comm *comm, const void *ptr, size_t bytes,
                           const char *arg_name, tw_alloc_t **alloc_out);

/* Heap internals (heap.c), called with the group lock held. */
tw_status_t tw_heap_group_init(tw_group_t *g, size_t heap_va);
void tw_heap_group_fini(tw_group_t *g);
tw_status_t tw_heap_alloc_locked(struct tw_comm *comm, size_t bytes, void **ptr);
tw_status_t tw_heap_free_locked(struct tw_comm *comm, void *ptr);
void tw_heap_free_all_locked(struct tw_comm *comm);

/* Fills node, nodes, local_rank, local_size of comm (rank and world set) from
 * the ranks' host hashes, or virtual nodes of ranks_per_node ranks when > 0. */
void tw_assign_nodes(struct tw_comm *comm, const uint64_t *host_of, int ranks_per_node);

/* Fills ranks_on_device and gpu_shared of comm (rank and world set) from every rank's host
 * hash and GPU UUID: ranks of one host whose UUIDs match share a GPU. */
void tw_assign_gpus(struct tw_comm *comm, const uint64_t *host_of, const uint8_t (*uuid)[16],
                    const int *sm_count, const int *sm_budget_cfg);
/* The values of the knobs that fix how ranks number, store or fetch each other's data
 * (TW_RS_BAND, TW_RS_GROUP_UNITS, TW_AR_PUSH, ...), in a fixed order, into knobs[0,
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
tw_status_t tw_launch_begin(struct tw_comm *comm, tw_stream_t user, cudaStream_t *launch);
/* Makes the caller's stream wait for the launch stream. */
tw_status_t tw_launch_end(struct tw_comm *comm, tw_stream_t user);

/* Loads every tilewire kernel on the current device. With CUDA's lazy module
 * loading, the first launch of a kernel may wait for the device to go idle; if a
 * persistent kernel is then spinning for a peer whose kernel is that first
 * launch, nothing moves until the wait bound. Loading everything at comm init
 * removes that. Each op file provides its tw_<op>_preload. */
tw_status_t tw_preload_kernels(void);
tw_status_t tw_allgather_preload(void);
tw_status_t tw_gemm_preload(void);
tw_status_t tw_ag_gemm_preload(void);

/* The message of a recorded device error (tw_comm_async_error's last_error): a flag wait that
 * expired, or (peer TW_ERR_PEER_PIPELINE) a stalled GEMM pipeline. */
void tw_err_block_format(const volatile tw_err_block_t *e, int wait_timeout_ms, char *buf,
                         size_t len);

/* Makes `device` current; returns the previous one in *prev. */
tw_status_t tw_set_device(int device, int *prev);

#ifdef __cplusplus
}
#endif
#endif
