/*
 * Internal: tw_gemm_rs / tw_gemm_ar geometry and launch plan (heuristics in
 * gemm_rs_heuristics.c).
 *
 * Geometry. Owner o holds rows [o * m_local, (o + 1) * m_local) of the sum. The
 * GEMM runs on global 128 x block_n tiles (row block mb, column block nb; block_n
 * 256, 128 where the plan takes narrow tiles, or 192 on the ping-pong loop at long K); a tile
 * may straddle two or more owners when m_local is not a multiple of 128. A
 * *unit* is the part of one tile inside one owner's rows; owner o's units are
 * numbered in bands of `band` column blocks, row-major inside a band
 * (tw_rs_unit), which is the order the GEMM's band sweeps finish them in (with
 * band = 1: column-major, u = nb * mbo(o) + (mb - mb_first(o))). Units are grouped
 * `group_units` at a time behind one flag (so any shape fits the channel's
 * flag slice); a group is the reduce (and all-gather) work item.
 *
 * Flags of the op's channel on each rank, in a layout fixed by the comm's world alone
 * (stride S = tw_rs_flag_stride(world); every plan keeps its groups within S), so calls of
 * any shapes, and the direct scheme, can follow each other on one comm:
 *   [0, S)                                  tile counters: every rank adds 1 per
 *       unit it stored into this rank's staging (red.release.sys); the reduce CTA
 *       waits for world * units-in-group, then resets the counter to 0 (no rank
 *       writes it again before this rank's entry into the next call). Every counter
 *       a call uses ends at 0.
 *   [S + o * S + g]                         (all-reduce) owner o finished group g:
 *       set to the epoch (which only grows); this rank then copies it from o's workspace.
 *   TW_CHANNEL_FLAGS - 1 / - 2              reduce / gather work queues.
 * The stride must not follow the call's own group count: a later call with more groups would
 * find an earlier call's ready epochs in its counters and reduce before the partials landed
 * (e.g. a direct all-reduce after a pushed one on the same comm).
 *
 * Workspace (symmetric, per rank): staging [world][m_local][n] of fp32 (of bf16
 * with TW_PARTIALS_BF16, packed the same way; the size asked for is the fp32
 * one either way) (slot s: rank s's partial of this rank's rows), then, for the
 * all-reduce, bf16 right after the staging: with the push gather (the default,
 * tw_gemm_ar_push_workspace_bytes) [world][m_local][n], block o holding owner o's
 * reduced rows (stored there by o's reduction, copied into `out` by this rank);
 * otherwise [m_local][n], this rank's reduced rows, loaded by every rank.
 */
#ifndef TW_OPS_GEMM_RS_H
#define TW_OPS_GEMM_RS_H

#include <stddef.h>
#include <stdint.h>

#include "gemm/band_units.h"
#include "runtime/devcomm.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The fused kernel keeps one TMA map per owner in its parameters. */
#define TW_GEMM_RS_MAX_WORLD 8
#define TW_GEMM_RS_BLOCK_M 128
#define TW_GEMM_RS_BLOCK_N 256 /* the default tile width; 128 where the plan takes narrow tiles */

typedef struct tw_gemm_rs_plan_args {
  int world;
  int64_t m, n, k;
  int sm_budget;      /* CTAs the rank may run */
  int reduce_sms_arg; /* from the args (0: unset) */
  int all_reduce;
  int band_env;       /* TW_RS_BAND (0: unset) */
  int partial_bytes;  /* 4 (fp32 partials) or 2 (TW_PARTIALS_BF16); 0 counts as 4 */
  int comm_world;     /* the comm's world, which fixes the flag layout (0: world) */
  int shared_gpu;     /* 1: some ranks of the comm share a GPU (and its L2); comm->gpu_shared,
                         the same on every rank: the band fixes the unit numbering */
  int interleave_env; /* TW_RS_INTERLEAVE (-1: the plan decides) */
  int reduce_env;     /* TW_RS_REDUCE_CTAS (-1: the plan decides; 0: none) */
  int group_env;      /* TW_RS_GROUP_UNITS: units per group (0: the plan decides) */
  int plan_sms;       /* comm->plan_sms, the same on every rank: sizes tw_gemm_ar's unit groups,
                         which every rank numbers alike (0: sm_budget) */
  int owner_env;      /* TW_RS_OWNER_EPI (-1: tw_gemm_rs_want_owner_epi decides; 0 never) */
  int pull_env;       /* TW_RS_PULL (-1: the plan decides; 0 never; 1 always) */
  int block_n_env;    /* TW_RS_BLOCK_N: 128, 192 or 256 (anything else: the plan decides) */
} tw_gemm_rs_plan_args_t;

