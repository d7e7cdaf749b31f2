/*
 * tw_gemm_rs / tw_gemm_ar's fused kernel and its host side. gemm_rs_kernel runs the GEMM on the
 * policies of gemm_rs_fused.cuh and the reduce and gather roles; it has internal linkage, so it
 * is instantiated here alone. run_fused fills its parameters from the arguments and the plan
 * (tensor maps, peer pointers, tile order) and launches it.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "gemm/gemm_launch.cuh"
#include "ops/gemm_rs/gemm_rs_fused.cuh"
#include "ops/gemm_rs/gemm_rs_impl.h"

extern "C" {
#include "gemm/tma_map.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
}

namespace tw {
namespace rs {

namespace {

/* Work stealing: the mainloop hands every warp back the entry register split when it ends
 * (setmaxnreg), so code after it is not compiled under the producer's 40 registers, and the
 * GEMM CTAs then take reduction (and gather) work too. Every CTA takes part in the
 * reduce/gather queues. */
template <class P, int BN>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_rs_kernel(const __grid_constant__ RsParams<P> p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int s_item, s_ok;
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const int ch = p.gemm.wait.ch;
  const uint64_t epoch = tw_op_begin(dc, ch);
  if (threadIdx.x == 0) {
    s_entered = 0;
    s_entry_failed = 0;
    s_rs_epoch = epoch;
    s_ok = tw_kernel_enter(dc, ch, epoch);
  }
  __syncthreads();
  if ((int)blockIdx.x < p.reduce_ctas && !p.gemm.epi.owner_epi) {
    reduce_work<8>(p, epoch, &s_item, &s_ok, TW_TR_REDUCED);
    if (p.all_reduce) {
      if (threadIdx.x == 0) /* TW_TRACE's gather stamp */
        tw_trace_gather_start(dc);
      gather_work(p, epoch, &s_item, &s_ok);
    }
    if (threadIdx.x == 0)
      tw_trace_stamp(dc, TW_TR_COMM_END);
  }
  if constexpr (BN == 192)
    gemm_cta_loop_pp<RsConfig<BN>::kStages, RsConfig<BN>::kEpiBytes, BN, RsEpi<P>, RsWait, true,
                     true, RsEpi<P, true>>(p.gemm, smem_raw, 0, 0);
  else
    gemm_cta_loop<RsConfig<BN>::kStages, RsConfig<BN>::kEpiBytes, RsEpi<P>, RsWait, true, 1, BN,
                  true>(p.gemm, smem_raw, 0, 0);
  if (dc.trace) { /* the consumers' last tile, not the producer's last load */
    __syncthreads();
    if (threadIdx.x == 0)
      tw_trace_stamp(dc, TW_TR_GEMM_END);
  }
  if ((int)blockIdx.x >= p.reduce_ctas) {
    if (!p.gemm.epi.owner_epi) /* the owner epilogue reduced every own unit */
      reduce_work<8>(p, epoch, &s_item, &s_ok, TW_TR_REDUCED_AFTER);
    if (p.all_reduce) {
      if (threadIdx.x == 0)
        tw_trace_gather_start(dc);
      gather_work(p, epoch, &s_item, &s_ok);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_END);
    /* release: the unfused pipeline's GEMM, which writes the workspace before any handshake,
     * may follow on the same workspace (ReleasedWait) */
    tw_op_finish(dc, ch, epoch, true);
  }
}

template <class P, int BN>
tw_status_t launch_bn(const RsParams<P> &params, int grid, cudaStream_t stream) {
  constexpr int kSmem = rs_smem_bytes<BN>();
  const char *set = "tw_gemm_rs: cudaFuncSetAttribute", *go = "tw_gemm_rs: kernel launch";
  return launch_persistent<gemm_rs_kernel<P, BN>, kSmem>(params, grid, stream, set, go);
}

template <class P> tw_status_t launch(const RsParams<P> &params, int grid, cudaStream_t stream) {
  if (params.block_n == 128)
    return launch_bn<P, 128>(params, grid, stream);
  if (params.block_n == 192)
    return launch_bn<P, 192>(params, grid, stream);
  return launch_bn<P, kBlockN>(params, grid, stream);
}

} // namespace

