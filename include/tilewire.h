/*
 * tilewire: persistent CUDA kernels for Hopper (sm_90a) that fuse multi-GPU communication with
 * the compute it feeds, tile by tile, in one launch.
 *
 * The one public header. C11 and C++; needs no CUDA header. Every call returns a tw_status_t; on
 * failure tw_comm_last_error(comm) (or tw_last_error() for calls that take no comm) says which
 * argument, which rank and what was expected. Failures inside kernels (a peer that never
 * signalled) are reported by tw_comm_async_error().
 *
 * Threading: a comm may be used by one host thread at a time. Ops are stream-ordered and
 * CUDA-graph capturable: no host synchronisation inside a call, no per-call host reset of device
 * state.
 *
 * Size: the one public header the library promises, so it holds every op's contract.
 */
#ifndef TILEWIRE_H
#define TILEWIRE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define TW_API __attribute__((visibility("default")))
#else
#define TW_API
#endif

#define TW_VERSION_MAJOR 0
#define TW_VERSION_MINOR 1
#define TW_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH */
#define TW_VERSION_CODE (TW_VERSION_MAJOR * 10000 + TW_VERSION_MINOR * 100 + TW_VERSION_PATCH)

/* The most ranks one comm holds. */
#define TW_MAX_WORLD 64

/* Same type as cudaStream_t, declared here so callers need no CUDA header. */
struct CUstream_st;
typedef struct CUstream_st *tw_stream_t;

typedef enum tw_status {
  TW_SUCCESS = 0,
  TW_ERR_INVALID_ARGUMENT = 1,   /* a bad argument: the message names it */
  TW_ERR_NO_DEVICE = 2,          /* no CUDA driver or no CUDA device */
  TW_ERR_UNSUPPORTED_DEVICE = 3, /* the GPU is not sm_90 (Hopper) */
  TW_ERR_CUDA = 4,               /* a CUDA runtime or driver call failed */
  TW_ERR_OUT_OF_MEMORY = 5,      /* device memory or symmetric-heap space ran out */
  TW_ERR_SYSTEM = 6,             /* a system call or socket operation failed */
  TW_ERR_TIMEOUT = 7,            /* a host-side wait timed out (bootstrap: a rank never arrived) */
  TW_ERR_REMOTE = 8,             /* another rank failed and told us so */
  TW_ERR_DEVICE_TIMEOUT = 9,     /* a wait inside a kernel timed out: the comm is unusable */
  TW_ERR_NOT_SUPPORTED = 10,     /* valid request this build or configuration cannot serve */
  TW_ERR_INTERNAL = 11,          /* a bug in tilewire: please report the message */
  TW_ERR_ABORTED = 12,           /* a kernel gave up because another rank's wait timed out */
  TW_ERR_MISMATCH = 13,          /* ranks disagree on a collective call: the comm is unusable */
  TW_ERR_NETWORK = 14            /* an RDMA transfer to a rank on another node failed, or the
                                    rank stopped answering: the comm is unusable */
} tw_status_t;

/* A constant string naming the status. Never NULL. */
TW_API const char *tw_status_string(tw_status_t status);

/* Message of the last failed call made by this thread (any comm, or none). */
TW_API const char *tw_last_error(void);

/* TW_VERSION_CODE of the loaded library. */
TW_API int tw_version(void);

/* What the inter-node transport finds on this host, as text (the first line says which
 * rdma-core was loaded, and from where; one line per RDMA device follows: its name, kind (RC or
 * EFA SRD) and port state). TW_ERR_NOT_SUPPORTED, with the reason in buf, where rdma-core
 * cannot be loaded or libtilewire was built without its headers: ranks on other nodes then
 * cannot be reached, ranks of one node still work. */
TW_API tw_status_t tw_transport_info(char *buf, size_t len);

typedef struct tw_comm *tw_comm_t;

#define TW_UNIQUE_ID_BYTES 128
/* Opaque; made by tw_get_unique_id on one rank and handed to the others by the caller
 * (torch.distributed, MPI, a file). */
typedef struct tw_unique_id {
  char internal[TW_UNIQUE_ID_BYTES];
} tw_unique_id_t;

#define TW_CONFIG_VERSION 1
/* Comm configuration. Zero in a field means "default" (usually an env knob, see docs/ENV.md),
 * so a caller built against an older, shorter struct keeps working: the library reads only
 * `size` bytes. */
typedef struct tw_config {
  size_t size;      /* sizeof(tw_config_t) as the caller knows it */
  uint32_t version; /* TW_CONFIG_VERSION as the caller knows it */
  /* SMs each rank's kernels may occupy. 0: the device's SMs divided by the number of ranks
   * sharing the GPU (TW_SM_BUDGET overrides). */
  int32_t sm_budget;
  /* 0: ranks are grouped into nodes by host. > 0: virtual nodes of this many
   * consecutive ranks (TW_RANKS_PER_NODE), to exercise the inter-node path on one host. */
  int32_t ranks_per_node;
  /* Host-side bootstrap timeout in ms (0: TW_BOOTSTRAP_TIMEOUT_MS). */
  int32_t bootstrap_timeout_ms;
  /* Bound on every device-side wait in ms (0: TW_WAIT_TIMEOUT_MS). */
  int32_t wait_timeout_ms;
  int32_t reserved0;
  /* Virtual address space reserved for each rank's symmetric heap, bytes (0: TW_HEAP_BYTES).
   * Physical memory is taken only by tw_mem_alloc. */
  uint64_t heap_bytes;
} tw_config_t;

#define TW_CONFIG_INIT                                                                             \
  { sizeof(tw_config_t), TW_CONFIG_VERSION, 0, 0, 0, 0, 0, 0 }

/* Fills *cfg as TW_CONFIG_INIT does (for callers that cannot use the macro). */
TW_API tw_status_t tw_config_init(tw_config_t *cfg);

/* ---- comm lifetime ---------------------------------------------------- */

/* A comm's operations (collectives, fused ops) run one at a time, in the order they are
 * enqueued on the device: enqueue one comm's calls on one stream, or order the streams (as
 * with an NCCL communicator); every rank enqueues the same calls in the same order. Calls on
 * different comms may run at once. */

/* Creates an id and starts, in this process, the bootstrap root that the ranks of one
 * tw_comm_init_rank group meet at. */
TW_API tw_status_t tw_get_unique_id(tw_unique_id_t *id);

/* One process (or thread) per rank: joins the group of `world` ranks that meet at `id`. The
 * current CUDA device is the rank's device. Fails with TW_ERR_TIMEOUT, naming the missing ranks,
 * if not all arrive in time. */
TW_API tw_status_t tw_comm_init_rank(tw_comm_t *comm, int world, tw_unique_id_t id, int rank,
                                     const tw_config_t *cfg);

