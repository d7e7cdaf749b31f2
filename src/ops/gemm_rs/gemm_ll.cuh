/*
 * Internal: a GEMM-core epilogue for tw_gemm_rs / tw_gemm_ar's unfused pipeline through the
 * comm's low-latency area (gemm_rs_unfused.cu, where its GEMM swaps A and B). The swap-AB GEMM of a
 * decode product (m <= 64) writes each finished tile's partial straight into its owners' areas as
 * low-latency words (signal.cuh: 8 data bytes and the call's flag twice per 16 bytes), this rank's
 * own rows into its own area, instead of TMA-storing the partial into the workspace for the reduce
 * kernel to read and push. The reduce kernel then only waits for words: it needs neither the GEMM's
 * end nor the workspace, and the words leave as each tile ends.
 *
 * Layout (the reduce kernel's, ll_reduce_kernel): half (q & 1) of the area, q = ctrl->ll_seq + 1
 * (the reduce kernel of the call stores q back at its end, after every word of the call has
 * arrived, this rank's own included, so every CTA here reads the same q); slot `rank` of owner
 * d holds d's rows [d * m_local, +m_local) of this rank's partial, item i = (row - d * m_local)
 * * vecs + column / V, V = 16 / sizeof(Out) values, its two words where tw_ll_item_off puts
 * them (32 bytes an item; 8 items' first words in one 128-byte line, their second words in the
 * next: a warpgroup's 8 threads of a box row store whole lines).
 *
 * reduce (tw_gemm_rs, TW_RS_LL_REDUCE): the epilogue reduces this rank's own rows itself. Each
 * warpgroup first stores the words of every peer's rows its boxes hold, then, for each 16-byte
 * group of its own rows, waits for every peer's words of that group (the peers' CTA of the same
 * tile index stores them: every rank runs the same static schedule, and each CTA stores before
 * it waits, so the waits of a tile depend only on stores that come before any wait), sums the
 * partials in rank order (rs_vec.cuh, the reduce kernel's arithmetic: the same bits) and stores
 * the bf16 sum into out. Own rows then never travel as words, and the reduce kernel after the
 * GEMM only keeps the call's books (one CTA). A failed wait (timeout, abort) is recorded in the
 * comm and its group left unwritten; the waits after it see the abort and give up at once.
 */
#pragma once

#include <type_traits>

#include "device/signal.cuh"
#include "gemm/gemm_sm90.cuh"
#include "ops/gemm_rs/rs_vec.cuh"

