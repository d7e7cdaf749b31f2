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
  int peer_gather;    /* peer_read with the gathered output: column block 0's tiles of peer rows
                         store the A boxes they load into a_gathered (write-through;
                         TW_AG_PEER_GATHER): 1 column block 0's tiles store, 2 every tile its
                         share of the k-blocks (experimental) */
  int variant;        /* kernel variant (TW_AG_VARIANT): 1 the wide epilogue, 3 stages; 0 not */
  int own_copy_ce;    /* push mode: a copy engine fills the own slot (set by tw_ag_gemm_prepare) */
  int auto_ce;        /* TW_AG_COMM_AUTO took the copy engine (tw_ag_gemm_prepare) */
} tw_ag_gemm_plan_t;

/* Peer reads: at most this many ranks (one tensor map per rank in the kernel parameters). */
#define TW_AG_PEER_READ_MAX_WORLD 8
/* Flag slots of the ag_gemm channel above the chunk flags: the exit barrier of peer reads. */
#define TW_AG_EXIT_COUNT (TW_CHANNEL_FLAGS - 2 * TW_MAX_WORLD - 1)
#define TW_AG_EXIT_FLAG(src) (TW_CHANNEL_FLAGS - 2 * TW_MAX_WORLD + (src))

void tw_ag_gemm_make_plan(const tw_ag_gemm_plan_args_t *args, tw_ag_gemm_plan_t *plan);
/* Peer reads and the write-through gather (sets peer_read, peer_gather and, with them,
 * comm_ctas) on a plan from tw_ag_gemm_make_plan. all_on_gpu: every rank runs on this GPU;
 * n: columns per rank; own_in_place: the shard already sits in the own slot of a_gathered;
 * the envs as read (peer_gather_env -1: the plan decides). */
void tw_ag_gemm_plan_peer(tw_ag_gemm_plan_t *plan, int world, int no_gathered_out, int sm_mode,
                          int all_on_gpu, int64_t m_local, int64_t n, int own_in_place,
                          int comm_sms_arg, int peer_gather_env);

#ifdef __CUDACC__
static __host__ __device__ __forceinline__ int tw_ag_gemm_flag_index(int src, int chunk) {
  return src * TW_AG_GEMM_MAX_CHUNKS + chunk;
}
#endif

struct tw_comm;
/* TW_AG_COMM_AUTO: 1 where the copy-engine mode should run (2 ranks on GPUs of their own, one
 * process or one per GPU, the push 0.3-0.8 of the GEMM's estimated time; env = TW_AG_AUTO_CE:
 * 0 never, 1 wherever allowed, -1 the rule). device_sms: the GPU's SMs, the same on every rank
 * (not the rank's budget, which may differ), so the ranks decide alike. The caller still keeps
 * the SMs under graph capture. */
int tw_ag_gemm_auto_copy_engine(int world, int gpu_shared, int64_t m_local, int64_t n, int64_t k,
                                int device_sms, int env);

/* SM mode, not in place, no straddling tile: 1 where a copy engine should copy the rank's own
 * shard into a_gathered beside the kernel (env = TW_AG_OWN_COPY_CE: 0 never, 1 always, -1 the
 * rule: 2 ranks on GPUs of their own, the push under 0.3 of the GEMM's estimated time). */
int tw_ag_gemm_own_copy_ce(int world, int gpu_shared, int64_t m_local, int64_t n, int64_t k,
                           int device_sms, int env);

tw_status_t tw_ag_gemm_prepare(struct tw_comm *comm, const tw_ag_gemm_args_t *in,
                               tw_ag_gemm_args_t *resolved, tw_ag_gemm_plan_t *plan);

#ifdef __cplusplus
}
#endif
#endif
