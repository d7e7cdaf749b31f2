/* Reading TW_* knobs (table in env_defs.h). */
#ifndef TW_CORE_ENV_H
#define TW_CORE_ENV_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tw_env_id {
#define TW_ENV(name, type, def, desc) name##_ID,
#include "core/env_defs.h"
#undef TW_ENV
  TW_ENV_COUNT
} tw_env_id;

/* TW_FAULT_STALL_TILE (tests): the bound on every GEMM-pipeline wait of the kernels it stalls
 * (src/gemm/gemm_launch.cuh), named by the stall's report (runtime/comm.c). */
#define TW_FAULT_STALL_BOUND_MS 500

/* Value of an int/bool/size knob: the environment's if it parses, else the
 * default (an unparsable value is warned about once). */
int64_t tw_env_int(tw_env_id id);
/* Value of a str knob, or its default. */
const char *tw_env_str(tw_env_id id);
/* Parses "123", "64K", "2M", "1G" (powers of 1024). Returns 0 on success. */
int tw_parse_size(const char *text, int64_t *value);

#ifdef __cplusplus
}
#endif
#endif
