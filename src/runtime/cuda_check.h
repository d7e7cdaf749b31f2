/* Runtime-API checks that turn cudaError_t into tw_status_t with a message. */
#ifndef TW_RUNTIME_CUDA_CHECK_H
#define TW_RUNTIME_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records "what: cudaErrorX (text)"; TW_ERR_NO_DEVICE for no-device/driver errors,
 * TW_ERR_OUT_OF_MEMORY for allocation failures, else TW_ERR_CUDA. */
tw_status_t tw_cuda_check(cudaError_t err, const char *what);

/* With `tw_status_t st` and a `fail:` label in scope. */
#define TW_CUDA(call) TW_CHECK(tw_cuda_check((call), #call))

/* tw_cuda_check for a call that creates the device's primary context (cudaSetDevice,
 * cudaFree(0)): an allocation failure there while CUDA_DEVICE_MAX_CONNECTIONS asks for more
 * than the default 8 queues also names that variable. Under MPS every client keeps the
 * connections it asks for out of one pool of the server's, so a few processes asking for many
 * can leave the later ones without a context, which CUDA reports as out of memory. */
tw_status_t tw_cuda_check_context(cudaError_t err, const char *what);
#define TW_CUDA_CONTEXT(call) TW_CHECK(tw_cuda_check_context((call), #call))

/* Checks that `device` exists and is sm_90; TW_ERR_UNSUPPORTED_DEVICE otherwise. */
tw_status_t tw_check_device(int device);

/* The single-GPU ops' device steps: the current device, checked (tw_check_device), into
 * *device; and the SMs a call of `op` may use there, sm_count (1 .. the device's SMs) or all of
 * them for 0, into *sms (anything else: TW_ERR_INVALID_ARGUMENT naming sm_count). */
tw_status_t tw_op_device(const char *op, int *device);
tw_status_t tw_op_sms(const char *op, int device, int32_t sm_count, int *sms);

/* Dynamic shared memory that makes one CTA of `kernel` occupy a whole SM (more
 * than half of the SM's shared memory), with the kernel's limit raised to it.
 * Persistent kernels whose CTAs wait on other ranks use it, so that a rank's
 * SM budget is exactly the SMs its CTAs hold and budgets that sum to at most
 * the device's SMs are always co-resident. */
tw_status_t tw_sm_exclusive_smem(const void *kernel, int *smem_bytes);

/* Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per
 * device: *configured (zero-initialised, one per kernel, owned by the caller) keeps a bit per
 * device. `what` names the caller in the error message. */
#include <stdint.h>
tw_status_t tw_kernel_smem_once(const void *kernel, int bytes, uint64_t *configured,
                                const char *what);

/* Makes `device` current; returns the previous one in *prev. */
tw_status_t tw_set_device(int device, int *prev);

#ifdef __cplusplus
}
#endif
#endif
