/*
 * tw_gemm_rs / tw_gemm_ar's unfused pipeline (plan.unfused: decode shapes), its kernels and
 * their launches; the only instantiations of these kernels and of the pipeline's GEMM
 * (gemm_rs_gemm.cuh) are here.
 *
 * Two launches on the rank's stream: tw_gemm of the whole partial [m][n] into the workspace
 * (fp32, or bf16 with TW_PARTIALS_BF16) whose CTAs first wait until every rank has released this
 * rank's workspace after its previous call (gemm_released.cuh), then unfused_reduce_kernel on
 * channel ch:
 *   entry(e) to every rank (this rank's partial is complete), wait for every rank's entry(e);
 *   sum rows [rank * m_local, +m_local) of the partials in rank order (fp32, the reference's
 *   __fadd_rn chain from partial 0), round to bf16, store into `out` (rs), or into every rank's
 *   gather area (the workspace after the partial) or every rank's symmetric `out` (ar);
 *   the grid's last CTA then sets done[ch][rank] = e on every rank: this rank no longer reads
 *   their partials and its rows are in their memory.
 *   ar into a plain `out`: every CTA waits for every rank's done(e), then copies the gather
 *   area into `out`. Otherwise the last CTA waits for them alone, so that the call ends only
 *   once no rank reads this rank's workspace (the fused kernel, which may follow, stores into
 *   a rank's workspace once that rank alone has entered).
 * The same bits as the fused kernel and the reference pipeline (tw_gemm per rank, then the
 * rank-ordered sum). With plan.ll the second launch is ll_reduce_kernel instead, through the
 * comm's low-latency area (see LlParams).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "device/signal.cuh"
#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_launch.cuh"
#include "ops/gemm_rs/gemm_rs.h"
#include "ops/gemm_rs/gemm_rs_gemm.cuh"
#include "ops/gemm_rs/gemm_rs_impl.h"
#include "ops/gemm_rs/rs_vec.cuh"

extern "C" {
#include "core/env.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
}

namespace tw {
namespace rs {

using namespace tw::gemm;

namespace {

constexpr int kUnfusedThreads = 256;

template <class P> struct UnfusedParams {
  tw_dev_comm_t dc;
  const P *partial[kMaxWorld];   /* rank s's partial [m][n], mapped for this rank */
  __nv_bfloat16 *dst[kMaxWorld]; /* rs: dst[0] = out; ar: every rank's gather area or out */
  const __nv_bfloat16 *gather;   /* ar into a plain out: this rank's gather area [m][n] */
  __nv_bfloat16 *out;
  int64_t ld_dst, ldo;
  int64_t dst_row0; /* rs: rank * m_local (out's first row); ar: 0 */
  int32_t ch, m_local, m, n, ndst, copy;
  int32_t peer_out; /* ar: dst[q] / its row stride are rank q's out, read from this rank's control
                       block after q's entry (plan.ar_peer_out); this rank's goes to every peer's
                       before its own entry signal */
};

/* One 16-byte load of partials as floats: 4 fp32 or 8 bf16 (kVec<P>), so that a warp's loads
 * are 512 contiguous bytes (two 16-byte loads per thread at a 32-byte stride would fetch every
 * remote sector twice). */
