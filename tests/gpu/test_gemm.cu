/*
 * tw_gemm (the sm90 GEMM core) against the fp32 reference and cuBLAS on fresh random inputs
 * with poisoned outputs; tails in M and N, short and long K, bf16 and fp32 out; strided
 * operands; error paths; SM budgets, tile orders and the dynamic tile queue (also under CUDA
 * graph replay) must give bitwise the C of the default run. The core's hooks, as a fused op
 * uses them: test_gemm_hooks.cu.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_sm90.cuh"
#include "ops/gemm/gemm_sm90.h"
#include "ref/ref_gemm.h"
#include "tw_test.h"

static cudaStream_t stream;
static tw_ref_blas_t *blas;
static uint64_t seed;

// Counts elements of a strided bf16 C that differ from the packed one (bitwise), plus padding
// elements that are no longer the poison pattern.
static __global__ void strided_diff_kernel(const uint16_t *strided, const uint16_t *packed,
                                           int64_t m, int64_t n, int64_t ldc,
                                           unsigned long long *bad) {
  unsigned long long nb = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < m * ldc;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / ldc, c = i % ldc;
    nb += c < n ? strided[i] != packed[r * n + c] : strided[i] != 0xFFFF;
  }
  if (nb)
    atomicAdd(bad, nb);
}

static tw_gemm_args_t make_args(const void *a, const void *b, void *c, tw_dtype_t dt, int64_t m,
                                int64_t n, int64_t k) {
  tw_gemm_args_t args = TW_GEMM_ARGS_INIT;
  args.a = a;
  args.b = b;
  args.c = c;
  args.c_dtype = dt;
  args.m = m;
  args.n = n;
  args.k = k;
  return args;
}

typedef struct buffers {
  __nv_bfloat16 *a, *b;
  void *c, *c2, *c3, *cref_bf16;
  float *ref;
} buffers_t;

// Fresh random A [m, k] and B [n, k] and their fp32 product in buf->ref; returns m * n.
static size_t fill_with_ref(const buffers_t *buf, int64_t m, int64_t n, int64_t k) {
  tw_test_fill_bf16(buf->a, (size_t)(m * k), seed++, stream);
  tw_test_fill_bf16(buf->b, (size_t)(n * k), seed++, stream);
  TEST_TW_OK(tw_ref_gemm_fp32(buf->a, buf->b, buf->ref, m, n, k, k, k, n, stream));
  return (size_t)(m * n);
}

// One shape: bf16 and fp32 out against the fp32 reference; bf16 against cuBLAS.
static void check_shape(const buffers_t *buf, int64_t m, int64_t n, int64_t k) {
  const size_t count = fill_with_ref(buf, m, n, k);
  size_t bad = 0;

  tw_test_poison(buf->c, count * 2, stream);
  tw_gemm_args_t args = make_args(buf->a, buf->b, buf->c, TW_BF16, m, n, k);
  TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
  double err = tw_test_rel_err_bf16(buf->c, buf->ref, 1, count, &bad);
  TEST_ASSERT(err < 1e-2 && bad == 0, "bf16 M=%lld N=%lld K=%lld: rel err %.3g, %zu NaN/unwritten",
              (long long)m, (long long)n, (long long)k, err, bad);

  tw_test_poison(buf->cref_bf16, count * 2, stream);
  TEST_TW_OK(tw_ref_cublas_gemm(blas, buf->a, buf->b, buf->cref_bf16, TW_BF16, m, n, k, k, k, n, 0,
                                stream));
  double err_blas = tw_test_rel_err_bf16(buf->c, buf->cref_bf16, 0, count, &bad);
  TEST_ASSERT(err_blas < 1e-2 && bad == 0, "bf16 vs cuBLAS M=%lld N=%lld K=%lld: rel err %.3g",
              (long long)m, (long long)n, (long long)k, err_blas);

  tw_test_poison(buf->c2, count * 4, stream);
  args = make_args(buf->a, buf->b, buf->c2, TW_FP32, m, n, k);
  TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
  double err32 = tw_test_rel_err_fp32((const float *)buf->c2, buf->ref, count, &bad);
  TEST_ASSERT(err32 < 1e-3 && bad == 0, "fp32 M=%lld N=%lld K=%lld: rel err %.3g, %zu NaN",
              (long long)m, (long long)n, (long long)k, err32, bad);

  // Every kernel variant computes each tile the same way: bitwise the default's C.
  for (int v = 0; v < TW_GEMM_V_COUNT; v++) {
    tw_gemm_sm90_opts_t opts = {v, 0, 0};
    for (int fp32 = 0; fp32 < 2; fp32++) {
      tw_test_poison(buf->c3, count * 4, stream);
      args = make_args(buf->a, buf->b, buf->c3, fp32 ? TW_FP32 : TW_BF16, m, n, k);
      TEST_TW_OK(tw_gemm_sm90_launch(&args, (tw_stream_t)stream, &opts));
      size_t diff = tw_test_count_diff(buf->c3, fp32 ? buf->c2 : buf->c, count * (fp32 ? 4 : 2));
      TEST_ASSERT(diff == 0, "variant %d %s M=%lld N=%lld K=%lld: %zu bytes differ from default", v,
                  fp32 ? "fp32" : "bf16", (long long)m, (long long)n, (long long)k, diff);
    }
  }
  printf("M=%-5lld N=%-5lld K=%-5lld  bf16 %.2e (cuBLAS %.2e)  fp32 %.2e\n", (long long)m,
         (long long)n, (long long)k, err, err_blas, err32);
}

static void check_errors(const buffers_t *buf) {
  tw_gemm_args_t args = make_args(buf->a, buf->b, buf->c, TW_BF16, 128, 256, 64);
  tw_gemm_args_t bad = args;
  TEST_TW_FAILS(tw_gemm(NULL, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "args");
  bad = args, bad.a = NULL;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "a is NULL");
  bad = args, bad.b = NULL;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "b is NULL");
  bad = args, bad.c = NULL;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "c is NULL");
  bad = args, bad.k = 60;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "k is 60");
  bad = args, bad.n = 252;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "n is 252");
  bad = args, bad.m = 0;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "m is 0");
  bad = args, bad.m = -5;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "m is -5");
  bad = args, bad.ldc = 200;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "ldc is 200");
  bad = args, bad.lda = 32;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "lda is 32");
  bad = args, bad.ldb = 68;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "ldb is 68");
  bad = args, bad.a = buf->a + 1;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "a (");
  bad = args, bad.c = (char *)buf->c + 8;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "c (");
  bad = args, bad.c_dtype = TW_FP16;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "c_dtype");
  bad = args, bad.sm_count = 100000;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "sm_count");
  bad = args, bad.tile_order = 7;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "tile_order");
  bad = args, bad.tile_order = TW_TILE_ORDER_ROTATED, bad.rotate_start = 128;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "rotate_start");
  bad = args, bad.size = 8;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "size");
  bad = args, bad.split_k = 3;
  TEST_TW_FAILS(tw_gemm(&bad, (tw_stream_t)stream), TW_ERR_INVALID_ARGUMENT, "split_k");
  tw_gemm_sm90_opts_t queue = {-1, 1, 0};
  /* K of 2 blocks: a split of 2 stands (K = 64 would halve it to none, and launch) */
  bad = make_args(buf->a, buf->b, buf->c, TW_BF16, 128, 256, 128), bad.split_k = 2;
  TEST_TW_FAILS(tw_gemm_sm90_launch(&bad, (tw_stream_t)stream, &queue), TW_ERR_INVALID_ARGUMENT,
                "static schedule");
  tw_gemm_args_t init;
  TEST_TW_OK(tw_gemm_args_init(&init));
  TEST_ASSERT(init.size == sizeof(init) && init.version == TW_GEMM_ARGS_VERSION, "args_init");
  // Nothing was launched by the failing calls: the stream is still healthy.
  TEST_ASSERT(cudaStreamSynchronize(stream) == cudaSuccess, "stream after error paths");
}

