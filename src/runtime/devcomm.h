/*
 * State shared between the host runtime and the kernels (plain C, included by
 * .c and .cu files).
 *
 * Each rank owns a control block (tw_ctrl_t) at offset 0 of its symmetric
 * heap, so peers reach it through the same peer-pointer arithmetic as data.
 * Flags are 64-bit and monotone: a producer sets a flag to the call's epoch
 * (never adds), a consumer waits until flag >= epoch. Epochs are per op
 * channel, kept in device memory and advanced by the kernels themselves, so
 * no host reset is ever needed and CUDA graph replays stay correct.
 */
#ifndef TW_RUNTIME_DEVCOMM_H
#define TW_RUNTIME_DEVCOMM_H

#include <stdint.h>

#include "tilewire.h"
#include "transport/fifo.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One channel per op family: each has its own epoch and flag slice, so calls
 * of different ops interleave freely. */
typedef enum tw_channel {
  TW_CH_BARRIER = 0,
  TW_CH_ALLGATHER = 1,
  TW_CH_AG_GEMM = 2,
  TW_CH_GEMM_RS = 3,
  TW_CH_GEMM_AR = 4,
  TW_CH_MOE = 5,
  TW_CH_ATTN = 6,
  TW_CH_TEST = 7,       /* tests that drive the primitives directly */
  TW_CH_AG_GEMM_CE = 8, /* tw_ag_gemm, copy-engine mode: epochs counted on the host */
  TW_NUM_CHANNELS = 9
} tw_channel_t;

/* Flags per channel a kernel may use for its data (chunk/tile flags). */
#define TW_CHANNEL_FLAGS 16384

/* What a collective call must have alike on every rank (runtime/calldesc.h builds it): the op's
 * channel and up to TW_CALL_FIELDS values (shapes, dtypes, symmetric buffers as heap offsets,
 * the plan's choices that fix the exchange), named by the op's registry entry, and their
 * digest. digest 0: a call with nothing to compare (tw_barrier, the tests' channel). */
#define TW_CALL_FIELDS 8
typedef struct tw_call_desc {
  uint64_t digest; /* of op, nfields and field[]; never 0 for a described call */
  uint32_t op;     /* tw_channel_t */
  uint32_t nfields;
  uint64_t field[TW_CALL_FIELDS];
} tw_call_desc_t;

typedef struct tw_ctrl {
  uint64_t epoch[TW_NUM_CHANNELS];      /* local: calls completed on the channel */
  uint32_t exit_count[TW_NUM_CHANNELS]; /* local: CTAs done with the current call */
  uint32_t abort;                       /* set (remotely too) once any rank timed out */
  uint32_t err_claim;                   /* local: first error wins */
  uint64_t ll_seq; /* local: calls that exchanged rows through the low-latency area (comm.h) */
  /* entry[ch][src] = epoch: rank src has entered call `epoch` on channel ch,
   * so everything before it in src's stream (reads of its buffers) is done. */
  uint64_t entry[TW_NUM_CHANNELS][TW_MAX_WORLD];
  /* done[ch][src] = epoch: rank src finished reading what this rank exposed
   * in call `epoch` (used by pull-based ops before the owner may reuse it). */
  uint64_t done[TW_NUM_CHANNELS][TW_MAX_WORLD];
  uint64_t flags[TW_NUM_CHANNELS][TW_CHANNEL_FLAGS];
  /* peer_out[ch][src] = {address, row stride in elements} of rank src's out in its current call
   * on ch, stored by src before its entry signal (tw_gemm_ar's peer outs: ranks of one process
   * on one GPU, TW_AR_PEER_OUT). */
  uint64_t peer_out[TW_NUM_CHANNELS][TW_MAX_WORLD][2];
  /* Tile queues of the fused GEMMs ({next ticket, finished CTAs}); zero between calls. */
  uint32_t tile_queue[TW_NUM_CHANNELS][2];
  /* call_digest[ch][src]: the digest of rank src's current call on ch, stored by src before its
   * entry signal (tw_signal_entry); the waits for src's entry compare it with this rank's. */
  uint64_t call_digest[TW_NUM_CHANNELS][TW_MAX_WORLD];
  /* current[src] = epoch << 8 | (ch + 1): the last call rank src entered (tw_signal_current). A
   * rank waiting for src's entry on another channel finds there that src's calls went another
   * way (a call it has not made itself). */
  uint64_t current[TW_MAX_WORLD];
  /* ll_call[src] = {digest, flag}: rank src's current exchange through the low-latency area, the
   * flag its words carry (tw_ll_flag), stored by src at its start (tw_ll_announce); a word that
   * is slow to come is checked against it (tw_ll_wait), whatever the peer's layout of the area. */
  uint64_t ll_call[TW_MAX_WORLD][2];
  /* local: this rank's current (or last) call on each channel, whole, stored by its kernel at
   * entry: on a mismatch every rank's host reads its own and the peer's to name the field. */
  tw_call_desc_t call[TW_NUM_CHANNELS];
  /* net_flags[i]: the flag words ranks on other nodes set after their RDMA writes into this
   * rank land (transport/net.h: the ib backend's flag writes target them; the efa backend keeps
   * its flags in host memory instead, tw_dev_comm_t.net_flags). */
  uint64_t net_flags[TW_NUM_CHANNELS][TW_NET_CH_FLAGS];
} tw_ctrl_t;
#ifdef __cplusplus
static_assert(TW_NET_FLAGS == TW_NUM_CHANNELS * TW_NET_CH_FLAGS, "net flags per channel");
#else
_Static_assert(TW_NET_FLAGS == TW_NUM_CHANNELS * TW_NET_CH_FLAGS, "net flags per channel");
#endif