template <class P> constexpr int kVec = RsVec<P>::kE;
template <class P> __device__ __forceinline__ void load_vec(const P *p, float (&v)[kVec<P>]) {
  RsVec<P>::unpack(__ldcg(reinterpret_cast<const uint4 *>(p)), v);
}
template <class P>
__global__ void __launch_bounds__(kUnfusedThreads)
    unfused_reduce_kernel(const __grid_constant__ UnfusedParams<P> p) {
  __shared__ int s_ok, s_last;
  /* launched with programmatic serialization (on GPUs of their own): the GEMM's partial is
   * complete and visible from here on (at once otherwise) */
  tw::ptx::griddep_wait();
  const tw_dev_comm_t &dc = p.dc;
  const int ch = p.ch, world = dc.world, rank = dc.rank;
  const uint64_t epoch = tw_op_begin(dc, ch);
  __shared__ __nv_bfloat16 *s_dst[kMaxWorld];
  __shared__ int64_t s_ld[kMaxWorld];
  if (threadIdx.x == 0) {
    /* peer outs: this rank's out into every peer's control block before the entry signal
     * (whose fence orders it); the peers read it once they have seen this rank enter */
    if (p.peer_out && blockIdx.x == 0 && tw_op_usable(dc, ch))
      for (int q = 0; q < world; q++)
        if (q != rank && dc.peer_ctrl[q]) {
          volatile uint64_t *slot = dc.peer_ctrl[q]->peer_out[ch][rank];
          slot[0] = (uint64_t)(uintptr_t)p.out;
          slot[1] = (uint64_t)p.ldo;
        }
    const bool ok = tw_kernel_enter(dc, ch, epoch) && tw_wait_entries(dc, ch, epoch);
    /* the destinations: every rank's out (peer outs, rows at their place in it), or p.dst[]
     * (rows from p.dst_row0 on, p.ld_dst apart) */
    if (ok && p.peer_out)
      for (int q = 0; q < world; q++) {
        const volatile uint64_t *slot = dc.ctrl->peer_out[ch][q];
        s_dst[q] = q == rank ? p.out : (__nv_bfloat16 *)(uintptr_t)slot[0];
        s_ld[q] = q == rank ? p.ldo : (int64_t)slot[1];
      }
    else
      for (int q = 0; q < p.ndst; q++) {
        s_dst[q] = p.dst[q];
        s_ld[q] = p.ld_dst;
      }
    s_ok = ok;
  }
  __syncthreads();
  if (!s_ok)
    return;
  constexpr int V = kVec<P>;
  const int64_t vecs = p.n / V, items = (int64_t)p.m_local * vecs;
  const int64_t row0 = (int64_t)rank * p.m_local;
  const int64_t dst_row0 = p.peer_out ? 0 : p.dst_row0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < items;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = row0 + i / vecs, c = V * (i % vecs);
    const size_t off = (size_t)r * (size_t)p.n + (size_t)c;
    /* every rank's loads in flight at once, then the sum in rank order */
    float v[kMaxWorld][V];
#pragma unroll
    for (int s = 0; s < kMaxWorld; s++)
      if (s < world)
        load_vec(p.partial[s] + off, v[s]);
    sum_rank_order(v, world);
    const typename RsVec<P>::Packed sum = RsVec<P>::pack(v[0]);
    for (int q = 0; q < p.ndst; q++)
      *reinterpret_cast<typename RsVec<P>::Packed *>(
          s_dst[q] + (size_t)(r - dst_row0) * (size_t)s_ld[q] + (size_t)c) = sum;
  }
  __syncthreads();
  /* this CTA's loads and stores before its count; the last CTA releases the peers' partials
   * and has put its rows in their memory (done[ch][rank] = e everywhere); the count is reset
   * before that, so the copy's CTAs count again after it */
  if (threadIdx.x == 0)
    s_last = tw_op_exit(dc, ch, epoch, true);
  __syncthreads();
  if (!p.copy) {
    /* rs, or ar into symmetric outputs: the last CTA waits until no rank reads this rank's
     * partial any more (and every rank's rows are in this rank's out), then ends the call */
    if (threadIdx.x == 0 && s_last) {
      bool ok = true;
      for (int q = 0; ok && q < world; q++)
        if (q != rank)
          ok = tw_wait_geq(dc, ch, &dc.ctrl->done[ch][q], epoch, q, -1);
      tw_trace_stamp(dc, TW_TR_END);
      if (ok)
        tw_op_end(dc, ch, epoch);
    }
    return;
  }
  /* ar into a plain out: every rank's rows are in this rank's gather area once every rank's
   * last CTA has signalled (this rank's too) */
  if (threadIdx.x == 0) {
    bool ok = true;
    for (int q = 0; ok && q < world; q++)
      ok = tw_wait_geq(dc, ch, &dc.ctrl->done[ch][q], epoch, q, -1);
    s_ok = ok;
  }
  __syncthreads();
  if (!s_ok)
    return;
  const int64_t vecs8 = p.n / 8, all = (int64_t)p.m * vecs8;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < all;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / vecs8, c = 8 * (i % vecs8);
    *reinterpret_cast<uint4 *>(p.out + (size_t)r * (size_t)p.ldo + (size_t)c) =
        __ldcg(reinterpret_cast<const uint4 *>(p.gather + (size_t)r * (size_t)p.n + (size_t)c));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_END);
    tw_op_finish(dc, ch, epoch);
  }
}

