/*
 * The host side the fused MoE GEMMs share (moe_gemm.cu, moe_gemm_combine.cu, moe_ffn.cu): the
 * engine's parameters over the recv layout (A = rows in recv's layout, B = the local experts'
 * weights, 128 x 256 tiles in a row-major order; by default A = recv [recv_rows, hidden], B
 * [local * n_out, hidden], out = expert_out [recv_rows, n_out] on the channel's tile queue),
 * and the call itself (its description, the rank's launch stream, the persistent launch).
 */
#ifndef TW_OPS_MOE_GEMM_HOST_CUH
#define TW_OPS_MOE_GEMM_HOST_CUH

#include <stdio.h>

#include "gemm/gemm_launch.cuh"
#include "ops/moe/moe_layout.cuh"

extern "C" {
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
}

namespace tw {
namespace moe {

/* g's maps, order, queue and bounds for a grouped GEMM over the recv layout on comm: A [rows, k]
 * (a_name names it in errors), B = the local experts' weights [local * n, k], out [rows, n]
 * (the out map goes to g.epi.c_map), on queue (NULL: the static schedule). */
template <class GP>
tw_status_t grouped_params(tw_comm_t comm, GP &g, const void *a, int64_t rows, int64_t k,
                           const void *b, int64_t n, int64_t local, const void *out,
                           gemm::TileQueue *queue, const char *op, const char *a_name,
                           const char *out_name) {
  using namespace tw::gemm;
  tw_status_t st =
      operand_maps(&g.a_map, &g.b_map, a, rows, k, b, local * n, k, k, kBlockN, op, a_name);
  char what[96];
  snprintf(what, sizeof(what), "%s: cuTensorMapEncodeTiled(%s)", op, out_name);
  if (st == TW_SUCCESS)
    st = out_map<__nv_bfloat16>(&g.epi.c_map, out, n, rows, n, what);
  if (st != TW_SUCCESS)
    return st;
  TileOrder &o = g.order;
  o.m_blocks = (int32_t)((rows + kBlockM - 1) / kBlockM);
  o.n_blocks = (int32_t)((n + kBlockN - 1) / kBlockN);
  o.num_tiles = o.m_blocks * o.n_blocks;
  o.order = kOrderRowMajor;
  g.queue = queue;
  g.participants = comm->sm_budget;
  g.k_blocks = (int32_t)((k + kBlockK - 1) / kBlockK);
  g.mbar_timeout_ns = fused_mbar_timeout_ns(comm->dev.timeout_ns);
  apply_fault_stall(g);
  return TW_SUCCESS;
}

/* The fused MoE GEMM of args a (recv x weights^T into expert_out) on the channel's tile queue. */
template <class GP>
tw_status_t moe_gemm_params(tw_comm_t comm, const tw_moe_args_t &a, GP &g, const char *op) {
  return grouped_params(
      comm, g, a.recv, a.recv_rows, a.hidden, a.weights, a.n_out, a.experts / comm->world,
      a.expert_out, (gemm::TileQueue *)comm->ctrl->tile_queue[TW_CH_MOE], op, "recv", "expert_out");
}

/* A fused MoE kernel's preload (runtime/registry.h): loads it on the current device now. */
template <auto Kernel> tw_status_t preload_kernel(const char *what) {
  cudaFuncAttributes attr;
  return tw_cuda_check(cudaFuncGetAttributes(&attr, Kernel), what);
}

/* The call of `kind` with params P on comm->sm_budget CTAs: described (what must be alike),
 * set(params) given the comm's device copy with that description, then launched. */
template <auto Kernel, int Smem, class P, class Set>
tw_status_t moe_gemm_launch(tw_comm_t comm, const tw_moe_args_t &a, int kind, P &params, Set set,
                            tw_stream_t stream, const char *op) {
  const int cols = kind == kGemmCombine; /* the combine's n_out, else the dispatch's hidden */
  const uint64_t width = kind == kFfn ? (uint64_t)a.hidden << 32 | (uint64_t)a.inter
                                      : (uint64_t)(cols ? a.n_out : a.hidden);
  const uint64_t fields[8] = {(uint64_t)kind,
                              (uint64_t)a.max_tokens,
                              width,
                              (uint64_t)a.experts,
                              (uint64_t)a.top_k,
                              (uint64_t)a.recv_rows,
                              tw_call_heap_field(comm, cols ? a.expert_out : a.recv),
                              tw_call_heap_field(comm, a.workspace)};
  int prev = 0;
  tw_status_t st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return st;
  const tw_call_desc_t outer = tw_call_begin(comm, TW_CH_MOE, 8, fields);
  set(params, comm->dev); /* with the call's description */
  cudaStream_t launch = NULL;
  char set_what[96], go_what[96];
  snprintf(set_what, sizeof(set_what), "%s: cudaFuncSetAttribute", op);
  snprintf(go_what, sizeof(go_what), "%s: kernel launch", op);
  st = tw_launch_begin(comm, stream, &launch);
  if (st == TW_SUCCESS)
    st = tw::gemm::launch_persistent<Kernel, Smem>(params, comm->sm_budget, launch, set_what,
                                                   go_what);
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  tw_call_end(comm, outer);
  cudaSetDevice(prev);
  return st;
}

} // namespace moe
} // namespace tw
#endif
