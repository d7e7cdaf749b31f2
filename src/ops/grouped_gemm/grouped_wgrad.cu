/*
 * tw_grouped_gemm_wgrad: the grouped GEMM's weight gradient on the GEMM core,
 *   out[g] = a_g^T b_g   ([n, k], a_g / b_g: group g's rows of a [m, n] and b [m, k]).
 *
 * Two launches in stream order, both reading the groups' offsets on the device (no host
 * synchronisation, graph-capturable):
 *   1. wgrad_transpose_kernel writes a^T [n, ld] and b^T [k, ld] into the workspace (the core
 *      takes K-major operands; here K is the rows), for rows [0, min(offsets[groups], m)) only,
 *      in 64-row tiles (a tile's rows from that end on are written as zeros, never read), and
 *      zeroes the last 64 columns of every row of both (the zero block). Rows past the end are
 *      never read: the contract lets them be anything, NaN included.
 *   2. The core's static schedule over groups x ceil(n / 128) x ceil(k / BN) tiles (row block
 *      mb of the loop is group mb / ceil(n / 128)'s), with WgradWait (grouped_wgrad.cuh): each
 *      tile multiplies its group's K blocks [offsets[g] / 64, offsets[g + 1] / 64) of a^T and
 *      b^T, in order from a zeroed accumulator (hook (k) of the engine), its A rows being its
 *      row block inside the group's n rows. An empty group's tiles multiply the zero block
 *      once, so they store zeros through the same epilogue. Out goes through a 3-D tensor map
 *      [groups][n][k] (EpiGroupStore): a tile's rows past n fall outside the map's n and are
 *      dropped, never stored into the next group's rows.
 * Every output element is the chain of products tw_gemm computes for a_g^T [n, rows] times
 * b_g^T [k, rows] (the same K blocks in the same order, the first with scale-d 0), so each
 * group's out is bitwise tw_gemm of its transposed rows.
 *
 * Why transpose rather than MN-major operands: the engine's wgmma descriptors and TMA boxes
 * are K-major; an MN-major mainloop would be a second mainloop. The transpose costs one read
 * and one write of the live rows of a and b, against the GEMM's n x k x rows products.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/status.h"
#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_run.cuh"
#include "ops/grouped_gemm/grouped_wgrad.cuh"
#include "runtime/argcheck.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "runtime/registry.h"

using namespace tw::gemm;

namespace {

constexpr int64_t kMaxGroups = 65536;
// m's bound: the workspace's columns (m rounded up to 64, then the zero block) stay TMA
// coordinates (int32).
constexpr int64_t kMaxRows = INT32_MAX - 256;
constexpr int kTrTile = 64;     // the transpose's tiles: 64 rows x 64 columns
constexpr int kTrPad = 66;      // its shared tile's row stride (elements): 2-way conflicts at most
constexpr int kTrThreads = 256; // each thread 2 of a tile's 512 16-byte chunks
constexpr int kTrBlocksPerSm = 8;
constexpr size_t kWsAlign = 256;

const char *const kOp = "tw_grouped_gemm_wgrad";

// The workspace: a^T [n, ld] then b^T [k, ld], bf16, ld = m rounded up to 64 (every row a
// group may hold, in whole 64-row tiles) plus the 64-column zero block.
struct WsLayout {
  int64_t ld;
  size_t bt_offset, bytes;
};
WsLayout ws_layout(int64_t m, int64_t n, int64_t k) {
  WsLayout w;
  w.ld = (m + kTrTile - 1) / kTrTile * kTrTile + kTrTile;
  w.bt_offset = (size_t)n * (size_t)w.ld * 2;
  w.bytes = ((size_t)(n + k) * (size_t)w.ld * 2 + kWsAlign - 1) / kWsAlign * kWsAlign;
  return w;
}

struct TransposeParams {
  const __nv_bfloat16 *src[2]; // a, b
  int64_t ld_src[2];           // lda, ldb
  __nv_bfloat16 *dst[2];       // a^T, b^T: row stride ld
  int32_t cols[2];             // n, k: the rows of a^T, b^T
  int32_t col_tiles[2];        // ceil(cols / 64)
  int64_t ld;
  const int32_t *offsets;
  int32_t groups, m;
  int64_t zero_col; // ld - 64
};

// Items of 64 x 64: row tiles [0, ceil(end / 64)) of every column tile of a then of b, then one
// zero-block item per column tile; a grid-stride loop, so the grid does not depend on offsets.
__global__ void __launch_bounds__(kTrThreads) wgrad_transpose_kernel(const TransposeParams p) {
  __shared__ __align__(16) uint16_t tile[kTrTile * kTrPad];
  const int32_t end = min(max(__ldg(p.offsets + p.groups), 0), p.m);
  const int64_t row_tiles = (end + kTrTile - 1) / kTrTile;
  const int32_t per_row = p.col_tiles[0] + p.col_tiles[1];
  const int64_t items = (row_tiles + 1) * per_row;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t rt = item / per_row;
    int32_t ct = (int32_t)(item - rt * per_row);
    const int w = ct < p.col_tiles[0] ? 0 : 1;
    ct -= w ? p.col_tiles[0] : 0;
    // constant indices only: a parameter array indexed by w would be copied to local memory
    const int32_t c0 = ct * kTrTile, cols = w ? p.cols[1] : p.cols[0];
    __nv_bfloat16 *dst = w ? p.dst[1] : p.dst[0];
    if (rt == row_tiles) { // the block is uniform here: no barrier skipped by part of it
      for (int q = threadIdx.x; q < kTrTile * 8; q += kTrThreads) {
        const int c = q / 8, rc = q % 8;
        if (c0 + c < cols)
          *reinterpret_cast<uint4 *>(dst + (int64_t)(c0 + c) * p.ld + p.zero_col + rc * 8) =
              make_uint4(0u, 0u, 0u, 0u);
      }
      continue;
    }
    const int64_t r0 = rt * kTrTile;
    const __nv_bfloat16 *src = w ? p.src[1] : p.src[0];
    const int64_t ld_src = w ? p.ld_src[1] : p.ld_src[0];
    for (int q = threadIdx.x; q < kTrTile * 8; q += kTrThreads) {
      const int r = q / 8, c8 = q % 8; // a warp reads 4 rows' 128-byte lines
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r0 + r < end && c0 + c8 * 8 < cols)
        v = __ldg(reinterpret_cast<const uint4 *>(src + (r0 + r) * ld_src + c0 + c8 * 8));
      uint32_t *s = reinterpret_cast<uint32_t *>(tile + r * kTrPad + c8 * 8);
      s[0] = v.x, s[1] = v.y, s[2] = v.z, s[3] = v.w;
    }
    __syncthreads();
    for (int q = threadIdx.x; q < kTrTile * 8; q += kTrThreads) {
      const int c = q / 8, rc = q % 8; // a warp writes 4 rows' 128-byte lines of the transpose
      if (c0 + c >= cols)
        continue;
      uint32_t e[8];
#pragma unroll
      for (int i = 0; i < 8; i++)
        e[i] = tile[(rc * 8 + i) * kTrPad + c];
      const uint4 v =
          make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
      *reinterpret_cast<uint4 *>(dst + (int64_t)(c0 + c) * p.ld + r0 + rc * 8) = v;
    }
    __syncthreads(); // the tile is read out before the next item's loads overwrite it
  }
}

tw_status_t fail_arg(const char *what) { return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s", what); }

// The shapes tw_grouped_gemm_wgrad_workspace_size and the call share.
tw_status_t check_shape(int64_t m, int64_t n, int64_t k) {
  char why[256];
  if (m < 1 || m > kMaxRows) {
    snprintf(why, sizeof(why), "%s: m is %lld; expected 1 <= m <= 2^31 - 257", kOp, (long long)m);
    return fail_arg(why);
  }
  if (n < 8 || n % 8 || n > INT32_MAX) {
    snprintf(why, sizeof(why), "%s: n is %lld; expected a positive multiple of 8 below 2^31", kOp,
             (long long)n);
    return fail_arg(why);
  }
  if (k < 8 || k % 8 || k > INT32_MAX) {
    snprintf(why, sizeof(why), "%s: k is %lld; expected a positive multiple of 8 below 2^31", kOp,
             (long long)k);
    return fail_arg(why);
  }
  return TW_SUCCESS;
}

template <class Out> cudaError_t preload_wgrad() {
  cudaError_t e = preload_one<6, 16384, Out, false, 1, 128, 1, WgradWait, EpiGroupStore<Out>>();
  cudaError_t f = preload_one<3, 32768, Out, false, 1, kBlockN, 1, WgradWait, EpiGroupStore<Out>>();
  return e != cudaSuccess ? e : f;
}

} // namespace

/* Loads the weight gradient's kernels on the current device now (see tw_ops_preload). */
static tw_status_t tw_grouped_gemm_wgrad_preload(void) {
  cudaError_t e = preload_wgrad<__nv_bfloat16>();
  cudaError_t f = preload_wgrad<float>();
  cudaError_t t = preload_kernel<wgrad_transpose_kernel>();
  e = e != cudaSuccess ? e : (f != cudaSuccess ? f : t);
  return tw_cuda_check(e, "loading the grouped GEMM weight-gradient kernels");
}