/* Counters per channel, and the stride of the all-reduce ready flags: fixed by the comm's
 * world (see the flag layout above). */
static inline int tw_rs_flag_stride(int comm_world) {
  return (TW_CHANNEL_FLAGS - 2) / (1 + comm_world);
}

typedef struct tw_gemm_rs_plan {
  int ctas;        /* grid: every CTA runs the GEMM loop */
  int band;        /* column blocks per band of the tile order (and of the unit numbering) */
  int reduce_ctas; /* of which start on the reduction (0: none; every CTA takes reduction
                      work after its tiles either way) */
  int group_units; /* units behind one flag */
  int groups_max;  /* groups of the owner with the most units (<= flag_stride) */
  int flag_stride; /* tw_rs_flag_stride(comm world): where the ready flags start */
  int interleave;  /* 1: the owners' row blocks interleaved in each band (not with direct) */
  int single;      /* world 1 as the plain GEMM (set by the caller of make_plan) */
  int direct;      /* tw_gemm_ar's direct scheme (set by the caller of make_plan) */
  int ar_push;     /* tw_gemm_ar's push gather (set by the caller of make_plan) */
  int ar_out_sym;  /* tw_gemm_ar into symmetric outputs (args.out_symmetric): the owners write
                      every rank's out, no gather copy (set by the caller of make_plan) */
  int owner_epi;   /* 2 ranks: own tiles reduced in their epilogue, no reduce CTAs, one unit
                      per group (tw_gemm_rs_want_owner_epi) */
  int pull;        /* each rank's whole partial stored locally, the owners reading their rows
                      of it from every rank (not with the direct scheme, not at world 1) */
  int block_n;     /* the GEMM tile's (and a unit's) columns: TW_GEMM_RS_BLOCK_N (256), 128, or
                      192 (TW_RS_BLOCK_N=192: the ping-pong loop) */
  int unfused;     /* tw_gemm into the workspace, then the reduce kernel, no fused kernel
                      (tw_gemm_rs_want_unfused; set by the caller of make_plan) */
  int ll;          /* the unfused pipeline exchanges rows through the comm's low-latency area
                      (tw_gemm_rs_want_ll; set by the caller of make_plan) */
  int ar_peer_out; /* tw_gemm_ar's unfused pipeline stores every rank's rows into every rank's
                      plain out, their addresses exchanged at entry (ranks of one process on
                      one GPU, TW_AR_PEER_OUT; set by the caller of make_plan) */
  int rail;        /* ranks on several nodes: the rail path (gemm_rs_rail.h; set by the caller of
                      make_plan), fused, or with `unfused` tw_gemm then the rail kernel's copy */
} tw_gemm_rs_plan_t;

/* Workspace bytes of tw_gemm_ar's direct scheme: fp32 staging [world][m][n]. */
size_t tw_gemm_ar_direct_workspace_bytes(int world, int64_t m, int64_t n, int partial_bytes);
/* Below this m, tw_gemm_ar_want_direct takes the direct scheme whatever the partials (2 ranks). */
#define TW_AR_DIRECT_ANY_M 128
/* tw_gemm_rs_workspace_size: the push's bytes, or the direct scheme's with fp32 partials where
 * the rule may take it. */
size_t tw_gemm_rs_call_workspace_bytes(int world, int64_t m, int64_t n);
/* Whether tw_gemm_ar takes the direct scheme (where the workspace holds it). direct_env:
 * TW_AR_DIRECT (-1: this rule decides). partial_bytes: 4 or 2. */
int tw_gemm_ar_want_direct(int direct_env, int world, int gpu_shared, int partial_bytes, int64_t m,
                           int64_t k);

/* Where tw_gemm_rs_want_unfused takes the unfused pipeline on distinct GPUs: tw_gemm_rs at
 * m <= TW_RS_UNFUSED_MAX_M, tw_gemm_ar at m <= TW_AR_UNFUSED_MAX_M. */