namespace tw {
namespace gemm {

/* The words' layout and where this call's go: both epilogues' parameters start with these. */
struct LlPushParams {
  uint8_t *area[TW_MAX_WORLD]; /* every rank's low-latency area, mapped for this rank */
  const uint64_t *ll_seq;      /* this rank's ctrl->ll_seq */
  uint64_t digest;             /* the call's digest, in the words' flags (tw_ll_flags) */
  uint64_t half_bytes;         /* one parity's bytes */
  uint64_t slot_bytes;         /* one slot's: m_local x vecs items of 32 bytes */
  int32_t rank, m, m_local, vecs;
};

/* EpiLlReduceT's: the words' and, for the own rows' sums, out (ldo elements a row); the waits
 * are bounded by dc's timeout and recorded under channel ch. A type of its own so that the
 * push-only epilogue's kernels keep their small parameters. */
struct LlReduceParams : LlPushParams {
  tw_dev_comm_t dc;
  __nv_bfloat16 *out;
  int64_t ldo;
  int32_t ch, pad;
};

namespace detail {

/* One 16-byte group of this rank's own rows (local row lr, vector v; d: its own partial): the
 * sum in rank order (ll_sum_item), into out. */
template <class Out>
__device__ __forceinline__ void ll_reduce_own(const LlReduceParams &p, const uint4 &d,
                                              uint64_t half0, uint2 flag, uint64_t item,
                                              uint64_t items, int32_t lr, int32_t v) {
  using V = RsVec<Out>;
  float sum[V::kE];
  if (!ll_sum_item<Out>(p.dc, p.ch, p.area[p.rank] + half0, p.slot_bytes, item, items, flag, &d,
                        sum))
    return; /* recorded; the group stays unwritten */
  *reinterpret_cast<typename V::Packed *>(p.out + (size_t)lr * (size_t)p.ldo + (size_t)v * V::kE) =
      V::pack(sum);
}

/* The warpgroup's boxes (kBoxes of kRows C rows x 128 bytes, 128B-swizzled, the first at C column
 * col, C row row): each thread takes 16-byte chunks (one item) and stores them into the owner's
 * area as two words; kReduce: the peers' rows only, then the own rows' sums (ll_reduce_own).
 * Rows past m and columns past n are padding: not stored. */
template <class Out, bool kReduce, int kBoxes, int kBoxBytes, int kRows, class Params>
__device__ __forceinline__ void ll_store_boxes(const Params &p, const uint8_t *boxes, int wg_thread,
                                               int32_t col, int32_t row) {
  constexpr int kV = 16 / (int)sizeof(Out);        /* values in a chunk */
  constexpr int kBoxCols = 128 / (int)sizeof(Out); /* C columns in a box */
  const uint64_t seq = tw_ll_seq_after(p.ll_seq);
  const uint2 flag = tw_ll_flags(seq, p.digest);
  const uint64_t half0 = tw_ll_half(seq, p.half_bytes);
  const uint64_t half = half0 + (uint64_t)p.rank * p.slot_bytes;
  const uint64_t items = (uint64_t)p.m_local * (uint64_t)p.vecs; /* a slot's */
#pragma unroll 1
  for (int pass = 0; pass < (kReduce ? 2 : 1); pass++)
    for_box_chunks<kBoxes, kBoxBytes, kRows>(
        boxes, wg_thread, [&](int b, int r, int c16, const uint8_t *chunk) {
          const int32_t t = row + r;                         /* the product's row (token) */
          const int32_t v = (col + b * kBoxCols) / kV + c16; /* its 16-byte vector */
          if (t >= p.m || v >= p.vecs)
            return;
          const uint4 d = *reinterpret_cast<const uint4 *>(chunk);
          const int32_t owner = t / p.m_local;
          const uint64_t item = (uint64_t)(t - owner * p.m_local) * (uint64_t)p.vecs + (uint64_t)v;
          if (pass == 0 && !(kReduce && owner == p.rank))
            tw_ll_put_item(p.area[owner] + half, item, items, d, flag);
          if constexpr (kReduce)
            if (pass == 1 && owner == p.rank)
              ll_reduce_own<Out>(p, d, half0, flag, item, items, t - owner * p.m_local, v);
        });
}

} // namespace detail

/* kReduce false (EpiLlPushT): every rank's rows as words, this rank's own too (the reduce kernel
 * sums them); true (EpiLlReduceT, tw_gemm_rs with TW_RS_LL_REDUCE): the peers' rows as words,
 * this rank's own summed here. */
template <class OutT, bool kReduce> struct EpiLlT {
  using Out = OutT;
  static constexpr bool kSignal = false;
  static constexpr bool kTransposed = true;
  static constexpr bool kWarpgroupStore = true;
  using Params = typename std::conditional<kReduce, LlReduceParams, LlPushParams>::type;
  __device__ static void prefetch(const Params &) {}
  __device__ static void signal(const Params &, int32_t, int32_t) {}
  template <int kBoxes, int kBoxBytes, int kRows>
  __device__ static void store_boxes(const Params &p, const uint8_t *boxes, int wg_thread,
                                     int32_t col, int32_t row) {
    detail::ll_store_boxes<Out, kReduce, kBoxes, kBoxBytes, kRows>(p, boxes, wg_thread, col, row);
  }
};
template <class OutT> using EpiLlPushT = EpiLlT<OutT, false>;
template <class OutT> using EpiLlReduceT = EpiLlT<OutT, true>;

} // namespace gemm
} // namespace tw