// Split-K (args.split_k): against the fp32 reference (bf16 and fp32 out, poisoned C), the same
// bits on a second run and under another SM budget (the slices' sum has a fixed order), and
// -1's choice (tw_gemm_auto_split) where it splits and where it does not; a split asked for
// beyond the K blocks runs with fewer slices.
static void check_split(const buffers_t *buf, int64_t m, int64_t n, int64_t k, int split) {
  const size_t count = fill_with_ref(buf, m, n, k);
  for (int fp32 = 0; fp32 < 2; fp32++) {
    const size_t bytes = count * (fp32 ? 4 : 2);
    void *out[2] = {buf->c, buf->c3};
    for (int run = 0; run < 2; run++) {
      tw_test_poison(out[run], bytes, stream);
      tw_gemm_args_t args = make_args(buf->a, buf->b, out[run], fp32 ? TW_FP32 : TW_BF16, m, n, k);
      args.split_k = split;
      args.sm_count = run ? 66 : 0; // a second run under half the SMs: fewer clusters at once
      TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
    }
    size_t bad = 0;
    const double err = fp32 ? tw_test_rel_err_fp32((const float *)buf->c, buf->ref, count, &bad)
                            : tw_test_rel_err_bf16(buf->c, buf->ref, 1, count, &bad);
    TEST_ASSERT(err < (fp32 ? 1e-3 : 1e-2) && bad == 0,
                "split_k %d %s M=%lld N=%lld K=%lld: rel err %.3g, %zu NaN/unwritten", split,
                fp32 ? "fp32" : "bf16", (long long)m, (long long)n, (long long)k, err, bad);
    const size_t diff = tw_test_count_diff(buf->c, buf->c3, bytes);
    TEST_ASSERT(diff == 0, "split_k %d %s M=%lld N=%lld K=%lld: %zu bytes differ between runs",
                split, fp32 ? "fp32" : "bf16", (long long)m, (long long)n, (long long)k, diff);
    printf("split_k %2d M=%-5lld N=%-5lld K=%-5lld  %s rel err %.2e\n", split, (long long)m,
           (long long)n, (long long)k, fp32 ? "fp32" : "bf16", err);
  }
}

