/*
 * tw_grouped_gemm: the GEMM core over group-major rows (an MoE layer's expert GEMMs).
 *
 * One static-schedule launch of the plain GEMM kernel with a Wait policy of its own
 * (GroupedWait) that reads the groups' row offsets from device memory:
 *   tile_count  the live row blocks, offsets[groups] / 128, times the column blocks: the tile
 *               order is row-major, so the live tiles are a prefix of the bound's and the
 *               CTAs stop at the last one (no host synchronisation, graph-capturable);
 *   tile_index  inside each group's tiles of that prefix, the default order's L2 groups
 *               (group_m row blocks, column-major inside), so its weights stream through L2
 *               once per group_m row blocks;
 *   b_source    a tile's B rows start at its group's weights (g * n), g found by a binary
 *               search of the offsets for the tile's first row.
 * B is one tensor map over every group's [n, k], [groups * n, k]: a tile's column block past n
 * reads the next group's rows (or TMA's zero fill after the last), which lands only in out's
 * columns past n, which the store drops. Each row's products and their order are tw_gemm's,
 * so every group's rows are bitwise tw_gemm of them.
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/status.h"
#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_run.cuh"
#include "ops/grouped_gemm/grouped_wait.cuh"
#include "runtime/argcheck.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"

using namespace tw::gemm;
using tw::gemm::GroupedWait;

namespace {

constexpr int64_t kMaxGroups = 65536;

tw_status_t fail_arg(const char *what) { return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s", what); }

template <class Out> cudaError_t preload_grouped() {
  cudaError_t e = preload_one<6, 16384, Out, false, 1, 128, 1, GroupedWait>();
  cudaError_t f = preload_one<3, 32768, Out, false, 1, kBlockN, 1, GroupedWait>();
  return e != cudaSuccess ? e : f;
}

} // namespace

/* Loads the grouped GEMM's kernels on the current device now (see tw_ops_preload). */
static tw_status_t tw_grouped_gemm_preload(void) {
  cudaError_t e = preload_grouped<__nv_bfloat16>();
  cudaError_t f = preload_grouped<float>();
  return tw_cuda_check(e != cudaSuccess ? e : f, "loading the grouped GEMM kernels");
}

static const tw_op_desc_t grouped_gemm_registration = {"grouped_gemm", tw_grouped_gemm_preload};
TW_OP_REGISTER(grouped_gemm, grouped_gemm_registration);

extern "C" tw_status_t tw_grouped_gemm_args_init(tw_grouped_gemm_args_t *args) {
  if (!args)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_grouped_gemm_args_init: args is NULL");
  const tw_grouped_gemm_args_t init = TW_GROUPED_GEMM_ARGS_INIT;
  memset(args, 0, sizeof(*args)); /* the padding too */
  memcpy(args, &init, offsetof(tw_grouped_gemm_args_t, sm_count) + sizeof(init.sm_count));
  return TW_SUCCESS;
}

/* The arguments' contract before anything is launched: TW_ERR_INVALID_ARGUMENT naming the first
 * one that breaks it. Leading dimensions of 0 are defaulted here. */
