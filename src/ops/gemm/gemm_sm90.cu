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
#include "gemm/gemm_launch.cuh"
#include "gemm/gemm_pp_sm90.cuh"
#include "gemm/gemm_sm90.cuh"
#include "gemm/tma_map.h"
#include "ops/gemm/gemm_sm90.h"
#include "ops/gemm_rs/gemm_ll.cuh"
#include "ops/gemm_rs/gemm_released.cuh"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "runtime/registry.h"

using namespace tw::gemm;

namespace {

// Queue of the dynamic-schedule variant of the plain GEMM (fused ops bring their own).
__device__ TileQueue g_plain_queue;

constexpr int kMaxDevices = 64;

// A GEMM-core kernel (gemm_sm90_kernel or gemm_sm90_pp_kernel) on `grid` CTAs of kSmem bytes of
// dynamic shared memory, in clusters of kClusterSize CTAs, as a programmatic dependent where
// params.after_grid says so.
template <auto Kernel, int kClusterSize, int kSmem, class GP>
tw_status_t launch_kernel(const GP &params, int grid, int device, cudaStream_t stream) {
  auto kernel = Kernel;
  // The shared-memory limit is raised once per device and kernel.
  static uint64_t configured;
  tw_status_t st = tw_kernel_smem_once((const void *)kernel, kSmem, &configured,
                                       "tw_gemm: cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (st != TW_SUCCESS)
    return st;
  if (kClusterSize == 1 && !params.after_grid) {
    kernel<<<grid, kThreads, kSmem, stream>>>(params);
    return tw_cuda_check(cudaGetLastError(), "tw_gemm: kernel launch");
  }
  cudaLaunchConfig_t config;
  memset(&config, 0, sizeof(config));
  cudaLaunchAttribute attr[2];
  memset(attr, 0, sizeof(attr));
  config.gridDim = dim3((unsigned)grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmem;
  config.stream = stream;
  config.attrs = attr;
  // GemmParams::after_grid: a programmatic dependent of the grid before it in the stream (the
  // attribute last, so that the occupancy query below sees the cluster's alone)
  if (kClusterSize == 1) {
    attr[0] = pdl_attribute();
    config.numAttrs = 1;
    return tw_cuda_check(cudaLaunchKernelEx(&config, kernel, params),
                         "tw_gemm: cudaLaunchKernelEx (programmatic dependent)");
  }
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kClusterSize;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.numAttrs = 1;
  // Clusters (pairs, or split-K's slices) that cannot all be resident would run as a second,
  // mostly idle wave.
  static std::atomic<int> max_pairs[kMaxDevices];
  int pairs = max_pairs[device % kMaxDevices].load(std::memory_order_relaxed);
  if (pairs == 0) {
    st = tw_cuda_check(cudaOccupancyMaxActiveClusters(&pairs, kernel, &config),
                       "tw_gemm: cudaOccupancyMaxActiveClusters");
    if (st != TW_SUCCESS)
      return st;
    if (pairs < 1)
      return tw_fail(TW_ERR_INTERNAL, "tw_gemm: no cluster of %d CTAs of the GEMM kernel fits",
                     kClusterSize);
    max_pairs[device % kMaxDevices].store(pairs, std::memory_order_relaxed);
  }
  if (grid > kClusterSize * pairs)
    config.gridDim = dim3((unsigned)(kClusterSize * pairs));
  if (params.after_grid)
    attr[config.numAttrs++] = pdl_attribute();
  return tw_cuda_check(cudaLaunchKernelEx(&config, kernel, params),
                       "tw_gemm: cudaLaunchKernelEx (cluster)");
}

template <int Stages, int EpiBytes, class Out, bool kDynamic, int kCluster = 1, int BN = kBlockN,
          int kSplit = 1, class Wait = NoWait, class Epi = EpiTmaStore<Out>, int kTileM = kBlockM,
          bool kSplitWs = false>
tw_status_t launch_plain(const GemmParams<Epi, Wait> &params, int grid, int device,
                         cudaStream_t stream) {
  // split-K through global memory (kSplitWs) runs its slices as single CTAs
  return launch_kernel < gemm_sm90_kernel<Stages, EpiBytes, Epi, Wait, kDynamic, kCluster, BN,
                                          kSplit, kTileM, kSplitWs>,
         kSplitWs ? kCluster : kCluster * kSplit,
         SmemLayout<Stages, EpiBytes, BN, kTileM>::kDynamicBytes > (params, grid, device, stream);
}

// The ping-pong loop (TW_GEMM_V_PP_N128 / _N192, gemm_pp_sm90.cuh): single CTAs, 128 x BN
// tiles, the stages and epilogue buffers that fit.
template <int BN> struct PpConfig;
template <> struct PpConfig<128> { static constexpr int kStages = 6, kEpiBytes = 16384; };
template <> struct PpConfig<192> { static constexpr int kStages = 4, kEpiBytes = 24576; };
template <class Out, int BN, bool kDynamic> constexpr auto pp_kernel() {
  return gemm_sm90_pp_kernel<PpConfig<BN>::kStages, PpConfig<BN>::kEpiBytes, BN, EpiTmaStore<Out>,
                             NoWait, kDynamic>;
}
template <class Out, int BN, bool kDynamic>
tw_status_t launch_pp(const GemmParams<EpiTmaStore<Out>, NoWait> &params, int grid, int device,
                      cudaStream_t stream) {
  return launch_kernel<
      pp_kernel<Out, BN, kDynamic>(), 1,
      PpSmemLayout<PpConfig<BN>::kStages, PpConfig<BN>::kEpiBytes, BN>::kDynamicBytes>(
      params, grid, device, stream);
}

template <class Out>
tw_status_t launch_out(const GemmParams<EpiTmaStore<Out>, NoWait> &params, int variant,
                       bool dynamic, int grid, int device, cudaStream_t stream) {
  if (variant == TW_GEMM_V_PP_N128)
    return dynamic ? launch_pp<Out, 128, true>(params, grid, device, stream)
                   : launch_pp<Out, 128, false>(params, grid, device, stream);
  if (variant == TW_GEMM_V_PP_N192)
    return dynamic ? launch_pp<Out, 192, true>(params, grid, device, stream)
                   : launch_pp<Out, 192, false>(params, grid, device, stream);
  if (variant == TW_GEMM_V_N128_S6)
    return dynamic ? launch_plain<6, 16384, Out, true, 1, 128>(params, grid, device, stream)
                   : launch_plain<6, 16384, Out, false, 1, 128>(params, grid, device, stream);
  if (variant == TW_GEMM_V_S4_E16_C2)
    return launch_plain<4, 16384, Out, false, 2>(params, grid, device, stream);
  if (variant == TW_GEMM_V_S3_E32_C2)
    return launch_plain<3, 32768, Out, false, 2>(params, grid, device, stream);
  if (variant == TW_GEMM_V_S3_E32)
    return dynamic ? launch_plain<3, 32768, Out, true>(params, grid, device, stream)
                   : launch_plain<3, 32768, Out, false>(params, grid, device, stream);
  return dynamic ? launch_plain<4, 16384, Out, true>(params, grid, device, stream)
                 : launch_plain<4, 16384, Out, false>(params, grid, device, stream);
}

// The unfused pipeline's GEMM (opts->released): the 1-CTA static variants the plan picks.
template <class Out>
tw_status_t launch_released(const GemmParams<EpiTmaStore<Out>, ReleasedWait> &params, int variant,
                            int grid, int device, cudaStream_t stream) {
  if (variant == TW_GEMM_V_N128_S6)
    return launch_plain<6, 16384, Out, false, 1, 128, 1, ReleasedWait>(params, grid, device,
                                                                       stream);
  return launch_plain<3, 32768, Out, false, 1, kBlockN, 1, ReleasedWait>(params, grid, device,
                                                                         stream);
}

// Split-K (tw_gemm_args_t.split_k): 128 x 128 tiles, 4 stages and a 32 KiB epilogue buffer per
// consumer warpgroup (it also holds a slice's accumulators for its reader), on clusters of
// `split` CTAs.
constexpr int kSplitStages = 4, kSplitEpiBytes = 32768;

template <class Out>
tw_status_t launch_split(const GemmParams<EpiTmaStore<Out>, NoWait> &params, int split, int grid,
                         int device, cudaStream_t stream) {
  if (split == 8)
    return launch_plain<kSplitStages, kSplitEpiBytes, Out, false, 1, 128, 8>(params, grid, device,
                                                                             stream);
  if (split == 4)
    return launch_plain<kSplitStages, kSplitEpiBytes, Out, false, 1, 128, 4>(params, grid, device,
                                                                             stream);
  return launch_plain<kSplitStages, kSplitEpiBytes, Out, false, 1, 128, 2>(params, grid, device,
                                                                           stream);
}

// Swap-AB (decode shapes, tw_gemm_swap_bn): tiles of 128 of B's rows x MT (16 or 64) of A's,
// a 16 KiB epilogue buffer per consumer warpgroup (the transposed boxes, and split-K's
// accumulators), as many stages as fit beside it; split-K's slices on clusters as above.
constexpr int kSwapEpiBytes = 16384;
template <int MT> constexpr int swap_stages() { return MT == 16 ? 10 : 7; }
// 64-row tiles (tw_gemm_swap_half): one consumer warpgroup takes all MT of A's rows (the
// workspace's slices: each MT / 2), so its transposed boxes are MT C rows x 128 bytes (at most
// 16 KiB for both fp32 boxes: both warpgroups' 8 KiB buffers, the other's idle); a stage is
// 8 KiB of B's rows and 2, 4 or 8 KiB of A's (MT 16, 32 or 64: tw_gemm_swap_half_mt), so 16,
// 16 or 12 fit.
constexpr int kSwapHalfEpiBytes = 8192;
template <int MT> constexpr int swap_half_stages() { return MT == 64 ? 12 : 16; }

template <class Out, int MT, class Wait, class E = EpiTmaStoreT<Out>>
tw_status_t launch_swap(const GemmParams<E, Wait> &params, int split, int grid, int device,
                        cudaStream_t stream) {
  constexpr int S = swap_stages<MT>();
  if constexpr (std::is_same<Wait, NoWait>::value && std::is_same<E, EpiTmaStoreT<Out>>::value) {
    if (split == 8)
      return launch_plain<S, kSwapEpiBytes, Out, false, 1, MT, 8, Wait, E>(params, grid, device,
                                                                           stream);
    if (split == 4)
      return launch_plain<S, kSwapEpiBytes, Out, false, 1, MT, 4, Wait, E>(params, grid, device,
                                                                           stream);
    if (split == 2)
      return launch_plain<S, kSwapEpiBytes, Out, false, 1, MT, 2, Wait, E>(params, grid, device,
                                                                           stream);
  }
  return launch_plain<S, kSwapEpiBytes, Out, false, 1, MT, 1, Wait, E>(params, grid, device,
                                                                       stream);
}

template <class Out, int MT, class Wait, class E = EpiTmaStoreT<Out>>
tw_status_t launch_swap_half(const GemmParams<E, Wait> &params, int grid, int device,
                             cudaStream_t stream) {
  return launch_plain<swap_half_stages<MT>(), kSwapHalfEpiBytes, Out, false, 1, MT / 2, 1, Wait, E,
                      64>(params, grid, device, stream);
}

// Split-K through a workspace (tw_gemm_args_t.workspace, tw_gemm_ws_split): 2, 4 or 8 slices
// as single CTAs, summed by the last to finish (detail::split_ws_combine), on tiles of half the
// tree's: swapped, 64-row tiles (the stages and epilogue buffer of launch_swap_half: the
// accumulators go to global memory, not through it); unswapped, 128 x 64 tiles (twice the
// 128 x 128 tiles' count; the same products, so the same bits), 6 stages and 16 KiB epilogue
// buffers (kWsStages, kWsEpiBytes).
constexpr int kWsStages = 6, kWsEpiBytes = 16384;
template <int Stages, int EpiBytes, class Out, int BN, class E, int kTileM>
tw_status_t launch_ws(const GemmParams<E, NoWait> &params, int split, int grid, int device,
                      cudaStream_t stream) {
  if (split == 8)
    return launch_plain<Stages, EpiBytes, Out, false, 1, BN, 8, NoWait, E, kTileM, true>(
        params, grid, device, stream);
  if (split == 4)
    return launch_plain<Stages, EpiBytes, Out, false, 1, BN, 4, NoWait, E, kTileM, true>(
        params, grid, device, stream);
  if (split == 2)
    return launch_plain<Stages, EpiBytes, Out, false, 1, BN, 2, NoWait, E, kTileM, true>(
        params, grid, device, stream);
  return tw_fail(TW_ERR_INTERNAL, "tw_gemm: %d slices through the workspace", split);
}
// Loads a kernel's module now (cudaFuncGetAttributes), not at its first launch (see
// tw_ops_preload): preload_one for gemm_sm90_kernel's instantiations, preload_out for
// launch_pp's.
template <auto Kernel> cudaError_t preload_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, Kernel);
}
template <int Stages, int EpiBytes, class Out, bool kDynamic, int kCluster = 1, int BN = kBlockN,
          int kSplit = 1, class Wait = NoWait, class Epi = EpiTmaStore<Out>, int kTileM = kBlockM,
          bool kSplitWs = false>
cudaError_t preload_one() {
  return preload_kernel<gemm_sm90_kernel<Stages, EpiBytes, Epi, Wait, kDynamic, kCluster, BN,
                                         kSplit, kTileM, kSplitWs>>();
}

/* launch_ws's, for one tile. */
template <int Stages, int EpiBytes, class Out, int BN, class E, int kTileM>
cudaError_t preload_ws() {
  cudaError_t e = cudaSuccess, r;
  if ((r = preload_one<Stages, EpiBytes, Out, false, 1, BN, 8, NoWait, E, kTileM, true>()) !=
      cudaSuccess)
    e = r;
  if ((r = preload_one<Stages, EpiBytes, Out, false, 1, BN, 4, NoWait, E, kTileM, true>()) !=
      cudaSuccess)
    e = r;
  if ((r = preload_one<Stages, EpiBytes, Out, false, 1, BN, 2, NoWait, E, kTileM, true>()) !=
      cudaSuccess)
    e = r;
  return e;
}

/* launch_swap_half's, for one tile width (unsplit): the plain GEMM, the released wait and the
 * unfused pipeline's two epilogues into the low-latency area. */
template <class Out, int MT> cudaError_t preload_swap_half() {
  constexpr int SH = swap_half_stages<MT>();
  using E = EpiTmaStoreT<Out>;
  cudaError_t e = cudaSuccess, r;
  if ((r = preload_one<SH, kSwapHalfEpiBytes, Out, false, 1, MT / 2, 1, NoWait, E, 64>()) !=
      cudaSuccess)
    e = r;
  if ((r = preload_one<SH, kSwapHalfEpiBytes, Out, false, 1, MT / 2, 1, ReleasedWait, E, 64>()) !=
      cudaSuccess)
    e = r;
  if ((r = preload_one<SH, kSwapHalfEpiBytes, Out, false, 1, MT / 2, 1, NoWait, EpiLlPushT<Out>,
                       64>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<SH, kSwapHalfEpiBytes, Out, false, 1, MT / 2, 1, NoWait, EpiLlReduceT<Out>,
                       64>()) != cudaSuccess)
    e = r;
  return e;
}

/* launch_swap's, for one tile width, with launch_swap_half's and launch_ws's of that width. */
template <class Out, int MT> cudaError_t preload_swap() {
  constexpr int S = swap_stages<MT>();
  using E = EpiTmaStoreT<Out>;
  cudaError_t e = cudaSuccess, r;
  if ((r = preload_one<S, kSwapEpiBytes, Out, false, 1, MT, 1, NoWait, E>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<S, kSwapEpiBytes, Out, false, 1, MT, 2, NoWait, E>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<S, kSwapEpiBytes, Out, false, 1, MT, 4, NoWait, E>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<S, kSwapEpiBytes, Out, false, 1, MT, 8, NoWait, E>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<S, kSwapEpiBytes, Out, false, 1, MT, 1, ReleasedWait, E>()) != cudaSuccess)
    e = r;
  /* the unfused pipeline's epilogues into the low-latency area */
  if ((r = preload_one<S, kSwapEpiBytes, Out, false, 1, MT, 1, NoWait, EpiLlPushT<Out>>()) !=
      cudaSuccess)
    e = r;
  if ((r = preload_one<S, kSwapEpiBytes, Out, false, 1, MT, 1, NoWait, EpiLlReduceT<Out>>()) !=
      cudaSuccess)
    e = r;
  if ((r = preload_swap_half<Out, MT>()) != cudaSuccess)
    e = r;
  /* launch_ws's, swapped */
  if ((r = preload_ws<swap_half_stages<MT>(), kSwapHalfEpiBytes, Out, MT / 2, E, 64>()) !=
      cudaSuccess)
    e = r;
  return e;
}

/* Every instantiation launch_out, launch_split, launch_released and launch_swap can pick (keep
 * the lists in step). */
template <class Out> cudaError_t preload_out() {
  cudaError_t e = cudaSuccess, r;
  if ((r = preload_one<6, 16384, Out, true, 1, 128>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<6, 16384, Out, false, 1, 128>()) != cudaSuccess)
    e = r;
  /* launch_pp's */
  if ((r = preload_kernel<pp_kernel<Out, 128, false>()>()) != cudaSuccess)
    e = r;
  if ((r = preload_kernel<pp_kernel<Out, 128, true>()>()) != cudaSuccess)
    e = r;
  if ((r = preload_kernel<pp_kernel<Out, 192, false>()>()) != cudaSuccess)
    e = r;
  if ((r = preload_kernel<pp_kernel<Out, 192, true>()>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<4, 16384, Out, false, 2>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<3, 32768, Out, false, 2>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<3, 32768, Out, true>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<3, 32768, Out, false>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<4, 16384, Out, true>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<4, 16384, Out, false>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<kSplitStages, kSplitEpiBytes, Out, false, 1, 128, 2>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<kSplitStages, kSplitEpiBytes, Out, false, 1, 128, 4>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<kSplitStages, kSplitEpiBytes, Out, false, 1, 128, 8>()) != cudaSuccess)
    e = r;
  /* launch_ws's, unswapped */
  if ((r = preload_ws<kWsStages, kWsEpiBytes, Out, 64, EpiTmaStore<Out>, kBlockM>()) != cudaSuccess)
    e = r;
  /* launch_released's */
  if ((r = preload_one<6, 16384, Out, false, 1, 128, 1, ReleasedWait>()) != cudaSuccess)
    e = r;
  if ((r = preload_one<3, 32768, Out, false, 1, kBlockN, 1, ReleasedWait>()) != cudaSuccess)
    e = r;
  if ((r = preload_swap<Out, 16>()) != cudaSuccess)
    e = r;
  if ((r = preload_swap<Out, 64>()) != cudaSuccess)
    e = r;
  if ((r = preload_swap_half<Out, 32>()) != cudaSuccess) /* tw_gemm_swap_half_mt's 32 */
    e = r;
  return e;
}

tw_status_t check_aligned(const void *ptr, const char *name) {
  if (!ptr)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: %s is NULL", name);
  if ((uintptr_t)ptr % 16)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: %s (%p) is not 16-byte aligned", name, ptr);
  return TW_SUCCESS;
}

// The unfused pipeline's wait hook (opts.released): the comm and the call's channel; the order
// comes with the schedule.
inline ReleasedWait::Params released_params(const tw_gemm_sm90_opts_t &opts) {
  ReleasedWait::Params w;
  memset(&w, 0, sizeof(w));
  w.dc = *opts.released;
  w.ch = opts.released_ch;
  return w;
}

inline void set_wait_order(NoWait::Params &, const TileOrder &) {}
inline void set_wait_order(ReleasedWait::Params &w, const TileOrder &o) { w.order = o; }

// The rest of a static schedule once params.order is set: K blocks, the grid (whole clusters of
// `cluster` CTAs, one schedule unit each, at most one per tile), the rows split-K may skip past
// (`rows`: the loop's rows, the product's N for swap-AB), the fault knob and the wait hook's
// copy of the order. Returns the grid.
template <class GP> int schedule(GP &params, int64_t k, int64_t rows, int cluster, int sms) {
  const TileOrder &o = params.order;
  params.k_blocks = (int32_t)((k + kBlockK - 1) / kBlockK);
  const int units = sms / cluster;
  const int grid = cluster * (o.num_tiles < units ? o.num_tiles : units);
  params.participants = grid;
  params.rows = rows < INT32_MAX ? (int32_t)rows : INT32_MAX;
  apply_fault_stall(params);
  set_wait_order(params.wait, o);
  return grid;
}

// Split-K through the caller's workspace (tw_gemm_ws_split): the slices, the partials (after
// the counter block) and the counters.
struct WsPlan {
  int split;
  float *part;
  uint32_t *cnt;
};

// Swap-AB (tw_gemm_swap_bn: m <= 64): the loop computes C^T = B * A^T in tiles of 128 of B's
// rows x mt (16 or 64) of A's, its "A" operand map over B, its "B" operand map over A, and
// stores C transposed (EpiTmaStoreT). Tile orders only move work between CTAs (the same bits),
// so the default order serves; split-K sums the same slices in the same tree as run()'s.
// half (tw_gemm_swap_half, unsplit): tiles of 64 of B's rows, twice as many, one consumer
// warpgroup taking all mt of A's rows (the workspace's slices: each warpgroup mt / 2; the same
// products in the same k order: the same bits).
// E = EpiLlPushT<Out> (opts.ll, unsplit): the tiles go into the owners' low-latency areas as
// words (gemm_ll.cuh) instead of into c; EpiLlReduceT<Out> (opts.ll->reduce): the peers' rows
// so, this rank's own summed into opts.ll->out.
template <class Out, class Wait = NoWait, class E = EpiTmaStoreT<Out>>
tw_status_t
run_swap(const tw_gemm_args_t &a, int mt, bool half, int sms, int split, int device,
         cudaStream_t stream, const typename Wait::Params &wait = typename Wait::Params(),
         const tw_gemm_ll_epi_t *ll = NULL, bool after_grid = false, const WsPlan *ws = NULL) {
  GemmParams<E, Wait> params;
  memset(&params, 0, sizeof(params));
  params.wait = wait;
  params.after_grid = after_grid ? kAfterGridB : 0; // the previous grid writes a: the loop's B
  if (ws) { // 64-row tiles, the slices as single CTAs (launch_ws)
    half = true;
    params.split_ws = ws->part;
    params.split_cnt = ws->cnt;
  }
  const int tile_m = half ? 64 : kBlockM;
  tw_status_t st = tw_tma_map_2d(&params.a_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, a.b,
                                 (uint64_t)a.k, (uint64_t)a.n, (uint64_t)a.ldb, kBlockK,
                                 (uint32_t)tile_m, "tw_gemm: cuTensorMapEncodeTiled(b, swapped)");
  if (st == TW_SUCCESS)
    st = tw_tma_map_2d(&params.b_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, a.a, (uint64_t)a.k,
                       (uint64_t)a.m, (uint64_t)a.lda, kBlockK, (uint32_t)mt,
                       "tw_gemm: cuTensorMapEncodeTiled(a, swapped)");
  constexpr bool kLlReduce = std::is_same<E, EpiLlReduceT<Out>>::value;
  if constexpr (kLlReduce || std::is_same<E, EpiLlPushT<Out>>::value) {
    if (!ll || split != 1)
      return tw_fail(TW_ERR_INTERNAL, "tw_gemm: the low-latency epilogue serves unsplit GEMMs");
    for (int r = 0; r < TW_MAX_WORLD; r++)
      params.epi.area[r] = ll->area[r];
    params.epi.ll_seq = ll->ll_seq;
    params.epi.half_bytes = ll->half_bytes;
    params.epi.slot_bytes = ll->slot_bytes;
    params.epi.rank = ll->rank;
    params.epi.m = (int32_t)a.m;
    params.epi.m_local = ll->m_local;
    params.epi.vecs = (int32_t)(a.n / (16 / (int64_t)sizeof(Out)));
    if constexpr (kLlReduce) {
      if (!ll->dc || !ll->out)
        return tw_fail(TW_ERR_INTERNAL, "tw_gemm: the low-latency reduce needs a comm and an out");
      params.epi.dc = *ll->dc;
      params.epi.ch = ll->ch;
      params.epi.out = (__nv_bfloat16 *)ll->out;
      params.epi.ldo = ll->ldo;
    }
  } else if (st == TW_SUCCESS) {
    st = out_map<Out>(&params.epi.c_map, a.c, a.n, a.m, a.ldc,
                      "tw_gemm: cuTensorMapEncodeTiled(c, swapped)",
                      half && ws ? mt / 2 : mt); // 64-row tiles store mt rows from one
                                                 // consumer (kOneWg), the workspace's mt / 2
  }
  if (st != TW_SUCCESS)
    return st;
  TileOrder &o = params.order;
  o.m_blocks = (int32_t)((a.n + tile_m - 1) / tile_m);
  o.n_blocks = (int32_t)((a.m + mt - 1) / mt);
  o.num_tiles = o.m_blocks * o.n_blocks;
  o.order = kOrderDefault;
  o.group_m = 1;
  const int grid = schedule(params, a.k, a.n, split, sms);
  if constexpr (std::is_same<Wait, NoWait>::value && std::is_same<E, EpiTmaStoreT<Out>>::value) {
    if (ws)
      return mt == 16 ? launch_ws<swap_half_stages<16>(), kSwapHalfEpiBytes, Out, 16 / 2,
                                  EpiTmaStoreT<Out>, 64>(params, split, grid, device, stream)
                      : launch_ws<swap_half_stages<64>(), kSwapHalfEpiBytes, Out, 64 / 2,
                                  EpiTmaStoreT<Out>, 64>(params, split, grid, device, stream);
  }
  if (ws)
    return tw_fail(TW_ERR_INTERNAL, "tw_gemm: the workspace's slices serve the plain GEMM");
  if (half && split == 1)
    return mt == 16   ? launch_swap_half<Out, 16, Wait, E>(params, grid, device, stream)
           : mt == 32 ? launch_swap_half<Out, 32, Wait, E>(params, grid, device, stream)
                      : launch_swap_half<Out, 64, Wait, E>(params, grid, device, stream);
  if (half)
    return tw_fail(TW_ERR_INTERNAL, "tw_gemm: 64-row swap-AB tiles serve unsplit GEMMs (split %d)",
                   split);
  if (mt == 16)
    return launch_swap<Out, 16, Wait, E>(params, split, grid, device, stream);
  return launch_swap<Out, 64, Wait, E>(params, split, grid, device, stream);
}

template <class Out, class Wait = NoWait>
tw_status_t run(const tw_gemm_args_t &a, const tw_gemm_plan_t &plan, int variant, bool dynamic,
                int group_m, int sms, int split, int device, cudaStream_t stream,
                const typename Wait::Params &wait = typename Wait::Params(),
                bool after_grid = false, const WsPlan *ws = NULL) {
  const bool clustered = variant == TW_GEMM_V_S4_E16_C2 || variant == TW_GEMM_V_S3_E32_C2;
  // The tile queue serves single CTAs; a pair needs two SMs.
  if (clustered && (dynamic || sms < 2))
    variant = variant == TW_GEMM_V_S4_E16_C2 ? TW_GEMM_V_S4_E16 : TW_GEMM_V_S3_E32;
  const bool pair =
      split == 1 && (variant == TW_GEMM_V_S4_E16_C2 || variant == TW_GEMM_V_S3_E32_C2);
  // ws: 128 x 64 tiles, the slices as single CTAs (launch_ws)
  const int32_t bn = ws ? 64
                        : (split > 1 || variant == TW_GEMM_V_N128_S6 || variant == TW_GEMM_V_PP_N128
                               ? 128
                               : (variant == TW_GEMM_V_PP_N192 ? 192 : kBlockN));
  GemmParams<EpiTmaStore<Out>, Wait> params;
  memset(&params, 0, sizeof(params));
  params.wait = wait;
  params.after_grid = after_grid ? kAfterGridA : 0;
  if (ws) {
    params.split_ws = ws->part;
    params.split_cnt = ws->cnt;
  }
  tw_status_t st;
  st = operand_maps(&params.a_map, &params.b_map, a.a, a.m, a.lda, a.b, a.n, a.ldb, a.k,
                    pair ? bn / 2 : bn, "tw_gemm", "a");
  if (st == TW_SUCCESS)
    st =
        out_map<Out>(&params.epi.c_map, a.c, a.n, a.m, a.ldc, "tw_gemm: cuTensorMapEncodeTiled(c)");
  if (st != TW_SUCCESS)
    return st;
  TileOrder &o = params.order;
  // A pair's schedule unit is two row blocks (one per CTA).
  const int32_t unit = pair ? 2 : 1;
  const int32_t m_blocks = (int32_t)((a.m + kBlockM - 1) / kBlockM);
  o.m_blocks = (m_blocks + unit - 1) / unit;
  o.n_blocks = (int32_t)((a.n + bn - 1) / bn);
  o.num_tiles = o.m_blocks * o.n_blocks;
  o.order = a.tile_order;
  int32_t g = (group_m > 0 ? group_m : plan.group_m) / unit;
  o.group_m = g < 1 ? 1 : (g > o.m_blocks ? o.m_blocks : g);
  o.rotate_mb =
      a.tile_order == TW_TILE_ORDER_ROTATED ? (int32_t)(a.rotate_start / kBlockM) / unit : 0;
  // A schedule unit: a pair's two CTAs, or split-K's slices of one tile.
  const int grid = schedule(params, a.k, a.m, split > 1 ? split : unit, sms);
  params.split_scatter = split > 1 && !ws && tw_env_int(TW_SPLIT_SCATTER_ID) != 0;
  params.split_n = (int32_t)a.n;
  params.split_c = a.c;
  params.split_ldc = a.ldc;
  if constexpr (!std::is_same<Wait, NoWait>::value) {
    if (ws)
      return tw_fail(TW_ERR_INTERNAL, "tw_gemm: the workspace's slices serve the plain GEMM");
    return launch_released<Out>(params, variant, grid, device, stream);
  } else {
    if (ws)
      return launch_ws<kWsStages, kWsEpiBytes, Out, 64, EpiTmaStore<Out>, kBlockM>(
          params, split, grid, device, stream);
    if (split > 1)
      return launch_split<Out>(params, split, grid, device, stream);
    if (dynamic) {
      st = tw_cuda_check(cudaGetSymbolAddress((void **)&params.queue, g_plain_queue),
                         "tw_gemm: cudaGetSymbolAddress(queue)");
      if (st != TW_SUCCESS)
        return st;
    }
    return launch_out<Out>(params, variant, dynamic, grid, device, stream);
  }
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

extern "C" tw_status_t tw_gemm_sm90_launch(const tw_gemm_args_t *args_in, tw_stream_t stream,
                                           const tw_gemm_sm90_opts_t *opts) {
  if (!args_in)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_gemm: args is NULL");
  if (args_in->size < offsetof(tw_gemm_args_t, sm_count))
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: args->size is %zu; expected sizeof(tw_gemm_args_t) = %zu "
                   "(initialise with TW_GEMM_ARGS_INIT)",
                   args_in->size, sizeof(tw_gemm_args_t));
  // A caller built against an older, shorter struct: read only what it has.
  tw_gemm_args_t a = TW_GEMM_ARGS_INIT;
  memcpy(&a, args_in, args_in->size < sizeof(a) ? args_in->size : sizeof(a));
  a.size = sizeof(a);

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
  if (a.lda == 0)
    a.lda = a.k;
  if (a.ldb == 0)
    a.ldb = a.k;
  if (a.ldc == 0)
    a.ldc = a.n;
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
  tw_status_t st;
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

  int device = 0;
  if ((st = tw_cuda_check(cudaGetDevice(&device), "tw_gemm: cudaGetDevice")) != TW_SUCCESS)
    return st;
  if ((st = tw_check_device(device)) != TW_SUCCESS)
    return st;
  int sms = 0;
  if ((st = tw_cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                          "tw_gemm: multiprocessor count")) != TW_SUCCESS)
    return st;
  if (a.sm_count < 0 || a.sm_count > sms)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "tw_gemm: sm_count is %d; expected 0 (all) or 1..%d (device %d's SMs)",
                   (int)a.sm_count, sms, device);
  if (a.sm_count > 0)
    sms = a.sm_count;

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
  if (after_grid && (opts->released || opts->ll))
    return tw_fail(TW_ERR_INTERNAL,
                   "tw_gemm: opts->after_grid serves the plain GEMM (no released wait, no "
                   "low-latency epilogue)");
  // Swap-AB at decode shapes (TW_GEMM_SWAP, read per call), where no variant or queue is forced.
  // TW_SPLIT_SCATTER's slices store C untransposed: they keep 128-row tiles.
  const int swap_env = (int)tw_env_int(TW_GEMM_SWAP_ID);
  const int swap_mt = tw_gemm_swap_bn_upto(
      swap_env, a.m,
      opts && opts->swap_max_m > 0 ? opts->swap_max_m : tw_gemm_swap_rule_max_m(a.n, split, sms));
  // split_k -1 with a workspace: the tree's slices as single CTAs on tiles of half its width,
  // twice the CTAs (tw_gemm_ws_split, by the shape; the same bits as the tree's).
  if (a.split_k < 0 && a.workspace && !dynamic &&
      !(opts && (opts->variant >= 0 || opts->released || opts->ll)) &&
      tw_env_int(TW_SPLIT_SCATTER_ID) == 0) {
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
                                             NoWait::Params(), NULL, after_grid, &ws)
                   : run_swap<float>(a, swap_mt, true, sms, ws_split, device, s, NoWait::Params(),
                                     NULL, after_grid, &ws);
      return a.c_dtype == TW_BF16
                 ? run<__nv_bfloat16>(a, plan, variant, false, group_m, sms, ws_split, device, s,
                                      NoWait::Params(), after_grid, &ws)
                 : run<float>(a, plan, variant, false, group_m, sms, ws_split, device, s,
                              NoWait::Params(), after_grid, &ws);
    }
  }
  if (swap_mt && (!opts || (opts->variant < 0 && !opts->dynamic_queue)) &&
      !(split > 1 && tw_env_int(TW_SPLIT_SCATTER_ID) != 0)) {
    const bool half = tw_gemm_swap_half(swap_env, a.m, a.n, split, sms) != 0;
    // 64-row tiles: 32 of A's rows wide at m <= 32 (unsplit, so every route below)
    const int mt = half && split == 1 ? tw_gemm_swap_half_mt(swap_mt, a.m) : swap_mt;
    if (opts && opts->ll) {
      if (split > 1 || opts->released)
        return tw_fail(TW_ERR_INTERNAL,
                       "tw_gemm: the low-latency epilogue serves unsplit GEMMs with no wait");
      const NoWait::Params w = NoWait::Params();
      if (opts->ll->reduce) /* tw_gemm_rs's own rows summed in the epilogue */
        return a.c_dtype == TW_BF16 ? run_swap<__nv_bfloat16, NoWait, EpiLlReduceT<__nv_bfloat16>>(
                                          a, mt, half, sms, 1, device, s, w, opts->ll)
                                    : run_swap<float, NoWait, EpiLlReduceT<float>>(
                                          a, mt, half, sms, 1, device, s, w, opts->ll);
      if (a.c_dtype == TW_BF16)
        return run_swap<__nv_bfloat16, NoWait, EpiLlPushT<__nv_bfloat16>>(a, mt, half, sms, 1,
                                                                          device, s, w, opts->ll);
      return run_swap<float, NoWait, EpiLlPushT<float>>(a, mt, half, sms, 1, device, s, w,
                                                        opts->ll);
    }
    if (opts && opts->released) {
      if (split > 1)
        return tw_fail(TW_ERR_INTERNAL,
                       "tw_gemm: the released wait serves unsplit GEMMs (split %d)", split);
      const ReleasedWait::Params w = released_params(*opts);
      if (a.c_dtype == TW_BF16)
        return run_swap<__nv_bfloat16, ReleasedWait>(a, mt, half, sms, 1, device, s, w);
      return run_swap<float, ReleasedWait>(a, mt, half, sms, 1, device, s, w);
    }
    if (a.c_dtype == TW_BF16)
      return run_swap<__nv_bfloat16>(a, mt, half, sms, split, device, s, NoWait::Params(), NULL,
                                     after_grid);
    return run_swap<float>(a, mt, half, sms, split, device, s, NoWait::Params(), NULL, after_grid);
  }
  if (opts && opts->ll)
    return tw_fail(TW_ERR_INTERNAL,
                   "tw_gemm: the low-latency epilogue serves swap-AB GEMMs (m %lld, TW_GEMM_SWAP)",
                   (long long)a.m);
  if (opts && opts->released) {
    // the unfused pipeline's GEMM: unsplit, static, one CTA per tile
    if (dynamic || split > 1 || (variant != TW_GEMM_V_S3_E32 && variant != TW_GEMM_V_N128_S6))
      return tw_fail(TW_ERR_INTERNAL,
                     "tw_gemm: the released wait serves unsplit 1-CTA static variants (variant "
                     "%d, split %d, dynamic %d)",
                     variant, split, (int)dynamic);
    const ReleasedWait::Params w = released_params(*opts);
    if (a.c_dtype == TW_BF16)
      return run<__nv_bfloat16, ReleasedWait>(a, plan, variant, dynamic, group_m, sms, 1, device, s,
                                              w);
    return run<float, ReleasedWait>(a, plan, variant, dynamic, group_m, sms, 1, device, s, w);
  }
  if (a.c_dtype == TW_BF16)
    return run<__nv_bfloat16>(a, plan, variant, dynamic, group_m, sms, split, device, s,
                              NoWait::Params(), after_grid);
  // fp32 output: the variant for it where nothing else decides (tw_gemm_out_variant)
  const int fp32_variant = !(opts && opts->variant >= 0) && !dynamic && split == 1 && !after_grid
                               ? tw_gemm_out_variant(variant, 1)
                               : variant;
  return run<float>(a, plan, fp32_variant, dynamic, group_m, sms, split, device, s,
                    NoWait::Params(), after_grid);
}

extern "C" tw_status_t tw_gemm(const tw_gemm_args_t *args, tw_stream_t stream) {
  return tw_gemm_sm90_launch(args, stream, NULL);
}
