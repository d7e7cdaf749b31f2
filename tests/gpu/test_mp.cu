/*
 * Several processes, one rank each, on the local GPUs (all on GPU 0 when there
 * is one: run under MPS, which scripts/gpu-suite.sh starts). Exercises the TCP
 * bootstrap, the fd exchange of the symmetric heap and the allgather across
 * processes, and tw_ag_gemm, tw_gemm_rs and tw_gemm_ar against their unfused pipelines, bitwise
 * (with a GPU per rank, every other tw_ag_gemm call in the copy-engine mode), and tw_moe_ffn and
 * tw_moe_dispatch_gemm against the unfused MoE pipeline (check_moe); then 2 ranks
 * whose TW_RS_BAND differs, where tw_comm_init_rank must fail on both, naming the knob; then 3
 * ranks whose tw_gemm_rs calls differ in n, which every rank must report as TW_ERR_MISMATCH.
 * Usage: test_mp [world=4] [iterations=100].
 *
 * test_mp kill [world=4]: the last rank's process SIGKILLs itself mid-call (run_kill): the
 * others' tw_gemm_ar must fail within a bound, with a message, the next call must fail at once,
 * tw_comm_destroy must return and each survivor's CUDA context must stay usable.
 */
#include <cuda_runtime.h>

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ref/ref_reduce.h"
#include "tw_test.h"

/* GEMM+ReduceScatter and GEMM+AllReduce across processes: fused == tw_gemm (fp32) per rank
 * + the rank-ordered reduction (tw_ref_reduce_rank between two barriers), bitwise. */
static int check_gemm_rs(tw_comm_t comm, int rank, int world, int iters, cudaStream_t stream) {
  const int64_t m = 96 * (int64_t)world, n = 256, k = 320;
  int failures = 0;
  size_t ws_bytes = 0;
  void *ws = NULL, *partial = NULL, *out_ar_ref = NULL, *a = NULL, *b = NULL, *out = NULL,
       *out_ref = NULL;
  if (tw_gemm_rs_workspace_size(comm, m, n, &ws_bytes) != TW_SUCCESS ||
      (ws_bytes && tw_mem_alloc(comm, ws_bytes, &ws) != TW_SUCCESS) ||
      tw_mem_alloc(comm, (size_t)m * n * 4, &partial) != TW_SUCCESS ||
      tw_mem_alloc(comm, (size_t)m * n * 2, &out_ar_ref) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: gemm_rs setup: %s\n", rank, tw_comm_last_error(comm));
    return 1;
  }
  cudaMalloc(&a, (size_t)m * k * 2);
  cudaMalloc(&b, (size_t)n * k * 2);
  cudaMalloc(&out, (size_t)m * n * 2);
  cudaMalloc(&out_ref, (size_t)m * n * 2);
  const void *peers[TW_MAX_WORLD];
  void *ar_outs[TW_MAX_WORLD];
  for (int s = 0; s < world; s++) {
    void *p = NULL, *q = NULL;
    tw_mem_peer_ptr(comm, partial, s, &p);
    tw_mem_peer_ptr(comm, out_ar_ref, s, &q);
    peers[s] = p;
    ar_outs[s] = q;
  }
  for (int i = 0; i < iters && !failures; i++) {
    for (int all_reduce = 0; all_reduce < 2 && !failures; all_reduce++) {
      tw_test_fill_bf16(a, (size_t)m * k, (uint64_t)i * 131 + rank, (tw_stream_t)stream);
      tw_test_fill_bf16(b, (size_t)n * k, (uint64_t)i * 137 + rank, (tw_stream_t)stream);
      tw_test_poison(out, (size_t)m * n * 2, (tw_stream_t)stream);
      tw_gemm_rs_args_t args = TW_GEMM_RS_ARGS_INIT;
      args.a = a, args.b = b, args.out = out, args.workspace = ws, args.m = m, args.n = n,
      args.k = k;
      tw_status_t st = all_reduce ? tw_gemm_ar(comm, &args, (tw_stream_t)stream)
                                  : tw_gemm_rs(comm, &args, (tw_stream_t)stream);
      /* Reference: fp32 partial per rank, barrier, this rank's share of the ordered sum, barrier.
       */
      tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
      g.c_dtype = TW_FP32, g.a = a, g.b = b, g.c = partial, g.m = m, g.n = n, g.k = k;
      if (st == TW_SUCCESS)
        st = tw_gemm(&g, (tw_stream_t)stream);
      if (st == TW_SUCCESS)
        st = tw_barrier(comm, (tw_stream_t)stream);
      void *outs[TW_MAX_WORLD];
      outs[0] = out_ref;
      cudaError_t ce = st == TW_SUCCESS
                           ? tw_ref_reduce_rank(world, rank, peers, 4, all_reduce ? ar_outs : outs,
                                                all_reduce, m, n, n, 0, stream)
                           : cudaSuccess;
      if (st == TW_SUCCESS)
        st = tw_barrier(comm, (tw_stream_t)stream);
      if (st != TW_SUCCESS || ce != cudaSuccess) {
        fprintf(stderr, "rank %d: gemm_%s iteration %d: %s / %s / %s\n", rank,
                all_reduce ? "ar" : "rs", i, tw_comm_last_error(comm), tw_last_error(),
                cudaGetErrorString(ce));
        failures++;
        break;
      }
      cudaStreamSynchronize(stream);
      const size_t bytes = (size_t)(all_reduce ? m : m / world) * n * 2;
      size_t diff = tw_test_count_diff(out, all_reduce ? out_ar_ref : out_ref, bytes);
      if (diff) {
        fprintf(stderr,
                "rank %d gemm_%s iteration %d: %zu bytes differ from the unfused pipeline\n", rank,
                all_reduce ? "ar" : "rs", i, diff);
        failures++;
      }
    }
  }
  cudaFree(a), cudaFree(b), cudaFree(out), cudaFree(out_ref);
  tw_mem_free(comm, out_ar_ref);
  tw_mem_free(comm, partial);
  if (ws)
    tw_mem_free(comm, ws);
  if (!failures)
    printf("rank %d: %d gemm_rs + gemm_ar iterations ok\n", rank, iters);
  return failures;
}