/* One process drives every rank: comms[r] is rank r on device devices[r]. A device may be named
 * several times: those ranks become virtual ranks sharing the GPU, each with an SM budget. cfg
 * may be NULL. */
TW_API tw_status_t tw_comm_init_all(tw_comm_t *comms, int world, const int *devices,
                                    const tw_config_t *cfg);

/* Frees everything the comm holds. Symmetric allocations still live are freed too. */
TW_API tw_status_t tw_comm_destroy(tw_comm_t comm);

/* ---- comm queries ----------------------------------------------------- */

TW_API tw_status_t tw_comm_rank(tw_comm_t comm, int *rank);
TW_API tw_status_t tw_comm_size(tw_comm_t comm, int *world);
TW_API tw_status_t tw_comm_device(tw_comm_t comm, int *device);
/* Rank inside its node, ranks in its node, node index, nodes; SMs its kernels may occupy. */
TW_API tw_status_t tw_comm_local_rank(tw_comm_t comm, int *local_rank);
TW_API tw_status_t tw_comm_local_size(tw_comm_t comm, int *local_size);
TW_API tw_status_t tw_comm_node(tw_comm_t comm, int *node);
TW_API tw_status_t tw_comm_nodes(tw_comm_t comm, int *nodes);
TW_API tw_status_t tw_comm_sm_budget(tw_comm_t comm, int *sm_budget);

/* Message of the last failed call on this comm ("" if none). Never NULL. */
TW_API const char *tw_comm_last_error(tw_comm_t comm);

/* Errors recorded by kernels: *async_status is TW_SUCCESS, or TW_ERR_DEVICE_TIMEOUT /
 * TW_ERR_ABORTED with the details (rank, op, flag, expected, seen) in tw_comm_last_error, or
 * TW_ERR_MISMATCH: the ranks called a collective with different ops, shapes, dtypes, buffers or
 * plans; the message names the op, the two ranks and the first field that differs, with both
 * values. Every rank of such a call returns without writing into a peer (except tw_ag_gemm's
 * copy-engine mode, whose enqueued copies still land in this rank's slot of the peers'
 * allocation at this rank's a_gathered offset). A timeout's message also names the ranks that
 * had not entered the call. Does not synchronise. */
TW_API tw_status_t tw_comm_async_error(tw_comm_t comm, tw_status_t *async_status);

/* ---- symmetric heap --------------------------------------------------- */

/* Collective: every rank of the comm calls it, in the same order, with the same size. Returns
 * this rank's pointer; the same allocation on peer p is reachable from this rank's kernels
 * through tw_mem_peer_ptrs(). With tw_comm_init_all one thread may call it for each comm in
 * turn. Contents are not initialised. */
TW_API tw_status_t tw_mem_alloc(tw_comm_t comm, size_t bytes, void **ptr);
/* Collective, like tw_mem_alloc. */
TW_API tw_status_t tw_mem_free(tw_comm_t comm, void *ptr);
/* Device array of `world` pointers: entry p is peer p's copy of the allocation holding ptr,
 * mapped in this rank's address space (offset applied: ptr may point inside the allocation).
 * Lives until tw_mem_free. */
TW_API tw_status_t tw_mem_peer_ptrs(tw_comm_t comm, const void *ptr,
                                    void *const **peer_ptrs_device);
/* The same, one peer, as a host value usable in this rank's kernels. */
TW_API tw_status_t tw_mem_peer_ptr(tw_comm_t comm, const void *ptr, int peer, void **peer_ptr);

/* ---- data types ------------------------------------------------------- */

typedef enum tw_dtype {
  TW_BF16 = 0,
  TW_FP16 = 1,
  TW_FP32 = 2,
} tw_dtype_t;

/* ---- ops -------------------------------------------------------------- */

/*
 * AllGather: recv (a symmetric allocation of world * bytes) on every rank
 * receives each rank's `bytes` of `send` at offset rank * bytes. send is
 * ordinary device memory (it may alias recv + rank * bytes). bytes must be a
 * multiple of 16 and both pointers 16-byte aligned. Persistent SM-driven
 * copy in chunks with per-chunk flags; uses at most the comm's SM budget.
 */
TW_API tw_status_t tw_allgather(tw_comm_t comm, const void *send, void *recv, size_t bytes,
                                tw_stream_t stream);

/* A barrier across all ranks of the comm, in stream order (device-side). */
TW_API tw_status_t tw_barrier(tw_comm_t comm, tw_stream_t stream);

/*
 * GEMM core, alone: C[M,N] = A[M,K] * B[N,K]^T, bf16 in, fp32 accumulate,
 * bf16 or fp32 out, all row-major with leading dimensions in elements.
 * Needs sm_90a. K and N multiples of 8; pointers and leading dimensions
 * 16-byte aligned; any M >= 1.
 */
typedef enum tw_tile_order {
  TW_TILE_ORDER_DEFAULT = 0, /* L2-friendly grouped raster */
  TW_TILE_ORDER_ROW_MAJOR = 1,
  TW_TILE_ORDER_ROTATED = 2 /* start at row block `rotate_start` and wrap */
} tw_tile_order_t;

#define TW_GEMM_ARGS_VERSION 3
/* Bytes of tw_gemm_args_t.workspace (version 3): enough for every split it may choose. */
#define TW_GEMM_WORKSPACE_BYTES ((size_t)9 << 20)
typedef struct tw_gemm_args {
  size_t size;        /* sizeof(tw_gemm_args_t) */
  uint32_t version;   /* TW_GEMM_ARGS_VERSION */
  tw_dtype_t c_dtype; /* TW_BF16 or TW_FP32; A and B are TW_BF16 */
  const void *a;
  const void *b;
  void *c;
  int64_t m, n, k;
  int64_t lda, ldb, ldc; /* 0: packed (k, k, n) */
  int32_t sm_count;      /* SMs to use; 0: all the device's */
  int32_t tile_order;    /* tw_tile_order_t */
  int64_t rotate_start;  /* with TW_TILE_ORDER_ROTATED: first row of the first tile */
  /* Version 2. K slices per output tile: 0 or 1 none (the default); 2, 4 or 8: that many CTAs
   * of a cluster each multiply a slice of K and their fp32 accumulators are summed in a fixed
   * tree order (deterministic, but not the bits of the unsplit product); -1: the
   * library splits where few tiles meet a long K (m x n of at most a few dozen 128 x 128
   * tiles) and the slices add CTAs streaming B, by the shape alone, so the same shape gives
   * the same bits under any sm_count.
   * Fewer slices where K has fewer 64-wide blocks than slices, or sm_count fewer SMs. */
  int32_t split_k;
  /* Version 3. Scratch for split_k -1 (NULL: none): device memory of workspace_bytes >=
   * TW_GEMM_WORKSPACE_BYTES, 256-byte aligned, zero before its first use (cudaMemset once;
   * every call leaves it zero again). Where -1 splits K (few tiles over a long K), the slices
   * then run as single CTAs on tiles of half the width (64 of B's rows) whose fp32 partials meet
   * in the workspace (the last slice of a tile to finish sums them in the cluster tree's order):
   * the same bits as without it, on twice the CTAs a cluster tree fits. Calls that may run at once
   * need workspaces of their own. Used only with split_k -1 (checked whenever given). */
  void *workspace;
  size_t workspace_bytes;
} tw_gemm_args_t;

