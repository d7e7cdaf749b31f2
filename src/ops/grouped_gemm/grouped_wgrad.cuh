/*
 * The GEMM engine's hooks for tw_grouped_gemm_wgrad (the contract in tilewire.h; the design in
 * grouped_wgrad.cu): a K-grouped GEMM whose tile of group g sums only g's rows.
 *   WgradWait      hook (k): the tile's K blocks are its group's rows; hook (a'): its A rows
 *                  are the group's local row block of a^T (every group reads the same rows of
 *                  a^T and b^T, over its own K columns);
 *   EpiGroupStore  the tile's boxes into out [groups][n][k] through a 3-D tensor map, so a
 *                  group's rows past n are dropped, never stored into the next group's.
 */
#ifndef TW_OPS_GROUPED_WGRAD_CUH
#define TW_OPS_GROUPED_WGRAD_CUH

#include "gemm/gemm_params.cuh"

namespace tw {
namespace gemm {

// The loop's row blocks: group g's are [g * row_blocks, (g + 1) * row_blocks), row_blocks =
// ceil(n / 128); its K blocks are its rows' columns of a^T and b^T.
struct WgradWait : NoWait {
  static constexpr bool kKRange = true;
  struct Params {
    const int32_t *offsets; /* [groups + 1], device: read at every tile through L1 */
    int32_t groups;
    int32_t row_blocks; /* ceil(n / 128) */
    int32_t m;          /* the bound: rows from min(offsets[groups], m) on were not transposed */
    int32_t zero_kb;    /* a K block of a^T and b^T that holds zeros (the workspace's last) */
  };
  __device__ static void before_tile(const Params &, int32_t, int32_t) {} /* rows are in place */
  // Group g's rows clamped to the transposed ones, [0, min(offsets[groups], m)), in K blocks of
  // 64 (offsets are multiples of 128, so exactly its rows). An empty group multiplies the zero
  // block once: its tiles store zeros (+0.0) like any other tile, with no store path of their
  // own. Offsets that break the contract give some range of transposed (or zero) columns.
  template <class P>
  __device__ static void k_range(const P &p, int32_t mb, int32_t, int32_t &kb0, int32_t &kb1) {
    const int32_t g = mb / p.row_blocks;
    const int32_t end = min(max(__ldg(p.offsets + p.groups), 0), p.m);
    const int32_t lo = min(max(__ldg(p.offsets + g), 0), end);
    const int32_t hi = min(max(__ldg(p.offsets + g + 1), lo), end);
    if (hi > lo) {
      kb0 = lo / kBlockK;
      kb1 = (hi + kBlockK - 1) / kBlockK;
    } else {
      kb0 = p.zero_kb;
      kb1 = p.zero_kb + 1;
    }
  }
  // The tile's A rows: its row block inside its group's [n] rows of a^T.
  template <class P>
  __device__ static void a_source(const P &p, int32_t mb, const CUtensorMap *&, int32_t &row) {
    row = (mb - mb / p.row_blocks * p.row_blocks) * kBlockM;
  }
};

// 3-D tile store shared -> global (out-of-bounds parts of the box are dropped).
__device__ __forceinline__ void tma_store_3d(const CUtensorMap *map, const void *src, int32_t c0,
                                             int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(ptx::smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// out [groups][n][k] as a 3-D tensor map (dims {k, n, groups}, box {128 / sizeof(Out), 64, 1},
// 128B swizzle). The loop's row r of the output is group r / group_rows's local row
// r % group_rows (group_rows = row_blocks * 128); local rows >= n lie outside the map's n.
template <class OutT> struct EpiGroupStore {
  using Out = OutT;
  static constexpr bool kSignal = false;
  struct Params {
    CUtensorMap c_map;
    int32_t group_rows;
  };
  __device__ static void prefetch(const Params &p) { ptx::tma_prefetch_map(&p.c_map); }
  __device__ static void issue_box(const Params &p, const void *box, int32_t col, int32_t row) {
    const int32_t g = row / p.group_rows;
    tma_store_3d(&p.c_map, box, col, row - g * p.group_rows, g);
  }
  __device__ static void signal(const Params &, int32_t, int32_t) {}
};

} // namespace gemm
} // namespace tw
#endif