/* distinct: every rank on a GPU of its own (then every other ag_gemm call takes the copy-engine
 * mode, which needs that). */
/* The MoE layer across processes: tw_moe_ffn == tw_moe_dispatch, tw_grouped_gemm (gate/up),
 * tw_swiglu, tw_grouped_gemm (down), tw_moe_combine, bitwise in every rank's out, with fresh
 * routings (tokens per rank differ) each iteration; tw_moe_dispatch_gemm's experts' rows then
 * tw_moe_combine give the same out again. */
static int check_moe(tw_comm_t comm, int rank, int world, int iters, cudaStream_t stream) {
  const int experts = 4 * world, top_k = 2, local = 4;
  const int64_t hidden = 256, inter = 136, max_tokens = 200;
  const int64_t rows = world * max_tokens * top_k + experts * 128;
  const tw_stream_t s = (tw_stream_t)stream;
  size_t ws_bytes = 0;
  void *ws = NULL, *recv = NULL, *eout = NULL;
  if (tw_moe_workspace_size(comm, max_tokens, hidden, experts, top_k, &ws_bytes) != TW_SUCCESS ||
      tw_mem_alloc(comm, ws_bytes, &ws) != TW_SUCCESS ||
      tw_mem_alloc(comm, (size_t)rows * hidden * 2, &recv) != TW_SUCCESS ||
      tw_mem_alloc(comm, (size_t)rows * hidden * 2, &eout) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: moe alloc: %s\n", rank, tw_comm_last_error(comm));
    return 1;
  }
  void *x, *idx, *wt, *w13, *w2, *h, *act, *out, *ref, *eout2;
  int32_t *off;
  cudaMalloc(&x, (size_t)max_tokens * hidden * 2), cudaMalloc(&idx, (size_t)max_tokens * top_k * 4);
  cudaMalloc(&wt, (size_t)max_tokens * top_k * 4),
      cudaMalloc(&out, (size_t)max_tokens * hidden * 2);
  cudaMalloc(&ref, (size_t)max_tokens * hidden * 2), cudaMalloc(&eout2, (size_t)rows * inter * 4);
  cudaMalloc(&w13, (size_t)local * 2 * inter * hidden * 2);
  cudaMalloc(&w2, (size_t)local * hidden * inter * 2);
  cudaMalloc(&h, (size_t)rows * inter * 4), cudaMalloc(&act, (size_t)rows * inter * 2);
  cudaMalloc((void **)&off, (size_t)(local + 1) * 4);
  tw_test_fill_bf16(w13, (size_t)local * 2 * inter * hidden, 500 + rank, s);
  tw_test_fill_bf16(w2, (size_t)local * hidden * inter, 600 + rank, s);
  int32_t hi[200 * 2];
  float hw[200 * 2];
  int failures = 0;
  uint64_t rng = 1234 + (uint64_t)rank;
  for (int it = 0; it < iters && !failures; it++) {
    const int64_t tokens = (int64_t)(tw_test_xorshift(&rng) % (uint64_t)(max_tokens + 1));
    for (int64_t t = 0; t < tokens; t++) {
      hi[t * 2] = (int32_t)(tw_test_xorshift(&rng) % (uint64_t)experts);
      hi[t * 2 + 1] =
          (hi[t * 2] + 1 + (int32_t)(tw_test_xorshift(&rng) % (uint64_t)(experts - 1))) % experts;
      hw[t * 2] = (float)(tw_test_xorshift(&rng) % 1000) / 1000.0f, hw[t * 2 + 1] = 0.5f;
    }
    cudaMemcpyAsync(idx, hi, (size_t)tokens * top_k * 4, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(wt, hw, (size_t)tokens * top_k * 4, cudaMemcpyHostToDevice, stream);
    tw_test_fill_bf16(x, (size_t)(tokens ? tokens : 1) * hidden, tw_test_xorshift(&rng), s);
    tw_moe_args_t a = TW_MOE_ARGS_INIT;
    a.x = x, a.topk_idx = idx, a.topk_weights = (const float *)wt, a.recv = recv, a.offsets = off;
    a.expert_out = eout, a.out = ref, a.workspace = ws, a.tokens = tokens;
    a.max_tokens = max_tokens, a.hidden = hidden, a.n_out = hidden, a.experts = experts;
    a.top_k = top_k, a.recv_rows = rows;
    a.weights = w13, a.weights2 = w2, a.h = h, a.act = act, a.inter = inter;
    tw_grouped_gemm_args_t g = TW_GROUPED_GEMM_ARGS_INIT;
    g.a = recv, g.b = w13, g.out = h, g.offsets = off, g.m = rows, g.n = 2 * inter;
    g.k = hidden, g.groups = local;
    tw_status_t st = tw_moe_dispatch(comm, &a, s);
    if (st == TW_SUCCESS)
      st = tw_grouped_gemm(&g, s);
    if (st == TW_SUCCESS)
      st = tw_swiglu(h, act, rows, inter, s);
    g.a = act, g.b = w2, g.out = eout, g.n = hidden, g.k = inter;
    if (st == TW_SUCCESS)
      st = tw_grouped_gemm(&g, s);
    if (st == TW_SUCCESS)
      st = tw_moe_combine(comm, &a, s);
    tw_test_poison(out, (size_t)max_tokens * hidden * 2, s);
    a.out = out;
    if (st == TW_SUCCESS)
      st = tw_moe_ffn(comm, &a, s);
    cudaStreamSynchronize(stream);
    size_t diff = st == TW_SUCCESS ? tw_test_count_diff(out, ref, (size_t)tokens * hidden * 2) : 0;
    /* the first half again, fused with the dispatch: act's rows are an input there */
    tw_moe_args_t d = a;
    d.weights = w13, d.expert_out = eout2, d.n_out = 2 * inter;
    tw_test_poison(out, (size_t)max_tokens * hidden * 2, s);
    if (st == TW_SUCCESS)
      st = tw_moe_dispatch_gemm(comm, &d, s);
    if (st == TW_SUCCESS)
      st = tw_swiglu(eout2, act, rows, inter, s);
    g.a = act;
    if (st == TW_SUCCESS)
      st = tw_grouped_gemm(&g, s);
    if (st == TW_SUCCESS)
      st = tw_moe_combine(comm, &a, s);
    cudaStreamSynchronize(stream);
    if (st == TW_SUCCESS)
      diff += tw_test_count_diff(out, ref, (size_t)tokens * hidden * 2);
    if (st != TW_SUCCESS || diff) {
      fprintf(stderr, "rank %d moe iteration %d (%lld tokens): %s; %zu bytes of out differ\n", rank,
              it, (long long)tokens, st == TW_SUCCESS ? "ok" : tw_comm_last_error(comm), diff);
      failures++;
    }
  }
  cudaFree(x), cudaFree(idx), cudaFree(wt), cudaFree(out), cudaFree(ref), cudaFree(eout2);
  cudaFree(w13), cudaFree(w2), cudaFree(h), cudaFree(act), cudaFree(off);
  tw_mem_free(comm, ws), tw_mem_free(comm, recv), tw_mem_free(comm, eout);
  return failures;
}

static int run_rank(tw_unique_id_t id, int rank, int world, int iters, int device, int distinct) {
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    fprintf(stderr, "rank %d: cudaSetDevice(%d): %s\n", rank, device, cudaGetErrorString(ce));
    return 1;
  }
  tw_comm_t comm;
  /* Odd ranks run on 8 SMs, the others on the default share: every op must work when the
   * ranks' budgets differ (a budget-derived allgather chunking once hung there). */
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.sm_budget = rank % 2 ? 8 : 0;
  tw_status_t st = tw_comm_init_rank(&comm, world, id, rank, &cfg);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "rank %d: init: %s: %s\n", rank, tw_status_string(st), tw_last_error());
    return 1;
  }
  int budget = 0, local_size = 0;
  tw_comm_sm_budget(comm, &budget);
  tw_comm_local_size(comm, &local_size);
  const size_t bytes = (1u << 20) + 48;
  void *recv = NULL, *send = NULL, *expected = NULL;
  int failures = 0;
  if (tw_mem_alloc(comm, bytes * world, &recv) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: alloc: %s\n", rank, tw_comm_last_error(comm));
    return 1;
  }
  cudaMalloc(&send, bytes);
  cudaMalloc(&expected, bytes * world);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  for (int i = 0; i < iters; i++) {
    tw_test_fill_bytes(send, bytes, (uint64_t)i * 1000 + rank, (tw_stream_t)stream);
    if (i % 10 == 0)
      tw_test_poison(recv, bytes * world, (tw_stream_t)stream);
    st = tw_allgather(comm, send, recv, bytes, (tw_stream_t)stream);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "rank %d: allgather: %s\n", rank, tw_comm_last_error(comm));
      failures++;
      break;
    }
    for (int src = 0; src < world; src++)
      tw_test_fill_bytes((char *)expected + src * bytes, bytes, (uint64_t)i * 1000 + src,
                         (tw_stream_t)stream);
    cudaStreamSynchronize(stream);
    size_t diff = tw_test_count_diff(recv, expected, bytes * world);
    if (diff) {
      fprintf(stderr, "rank %d iteration %d: %zu bytes differ\n", rank, i, diff);
      failures++;
      break;
    }
  }
  /* AllGather+GEMM: fused == tw_allgather + tw_gemm, bitwise, with fresh inputs each time. */
  const int64_t m_local = 200, n = 256, k = 512;
  void *g1 = NULL, *g2 = NULL, *shard = NULL, *b = NULL, *c1 = NULL, *c2 = NULL;
  const size_t shard_bytes = (size_t)m_local * k * 2, c_bytes = (size_t)m_local * world * n * 2;
  if (tw_mem_alloc(comm, shard_bytes * world, &g1) != TW_SUCCESS ||
      tw_mem_alloc(comm, shard_bytes * world, &g2) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: alloc: %s\n", rank, tw_comm_last_error(comm));
    failures++;
  }
  cudaMalloc(&shard, shard_bytes);
  cudaMalloc(&b, (size_t)n * k * 2);
  cudaMalloc(&c1, c_bytes);
  cudaMalloc(&c2, c_bytes);
  for (int i = 0; i < iters / 2 && !failures; i++) {
    tw_test_fill_bf16(shard, (size_t)m_local * k, (uint64_t)i * 77 + rank, (tw_stream_t)stream);
    tw_test_fill_bf16(b, (size_t)n * k, (uint64_t)i * 91 + rank, (tw_stream_t)stream);
    tw_test_poison(c1, c_bytes, (tw_stream_t)stream);
    tw_ag_gemm_args_t a = TW_AG_GEMM_ARGS_INIT;
    a.a = shard, a.b = b, a.c = c1, a.a_gathered = g1, a.m_local = m_local, a.n = n, a.k = k;
    if (distinct && i % 2) /* one process per GPU: the copy-engine mode too */
      a.comm_mode = TW_AG_COMM_COPY_ENGINE;
    st = tw_ag_gemm(comm, &a, (tw_stream_t)stream);
    if (st == TW_SUCCESS)
      st = tw_allgather(comm, shard, g2, shard_bytes, (tw_stream_t)stream);
    tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
    g.a = g2, g.b = b, g.c = c2, g.m = m_local * world, g.n = n, g.k = k;
    g.split_k = -1; /* what tw_ag_gemm's GEMM does where it runs unfused (few tiles, long K) */
    tw_comm_sm_budget(comm, &g.sm_count);
    if (st == TW_SUCCESS)
      st = tw_gemm(&g, (tw_stream_t)stream);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "rank %d: ag_gemm iteration %d: %s / %s\n", rank, i, tw_comm_last_error(comm),
              tw_last_error());
      failures++;
      break;
    }
    cudaStreamSynchronize(stream);
    size_t diff = tw_test_count_diff(c1, c2, c_bytes);
    if (diff) {
      fprintf(stderr, "rank %d ag_gemm iteration %d: %zu bytes differ from the unfused pipeline\n",
              rank, i, diff);
      failures++;
    }
  }
  cudaFree(shard), cudaFree(b), cudaFree(c1), cudaFree(c2);
  if (g1)
    tw_mem_free(comm, g1);
  if (g2)
    tw_mem_free(comm, g2);
  if (!failures)
    failures += check_gemm_rs(comm, rank, world, iters / 4 > 0 ? iters / 4 : 1, stream);
  if (!failures)
    failures += check_moe(comm, rank, world, iters / 10 > 0 ? iters / 10 : 1, stream);
  tw_status_t async = TW_SUCCESS;
  tw_comm_async_error(comm, &async);
  if (async != TW_SUCCESS) {
    fprintf(stderr, "rank %d: async error: %s\n", rank, tw_comm_last_error(comm));
    failures++;
  }
  ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    fprintf(stderr, "rank %d: %s\n", rank, cudaGetErrorString(ce));
    failures++;
  }
  tw_mem_free(comm, recv);
  tw_comm_destroy(comm);
  printf("rank %d (pid %d, sm budget %d, %d ranks on this host): %d allgather + %d ag_gemm "
         "iterations, %s\n",
         rank, (int)getpid(), budget, local_size, iters, iters / 2, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

/* A rank whose TW_RS_BAND differs (rank 1 sets it): tw_comm_init_rank fails on every rank,
 * naming the knob, instead of a later call waiting on flags or summing partials too early. */
static int run_mismatch(tw_unique_id_t id, int rank, int world, int device) {
  if (cudaSetDevice(device) != cudaSuccess)
    return 1;
  if (rank == 1)
    setenv("TW_RS_BAND", "3", 1);
  tw_comm_t comm = NULL;
  const tw_status_t st = tw_comm_init_rank(&comm, world, id, rank, NULL);
  const char *why = tw_last_error();
  if (st == TW_ERR_INVALID_ARGUMENT && why &&
      strstr(why, "TW_RS_BAND is 0 on rank 0 but 3 on rank 1")) {
    printf("rank %d: init refused as expected: %s\n", rank, why);
    return 0;
  }
  fprintf(stderr, "rank %d: init with TW_RS_BAND set on rank 1 only: status %d (%s)\n", rank,
          (int)st, why ? why : "");
  if (comm)
    tw_comm_destroy(comm);
  return 1;
}

/* ---- kill: a rank's process dies mid-call ---------------------------------------------------
 * Every rank bounds its device waits at kKillWaitMs (tw_config.wait_timeout_ms). After warm-up
 * tw_gemm_ar calls and a barrier, the last rank (the victim) SIGKILLs itself where it would make
 * the next tw_gemm_ar, which the others (the survivors) make: their kernels wait for a rank that
 * is gone. Per survivor: the call fails (TW_ERR_DEVICE_TIMEOUT where its own wait expired,
 * TW_ERR_ABORTED where a peer's abort ended it first) with a message, within a bound; the next
 * call fails at once; tw_comm_destroy returns; and the process's CUDA context stays usable
 * (the kernels give up and return; they do not trap). An alarm per step turns a hang into a
 * failure that names the step. */
enum { kKillWaitMs = 2000, kKillWarmups = 3, kKillBoundS = 180 };
/* The failed call: 10 wait bounds + 20 s (one bound is what it should take: a survivor's waits
 * after the first expired one end at once on the abort word). */
static const double kKillFailS = 10.0 * kKillWaitMs / 1000.0 + 20.0;
/* The next call: under one wait bound, which a call that waited for the dead rank again takes. */
static const double kKillNextS = kKillWaitMs / 1000.0;
static const double kKillDestroyS = 10.0;

static char kill_hang_msg[200];
static volatile sig_atomic_t kill_hang_len;

static void kill_on_alarm(int sig) {
  (void)sig;
  const ssize_t w = write(STDERR_FILENO, kill_hang_msg, (size_t)kill_hang_len);
  (void)w;
  _exit(3);
}

/* Arms the rank's alarm for its next step: if `what` has not finished within bound_s seconds,
 * the rank says so on stderr and exits 3. The bounds of a rank's steps add up to less than
 * kKillBoundS, so the rank names its hang before the parent kills it. */
static void kill_guard(int rank, const char *what, unsigned bound_s) {
  alarm(0);
  const int n =
      snprintf(kill_hang_msg, sizeof(kill_hang_msg),
               "FAIL rank %d: %s did not finish within %u s: a hang\n", rank, what, bound_s);
  kill_hang_len = n < 0 ? 0 : n < (int)sizeof(kill_hang_msg) ? n : (int)sizeof(kill_hang_msg) - 1;
  alarm(bound_s);
}

/* The test's operands (m above the decode sizes, so the fused kernel runs, on one GPU or
 * several), then kKillWarmups calls and a barrier, each of which must succeed. Returns the
 * number of failed checks. */
static int kill_warm_up(tw_comm_t comm, int rank, int world, tw_gemm_rs_args_t *args,
                        cudaStream_t stream) {
  const int failed0 = tw_test_failed;
  const int64_t m = 256 * (int64_t)world, n = 256, k = 512;
  size_t ws_bytes = 0;
  void *ws = NULL, *a = NULL, *b = NULL, *out = NULL;
  TEST_TW_OK(tw_gemm_rs_workspace_size(comm, m, n, &ws_bytes));
  TEST_TW_OK(tw_mem_alloc(comm, ws_bytes, &ws));
  TEST_ASSERT(cudaMalloc(&a, (size_t)m * k * 2) == cudaSuccess &&
                  cudaMalloc(&b, (size_t)n * k * 2) == cudaSuccess &&
                  cudaMalloc(&out, (size_t)m * n * 2) == cudaSuccess,
              "rank %d: cudaMalloc of the operands", rank);
  if (tw_test_failed > failed0)
    return tw_test_failed - failed0;
  args->a = a, args->b = b, args->out = out, args->workspace = ws;
  args->m = m, args->n = n, args->k = k;
  for (int i = 0; i < kKillWarmups; i++) {
    tw_test_fill_bf16(a, (size_t)m * k, (uint64_t)i * 131 + rank, (tw_stream_t)stream);
    tw_test_fill_bf16(b, (size_t)n * k, (uint64_t)i * 137 + rank, (tw_stream_t)stream);
    TEST_TW_OK(tw_gemm_ar(comm, args, (tw_stream_t)stream));
    const cudaError_t ce = cudaStreamSynchronize(stream);
    tw_status_t async = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(comm, &async));
    TEST_ASSERT(ce == cudaSuccess && async == TW_SUCCESS, "rank %d: warm-up call %d: %s / %s", rank,
                i, cudaGetErrorString(ce), tw_comm_last_error(comm));
  }
  TEST_TW_OK(tw_barrier(comm, (tw_stream_t)stream));
  TEST_ASSERT(cudaStreamSynchronize(stream) == cudaSuccess, "rank %d: the barrier", rank);
  return tw_test_failed - failed0;
}