#define TW_GEMM_ARGS_INIT                                                                          \
  {                                                                                                \
    sizeof(tw_gemm_args_t), TW_GEMM_ARGS_VERSION, TW_BF16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  \
        0, 0                                                                                       \
  }

TW_API tw_status_t tw_gemm_args_init(tw_gemm_args_t *args);
/* Standalone GEMM on the current device; errors go to tw_last_error(). */
TW_API tw_status_t tw_gemm(const tw_gemm_args_t *args, tw_stream_t stream);

/*
 * Grouped GEMM over group-major rows (an MoE layer's expert GEMMs), on the GEMM core:
 *   out[r, :] = a[r, :] * b[g]^T   for every row r of group g
 * Group g's rows are [offsets[g], offsets[g + 1]) of a and of out. `offsets` lives in device
 * memory and is read only by the kernel, so the call needs no host synchronisation and can be
 * captured in a CUDA graph while a kernel before it (a dispatch, a router) writes the offsets:
 * int32 [groups + 1], offsets[0] = 0, nondecreasing, every entry a multiple of 128 (each group's
 * rows padded to the 128-row tile; an empty group has equal offsets) and offsets[groups] <= m.
 * m is the bound the buffers are sized for; rows from offsets[groups] on are neither read nor
 * written. Every row of a group is computed, its padding rows too. Offsets that break the
 * contract give unspecified rows of out, never a fault or a write outside out. Each out row is
 * bitwise tw_gemm of that group's rows (fp32 accumulation in the same order).
 */
#define TW_GROUPED_GEMM_ARGS_VERSION 1
typedef struct tw_grouped_gemm_args {
  size_t size;        /* sizeof(tw_grouped_gemm_args_t) */
  uint32_t version;   /* TW_GROUPED_GEMM_ARGS_VERSION */
  tw_dtype_t c_dtype; /* out: TW_BF16 or TW_FP32; a and b are TW_BF16 */
  const void *a;      /* [m, k], row stride lda */
  const void *b;      /* [groups][n, k]: group g's [n, k] weights at row g * n, row stride ldb */
  void *out;          /* [m, n], row stride ldo */
  const int32_t *offsets; /* device memory, [groups + 1] (above) */
  int64_t m, n, k;
  int64_t groups;        /* 1 .. 65536 */
  int64_t lda, ldb, ldo; /* 0: packed (k, k, n) */
  int32_t sm_count;      /* SMs to use; 0: all the device's */
} tw_grouped_gemm_args_t;

#define TW_GROUPED_GEMM_ARGS_INIT                                                                  \
  {                                                                                                \
    sizeof(tw_grouped_gemm_args_t), TW_GROUPED_GEMM_ARGS_VERSION, TW_BF16, 0, 0, 0, 0, 0, 0, 0, 0, \
        0, 0, 0, 0                                                                                 \
  }

TW_API tw_status_t tw_grouped_gemm_args_init(tw_grouped_gemm_args_t *args);
/* The grouped GEMM on the current device; errors go to tw_last_error(). */
TW_API tw_status_t tw_grouped_gemm(const tw_grouped_gemm_args_t *args, tw_stream_t stream);

/*
 * The grouped GEMM's weight gradient (an MoE layer's expert weight gradients) on the GEMM core:
 *   out[g] = sum over the rows r of group g of a[r, :]^T * b[r, :]      [n, k] for every g
 * with the groups' rows [offsets[g], offsets[g + 1]) as tw_grouped_gemm's (device int32
 * [groups + 1], multiples of 128, offsets[groups] <= m; no host synchronisation, CUDA-graph
 * capturable). a: bf16 [m, n] (the gradient of the grouped GEMM's out, row stride lda), b: bf16
 * [m, k] (the grouped GEMM's a, row stride ldb), out: [groups][n, k] (c_dtype TW_FP32 or
 * TW_BF16), group g's at row g * n, row stride ldo (0: packed). Every row of a group counts,
 * its padding rows too: each must be zero in a or in b and finite in the other
 * (tw_moe_combine_backward zeroes expert_grad's). An empty group's out is zeros. Rows from
 * offsets[groups] on are not read. fp32 accumulation in a fixed order (bitwise repeatable).
 * workspace: 16-byte aligned device memory of at least tw_grouped_gemm_wgrad_workspace_size
 * bytes (the operands, transposed), used by this call only while it runs in stream order.
 * m is at most 2^31 - 257.
 */
TW_API tw_status_t tw_grouped_gemm_wgrad_workspace_size(int64_t m, int64_t n, int64_t k,
                                                        size_t *bytes);
TW_API tw_status_t tw_grouped_gemm_wgrad(const tw_grouped_gemm_args_t *args, void *workspace,
                                         size_t workspace_bytes, tw_stream_t stream);

/*
 * Forward attention (FlashAttention-style, one persistent launch), for one device, no comm:
 *   o[b, i, h, :] = sum_j softmax_j(softmax_scale * q[b, i, h, :] . k[b, j, h / g, :])
 *                   * v[b, j, h / g, :]            with g = heads_q / heads_kv (GQA / MQA)
 * Layouts are those of contiguous torch tensors (B, S, H, D), bf16: q and o
 * [batch, seq_q, heads_q, head_dim], k and v [batch, seq_kv, heads_kv, head_dim]; lse (fp32,
 * may be NULL) [batch, heads_q, seq_q], the natural-log sum of exp of each row's scaled scores
 * (what a ring step needs to merge partial results). head_dim 64 or 128; q, k, v and o 16-byte
 * aligned device memory of the current device, o overlapping no input.
 * causal: key j is visible to query i iff kv_offset + j <= q_offset + i, the offsets being the
 * global positions of row 0 of q and of k (0 and 0 for a whole sequence; a shard's starts for
 * ring attention). A row no key reaches (causal) gets o = 0 and lse = -inf.
 * softmax_scale 0: 1 / sqrt(head_dim). fp32 accumulation, P rounded to bf16 for P V, in a fixed
 * order: repeated calls give the same bits. sm_count: SMs to use (0: all).
 */