static tw_status_t check_args(tw_grouped_gemm_args_t &a) {
  char why[256];
  if (a.c_dtype != TW_BF16 && a.c_dtype != TW_FP32) {
    snprintf(why, sizeof(why), "tw_grouped_gemm: c_dtype is %d; expected TW_BF16 or TW_FP32",
             (int)a.c_dtype);
    return fail_arg(why);
  }
  if (a.groups < 1 || a.groups > kMaxGroups) {
    snprintf(why, sizeof(why), "tw_grouped_gemm: groups is %lld; expected 1 .. %lld",
             (long long)a.groups, (long long)kMaxGroups);
    return fail_arg(why);
  }
  if (a.m < 1 || a.m > INT32_MAX - kBlockM) {
    snprintf(why, sizeof(why), "tw_grouped_gemm: m is %lld; expected 1 <= m < 2^31 - 128",
             (long long)a.m);
    return fail_arg(why);
  }
  if (a.n < 8 || a.n % 8 || a.n * a.groups > INT32_MAX) {
    snprintf(why, sizeof(why),
             "tw_grouped_gemm: n is %lld; expected a positive multiple of 8 with n x groups "
             "(%lld) below 2^31",
             (long long)a.n, (long long)a.groups);
    return fail_arg(why);
  }
  if (a.k < 8 || a.k > INT32_MAX || a.k % 8) {
    snprintf(why, sizeof(why),
             "tw_grouped_gemm: k is %lld; expected a positive multiple of 8 below 2^31",
             (long long)a.k);
    return fail_arg(why);
  }
  if (a.lda == 0)
    a.lda = a.k;
  if (a.ldb == 0)
    a.ldb = a.k;
  if (a.ldo == 0)
    a.ldo = a.n;
  const int c_bytes = a.c_dtype == TW_BF16 ? 2 : 4;
  const struct {
    int64_t value, least, multiple;
    const char *name, *of;
  } dims[3] = {{a.lda, a.k, 8, "lda", "k"},
               {a.ldb, a.k, 8, "ldb", "k"},
               {a.ldo, a.n, 16 / c_bytes, "ldo", "n"}};
  for (int i = 0; i < 3; i++)
    if (dims[i].value < dims[i].least || dims[i].value % dims[i].multiple) {
      snprintf(why, sizeof(why),
               "tw_grouped_gemm: %s is %lld; expected >= %s (%lld) and a multiple of %lld",
               dims[i].name, (long long)dims[i].value, dims[i].of, (long long)dims[i].least,
               (long long)dims[i].multiple);
      return fail_arg(why);
    }
  const void *ptrs[4] = {a.a, a.b, a.out, a.offsets};
  const char *names[4] = {"a", "b", "out", "offsets"};
  for (int i = 0; i < 4; i++) {
    if (!ptrs[i]) {
      snprintf(why, sizeof(why), "tw_grouped_gemm: %s is NULL", names[i]);
      return fail_arg(why);
    }
    if ((uintptr_t)ptrs[i] % (i == 3 ? 4 : 16)) {
      snprintf(why, sizeof(why), "tw_grouped_gemm: %s (%p) is not %d-byte aligned", names[i],
               ptrs[i], i == 3 ? 4 : 16);
      return fail_arg(why);
    }
  }
  const int64_t tiles = ((a.m + kBlockM - 1) / kBlockM) * ((a.n + 127) / 128);
  if (tiles > INT32_MAX) {
    snprintf(why, sizeof(why), "tw_grouped_gemm: m x n needs %lld tiles; at most 2^31 - 1",
             (long long)tiles);
    return fail_arg(why);
  }
  return TW_SUCCESS;
}

/* Every operand is device memory of `device` as large as the shapes make it, and out overlaps
 * no input. */
static tw_status_t check_pointers(const tw_grouped_gemm_args_t &a, int device) {
  const size_t a_bytes = (size_t)((a.m - 1) * a.lda + a.k) * 2;
  const size_t b_bytes = (size_t)((a.groups * a.n - 1) * a.ldb + a.k) * 2;
  const size_t o_bytes = (size_t)((a.m - 1) * a.ldo + a.n) * (a.c_dtype == TW_BF16 ? 2 : 4);
  const size_t off_bytes = (size_t)(a.groups + 1) * sizeof(int32_t);
  tw_status_t st = tw_check_device_range(device, a.a, a_bytes, "tw_grouped_gemm: a");
  if (st == TW_SUCCESS)
    st = tw_check_device_range(device, a.b, b_bytes, "tw_grouped_gemm: b");
  if (st == TW_SUCCESS)
    st = tw_check_device_range(device, a.out, o_bytes, "tw_grouped_gemm: out");
  if (st == TW_SUCCESS)
    st = tw_check_device_range(device, a.offsets, off_bytes, "tw_grouped_gemm: offsets");
  const void *inputs[3] = {a.a, a.b, a.offsets};
  const size_t sizes[3] = {a_bytes, b_bytes, off_bytes};
  const char *names[3] = {"a", "b", "offsets"};
  for (int i = 0; i < 3 && st == TW_SUCCESS; i++)
    st = tw_check_disjoint(a.out, o_bytes, "tw_grouped_gemm: out", inputs[i], sizes[i], names[i]);
  return st;
}

