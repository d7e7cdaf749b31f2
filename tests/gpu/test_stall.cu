/*
 * The GEMM core's pipeline waits are bounded (docs/ARCHITECTURE.md, "Pipeline waits are
 * bounded too"): with TW_FAULT_STALL_TILE=2 the producer of the CTA that takes tile 2 never
 * loads that tile's first stage, so the consumers' wait for it can only expire. The kernel then
 * traps, which ends the CUDA context, so every case runs in a child process of its own:
 *   - tw_gemm, unsplit and with split_k 8: the next synchronisation fails, within seconds;
 *   - tw_ag_gemm, tw_gemm_rs, tw_gemm_ar on 2 ranks (virtual ranks on one GPU, or with
 *     TW_TEST_DEVICES=distinct one GPU each): the synchronisation fails too, and
 *     tw_comm_async_error reports TW_ERR_DEVICE_TIMEOUT with "internal stall in the GEMM
 *     pipeline", the role and the stage, from the comm's host-mapped error block.
 *   - the unfused tw_gemm_rs / tw_gemm_ar (decode shapes) with a peer that never calls: the
 *     wait for its rows in the low-latency area (or, with TW_RS_UNFUSED_LL=0, for its entry;
 *     or, tw_gemm_rs at m 16 with TW_RS_LL_REDUCE=1, the GEMM epilogue's wait for them) gives
 *     up after TW_WAIT_TIMEOUT_MS and the comm names it.
 * The parent kills a child that outlives its bound (30 s): a hang fails the test, and so does a
 * child that finishes without the failure. Without a GPU every child exits 77 and so does this.
 */
#include <cuda_runtime.h>

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tw_test.h"

enum { kWorld = 2, kBoundS = 30 };

typedef enum {
  OP_GEMM,
  OP_GEMM_SPLIT,
  OP_AG_GEMM,
  OP_GEMM_RS,
  OP_GEMM_AR,
  OP_RS_ABSENT,
  OP_AR_ABSENT,
  OP_RS_ABSENT_PULL,
  OP_AR_ABSENT_PULL,
  OP_RS_ABSENT_EPI
} op_t;
static const char *const kOpNames[] = {"tw_gemm",
                                       "tw_gemm split_k 8",
                                       "tw_ag_gemm",
                                       "tw_gemm_rs",
                                       "tw_gemm_ar",
                                       "tw_gemm_rs unfused, peer absent",
                                       "tw_gemm_ar unfused, peer absent",
                                       "tw_gemm_rs unfused (the pull), peer absent",
                                       "tw_gemm_ar unfused (the pull), peer absent",
                                       "tw_gemm_rs unfused (the epilogue's sums), peer absent"};

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  TEST_REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess, "cudaMalloc(%zu)", bytes);
  return p;
}

/* The synchronisation after a stalled kernel must fail, within the bound. */
static void expect_failed_sync(cudaStream_t stream, int device, double t0, const char *what) {
  cudaSetDevice(device);
  cudaError_t e = cudaStreamSynchronize(stream);
  const double waited = tw_test_now() - t0;
  TEST_ASSERT(e != cudaSuccess, "%s: the stalled kernel finished without an error", what);
  /* Measured: 3.7 s with one GPU, 7.1 s with two (each context's trap and teardown). */
  TEST_ASSERT(waited < 20.0, "%s: failed only after %.1f s", what, waited);
  printf("  %s: synchronisation failed after %.2f s: %s\n", what, waited, cudaGetErrorString(e));
}

/* split: K over clusters of 8 CTAs (decode-sized: 8 tiles of 128 x 128, K 8192); the stalled
 * slice's consumers trap, and its reader's wait for its accumulators is bounded alike. */
static int child_gemm(int split) {
  const int64_t m = split ? 64 : 1024, n = 1024, k = split ? 8192 : 1024;
  void *a = dev_alloc(m * k * 2), *b = dev_alloc(n * k * 2), *c = dev_alloc(m * n * 2);
  tw_test_fill_bf16(a, m * k, 1, NULL);
  tw_test_fill_bf16(b, n * k, 2, NULL);
  TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "inputs");
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.a = a, g.b = b, g.c = c, g.m = m, g.n = n, g.k = k;
  g.split_k = split;
  const double t0 = tw_test_now();
  TEST_TW_OK(tw_gemm(&g, NULL));
  expect_failed_sync(NULL, 0, t0, kOpNames[split ? OP_GEMM_SPLIT : OP_GEMM]);
  return tw_test_finish();
}

/* kWorld ranks on distinct GPUs (TW_TEST_DEVICES=distinct) or one; returns whether distinct. */
static int init_pair(int devices[kWorld], tw_comm_t comms[kWorld]) {
  const int distinct = tw_test_devices(kWorld, devices);
  tw_status_t st = tw_comm_init_all(comms, kWorld, devices, NULL);
  TEST_REQUIRE(st == TW_SUCCESS, "init_all: %s", tw_last_error());
  return distinct;
}

