/*
 * CUDA driver API through cudaGetDriverEntryPointByVersion, so libtilewire
 * never links libcuda and loads on machines without a GPU driver.
 */
#ifndef TW_RUNTIME_DRIVER_H
#define TW_RUNTIME_DRIVER_H

#include <cuda.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_driver_api {
  CUresult (*cuGetErrorString)(CUresult, const char **);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                          unsigned long long);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *,
                                            CUmemAllocationGranularity_flags);
  CUresult (*cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle,
                                           CUmemAllocationHandleType, unsigned long long);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *,
                                             CUmemAllocationHandleType);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
  CUresult (*cuMemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, CUmemRangeHandleType,
                                            unsigned long long);
  CUresult (*cuStreamWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  CUresult (*cuStreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                     const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                     const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                     CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
} tw_driver_api_t;

/* Resolves the entry points once. Fails with TW_ERR_NO_DEVICE (message says
 * why) when there is no driver or no device. */
tw_status_t tw_driver(const tw_driver_api_t **api);

/* Checks a CUresult; on failure records "what: CUDA_ERROR_X (text)" and returns TW_ERR_CUDA
 * (TW_ERR_OUT_OF_MEMORY for CUDA_ERROR_OUT_OF_MEMORY). */
tw_status_t tw_cu_check(CUresult res, const char *what);

#ifdef __cplusplus
}
#endif
#endif