template <class Out>
static tw_status_t run(const tw_grouped_gemm_args_t &a, int sms, int device, cudaStream_t stream) {
  tw_gemm_plan_t plan;
  tw_gemm_plan_make(a.m, a.n, a.k, sms, &plan);
  /* the two 1-CTA static variants a Wait hook may take (launch_waited) */
  const int variant = plan.variant == TW_GEMM_V_N128_S6 || plan.variant == TW_GEMM_V_PP_N128
                          ? TW_GEMM_V_N128_S6
                          : TW_GEMM_V_S3_E32;
  const int bn = variant == TW_GEMM_V_N128_S6 ? 128 : kBlockN;
  GemmParams<EpiTmaStore<Out>, GroupedWait> p;
  memset(&p, 0, sizeof(p));
  tw_status_t st = operand_maps(&p.a_map, &p.b_map, a.a, a.m, a.lda, a.b, a.groups * a.n, a.ldb,
                                a.k, bn, "tw_grouped_gemm", "a");
  if (st == TW_SUCCESS)
    st = out_map<Out>(&p.epi.c_map, a.out, a.n, a.m, a.ldo,
                      "tw_grouped_gemm: cuTensorMapEncodeTiled(out)");
  if (st != TW_SUCCESS)
    return st;
  TileOrder &o = p.order;
  o.m_blocks = (int32_t)((a.m + kBlockM - 1) / kBlockM);
  o.n_blocks = (int32_t)((a.n + bn - 1) / bn);
  o.num_tiles = o.m_blocks * o.n_blocks;
  o.order = kOrderRowMajor;
  p.k_blocks = (int32_t)((a.k + kBlockK - 1) / kBlockK);
  p.wait.offsets = a.offsets;
  p.wait.groups = (int32_t)a.groups;
  p.wait.n = (int32_t)a.n;
  p.wait.n_blocks = o.n_blocks;
  p.wait.m_blocks = o.m_blocks;
  p.wait.group_m = plan.group_m > 0 ? plan.group_m : 16;
  apply_fault_stall(p);
  const int grid = o.num_tiles < sms ? o.num_tiles : sms;
  return launch_waited<Out, GroupedWait>(p, variant, grid, device, stream);
}

extern "C" tw_status_t tw_grouped_gemm(const tw_grouped_gemm_args_t *args_in, tw_stream_t stream) {
  tw_grouped_gemm_args_t a = TW_GROUPED_GEMM_ARGS_INIT;
  tw_status_t st =
      tw_args_copy(args_in, &a, sizeof(a), offsetof(tw_grouped_gemm_args_t, sm_count),
                   "tw_grouped_gemm", "tw_grouped_gemm_args_t", "TW_GROUPED_GEMM_ARGS_INIT");
  if (st != TW_SUCCESS)
    return st;
  st = check_args(a);
  if (st != TW_SUCCESS)
    return st;
  int device = 0, sms = 0;
  if ((st = tw_op_device("tw_grouped_gemm", &device)) != TW_SUCCESS)
    return st;
  if ((st = check_pointers(a, device)) != TW_SUCCESS)
    return st;
  if ((st = tw_op_sms("tw_grouped_gemm", device, a.sm_count, &sms)) != TW_SUCCESS)
    return st;
  return a.c_dtype == TW_BF16 ? run<__nv_bfloat16>(a, sms, device, (cudaStream_t)stream)
                              : run<float>(a, sms, device, (cudaStream_t)stream);
}