static int child_fused(op_t op) {
  int devices[kWorld];
  tw_comm_t comms[kWorld];
  const int distinct = init_pair(devices, comms);
  const int64_t m_local = 512, n = 1024, k = 1024, m = m_local * kWorld;
  cudaStream_t streams[kWorld];
  tw_ag_gemm_args_t ag[kWorld];
  tw_gemm_rs_args_t rs[kWorld];
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_gemm_rs_workspace_size(comms[0], m, n, &ws_bytes));
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(devices[r]);
    TEST_REQUIRE(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking) == cudaSuccess,
                 "stream");
    if (op == OP_AG_GEMM) {
      tw_ag_gemm_args_t a = TW_AG_GEMM_ARGS_INIT;
      a.a = dev_alloc(m_local * k * 2), a.b = dev_alloc(n * k * 2), a.c = dev_alloc(m * n * 2);
      TEST_TW_OK(tw_mem_alloc(comms[r], (size_t)(m * k * 2), &a.a_gathered));
      a.m_local = m_local, a.n = n, a.k = k;
      tw_test_fill_bf16((void *)a.a, m_local * k, 10 + r, NULL);
      tw_test_fill_bf16((void *)a.b, n * k, 20 + r, NULL);
      ag[r] = a;
    } else {
      tw_gemm_rs_args_t a = TW_GEMM_RS_ARGS_INIT;
      a.a = dev_alloc(m * k * 2), a.b = dev_alloc(n * k * 2), a.out = dev_alloc(m * n * 2);
      TEST_TW_OK(tw_mem_alloc(comms[r], ws_bytes, &a.workspace));
      a.m = m, a.n = n, a.k = k;
      tw_test_fill_bf16((void *)a.a, m * k, 10 + r, NULL);
      tw_test_fill_bf16((void *)a.b, n * k, 20 + r, NULL);
      rs[r] = a;
    }
    TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "inputs");
  }
  const double t0 = tw_test_now();
  for (int r = 0; r < kWorld; r++) {
    cudaSetDevice(devices[r]);
    tw_stream_t s = (tw_stream_t)streams[r];
    TEST_TW_OK(op == OP_AG_GEMM   ? tw_ag_gemm(comms[r], &ag[r], s)
               : op == OP_GEMM_RS ? tw_gemm_rs(comms[r], &rs[r], s)
                                  : tw_gemm_ar(comms[r], &rs[r], s));
  }
  for (int r = 0; r < kWorld; r++) {
    char what[64];
    snprintf(what, sizeof(what), "%s rank %d", kOpNames[op], r);
    expect_failed_sync(streams[r], devices[r], t0, what);
  }
  /* Every rank withheld its tile 2 and records its own stall, unless the first trap ended its
   * kernel before (virtual ranks share one context) or it saw the abort a peer raised first.
   * At least one says where the pipeline stalled. */
  int reported = 0;
  for (int r = 0; r < kWorld; r++) {
    tw_status_t async = TW_SUCCESS;
    TEST_TW_OK(tw_comm_async_error(comms[r], &async));
    const char *msg = tw_comm_last_error(comms[r]);
    TEST_ASSERT(async == TW_SUCCESS || async == TW_ERR_DEVICE_TIMEOUT || async == TW_ERR_ABORTED,
                "%s rank %d: async status %s (%s)", kOpNames[op], r, tw_status_string(async), msg);
    if (async == TW_ERR_DEVICE_TIMEOUT && strstr(msg, "internal stall in the GEMM pipeline") &&
        strstr(msg, "stage") && strstr(msg, "500 ms: TW_FAULT_STALL_TILE")) {
      reported++;
      printf("  %s rank %d (%s): %s\n", kOpNames[op], r, distinct ? "distinct GPUs" : "one GPU",
             msg);
    }
  }
  TEST_ASSERT(reported >= 1, "%s: no rank reported the pipeline stall", kOpNames[op]);
  return tw_test_finish();
}

/* The unfused pipeline (TW_RS_UNFUSED_SMALL=1, decode-sized) on 2 ranks of which only rank 0
 * calls: its reduce kernel's wait for rank 1's entry gives up after TW_WAIT_TIMEOUT_MS (no
 * TW_FAULT_STALL_TILE here), the call's stream still completes, and the comm reports the flag,
 * the op and the peer that never signalled. */
