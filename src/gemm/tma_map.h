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

/* The memo behind tw_tma_map_2d: the encoding is a pure function of these
 * arguments, and a fused call encodes one map per operand and per peer slot on every call, so
 * each thread keeps the maps it encoded last (direct-mapped, TW_TMA_MEMO_SLOTS). Exposed for
 * the host test. */
typedef struct tw_tma_args {
  const void *ptr;
  uint64_t cols, rows, ld;
  uint32_t box_cols, box_rows;
  int32_t dtype, elem_bytes;
} tw_tma_args_t;

#define TW_TMA_MEMO_SLOTS 128

/* 1 and *map filled when this thread encoded exactly `args` last in its slot, else 0. */
int tw_tma_memo_get(const tw_tma_args_t *args, CUtensorMap *map);
void tw_tma_memo_put(const tw_tma_args_t *args, const CUtensorMap *map);
/* Forgets this thread's maps. */
void tw_tma_memo_clear(void);

#ifdef __cplusplus
}
#endif
#endif