static const tw_op_desc_t grouped_wgrad_registration = {"grouped_gemm_wgrad",
                                                        tw_grouped_gemm_wgrad_preload};
TW_OP_REGISTER(grouped_gemm_wgrad, grouped_wgrad_registration);

extern "C" tw_status_t tw_grouped_gemm_wgrad_workspace_size(int64_t m, int64_t n, int64_t k,
                                                            size_t *bytes) {
  if (!bytes)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_grouped_gemm_wgrad_workspace_size: bytes is NULL");
  tw_status_t st = check_shape(m, n, k);
  if (st != TW_SUCCESS)
    return st;
  *bytes = ws_layout(m, n, k).bytes;
  return TW_SUCCESS;
}

/* The arguments' contract before anything is launched: TW_ERR_INVALID_ARGUMENT naming the first
 * one that breaks it. Leading dimensions of 0 are defaulted here. */
static tw_status_t check_args(tw_grouped_gemm_args_t &a, const void *ws, size_t ws_bytes) {
  char why[256];
  if (a.c_dtype != TW_BF16 && a.c_dtype != TW_FP32) {
    snprintf(why, sizeof(why), "%s: c_dtype is %d; expected TW_BF16 or TW_FP32", kOp,
             (int)a.c_dtype);
    return fail_arg(why);
  }
  if (a.groups < 1 || a.groups > kMaxGroups) {
    snprintf(why, sizeof(why), "%s: groups is %lld; expected 1 .. %lld", kOp, (long long)a.groups,
             (long long)kMaxGroups);
    return fail_arg(why);
  }
  tw_status_t st = check_shape(a.m, a.n, a.k);
  if (st != TW_SUCCESS)
    return st;
  /* the loop's rows (groups x n rounded up to 128) and tiles stay int32 */
  const int64_t row_blocks = (a.n + kBlockM - 1) / kBlockM;
  if (a.groups * row_blocks * kBlockM > INT32_MAX ||
      a.groups * row_blocks * ((a.k + 127) / 128) > INT32_MAX) {
    snprintf(why, sizeof(why),
             "%s: groups (%lld) x n (%lld) rounded up to 128 rows, times k (%lld) / 128 tiles, "
             "must stay below 2^31",
             kOp, (long long)a.groups, (long long)a.n, (long long)a.k);
    return fail_arg(why);
  }
  if (a.lda == 0)
    a.lda = a.n;
  if (a.ldb == 0)
    a.ldb = a.k;
  if (a.ldo == 0)
    a.ldo = a.k;
  const int c_bytes = a.c_dtype == TW_BF16 ? 2 : 4;
  const struct {
    int64_t value, least, multiple;
    const char *name, *of;
  } dims[3] = {{a.lda, a.n, 8, "lda", "n"},
               {a.ldb, a.k, 8, "ldb", "k"},
               {a.ldo, a.k, 16 / c_bytes, "ldo", "k"}};
  for (int i = 0; i < 3; i++)
    if (dims[i].value < dims[i].least || dims[i].value % dims[i].multiple ||
        dims[i].value > INT32_MAX) {
      snprintf(why, sizeof(why),
               "%s: %s is %lld; expected >= %s (%lld), a multiple of %lld, below 2^31", kOp,
               dims[i].name, (long long)dims[i].value, dims[i].of, (long long)dims[i].least,
               (long long)dims[i].multiple);
      return fail_arg(why);
    }
  const void *ptrs[5] = {a.a, a.b, a.out, a.offsets, ws};
  const char *names[5] = {"a", "b", "out", "offsets", "workspace"};
  for (int i = 0; i < 5; i++) {
    const int align = i == 3 ? 4 : 16;
    if (!ptrs[i]) {
      snprintf(why, sizeof(why), "%s: %s is NULL", kOp, names[i]);
      return fail_arg(why);
    }
    if ((uintptr_t)ptrs[i] % align) {
      snprintf(why, sizeof(why), "%s: %s (%p) is not %d-byte aligned", kOp, names[i], ptrs[i],
               align);
      return fail_arg(why);
    }
  }
  const size_t need = ws_layout(a.m, a.n, a.k).bytes;
  if (ws_bytes < need) {
    snprintf(why, sizeof(why),
             "%s: workspace_bytes is %zu; expected at least %zu "
             "(tw_grouped_gemm_wgrad_workspace_size)",
             kOp, ws_bytes, need);
    return fail_arg(why);
  }
  return TW_SUCCESS;
}