static int child_absent(op_t op) {
  int devices[kWorld];
  tw_comm_t comms[kWorld];
  const int distinct = init_pair(devices, comms);
  const int64_t m = op == OP_RS_ABSENT_EPI ? 16 : 64, n = 1024, k = 1024;
  size_t ws_bytes = 0;
  TEST_TW_OK(tw_gemm_rs_workspace_size(comms[0], m, n, &ws_bytes));
  void *ws[kWorld];
  for (int r = 0; r < kWorld; r++)
    TEST_TW_OK(tw_mem_alloc(comms[r], ws_bytes, &ws[r]));
  cudaSetDevice(devices[0]);
  tw_gemm_rs_args_t a = TW_GEMM_RS_ARGS_INIT;
  a.a = dev_alloc(m * k * 2), a.b = dev_alloc(n * k * 2), a.out = dev_alloc(m * n * 2);
  a.workspace = ws[0];
  a.m = m, a.n = n, a.k = k;
  tw_test_fill_bf16((void *)a.a, m * k, 10, NULL);
  tw_test_fill_bf16((void *)a.b, n * k, 20, NULL);
  TEST_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "inputs");
  const double t0 = tw_test_now();
  const int rs = op == OP_RS_ABSENT || op == OP_RS_ABSENT_PULL || op == OP_RS_ABSENT_EPI;
  TEST_TW_OK(rs ? tw_gemm_rs(comms[0], &a, NULL) : tw_gemm_ar(comms[0], &a, NULL));
  const cudaError_t e = cudaDeviceSynchronize();
  const double waited = tw_test_now() - t0;
  TEST_ASSERT(e == cudaSuccess, "%s: the call's kernels failed: %s", kOpNames[op],
              cudaGetErrorString(e));
  TEST_ASSERT(waited < 20.0, "%s: returned only after %.1f s", kOpNames[op], waited);
  tw_status_t async = TW_SUCCESS;
  TEST_TW_OK(tw_comm_async_error(comms[0], &async));
  const char *msg = tw_comm_last_error(comms[0]);
  TEST_ASSERT(async == TW_ERR_DEVICE_TIMEOUT, "%s: async status %s (%s)", kOpNames[op],
              tw_status_string(async), msg);
  TEST_ASSERT(strstr(msg, "peer expected to signal: 1") &&
                  strstr(msg, rs ? "op gemm_rs" : "op gemm_ar"),
              "%s: the report names neither the op nor the absent peer: %s", kOpNames[op], msg);
  printf("  %s (%s), after %.2f s: %s\n", kOpNames[op], distinct ? "distinct GPUs" : "one GPU",
         waited, msg);
  return tw_test_finish();
}

/* Runs one case in a child; returns its exit code (1 if it hung or died by a signal). */
static int run_child(op_t op) {
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  TEST_REQUIRE(pid >= 0, "fork");
  if (pid == 0) {
    const int absent = op >= OP_RS_ABSENT;
    if (absent) {
      setenv("TW_RS_UNFUSED_SMALL", "1", 1);
      if (op == OP_RS_ABSENT_PULL || op == OP_AR_ABSENT_PULL)
        setenv("TW_RS_UNFUSED_LL", "0", 1);
      if (op == OP_RS_ABSENT_EPI) /* the own rows' sums in the swap-AB GEMM's epilogue */
        setenv("TW_RS_LL_REDUCE", "1", 1);
      setenv("TW_WAIT_TIMEOUT_MS", "2000", 1);
    } else {
      setenv("TW_FAULT_STALL_TILE", "2", 1);
      setenv("TW_WAIT_TIMEOUT_MS", "3000", 1); /* flag waits give up later than the pipeline's */
    }
    /* the fused kernel's report is what is tested: at this shape (64 tiles, K 1024) tw_ag_gemm
     * would otherwise run tw_allgather + a split-K tw_gemm, whose stall is child_gemm's case */
    setenv("TW_AG_UNFUSED_SMALL", "0", 1);
    tw_test_require_hopper();
    const int rc = op == OP_GEMM         ? child_gemm(0)
                   : op == OP_GEMM_SPLIT ? child_gemm(8)
                   : absent              ? child_absent(op)
                                         : child_fused(op);
    fflush(stdout);
    fflush(stderr);
    _exit(rc);
  }
  int status = 0;
  char what[64];
  snprintf(what, sizeof(what), "%s child", kOpNames[op]);
  if (tw_test_wait_children(&pid, 1, kBoundS, &status, what))
    return 1; /* a hang */
  if (!WIFEXITED(status)) {
    fprintf(stderr, "FAIL %s: child died by signal %d\n", kOpNames[op],
            WIFSIGNALED(status) ? WTERMSIG(status) : -1);
    return 1;
  }
  return WEXITSTATUS(status);
}

int main(void) {
  /* No CUDA call here before the children run: a CUDA context does not survive fork. */
  static const op_t ops[] = {OP_GEMM,           OP_GEMM_SPLIT,   OP_AG_GEMM,   OP_GEMM_RS,
                             OP_GEMM_AR,        OP_RS_ABSENT,    OP_AR_ABSENT, OP_RS_ABSENT_PULL,
                             OP_AR_ABSENT_PULL, OP_RS_ABSENT_EPI};
  for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
    printf("%s%s:\n", kOpNames[ops[i]], ops[i] < OP_RS_ABSENT ? " with TW_FAULT_STALL_TILE=2" : "");
    const int rc = run_child(ops[i]);
    if (rc == 77)
      return 77; /* the child said why */
    TEST_ASSERT(rc == 0, "%s: child exit code %d", kOpNames[ops[i]], rc);
  }
  return tw_test_finish();
}
