/* Pointer arguments' checks (argcheck.h). */
#include "runtime/argcheck.h"

#include <stdint.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/status.h"
#include "runtime/comm.h"
#include "runtime/driver.h"

tw_status_t tw_check_device_range(int device, const void *ptr, size_t bytes, const char *what) {
  if (!ptr)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: NULL", what);
  struct cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError(); /* not sticky: leave no error for the caller's next call */
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %p is not memory CUDA knows (%s)", what, ptr,
                   cudaGetErrorString(err));
  }
  switch (attr.type) {
  case cudaMemoryTypeDevice:
    if (attr.device != device)
      return tw_fail(TW_ERR_INVALID_ARGUMENT,
                     "%s: %p is memory of device %d; the call runs on device %d", what, ptr,
                     attr.device, device);
    break;
  case cudaMemoryTypeManaged:
    return TW_SUCCESS; /* every device of the process may use it; its extent is the caller's */
  case cudaMemoryTypeHost:
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: %p is pinned host memory; the op needs device memory", what, ptr);
  default:
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: %p is not device memory (host memory, or freed or never allocated)", what,
                   ptr);
  }
  if (bytes == 0)
    return TW_SUCCESS;
  const tw_driver_api_t *cu;
  tw_status_t st = tw_driver(&cu);
  if (st != TW_SUCCESS)
    return st;
  CUdeviceptr base = 0;
  size_t size = 0;
  /* A cuMem mapping whose extent the driver does not report (the symmetric heap's) passes here;
   * the heap's own lookups check those ranges (tw_comm_check_range). */
  if (cu->cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS)
    return TW_SUCCESS;
  const size_t offset = (size_t)((uintptr_t)ptr - (uintptr_t)base);
  if (bytes > size - offset)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: the call's %zu bytes from %p run past the end of its allocation (%zu "
                   "bytes left)",
                   what, bytes, ptr, size - offset);
  return TW_SUCCESS;
}

tw_status_t tw_check_disjoint(const void *a, size_t a_bytes, const char *a_what, const void *b,
                              size_t b_bytes, const char *b_what) {
  const uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
  if (!a || !b || a_bytes == 0 || b_bytes == 0)
    return TW_SUCCESS;
  if (a0 < b0 + b_bytes && b0 < a0 + a_bytes)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s (%p, %zu bytes) overlaps %s (%p, %zu bytes): the call would race with "
                   "itself",
                   a_what, a, a_bytes, b_what, b, b_bytes);
  return TW_SUCCESS;
}

tw_status_t tw_comm_check_range(const struct tw_comm *comm, const void *ptr, size_t bytes,
                                const char *what) {
  /* inside this rank's heap slot (an address test, no list walk): one lookup of the heap */
  if (ptr && tw_heap_peer_ptr(comm, ptr, comm->rank) == ptr)
    return tw_heap_lookup(comm, ptr, bytes, what, NULL);
  return tw_check_device_range(comm->device, ptr, bytes, what);
}

tw_status_t tw_args_copy(const void *in, void *out, size_t size, size_t min_size, const char *op,
                         const char *type, const char *init) {
  if (!in)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: args is NULL", op);
  size_t given;
  memcpy(&given, in, sizeof(given));
  if (given < min_size || given > size + 4096)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: args->size is %zu; expected sizeof(%s) = %zu (initialise with %s)", op,
                   given, type, size, init);
  memcpy(out, in, given < size ? given : size);
  memcpy(out, &size, sizeof(size));
  return TW_SUCCESS;
}
