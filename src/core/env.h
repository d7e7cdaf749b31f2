/* Reading TW_* knobs (table in env_defs.h). */
#ifndef TW_CORE_ENV_H
#define TW_CORE_ENV_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tw_env_id {
#define TW_ENV(name, type, def, cls, alike, desc) name##_ID,
#include "core/env_defs.h"
#undef TW_ENV
  TW_ENV_COUNT
} tw_env_id;

/* A knob's class (env_defs.h): a user setting (docs/ENV.md) or a developer switch
 * (docs/ENV-DEV.md). */
typedef enum tw_env_class { TW_ENV_USER = 0, TW_ENV_DEV = 1 } tw_env_class;

/* How many knobs every rank must set alike (the table's alike column). */
enum {
  TW_ENV_ALIKE_COUNT = 0
#define TW_ENV(name, type, def, cls, alike, desc) +(alike)
#include "core/env_defs.h"
#undef TW_ENV
};

/* TW_FAULT_STALL_TILE (tests): the bound on every GEMM-pipeline wait of the kernels it stalls
 * (src/gemm/gemm_launch.cuh), named by the stall's report (runtime/comm.c). */
#define TW_FAULT_STALL_BOUND_MS 500

/* Value of an int/bool/size knob: the environment's if it parses, else the
 * default (an unparsable value is warned about once). */
int64_t tw_env_int(tw_env_id id);
/* Value of a str knob, or its default. */
const char *tw_env_str(tw_env_id id);
/* 1 if every rank must set the knob alike (the table's alike column), else 0. */
int tw_env_alike(tw_env_id id);
/* The knob's class (the table's class column). */
tw_env_class tw_env_class_of(tw_env_id id);
/* Parses "123", "64K", "2M", "1G" (powers of 1024). Returns 0 on success. */
int tw_parse_size(const char *text, int64_t *value);

#ifdef __cplusplus
}
#endif
#endif
