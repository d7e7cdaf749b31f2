/* Ranks for multi-rank benchmarks: comms from tw_comm_init_all over the local GPUs
 * (virtual ranks when there are fewer GPUs than ranks), one stream and event each. */
#ifndef TW_BENCH_RANKS_H
#define TW_BENCH_RANKS_H

#include <cuda_runtime_api.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bench_ranks {
  int world;
  int sm_budget; /* per rank, as the comm resolved it */
  tw_comm_t comms[TW_MAX_WORLD];
  cudaStream_t streams[TW_MAX_WORLD];
  cudaEvent_t events[TW_MAX_WORLD];
  int devices[TW_MAX_WORLD];
} bench_ranks_t;

/* Rank r on GPU r % (number of GPUs), or on GPU 0 when TW_BENCH_VIRTUAL=1.
 * Returns 0, or 1 after printing tw_last_error(). Leaves device 0 current. */
int bench_ranks_init(bench_ranks_t *rk, int world, int sm_budget);
void bench_ranks_fini(bench_ranks_t *rk);
/* 1 if no rank has an async (kernel) error; else prints them and returns 0. */
int bench_ranks_async_ok(const bench_ranks_t *rk, const char *what);
/* cudaSetDevice to rank r's device. */
void bench_ranks_use(const bench_ranks_t *rk, int r);

#ifdef __cplusplus
}
#endif
#endif
