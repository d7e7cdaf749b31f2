/* docs/ENV.md, generated from the knob table (env_defs.h). Internal: tw-info and the
 * host test (tests/host/test_env.c) call it; the library does not export it. */
#ifndef TW_CORE_ENV_DOC_H
#define TW_CORE_ENV_DOC_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the whole of docs/ENV.md to `out`. Depends only on the table's defaults, never
 * on the environment, so the file is the same wherever it is generated. Returns 0, or -1
 * if writing failed. */
int tw_env_markdown(FILE *out);

#ifdef __cplusplus
}
#endif
#endif
