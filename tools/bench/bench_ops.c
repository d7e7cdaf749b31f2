/*
 * The registry of tw-bench ops (contract in bench.h). Each op file registers its bench_op_t
 * before main runs (BENCH_OP_REGISTER); the registry keeps them sorted by their order key, so
 * the run order and --list do not depend on the order the linker put the files in.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

typedef struct entry {
  const bench_op_t *op;
  int order;
} entry_t;

static entry_t registry[BENCH_MAX_OPS];
static int registered;

void bench_op_register(const bench_op_t *op, int order) {
  /* A second op of one name or a full table is a programming error, found at load. */
  if (!op || !op->name) {
    fprintf(stderr, "tw-bench: an op registered without a name\n");
    abort();
  }
  if (bench_op_find(op->name)) {
    fprintf(stderr, "tw-bench: op \"%s\" registered twice\n", op->name);
    abort();
  }
  if (registered == BENCH_MAX_OPS) {
    fprintf(stderr, "tw-bench: more than BENCH_MAX_OPS (%d) ops registered (%s)\n", BENCH_MAX_OPS,
            op->name);
    abort();
  }
  /* Insertion in (order, name) order: ties are broken by name so the result is still fixed. */
  int at = registered;
  while (at > 0 &&
         (registry[at - 1].order > order ||
          (registry[at - 1].order == order && strcmp(registry[at - 1].op->name, op->name) > 0))) {
    registry[at] = registry[at - 1];
    at--;
  }
  registry[at].op = op;
  registry[at].order = order;
  registered++;
}

int bench_op_count(void) { return registered; }

const bench_op_t *bench_op_at(int index) {
  return index >= 0 && index < registered ? registry[index].op : NULL;
}

const bench_op_t *bench_op_find(const char *name) {
  if (!name)
    return NULL;
  for (int i = 0; i < registered; i++)
    if (strcmp(registry[i].op->name, name) == 0)
      return registry[i].op;
  return NULL;
}