template <class P>
tw_status_t run_fused(tw_comm_t comm, const tw_gemm_rs_args_t &a, const tw_gemm_rs_plan_t &plan,
                      int all_reduce, cudaStream_t stream) {
  constexpr CUtensorMapDataType kMapType =
      sizeof(P) == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const int world = comm->world, rank = comm->rank;
  const int ch = all_reduce ? TW_CH_GEMM_AR : TW_CH_GEMM_RS;
  /* Direct scheme: the geometry of one owner holding all m rows, every rank's staging a
   * target of every tile. */
  const int64_t m_local = plan.direct ? a.m : a.m / world;
  RsParams<P> p;
  memset(&p, 0, sizeof(p));
  tw_status_t st;
  st = operand_maps(&p.gemm.a_map, &p.gemm.b_map, a.a, a.m, a.lda, a.b, a.n, a.ldb, a.k,
                    plan.block_n, "tw_gemm_rs", "a");
  if (st != TW_SUCCESS)
    return st;
  const size_t slot_bytes = (size_t)m_local * (size_t)a.n * sizeof(P);
  const size_t reduced_offset = slot_bytes * (size_t)world;
  /* tw_gemm_ar's reduced rows, bf16 after the staging. Push (plan.ar_push): the area is
   * [world][m_local][n], block o holding owner o's rows; owner o's reduction stores block o of
   * every other rank's area, and each rank's gather copies from its own area (local loads).
   * Otherwise the owner keeps its rows in block 0 of its own area and the others load them
   * from there over NVLink. */
  p.push = plan.ar_push;       /* prepare: tw_gemm_ar only, never with the direct scheme */
  p.out_sym = plan.ar_out_sym; /* likewise */
  for (int q = 0; p.out_sym && q < world; q++)
    p.out_peer[q] = (__nv_bfloat16 *)tw_heap_peer_ptr(comm, a.out, q);
  const size_t block = (size_t)m_local * (size_t)a.n * 2;
  for (int o = 0; o < world; o++) {
    char *owner_ws = (char *)tw_heap_peer_ptr(comm, a.workspace, o);
    char *store_ws = (TW_RS_DIAG & 1) ? (char *)a.workspace : owner_ws;
    st = tw_tma_map_2d(&p.gemm.epi.slot_map[o], kMapType, sizeof(P),
                       store_ws + slot_bytes * (size_t)rank, a.n, m_local, a.n, 128 / sizeof(P),
                       kBoxRows, "tw_gemm_rs: cuTensorMapEncodeTiled(staging)");
    if (st != TW_SUCCESS)
      return st;
    p.gemm.epi.owner_flags[o] = &comm->dev.peer_ctrl[o]->flags[ch][0];
    p.gemm.epi.slot[o] = (P *)(store_ws + slot_bytes * (size_t)rank);
    p.reduced_peer[o] =
        (const __nv_bfloat16 *)(p.push ? (char *)a.workspace + reduced_offset + block * o
                                       : owner_ws + reduced_offset);
    if (p.push)
      p.reduced_push[o] = (__nv_bfloat16 *)(owner_ws + reduced_offset + block * (size_t)rank);
  }
  p.gemm.epi.n = (int32_t)a.n;
  p.gemm.epi.m_local = (int32_t)m_local;
  p.gemm.epi.m = (int32_t)a.m;
  p.gemm.epi.group_units = plan.group_units;
  p.gemm.epi.direct = plan.direct ? world : 0;
  p.direct = plan.direct;
  /* The pull (plan.pull): each rank stores its whole partial locally and the owners read
   * their rows of it from every rank when they reduce. */
  const int pull = !plan.direct && plan.pull;
  p.gemm.epi.pull = pull;
  for (int s = 0; s < world; s++)
    p.slab[s] = pull ? (const P *)tw_heap_peer_ptr(comm, a.workspace, s) +
                           (size_t)rank * (size_t)m_local * (size_t)a.n
                     : (const P *)a.workspace + (size_t)s * (size_t)m_local * (size_t)a.n;
  if (pull) {
    st = tw_tma_map_2d(&p.gemm.epi.slot_map[0], kMapType, sizeof(P), a.workspace, a.n, a.m, a.n,
                       128 / sizeof(P), kBoxRows, "tw_gemm_rs: cuTensorMapEncodeTiled(own)");
    if (st != TW_SUCCESS)
      return st;
  }
  TileOrder &o = p.gemm.order;
  o.m_blocks = (int32_t)((a.m + kBlockM - 1) / kBlockM);
  o.n_blocks = (int32_t)((a.n + plan.block_n - 1) / plan.block_n);
  o.num_tiles = o.m_blocks * o.n_blocks;
  /* Band sweeps over all row blocks, from owner rank + 1's rows (see the top); the owners'
   * rows interleaved where the plan says (gemm_rs_heuristics.c): each owner's rows still
   * ascending, so the unit order (and the reduce queue that follows it) is unchanged. */
  o.order = plan.interleave ? kOrderBandsInterleaved : kOrderBands; /* never direct: 1 owner */
  o.group_m = plan.interleave ? world : o.m_blocks;
  o.group_n = plan.band;
  if (plan.owner_epi) {
    /* plan.owner_epi: own tiles trail the peers' by `lag` positions at least
     * (tests/host/test_tile_order.cu), two waves of this rank's CTAs, so the peers' partials of
     * an own unit have landed when its epilogue needs them. */
    const int32_t own_mbs = (int32_t)(m_local / kBlockM);
    const int32_t units = own_mbs * o.n_blocks;
    o.order = kOrderBandsOwnerLag;
    o.group_m = world;
    o.lag = 2 * plan.ctas < units ? 2 * plan.ctas : units;
    p.gemm.epi.owner_epi = 1;
    p.gemm.epi.own_mb0 = rank * own_mbs;
    p.gemm.epi.own_mbs = own_mbs;
    p.gemm.epi.own_counters = &comm->dev.ctrl->flags[ch][0]; /* tw_own_flag(dc, ch, 0) */
    for (int s = 0; s < world; s++)
      p.gemm.epi.own_slab[s] = (const P *)a.workspace + (size_t)s * (size_t)m_local * (size_t)a.n;
    /* tw_gemm_ar's out holds every owner's rows: this rank's start at rank * m_local */
    const __nv_bfloat16 *own_out =
        (const __nv_bfloat16 *)a.out + (all_reduce ? (size_t)rank * m_local * (size_t)a.ldo : 0);
    st = out_map<__nv_bfloat16>(&p.gemm.epi.out_map, own_out, a.n, m_local, a.ldo,
                                "tw_gemm_rs: cuTensorMapEncodeTiled(out)");
    if (st != TW_SUCCESS)
      return st;
    if (all_reduce) { /* prepare: 2 ranks (the gather runs after the tiles) */
      const int peer = 1 - rank;
      const void *dst =
          p.out_sym ? (const void *)(p.out_peer[peer] + (size_t)rank * m_local * (size_t)a.ldo)
          : p.push  ? (const void *)p.reduced_push[peer]
                    : (const void *)((const char *)a.workspace + reduced_offset);
      st = out_map<__nv_bfloat16>(&p.gemm.epi.peer_map, dst, a.n, m_local, p.out_sym ? a.ldo : a.n,
                                  "tw_gemm_ar: cuTensorMapEncodeTiled(reduced rows)");
      if (st != TW_SUCCESS)
        return st;
      p.gemm.epi.owner_ar = 1;
      p.gemm.epi.peer_ready =
          &comm->dev.peer_ctrl[peer]->flags[ch][(size_t)plan.flag_stride * (size_t)(1 + rank)];
    }
  }
  o.rotate_mb = plan.direct ? 0 : tw_rs_mb_first((rank + 1) % world, (int32_t)m_local);
  /* The measurement build's bit 16: the plain GEMM's grouped order. Any order is correct, the
   * reduction waiting for counts; the owner epilogue needs its own (kOrderBandsOwnerLag). */
  if ((TW_RS_DIAG & 16) && !plan.owner_epi) {
    o.order = kOrderRotated;
    o.group_m = o.m_blocks < 16 ? o.m_blocks : 16;
  }
  p.gemm.queue = (TileQueue *)comm->ctrl->tile_queue[ch];
  p.gemm.participants = plan.ctas;
  p.gemm.k_blocks = (int32_t)((a.k + kBlockK - 1) / kBlockK);
  p.gemm.mbar_timeout_ns = fused_mbar_timeout_ns(comm->dev.timeout_ns);
  apply_fault_stall(p.gemm);
  p.gemm.wait.dc = comm->dev;
  p.gemm.wait.ch = ch;
  p.gemm.wait.m_local = (int32_t)m_local;
  p.gemm.wait.m = (int32_t)a.m;
  p.gemm.wait.world = world;
  p.out = (__nv_bfloat16 *)a.out;
  p.reduced = (__nv_bfloat16 *)((char *)a.workspace + reduced_offset);
  p.ldo = a.ldo;
  p.n = (int32_t)a.n;
  p.m_local = (int32_t)m_local;
  p.n_blocks = o.n_blocks;
  p.block_n = plan.block_n;
  p.band = plan.band;
  p.gemm.epi.n_blocks = o.n_blocks;
  p.gemm.epi.band = plan.band;
  p.gemm.epi.trace = comm->dev.trace;
  p.gemm.epi.gpu_scope = comm->ranks_on_device == world;
  p.group_units = plan.group_units;
  p.groups_max = plan.groups_max;
  p.flag_stride = plan.flag_stride;
  p.reduce_ctas = plan.reduce_ctas;
  p.all_reduce = plan.direct ? 0 : all_reduce; /* direct: no gather phase */
  return launch(p, plan.ctas, stream);
}

template tw_status_t run_fused<float>(tw_comm_t, const tw_gemm_rs_args_t &,
                                      const tw_gemm_rs_plan_t &, int, cudaStream_t);
template tw_status_t run_fused<__nv_bfloat16>(tw_comm_t, const tw_gemm_rs_args_t &,
                                              const tw_gemm_rs_plan_t &, int, cudaStream_t);

cudaError_t preload_fused() {
  const void *kernels[] = {(const void *)gemm_rs_kernel<float, kBlockN>,
                           (const void *)gemm_rs_kernel<__nv_bfloat16, kBlockN>,
                           (const void *)gemm_rs_kernel<float, 128>,
                           (const void *)gemm_rs_kernel<__nv_bfloat16, 128>,
                           (const void *)gemm_rs_kernel<float, 192>,
                           (const void *)gemm_rs_kernel<__nv_bfloat16, 192>};
  return load_kernels(kernels, sizeof(kernels) / sizeof(kernels[0]));
}

} // namespace rs
} // namespace tw