/* One tw_gemm_ar and the synchronisation of its stream. Returns what the call reports: its own
 * status where it failed, else tw_comm_async_error's; *ce: the synchronisation's result,
 * *secs: the time from the call to there. */
static tw_status_t kill_call(tw_comm_t comm, const tw_gemm_rs_args_t *args, cudaStream_t stream,
                             cudaError_t *ce, double *secs) {
  const double t0 = tw_test_now();
  tw_status_t st = tw_gemm_ar(comm, args, (tw_stream_t)stream);
  *ce = st == TW_SUCCESS ? cudaStreamSynchronize(stream) : cudaSuccess;
  tw_status_t async = TW_SUCCESS;
  if (st == TW_SUCCESS && tw_comm_async_error(comm, &async) == TW_SUCCESS)
    st = async;
  *secs = tw_test_now() - t0;
  return st;
}

/* A survivor, once the victim is gone: the call that waits for it, the next call, then
 * tw_comm_destroy (comm is gone after it). */
static void kill_survive(tw_comm_t comm, int rank, int victim, const tw_gemm_rs_args_t *args,
                         cudaStream_t stream) {
  cudaError_t ce;
  double secs;
  kill_guard(rank, "tw_gemm_ar with a dead rank", (unsigned)kKillFailS + 10);
  const tw_status_t st = kill_call(comm, args, stream, &ce, &secs);
  char msg[512];
  snprintf(msg, sizeof(msg), "%s", tw_comm_last_error(comm));
  TEST_ASSERT(st == TW_ERR_DEVICE_TIMEOUT || st == TW_ERR_ABORTED,
              "rank %d: tw_gemm_ar with rank %d dead: %s (%s)", rank, victim, tw_status_string(st),
              msg);
  TEST_ASSERT(msg[0] != '\0', "rank %d: %s came with an empty message", rank, tw_status_string(st));
  TEST_ASSERT(ce == cudaSuccess, "rank %d: the call's stream failed: %s (a kernel trapped?)", rank,
              cudaGetErrorString(ce));
  TEST_ASSERT(secs < kKillFailS, "rank %d: the call failed only after %.1f s (bound %.0f s)", rank,
              secs, kKillFailS);
  printf("rank %d: tw_gemm_ar with rank %d dead: %s after %.2f s: %s\n", rank, victim,
         tw_status_string(st), secs, msg);

  kill_guard(rank, "the tw_gemm_ar after the failed one", 15);
  const tw_status_t next = kill_call(comm, args, stream, &ce, &secs);
  TEST_ASSERT(next != TW_SUCCESS, "rank %d: the call after the failed one succeeded", rank);
  TEST_ASSERT(ce == cudaSuccess, "rank %d: the next call's stream failed: %s", rank,
              cudaGetErrorString(ce));
  TEST_ASSERT(secs < kKillNextS, "rank %d: the next call failed only after %.2f s (bound %.1f s)",
              rank, secs, kKillNextS);
  printf("rank %d: the next tw_gemm_ar: %s after %.3f s\n", rank, tw_status_string(next), secs);

  kill_guard(rank, "tw_comm_destroy with a dead rank", (unsigned)kKillDestroyS + 10);
  const double t0 = tw_test_now();
  const tw_status_t destroyed = tw_comm_destroy(comm);
  secs = tw_test_now() - t0;
  TEST_ASSERT(secs < kKillDestroyS, "rank %d: tw_comm_destroy returned only after %.1f s", rank,
              secs);
  printf("rank %d: tw_comm_destroy: %s after %.3f s\n", rank, tw_status_string(destroyed), secs);
}

