/* Internal: tw_ag_gemm's plan (heuristics in ag_gemm_heuristics.c). */
#ifndef TW_OPS_AG_GEMM_H
#define TW_OPS_AG_GEMM_H

#include <stdint.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Flag slice of the ag_gemm channel: (src rank, chunk) -> src * TW_AG_GEMM_MAX_CHUNKS + chunk. */
#define TW_AG_GEMM_MAX_CHUNKS 256

typedef struct tw_ag_gemm_plan_args {
  int world;
  int64_t m_local, n, k;
  int sm_budget;    /* CTAs the rank may run */
  int comm_sms_arg; /* from the args (0: unset) */
  int comm_sms_env; /* TW_AG_COMM_SMS (0: unset) */
  int group_m_env;  /* TW_AG_GROUP_M (0: unset) */
  int shared_gpu;   /* 1: other ranks run on this rank's GPU (their copies compete for its HBM) */
  int variant_env;  /* TW_AG_VARIANT (-1: unset) */
} tw_ag_gemm_plan_args_t;

typedef struct tw_ag_gemm_plan {
  int ctas;           /* grid: every CTA runs the GEMM loop */
  int comm_ctas;      /* of which push data first */
  int rows_per_chunk; /* rows of a shard behind one flag */
  int nchunks;        /* chunks per shard */
  int group_m;        /* row blocks per L2 group of the tile order */
  int block_n;        /* output tile width: 256, or 128 where 256-wide tiles fill the waves badly */
  int peer_read;      /* 1: tiles read the peers' slots in place (set by tw_ag_gemm_prepare) */
  int peer_gather;    /* peer_read with the gathered output: the communication CTAs copy the
                         peers' slots into this rank's a_gathered beside the GEMM, which never
                         waits for those copies (TW_AG_PEER_GATHER, experimental) */
  int copy_wide;      /* TW_AG_COPY_WIDE: 16 loads in flight per copying thread, not 4 */
  int variant;        /* kernel variant (TW_AG_VARIANT bits): bit 0 wide epilogue, 3 stages */
  int own_copy_ce;    /* push mode: a copy engine fills the own slot (set by tw_ag_gemm_prepare) */
} tw_ag_gemm_plan_t;

/* Peer reads: at most this many ranks (one tensor map per rank in the kernel parameters). */
#define TW_AG_PEER_READ_MAX_WORLD 8
/* Flag slots of the ag_gemm channel above the chunk flags: the exit barrier of peer reads. */
#define TW_AG_EXIT_COUNT (TW_CHANNEL_FLAGS - 2 * TW_MAX_WORLD - 1)
#define TW_AG_EXIT_FLAG(src) (TW_CHANNEL_FLAGS - 2 * TW_MAX_WORLD + (src))

void tw_ag_gemm_make_plan(const tw_ag_gemm_plan_args_t *args, tw_ag_gemm_plan_t *plan);

#ifdef __CUDACC__
static __host__ __device__ __forceinline__ int tw_ag_gemm_flag_index(int src, int chunk) {
  return src * TW_AG_GEMM_MAX_CHUNKS + chunk;
}
#endif

struct tw_comm;
tw_status_t tw_ag_gemm_prepare(struct tw_comm *comm, const tw_ag_gemm_args_t *in,
                               tw_ag_gemm_args_t *resolved, tw_ag_gemm_plan_t *plan);

#ifdef __cplusplus
}
#endif
#endif