// Swap-AB into a strided bf16 C (ldc = n + 8): equal to the packed C in buf->c, and the 8
// padding columns of every row keep their poison.
static void check_swap_strided(const buffers_t *buf, int64_t m, int64_t n, int64_t k, int split) {
  const int64_t ldc = n + 8;
  tw_gemm_args_t args = make_args(buf->a, buf->b, buf->c2, TW_BF16, m, n, k);
  args.split_k = split;
  args.ldc = ldc;
  tw_test_poison(buf->c2, (size_t)(m * ldc) * 2, stream);
  TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
  unsigned long long *nbad = NULL, host = 0;
  TEST_CUDA_OK(cudaMalloc(&nbad, sizeof(*nbad)));
  TEST_CUDA_OK(cudaMemsetAsync(nbad, 0, sizeof(*nbad), stream));
  strided_diff_kernel<<<256, 256, 0, stream>>>((const uint16_t *)buf->c2, (const uint16_t *)buf->c,
                                               m, n, ldc, nbad);
  TEST_CUDA_OK(cudaMemcpyAsync(&host, nbad, sizeof(host), cudaMemcpyDeviceToHost, stream));
  TEST_CUDA_OK(cudaStreamSynchronize(stream));
  cudaFree(nbad);
  TEST_ASSERT(host == 0, "swap-AB split_k %d M=%lld N=%lld K=%lld ldc %lld: %llu elements wrong",
              split, (long long)m, (long long)n, (long long)k, (long long)ldc, host);
}

// Swap-AB (tw_gemm at m <= 64 by default, TW_GEMM_SWAP read per call): C^T = B A^T on tiles of
// 128 of B's rows, C stored transposed. Against 128-row tiles (TW_GEMM_SWAP=0) bitwise (the same
// products summed in the same k order; split-K: the same slices and tree), bf16 and fp32 out,
// all SMs and 66, and into a strided C whose padding must keep its poison; and the fp32
// reference.
static void check_swap(const buffers_t *buf, int64_t m, int64_t n, int64_t k, int split) {
  const size_t count = fill_with_ref(buf, m, n, k);
  for (int fp32 = 0; fp32 < 2; fp32++) {
    const size_t bytes = count * (fp32 ? 4 : 2);
    tw_gemm_args_t args = make_args(buf->a, buf->b, buf->c, fp32 ? TW_FP32 : TW_BF16, m, n, k);
    args.split_k = split;
    tw_test_poison(buf->c, bytes, stream);
    setenv("TW_GEMM_SWAP", "0", 1);
    TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
    unsetenv("TW_GEMM_SWAP");
    /* the rule on every SM and on 66, then the swap's 128-row and 64-row tiles forced
     * (TW_GEMM_SWAP=1, 2; 64-row tiles only unsplit: with slices =2 is =1) */
    static const char *const swap_env[4] = {NULL, NULL, "1", "2"};
    for (int run = 0; run < 4; run++) {
      args.c = buf->c3;
      args.sm_count = run == 1 ? 66 : 0;
      tw_test_poison(buf->c3, bytes, stream);
      if (swap_env[run])
        setenv("TW_GEMM_SWAP", swap_env[run], 1);
      TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
      unsetenv("TW_GEMM_SWAP");
      const size_t diff = tw_test_count_diff(buf->c, buf->c3, bytes);
      TEST_ASSERT(diff == 0,
                  "swap-AB split_k %d %s M=%lld N=%lld K=%lld sm_count %d TW_GEMM_SWAP=%s: %zu "
                  "bytes differ from 128-row tiles",
                  split, fp32 ? "fp32" : "bf16", (long long)m, (long long)n, (long long)k,
                  (int)args.sm_count, swap_env[run] ? swap_env[run] : "(rule)", diff);
    }
    size_t bad = 0;
    const double err = fp32 ? tw_test_rel_err_fp32((const float *)buf->c3, buf->ref, count, &bad)
                            : tw_test_rel_err_bf16(buf->c3, buf->ref, 1, count, &bad);
    TEST_ASSERT(err < (fp32 ? 1e-3 : 1e-2) && bad == 0,
                "swap-AB split_k %d %s M=%lld N=%lld K=%lld: rel err %.3g, %zu NaN/unwritten",
                split, fp32 ? "fp32" : "bf16", (long long)m, (long long)n, (long long)k, err, bad);

    if (!fp32)
      check_swap_strided(buf, m, n, k, split); /* against buf->c, the 128-row tiles' bf16 C */
  }
  printf("swap-AB split_k %2d M=%-5lld N=%-5lld K=%-5lld: bitwise the 128-row tiles' (rule, 66 "
         "SMs, 128- and 64-row swap tiles)\n",
         split, (long long)m, (long long)n, (long long)k);
}

