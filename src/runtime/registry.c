/* The op registry (registry.h). */
#include "runtime/registry.h"

#include <stdio.h>
#include <stdlib.h>

#include "core/status.h"

static const tw_op_desc_t *ops[TW_MAX_OPS];
static int nops;

void tw_op_register(const tw_op_desc_t *op) {
  if (nops == TW_MAX_OPS) {
    /* A build with more ops than the table holds is a programming error, found at load. */
    fprintf(stderr, "tilewire: more than TW_MAX_OPS (%d) ops registered (%s)\n", TW_MAX_OPS,
            op->name);
    abort();
  }
  ops[nops++] = op;
}

const tw_call_fields_t *tw_call_fields(int channel) {
  for (int i = 0; i < nops; i++)
    for (int c = 0; c < ops[i]->ncalls; c++)
      if (ops[i]->calls[c].channel == channel)
        return &ops[i]->calls[c];
  return NULL;
}

tw_status_t tw_ops_preload(void) {
  for (int i = 0; i < nops; i++) {
    if (!ops[i]->preload)
      continue;
    tw_status_t st = ops[i]->preload();
    if (st != TW_SUCCESS) {
      tw_error_prefix("preloading the kernels of op %s", ops[i]->name);
      return st;
    }
  }
  return TW_SUCCESS;
}
