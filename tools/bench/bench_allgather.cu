/*
 * tw-bench allgather: tw_allgather against a copy-engine allgather
 * (cudaMemcpyAsync per peer, then cross-stream events), both on the same
 * ranks in one run. Shape m = bytes per rank; --world ranks (default 8),
 * virtual ranks on one GPU when there are fewer GPUs. Reports bus bandwidth
 * (nccl-tests convention: bytes * world / t * (world - 1) / world).
 *
 * tw-bench flag: round-trip latency of a flag between two ranks (virtual ranks
 * share a GPU): rank 0 sets rank 1's flag, rank 1 answers, N times inside one
 * launch of each kernel, using the library's release/acquire primitives.
 */
#include <cuda_runtime.h>

#include <string.h>

#include "bench.h"
#include "bench_ranks.h"
#include "device/signal.cuh"
#include "ref/ref_collectives.h"
#include "tw_test.h"

/* ---- allgather --------------------------------------------------------------------------- */

typedef struct ag_ctx {
  bench_ranks_t *rk;
  size_t bytes;
  void *send[TW_MAX_WORLD];
  void *recv[TW_MAX_WORLD];
  int failed;
} ag_ctx;

static void run_tilewire(void *p, int iter) {
  (void)iter;
  ag_ctx *c = (ag_ctx *)p;
  for (int r = 0; r < c->rk->world; r++)
    if (tw_allgather(c->rk->comms[r], c->send[r], c->recv[r], c->bytes,
                     (tw_stream_t)c->rk->streams[r]) != TW_SUCCESS) {
      fprintf(stderr, "tw_allgather: %s\n", tw_comm_last_error(c->rk->comms[r]));
      c->failed = 1;
    }
}

static void run_memcpy(void *p, int iter) {
  (void)iter;
  ag_ctx *c = (ag_ctx *)p;
  BENCH_CUDA(tw_ref_allgather_memcpy(c->rk->world, (const void *const *)c->send, c->recv, c->bytes,
                                     c->rk->streams, c->rk->events));
}

static int check_gather(ag_ctx *c, void (*fn)(void *, int), const char *what) {
  int world = c->rk->world;
  for (int r = 0; r < world; r++) {
    bench_ranks_use(c->rk, r);
    tw_test_fill_bytes(c->send[r], c->bytes, 77 + r, (tw_stream_t)c->rk->streams[r]);
    tw_test_poison(c->recv[r], c->bytes * world, (tw_stream_t)c->rk->streams[r]);
    BENCH_CUDA(cudaStreamSynchronize(c->rk->streams[r]));
  }
  bench_ranks_use(c->rk, 0);
  fn(c, 0);
  for (int r = 0; r < world; r++)
    BENCH_CUDA(cudaStreamSynchronize(c->rk->streams[r]));
  int ok = !c->failed;
  for (int r = 0; r < world && ok; r++) {
    /* Compare on rank r's GPU: bring each source shard over first (distinct GPUs). */
    bench_ranks_use(c->rk, r);
    void *expected = NULL;
    BENCH_CUDA(cudaMalloc(&expected, c->bytes));
    for (int src = 0; src < world && ok; src++) {
      BENCH_CUDA(
          cudaMemcpyPeer(expected, c->rk->devices[r], c->send[src], c->rk->devices[src], c->bytes));
      size_t diff = tw_test_count_diff((char *)c->recv[r] + src * c->bytes, expected, c->bytes);
      if (diff) {
        fprintf(stderr, "%s: rank %d's copy of rank %d's shard: %zu bytes differ\n", what, r, src,
                diff);
        ok = 0;
      }
    }
    cudaFree(expected);
  }
  bench_ranks_use(c->rk, 0);
  return ok;
}