/* The process's CUDA context after the failure: memory can be allocated, set and read back. */
static void kill_check_context(int rank) {
  const size_t bytes = 1u << 20;
  void *p = NULL;
  unsigned char last = 0;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaSuccess)
    e = cudaMemset(p, 0x5a, bytes);
  if (e == cudaSuccess)
    e = cudaDeviceSynchronize();
  if (e == cudaSuccess)
    e = cudaMemcpy(&last, (char *)p + bytes - 1, 1, cudaMemcpyDeviceToHost);
  TEST_ASSERT(e == cudaSuccess && last == 0x5a,
              "rank %d: the CUDA context after the failure: %s (read back %#x)", rank,
              cudaGetErrorString(e), last);
  if (p)
    cudaFree(p);
}

static int run_kill(tw_unique_id_t id, int rank, int world, int device) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* the lines before an alarm's _exit reach a log file */
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = kill_on_alarm;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGALRM, &sa, NULL);
  const int failed0 = tw_test_failed, victim = world - 1;
  kill_guard(rank, "tw_comm_init_rank and the warm-up calls", 60);
  setenv("TW_WAIT_TRAP", "0", 1); /* an expired wait returns (a trap would end the context) */
  TEST_REQUIRE(cudaSetDevice(device) == cudaSuccess, "rank %d: cudaSetDevice(%d)", rank, device);
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.wait_timeout_ms = kKillWaitMs;
  tw_comm_t comm = NULL;
  const tw_status_t st = tw_comm_init_rank(&comm, world, id, rank, &cfg);
  TEST_REQUIRE(st == TW_SUCCESS, "rank %d: init: %s: %s", rank, tw_status_string(st),
               tw_last_error());
  cudaStream_t stream;
  TEST_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess,
               "rank %d: stream", rank);
  tw_gemm_rs_args_t args = TW_GEMM_RS_ARGS_INIT;
  if (kill_warm_up(comm, rank, world, &args, stream))
    return 1;
  if (rank == victim) {
    printf("rank %d (pid %d): warm-up done; killing itself instead of the next tw_gemm_ar\n", rank,
           (int)getpid());
    fflush(NULL);
    raise(SIGKILL);
    return 1; /* not reached */
  }
  kill_survive(comm, rank, victim, &args, stream);
  kill_guard(rank, "the CUDA context check", 15);
  kill_check_context(rank);
  cudaFree((void *)args.a), cudaFree((void *)args.b), cudaFree(args.out);
  cudaStreamDestroy(stream);
  alarm(0);
  const int failed = tw_test_failed > failed0;
  printf("rank %d (pid %d): survived rank %d's death: %s\n", rank, (int)getpid(), victim,
         failed ? "FAILED" : "ok");
  return failed;
}

