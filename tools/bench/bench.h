/*
 * tw-bench: one benchmark CLI for every op. Each op is a bench_op_t in its own
 * file (bench_<op>.c/.cu) that registers itself (bench_ops.c); the driver (bench_main.c)
 * parses the shared options, calls the op's run function for each shape, and
 * prints one side-by-side table last (plus --json / --csv files).
 *
 * Method (bench_time.c): warm-up, CUDA events, many repeats, median (p10/p90
 * kept); an op whose working set could stay in L2 rotates its inputs through copies
 * whose total is at least 4x the L2 (bench_rotation_count); random data, never zeros.
 */
#ifndef TW_BENCH_H
#define TW_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bench_shape {
  int64_t m, n, k;   /* op-specific meaning, documented by each op (e.g. total M for ag_gemm) */
  const char *label; /* optional, e.g. "flux-tp8" */
} bench_shape_t;

typedef struct bench_opts {
  const char *op;
  int have_shape; /* --m/--n/--k given: run that one shape instead of the op's sweep */
  bench_shape_t shape;
  int world;             /* --world: ranks (virtual ranks when fewer GPUs); 0 = op default */
  int sm_budget;         /* --sm-budget: SMs for the op / per rank; 0 = default */
  int repeats;           /* --repeats (default 50) */
  int warmup;            /* --warmup (default 10) */
  int check;             /* --check (default 1): verify results once before timing */
  const char *json_path; /* --json FILE */
  const char *csv_path;  /* --csv FILE */
  int quick;             /* --quick: the op's small sweep (for smoke tests / CI-size runs) */
} bench_opts_t;

/* One timed variant of one shape. */
typedef struct bench_row {
  char op[32];
  char variant[48]; /* "tilewire", "cublas", "unfused", "copy-engine", "gemm-alone", ... */
  char shape[96];   /* human-readable shape, e.g. "M=8192 N=8192 K=8192 sms=116" */
  double ms;        /* median */
  double ms_p10, ms_p90;
  double tflops;  /* per rank/GPU; 0 if not meaningful */
  double gbps;    /* bus bandwidth; 0 if not meaningful */
  double speedup; /* baseline time / this time (vs the row named by the op as baseline); 0 = n/a */
  double overlap; /* max(t_compute, t_comm) / t_fused for fused rows; 0 = n/a */
  int ok;         /* 1 = the variant's check passed (or no check), 0 = failed */
} bench_row_t;

/* ---- results (bench_results.c): the rows of a run, in the order they were added ------------ */

typedef struct bench_results bench_results_t;
/* An empty set of rows; out of host memory, these functions exit the process with status 3. */
bench_results_t *bench_results_create(void);
void bench_results_destroy(bench_results_t *res);
/* Appends a row (copied; its strings cut to their fields). */
void bench_add_row(bench_results_t *res, const bench_row_t *row);
/* Appends a failed row with no timing (ms NaN), which stands for a shape that produced none. */
void bench_add_error_row(bench_results_t *res, const char *op, const char *shape,
                         const char *variant);
int bench_results_count(const bench_results_t *res);
/* Row `index` (0 .. count - 1), or NULL. */
const bench_row_t *bench_results_row(const bench_results_t *res, int index);
/* How many rows from index `from` on failed their check. */
int bench_results_failed(const bench_results_t *res, int from);

typedef struct bench_op {
  const char *name;
  const char *help; /* one line: what it measures, what m/n/k mean */
  /* The op's default sweep (and --quick sweep). */
  const bench_shape_t *sweep;
  int sweep_count;
  const bench_shape_t *quick_sweep;
  int quick_count;
  /* Runs all variants of one shape and appends rows. Returns 0, or non-zero on a
   * setup error (the driver prints tw_last_error() / the message it printed). */
  int (*run)(const bench_opts_t *opts, const bench_shape_t *shape, bench_results_t *res);
} bench_op_t;

/* ---- the registry of ops (bench_ops.c) ------------------------------------- */

/* A new op's benchmark is a new file: bench_<op>.cu defines its bench_op_t and registers it at
 * file scope with BENCH_OP_REGISTER (a constructor that runs before main); no list names it.
 * `order` is its place in the run (and --list) order: increasing, ties by name. The ops in the
 * tree use multiples of 10 (grep BENCH_OP_REGISTER), so a new one can go between two. */
#define BENCH_MAX_OPS 32

/* Adds op (kept, not copied) to the registry; at load time, single-threaded. A second op of the
 * same name, or more than BENCH_MAX_OPS, aborts the program with a message. */
void bench_op_register(const bench_op_t *op, int order);

#define BENCH_OP_REGISTER(id, op, order)                                                           \
  static void __attribute__((constructor)) bench_op_register_##id(void) {                          \
    bench_op_register(&(op), (order));                                                             \
  }

/* Registered ops, in order. */
int bench_op_count(void);
const bench_op_t *bench_op_at(int index);
/* The op named `name`, or NULL. */
const bench_op_t *bench_op_find(const char *name);

/* ---- timing helpers (bench_time.c) ---------------------------------------- */

