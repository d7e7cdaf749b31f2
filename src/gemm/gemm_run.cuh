/*
 * The GEMM engine's host side: every kernel configuration of gemm_sm90.cuh / gemm_pp_sm90.cuh a
 * caller can launch, with the launch itself (shared-memory limit, clusters, programmatic
 * dependence) and the static schedule. The callers pick: tw_gemm (src/ops/gemm) launches the
 * plain GEMM (NoWait, EpiTmaStore / EpiTmaStoreT); an op with hooks of its own (a Wait or an
 * Epi policy it defines) instantiates the same templates with them, in its own file, and
 * preloads what it launches. The engine knows none of its callers.
 *
 * Kernel variants: TW_GEMM_V_* (gemm_heuristics.h). Swap-AB (decode shapes) runs C^T = B * A^T
 * (run_swap); split-K runs on clusters (launch_split) or through a workspace (launch_ws).
 */
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>
#include <utility>

#include "core/status.h"
#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_launch.cuh"
#include "gemm/gemm_pp_sm90.cuh"
#include "gemm/gemm_sm90.cuh"
#include "gemm/tma_map.h"
#include "runtime/cuda_check.h"

namespace tw {
namespace gemm {

// tw_gemm_args_t's leading dimensions of 0: the packed ones (k, k, n).
inline void default_leading_dims(tw_gemm_args_t &a) {
  if (a.lda == 0)
    a.lda = a.k;
  if (a.ldb == 0)
    a.ldb = a.k;
  if (a.ldc == 0)
    a.ldc = a.n;
}

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

// A GEMM with a caller's wait hook (unsplit, static): the two 1-CTA variants it may take
// (TW_GEMM_V_N128_S6, else TW_GEMM_V_S3_E32).
template <class Out, class Wait>
tw_status_t launch_waited(const GemmParams<EpiTmaStore<Out>, Wait> &params, int variant, int grid,
                          int device, cudaStream_t stream) {
  if (variant == TW_GEMM_V_N128_S6)
    return launch_plain<6, 16384, Out, false, 1, 128, 1, Wait>(params, grid, device, stream);
  return launch_plain<3, 32768, Out, false, 1, kBlockN, 1, Wait>(params, grid, device, stream);
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

/* launch_swap_half's plain GEMM, for one tile width (unsplit). */
template <class Out, int MT> cudaError_t preload_swap_half() {
  constexpr int SH = swap_half_stages<MT>();
  using E = EpiTmaStoreT<Out>;
  cudaError_t e = cudaSuccess, r;
  if ((r = preload_one<SH, kSwapHalfEpiBytes, Out, false, 1, MT / 2, 1, NoWait, E, 64>()) !=
      cudaSuccess)
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
  if ((r = preload_swap_half<Out, MT>()) != cudaSuccess)
    e = r;
  /* launch_ws's, swapped */
  if ((r = preload_ws<swap_half_stages<MT>(), kSwapHalfEpiBytes, Out, MT / 2, E, 64>()) !=
      cudaSuccess)
    e = r;
  return e;
}

/* Every instantiation of the plain GEMM (NoWait, EpiTmaStore) launch_out, launch_split,
 * launch_ws and launch_swap can pick (keep the lists in step; a caller with hooks of its own
 * preloads the instantiations it launches) (keep
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
  if ((r = preload_swap<Out, 16>()) != cudaSuccess)
    e = r;
  if ((r = preload_swap<Out, 64>()) != cudaSuccess)
    e = r;
  if ((r = preload_swap_half<Out, 32>()) != cudaSuccess) /* tw_gemm_swap_half_mt's 32 */
    e = r;
  return e;
}

// A wait hook whose Params has a TileOrder `order` gets the loop's (to know each CTA's tiles).
template <class W, class = void> struct HasOrder : std::false_type {};
template <class W>
struct HasOrder<W, std::void_t<decltype(std::declval<W &>().order)>> : std::true_type {};
template <class W> inline void set_wait_order(W &w, const TileOrder &o) {
  if constexpr (HasOrder<W>::value)
    w.order = o;
  (void)w, (void)o;
}

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
// E other than EpiTmaStoreT<Out> (a caller's epilogue, unsplit): fill(params.epi, a, split) sets
// its parameters instead of the C map.
struct NoFill {
  template <class EP> tw_status_t operator()(EP &, const tw_gemm_args_t &, int) const {
    return tw_fail(TW_ERR_INTERNAL, "tw_gemm: this epilogue needs its parameters");
  }
};

template <class Out, class Wait = NoWait, class E = EpiTmaStoreT<Out>, class Fill = NoFill>
tw_status_t run_swap(const tw_gemm_args_t &a, int mt, bool half, int sms, int split, int device,
                     cudaStream_t stream,
                     const typename Wait::Params &wait = typename Wait::Params(),
                     const Fill &fill = Fill(), bool after_grid = false, const WsPlan *ws = NULL) {
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
  if constexpr (!std::is_same<E, EpiTmaStoreT<Out>>::value) {
    if (st == TW_SUCCESS)
      st = fill(params.epi, a, split);
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
                bool after_grid = false, const WsPlan *ws = NULL, TileQueue *queue = NULL) {
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
  if constexpr (!std::is_same<Wait, NoWait>::value) {
    if (ws)
      return tw_fail(TW_ERR_INTERNAL, "tw_gemm: the workspace's slices serve the plain GEMM");
    return launch_waited<Out, Wait>(params, variant, grid, device, stream);
  } else {
    if (ws)
      return launch_ws<kWsStages, kWsEpiBytes, Out, 64, EpiTmaStore<Out>, kBlockM>(
          params, split, grid, device, stream);
    if (split > 1)
      return launch_split<Out>(params, split, grid, device, stream);
    if (dynamic) {
      if (!queue)
        return tw_fail(TW_ERR_INTERNAL, "tw_gemm: the dynamic schedule needs a tile queue");
      params.queue = queue;
    }
    return launch_out<Out>(params, variant, dynamic, grid, device, stream);
  }
}

} // namespace gemm
} // namespace tw