typedef tw_test_rank_fn rank_fn_t;

/* Ranks in processes of their own that disagree on a call (rank 1 passes another n to
 * tw_gemm_rs): every rank's kernels end, well within the wait bound, with TW_ERR_MISMATCH naming
 * both values, the peer's description read through the heap mapping of another process. */
static int run_call_mismatch(tw_unique_id_t id, int rank, int world, int device) {
  if (cudaSetDevice(device) != cudaSuccess)
    return 1;
  tw_config_t cfg = TW_CONFIG_INIT;
  cfg.wait_timeout_ms = 4000;
  tw_comm_t comm = NULL;
  if (tw_comm_init_rank(&comm, world, id, rank, &cfg) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: init: %s\n", rank, tw_last_error());
    return 1;
  }
  const int64_t m = 256 * (int64_t)world, n = rank == 1 ? 128 : 256, k = 512;
  size_t ws_bytes = 0;
  void *ws = NULL, *a = NULL, *b = NULL, *out = NULL;
  int failures = tw_gemm_rs_workspace_size(comm, m, 256, &ws_bytes) != TW_SUCCESS ||
                 tw_mem_alloc(comm, ws_bytes, &ws) != TW_SUCCESS;
  cudaMalloc(&a, (size_t)(m * k * 2));
  cudaMalloc(&b, (size_t)(256 * k * 2));
  cudaMalloc(&out, (size_t)(m * 256 * 2));
  tw_test_fill_bf16(a, (size_t)(m * k), 1 + rank, NULL);
  tw_test_fill_bf16(b, (size_t)(256 * k), 7 + rank, NULL);
  cudaDeviceSynchronize();
  tw_gemm_rs_args_t args = TW_GEMM_RS_ARGS_INIT;
  args.a = a, args.b = b, args.out = out, args.workspace = ws, args.m = m, args.n = n, args.k = k;
  const double t0 = tw_test_now();
  if (!failures && tw_gemm_rs(comm, &args, NULL) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: tw_gemm_rs refused: %s\n", rank, tw_comm_last_error(comm));
    failures++;
  }
  const cudaError_t e = cudaDeviceSynchronize();
  const double waited = tw_test_now() - t0;
  tw_status_t async = TW_SUCCESS;
  tw_comm_async_error(comm, &async);
  const char *msg = tw_comm_last_error(comm);
  if (e != cudaSuccess || async != TW_ERR_MISMATCH || !strstr(msg, "n = 256") ||
      !strstr(msg, "n = 128") || waited > 2.0) {
    fprintf(stderr, "rank %d: after %.2f s: sync %s, async %s: %s\n", rank, waited,
            cudaGetErrorString(e), tw_status_string(async), msg);
    failures++;
  } else {
    printf("rank %d: mismatch named after %.3f s: %s\n", rank, waited, msg);
  }
  cudaFree(a), cudaFree(b), cudaFree(out);
  tw_mem_free(comm, ws);
  tw_comm_destroy(comm);
  return failures ? 1 : 0;
}

