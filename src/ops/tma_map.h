/* Internal: 2D TMA tensor maps (128B swizzle) for the GEMM cores and the fused ops. */
#ifndef TW_OPS_TMA_MAP_H
#define TW_OPS_TMA_MAP_H

#include <cuda.h>
#include <stdint.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A row-major [rows, cols] matrix of elem_bytes-sized elements with leading
 * dimension ld (elements), boxes of box_rows x box_cols, 128B swizzle, zero
 * fill out of bounds. `what` names the operand in the error message. */
tw_status_t tw_tma_map_2d(CUtensorMap *map, CUtensorMapDataType dtype, int elem_bytes,
                          const void *ptr, uint64_t cols, uint64_t rows, uint64_t ld,
                          uint32_t box_cols, uint32_t box_rows, const char *what);

#ifdef __cplusplus
}
#endif
#endif