/* Every operand is device memory of `device` as large as the shapes make it; out and the
 * workspace (both written) overlap no input and not each other. */
static tw_status_t check_pointers(const tw_grouped_gemm_args_t &a, const void *ws, int device) {
  const size_t c_bytes = a.c_dtype == TW_BF16 ? 2 : 4;
  const size_t bytes[5] = {
      (size_t)((a.m - 1) * a.lda + a.n) * 2, (size_t)((a.m - 1) * a.ldb + a.k) * 2,
      (size_t)((a.groups * a.n - 1) * a.ldo + a.k) * c_bytes,
      (size_t)(a.groups + 1) * sizeof(int32_t), ws_layout(a.m, a.n, a.k).bytes};
  const void *ptrs[5] = {a.a, a.b, a.out, a.offsets, ws};
  const char *whats[5] = {"tw_grouped_gemm_wgrad: a", "tw_grouped_gemm_wgrad: b",
                          "tw_grouped_gemm_wgrad: out", "tw_grouped_gemm_wgrad: offsets",
                          "tw_grouped_gemm_wgrad: workspace"};
  const char *names[5] = {"a", "b", "out", "offsets", "workspace"};
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < 5 && st == TW_SUCCESS; i++)
    st = tw_check_device_range(device, ptrs[i], bytes[i], whats[i]);
  /* out (2) and the workspace (4), both written, against every other range */
  for (int w = 2; w <= 4 && st == TW_SUCCESS; w += 2)
    for (int i = 0; i < 5 && st == TW_SUCCESS; i++)
      if (i != w && !(w == 4 && i == 2))
        st = tw_check_disjoint(ptrs[w], bytes[w], whats[w], ptrs[i], bytes[i], names[i]);
  return st;
}