/* Forks `world` ranks running fn; every one must exit 0 within 240 s. */
static void run_ranks(int world, int ngpus, rank_fn_t fn, void *arg) {
  int st[TW_MAX_WORLD];
  const int killed = tw_test_fork_ranks(world, ngpus, fn, arg, 240, st);
  TEST_ASSERT(killed == 0, "%d rank(s) did not finish within 240 s: killed", killed);
  for (int r = 0; r < world; r++)
    TEST_ASSERT(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "rank %d exited with status %d", r,
                st[r]);
}

typedef struct {
  int iters, own_gpu;
} main_args_t;

static int main_rank(tw_unique_id_t id, int rank, int world, int device, void *arg) {
  const main_args_t *a = (const main_args_t *)arg;
  return run_rank(id, rank, world, a->iters, device, a->own_gpu);
}

static int call_mismatch_rank(tw_unique_id_t id, int rank, int world, int device, void *arg) {
  (void)arg;
  return run_call_mismatch(id, rank, world, device);
}

static int mismatch_rank(tw_unique_id_t id, int rank, int world, int device, void *arg) {
  (void)arg;
  return run_mismatch(id, rank, world, device);
}

static int kill_rank(tw_unique_id_t id, int rank, int world, int device, void *arg) {
  (void)arg;
  return run_kill(id, rank, world, device);
}

