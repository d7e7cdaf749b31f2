/*
 * The registry of tw-bench ops. Every entry is a weak reference, so an op whose
 * file is not in the build (yet) is simply absent from the list instead of a
 * link error; its address is then NULL and the lookups skip it.
 */
#include <stddef.h>
#include <string.h>

#include "bench.h"

extern const bench_op_t bench_op_gemm __attribute__((weak));
extern const bench_op_t bench_op_allgather __attribute__((weak));
extern const bench_op_t bench_op_flag __attribute__((weak));
extern const bench_op_t bench_op_ag_gemm __attribute__((weak));
extern const bench_op_t bench_op_gemm_rs __attribute__((weak));
extern const bench_op_t bench_op_gemm_ar __attribute__((weak));

/* Registry order is the order `tw-bench` runs them in and `--list` prints them. */
static const bench_op_t *const registry[] = {
    &bench_op_gemm,    &bench_op_allgather, &bench_op_flag,
    &bench_op_ag_gemm, &bench_op_gemm_rs,   &bench_op_gemm_ar,
};

enum { REGISTRY_SIZE = (int)(sizeof(registry) / sizeof(registry[0])) };

int bench_op_count(void) {
  int count = 0;
  for (int i = 0; i < REGISTRY_SIZE; i++)
    if (registry[i])
      count++;
  return count;
}

const bench_op_t *bench_op_at(int index) {
  for (int i = 0; i < REGISTRY_SIZE; i++) {
    if (!registry[i])
      continue;
    if (index-- == 0)
      return registry[i];
  }
  return NULL;
}

const bench_op_t *bench_op_find(const char *name) {
  if (!name)
    return NULL;
  for (int i = 0; i < REGISTRY_SIZE; i++)
    if (registry[i] && registry[i]->name && strcmp(registry[i]->name, name) == 0)
      return registry[i];
  return NULL;
}