// split_k -1 with a workspace (tw_gemm_args_t.workspace): the tree's slices as single CTAs on
// 64-row tiles must give bitwise the cluster tree's C (bf16 and fp32 out), under 66 SMs too
// (tiles per CTA), from a CUDA graph, and after 100 back-to-back calls; the workspace's counters
// are zero again after every call; and the fp32 reference.
static void *g_ws; /* TW_GEMM_WORKSPACE_BYTES, zeroed once */
// `slices`: tw_gemm_ws_split's for the shape (test_plans_gemm checks the rule), for the messages.
static void check_split_ws(const buffers_t *buf, int64_t m, int64_t n, int64_t k, int slices) {
  const size_t count = fill_with_ref(buf, m, n, k);
  for (int fp32 = 0; fp32 < 2; fp32++) {
    const size_t bytes = count * (fp32 ? 4 : 2);
    tw_gemm_args_t args = make_args(buf->a, buf->b, buf->c, fp32 ? TW_FP32 : TW_BF16, m, n, k);
    args.split_k = -1;
    tw_test_poison(buf->c, bytes, stream);
    TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream)); /* the cluster tree */
    args.c = buf->c3;
    args.workspace = g_ws, args.workspace_bytes = TW_GEMM_WORKSPACE_BYTES;
    for (int run = 0; run < 4; run++) {
      args.sm_count = run == 1 ? 66 : 0;
      tw_test_poison(buf->c3, bytes, stream);
      if (run == 2) { /* from a graph, replayed twice */
        cudaGraph_t g;
        cudaGraphExec_t exec;
        TEST_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
        TEST_CUDA_OK(cudaStreamEndCapture(stream, &g));
        TEST_CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
        TEST_CUDA_OK(cudaGraphLaunch(exec, stream));
        TEST_CUDA_OK(cudaGraphLaunch(exec, stream));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(g);
      } else {
        for (int i = 0; i < (run == 3 ? 100 : 1); i++)
          TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
      }
      const size_t diff = tw_test_count_diff(buf->c, buf->c3, bytes);
      TEST_ASSERT(diff == 0,
                  "workspace split %d %s M=%lld N=%lld K=%lld run %d: %zu bytes differ from the "
                  "cluster tree's",
                  slices, fp32 ? "fp32" : "bf16", (long long)m, (long long)n, (long long)k, run,
                  diff);
      uint32_t counters[1024]; /* the counter block's 4 KiB (gemm_heuristics.h) */
      TEST_CUDA_OK(cudaMemcpy(counters, g_ws, sizeof(counters), cudaMemcpyDeviceToHost));
      size_t nonzero = 0;
      for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++)
        nonzero += counters[i] != 0;
      TEST_ASSERT(nonzero == 0, "workspace split M=%lld N=%lld: %zu counters left nonzero",
                  (long long)m, (long long)n, nonzero);
    }
    size_t bad = 0;
    const double err = fp32 ? tw_test_rel_err_fp32((const float *)buf->c3, buf->ref, count, &bad)
                            : tw_test_rel_err_bf16(buf->c3, buf->ref, 1, count, &bad);
    TEST_ASSERT(err < (fp32 ? 1e-3 : 1e-2) && bad == 0,
                "workspace split %s M=%lld N=%lld K=%lld: rel err %.3g, %zu NaN/unwritten",
                fp32 ? "fp32" : "bf16", (long long)m, (long long)n, (long long)k, err, bad);
  }
  printf("workspace split %d M=%-5lld N=%-5lld K=%-5lld: bitwise the cluster tree's (66 SMs, "
         "graph, 100 calls), counters zero\n",
         slices, (long long)m, (long long)n, (long long)k);
}

