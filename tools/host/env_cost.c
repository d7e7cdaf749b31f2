/*
 * Host-only microbenchmark: what the TW_* knob reads of one fused call cost (a dozen
 * tw_env_int calls, each a getenv over the process environment). No GPU, not built by CMake:
 *
 *   gcc -O2 -std=c11 -D_GNU_SOURCE -Isrc -Iinclude tools/host/env_cost.c src/core/env.c \
 *       src/core/log.c src/core/status.c -o /tmp/env_cost -lpthread && /tmp/env_cost
 *
 * Sixteenth session: 0.6 us per 12 reads with 37 variables in the environment, 1.1 us with 117.
 */
#include <stdio.h>
#include <time.h>

#include "core/env.h"

extern char **environ;

int main(void) {
  const int calls = 200000, reads = 12;
  volatile long long sink = 0;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int i = 0; i < calls; i++)
    for (int j = 0; j < reads; j++)
      sink += tw_env_int((tw_env_id)(j % TW_ENV_COUNT));
  clock_gettime(CLOCK_MONOTONIC, &b);
  int vars = 0;
  for (char **e = environ; *e; e++)
    vars++;
  const double us = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e3 / calls;
  printf("%d tw_env_int reads: %.2f us (%d environment variables)\n", reads, us, vars);
  return 0;
}
