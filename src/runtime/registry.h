/*
 * The op registry: each op describes itself to the runtime, so the runtime names no op.
 *
 * An op file registers its descriptor at load time with TW_OP_REGISTER (a constructor that
 * runs when libtilewire is loaded, before any comm exists). The runtime asks each op for two
 * things: the names of its call descriptions' fields (`calls`, for the mismatch message of
 * runtime/calldesc.h), and `preload`, which loads the op's kernels on the current device. With
 * CUDA's lazy module loading, the first launch of a kernel may wait for the device to go idle; if a
 * persistent kernel is then spinning for a peer whose kernel is that first launch, nothing
 * moves until the wait bound. Loading every op's kernels at comm init removes that.
 */
#ifndef TW_RUNTIME_REGISTRY_H
#define TW_RUNTIME_REGISTRY_H

#include "runtime/devcomm.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_MAX_OPS 32

/* The calls an op describes on one channel (runtime/calldesc.h): the public entry's name and
 * what each field of its tw_call_desc_t holds, as the mismatch message names it. */
typedef struct tw_call_fields {
  int channel;       /* tw_channel_t */
  const char *entry; /* e.g. "tw_gemm_rs" */
  const char *field[TW_CALL_FIELDS];
} tw_call_fields_t;

typedef struct tw_op_desc {
  const char *name;              /* the public entry's name without tw_, e.g. "gemm_rs" */
  tw_status_t (*preload)(void);  /* loads the op's kernels on the current device */
  const tw_call_fields_t *calls; /* the channels its calls are described on (may be NULL) */
  int ncalls;
} tw_op_desc_t;

/* Adds op to the registry (at load time, single-threaded; at most TW_MAX_OPS). */
void tw_op_register(const tw_op_desc_t *op);

/* The fields of calls on `channel`, from the op that describes them; NULL if none does. */
const tw_call_fields_t *tw_call_fields(int channel);

/* Runs every registered op's preload on the current device; the first failure names its op. */
tw_status_t tw_ops_preload(void);

#ifdef __cplusplus
}
#endif

/* At file scope of an op's source: registers `desc` (a static const tw_op_desc_t); id is a
 * name unique in the library. */
#define TW_OP_REGISTER(id, desc)                                                                   \
  static void __attribute__((constructor)) tw_op_register_##id(void) { tw_op_register(&(desc)); }

#endif