// A late writer of A: lets a programmatic dependent start at once, spins `spin_ns`, then
// copies src into dst (the GEMM's A, poisoned before it).
static __global__ void late_writer_kernel(uint4 *dst, const uint4 *src, size_t vecs,
                                          unsigned long long spin_ns) {
  if (threadIdx.x == 0) {
    tw::ptx::griddep_launch_dependents();
    const uint64_t t0 = tw::ptx::globaltimer_ns();
    while (tw::ptx::globaltimer_ns() - t0 < spin_ns) {
    }
  }
  __syncthreads();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vecs;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

// opts.after_grid (tw_ag_gemm's decode GEMM after its allgather): the GEMM launched as a
// programmatic dependent of a kernel that writes A 200 us after letting it start must read the
// written A, never the poison (NaN) before it: bitwise the C of a plain launch after A is
// final, bf16 and fp32 out; eagerly and replayed from a CUDA graph (after the poison again).
static void check_after_grid(const buffers_t *buf, int64_t m, int64_t n, int64_t k, int split,
                             int variant, int dynamic) {
  const size_t count = fill_with_ref(buf, m, n, k);
  const size_t a_bytes = (size_t)(m * k) * 2;
  __nv_bfloat16 *a_final = (__nv_bfloat16 *)buf->cref_bf16; /* scratch: A's final values */
  TEST_CUDA_OK(cudaMemcpyAsync(a_final, buf->a, a_bytes, cudaMemcpyDeviceToDevice, stream));
  tw_gemm_sm90_opts_t plain = {variant, dynamic, 0}, after = {variant, dynamic, 0};
  after.after_grid = 1;
  for (int fp32 = 0; fp32 < 2; fp32++) {
    const size_t bytes = count * (fp32 ? 4 : 2);
    tw_gemm_args_t args = make_args(buf->a, buf->b, buf->c, fp32 ? TW_FP32 : TW_BF16, m, n, k);
    args.split_k = split;
    tw_test_poison(buf->c, bytes, stream);
    TEST_TW_OK(tw_gemm_sm90_launch(&args, (tw_stream_t)stream, &plain));
    args.c = buf->c3;
    for (int graph = 0; graph < 2; graph++) {
      cudaGraphExec_t exec = NULL;
      if (graph)
        TEST_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int rep = 0; rep < (graph ? 1 : 2); rep++) {
        if (!graph) {
          tw_test_poison(buf->a, a_bytes, stream);
          tw_test_poison(buf->c3, bytes, stream);
        }
        late_writer_kernel<<<8, 256, 0, stream>>>((uint4 *)buf->a, (const uint4 *)a_final,
                                                  a_bytes / 16, 200000ull);
        TEST_TW_OK(tw_gemm_sm90_launch(&args, (tw_stream_t)stream, &after));
      }
      if (graph) {
        cudaGraph_t g;
        TEST_CUDA_OK(cudaStreamEndCapture(stream, &g));
        TEST_CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
        cudaGraphDestroy(g);
        for (int rep = 0; rep < 2; rep++) {
          tw_test_poison(buf->a, a_bytes, stream);
          tw_test_poison(buf->c3, bytes, stream);
          TEST_CUDA_OK(cudaGraphLaunch(exec, stream));
        }
        cudaGraphExecDestroy(exec);
      }
      const size_t diff = tw_test_count_diff(buf->c, buf->c3, bytes);
      TEST_ASSERT(diff == 0,
                  "after_grid %s M=%lld N=%lld K=%lld split_k %d variant %d dynamic %d%s: %zu "
                  "bytes differ from the plain launch's",
                  fp32 ? "fp32" : "bf16", (long long)m, (long long)n, (long long)k, split, variant,
                  dynamic, graph ? " (graph)" : "", diff);
    }
  }
  printf("after_grid M=%-5lld N=%-5lld K=%-5lld split_k %2d variant %2d dynamic %d: bitwise the "
         "plain launch's (eager, graph)\n",
         (long long)m, (long long)n, (long long)k, split, variant, dynamic);
}

