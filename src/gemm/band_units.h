/* The unit numbering of tw_gemm_rs / tw_gemm_ar's band tile orders (an owner's 128 x 256
 * tiles in bands of `band` column blocks, row-major inside a band): host and device, C and
 * CUDA, so the GEMM core's tile orders (gemm_sm90.cuh) and the op (gemm_rs.h) share it. */
#ifndef TW_DEVICE_BAND_UNITS_H
#define TW_DEVICE_BAND_UNITS_H

#include <stdint.h>

#ifdef __CUDACC__
#define TW_BAND_HD static __host__ __device__ __forceinline__
#else
#define TW_BAND_HD static inline
#endif

/* Owner-relative unit number of row block mb_first(o) + mb_rel, column block nb (mbo: the
 * owner's row blocks): bands of `band` column blocks, row-major inside a band. */
TW_BAND_HD int32_t tw_rs_unit(int32_t mb_rel, int32_t nb, int32_t mbo, int32_t n_blocks,
                              int32_t band) {
  const int32_t first = nb / band * band;
  const int32_t width = n_blocks - first < band ? n_blocks - first : band;
  return first * mbo + mb_rel * width + (nb - first);
}

/* Its inverse. */
TW_BAND_HD void tw_rs_unit_coords(int32_t u, int32_t mbo, int32_t n_blocks, int32_t band,
                                  int32_t *mb_rel, int32_t *nb) {
  const int32_t first = u / (band * mbo) * band;
  const int32_t width = n_blocks - first < band ? n_blocks - first : band;
  const int32_t rem = u - first * mbo;
  *mb_rel = rem / width;
  *nb = first + rem % width;
}

#endif