/* ---- the unfused pipeline's exchange through the low-latency area (plan.ll) ------------------
 * Instead of unfused_reduce_kernel (TW_RS_UNFUSED_LL; where the rows fit the comm's area):
 *   call sequence q = ctrl->ll_seq + 1 (every LL call of the comm, either channel, counts alike on
 *   every rank), flag tw_ll_flag(q), half q & 1 of every rank's area;
 *   1. done[ch][rank] = e on every rank at once: this rank reads no peer's workspace in the call
 *      (the next call's release wait, ReleasedWait, passes without waiting for its end);
 *   2. push: each 16-byte vector of this rank's partial in a peer's rows goes into that peer's
 *      area, slot `rank`, as two low-latency words (tw_ll_put_item: the flag rides with the
 *      data; 8 items' first words share a 128-byte line, so a warp's stores fill whole lines);
 *   3. reduce: each vector of this rank's rows: its own partial from the workspace, the peers'
 *      from this rank's area (tw_ll_wait_item), summed in rank order from partial 0 (the
 *      reference's __fadd_rn chain), rounded to bf16; rs: stored into `out`; ar: into `out` and, as
 *      low-latency words, into every peer's area (gather slot `rank`);
 *   4. ar: every peer's reduced rows from this rank's gather slots into `out`;
 *   5. the grid's last CTA stores ll_seq = q and ends the call (tw_op_end).
 * Why a half per parity of q suffices: a rank writes a peer's half q & 1 in call q only after it
 * has all of call q - 1's words, which that peer stored after its call q - 2 (the same half)
 * had read everything: its stream runs its calls in order. Nothing reads a peer's workspace, so
 * the call ends without waiting for anyone, and the workspace is free when it ends. */
template <class P> struct LlParams {
  tw_dev_comm_t dc;
  const P *partial;         /* this rank's partial [m][n] (the workspace) */
  uint8_t *area[kMaxWorld]; /* every rank's low-latency area, mapped for this rank */
  __nv_bfloat16 *out;
  int64_t ldo;
  uint64_t half_bytes, gather_off; /* one parity's bytes; its gather slots' offset in it */
  int32_t ch, m_local, n, all_reduce;
  int32_t from_gemm; /* the GEMM stored every rank's words itself (swap-AB, gemm_ll.cuh):
                        this rank's own rows too, so no push here and no wait for the GEMM */
  int32_t reduced;   /* tw_gemm_rs, TW_RS_LL_REDUCE: the GEMM's epilogue also summed this rank's
                        rows into out (gemm_ll.cuh): only the call's books are left here */
};

