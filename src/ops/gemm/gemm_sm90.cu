/*
 * tw_gemm: the sm90 GEMM core alone (host launcher and kernel instantiations).
 * The mainloop and its hooks are in src/gemm/gemm_sm90.cuh; the per-shape choice in
 * gemm_heuristics.c.
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>

#include "core/status.h"
#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_run.cuh"
#include "ops/gemm/gemm_sm90.h"
#include "runtime/argcheck.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "runtime/registry.h"

using namespace tw::gemm;

namespace {

// Queue of the dynamic-schedule variant of the plain GEMM (fused ops bring their own).
__device__ TileQueue g_plain_queue;

tw_status_t check_aligned(const void *ptr, const char *name) {
  if (!ptr)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: %s is NULL", name);
  if ((uintptr_t)ptr % 16)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: %s (%p) is not 16-byte aligned", name, ptr);
  return TW_SUCCESS;
}

} // namespace

/* Loads the GEMM kernels on the current device now (see tw_ops_preload). */
static tw_status_t tw_gemm_preload(void) {
  cudaError_t e = preload_out<__nv_bfloat16>();
  cudaError_t f = preload_out<float>();
  return tw_cuda_check(e != cudaSuccess ? e : f, "loading the GEMM kernels");
}

/* tw_gemm, registered with the runtime (runtime/registry.h). */
static const tw_op_desc_t gemm_registration = {"gemm", tw_gemm_preload};
TW_OP_REGISTER(gemm, gemm_registration);

extern "C" tw_status_t tw_gemm_args_init(tw_gemm_args_t *args) {
  if (!args)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm_args_init: args is NULL");
  const tw_gemm_args_t init = TW_GEMM_ARGS_INIT;
  /* zeroes the padding too (a struct copy may leave it undefined) */
  memset(args, 0, sizeof(*args));
  memcpy(args, &init, offsetof(tw_gemm_args_t, workspace_bytes) + sizeof(init.workspace_bytes));
  return TW_SUCCESS;
}

/* The operands are device memory of `device`, each as large as the shapes and leading
 * dimensions make it, and c and the workspace overlap nothing else. */
static tw_status_t check_pointers(const tw_gemm_args_t &a, int device) {
  const size_t a_bytes = (size_t)((a.m - 1) * a.lda + a.k) * 2;
  const size_t b_bytes = (size_t)((a.n - 1) * a.ldb + a.k) * 2;
  const size_t c_bytes = (size_t)((a.m - 1) * a.ldc + a.n) * (a.c_dtype == TW_BF16 ? 2 : 4);
  tw_status_t st = tw_check_device_range(device, a.a, a_bytes, "tw_gemm: a");
  if (st == TW_SUCCESS)
    st = tw_check_device_range(device, a.b, b_bytes, "tw_gemm: b");
  if (st == TW_SUCCESS)
    st = tw_check_device_range(device, a.c, c_bytes, "tw_gemm: c");
  if (st == TW_SUCCESS)
    st = tw_check_disjoint(a.c, c_bytes, "tw_gemm: c", a.a, a_bytes, "a");
  if (st == TW_SUCCESS)
    st = tw_check_disjoint(a.c, c_bytes, "tw_gemm: c", a.b, b_bytes, "b");
  if (st == TW_SUCCESS && a.workspace) {
    st = tw_check_device_range(device, a.workspace, a.workspace_bytes, "tw_gemm: workspace");
    const void *others[3] = {a.a, a.b, a.c};
    const size_t sizes[3] = {a_bytes, b_bytes, c_bytes};
    const char *names[3] = {"a", "b", "c"};
    for (int i = 0; i < 3 && st == TW_SUCCESS; i++)
      st = tw_check_disjoint(a.workspace, a.workspace_bytes, "tw_gemm: workspace", others[i],
                             sizes[i], names[i]);
  }
  return st;
}

/* The arguments' contract (args resolved from the caller's struct, leading dimensions of 0
 * defaulted), before anything is launched: TW_ERR_INVALID_ARGUMENT naming the first one that
 * breaks it. */