/* Written by the first kernel wait that fails; host-mapped pinned memory so
 * the host can read it even after the kernel died. `status` is written last. */
/* tw_err_block_t.peer of an internal stall: an mbarrier wait of the GEMM pipeline expired. */
#define TW_ERR_PEER_PIPELINE (-3)
/* tw_err_block_t.peer of a routing error tw_moe_dispatch found on the device (status
 * TW_ERR_INVALID_ARGUMENT, what = the rank concerned): an expert index outside the range
 * (expected = the index, seen = the (token, slot) entry), or a rank whose experts need more rows
 * than recv_rows (expected = the rows needed, seen = recv_rows). */
#define TW_ERR_PEER_MOE_INDEX (-4)
#define TW_ERR_PEER_MOE_CAPACITY (-5)

typedef struct tw_err_block {
  volatile uint32_t status; /* tw_status_t; 0 = no error */
  int32_t rank;             /* rank whose wait failed */
  int32_t op;               /* tw_channel_t of the op */
  int32_t peer;             /* rank expected to signal, -1 if unknown; TW_ERR_PEER_PIPELINE:
                               a GEMM pipeline stall (what = the GEMM core's stuck code) */
  uint64_t flag_offset;     /* flag address minus the waiter's ctrl base (or raw address) */
  uint64_t flag_addr;
  uint64_t expected;
  uint64_t seen;
  int32_t block; /* blockIdx.x of the waiter */
  int32_t what;  /* op-specific: chunk or tile index */
} tw_err_block_t;
/* TW_ERR_MISMATCH: peer = the rank whose call differs, expected / seen = this rank's / its
 * digest, op = the channel of this rank's call. */

/* Where the ranks sit across nodes, for the ops' rail paths (device/rail.cuh; filled by
 * tw_comm_rail, runtime/comm_net.h): nodes of local_size ranks each; a rank's rail peers are
 * the ranks of its local index on the other nodes. */
#define TW_RAIL_MAX_NODES 16
#define TW_RAIL_MAX_CHUNKS 120 /* per rank: net flags (node, chunk) of a channel */
typedef struct tw_rail {
  int32_t nodes, node, local, local_size;
  int16_t rail[TW_RAIL_MAX_NODES];  /* node n's rank of this rank's local index */
  int16_t local_rank[TW_MAX_WORLD]; /* this node's ranks by local index */
  int8_t node_of[TW_MAX_WORLD];     /* every rank's node */
  int8_t local_of[TW_MAX_WORLD];    /* every rank's local index */
} tw_rail_t;

