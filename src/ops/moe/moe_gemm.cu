/*
 * tw_moe_dispatch_gemm: tw_moe_dispatch and the local experts' grouped GEMM in one persistent
 * kernel (contract in tilewire.h). One CTA per SM of the budget, every CTA running the GEMM
 * engine's loop on the tile queue:
 *
 *   layout      every CTA, first: the count exchange of the dispatch, the entry handshake too
 *               (exchange_layout, moe_layout.cuh); block 0 lays out this rank's entries. Every
 *               CTA then holds the layout in shared memory, where the GEMM's hooks read it.
 *   copy        every CTA its share, before it joins the GEMM: this rank's rows in the order
 *               the GEMM consumes them, expert by expert (the inverse table inv), starting at
 *               this rank's own experts, a warp a row; after each row one system-scope add of
 *               1 to the counter of its 128-row block on the expert's rank.
 *   GEMM        LayoutWait<true> (moe_hooks.cuh): tile_count / tile_index / b_source as
 *               tw_grouped_gemm's (the offsets from shared memory), and before a tile's loads a
 *               bounded wait until its block's counter holds every live row of the block.
 *   end         the last CTA out zeroes this rank's block counters (every add of the call came
 *               before the tile that waited for it) and ends the call.
 *
 * Flags of TW_CH_MOE: moe_layout.cuh (the counts, then the block counters from kFlagBlocks).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "gemm/gemm_launch.cuh"
#include "ops/moe/moe_gemm_host.cuh"
#include "ops/moe/moe_hooks.cuh"
#include "ops/moe/moe_layout.cuh"
#include "ops/moe/moe_net_counts.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

namespace {

using namespace tw::gemm;
using namespace tw::moe;

constexpr int kStages = 3, kEpiBytes = 32768, kBN = kBlockN;
constexpr int kSmem = SmemLayout<kStages, kEpiBytes, kBN>::kDynamicBytes;

using MoeWait = LayoutWait<true>;

struct FusedParams {
  GemmParams<EpiTmaStore<__nv_bfloat16>, MoeWait> gemm;
  MoeParams moe;
};

__global__ void __launch_bounds__(tw::gemm::kThreads, 1)
    moe_dispatch_gemm_kernel(const __grid_constant__ FusedParams fp) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const tw_dev_comm_t &dc = fp.gemm.wait.dc;
  const MoeParams &p = fp.moe;
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  /* block 0's layout counts live in the GEMM's shared memory, unused until its loop starts */
  const bool usable = layout_phase(dc, p, reinterpret_cast<int32_t *>(smem_raw), epoch);
  if (usable) {
    copy_rows(p, dc);
    __syncthreads();
    if (threadIdx.x == 0)
      tw_trace_stamp(dc, TW_TR_COMM_END);
  }
  __syncthreads();
  gemm_cta_loop<kStages, kEpiBytes, EpiTmaStore<__nv_bfloat16>, MoeWait, true, 1, kBN>(
      fp.gemm, smem_raw, (int32_t)blockIdx.x, (int32_t)gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_GEMM_END);
  if (threadIdx.x == 0 && tw_op_exit(dc, ch, epoch, false)) {
    /* the last CTA: every tile waited for its block's adds, so all of them are in */
    for (int32_t b = 0; b < g_live_blocks; b++)
      *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagBlocks + b) = 0;
    ll_call_done(dc, p);
    tw_op_end(dc, ch, epoch);
  }
}

/* Across nodes (moe_net.cuh): the dispatch's counts step over the rail, then every CTA its items
 * of the three rounds of moe_net.cu's dispatch (the chunks bound for the other nodes, this rank's
 * entries for experts of this node, the chunks the rail peers sent), each row landed counted into
 * its row block on its rank as copy_rows counts, then the same GEMM. The rows a tile reads land
 * by a local copy or a forward, and neither waits on a tile: every CTA finishes its copy rounds
 * before its first tile, and a forward waits only for a rail peer's pack, its first round. The
 * kernel ends once the NIC has read this CTA's staged rows and the last CTA zeroed the counters. */
struct FusedNetParams {
  FusedParams f;
  MoeNet n;
};