static tw_status_t check_args(tw_gemm_args_t &a, const tw_gemm_sm90_opts_t *opts) {
  tw_status_t st;
  if (a.c_dtype != TW_BF16 && a.c_dtype != TW_FP32)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: c_dtype is %d; expected TW_BF16 or TW_FP32",
                   (int)a.c_dtype);
  if (a.m < 1 || a.m > INT32_MAX)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: m is %lld; expected 1 <= m < 2^31",
                   (long long)a.m);
  if (a.n < 8 || a.n > INT32_MAX || a.n % 8)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: n is %lld; expected a positive multiple of 8 below 2^31",
                   (long long)a.n);
  if (a.k < 8 || a.k > INT32_MAX || a.k % 8)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: k is %lld; expected a positive multiple of 8 below 2^31",
                   (long long)a.k);
  default_leading_dims(a);
  const int c_bytes = a.c_dtype == TW_BF16 ? 2 : 4;
  if (a.lda < a.k || a.lda % 8)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: lda is %lld; expected >= k (%lld) and a multiple of 8",
                   (long long)a.lda, (long long)a.k);
  if (a.ldb < a.k || a.ldb % 8)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: ldb is %lld; expected >= k (%lld) and a multiple of 8",
                   (long long)a.ldb, (long long)a.k);
  if (a.ldc < a.n || (a.ldc * c_bytes) % 16)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: ldc is %lld; expected >= n (%lld) and a multiple of %d elements",
                   (long long)a.ldc, (long long)a.n, 16 / c_bytes);
  if ((st = check_aligned(a.a, "a")) != TW_SUCCESS)
    return st;
  if ((st = check_aligned(a.b, "b")) != TW_SUCCESS)
    return st;
  if ((st = check_aligned(a.c, "c")) != TW_SUCCESS)
    return st;
  if (a.tile_order < TW_TILE_ORDER_DEFAULT || a.tile_order > TW_TILE_ORDER_ROTATED)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: tile_order is %d; expected a tw_tile_order_t",
                   (int)a.tile_order);
  if (a.tile_order == TW_TILE_ORDER_ROTATED && (a.rotate_start < 0 || a.rotate_start >= a.m))
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: rotate_start is %lld; expected 0 <= it < m",
                   (long long)a.rotate_start);
  const int64_t tiles = ((a.m + kBlockM - 1) / kBlockM) * ((a.n + 127) / 128);
  if (tiles > INT32_MAX)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: m x n needs %lld tiles; at most 2^31 - 1",
                   (long long)tiles);
  if (opts && (opts->variant < -1 || opts->variant >= TW_GEMM_V_COUNT))
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: opts->variant is %d", opts->variant);
  if (a.workspace && (uintptr_t)a.workspace % 256)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: workspace (%p) is not 256-byte aligned",
                   a.workspace);
  if (a.workspace && a.workspace_bytes < TW_GEMM_WORKSPACE_BYTES)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: workspace_bytes is %zu; expected at least TW_GEMM_WORKSPACE_BYTES "
                   "(%zu)",
                   a.workspace_bytes, (size_t)TW_GEMM_WORKSPACE_BYTES);
  if (a.split_k < -1 || a.split_k == 3 || (a.split_k > 4 && a.split_k != 8))
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: split_k is %d; expected 0 or 1 (none), 2, 4, 8, or -1 (the library "
                   "chooses)",
                   (int)a.split_k);
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_gemm_sm90_launch(const tw_gemm_args_t *args_in, tw_stream_t stream,
                                           const tw_gemm_sm90_opts_t *opts) {
  tw_gemm_args_t a = TW_GEMM_ARGS_INIT;
  tw_status_t st = tw_args_copy(args_in, &a, sizeof(a), offsetof(tw_gemm_args_t, sm_count),
                                "tw_gemm", "tw_gemm_args_t", "TW_GEMM_ARGS_INIT");
  if (st != TW_SUCCESS)
    return st;
  st = check_args(a, opts);
  if (st != TW_SUCCESS)
    return st;

  int device = 0;
  if ((st = tw_op_device("tw_gemm", &device)) != TW_SUCCESS)
    return st;
  if (!(opts && opts->pointers_checked) && (st = check_pointers(a, device)) != TW_SUCCESS)
    return st;
  int sms = 0;
  if ((st = tw_op_sms("tw_gemm", device, a.sm_count, &sms)) != TW_SUCCESS)
    return st;

  tw_gemm_plan_t plan;
  tw_gemm_plan_make(a.m, a.n, a.k, sms, &plan);
  const int variant = opts && opts->variant >= 0 ? opts->variant : plan.variant;
  const bool dynamic = opts && opts->dynamic_queue;
  const int group_m = opts ? opts->group_m : 0;
  // K slices: as asked (or the library's choice), halved until every slice has a K block and a
  // cluster of them fits the SMs given.
  int split = a.split_k < 0 ? tw_gemm_auto_split(a.m, a.n, a.k) : (a.split_k > 1 ? a.split_k : 1);
  const int64_t k_blocks = (a.k + kBlockK - 1) / kBlockK;
  while (split > 1 && (split > k_blocks || split > sms))
    split /= 2;
  if (split > 1 && dynamic)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: split_k runs on a static schedule");
  cudaStream_t s = (cudaStream_t)stream;
  const bool after_grid = opts && opts->after_grid;
  // Swap-AB at decode shapes (TW_GEMM_SWAP, read per call), where no variant or queue is forced.
  const int swap_env = (int)tw_env_int(TW_GEMM_SWAP_ID);
  const int swap_mt = tw_gemm_swap_bn_upto(
      swap_env, a.m,
      opts && opts->swap_max_m > 0 ? opts->swap_max_m : tw_gemm_swap_rule_max_m(a.n, split, sms));
  // split_k -1 with a workspace: the tree's slices as single CTAs on tiles of half its width,
  // twice the CTAs (tw_gemm_ws_split, by the shape; the same bits as the tree's).
  if (a.split_k < 0 && a.workspace && !dynamic && !(opts && opts->variant >= 0)) {
    size_t need = 0;
    const int ws_split = tw_gemm_ws_split(a.m, a.n, a.k, swap_mt, &need);
    if (ws_split > 1 && ws_split == split) { /* split: the tree's, after the budget's halving */
      if (need > a.workspace_bytes)
        return tw_fail(TW_ERR_INTERNAL, "tw_gemm: the workspace's split needs %zu bytes", need);
      const WsPlan ws = {ws_split, (float *)((char *)a.workspace + TW_GEMM_WS_COUNTERS),
                         (uint32_t *)a.workspace};
      if (swap_mt)
        return a.c_dtype == TW_BF16
                   ? run_swap<__nv_bfloat16>(a, swap_mt, true, sms, ws_split, device, s,
                                             NoWait::Params(), NoFill(), after_grid, &ws)
                   : run_swap<float>(a, swap_mt, true, sms, ws_split, device, s, NoWait::Params(),
                                     NoFill(), after_grid, &ws);
      return a.c_dtype == TW_BF16
                 ? run<__nv_bfloat16>(a, plan, variant, false, group_m, sms, ws_split, device, s,
                                      NoWait::Params(), after_grid, &ws)
                 : run<float>(a, plan, variant, false, group_m, sms, ws_split, device, s,
                              NoWait::Params(), after_grid, &ws);
    }
  }
  if (swap_mt && (!opts || (opts->variant < 0 && !opts->dynamic_queue))) {
    const bool half = tw_gemm_swap_half(swap_env, a.m, a.n, split, sms) != 0;
    // 64-row tiles: 32 of A's rows wide at m <= 32 (unsplit, so every route below)
    const int mt = half && split == 1 ? tw_gemm_swap_half_mt(swap_mt, a.m) : swap_mt;
    if (a.c_dtype == TW_BF16)
      return run_swap<__nv_bfloat16>(a, mt, half, sms, split, device, s, NoWait::Params(), NoFill(),
                                     after_grid);
    return run_swap<float>(a, mt, half, sms, split, device, s, NoWait::Params(), NoFill(),
                           after_grid);
  }
  TileQueue *queue = NULL;
  if (dynamic && (st = tw_cuda_check(cudaGetSymbolAddress((void **)&queue, g_plain_queue),
                                     "tw_gemm: cudaGetSymbolAddress(queue)")) != TW_SUCCESS)
    return st;
  if (a.c_dtype == TW_BF16)
    return run<__nv_bfloat16>(a, plan, variant, dynamic, group_m, sms, split, device, s,
                              NoWait::Params(), after_grid, NULL, queue);
  // fp32 output: the variant for it where nothing else decides (tw_gemm_out_variant)
  const int fp32_variant = !(opts && opts->variant >= 0) && !dynamic && split == 1 && !after_grid
                               ? tw_gemm_out_variant(variant, 1)
                               : variant;
  return run<float>(a, plan, fp32_variant, dynamic, group_m, sms, split, device, s,
                    NoWait::Params(), after_grid, NULL, queue);
}

extern "C" tw_status_t tw_gemm(const tw_gemm_args_t *args, tw_stream_t stream) {
  return tw_gemm_sm90_launch(args, stream, NULL);
}
