#include "tma_map.h"

#include "driver.h"

tw_status_t tw_tma_map_2d(CUtensorMap *map, CUtensorMapDataType dtype, int elem_bytes,
                          const void *ptr, uint64_t cols, uint64_t rows, uint64_t ld,
                          uint32_t box_cols, uint32_t box_rows, const char *what) {
  const tw_driver_api_t *api = NULL;
  tw_status_t st = tw_driver(&api);
  if (st != TW_SUCCESS)
    return st;
  cuuint64_t dims[2] = {cols, rows};
  cuuint64_t strides[1] = {ld * (uint64_t)elem_bytes};
  cuuint32_t box[2] = {box_cols, box_rows};
  cuuint32_t elem_strides[2] = {1, 1};
  CUresult res = api->cuTensorMapEncodeTiled(
      map, dtype, 2, (void *)ptr, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return tw_cu_check(res, what);
}
