#include "runtime/cuda_check.h"

#include <stdio.h>

#include <stdlib.h>

#include "core/status.h"

tw_status_t tw_cuda_check(cudaError_t err, const char *what) {
  if (err == cudaSuccess)
    return TW_SUCCESS;
  tw_status_t st = TW_ERR_CUDA;
  switch (err) {
  case cudaErrorNoDevice:
  case cudaErrorInsufficientDriver:
  case cudaErrorInvalidDevice: st = TW_ERR_NO_DEVICE; break;
  case cudaErrorMemoryAllocation: st = TW_ERR_OUT_OF_MEMORY; break;
  default: break;
  }
  return tw_fail(st, "%s: %s (%s)", what, cudaGetErrorName(err), cudaGetErrorString(err));
}

tw_status_t tw_cuda_check_context(cudaError_t err, const char *what) {
  const char *conns = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (err != cudaErrorMemoryAllocation || !conns || atoi(conns) <= 8)
    return tw_cuda_check(err, what);
  return tw_fail(TW_ERR_OUT_OF_MEMORY,
                 "%s: %s (%s) creating the CUDA context; CUDA_DEVICE_MAX_CONNECTIONS=%s asks for "
                 "%s hardware queues, and under MPS the server's clients share one pool of them "
                 "(a process with one rank needs no more than the default 8)",
                 what, cudaGetErrorName(err), cudaGetErrorString(err), conns, conns);
}

tw_status_t tw_check_device(int device) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0)
    return tw_fail(TW_ERR_NO_DEVICE, "no CUDA device: cudaGetDeviceCount -> %s",
                   err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
  if (device < 0 || device >= count)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "device: %d is outside [0, %d)", device, count);
  int major = 0, minor = 0;
  tw_status_t st =
      tw_cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                    "compute capability");
  if (st != TW_SUCCESS)
    return st;
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9)
    return tw_fail(TW_ERR_UNSUPPORTED_DEVICE,
                   "device %d has compute capability %d.%d; tilewire needs sm_90 (Hopper)", device,
                   major, minor);
  return TW_SUCCESS;
}

tw_status_t tw_op_device(const char *op, int *device) {
  char what[96];
  snprintf(what, sizeof(what), "%s: cudaGetDevice", op);
  tw_status_t st = tw_cuda_check(cudaGetDevice(device), what);
  return st == TW_SUCCESS ? tw_check_device(*device) : st;
}

tw_status_t tw_op_sms(const char *op, int device, int32_t sm_count, int *sms) {
  char what[96];
  snprintf(what, sizeof(what), "%s: multiprocessor count", op);
  tw_status_t st =
      tw_cuda_check(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device), what);
  if (st != TW_SUCCESS)
    return st;
  if (sm_count < 0 || sm_count > *sms)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: sm_count is %d; expected 0 (all) or 1..%d (device %d's SMs)", op,
                   (int)sm_count, *sms, device);
  if (sm_count > 0)
    *sms = sm_count;
  return TW_SUCCESS;
}

tw_status_t tw_sm_exclusive_smem(const void *kernel, int *smem_bytes) {
  int device = 0, per_sm = 0, optin = 0;
  tw_status_t st = tw_cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (st != TW_SUCCESS)
    return st;
  cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  int bytes = per_sm / 2 + 1024;
  if (bytes > optin)
    bytes = optin;
  st = tw_cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
      "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (st == TW_SUCCESS)
    *smem_bytes = bytes;
  return st;
}

tw_status_t tw_kernel_smem_once(const void *kernel, int bytes, uint64_t *configured,
                                const char *what) {
  int device = 0;
  tw_status_t st = tw_cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (st != TW_SUCCESS)
    return st;
  const uint64_t bit = (uint64_t)1 << (device % 64);
  if (__atomic_load_n(configured, __ATOMIC_ACQUIRE) & bit)
    return TW_SUCCESS;
  st = tw_cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
  if (st == TW_SUCCESS)
    __atomic_fetch_or(configured, bit, __ATOMIC_RELEASE);
  return st;
}

tw_status_t tw_set_device(int device, int *prev) {
  tw_status_t st = tw_cuda_check(cudaGetDevice(prev), "cudaGetDevice");
  if (st != TW_SUCCESS)
    return st;
  if (*prev == device)
    return TW_SUCCESS;
  return tw_cuda_check_context(cudaSetDevice(device), "cudaSetDevice");
}