template <class P>
__global__ void __launch_bounds__(kUnfusedThreads)
    ll_reduce_kernel(const __grid_constant__ LlParams<P> p) {
  /* programmatic launch: the GEMM's partial is complete from here (from_gemm: its words carry
   * their flags, so nothing waits for the GEMM's end) */
  if (!p.from_gemm)
    tw::ptx::griddep_wait();
  const tw_dev_comm_t &dc = p.dc;
  const int ch = p.ch, world = dc.world, rank = dc.rank;
  const uint64_t epoch = tw_op_begin(dc, ch);
  const uint64_t seq = tw_ll_next_seq(dc);
  const uint2 flag = tw_ll_flags(seq, dc.call.digest);
  const uint64_t half = tw_ll_half(seq, p.half_bytes);
  bool ok = tw_op_usable(dc, ch);
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_START);
    tw_trace_channel(dc, ch);
    if (blockIdx.x == 0 && ok) {
      tw_call_publish(dc, ch);
      tw_signal_current(dc, ch, epoch);
      tw_ll_announce(dc, flag);
    }
    if (blockIdx.x == 0 && ok)
      for (int q = 0; q < world; q++)
        if (q != rank && dc.peer_ctrl[q])
          tw_st_relaxed_sys(&dc.peer_ctrl[q]->done[ch][rank], epoch);
  }
  constexpr int V = kVec<P>;
  const int64_t vecs = p.n / V, items = (int64_t)p.m_local * vecs;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const uint64_t slot_bytes = (uint64_t)items * 32;  /* partials: 32 B per vector */
  constexpr uint64_t kGatherItem = V == 8 ? 32 : 16; /* bf16 sums: 16 or 8 B */
  /* 2. push this rank's partial rows of every peer into its area */
  for (int64_t i = first; ok && !p.from_gemm && i < items; i += stride) {
    const int64_t r = i / vecs, c = V * (i % vecs);
    for (int d = 0; d < world; d++) {
      if (d == rank)
        continue;
      const uint4 v = __ldcg(reinterpret_cast<const uint4 *>(
          p.partial + (size_t)(d * p.m_local + r) * (size_t)p.n + (size_t)c));
      tw_ll_put_item(p.area[d] + half + (uint64_t)rank * slot_bytes, (uint64_t)i, (uint64_t)items,
                     v, flag);
    }
  }
  /* 3. this rank's rows: the sum in rank order (reduced: the GEMM's epilogue did it) */
  const uint8_t *mine = p.area[rank] + half;
  for (int64_t i = first; ok && !p.reduced && i < items; i += stride) {
    const int64_t r = i / vecs, c = V * (i % vecs);
    /* this rank's own partial from the workspace, loaded before the peers' waits (from_gemm: in
     * its words, as the peers') */
    uint4 own;
    if (!p.from_gemm)
      own = __ldcg(reinterpret_cast<const uint4 *>(
          p.partial + (size_t)(rank * p.m_local + r) * (size_t)p.n + (size_t)c));
    float v[V];
    ok = ll_sum_item<P>(dc, ch, mine, slot_bytes, (uint64_t)i, (uint64_t)items, flag,
                        p.from_gemm ? nullptr : &own, v);
    if (!ok)
      break;
    const typename RsVec<P>::Packed sum = RsVec<P>::pack(v);
    const int64_t orow = p.all_reduce ? (int64_t)rank * p.m_local + r : r;
    *reinterpret_cast<typename RsVec<P>::Packed *>(p.out + (size_t)orow * (size_t)p.ldo +
                                                   (size_t)c) = sum;
    if (p.all_reduce)
      for (int d = 0; d < world; d++) {
        if (d == rank)
          continue;
        uint8_t *g = p.area[d] + half + p.gather_off + (uint64_t)rank * items * kGatherItem;
        if constexpr (V == 8)
          tw_ll_put_item(g, (uint64_t)i, (uint64_t)items, make_uint4(sum.x, sum.y, sum.z, sum.w),
                         flag);
        else /* one word an item: a warp's words fill whole lines as they are */
          tw_ll_store(reinterpret_cast<uint4 *>(g + (uint64_t)i * kGatherItem), sum.x, sum.y, flag);
      }
  }
  /* 4. tw_gemm_ar: every peer's reduced rows into out */
  if (p.all_reduce) {
    const int64_t all = (int64_t)(world - 1) * items;
    for (int64_t j = first; ok && j < all; j += stride) {
      const int64_t k = j / items, i = j % items;
      const int s = (int)k + ((int)k >= rank ? 1 : 0); /* the peers in order, this rank skipped */
      const int64_t r = i / vecs, c = V * (i % vecs);
      const uint8_t *g = mine + p.gather_off + (uint64_t)s * items * kGatherItem;
      __nv_bfloat16 *o = p.out + (size_t)((int64_t)s * p.m_local + r) * (size_t)p.ldo + (size_t)c;
      if constexpr (V == 8) {
        uint4 w;
        ok = tw_ll_wait_item(dc, ch, g, (uint64_t)i, (uint64_t)items, flag, s, &w);
        if (!ok)
          break;
        *reinterpret_cast<uint4 *>(o) = w;
      } else {
        uint2 lo;
        ok = tw_ll_wait(dc, ch, reinterpret_cast<const uint4 *>(g + (uint64_t)i * kGatherItem),
                        flag, s, (int)i, &lo);
        if (!ok)
          break;
        *reinterpret_cast<uint2 *>(o) = lo;
      }
    }
  }
  /* from_gemm: this grid does not end before the GEMM's (whatever follows on the stream finds
   * both done); by now the GEMM has stored its last words, so this costs its exit alone */
  if (p.from_gemm)
    tw::ptx::griddep_wait();
  /* 5. the last CTA ends the call */
  tw_ll_call_end(dc, ch, epoch, seq);
}

/* The unfused pipeline's second kernel on `stream`: one thread per item, at most one CTA per SM
 * of the rank's budget. The cap is load-bearing where ranks share a GPU: every rank's CTAs spin
 * in the entry handshake until all ranks have entered, so all ranks' kernels must be resident at
 * once (with more CTAs than the budget, e.g. 128 a rank for 8 ranks on one GPU, they are not,
 * and the handshake times out). On GPUs of their own it is launched while the GEMM
 * runs (programmatic dependent launch), so its launch and the CTAs' start overlap the GEMM's tail;
 * never where ranks share a GPU (its early CTAs would hold SMs another rank's GEMM needs). */