#define TW_ATTENTION_ARGS_VERSION 1
typedef struct tw_attention_args {
  size_t size;      /* sizeof(tw_attention_args_t) */
  uint32_t version; /* TW_ATTENTION_ARGS_VERSION */
  int32_t causal;   /* 0 or 1 */
  const void *q;    /* bf16 [batch, seq_q, heads_q, head_dim] */
  const void *k;    /* bf16 [batch, seq_kv, heads_kv, head_dim] */
  const void *v;    /* bf16 [batch, seq_kv, heads_kv, head_dim] */
  void *o;          /* bf16 [batch, seq_q, heads_q, head_dim] */
  float *lse;       /* fp32 [batch, heads_q, seq_q], 4-byte aligned, or NULL */
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
  int64_t q_offset, kv_offset; /* causal masking: 0 .. 2^62 */
  float softmax_scale;         /* > 0; 0: 1 / sqrt(head_dim) */
  int32_t sm_count;            /* SMs to use; 0: all the device's */
} tw_attention_args_t;

#define TW_ATTENTION_ARGS_INIT                                                                     \
  {                                                                                                \
    sizeof(tw_attention_args_t), TW_ATTENTION_ARGS_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
        0, 0.0f, 0                                                                                 \
  }

TW_API tw_status_t tw_attention_args_init(tw_attention_args_t *args);
/* Attention on the current device; errors go to tw_last_error(). */
TW_API tw_status_t tw_attention(const tw_attention_args_t *args, tw_stream_t stream);

/*
 * The backward of tw_attention (one device, no comm). With S = softmax_scale q k^T masked as the
 * forward's, P = exp(S - lse) and dsum_i = dout[i] . o[i]: dv = P^T dout, dk = softmax_scale dS^T
 * q, dq = softmax_scale dS k, dS = P (dout v^T - dsum); GQA: a kv head's dk, dv sum over its group.
 * Shapes, causal, offsets, softmax_scale as the forward's call. fp32 sums, P and dS rounded to
 * bf16 as GEMM operands, in a fixed order (no atomics: bitwise repeatable); rows no key reaches
 * add nothing. workspace: fp32 [batch, heads_q, seq_q], written. Device memory of the current
 * device, 16-byte aligned (lse, workspace 4); outputs overlap no input nor each other. Three
 * launches on `stream`, no host synchronisation. sm_count: SMs to use (0: all).
 * With dq_accum (version 2) the one-pass backward: dq's sums run in the kernel that computes dk
 * and dv (five GEMMs a block instead of seven) and are added into dq_accum by the memory system
 * in no fixed order, so dq is not bitwise repeatable (dk, dv still are) though within the same
 * tolerance; four launches (dq_accum zeroed among them).
 */
#define TW_ATTENTION_BACKWARD_ARGS_VERSION 2
typedef struct tw_attention_backward_args {
  size_t size;      /* sizeof(tw_attention_backward_args_t) */
  uint32_t version; /* TW_ATTENTION_BACKWARD_ARGS_VERSION */
  int32_t causal;   /* 0 or 1, as the forward's */
  const void *q;    /* bf16 [batch, seq_q, heads_q, head_dim] */
  const void *k;    /* bf16 [batch, seq_kv, heads_kv, head_dim] */
  const void *v;    /* bf16 [batch, seq_kv, heads_kv, head_dim] */
  const void *o;    /* bf16 [batch, seq_q, heads_q, head_dim]: the forward's output */
  const void *dout; /* bf16, o's shape: the gradient of o */
  const float *lse; /* fp32 [batch, heads_q, seq_q]: the forward's */
  void *dq;         /* bf16, q's shape, written */
  void *dk;         /* bf16, k's shape, written */
  void *dv;         /* bf16, v's shape, written */
  float *workspace; /* fp32 [batch, heads_q, seq_q], written */
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
  int64_t q_offset, kv_offset; /* as the forward's */
  float softmax_scale;         /* as the forward's; 0: 1 / sqrt(head_dim) */
  int32_t sm_count;            /* SMs to use; 0: all the device's */
  /* Version 2. NULL, or fp32 scratch of batch x heads_q x round_up(seq_q, 128) x head_dim
   * elements, 16-byte aligned, overlapping nothing else: the one-pass backward (above). */
  float *dq_accum;
} tw_attention_backward_args_t;

#define TW_ATTENTION_BACKWARD_ARGS_INIT                                                            \
  {                                                                                                \
    sizeof(tw_attention_backward_args_t), TW_ATTENTION_BACKWARD_ARGS_VERSION, 0, 0, 0, 0, 0, 0, 0, \
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0f, 0, 0                                             \
  }

TW_API tw_status_t tw_attention_backward_args_init(tw_attention_backward_args_t *args);
/* On the current device; errors go to tw_last_error(). */
TW_API tw_status_t tw_attention_backward(const tw_attention_backward_args_t *args,
                                         tw_stream_t stream);

/*
 * Ring (context-parallel) attention inside one node, one persistent launch a rank: each rank
 * holds a shard of seq_local rows of the sequence of every batch (q, k, v, o bf16
 * [batch, seq_local, heads, head_dim] as tw_attention's; lse fp32 [batch, heads_q, seq_local]
 * or NULL) and gets its queries' attention over the whole sequence (every rank's keys), causal
 * by global position. The kernel reads the peers' k and v in place over NVLink, so k and v must
 * be symmetric memory of comm (tw_mem_alloc, the same offsets on every rank); every rank passes
 * the same shapes, layout and causal. layout: TW_RING_CONTIGUOUS: rank r holds positions
 * [r S, (r + 1) S); TW_RING_ZIGZAG (S even): rank r holds chunks r and 2W - 1 - r of the 2W
 * chunks of S / 2 positions (rows [0, S/2) then [S/2, S)), which balances causal work. When the
 * call returns in stream order every peer has finished reading this rank's k and v. At most 8
 * ranks. Across nodes the k and v of the ranks on other nodes are first gathered into
 * `gathered` (tw_allgather's rail path), then read from there: the same bits as inside one node,
 * that transfer not yet overlapped with the attention. sm_count: SMs to use (0: the comm's
 * budget). fp32 accumulation in a fixed order: repeated calls give the same bits.
 */
#define TW_RING_CONTIGUOUS 0
#define TW_RING_ZIGZAG 1
#define TW_RING_ATTENTION_ARGS_VERSION 1
typedef struct tw_ring_attention_args {
  size_t size;      /* sizeof(tw_ring_attention_args_t) */
  uint32_t version; /* TW_RING_ATTENTION_ARGS_VERSION */
  int32_t causal;   /* 0 or 1 */
  const void *q;    /* bf16 [batch, seq_local, heads_q, head_dim] */
  const void *k;    /* bf16 [batch, seq_local, heads_kv, head_dim], symmetric */
  const void *v;    /* bf16 [batch, seq_local, heads_kv, head_dim], symmetric */
  void *o;          /* bf16 [batch, seq_local, heads_q, head_dim] */
  float *lse;       /* fp32 [batch, heads_q, seq_local], 4-byte aligned, or NULL */
  int64_t batch, heads_q, heads_kv, seq_local, head_dim;
  float softmax_scale; /* > 0; 0: 1 / sqrt(head_dim) */
  int32_t layout;      /* TW_RING_CONTIGUOUS or TW_RING_ZIGZAG */
  int32_t sm_count;    /* SMs to use; 0: the comm's budget */
  void *gathered;      /* across nodes: symmetric, 2 x world x k's bytes (else NULL, unread) */
} tw_ring_attention_args_t;