static int run_allgather(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res) {
  bench_ranks_t rk;
  int world = o->world ? o->world : 8;
  if (bench_ranks_init(&rk, world, o->sm_budget))
    return 1;
  ag_ctx c;
  memset(&c, 0, sizeof(c));
  c.rk = &rk;
  c.bytes = (size_t)shape->m;
  for (int r = 0; r < world; r++) {
    if (tw_mem_alloc(rk.comms[r], c.bytes * world, &c.recv[r]) != TW_SUCCESS) {
      fprintf(stderr, "tw_mem_alloc: %s\n", tw_comm_last_error(rk.comms[r]));
      return 1;
    }
    BENCH_CUDA(cudaSetDevice(rk.devices[r]));
    BENCH_CUDA(cudaMalloc(&c.send[r], c.bytes));
  }
  int budget = 0;
  tw_comm_sm_budget(rk.comms[0], &budget);
  struct {
    const char *name;
    void (*fn)(void *, int);
  } variants[] = {{"copy-engine", run_memcpy}, {"tilewire", run_tilewire}};
  double base_ms = 0;
  for (int v = 0; v < 2; v++) {
    bench_row_t row;
    memset(&row, 0, sizeof(row));
    snprintf(row.op, sizeof(row.op), "allgather");
    snprintf(row.variant, sizeof(row.variant), "%s", variants[v].name);
    snprintf(row.shape, sizeof(row.shape), "%zu B/rank world=%d sms/rank=%d", c.bytes, world,
             budget);
    row.ok = o->check ? check_gather(&c, variants[v].fn, variants[v].name) : 1;
    row.ms = bench_time_multi_ms(variants[v].fn, &c, rk.streams[0], rk.streams, world, o->warmup,
                                 o->repeats, &row.ms_p10, &row.ms_p90);
    row.gbps = (double)c.bytes * world / (row.ms * 1e-3) * (world - 1) / world / 1e9;
    row.ok = row.ok && bench_ranks_async_ok(&rk, variants[v].name);
    if (v == 0)
      base_ms = row.ms;
    row.speedup = base_ms / row.ms;
    bench_add_row(res, &row);
  }
  for (int r = 0; r < world; r++) {
    cudaSetDevice(rk.devices[r]);
    cudaFree(c.send[r]);
    tw_mem_free(rk.comms[r], c.recv[r]);
  }
  bench_ranks_fini(&rk);
  return 0;
}

static const bench_shape_t ag_sweep[] = {
    {1 << 20, 0, 0, NULL}, {8 << 20, 0, 0, NULL}, {32 << 20, 0, 0, NULL}, {128 << 20, 0, 0, NULL}};
static const bench_shape_t ag_quick[] = {{1 << 20, 0, 0, NULL}, {32 << 20, 0, 0, NULL}};

static const bench_op_t allgather_op = {
    "allgather",  "tw_allgather vs copy-engine allgather; m = bytes per rank, --world ranks (8)",
    ag_sweep,     4,
    ag_quick,     2,
    run_allgather};
BENCH_OP_REGISTER(allgather, allgather_op, 20);

/* ---- flag ping-pong ---------------------------------------------------------------------- */

static __device__ bool spin_geq(const uint64_t *flag, uint64_t target, int gpu_scope) {
  uint64_t start = tw_globaltimer();
  while ((gpu_scope ? tw_ld_acquire_gpu(flag) : tw_ld_acquire_sys(flag)) < target)
    if (tw_globaltimer() - start > 2000000000ull)
      return false; /* 2 s */
  return true;
}

static __device__ void set_flag(uint64_t *flag, uint64_t v, int gpu_scope) {
  if (gpu_scope)
    tw_st_release_gpu(flag, v);
  else
    tw_st_release_sys(flag, v);
}

/* flags: this rank's slot; peer: the other rank's slot. Rank 0 serves, rank 1 answers.
 * gpu_scope: .gpu release/acquire (valid only when both ranks share a GPU). */
static __global__ void pingpong_kernel(uint64_t *own, uint64_t *peer, int rounds, uint64_t base,
                                       int serve, int gpu_scope, int *failed) {
  for (int i = 1; i <= rounds; i++) {
    uint64_t v = base + (uint64_t)i;
    if (serve)
      set_flag(peer, v, gpu_scope);
    if (!spin_geq(own, v, gpu_scope)) {
      *failed = 1;
      return;
    }
    if (!serve)
      set_flag(peer, v, gpu_scope);
  }
}

