/*
 * GroupedWait: the GEMM engine's hooks for group-major rows (tw_grouped_gemm's contract in
 * tilewire.h; the design in grouped_gemm.cu): the live tiles from the groups' offsets in device
 * memory, L2 groups inside each group, and each tile's B rows at its group's weights. Offsets
 * written by an earlier kernel are read through the read-only cache. A fused op extends Params
 * (the hooks are templates over it) and may add a before_tile wait.
 */
#ifndef TW_OPS_GROUPED_WAIT_CUH
#define TW_OPS_GROUPED_WAIT_CUH

#include "gemm/gemm_params.cuh"

namespace tw {
namespace gemm {

struct GroupedWait : NoWait {
  struct Params {
    const int32_t *offsets; /* [groups + 1], device */
    int32_t groups, n, n_blocks, m_blocks, group_m;
  };
  __device__ static void before_tile(const Params &, int32_t, int32_t) {} /* rows are in place */
  /* The live row blocks (offsets[groups], read once per claim from L2), at most the bound's. */
  template <class P> __device__ static int32_t tile_count(const P &p, int32_t num_tiles) {
    const int32_t end = __ldg(p.offsets + p.groups);
    const int32_t blocks = end <= 0 ? 0 : (end + kBlockM - 1) / kBlockM;
    return blocks < p.m_blocks ? blocks * p.n_blocks : num_tiles;
  }
  /* The group whose rows hold row block mb's first row: the last g with offsets[g] <= row. */
  __device__ static int32_t group_of(const Params &p, int32_t mb) {
    const int32_t row = mb * kBlockM;
    int32_t lo = 0, hi = p.groups - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (__ldg(p.offsets + mid) <= row)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }
  /* The t-th tile of the row-major prefix is the same group's: inside a group, the default
   * order's L2 groups of group_m row blocks, column-major inside one (so the group's weights
   * stream through L2 once per group_m row blocks, not once per wave as row-major would). */
  template <class P> __device__ static int32_t tile_index(const P &p, int32_t t) {
    const int32_t g = group_of(p, t / p.n_blocks);
    const int32_t first = max(0, __ldg(p.offsets + g)) / kBlockM;
    const int32_t last = min(p.m_blocks, (__ldg(p.offsets + g + 1) + kBlockM - 1) / kBlockM);
    return group_tile_index(t, p.n_blocks, first, last, p.group_m);
  }
  template <class P> __device__ static void b_source(const P &p, int32_t mb, int32_t &b_row) {
    b_row += group_of(p, mb) * p.n;
  }
};

} // namespace gemm
} // namespace tw
#endif