#define TW_RING_ATTENTION_ARGS_INIT                                                                \
  {                                                                                                \
    sizeof(tw_ring_attention_args_t), TW_RING_ATTENTION_ARGS_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0,   \
        0, 0, 0.0f, TW_RING_ZIGZAG, 0, 0                                                           \
  }

TW_API tw_status_t tw_ring_attention_args_init(tw_ring_attention_args_t *args);
/* Collective over comm (every rank calls); errors go to tw_last_error() and the comm. */
TW_API tw_status_t tw_ring_attention(tw_comm_t comm, const tw_ring_attention_args_t *args,
                                     tw_stream_t stream);

/*
 * The backward of tw_ring_attention (collective, one node): each rank passes its shard's q, k, v,
 * o, dout and lse (the forward's) and gets its shard's dq, dk, dv over the whole sequence
 * (tw_attention_backward's math). The kernels read the peers' q, k, v, dout, lse and dsum in place
 * (a rank's dk, dv from every rank's queries, its dq from every rank's keys; nothing is reduced
 * across ranks: deterministic), so those and workspace (fp32 [batch, heads_q, seq_local], written)
 * must be symmetric memory of comm; o, dq, dk, dv this rank's device memory. Shapes, causal,
 * layout, softmax_scale as the forward's, the same on every rank. When the call returns in stream
 * order every peer has finished reading this rank's buffers. sm_count 0: the comm's budget.
 * Across nodes the other nodes' ranks' q, k, v, dout, lse and dsum are first gathered into
 * `gathered` (tw_allgather's rail path; its bytes from the _gathered_bytes call), then read there.
 */
#define TW_RING_ATTENTION_BACKWARD_ARGS_VERSION 1
typedef struct tw_ring_attention_backward_args {
  size_t size;      /* sizeof(tw_ring_attention_backward_args_t) */
  uint32_t version; /* TW_RING_ATTENTION_BACKWARD_ARGS_VERSION */
  int32_t causal;   /* 0 or 1, as the forward's */
  const void *q;    /* bf16 [batch, seq_local, heads_q, head_dim], symmetric */
  const void *k;    /* bf16 [batch, seq_local, heads_kv, head_dim], symmetric */
  const void *v;    /* bf16 [batch, seq_local, heads_kv, head_dim], symmetric */
  const void *o;    /* bf16, q's shape: the forward's output */
  const void *dout; /* bf16, q's shape: the gradient of o, symmetric */
  const float *lse; /* fp32 [batch, heads_q, seq_local]: the forward's, symmetric */
  void *dq;         /* bf16, q's shape, written */
  void *dk;         /* bf16, k's shape, written */
  void *dv;         /* bf16, v's shape, written */
  float *workspace; /* fp32 [batch, heads_q, seq_local], symmetric, written */
  int64_t batch, heads_q, heads_kv, seq_local, head_dim;
  float softmax_scale; /* as the forward's; 0: 1 / sqrt(head_dim) */
  int32_t layout;      /* TW_RING_CONTIGUOUS or TW_RING_ZIGZAG, as the forward's */
  int32_t sm_count;    /* SMs to use; 0: the comm's budget */
  void *gathered;      /* across nodes: symmetric, tw_ring_attention_backward_gathered_bytes */
} tw_ring_attention_backward_args_t;

#define TW_RING_ATTENTION_BACKWARD_ARGS_INIT                                                       \
  {                                                                                                \
    sizeof(tw_ring_attention_backward_args_t), TW_RING_ATTENTION_BACKWARD_ARGS_VERSION, 0, 0, 0,   \
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0f, TW_RING_ZIGZAG, 0, 0                          \
  }

TW_API tw_status_t tw_ring_attention_backward_args_init(tw_ring_attention_backward_args_t *args);
/* The bytes of `gathered` for shards of these shapes on comm (0 inside one node). */
TW_API tw_status_t tw_ring_attention_backward_gathered_bytes(tw_comm_t comm, int64_t batch,
                                                             int64_t heads_q, int64_t heads_kv,
                                                             int64_t seq_local, int64_t head_dim,
                                                             size_t *bytes);
/* Collective over comm (every rank calls); errors go to tw_last_error() and the comm. */
TW_API tw_status_t tw_ring_attention_backward(tw_comm_t comm,
                                              const tw_ring_attention_backward_args_t *args,
                                              tw_stream_t stream);

/*
 * Fused AllGather + GEMM (the column-parallel linear layer):
 *   C[world * m_local, N] = gather(A)[world * m_local, K] * B[N, K]^T
 * Each rank holds its row shard `a` [m_local, K] (ordinary device memory, packed
 * rows; it may be a_gathered + rank * m_local * K, then nothing is copied for
 * the own shard), and `a_gathered`, a symmetric allocation (tw_mem_alloc) of at
 * least world * m_local * K bf16, which holds the gathered A after the call
 * (the backward pass needs it). One persistent launch per rank: communication
 * CTAs push the shard into every rank's a_gathered in row chunks with per-chunk
 * flags, then join the GEMM; compute CTAs start on the local shard (rank-rotated
 * tile order) and wait per tile only for the rows it reads. Collective: every
 * rank calls it with the same shapes. Where the gathered product has few output tiles over a
 * long K (decode shapes: where tw_gemm's split_k -1 would split it), the call is tw_allgather
 * then tw_gemm with split_k -1 instead; then, and at world 1, the result bits are that
 * pipeline's. Across nodes (nodes of as many ranks each) each shard crosses the network once
 * per node, to the rank of its local index there, which forwards it over NVLink; the copy
 * engine mode is refused there (TW_ERR_NOT_SUPPORTED) and AUTO takes the SMs. tw_allgather
 * moves its slots the same way.
 */
/* How tw_ag_gemm moves the shards. */
typedef enum tw_ag_comm_mode {
  TW_AG_COMM_SM = 0, /* communication CTAs push the shard, then join the GEMM */
  /* cudaMemcpyAsync on a side stream, each chunk followed by a stream-written flag, while
   * every CTA computes (no SMs spent on copies). Eager only: a stream under CUDA graph
   * capture is refused with TW_ERR_NOT_SUPPORTED (the flag values are fixed at enqueue). */
  TW_AG_COMM_COPY_ENGINE = 1,
  /* The default (TW_AG_GEMM_ARGS_INIT): the library chooses the copy engine or the SMs from the
   * shapes and the comm: the copy engine only on 2 ranks on GPUs of their own (one process or
   * one per GPU), where the push is a large share of the GEMM's estimated time, and never
   * under graph capture; else the SMs. Ranks decide alike, so they must all capture, or all
   * not. */
  TW_AG_COMM_AUTO = 2
} tw_ag_comm_mode_t;