/* TW_BENCH_WARM_MS (default 100, 0 for none): how long every timing warms up at least. */
double bench_warm_ms(void);

/* Calls fn(ctx, i) `warmup` times, then on until bench_warm_ms() have passed since the
 * first call, then times `repeats` calls, each between two events on `stream`, and returns
 * the median in ms (p10/p90 optional). fn must enqueue its work on `stream` (or join its side
 * streams back into it). */
double bench_time_ms(void (*fn)(void *ctx, int iter), void *ctx, cudaStream_t stream, int warmup,
                     int repeats, double *p10, double *p90);

/* For work on several streams (virtual ranks): `fn` gets the index; the helper
 * records a start event on `main`, makes every stream in `streams` wait on it,
 * calls fn, then makes `main` wait on every stream and records the stop event. */
double bench_time_multi_ms(void (*fn)(void *ctx, int iter), void *ctx, cudaStream_t main,
                           cudaStream_t *streams, int nstreams, int warmup, int repeats,
                           double *p10, double *p90);

/* The main rows of a multi-rank op, fns[0..nfns) on one ctx: TW_BENCH_ROUNDS rounds (default 1:
 * one variant after another), each timing every variant in turn for ceil(repeats / rounds)
 * repeats (the first round after `warmup` calls, later ones after one; each block also warms
 * for bench_warm_ms()), so a card whose clock drifts (a power-capped one does, docs/PERF.md)
 * drifts for every variant alike; but each short block then starts in the power state its
 * predecessor left, which moves multi-rank rows more than the drift does, so the default
 * stays one block per variant. Per variant: the median (p10/p90 optional) of all its
 * repeats. */
int bench_rounds(int repeats);
/* TW_BENCH_GRAPH=1: rows are graph replays (multi-stream timings: variants that refuse capture
 * are left out; bench_time_ms: 16 calls per replay, its time over 16). */
int bench_graph_mode(void);
void bench_time_multi_rounds(void (*const *fns)(void *ctx, int iter), int nfns, void *ctx,
                             cudaStream_t main, cudaStream_t *streams, int nstreams, int warmup,
                             int repeats, double *ms, double *p10, double *p90);

/* A library knob's environment value, kept while a bench sets it and put back after. */
typedef struct {
  char name[64];
  char value[256];
  int had; /* it was set */
} bench_env_saved_t;
void bench_env_save(bench_env_saved_t *saved, const char *name);
void bench_env_restore(const bench_env_saved_t *saved);

/* TW_BENCH_AB="NAME=v1,v2,..." (environment knobs the library reads at every call): rows of one
 * fused variant under each value, timed in interleaved rounds (TW_BENCH_AB_ROUNDS, default 6;
 * each round times every value in turn, one warm-up call then max(2, repeats / rounds) calls;
 * the loop of bench_time_multi_rounds), so a card whose clock drifts over a run drifts for every
 * value alike. Per value: the median (p10/p90) of all its repeats. Rows are `tmpl` with variant
 * "<prefix>[NAME=v]", tflops = flops / t, speedup = t_base / t, overlap = t_max / t (0: none).
 * Every rank must read the same value at each call, so this is for ranks of one process; the knob's
 * previous value is restored. Does nothing when TW_BENCH_AB is unset; a malformed spec is reported.
 */
void bench_ab_rows(bench_results_t *res, const bench_row_t *tmpl, const char *prefix, double flops,
                   double t_base, double t_max, void (*fn)(void *ctx, int iter), void *ctx,
                   cudaStream_t main, cudaStream_t *streams, int nstreams,
                   const bench_opts_t *opts);

/* The single-GPU GEMM benches' rounds (tw-bench gemm, grouped_gemm, grouped_wgrad): every
 * variant timed once per round, interleaved, so the card's drift falls on every row alike.
 * bench_gemm_rounds: TW_BENCH_GEMM_ROUNDS (default 3), clamped to 1 .. BENCH_MAX_ROUNDS.
 * bench_median: sorts t[0..n) and returns its median. */
#define BENCH_MAX_ROUNDS 8
int bench_gemm_rounds(void);
double bench_median(double *t, int n);
/* Adds the row of one timed variant: tflops = flops / ms, speedup = baseline_ms / ms. */
void bench_add_timed_row(bench_results_t *res, const char *op, const char *variant,
                         const char *shape, double ms, double p10, double p90, double flops,
                         double baseline_ms, int ok);
/* The grouped benches' expert count: the shape label's "E=<n>", else TW_BENCH_GROUPED_EXPERTS,
 * else dflt; 0 where the text is not an integer in 1 .. max. */
int64_t bench_grouped_experts(const bench_shape_t *shape, int64_t dflt, int64_t max);

/* How many copies of a working set of `bytes` make the total at least 4x the L2. */
int bench_rotation_count(size_t bytes);

/* Exits the process with a message if a CUDA call failed. */
void bench_cuda_check(cudaError_t err, const char *what, const char *file, int line);
#define BENCH_CUDA(call) bench_cuda_check((call), #call, __FILE__, __LINE__)

#ifdef __cplusplus
}
#endif
#endif