typedef struct flag_ctx {
  bench_ranks_t *rk;
  uint64_t *flag[2];
  uint64_t *peer_flag[2];
  int rounds;
  int gpu_scope;
  uint64_t base;
  int *failed;
} flag_ctx;

static void run_pingpong(void *p, int iter) {
  (void)iter;
  flag_ctx *c = (flag_ctx *)p;
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(c->rk->devices[r]);
    pingpong_kernel<<<1, 1, 0, c->rk->streams[r]>>>(c->flag[r], c->peer_flag[r], c->rounds, c->base,
                                                    r == 0, c->gpu_scope, c->failed);
  }
  c->base += (uint64_t)c->rounds;
  cudaSetDevice(c->rk->devices[0]);
}

static int run_flag(const bench_opts_t *o, const bench_shape_t *shape, bench_results_t *res) {
  bench_ranks_t rk;
  if (bench_ranks_init(&rk, 2, o->sm_budget))
    return 1;
  flag_ctx c;
  memset(&c, 0, sizeof(c));
  c.rk = &rk;
  c.rounds = shape->m > 0 ? (int)shape->m : 1000;
  void *buf[2];
  for (int r = 0; r < 2; r++) {
    if (tw_mem_alloc(rk.comms[r], 4096, &buf[r]) != TW_SUCCESS)
      return 1;
    BENCH_CUDA(cudaMemset(buf[r], 0, 4096));
    c.flag[r] = (uint64_t *)buf[r];
  }
  for (int r = 0; r < 2; r++) {
    void *peer;
    if (tw_mem_peer_ptr(rk.comms[r], buf[r], 1 - r, &peer) != TW_SUCCESS)
      return 1;
    c.peer_flag[r] = (uint64_t *)peer;
  }
  BENCH_CUDA(cudaMalloc(&c.failed, sizeof(int)));
  BENCH_CUDA(cudaMemset(c.failed, 0, sizeof(int)));
  BENCH_CUDA(cudaDeviceSynchronize());
  int same_gpu = rk.devices[1] == rk.devices[0];
  for (int scope = 0; scope < 1 + same_gpu; scope++) {
    c.gpu_scope = scope;
    bench_row_t row;
    memset(&row, 0, sizeof(row));
    snprintf(row.op, sizeof(row.op), "flag");
    snprintf(row.variant, sizeof(row.variant), "round-trip-us %s", scope ? ".gpu" : ".sys");
    snprintf(row.shape, sizeof(row.shape), "%d round trips per launch, 2 ranks%s", c.rounds,
             same_gpu ? " (virtual)" : "");
    double ms = bench_time_multi_ms(run_pingpong, &c, rk.streams[0], rk.streams, 2, o->warmup,
                                    o->repeats, &row.ms_p10, &row.ms_p90);
    BENCH_CUDA(cudaDeviceSynchronize());
    /* Reported in microseconds per round trip (the ms column holds us). */
    row.ms = ms * 1e3 / c.rounds;
    row.ms_p10 *= 1e3 / c.rounds;
    row.ms_p90 *= 1e3 / c.rounds;
    int failed = 1;
    BENCH_CUDA(cudaMemcpy(&failed, c.failed, sizeof(int), cudaMemcpyDeviceToHost));
    row.ok = failed == 0;
    bench_add_row(res, &row);
  }
  cudaFree(c.failed);
  for (int r = 0; r < 2; r++)
    tw_mem_free(rk.comms[r], buf[r]);
  bench_ranks_fini(&rk);
  return 0;
}

static const bench_shape_t flag_sweep[] = {{1000, 0, 0, NULL}};

static const bench_op_t flag_op = {
    "flag",
    "flag round trip between two ranks (ms column: microseconds per round trip); m = rounds",
    flag_sweep,
    1,
    flag_sweep,
    1,
    run_flag};
BENCH_OP_REGISTER(flag, flag_op, 30);