/* test_mp kill: the victim (the last rank) must die by its SIGKILL, every survivor exit 0. */
static void run_kill_ranks(int world, int ngpus) {
  int st[TW_MAX_WORLD];
  const int killed = tw_test_fork_ranks(world, ngpus, kill_rank, NULL, kKillBoundS, st);
  TEST_ASSERT(killed == 0, "%d rank(s) did not finish within %d s: killed", killed, kKillBoundS);
  const int victim = world - 1;
  TEST_ASSERT(WIFSIGNALED(st[victim]) && WTERMSIG(st[victim]) == SIGKILL,
              "the victim, rank %d, did not die by SIGKILL: exit code %d, signal %d", victim,
              WIFEXITED(st[victim]) ? WEXITSTATUS(st[victim]) : -1,
              WIFSIGNALED(st[victim]) ? WTERMSIG(st[victim]) : 0);
  for (int r = 0; r < victim; r++)
    TEST_ASSERT(
        WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "survivor rank %d: exit code %d, signal %d", r,
        WIFEXITED(st[r]) ? WEXITSTATUS(st[r]) : -1, WIFSIGNALED(st[r]) ? WTERMSIG(st[r]) : 0);
}

int main(int argc, char **argv) {
  setenv("CUDA_MODULE_LOADING", "EAGER",
         0); /* the ranks' own kernels: see tw_test_require_hopper */
  const int kill_mode = argc > 1 && strcmp(argv[1], "kill") == 0;
  if (kill_mode)
    argc--, argv++;
  int world = argc > 1 ? atoi(argv[1]) : 4;
  int iters = argc > 2 ? atoi(argv[2]) : 100;
  if (kill_mode && (world < 2 || world > TW_MAX_WORLD)) {
    fprintf(stderr, "test_mp kill: world %d; expected 2..%d (a victim and a survivor)\n", world,
            TW_MAX_WORLD);
    return 1;
  }
  /* Probe the GPU in a child: CUDA must not be initialised in the parent before fork. */
  pid_t probe = fork();
  if (probe == 0) {
    int n = tw_test_require_hopper();
    _exit(n > 0 && n < 100 ? n : 1);
  }
  int status = 0;
  waitpid(probe, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 77) {
    printf("SKIP: no Hopper GPU\n");
    return 77;
  }
  int ngpus = WEXITSTATUS(status);
  if (ngpus < world && !getenv("CUDA_MPS_PIPE_DIRECTORY") && !getenv("TW_TEST_ALLOW_NO_MPS")) {
    printf("SKIP: %d processes would share %d GPU(s) without MPS (start MPS as "
           "scripts/gpu-suite.sh does, or set TW_TEST_ALLOW_NO_MPS=1)\n",
           world, ngpus);
    return 77;
  }
  if (kill_mode) {
    run_kill_ranks(world, ngpus);
    return tw_test_finish();
  }
  main_args_t args = {iters, world <= ngpus};
  run_ranks(world, ngpus, main_rank, &args);
  run_ranks(2, ngpus, mismatch_rank, NULL);
  run_ranks(world < 3 ? world : 3, ngpus, call_mismatch_rank, NULL);
  return tw_test_finish();
}