#define TW_RS_UNFUSED_MAX_M 512
#define TW_AR_UNFUSED_MAX_M 256
/* Where ranks share a GPU: tw_gemm_ar at m <= TW_AR_UNFUSED_SHARED_MAX_M; tw_gemm_ar into
 * symmetric outputs (or into plain outs the unfused pipeline stores into directly,
 * TW_AR_PEER_OUT) with K per rank <= TW_RS_UNFUSED_SHARED_MAX_K at m <=
 * TW_AR_UNFUSED_SHARED_ANY_PARTIALS_MAX_M, either partials; and with fp32 partials, K per rank
 * <= TW_RS_UNFUSED_SHARED_MAX_K and m >= TW_RS_UNFUSED_SHARED_MIN_M, tw_gemm_rs and
 * tw_gemm_ar into such outputs. */
#define TW_AR_UNFUSED_SHARED_MAX_M 64
#define TW_AR_UNFUSED_SHARED_ANY_PARTIALS_MAX_M 4096
#define TW_RS_UNFUSED_SHARED_MAX_K 2048
#define TW_RS_UNFUSED_SHARED_MIN_M 4096
/* Whether tw_gemm_rs (all_reduce 0) / tw_gemm_ar (1) run the unfused pipeline in the call
 * (tw_gemm into the workspace, then the reduce kernel; gemm_rs_unfused.cu), where the workspace
 * holds it. env: TW_RS_UNFUSED_SMALL (-1: this rule decides); k: K per rank; partial_bytes: 4
 * or 2; stores_all: tw_gemm_ar's pipeline stores its rows into every rank's out (symmetric
 * outputs, or peer outs: TW_AR_PEER_OUT). Every input is the same on every rank. */
int tw_gemm_rs_want_unfused(int env, int world, int gpu_shared, int64_t m, int64_t k,
                            int partial_bytes, int all_reduce, int stores_all);
/* Bytes of the low-latency area (comm.h) the unfused pipeline's exchange through it takes
 * (TW_RS_UNFUSED_LL): two calls' halves (odd and even sequence numbers), each world slots of a
 * rank's m / world rows of partials as 16-byte words of 8 data bytes and two flags (x2), then
 * for tw_gemm_ar (all_reduce) world slots of the owners' reduced bf16 rows, also x2. */
size_t tw_gemm_rs_ll_bytes(int world, int64_t m, int64_t n, int partial_bytes, int all_reduce);
/* Whether the unfused pipeline exchanges through the low-latency area of ll_bytes bytes.
 * env: TW_RS_UNFUSED_LL (1: wherever the call's rows fit; -1: there, where a rank's words for
 * one peer are at most TW_LL_RULE_SLOT_BYTES, TW_LL_RULE_SWAP_SLOT_BYTES at the shapes the
 * pipeline's GEMM swaps by its rule (m <= swap_max_m: tw_gemm_rs_swap_max_m), unless shared_stores
 * (then only bf16 partials at m <= TW_AR_UNFUSED_SHARED_MAX_M); 0: never). shared_stores: ranks
 * sharing a GPU whose tw_gemm_ar pipeline can store its rows straight into every rank's out
 * (symmetric outputs, or peer outs: TW_AR_PEER_OUT). */
#define TW_LL_RULE_SLOT_BYTES ((size_t)1 << 20)
/* The unfused pipeline's GEMM swaps A and B (TW_GEMM_SWAP -1) up to this m, past tw_gemm's 64:
 * at M=128 n 8192 K 1024 its 128-row tiles fill half the SMs (tw_gemm_sm90_opts_t.swap_max_m). */
#define TW_GEMM_RS_SWAP_MAX_M 128
#define TW_LL_RULE_SWAP_SLOT_BYTES ((size_t)2 << 20)
int tw_gemm_rs_want_ll(int env, int world, int64_t m, int64_t n, int partial_bytes, int all_reduce,
                       size_t ll_bytes, int shared_stores, int64_t swap_max_m);
/* The swap rule's bound on m for the unfused pipeline's GEMM (tw_gemm_sm90_opts_t.swap_max_m):
 * TW_GEMM_RS_SWAP_MAX_M on ranks with GPUs of their own, tw_gemm's 64 where ranks share one (the
 * larger bound is untried there). The same on every rank. */