__global__ void __launch_bounds__(tw::gemm::kThreads, 1)
    moe_dispatch_gemm_net_kernel(const __grid_constant__ FusedNetParams fn) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ NetCta c;
  const FusedParams &fp = fn.f;
  const MoeNet &n = fn.n;
  const tw_dev_comm_t &dc = fp.gemm.wait.dc;
  const MoeParams &p = fp.moe;
  const int ch = TW_CH_MOE;
  const uint64_t epoch = tw_op_begin(dc, ch);
  const bool copy =
      layout_phase(dc, p, reinterpret_cast<int32_t *>(smem_raw), ExchangeNet{dc, p, n, c, epoch});
  if (copy)
    net_copy_rounds<true>(dc, p, n, g_layout, c, epoch);
  __syncthreads();
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_COMM_END);
  gemm_cta_loop<kStages, kEpiBytes, EpiTmaStore<__nv_bfloat16>, MoeWait, true, 1, kBN>(
      fp.gemm, smem_raw, (int32_t)blockIdx.x, (int32_t)gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_GEMM_END);
    if (c.last != ~0ull)
      tw_fifo_wait_done(dc.fifo, dc, ch, c.last); /* the NIC has read this CTA's staged rows */
  }
  if (threadIdx.x == 0 && tw_op_exit(dc, ch, epoch, false)) {
    for (int32_t b = 0; b < g_live_blocks; b++)
      *(volatile uint64_t *)tw_own_flag(dc, ch, kFlagBlocks + b) = 0;
    ll_call_done(dc, p);
    tw_op_end(dc, ch, epoch);
  }
}

static_assert(sizeof(FusedParams) <= 4096, "kernel parameters");
/* above 4 KiB, inside the 32764 bytes CUDA 12.1 and later take on sm_90 */
static_assert(sizeof(FusedNetParams) <= 32764, "kernel parameters");
static_assert(kSmem + sizeof(SharedLayout) + 1024 <= 227 * 1024, "shared memory");
static_assert(kSmem >= (kThreads / 32 + 1) * kMaxExperts * 4,
              "block 0's layout fits the GEMM's smem");

} // namespace

/* Loads tw_moe_dispatch_gemm's kernel on the current device now (see tw_ops_preload). */
static tw_status_t moe_dispatch_gemm_preload(void) {
  tw_status_t st =
      preload_kernel<moe_dispatch_gemm_kernel>("loading tw_moe_dispatch_gemm's kernel");
  if (st == TW_SUCCESS)
    st = preload_kernel<moe_dispatch_gemm_net_kernel>(
        "loading tw_moe_dispatch_gemm's kernel across nodes");
  return st;
}

static const tw_op_desc_t moe_dispatch_gemm_registration = {"moe_dispatch_gemm",
                                                            moe_dispatch_gemm_preload};
TW_OP_REGISTER(moe_dispatch_gemm, moe_dispatch_gemm_registration);

extern "C" tw_status_t tw_moe_dispatch_gemm(tw_comm_t comm, const tw_moe_args_t *in,
                                            tw_stream_t stream) {
  const char *op = "tw_moe_dispatch_gemm";
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_moe_args_t a;
  Layout l;
  FusedParams fp;
  memset(&fp, 0, sizeof(fp));
  st = moe_prepare(comm, in, kDispatchGemm, &a, &l, &fp.moe);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const int local = (int)(a.experts / comm->world);
  auto &g = fp.gemm;
  st = moe_gemm_params(comm, a, g, op);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  MoeWait::set(g.wait, comm->rank, local, a.n_out, g.order);
  if (comm->nodes > 1) {
    FusedNetParams fn;
    memset(&fn, 0, sizeof(fn));
    fn.f = fp;
    st = moe_net_params(comm, a, kDispatchGemm, l, &fn.n);
    if (st == TW_SUCCESS)
      st = moe_gemm_launch<moe_dispatch_gemm_net_kernel, kSmem>(
          comm, a, kDispatchGemm, fn,
          [](FusedNetParams &q, const tw_dev_comm_t &dc) { q.f.gemm.wait.dc = dc; }, stream, op);
    return tw_comm_result(comm, st);
  }
  st = moe_gemm_launch<moe_dispatch_gemm_kernel, kSmem>(
      comm, a, kDispatchGemm, fp,
      [](FusedParams &q, const tw_dev_comm_t &dc) { q.gemm.wait.dc = dc; }, stream, op);
  return tw_comm_result(comm, st);
}