template <class Params>
tw_status_t launch_after_gemm(tw_comm_t comm, int64_t items, cudaStream_t stream,
                              void (*kernel)(Params), const Params &p) {
  int64_t grid = (items + kUnfusedThreads - 1) / kUnfusedThreads;
  if (grid > comm->sm_budget)
    grid = comm->sm_budget;
  if (grid < 1)
    grid = 1;
  const bool pdl = !comm->gpu_shared;
  cudaLaunchConfig_t config;
  memset(&config, 0, sizeof(config));
  cudaLaunchAttribute attr[1] = {pdl_attribute()};
  config.gridDim = dim3((unsigned)grid);
  config.blockDim = dim3(kUnfusedThreads);
  config.stream = stream;
  config.attrs = pdl ? attr : NULL;
  config.numAttrs = pdl ? 1 : 0;
  return tw_cuda_check(cudaLaunchKernelEx(&config, kernel, p),
                       "tw_gemm_rs: launching the reduce kernel");
}

/* plan.ll: ll_reduce_kernel after the GEMM (run_unfused). */
template <class P>
tw_status_t launch_ll(tw_comm_t comm, const tw_gemm_rs_args_t &a, int all_reduce, int ch,
                      bool from_gemm, bool reduced, uint8_t *const *area, cudaStream_t stream) {
  const int world = comm->world;
  LlParams<P> p;
  memset(&p, 0, sizeof(p));
  p.dc = comm->dev;
  p.ch = ch;
  p.from_gemm = from_gemm;
  p.reduced = reduced;
  p.partial = (const P *)a.workspace;
  for (int s = 0; s < world; s++)
    p.area[s] = area[s];
  p.out = (__nv_bfloat16 *)a.out;
  p.ldo = a.ldo;
  p.m_local = (int32_t)(a.m / world);
  p.n = (int32_t)a.n;
  p.all_reduce = all_reduce;
  p.half_bytes = comm->ll_bytes / 2; /* the whole area's halves (allgather.cu says why) */
  p.gather_off = (uint64_t)world * (uint64_t)p.m_local * (uint64_t)a.n * sizeof(P) * 2;
  const int64_t items = (int64_t)p.m_local * (a.n / kVec<P>);
  /* reduced: one CTA keeps the books */
  return launch_after_gemm(comm,
                           reduced      ? 1
                           : all_reduce ? (world - 1) * items
                                        : items,
                           stream, ll_reduce_kernel<P>, p);
}

} // namespace

/* The unfused pipeline's launches (see above: two) on
 * `stream`, the rank's launch stream. */