/* Everything a kernel needs to signal and wait, passed by value. */
typedef struct tw_dev_comm {
  int32_t rank;
  int32_t world;
  int32_t trap_on_timeout;
  int32_t pad;
  uint64_t timeout_ns;
  tw_call_desc_t call;                /* the call this copy was made for (digest 0: none) */
  tw_ctrl_t *ctrl;                    /* this rank's control block */
  tw_ctrl_t *peer_ctrl[TW_MAX_WORLD]; /* peers' control blocks (NULL: not load/store reachable) */
  tw_err_block_t *err;                /* host-mapped */
  /* The command FIFO to this rank's CPU proxy and the flag words peers on other nodes set
   * (ctrl->net_flags, or host memory mapped for the device); zero inside one node. */
  tw_fifo_dev_t fifo;
  uint64_t *net_flags;
  uint64_t
      *trace; /* TW_TRACE=1: [TW_TRACE_CTAS + 1][TW_TRACE_FIELDS], in device memory, or
                 in host-mapped memory with TW_WATCHDOG_S (read while kernels run); else NULL */
} tw_dev_comm_t;

/* TW_TRACE: per CTA (rows 0..TW_TRACE_CTAS-1) globaltimer stamps and wait totals of the
 * comm's last kernel; row TW_TRACE_CTAS holds {channel + 1}. Printed after each call. The
 * fields from TW_TR_WAITING on say where the CTA is now, for the watchdog's report on a call
 * that does not finish (TW_WATCHDOG_S; runtime/watchdog.c). */
#define TW_TRACE_CTAS 256
#define TW_TRACE_FIELDS 32
#define TW_TRACE_BYTES ((size_t)(TW_TRACE_CTAS + 1) * TW_TRACE_FIELDS * sizeof(uint64_t))
enum {
  TW_TR_START = 0,      /* the CTA began */
  TW_TR_COMM_END = 1,   /* its communication / reduce role before the GEMM ended (if it had one) */
  TW_TR_GEMM_END = 2,   /* its GEMM loop ended */
  TW_TR_END = 3,        /* it finished (after any work after the GEMM and exit barriers) */
  TW_TR_WAIT_NS = 4,    /* thread 0's time spinning in bounded waits */
  TW_TR_WAITS = 5,      /* thread 0's waits that had to spin */
  TW_TR_WAITING = 6,    /* the bounded wait thread 0 spins in now: TW_TR_WAIT_DESC (0: none) */
  TW_TR_WAIT_SINCE = 7, /* its start (globaltimer) */
  TW_TR_CLAIMED = 8,    /* the last GEMM tile its producer claimed: TW_TR_TILE(mb, nb) */
  TW_TR_CLAIMED_AT = 9, /* when (globaltimer) */
  TW_TR_DONE = 10,      /* the last GEMM tile its consumers finished (stored, signalled) */
  TW_TR_DONE_AT = 11,   /* when */
  TW_TR_GATHER_AT = 12, /* tw_gemm_ar: it began its all-gather role (after its reduce role) */
  TW_TR_GATHER_WAIT0 = 13,  /* its TW_TR_WAIT_NS then: the gather's own waits are the rest */
  TW_TR_REDUCED = 14,       /* tw_gemm_rs / tw_gemm_ar: unit groups it reduced before its tiles */
  TW_TR_REDUCED_AFTER = 15, /* and after them */
  TW_TR_LAYOUT_AT = 16      /* the MoE calls: the CTA holds the layout (every rank's counts) */
};
/* A wait on `item` (-1: none) of channel `op` for `peer` (-1: unknown); bit 62: it expired. */
#define TW_TR_WAIT_DESC(op, peer, item)                                                            \
  ((1ull << 63) | ((uint64_t)((op)&0xff) << 48) | ((uint64_t)((peer)&0xffff) << 32) |              \
   (uint64_t)(uint32_t)(item))
#define TW_TR_WAIT_EXPIRED (1ull << 62)
/* A tile (row block, column block), stored + 1 so that 0 means none. */
#define TW_TR_TILE(mb, nb) ((((uint64_t)(uint32_t)(mb)) << 32 | (uint32_t)(nb)) + 1)

#ifdef __cplusplus
}
#endif
#endif
