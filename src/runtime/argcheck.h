/*
 * Pointer arguments, checked before an op enqueues anything: a kernel handed a host, freed,
 * foreign or too-small pointer would fault, and a fault loses the CUDA context of the whole
 * process. Every failure is TW_ERR_INVALID_ARGUMENT with a message that names the argument.
 */
#ifndef TW_RUNTIME_ARGCHECK_H
#define TW_RUNTIME_ARGCHECK_H

#include <stddef.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* [ptr, ptr + bytes) must be memory that kernels on `device` can read and write: device memory
 * of that device (cudaMalloc, cuMem, the symmetric heap) or managed memory, all of it inside
 * one allocation. Host memory (pageable or pinned), memory of another device, and freed or
 * never-allocated addresses are refused. bytes 0 checks the pointer alone. */
tw_status_t tw_check_device_range(int device, const void *ptr, size_t bytes, const char *what);

struct tw_comm;
/* tw_check_device_range on the comm's device; inside the rank's symmetric heap the range must
 * lie inside one live allocation of the heap. */
tw_status_t tw_comm_check_range(const struct tw_comm *comm, const void *ptr, size_t bytes,
                                const char *what);

/* Ranges [a, a + a_bytes) and [b, b + b_bytes) must not overlap (an output written while
 * another argument is read, or two outputs, would race). */
tw_status_t tw_check_disjoint(const void *a, size_t a_bytes, const char *a_what, const void *b,
                              size_t b_bytes, const char *b_what);

/* The versioned args struct `in` (whose first field is its size_t size) copied into `out`,
 * `size` bytes that the caller filled with the struct's INIT first: a caller built against an
 * older, shorter struct gives fewer bytes, read as far as they go (the rest keeps INIT's
 * values). NULL, fewer than `min_size` bytes (the fields every version has) or more than size +
 * 4096 (not such a struct) is refused naming `op`, the struct `type` and its `init` macro.
 * out's size becomes `size`. */
tw_status_t tw_args_copy(const void *in, void *out, size_t size, size_t min_size, const char *op,
                         const char *type, const char *init);

#ifdef __cplusplus
}
#endif
#endif