#define TW_AG_GEMM_ARGS_VERSION 2
typedef struct tw_ag_gemm_args {
  size_t size;        /* sizeof(tw_ag_gemm_args_t) */
  uint32_t version;   /* TW_AG_GEMM_ARGS_VERSION */
  tw_dtype_t c_dtype; /* TW_BF16 or TW_FP32 */
  const void *a;      /* [m_local, K] bf16, this rank's shard */
  const void *b;      /* [N, K] bf16 */
  void *c;            /* [world * m_local, N] */
  void *a_gathered;   /* symmetric, [world * m_local, K] bf16 */
  int64_t m_local, n, k;
  int64_t ldb, ldc;  /* 0: packed (k, n) */
  int32_t comm_sms;  /* CTAs that push data before joining the GEMM; 0: heuristic */
  int32_t comm_mode; /* tw_ag_comm_mode_t */
  /* (version 2) 0: on return a_gathered holds the gathered A (the backward pass needs it).
   * 1: the caller does not need it: a_gathered only stages the call and afterwards holds
   * this rank's shard in its slot, the rest unspecified. Where every rank shares one GPU
   * (virtual ranks, processes under MPS) the GEMM then reads the peers' shards in place
   * from their slots instead of copying them. */
  int32_t no_gathered_out;
  int32_t reserved; /* 0 */
} tw_ag_gemm_args_t;

#define TW_AG_GEMM_ARGS_INIT                                                                       \
  {                                                                                                \
    sizeof(tw_ag_gemm_args_t), TW_AG_GEMM_ARGS_VERSION, TW_BF16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,     \
        TW_AG_COMM_AUTO, 0                                                                         \
  }

TW_API tw_status_t tw_ag_gemm_args_init(tw_ag_gemm_args_t *args);
TW_API tw_status_t tw_ag_gemm(tw_comm_t comm, const tw_ag_gemm_args_t *args, tw_stream_t stream);

/*
 * Fused GEMM + ReduceScatter / AllReduce (the row-parallel linear layer):
 * every rank holds a [m, k] and b [n, k] (bf16, row-major) and the product is
 *   S[m, n] = sum over ranks i of a_i * b_i^T   (fp32 accumulation throughout)
 * tw_gemm_rs: rank r receives rows [r * m / world, (r + 1) * m / world) of S as
 *   bf16 in `out` ([m / world, n], leading dimension ldo).
 * tw_gemm_ar: every rank receives all of S as bf16 in `out` ([m, n]).
 * m must be a multiple of world (any m / world >= 1); n and k multiples of 8.
 * The reduction order is fixed (rank 0, 1, ..., world - 1, in fp32), so results
 * are bitwise reproducible and equal tw_gemm (fp32 out) per rank followed by
 * that rank-ordered sum. `workspace` is a symmetric allocation (tw_mem_alloc)
 * of at least tw_gemm_rs_workspace_size() bytes, the same on every rank (not
 * needed when world == 1); `out` and the operands are ordinary device memory.
 * One persistent launch per rank: GEMM tiles are stored (fp32 by default) straight into
 * their owner's workspace and counted there; the owner's reduce CTAs sum each
 * tile once all ranks delivered it; tw_gemm_ar's owners then store their reduced rows
 * into every rank's workspace, from where each rank copies them into `out`. Collective:
 * every rank calls it with the same shapes; both ops take the same args struct.
 * Decode shapes (on ranks with GPUs of their own tw_gemm_rs at m <= 512 and tw_gemm_ar at
 * m <= 256; where ranks share a GPU, small and short-K shapes the plan picks): where the
 * workspace holds it, the call runs the unfused pipeline instead, tw_gemm of the whole
 * partial into the workspace, then a reduce kernel that sums this rank's rows in rank order
 * (tw_gemm_ar: and hands them to every rank); the same bits.
 * Direct scheme (on 2 ranks on distinct GPUs at m < 128, and with bf16 partials at m <= 4096
 * with K >= 4096): where the workspace holds world * m * n partials (4 or 2 bytes each),
 * tw_gemm_ar stores every tile into every rank's workspace and each rank reduces all of S
 * itself (one hop, no gather phase); the same bits.
 * Across nodes (a comm whose ranks sit on several nodes of as many ranks each, at most 8 ranks
 * in all): the sum's order is hierarchical, each node's ranks in rank order, then the nodes'
 * sums in node order (fp32), so the result equals tw_gemm per rank followed by that sum. Each
 * node's partials of a rank's rows are summed inside the node and cross the network once, to
 * that rank, from the rank of its local index; tw_gemm_ar's rows travel back the same way. The
 * workspace is larger there (tw_gemm_rs_workspace_size on that comm; a smaller one is refused)
 * and out_symmetric is ignored.
 * partials = TW_PARTIALS_BF16 (version 2): each rank's partial product is rounded
 * to bf16 before it travels (as the cuBLAS bf16 output of the usual unfused
 * pipeline is), then summed in fp32 in rank order: half the NVLink bytes and
 * staging reads of the fp32 default, and more exact than an NCCL bf16 reduction
 * (which rounds to bf16 between hops). The result then equals, bitwise, tw_gemm
 * with bf16 output per rank followed by the rank-ordered fp32 sum. Every rank must
 * pass the same value.
 */
typedef enum tw_partials {
  TW_PARTIALS_FP32 = 0, /* default: fp32 partials, fp32 sum */
  TW_PARTIALS_BF16 = 1  /* bf16 partials, fp32 sum */
} tw_partials_t;

#define TW_GEMM_RS_ARGS_VERSION 3
typedef struct tw_gemm_rs_args {
  size_t size;          /* sizeof(tw_gemm_rs_args_t) */
  uint32_t version;     /* TW_GEMM_RS_ARGS_VERSION */
  tw_dtype_t out_dtype; /* TW_BF16 */
  const void *a;        /* [m, k] bf16 */
  const void *b;        /* [n, k] bf16 */
  void *out;            /* rs: [m / world, n]; ar: [m, n] */
  void *workspace;      /* symmetric, >= tw_gemm_rs_workspace_size() bytes */
  int64_t m, n, k;
  int64_t lda, ldb, ldo; /* 0: packed (k, k, n) */
  /* CTAs that start on the reduction, fewer than the rank's SM budget; 0: heuristic; ranks may
   * differ. On 2 ranks the plan may instead reduce each rank's own tiles in the GEMM's
   * epilogue, with no reduce CTAs (fp32 partials, K < 4096, at least 3 waves of tiles): a
   * nonzero value keeps tw_gemm_rs's reduce CTAs there, while tw_gemm_ar ignores it there,
   * since that choice must be the same on every rank and this field may differ by rank. */
  int32_t reduce_sms;
  int32_t partials; /* (version 2; 0 before) tw_partials_t: TW_PARTIALS_FP32 (0) */
  /* (version 3; 0 before) tw_gemm_ar: 1 when `out` is one symmetric allocation (the same
   * tw_mem_alloc on every rank, at least (m - 1) * ldo + n bf16): each owner then writes its
   * reduced rows straight into every rank's out, and no rank copies them (the workspace's bf16
   * area goes unused). Every rank must pass the same value. tw_gemm_rs
   * ignores it. */
  int32_t out_symmetric;
  int32_t reserved; /* 0 */
} tw_gemm_rs_args_t;