template <class P>
tw_status_t run_unfused(tw_comm_t comm, const tw_gemm_rs_args_t &a, const tw_gemm_rs_plan_t &plan,
                        int all_reduce, cudaStream_t stream) {
  const int world = comm->world, rank = comm->rank;
  const int ch = all_reduce ? TW_CH_GEMM_AR : TW_CH_GEMM_RS;
  /* The peers' release of this workspace is waited for inside the GEMM (each CTA's producer
   * before its first tile, gemm_released.cuh). */
  tw_status_t st = TW_SUCCESS;
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.c_dtype = sizeof(P) == 2 ? TW_BF16 : TW_FP32;
  g.a = a.a, g.b = a.b, g.c = a.workspace;
  g.m = a.m, g.n = a.n, g.k = a.k;
  g.lda = a.lda, g.ldb = a.ldb, g.ldc = a.n;
  g.sm_count = comm->sm_budget;
  const int swap_max_m = (int)tw_gemm_rs_swap_max_m(comm->gpu_shared); /* swap-AB to m 128 here */
  /* Where it swaps A and B, the GEMM stores the words itself (gemm_ll.cuh), its own rows too; it
   * writes no workspace, so it waits for no release either */
  tw_gemm_ll_epi_t ll;
  memset(&ll, 0, sizeof(ll));
  if (plan.ll) /* every rank's area, mapped here (the GEMM's words and the reduce kernel's) */
    for (int s = 0; s < world; s++)
      ll.area[s] = (uint8_t *)tw_heap_peer_ptr(comm, comm->ll, s);
  const bool ll_epi =
      plan.ll && tw_gemm_swap_bn_upto((int)tw_env_int(TW_GEMM_SWAP_ID), a.m, swap_max_m) != 0;
  if (ll_epi) {
    ll.ll_seq = &comm->ctrl->ll_seq;
    ll.digest = comm->dev.call.digest;  /* the words' second flag (tw_ll_flags) */
    ll.half_bytes = comm->ll_bytes / 2; /* the reduce kernel's halves */
    ll.m_local = (int32_t)(a.m / world);
    ll.slot_bytes = (uint64_t)ll.m_local * (uint64_t)a.n * sizeof(P) * 2;
    ll.rank = rank;
    /* TW_RS_LL_REDUCE: tw_gemm_rs's own rows summed in the GEMM's epilogue (gemm_ll.cuh) */
    ll.reduce = tw_gemm_rs_want_ll_reduce((int)tw_env_int(TW_RS_LL_REDUCE_ID), all_reduce, a.m);
    ll.ch = ch;
    ll.dc = &comm->dev;
    ll.out = a.out;
    ll.ldo = a.ldo;
  }
  st = unfused_gemm<P>(g, swap_max_m, &comm->dev, ch, ll_epi ? &ll : NULL, stream);
  if (st != TW_SUCCESS)
    return st;
  if (plan.ll)
    return launch_ll<P>(comm, a, all_reduce, ch, ll_epi, ll.reduce != 0, ll.area, stream);
  UnfusedParams<P> p;
  memset(&p, 0, sizeof(p));
  p.dc = comm->dev;
  p.ch = ch;
  p.m_local = (int32_t)(a.m / world);
  p.m = (int32_t)a.m;
  p.n = (int32_t)a.n;
  const size_t partial_bytes = (size_t)a.m * (size_t)a.n * sizeof(P);
  for (int s = 0; s < world; s++)
    p.partial[s] = (const P *)tw_heap_peer_ptr(comm, a.workspace, s);
  if (!all_reduce) {
    p.ndst = 1;
    p.dst[0] = (__nv_bfloat16 *)a.out;
    p.ld_dst = a.ldo;
    p.dst_row0 = (int64_t)rank * p.m_local;
  } else if (plan.ar_peer_out) {
    p.ndst = world;
    p.peer_out = 1; /* dst[]: on the device, after the entries; no gather copy */
    p.out = (__nv_bfloat16 *)a.out;
    p.ldo = a.ldo;
  } else {
    p.ndst = world;
    p.copy = !plan.ar_out_sym;
    for (int q = 0; q < world; q++)
      p.dst[q] =
          plan.ar_out_sym
              ? (__nv_bfloat16 *)tw_heap_peer_ptr(comm, a.out, q)
              : (__nv_bfloat16 *)((char *)tw_heap_peer_ptr(comm, a.workspace, q) + partial_bytes);
    p.ld_dst = plan.ar_out_sym ? a.ldo : a.n;
    p.gather = (const __nv_bfloat16 *)((const char *)a.workspace + partial_bytes);
    p.out = (__nv_bfloat16 *)a.out;
    p.ldo = a.ldo;
  }
  const int64_t items = p.copy ? a.m * (a.n / 8) : a.m / world * (a.n / kVec<P>);
  return launch_after_gemm(comm, items, stream, unfused_reduce_kernel<P>, p);
}

template tw_status_t run_unfused<float>(tw_comm_t, const tw_gemm_rs_args_t &,
                                        const tw_gemm_rs_plan_t &, int, cudaStream_t);
template tw_status_t run_unfused<__nv_bfloat16>(tw_comm_t, const tw_gemm_rs_args_t &,
                                                const tw_gemm_rs_plan_t &, int, cudaStream_t);

cudaError_t preload_unfused() {
  const void *kernels[] = {(const void *)unfused_reduce_kernel<float>,
                           (const void *)unfused_reduce_kernel<__nv_bfloat16>,
                           (const void *)ll_reduce_kernel<float>,
                           (const void *)ll_reduce_kernel<__nv_bfloat16>};
  cudaError_t e = load_kernels(kernels, sizeof(kernels) / sizeof(kernels[0]));
  /* the pipeline's GEMM */
  if (e == cudaSuccess)
    e = preload_unfused_gemm<float>();
  if (e == cudaSuccess)
    e = preload_unfused_gemm<__nv_bfloat16>();
  return e;
}

} // namespace rs
} // namespace tw