/* out [groups][n, k] (ldo) as EpiGroupStore's 3-D map. */
template <class Out>
static tw_status_t out_map_3d(CUtensorMap *map, const tw_grouped_gemm_args_t &a) {
  const tw_driver_api_t *api = NULL;
  tw_status_t st = tw_driver(&api);
  if (st != TW_SUCCESS)
    return st;
  const cuuint64_t es = sizeof(Out);
  const cuuint64_t dims[3] = {(cuuint64_t)a.k, (cuuint64_t)a.n, (cuuint64_t)a.groups};
  const cuuint64_t strides[2] = {(cuuint64_t)a.ldo * es, (cuuint64_t)a.ldo * es * a.n};
  const cuuint32_t box[3] = {(cuuint32_t)(128 / es), (cuuint32_t)kBoxRows, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return tw_cu_check(
      api->cuTensorMapEncodeTiled(
          map,
          sizeof(Out) == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3,
          a.out, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
      "tw_grouped_gemm_wgrad: cuTensorMapEncodeTiled(out)");
}

static tw_status_t launch_transpose(const tw_grouped_gemm_args_t &a, void *ws, const WsLayout &w,
                                    int sms, cudaStream_t stream) {
  TransposeParams t;
  memset(&t, 0, sizeof(t));
  t.src[0] = (const __nv_bfloat16 *)a.a;
  t.src[1] = (const __nv_bfloat16 *)a.b;
  t.ld_src[0] = a.lda;
  t.ld_src[1] = a.ldb;
  t.dst[0] = (__nv_bfloat16 *)ws;
  t.dst[1] = (__nv_bfloat16 *)((char *)ws + w.bt_offset);
  t.cols[0] = (int32_t)a.n;
  t.cols[1] = (int32_t)a.k;
  t.col_tiles[0] = (int32_t)((a.n + kTrTile - 1) / kTrTile);
  t.col_tiles[1] = (int32_t)((a.k + kTrTile - 1) / kTrTile);
  t.ld = w.ld;
  t.offsets = a.offsets;
  t.groups = (int32_t)a.groups;
  t.m = (int32_t)a.m;
  t.zero_col = w.ld - kTrTile;
  /* at most the items of the bound (every row live), at most kTrBlocksPerSm per SM */
  const int64_t items = ((a.m + kTrTile - 1) / kTrTile + 1) * (t.col_tiles[0] + t.col_tiles[1]);
  const int64_t most = (int64_t)sms * kTrBlocksPerSm;
  const int grid = (int)(items < most ? items : most);
  wgrad_transpose_kernel<<<grid, kTrThreads, 0, stream>>>(t);
  return tw_cuda_check(cudaGetLastError(), "tw_grouped_gemm_wgrad: transpose kernel launch");
}

template <class Out>
static tw_status_t run(const tw_grouped_gemm_args_t &a, void *ws, int sms, int device,
                       cudaStream_t stream) {
  const WsLayout w = ws_layout(a.m, a.n, a.k);
  const int32_t row_blocks = (int32_t)((a.n + kBlockM - 1) / kBlockM);
  const int64_t rows = a.groups * row_blocks * kBlockM;
  tw_gemm_plan_t plan;
  tw_gemm_plan_make(rows, a.k, 0, sms, &plan);
  const bool n128 = plan.variant == TW_GEMM_V_N128_S6; /* else TW_GEMM_V_S3_E32 */
  const int bn = n128 ? 128 : kBlockN;
  GemmParams<EpiGroupStore<Out>, WgradWait> p;
  memset(&p, 0, sizeof(p));
  /* A = a^T [n, ld], B = b^T [k, ld]: K is the workspace's ld columns */
  tw_status_t st = operand_maps(&p.a_map, &p.b_map, ws, a.n, w.ld, (const char *)ws + w.bt_offset,
                                a.k, w.ld, w.ld, bn, kOp, "a^T (workspace)");
  if (st == TW_SUCCESS)
    st = out_map_3d<Out>(&p.epi.c_map, a);
  if (st != TW_SUCCESS)
    return st;
  p.epi.group_rows = row_blocks * kBlockM;
  TileOrder &o = p.order;
  o.m_blocks = (int32_t)(a.groups * row_blocks);
  o.n_blocks = (int32_t)((a.k + bn - 1) / bn);
  o.num_tiles = o.m_blocks * o.n_blocks;
  o.order = kOrderDefault;
  o.group_m = plan.group_m < 1 ? 1 : (plan.group_m > o.m_blocks ? o.m_blocks : plan.group_m);
  p.k_blocks = (int32_t)(w.ld / kBlockK);
  p.wait.offsets = a.offsets;
  p.wait.groups = (int32_t)a.groups;
  p.wait.row_blocks = row_blocks;
  p.wait.m = (int32_t)a.m;
  p.wait.zero_kb = (int32_t)((w.ld - kTrTile) / kBlockK);
  apply_fault_stall(p);
  if ((st = launch_transpose(a, ws, w, sms, stream)) != TW_SUCCESS)
    return st;
  const int grid = o.num_tiles < sms ? o.num_tiles : sms;
  if (n128)
    return launch_plain<6, 16384, Out, false, 1, 128, 1, WgradWait, EpiGroupStore<Out>>(
        p, grid, device, stream);
  return launch_plain<3, 32768, Out, false, 1, kBlockN, 1, WgradWait, EpiGroupStore<Out>>(
      p, grid, device, stream);
}

extern "C" tw_status_t tw_grouped_gemm_wgrad(const tw_grouped_gemm_args_t *args_in, void *workspace,
                                             size_t workspace_bytes, tw_stream_t stream) {
  tw_grouped_gemm_args_t a = TW_GROUPED_GEMM_ARGS_INIT;
  tw_status_t st =
      tw_args_copy(args_in, &a, sizeof(a), offsetof(tw_grouped_gemm_args_t, sm_count),
                   "tw_grouped_gemm_wgrad", "tw_grouped_gemm_args_t", "TW_GROUPED_GEMM_ARGS_INIT");
  if (st != TW_SUCCESS)
    return st;
  st = check_args(a, workspace, workspace_bytes);
  if (st != TW_SUCCESS)
    return st;
  int device = 0, sms = 0;
  if ((st = tw_op_device("tw_grouped_gemm_wgrad", &device)) != TW_SUCCESS)
    return st;
  if ((st = check_pointers(a, workspace, device)) != TW_SUCCESS)
    return st;
  if ((st = tw_op_sms("tw_grouped_gemm_wgrad", device, a.sm_count, &sms)) != TW_SUCCESS)
    return st;
  return a.c_dtype == TW_BF16 ? run<__nv_bfloat16>(a, workspace, sms, device, (cudaStream_t)stream)
                              : run<float>(a, workspace, sms, device, (cudaStream_t)stream);
}