#define TW_GEMM_RS_ARGS_INIT                                                                       \
  {                                                                                                \
    sizeof(tw_gemm_rs_args_t), TW_GEMM_RS_ARGS_VERSION, TW_BF16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  \
        0, 0, 0                                                                                    \
  }

TW_API tw_status_t tw_gemm_rs_args_init(tw_gemm_rs_args_t *args);
/* Workspace bytes tw_gemm_rs and tw_gemm_ar need on this comm for an m x n product
 * (world * (m / world) * n * 6: fp32 staging, then every owner's bf16 rows for tw_gemm_ar;
 * on 2 ranks with m < 128 at least 2 * m * n * 4, the direct scheme's fp32 staging; across
 * nodes about 2 m n 4 + 2 nodes (m / world) n 4 + m n 2: the staging, the unfused pipeline's
 * partial, the node partials in and out, the gathered rows).
 * A smaller workspace of at least world * (m / world) * n * 4 + (m / world) * n * 2 bytes
 * still works; tw_gemm_ar then has every rank load the owners' rows from the owners' workspaces
 * instead of receiving them into its own. */
TW_API tw_status_t tw_gemm_rs_workspace_size(tw_comm_t comm, int64_t m, int64_t n, size_t *bytes);
TW_API tw_status_t tw_gemm_rs(tw_comm_t comm, const tw_gemm_rs_args_t *args, tw_stream_t stream);
TW_API tw_status_t tw_gemm_ar(tw_comm_t comm, const tw_gemm_rs_args_t *args, tw_stream_t stream);

/*
 * MoE expert parallelism: the token dispatch and the weighted combine, routed on the GPU from
 * topk_idx (no host synchronisation, CUDA-graph capturable), inside a node and (dispatch and
 * combine, and the fused dispatch + GEMM) across nodes. `experts` experts are
 * placed in contiguous blocks: rank r holds experts [r * E / world, (r + 1) * E / world)
 * (experts a multiple of world), its local experts.
 *
 * tw_moe_dispatch: every (token t, slot j) with topk_idx[t][j] = e >= 0 copies x[t] into the
 * recv buffer of e's rank, expert-major: each local expert's rows start at a multiple of 128
 * (offsets[e_local], written for tw_grouped_gemm), inside an expert by source rank, inside a
 * source in token order (so every call with the same routing lays out the same rows). A slot of -1
 * sends nothing; a token's slots name distinct experts. Rows past an expert's live rows up to the
 * next multiple of 128 are left as they were (the grouped GEMM computes them; combine never reads
 * them). The call returns (in stream order) once every rank's rows have landed in this rank's recv.
 * Routing that needs more than recv_rows rows at some rank, or an expert index outside [-1,
 * experts), is found on the device: then no rank copies anything and tw_comm_async_error reports
 * TW_ERR_INVALID_ARGUMENT naming the rank and what it needed (the comm is then unusable).
 * tw_moe_combine: out[t] = sum over slots j in order of topk_weights[t][j] * y[row of (t, j)],
 * fp32, rounded to bf16 once, where y (expert_out) holds the experts' outputs in recv's layout on
 * every rank, read in place from the experts' ranks. It uses the routing the last
 * tw_moe_dispatch of the same workspace recorded, with the same tokens and topk_idx; every rank
 * calls it after its expert GEMM, and each rank's next dispatch waits until every rank's combine
 * has read its expert_out.
 * Across nodes (a comm of several nodes with as many ranks each): a token crosses the network
 * once per node that holds one of its experts, to the rank of its rank's local index there,
 * which forwards it over NVLink; recv and offsets are exactly as inside a node. The combine
 * sums, on each node, the slots it holds in slot order (fp32), rounds that partial to bf16 and
 * sends it back; out[t] = t's own node's slots in slot order, then each other node's partial
 * in node order, fp32, rounded once. The fused calls run there too: tw_moe_dispatch_gemm (the
 * same dispatch, its GEMM tiles waiting for their rows as inside a node), tw_moe_gemm_combine
 * (the same GEMM, the combine's partials of a row once its row blocks are complete) and
 * tw_moe_ffn (both); their results are bitwise those of the unfused calls across nodes.
 * tw_moe_combine_backward runs there too: each token's gradient row crosses to each other
 * node that holds one of its experts once, with its weights, on the same rail; that node writes
 * the expert_grad rows and computes the weights_grad sums of its slots and sends them back.
 * expert_grad and weights_grad are bitwise those of a one-node call.
 */
#define TW_MOE_ARGS_VERSION 3
typedef struct tw_moe_args {
  size_t size;               /* sizeof(tw_moe_args_t) */
  uint32_t version;          /* TW_MOE_ARGS_VERSION */
  int32_t index_bits;        /* topk_idx's integers: 32 or 64 */
  const void *x;             /* dispatch: bf16 [tokens, hidden] */
  const void *topk_idx;      /* [tokens, top_k] global expert ids, -1 for an unused slot */
  const float *topk_weights; /* combine: fp32 [tokens, top_k] */
  void *recv;                /* dispatch: symmetric bf16 [recv_rows, hidden] */
  int32_t *offsets;          /* dispatch: device int32 [local experts + 1], written */
  const void *expert_out;    /* combine: symmetric bf16 [recv_rows, n_out] */
  void *out;                 /* combine: bf16 [tokens, n_out] */
  void *workspace;           /* symmetric, tw_moe_workspace_size bytes, alike on every rank */
  int64_t tokens;            /* this rank's tokens, 0 .. max_tokens (ranks may differ) */
  int64_t max_tokens;        /* the bound on tokens per rank, alike on every rank */
  int64_t hidden;            /* a multiple of 8 */
  int64_t n_out;             /* combine: expert_out's and out's columns, a multiple of 8 */
  int64_t experts, top_k;    /* experts a multiple of world, <= 1024; top_k 1 .. 16 */
  int64_t recv_rows;         /* rows of every rank's recv (and expert_out) */
  /* tw_moe_dispatch_gemm: bf16 [local experts][n_out, hidden], this rank's experts' weights
   * (the grouped GEMM's b); expert_out is then its output (device memory of this rank).
   * tw_moe_ffn: bf16 [local experts][2 inter, hidden], each expert's gate rows then its up rows */
  const void *weights;
  /* (version 2; absent before) tw_moe_ffn only */
  const void *weights2; /* bf16 [local experts][hidden, inter]: the down projection */
  void *h;              /* bf16 [recv_rows, 2 inter], this rank's device memory: gate | up */
  void *act;            /* bf16 [recv_rows, inter], this rank's device memory: tw_swiglu(h) */
  int64_t inter;        /* the experts' intermediate size, a positive multiple of 8 */
  /* (version 3; absent before) tw_moe_combine_backward only */
  const void *grad;    /* bf16 [tokens, n_out]: the gradient of the combine's out */
  void *expert_grad;   /* symmetric bf16 [recv_rows, n_out]: the gradient of expert_out, written */
  float *weights_grad; /* fp32 [tokens, top_k]: the gradient of topk_weights, written (NULL:
                          not computed) */
} tw_moe_args_t;

