#include "runtime/driver.h"

#include <pthread.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "core/status.h"

static tw_driver_api_t api;
static tw_status_t api_status = TW_ERR_INTERNAL;
static char api_error[TW_ERRMSG_LEN];
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

/* Entry points as of CUDA 12.0: the ABI these prototypes describe. */
#define TW_DRIVER_ABI_VERSION 12000

static void resolve_all(void) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    api_status = tw_fail(TW_ERR_NO_DEVICE, "no CUDA device: cudaGetDeviceCount -> %s",
                         err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    tw_error_copy(api_error);
    return;
  }
#define RESOLVE(name)                                                                              \
  do {                                                                                             \
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;                   \
    void *fn = NULL;                                                                               \
    err = cudaGetDriverEntryPointByVersion(#name, &fn, TW_DRIVER_ABI_VERSION, cudaEnableDefault,   \
                                           &q);                                                    \
    if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn) {                           \
      api_status = tw_fail(TW_ERR_NO_DEVICE, "CUDA driver entry point %s not found (%s)", #name,   \
                           cudaGetErrorString(err));                                               \
      tw_error_copy(api_error);                                                                    \
      return;                                                                                      \
    }                                                                                              \
    *(void **)&api.name = fn;                                                                      \
  } while (0)
  RESOLVE(cuGetErrorString);
  RESOLVE(cuMemCreate);
  RESOLVE(cuMemRelease);
  RESOLVE(cuMemAddressReserve);
  RESOLVE(cuMemAddressFree);
  RESOLVE(cuMemMap);
  RESOLVE(cuMemUnmap);
  RESOLVE(cuMemSetAccess);
  RESOLVE(cuMemGetAllocationGranularity);
  RESOLVE(cuMemExportToShareableHandle);
  RESOLVE(cuMemImportFromShareableHandle);
  RESOLVE(cuMemGetAddressRange);
  RESOLVE(cuMemGetHandleForAddressRange);
  RESOLVE(cuStreamWaitValue64);
  RESOLVE(cuStreamWriteValue64);
  RESOLVE(cuTensorMapEncodeTiled);
#undef RESOLVE
  api_status = TW_SUCCESS;
}

tw_status_t tw_driver(const tw_driver_api_t **out) {
  pthread_once(&api_once, resolve_all);
  if (api_status != TW_SUCCESS)
    return tw_fail(api_status, "%s", api_error);
  *out = &api;
  return TW_SUCCESS;
}

tw_status_t tw_cu_check(CUresult res, const char *what) {
  if (res == CUDA_SUCCESS)
    return TW_SUCCESS;
  const char *text = "unknown error";
  if (api_status == TW_SUCCESS)
    api.cuGetErrorString(res, &text);
  tw_status_t st = res == CUDA_ERROR_OUT_OF_MEMORY ? TW_ERR_OUT_OF_MEMORY
                   : (res == CUDA_ERROR_NO_DEVICE || res == CUDA_ERROR_NOT_INITIALIZED)
                       ? TW_ERR_NO_DEVICE
                       : TW_ERR_CUDA;
  return tw_fail(st, "%s: CUresult %d (%s)", what, (int)res, text);
}
