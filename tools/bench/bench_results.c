/*
 * The rows of a tw-bench run (contract in bench.h). The bottom layer of tw-bench: the ops and
 * the timing helpers add rows, the driver (bench_main.c) prints them; this file calls neither.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

struct bench_results {
  bench_row_t *rows;
  int count;
  int capacity;
};

static void out_of_memory(size_t bytes) {
  fprintf(stderr, "tw-bench: out of host memory for result rows (%zu bytes)\n", bytes);
  exit(3);
}

bench_results_t *bench_results_create(void) {
  bench_results_t *res = calloc(1, sizeof(*res));
  if (!res)
    out_of_memory(sizeof(*res));
  return res;
}

void bench_results_destroy(bench_results_t *res) {
  if (!res)
    return;
  free(res->rows);
  free(res);
}

void bench_add_row(bench_results_t *res, const bench_row_t *row) {
  if (res->count == res->capacity) {
    int capacity = res->capacity ? 2 * res->capacity : 64;
    bench_row_t *rows = realloc(res->rows, (size_t)capacity * sizeof(*rows));
    if (!rows)
      out_of_memory((size_t)capacity * sizeof(*rows));
    res->rows = rows;
    res->capacity = capacity;
  }
  bench_row_t *dst = &res->rows[res->count++];
  *dst = *row;
  /* An op may have filled a field to the brim: the table and JSON rely on termination. */
  dst->op[sizeof(dst->op) - 1] = '\0';
  dst->variant[sizeof(dst->variant) - 1] = '\0';
  dst->shape[sizeof(dst->shape) - 1] = '\0';
}

void bench_add_timed_row(bench_results_t *res, const char *op, const char *variant,
                         const char *shape, double ms, double p10, double p90, double flops,
                         double baseline_ms, int ok) {
  bench_row_t row;
  memset(&row, 0, sizeof(row));
  snprintf(row.op, sizeof(row.op), "%s", op);
  snprintf(row.variant, sizeof(row.variant), "%s", variant);
  snprintf(row.shape, sizeof(row.shape), "%s", shape);
  row.ms = ms;
  row.ms_p10 = p10;
  row.ms_p90 = p90;
  row.tflops = flops / (ms * 1e-3) / 1e12;
  row.speedup = baseline_ms / ms;
  row.ok = ok;
  bench_add_row(res, &row);
}

int64_t bench_grouped_experts(const bench_shape_t *shape, int64_t dflt, int64_t max) {
  const char *e = shape->label ? strstr(shape->label, "E=") : NULL;
  const char *text = e ? e + 2 : getenv("TW_BENCH_GROUPED_EXPERTS");
  if (!text || !*text)
    return dflt;
  char *end = NULL;
  const long long v = strtoll(text, &end, 10);
  if (end == text || (*end && *end != ' ') || v < 1 || v > max)
    return 0;
  return (int64_t)v;
}

void bench_add_error_row(bench_results_t *res, const char *op, const char *shape,
                         const char *variant) {
  bench_row_t row;
  memset(&row, 0, sizeof(row));
  snprintf(row.op, sizeof(row.op), "%s", op);
  snprintf(row.shape, sizeof(row.shape), "%.*s", (int)sizeof(row.shape) - 1, shape);
  snprintf(row.variant, sizeof(row.variant), "%s", variant);
  row.ms = row.ms_p10 = row.ms_p90 = NAN;
  row.ok = 0;
  bench_add_row(res, &row);
}

int bench_results_count(const bench_results_t *res) { return res->count; }

const bench_row_t *bench_results_row(const bench_results_t *res, int index) {
  return index >= 0 && index < res->count ? &res->rows[index] : NULL;
}

int bench_results_failed(const bench_results_t *res, int from) {
  int failed = 0;
  for (int i = from < 0 ? 0 : from; i < res->count; i++)
    failed += !res->rows[i].ok;
  return failed;
}
