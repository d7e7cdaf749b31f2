/* Internal: the allgather plan shared by tw_allgather and tw_ag_gemm. */
#ifndef TW_OPS_ALLGATHER_H
#define TW_OPS_ALLGATHER_H

#include <stddef.h>

#include "runtime/devcomm.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_AG_THREADS 512
/* Flag slice of the allgather channel: (src rank, chunk) -> src * TW_AG_MAX_CHUNKS + chunk. */
#define TW_AG_MAX_CHUNKS 256
#define TW_AG_TARGET_ITEMS 264          /* 2 x 132 SMs */
#define TW_AG_RAIL_MIN_CHUNK (1u << 20) /* across nodes: bytes per chunk at least */

typedef struct tw_ag_plan {
  const void *send;
  void *recv_peer[TW_MAX_WORLD]; /* each rank's receive buffer, mapped here (NULL: other node) */
  size_t bytes;                  /* per rank */
  size_t chunk_bytes;
  int nchunks;
  int world;
  int ctas;
  int inter;         /* ranks on other nodes: the rail gather (device/rail.cuh) */
  uint64_t recv_off; /* recv's heap offset */
  tw_rail_t rail;
} tw_ag_plan_t;

#ifdef __CUDACC__
static __host__ __device__ __forceinline__ int tw_ag_flag_index(int src, int chunk) {
  return src * TW_AG_MAX_CHUNKS + chunk;
}
#endif

/* Bytes of the comm's low-latency area (comm.h) an allgather of `bytes` per rank takes through
 * it: two halves of world slots of 2 x bytes (16-byte words of 8 data bytes). */
size_t tw_ag_ll_bytes(int world, size_t bytes);
/* Whether tw_allgather exchanges through the low-latency area of ll_bytes bytes. env: TW_AG_LL
 * (1: wherever it fits; -1: there, on ranks that do not share a GPU, for at most
 * TW_AG_LL_RULE_BYTES per rank; 0: never). */
#define TW_AG_LL_RULE_BYTES ((size_t)512 << 10)
int tw_ag_want_ll(int env, int world, int gpu_shared, size_t bytes, size_t ll_bytes);

struct tw_comm;
/* Validates the arguments (naming the bad one) and chooses chunks for max_ctas CTAs. */
tw_status_t tw_ag_make_plan(struct tw_comm *comm, const void *send, void *recv, size_t bytes,
                            int max_ctas, tw_ag_plan_t *plan);

#ifdef __cplusplus
}
#endif
#endif
