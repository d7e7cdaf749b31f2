/* docs/ENV.md and docs/ENV-DEV.md, generated from the knob table (env_defs.h). Internal:
 * tw-info and the host test (tests/host/test_env.c) call it; the library does not export it. */
#ifndef TW_CORE_ENV_DOC_H
#define TW_CORE_ENV_DOC_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One row of the knob table, straight from env_defs.h (so tw-info, which links only the
 * library's public symbols, sees the class and alike columns too). */
typedef struct tw_env_doc_row {
  const char *name, *type, *default_value, *description;
  int developer; /* 1: a developer switch (docs/ENV-DEV.md); 0: a user setting (docs/ENV.md) */
  int alike;     /* 1: every rank must set it alike */
} tw_env_doc_row;

/* The table's rows, in table order (the order of tw_env_describe's indices), and their count. */
const tw_env_doc_row *tw_env_doc_rows(int *count);

/* Writes the whole of docs/ENV.md (developer 0: the user settings) or docs/ENV-DEV.md
 * (developer 1: the developer switches) to `out`. Depends only on the table, never on the
 * environment, so the file is the same wherever it is generated. Returns 0, or -1 if writing
 * failed. */
int tw_env_markdown(FILE *out, int developer);

#ifdef __cplusplus
}
#endif
#endif