int64_t tw_gemm_rs_swap_max_m(int gpu_shared);
/* Whether tw_gemm_rs's swap-AB GEMM, storing the low-latency words itself, also
 * sums this rank's own rows in its epilogue (gemm_ll.cuh). env: TW_RS_LL_REDUCE (1: always, 0:
 * never, -1: at m <= TW_RS_LL_REDUCE_MAX_M, the 16-wide swap tiles, where it beats the reduce
 * kernel). tw_gemm_ar: never. */
#define TW_RS_LL_REDUCE_MAX_M 16
int tw_gemm_rs_want_ll_reduce(int env, int all_reduce, int64_t m);
/* Workspace bytes of the unfused pipeline: this rank's partial [m][n] (4 or 2 bytes), then for
 * tw_gemm_ar into a plain `out` every rank's reduced rows, bf16 [m][n]. */
size_t tw_gemm_rs_unfused_workspace_bytes(int64_t m, int64_t n, int partial_bytes, int gather);

/* Whether tw_gemm_rs / tw_gemm_ar reduce each rank's own tiles in their epilogue
 * (RsEpi::combine), given that the call can (2 ranks, whole row blocks per owner, one unit per
 * flag, the push layout). env: TW_RS_OWNER_EPI (-1: this rule
 * decides). reduce_set: the caller set the reduce CTAs (args.reduce_sms > 0 or
 * TW_RS_REDUCE_CTAS >= 0), which the rule then leaves running; always 0 for tw_gemm_ar, whose
 * ranks must all choose alike.
 * partial_bytes: 4 or 2. k: per rank. tiles: 128 x 256 tiles of the m x n product; ctas: CTAs
 * per rank (comm->plan_sms). */
int tw_gemm_rs_want_owner_epi(int env, int reduce_set, int partial_bytes, int64_t k, int64_t tiles,
                              int ctas);

void tw_gemm_rs_make_plan(const tw_gemm_rs_plan_args_t *args, tw_gemm_rs_plan_t *plan);
/* Across nodes (plan->rail, ops/gemm_rs/gemm_rs_rail.h): the one-node plan's tiling and CTAs
 * for args (world, fused), without the schemes of one node (direct, pull, owner epilogue,
 * interleave, push, symmetric outputs, low-latency rows), on 128- or 256-column tiles, with
 * unit groups that fit the rail flags of `nodes` nodes and, unless args->group_env sets them,
 * carry TW_RS_RAIL_WRITE_BYTES of fp32 node partials each (one RDMA write), and reduce CTAs
 * that start beside the GEMM (args->reduce_sms_arg or reduce_env where set, else at least 1 in
 * 16; they may differ by rank). unfused_env: TW_RS_UNFUSED_SMALL (1: the unfused pipeline). */
void tw_gemm_rs_make_rail_plan(const tw_gemm_rs_plan_args_t *args, int nodes, int unfused_env,
                               tw_gemm_rs_plan_t *plan);

/* Bytes of workspace for an m x n product on `world` ranks. */
size_t tw_gemm_rs_workspace_bytes(int world, int64_t m, int64_t n);
/* The staging, then every owner's reduced rows, bf16 [world][m_local][n] (tw_gemm_ar's push
 * gather); what tw_gemm_rs_workspace_size asks for. */
size_t tw_gemm_ar_push_workspace_bytes(int world, int64_t m, int64_t n);

#ifdef __CUDACC__
#define TW_RS_HD static __host__ __device__ __forceinline__
#else
#define TW_RS_HD static inline
#endif

/* First global row block holding rows of owner o, and how many row blocks do. */
TW_RS_HD int32_t tw_rs_mb_first(int32_t o, int32_t m_local) {
  return (int32_t)(((int64_t)o * m_local) / TW_GEMM_RS_BLOCK_M);
}
TW_RS_HD int32_t tw_rs_mb_count(int32_t o, int32_t m_local) {
  return (int32_t)((((int64_t)o + 1) * m_local - 1) / TW_GEMM_RS_BLOCK_M) -
         tw_rs_mb_first(o, m_local) + 1;
}

#ifdef __cplusplus
}
#endif
#endif
