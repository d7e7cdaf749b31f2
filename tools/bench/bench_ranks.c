#include "bench_ranks.h"

#include <stdio.h>
#include <stdlib.h>

#include "bench.h"

int bench_ranks_init(bench_ranks_t *rk, int world, int sm_budget) {
  int ngpu = 0;
  BENCH_CUDA(cudaGetDeviceCount(&ngpu));
  rk->world = world;
  const char *virt = getenv("TW_BENCH_VIRTUAL"); /* 1: every rank on GPU 0 */
  if (virt && *virt == '1')
    ngpu = 1;
  for (int r = 0; r < world; r++)
    rk->devices[r] = r % ngpu;
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.sm_budget = sm_budget;
  if (tw_comm_init_all(rk->comms, world, rk->devices, &cfg) != TW_SUCCESS) {
    fprintf(stderr, "tw_comm_init_all(world=%d): %s\n", world, tw_last_error());
    return 1;
  }
  tw_comm_sm_budget(rk->comms[0], &rk->sm_budget);
  for (int r = 0; r < world; r++) {
    BENCH_CUDA(cudaSetDevice(rk->devices[r]));
    BENCH_CUDA(cudaStreamCreateWithFlags(&rk->streams[r], cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreateWithFlags(&rk->events[r], cudaEventDisableTiming));
  }
  BENCH_CUDA(cudaSetDevice(rk->devices[0]));
  return 0;
}

void bench_ranks_fini(bench_ranks_t *rk) {
  for (int r = 0; r < rk->world; r++) {
    cudaSetDevice(rk->devices[r]);
    cudaStreamSynchronize(rk->streams[r]);
    cudaStreamDestroy(rk->streams[r]);
    cudaEventDestroy(rk->events[r]);
    tw_comm_destroy(rk->comms[r]);
  }
  cudaSetDevice(rk->devices[0]);
}

void bench_ranks_use(const bench_ranks_t *rk, int r) { BENCH_CUDA(cudaSetDevice(rk->devices[r])); }

int bench_ranks_async_ok(const bench_ranks_t *rk, const char *what) {
  int ok = 1;
  for (int r = 0; r < rk->world; r++) {
    bench_ranks_use(rk, r);
    BENCH_CUDA(cudaStreamSynchronize(rk->streams[r]));
    tw_status_t async = TW_SUCCESS;
    if (tw_comm_async_error(rk->comms[r], &async) != TW_SUCCESS || async != TW_SUCCESS) {
      fprintf(stderr, "%s: rank %d: %s\n", what, r, tw_comm_last_error(rk->comms[r]));
      ok = 0;
    }
  }
  bench_ranks_use(rk, 0);
  return ok;
}