#define TW_MOE_ARGS_INIT                                                                           \
  {                                                                                                \
    sizeof(tw_moe_args_t), TW_MOE_ARGS_VERSION, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,   \
        0, 0, 0, 0, 0, 0, 0, 0                                                                     \
  }

TW_API tw_status_t tw_moe_args_init(tw_moe_args_t *args);
/* Workspace bytes of the MoE calls on this comm (one workspace serves a dispatch and the combine
 * that follows it, fused or not). hidden: the widest row the calls move (the dispatches' hidden,
 * the combines' n_out); across nodes the workspace stages the rows sent to each node, so a
 * call wider than it is refused naming args->workspace, and 0 is refused; inside one node it is
 * not read (0 is fine). */
TW_API tw_status_t tw_moe_workspace_size(tw_comm_t comm, int64_t max_tokens, int64_t hidden,
                                         int64_t experts, int64_t top_k, size_t *bytes);
TW_API tw_status_t tw_moe_dispatch(tw_comm_t comm, const tw_moe_args_t *args, tw_stream_t stream);
TW_API tw_status_t tw_moe_combine(tw_comm_t comm, const tw_moe_args_t *args, tw_stream_t stream);
/* tw_moe_dispatch and tw_grouped_gemm of each rank's local experts over its recv, in one
 * persistent kernel: each 128-row tile of an expert starts as soon as every row of its block
 * has landed (the copies run in the order the GEMM consumes them, this rank's own tokens
 * first). recv, offsets and expert_out's live rows are bitwise those of tw_moe_dispatch then
 * tw_grouped_gemm (b = weights, out = expert_out, m = recv_rows, n = n_out, k = hidden). */
TW_API tw_status_t tw_moe_dispatch_gemm(tw_comm_t comm, const tw_moe_args_t *args,
                                        tw_stream_t stream);
/* tw_grouped_gemm of each rank's local experts (a = recv: rows in the layout of the last
 * tw_moe_dispatch of this workspace, e.g. the experts' activations; b = weights; offsets as
 * that dispatch wrote them; out = expert_out, symmetric) and tw_moe_combine in one persistent
 * kernel: each token is combined as soon as the row blocks of its slots' rows are complete on
 * their ranks. expert_out's live rows and out are bitwise tw_grouped_gemm then tw_moe_combine.
 * x is not read. */
TW_API tw_status_t tw_moe_gemm_combine(tw_comm_t comm, const tw_moe_args_t *args,
                                       tw_stream_t stream);
/* The expert FFN of an MoE layer in one persistent kernel: the dispatch of x; h = recv x
 * weights^T (gate and up); act = tw_swiglu(h); expert_out = act x weights2^T (the down
 * projection, n = hidden); the combine of expert_out into out [tokens, hidden]. Each stage's
 * row block starts once the one before has finished it: a gate/up tile when its block's rows
 * landed, a block's SwiGLU when its gate/up tiles are stored, a down tile when its block's act
 * is, a token when its slots' down rows are, on their ranks. recv, offsets, h, act and
 * expert_out's live rows and out are bitwise tw_moe_dispatch, tw_grouped_gemm, tw_swiglu,
 * tw_grouped_gemm and tw_moe_combine. n_out is not read. recv and expert_out [recv_rows,
 * hidden] are symmetric; h and act are this rank's device memory. */
TW_API tw_status_t tw_moe_ffn(tw_comm_t comm, const tw_moe_args_t *args, tw_stream_t stream);
/*
 * tw_moe_combine_backward: the backward of tw_moe_combine over the routing the last
 * tw_moe_dispatch of the workspace recorded (the forward's). For every (token t, slot j) with
 * an expert, y = expert_out and g = grad:
 *   expert_grad[row of (t, j)] = bf16(topk_weights[t][j] * g[t])        on the expert's rank
 *   weights_grad[t][j] = sum over c of g[t][c] * y[row of (t, j)][c]    fp32, in column order,
 *                                                                       y read in place there
 * and weights_grad[t][j] = 0 for a slot of -1. On every rank the rows of expert_grad in
 * [0, offsets[local experts]) that hold no (t, j) (each expert's padding up to its multiple of
 * 128) are zeroed, so tw_grouped_gemm_wgrad may read them. The call returns (in stream order)
 * once every rank's rows have landed in this rank's expert_grad. expert_out must still hold
 * the forward's rows on every rank. It comes after the forward's tw_moe_combine (or
 * tw_moe_gemm_combine, tw_moe_ffn) of the workspace and before its next dispatch; a
 * tw_moe_combine of the same routing may follow it (the dispatch's backward: the combine of
 * recv's gradient with topk_weights all 1). Reads topk_idx, topk_weights, grad, expert_out
 * (n_out columns); x, recv and the weights are not read.
 */
TW_API tw_status_t tw_moe_combine_backward(tw_comm_t comm, const tw_moe_args_t *args,
                                           tw_stream_t stream);
/* act[r][i] = bf16(silu(g) * u) for g = h[r][i], u = h[r][inter + i], in fp32 with silu(g) =
 * g / (1 + expf(-g)): the step between an expert's gate/up and down GEMMs (tw_moe_ffn's, the
 * same bits). h bf16 [rows, 2 inter], act bf16 [rows, inter], both 16-byte aligned device
 * memory, inter a positive multiple of 8. */
TW_API tw_status_t tw_swiglu(const void *h, void *act, int64_t rows, int64_t inter,
                             tw_stream_t stream);

/* ---- environment knobs ------------------------------------------------ */

/* Number of TW_* environment knobs, and the i-th one's name, type, default,
 * current value (as the library reads it) and description: every knob, the user settings
 * of docs/ENV.md and the developer switches of docs/ENV-DEV.md alike. */
TW_API int tw_env_count(void);
TW_API tw_status_t tw_env_describe(int index, const char **name, const char **type,
                                   const char **default_value, const char **current_value,
                                   const char **description);

#ifdef __cplusplus
}
#endif
#endif /* TILEWIRE_H */