// Every schedule must give bitwise the default order's C.
static void check_schedules(const buffers_t *buf, int64_t m, int64_t n, int64_t k) {
  tw_test_fill_bf16(buf->a, (size_t)(m * k), seed++, stream);
  tw_test_fill_bf16(buf->b, (size_t)(n * k), seed++, stream);
  const size_t bytes = (size_t)(m * n) * 2;
  tw_test_poison(buf->c, bytes, stream);
  tw_gemm_args_t base = make_args(buf->a, buf->b, buf->c, TW_BF16, m, n, k);
  TEST_TW_OK(tw_gemm(&base, (tw_stream_t)stream));

  struct variant {
    const char *name;
    int sm_count, order;
    int64_t rotate;
    int kernel_variant, dynamic;
  } variants[] = {
      {"sm_count=16", 16, TW_TILE_ORDER_DEFAULT, 0, -1, 0},
      {"sm_count=116", 116, TW_TILE_ORDER_DEFAULT, 0, -1, 0},
      {"row-major", 0, TW_TILE_ORDER_ROW_MAJOR, 0, -1, 0},
      {"rotated", 0, TW_TILE_ORDER_ROTATED, m / 3, -1, 0},
      {"3-stage", 0, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_S3_E32, 0},
      {"queue", 0, TW_TILE_ORDER_DEFAULT, 0, -1, 1},
      {"queue sm_count=16 rotated", 16, TW_TILE_ORDER_ROTATED, m / 2, -1, 1},
      {"queue 3-stage", 0, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_S3_E32, 1},
      {"pair", 0, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_S4_E16_C2, 0},
      {"pair sm_count=116", 116, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_S4_E16_C2, 0},
      {"pair sm_count=15 rotated", 15, TW_TILE_ORDER_ROTATED, m / 3, TW_GEMM_V_S4_E16_C2, 0},
      {"pair row-major", 0, TW_TILE_ORDER_ROW_MAJOR, 0, TW_GEMM_V_S4_E16_C2, 0},
      {"pair 3-stage", 0, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_S3_E32_C2, 0},
      {"n128", 0, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_N128_S6, 0},
      {"n128 queue sm_count=116 rotated", 116, TW_TILE_ORDER_ROTATED, m / 3, TW_GEMM_V_N128_S6, 1},
      {"ping-pong", 0, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_PP_N128, 0},
      {"ping-pong sm_count=3 row-major", 3, TW_TILE_ORDER_ROW_MAJOR, 0, TW_GEMM_V_PP_N128, 0},
      {"ping-pong queue sm_count=116 rotated", 116, TW_TILE_ORDER_ROTATED, m / 3, TW_GEMM_V_PP_N128,
       1},
      {"ping-pong 192", 0, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_PP_N192, 0},
      {"ping-pong 192 queue sm_count=5", 5, TW_TILE_ORDER_DEFAULT, 0, TW_GEMM_V_PP_N192, 1},
  };
  for (size_t i = 0; i < sizeof(variants) / sizeof(variants[0]); i++) {
    const struct variant *v = &variants[i];
    tw_gemm_args_t args = base;
    args.c = buf->c2;
    args.sm_count = v->sm_count;
    args.tile_order = v->order;
    args.rotate_start = v->rotate;
    tw_gemm_sm90_opts_t opts = {v->kernel_variant, v->dynamic, 0};
    for (int rep = 0; rep < 2; rep++) { // twice: the queue must have reset itself
      tw_test_poison(buf->c2, bytes, stream);
      TEST_TW_OK(tw_gemm_sm90_launch(&args, (tw_stream_t)stream, &opts));
      size_t diff = tw_test_count_diff(buf->c2, buf->c, bytes);
      TEST_ASSERT(diff == 0, "M=%lld N=%lld K=%lld %s (rep %d): %zu bytes differ from default",
                  (long long)m, (long long)n, (long long)k, v->name, rep, diff);
    }
  }

  // The queue variant under graph replay: no host reset between replays.
  tw_gemm_args_t args = base;
  args.c = buf->c2;
  tw_gemm_sm90_opts_t opts = {-1, 1, 0};
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TEST_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  tw_status_t st = tw_gemm_sm90_launch(&args, (tw_stream_t)stream, &opts);
  tw_status_t st2 = tw_gemm_sm90_launch(&args, (tw_stream_t)stream, &opts);
  TEST_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  TEST_ASSERT(st == TW_SUCCESS && st2 == TW_SUCCESS, "capture: %s", tw_last_error());
  TEST_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; rep++) {
    tw_test_poison(buf->c2, bytes, stream);
    TEST_CUDA_OK(cudaGraphLaunch(exec, stream));
    size_t diff = tw_test_count_diff(buf->c2, buf->c, bytes);
    TEST_ASSERT(diff == 0, "graph replay %d of the queue variant: %zu bytes differ", rep, diff);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Leading dimensions larger than the rows: same values as packed, padding of C untouched.
static void check_strided(const buffers_t *buf) {
  const int64_t m = 1000, n = 200, k = 136, lda = 200, ldb = 144, ldc = 264;
  __nv_bfloat16 *a_pad, *b_pad;
  uint16_t *c_pad;
  TEST_CUDA_OK(cudaMalloc(&a_pad, m * lda * 2));
  TEST_CUDA_OK(cudaMalloc(&b_pad, n * ldb * 2));
  TEST_CUDA_OK(cudaMalloc(&c_pad, m * ldc * 2));
  tw_test_fill_bf16(buf->a, (size_t)(m * k), seed++, stream);
  tw_test_fill_bf16(buf->b, (size_t)(n * k), seed++, stream);
  tw_test_fill_bf16(a_pad, (size_t)(m * lda), seed++, stream); // padding holds garbage
  tw_test_fill_bf16(b_pad, (size_t)(n * ldb), seed++, stream);
  TEST_CUDA_OK(
      cudaMemcpy2DAsync(a_pad, lda * 2, buf->a, k * 2, k * 2, m, cudaMemcpyDeviceToDevice, stream));
  TEST_CUDA_OK(
      cudaMemcpy2DAsync(b_pad, ldb * 2, buf->b, k * 2, k * 2, n, cudaMemcpyDeviceToDevice, stream));
  tw_test_poison(buf->c, m * n * 2, stream);
  tw_gemm_args_t args = make_args(buf->a, buf->b, buf->c, TW_BF16, m, n, k);
  TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
  tw_test_poison(c_pad, m * ldc * 2, stream);
  args = make_args(a_pad, b_pad, c_pad, TW_BF16, m, n, k);
  args.lda = lda, args.ldb = ldb, args.ldc = ldc;
  TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
  unsigned long long *bad, host_bad = 0;
  TEST_CUDA_OK(cudaMalloc(&bad, sizeof(*bad)));
  TEST_CUDA_OK(cudaMemsetAsync(bad, 0, sizeof(*bad), stream));
  strided_diff_kernel<<<256, 256, 0, stream>>>(c_pad, (const uint16_t *)buf->c, m, n, ldc, bad);
  TEST_CUDA_OK(cudaMemcpyAsync(&host_bad, bad, sizeof(host_bad), cudaMemcpyDeviceToHost, stream));
  TEST_CUDA_OK(cudaStreamSynchronize(stream));
  TEST_ASSERT(host_bad == 0, "strided lda/ldb/ldc: %llu elements wrong", host_bad);
  cudaFree(bad);
  cudaFree(a_pad);
  cudaFree(b_pad);
  cudaFree(c_pad);
}

// The large shape: against cuBLAS only (the loop reference would take too long).
static void check_large(const buffers_t *buf, int64_t s) {
  tw_test_fill_bf16(buf->a, (size_t)(s * s), seed++, stream);
  tw_test_fill_bf16(buf->b, (size_t)(s * s), seed++, stream);
  tw_test_poison(buf->c, s * s * 2, stream);
  tw_test_poison(buf->cref_bf16, s * s * 2, stream);
  tw_gemm_args_t args = make_args(buf->a, buf->b, buf->c, TW_BF16, s, s, s);
  TEST_TW_OK(tw_gemm(&args, (tw_stream_t)stream));
  TEST_TW_OK(tw_ref_cublas_gemm(blas, buf->a, buf->b, buf->cref_bf16, TW_BF16, s, s, s, s, s, s, 0,
                                stream));
  size_t bad = 0;
  double err = tw_test_rel_err_bf16(buf->c, buf->cref_bf16, 0, (size_t)(s * s), &bad);
  TEST_ASSERT(err < 1e-2 && bad == 0, "%lld^3 vs cuBLAS: rel err %.3g, %zu NaN", (long long)s, err,
              bad);
  printf("%lld^3 vs cuBLAS: rel err %.2e\n", (long long)s, err);
}

int main(void) {
  tw_test_require_hopper();
  seed = tw_test_seed();
  TEST_CUDA_OK(cudaStreamCreate(&stream)); // blocking: the helpers run on the legacy stream
  TEST_TW_OK(tw_ref_blas_create(&blas));
  buffers_t buf;
  const size_t big = (size_t)4160 * 4160; // elements: >= 4096^2 and >= 4160 x 4104
  TEST_CUDA_OK(cudaMalloc(&buf.a, big * 2));
  TEST_CUDA_OK(cudaMalloc(&buf.b, big * 2));
  TEST_CUDA_OK(cudaMalloc(&buf.c, big * 4));
  TEST_CUDA_OK(cudaMalloc(&buf.c2, big * 4));
  TEST_CUDA_OK(cudaMalloc(&buf.c3, big * 4));
  TEST_CUDA_OK(cudaMalloc(&buf.cref_bf16, big * 2));
  TEST_CUDA_OK(cudaMalloc(&buf.ref, big * 4));

  const int64_t ms[] = {1, 127, 1000, 4160};
  const int64_t ns[] = {8, 200, 1000};
  const int64_t ks[] = {8, 64, 4104};
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++)
      for (int l = 0; l < 3; l++)
        check_shape(&buf, ms[i], ns[j], ks[l]);
  check_shape(&buf, 384, 4096, 1000);
  // split-K: decode-sized (M=64 N=1024 K=8192: -1 takes 8 slices), every forced count, tails
  // in M, N and K (slices of unequal K), 1 row, more slices than K blocks, and -1 where it does
  // not split (a full wave of tiles)
  check_split(&buf, 64, 1024, 8192, -1);
  check_split(&buf, 64, 1024, 8192, 2);
  check_split(&buf, 64, 1024, 8192, 4);
  check_split(&buf, 200, 264, 2056, 8);
  check_split(&buf, 1, 8, 4096, 8);
  check_split(&buf, 127, 200, 128, 8); /* 2 K blocks: 2 slices */
  check_split(&buf, 64, 8192, 1024, -1);
  check_split(&buf, 4160, 1000, 4104, -1);
  /* several tiles per cluster (32 tiles on 16 clusters, 8 under 66 SMs), every round's barrier
   * phases in turn; M=130: the second row block's second warpgroup has no rows (skipped) */
  check_split(&buf, 130, 2048, 1024, 8);
  check_split(&buf, 130, 2048, 1024, 4);
  check_split(&buf, 256, 1024, 2048, 2);
  /* swap-AB: tile widths 16 (m <= 16) and 64, m tails inside a tile, n tails inside a 128-row
   * block and its 64-row halves, short and long K, and the slices */
  check_swap(&buf, 16, 8192, 1024, 0);
  check_swap(&buf, 64, 8192, 1024, 0);
  check_swap(&buf, 1, 8, 8, 0);
  check_swap(&buf, 7, 200, 72, 0);    /* 2 row blocks, the second's upper warpgroup past n */
  check_swap(&buf, 17, 1000, 520, 0); /* m 17: the 64-wide tile, 47 rows past m */
  check_swap(&buf, 40, 136, 4104, 0);
  check_swap(&buf, 64, 1024, 8192, 8);
  check_swap(&buf, 16, 1024, 8192, 4);
  check_swap(&buf, 33, 264, 2056, 2);
  check_swap(&buf, 64, 1024, 8192, -1);
  check_swap(&buf, 9, 2048, 1024, 8);  /* 16 tiles on 16 clusters; 8 under 66 SMs */
  check_swap(&buf, 12, 200, 1000, 0);  /* 64-row tiles: 4, the last 8 rows past n; K tail */
  check_swap(&buf, 48, 8256, 520, 0);  /* 64-row tiles by the rule: 129 on 129 CTAs */
  check_swap(&buf, 32, 1000, 520, 0);  /* 64-row tiles 32 wide (m <= 32); K tail */
  check_swap(&buf, 20, 8256, 264, 0);  /* 32 wide, 12 columns past m, 129 CTAs */
  check_swap(&buf, 16, 16384, 264, 0); /* TW_GEMM_SWAP=2: 256 64-row tiles, two rounds */
  /* forced past m 64 (TW_GEMM_SWAP=1, 2 reach m 128): two 64-wide tiles of A's rows, the
   * second part past m; and with slices */
  check_swap(&buf, 128, 8192, 1024, 0);
  check_swap(&buf, 100, 1000, 520, 0);
  check_swap(&buf, 128, 1024, 8192, 4);
  /* split_k -1 with a workspace: 16- and 64-wide swap tiles, 2, 4 and 8 slices, tails in M, N
   * and K */
  TEST_CUDA_OK(cudaMalloc(&g_ws, TW_GEMM_WORKSPACE_BYTES));
  TEST_CUDA_OK(cudaMemset(g_ws, 0, TW_GEMM_WORKSPACE_BYTES));
  check_split_ws(&buf, 16, 1024, 8192, 8);
  check_split_ws(&buf, 32, 1024, 8192, 8);
  check_split_ws(&buf, 64, 1024, 8192, 8);
  check_split_ws(&buf, 9, 2048, 4096, 4);  /* 4 slices on 32 tiles */
  check_split_ws(&buf, 1, 200, 4096, 4);   /* 4 tiles, the last 8 rows of B past n */
  check_split_ws(&buf, 40, 136, 2056, 2);  /* 2 slices, K tail */
  check_split_ws(&buf, 64, 1088, 3072, 2); /* 2 slices on 17 tiles */
  /* unswapped: 128 x 64 tiles (M past 64, or TW_GEMM_SWAP=0), M=130: the second row block's
   * second warpgroup past m; tails in M, N and K */
  check_split_ws(&buf, 128, 1024, 8192, 8);
  check_split_ws(&buf, 256, 1024, 8192, 4);
  check_split_ws(&buf, 130, 1024, 4096, 4);
  check_split_ws(&buf, 100, 520, 4104, 4);
  setenv("TW_GEMM_SWAP", "0", 1);
  check_split_ws(&buf, 64, 1024, 8192, 8);
  unsetenv("TW_GEMM_SWAP");
  /* opts.after_grid: swap-AB with slices (16- and 64-wide), 128-row tiles with slices (tw_ag_gemm
   * at M=64 per rank on 2), 64-row swap tiles, the plain 1-CTA launch, a CTA pair, the queue */
  check_after_grid(&buf, 16, 1024, 8192, -1, -1, 0);
  check_after_grid(&buf, 32, 1024, 8192, -1, -1, 0);
  check_after_grid(&buf, 128, 1024, 8192, -1, -1, 0);
  check_after_grid(&buf, 16, 8192, 1024, 0, -1, 0);
  check_after_grid(&buf, 300, 520, 1032, 0, -1, 0);
  check_after_grid(&buf, 1000, 1000, 1032, 0, TW_GEMM_V_S3_E32_C2, 0);
  check_after_grid(&buf, 1000, 1000, 1032, 0, TW_GEMM_V_S4_E16, 1);
  check_errors(&buf);
  check_strided(&buf);
  check_schedules(&buf, 4160, 1000, 4104);
  check_schedules(&buf, 4096, 4096, 4096);
  check_large(&buf, 4096);

  TEST_CUDA_OK(cudaDeviceSynchronize());
  TEST_ASSERT(cudaGetLastError() == cudaSuccess, "no sticky CUDA error");
  tw_ref_blas_destroy(blas);
  cudaFree(buf.a);
  cudaFree(buf.b);
  cudaFree(buf.c);
  cudaFree(buf.c2);
  cudaFree(buf.c3);
  cudaFree(buf.cref_bf16);
  cudaFree(buf.ref);
  cudaFree(g_ws);
  cudaStreamDestroy(stream);
  return tw_test_finish();
}
