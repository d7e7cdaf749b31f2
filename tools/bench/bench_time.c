/*
 * Timing helpers for tw-bench (contract in bench.h).
 *
 * Every repeat is bracketed by its own pair of events and all repeats are
 * enqueued before the host waits once, behind two untimed calls (the warm-up drains the
 * stream), so the GPU runs them back to back and the host's launch latency never lands
 * inside a timed interval (unless the work itself is launch-bound, which is then what gets
 * measured). The median of many
 * repeats is the figure; p10/p90 say how steady it was.
 *
 * TW_BENCH_STAMPS=1: each timing prints "tw-bench stamp N start|end <unix seconds>" to stderr
 * (after the warm-up has drained, and once the repeats have), N counting timings from 0 in
 * row order, so samples of clocks and power taken meanwhile (nvidia-smi) can be
 * told apart per variant, and "tw-bench host enqueue X ms per call" (the host's time to
 * enqueue one call: where it reaches the median, the figure is launch-bound).
 *
 * TW_BENCH_GRAPH=1 (multi-stream timings): the repeat is captured once into a CUDA graph
 * (after the warm-up) and the timed repeats replay it, so the host's enqueue cost (tensor
 * maps, plans, per-rank launches) stays out of the figure. Work that refuses capture (the
 * copy-engine mode of tw_ag_gemm) fails its row. Single-stream timings (tw-bench gemm)
 * capture 16 calls and report a replay's time over 16.
 *
 * TW_BENCH_WARM_MS (default 100; 0: the warm-up calls alone): after its warm-up calls a timing
 * keeps calling, in batches with the stream drained between them, until that much time has
 * passed since its first call. A power-capped card's clock follows the load with a lag, so a
 * short block per variant would be timed in whatever clock state the previous variant left
 * (a heavy row timed right after a light one reads faster than the same row after a heavy
 * one). Warming each timing for longer than that lag times every variant in the state its
 * own load settles in.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"

void bench_cuda_check(cudaError_t err, const char *what, const char *file, int line) {
  if (err == cudaSuccess)
    return;
  fprintf(stderr, "tw-bench: %s:%d: %s failed: %s (%s)\n", file, line, what, cudaGetErrorName(err),
          cudaGetErrorString(err));
  exit(3);
}

static int graph_on(void) {
  const char *e = getenv("TW_BENCH_GRAPH");
  return e && *e == '1';
}

/* TW_BENCH_BLOCK=B (multi-rank timings, default 1): each timed sample is B calls between one
 * fork and one join of the ranks' streams, its time divided by B. The ranks' streams then run
 * the calls back to back, as in a training step, and the cross-GPU fork/join around each
 * sample (which starts the ranks apart) is paid once per B calls. */
static int block_calls(void) {
  const char *e = getenv("TW_BENCH_BLOCK");
  const int b = e && *e ? atoi(e) : 1;
  return b < 1 ? 1 : (b > 64 ? 64 : b);
}

static double host_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

double bench_warm_ms(void) {
  const char *e = getenv("TW_BENCH_WARM_MS");
  const double ms = e && *e ? atof(e) : 100;
  return ms > 0 ? ms : 0;
}

/* The warm-up of one timing: `warmup` calls of call(arg, 0..), then more in batches sized from
 * the time per call so far, draining `stream` after each batch, until TW_BENCH_WARM_MS have
 * passed since the first; returns the next iter. */
static int warm_up(void (*call)(void *arg, int iter), void *arg, cudaStream_t stream, int warmup) {
  const double t0 = host_seconds(), budget = bench_warm_ms() * 1e-3;
  int iter = 0;
  for (; iter < warmup; iter++)
    call(arg, iter);
  if (budget <= 0)
    return iter;
  BENCH_CUDA(cudaStreamSynchronize(stream));
  for (int batches = 0; batches < 32; batches++) {
    const double spent = host_seconds() - t0;
    if (spent >= budget)
      break;
    double batch = iter > 0 ? (budget - spent) / (spent / iter) + 1 : 1;
    if (batch > 2048)
      batch = 2048;
    for (int i = 0; i < (int)batch; i++)
      call(arg, iter++);
    BENCH_CUDA(cudaStreamSynchronize(stream));
  }
  return iter;
}

/* Untimed calls enqueued right before the timed repeats, with no drain after them: the warm-up
 * ends with the stream drained, so without these the first timed repeat starts on an idle GPU
 * and takes in the host's time to enqueue it (every rank's call, the fork and the join). One
 * such sample in a long block leaves the median alone; in TW_BENCH_AB's short blocks it is a
 * large share of the samples and would lift the A/B rows above the same code's main row. */
enum { kPrimeCalls = 2 };

static int prime(void (*call)(void *arg, int iter), void *arg, int iter) {
  for (int i = 0; i < kPrimeCalls; i++)
    call(arg, iter++);
  return iter;
}

static int stamps_on(void) {
  const char *e = getenv("TW_BENCH_STAMPS");
  return e && *e == '1';
}

/* Once the stream has drained: "start" or "end" of timing N (counted up at each end). */
static void stamp(int end, cudaStream_t stream) {
  static int timing = 0;
  BENCH_CUDA(cudaStreamSynchronize(stream));
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  fprintf(stderr, "tw-bench stamp %d %s %.3f\n", timing, end ? "end" : "start",
          (double)ts.tv_sec + ts.tv_nsec * 1e-9);
  timing += end;
}

static void *xcalloc(size_t count, size_t size) {
  void *p = calloc(count, size);
  if (!p) {
    fprintf(stderr, "tw-bench: out of host memory (%zu x %zu bytes)\n", count, size);
    exit(3);
  }
  return p;
}

static int compare_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Quantile q of sorted[0..n), interpolating linearly between neighbours. */
static double quantile(const double *sorted, int n, double q) {
  double pos = q * (double)(n - 1);
  int lo = (int)pos;
  if (lo >= n - 1)
    return sorted[n - 1];
  double frac = pos - (double)lo;
  return sorted[lo] + frac * (sorted[lo + 1] - sorted[lo]);
}

/* Sorts t[0..n) and returns its median (p10 / p90 optional). */
static double sorted_stats(double *t, int n, double *p10, double *p90) {
  qsort(t, (size_t)n, sizeof(double), compare_double);
  if (p10)
    *p10 = quantile(t, n, 0.1);
  if (p90)
    *p90 = quantile(t, n, 0.9);
  return quantile(t, n, 0.5);
}

/* Pooled samples (bench_time_multi_rounds): while `sink` is set, summarize() appends every
 * repeat's time there. */
static double *sink;
static int sink_len;

/* Waits for the last stop event, turns the event pairs into sorted times and
 * returns the median; frees nothing (the caller owns the events). */
static double summarize(cudaEvent_t *start, cudaEvent_t *stop, int repeats, int calls, double *p10,
                        double *p90) {
  BENCH_CUDA(cudaEventSynchronize(stop[repeats - 1]));
  double *times = xcalloc((size_t)repeats, sizeof(double));
  for (int i = 0; i < repeats; i++) {
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start[i], stop[i]));
    times[i] = (double)ms / calls;
    if (sink)
      sink[sink_len++] = times[i];
  }
  const double median = sorted_stats(times, repeats, p10, p90);
  free(times);
  return median;
}

static void create_events(cudaEvent_t *events, int count) {
  for (int i = 0; i < count; i++)
    BENCH_CUDA(cudaEventCreate(&events[i]));
}

static void destroy_events(cudaEvent_t *events, int count) {
  for (int i = 0; i < count; i++)
    BENCH_CUDA(cudaEventDestroy(events[i]));
}

double bench_time_ms(void (*fn)(void *ctx, int iter), void *ctx, cudaStream_t stream, int warmup,
                     int repeats, double *p10, double *p90) {
  if (warmup < 0)
    warmup = 0;
  if (repeats < 1)
    repeats = 1;
  /* The event pairs are created on the current device, which must be the stream's. */
  cudaEvent_t *start = xcalloc((size_t)repeats, sizeof(cudaEvent_t));
  cudaEvent_t *stop = xcalloc((size_t)repeats, sizeof(cudaEvent_t));
  create_events(start, repeats);
  create_events(stop, repeats);

  int iter = warm_up(fn, ctx, stream, warmup);
  BENCH_CUDA(cudaGetLastError());
  /* TW_BENCH_GRAPH=1: kGraphCalls calls (iters in turn: the buffer rotation goes on) captured
   * once; each timed repeat replays them back to back, so a kernel shorter than its host
   * enqueue (decode-sized GEMMs: tw_gemm's argument checks, maps and cluster launch, or
   * cuBLAS's heuristics) is timed at its GPU time, as a captured decode step runs it. */
  enum { kGraphCalls = 16 };
  cudaGraphExec_t exec = NULL;
  if (graph_on()) {
    cudaGraph_t graph;
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < kGraphCalls; c++)
      fn(ctx, iter++);
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    BENCH_CUDA(cudaGraphDestroy(graph));
    BENCH_CUDA(cudaGraphLaunch(exec, stream)); /* an untimed replay: uploads the graph */
    BENCH_CUDA(cudaStreamSynchronize(stream));
  }
  if (stamps_on())
    stamp(0, stream);
  if (exec)
    BENCH_CUDA(cudaGraphLaunch(exec, stream)); /* primes, as prime() does for eager calls */
  else
    iter = prime(fn, ctx, iter);
  for (int i = 0; i < repeats; i++) {
    BENCH_CUDA(cudaEventRecord(start[i], stream));
    if (exec)
      BENCH_CUDA(cudaGraphLaunch(exec, stream));
    else
      fn(ctx, iter++);
    BENCH_CUDA(cudaEventRecord(stop[i], stream));
  }
  BENCH_CUDA(cudaGetLastError());
  double median = summarize(start, stop, repeats, exec ? kGraphCalls : 1, p10, p90);
  if (exec)
    BENCH_CUDA(cudaGraphExecDestroy(exec));
  if (stamps_on())
    stamp(1, stream);

  destroy_events(stop, repeats);
  destroy_events(start, repeats);
  free(stop);
  free(start);
  return median;
}

/* Side streams may live on other devices (ranks on distinct GPUs): an event can
 * only be recorded on a stream of the device it was created on, so each join
 * event is made, and recorded, with its stream's device current. */
typedef struct side_stream {
  cudaStream_t stream;
  int device;
  cudaEvent_t joined;
} side_stream_t;

static void fork_join(void (*fn)(void *ctx, int iter), void *ctx, int iter, int calls,
                      cudaStream_t main, cudaEvent_t forked, side_stream_t *sides, int nsides,
                      int main_device) {
  for (int s = 0; s < nsides; s++)
    BENCH_CUDA(cudaStreamWaitEvent(sides[s].stream, forked, 0));
  for (int c = 0; c < calls; c++)
    fn(ctx, iter + c);
  for (int s = 0; s < nsides; s++) {
    BENCH_CUDA(cudaSetDevice(sides[s].device));
    BENCH_CUDA(cudaEventRecord(sides[s].joined, sides[s].stream));
    BENCH_CUDA(cudaStreamWaitEvent(main, sides[s].joined, 0));
  }
  BENCH_CUDA(cudaSetDevice(main_device));
}

/* One untimed repeat of a multi-stream timing (warm-up, graph capture), forked from its own
 * event. */
typedef struct {
  void (*fn)(void *ctx, int iter);
  void *ctx;
  cudaStream_t main;
  cudaEvent_t fork;
  side_stream_t *sides;
  int nsides, main_device;
  int calls; /* per fork/join (block_calls) */
} multi_call_t;

static void multi_call(void *arg, int iter) {
  const multi_call_t *m = (const multi_call_t *)arg;
  BENCH_CUDA(cudaEventRecord(m->fork, m->main));
  fork_join(m->fn, m->ctx, iter, m->calls, m->main, m->fork, m->sides, m->nsides, m->main_device);
}

double bench_time_multi_ms(void (*fn)(void *ctx, int iter), void *ctx, cudaStream_t main,
                           cudaStream_t *streams, int nstreams, int warmup, int repeats,
                           double *p10, double *p90) {
  if (warmup < 0)
    warmup = 0;
  if (repeats < 1)
    repeats = 1;
  if (nstreams < 0)
    nstreams = 0;
  int caller_device = 0, main_device = 0;
  BENCH_CUDA(cudaGetDevice(&caller_device));
  BENCH_CUDA(cudaStreamGetDevice(main, &main_device));

  side_stream_t *sides = xcalloc(nstreams > 0 ? (size_t)nstreams : 1, sizeof(side_stream_t));
  for (int s = 0; s < nstreams; s++) {
    sides[s].stream = streams[s];
    BENCH_CUDA(cudaStreamGetDevice(streams[s], &sides[s].device));
    BENCH_CUDA(cudaSetDevice(sides[s].device));
    BENCH_CUDA(cudaEventCreateWithFlags(&sides[s].joined, cudaEventDisableTiming));
  }
  BENCH_CUDA(cudaSetDevice(main_device));
  cudaEvent_t *start = xcalloc((size_t)repeats, sizeof(cudaEvent_t));
  cudaEvent_t *stop = xcalloc((size_t)repeats, sizeof(cudaEvent_t));
  create_events(start, repeats);
  create_events(stop, repeats);
  /* Warm-up forks from its own untimed event so it is ordered the same way. */
  cudaEvent_t warm_fork;
  BENCH_CUDA(cudaEventCreateWithFlags(&warm_fork, cudaEventDisableTiming));

  const int calls = block_calls();
  multi_call_t mc = {fn, ctx, main, warm_fork, sides, nstreams, main_device, calls};
  int iter = warm_up(multi_call, &mc, main, warmup);
  BENCH_CUDA(cudaGetLastError());
  cudaGraphExec_t exec = NULL;
  if (graph_on()) { /* one repeat, captured after the warm-up; its fork event is the graph's */
    cudaGraph_t graph;
    BENCH_CUDA(cudaStreamBeginCapture(main, cudaStreamCaptureModeRelaxed));
    multi_call(&mc, iter++);
    BENCH_CUDA(cudaStreamEndCapture(main, &graph));
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    BENCH_CUDA(cudaGraphDestroy(graph));
    BENCH_CUDA(cudaGraphLaunch(exec, main)); /* an untimed replay: uploads the graph */
  }
  if (stamps_on())
    stamp(0, main);
  if (exec)
    for (int i = 0; i < kPrimeCalls; i++)
      BENCH_CUDA(cudaGraphLaunch(exec, main));
  else
    iter = prime(multi_call, &mc, iter);
  const double host_t0 = host_seconds();
  for (int i = 0; i < repeats; i++) {
    BENCH_CUDA(cudaEventRecord(start[i], main));
    if (exec)
      BENCH_CUDA(cudaGraphLaunch(exec, main));
    else
      fork_join(fn, ctx, iter, calls, main, start[i], sides, nstreams, main_device);
    iter += calls;
    BENCH_CUDA(cudaEventRecord(stop[i], main));
  }
  const double host_ms = (host_seconds() - host_t0) * 1e3 / ((double)repeats * calls);
  BENCH_CUDA(cudaGetLastError());
  if (stamps_on())
    fprintf(stderr, "tw-bench host enqueue %.3f ms per call%s\n", host_ms,
            exec ? " (graph replays)" : "");
  double median = summarize(start, stop, repeats, calls, p10, p90);
  if (stamps_on())
    stamp(1, main);

  if (exec)
    BENCH_CUDA(cudaGraphExecDestroy(exec));
  BENCH_CUDA(cudaEventDestroy(warm_fork));
  destroy_events(stop, repeats);
  destroy_events(start, repeats);
  for (int s = nstreams - 1; s >= 0; s--)
    BENCH_CUDA(cudaEventDestroy(sides[s].joined));
  free(stop);
  free(start);
  free(sides);
  BENCH_CUDA(cudaSetDevice(caller_device));
  return median;
}

void bench_env_save(bench_env_saved_t *saved, const char *name) {
  const char *value = getenv(name);
  snprintf(saved->name, sizeof(saved->name), "%s", name);
  saved->had = value != NULL;
  snprintf(saved->value, sizeof(saved->value), "%s", value ? value : "");
}

void bench_env_restore(const bench_env_saved_t *saved) {
  if (saved->had)
    setenv(saved->name, saved->value, 1);
  else
    unsetenv(saved->name);
}

static void time_rounds(void (*const *fns)(void *ctx, int iter), int nfns, void *ctx,
                        void (*before)(void *arg, int v), void *arg, cudaStream_t main,
                        cudaStream_t *streams, int nstreams, int warmup, int rounds, int per,
                        double *ms, double *p10, double *p90);

/* TW_BENCH_AB's knob and values: value v goes into the environment before its block. */
typedef struct {
  const char *name;
  char (*values)[32];
} ab_values_t;

static void ab_set_value(void *arg, int v) {
  const ab_values_t *set = (const ab_values_t *)arg;
  setenv(set->name, set->values[v], 1);
}

void bench_ab_rows(bench_results_t *res, const bench_row_t *tmpl, const char *prefix, double flops,
                   double t_base, double t_max, void (*fn)(void *ctx, int iter), void *ctx,
                   cudaStream_t main, cudaStream_t *streams, int nstreams,
                   const bench_opts_t *opts) {
  enum { kMaxValues = 6, kMaxRounds = 32 };
  const char *spec = getenv("TW_BENCH_AB");
  if (!spec || !*spec)
    return;
  char name[64], values[kMaxValues][32];
  const char *eq = strchr(spec, '=');
  int nvalues = 0;
  if (eq && eq > spec && (size_t)(eq - spec) < sizeof(name)) {
    snprintf(name, sizeof(name), "%.*s", (int)(eq - spec), spec);
    for (const char *q = eq + 1; *q && nvalues < kMaxValues;) {
      const char *end = strchr(q, ',');
      const size_t len = end ? (size_t)(end - q) : strlen(q);
      if (len > 0 && len < sizeof(values[0]))
        snprintf(values[nvalues++], sizeof(values[0]), "%.*s", (int)len, q);
      q = end ? end + 1 : q + len;
    }
  }
  if (nvalues < 1) {
    fprintf(stderr, "tw-bench: TW_BENCH_AB=\"%s\": expected NAME=v1,v2,...\n", spec);
    return;
  }
  const char *r_env = getenv("TW_BENCH_AB_ROUNDS");
  int rounds = r_env && atoi(r_env) > 0 ? atoi(r_env) : 6;
  if (rounds > kMaxRounds)
    rounds = kMaxRounds;
  const int per_round = opts->repeats / rounds > 2 ? opts->repeats / rounds : 2;
  bench_env_saved_t saved;
  bench_env_save(&saved, name);
  ab_values_t set = {name, values};
  void (*fns[kMaxValues])(void *, int);
  double ms[kMaxValues], p10[kMaxValues], p90[kMaxValues];
  for (int v = 0; v < nvalues; v++)
    fns[v] = fn;
  time_rounds(fns, nvalues, ctx, ab_set_value, &set, main, streams, nstreams, 1, rounds, per_round,
              ms, p10, p90);
  bench_env_restore(&saved);
  for (int v = 0; v < nvalues; v++) {
    bench_row_t row = *tmpl;
    char label[512]; /* cut to the row's width */
    snprintf(label, sizeof(label), "%s[%s=%s]", prefix, name, values[v]);
    memcpy(row.variant, label, sizeof(row.variant) - 1);
    row.variant[sizeof(row.variant) - 1] = '\0';
    row.ms = ms[v], row.ms_p10 = p10[v], row.ms_p90 = p90[v];
    row.tflops = flops > 0 ? flops / (row.ms * 1e-3) / 1e12 : 0;
    row.gbps = 0;
    row.speedup = t_base > 0 ? t_base / row.ms : 0;
    row.overlap = t_max > 0 ? t_max / row.ms : 0;
    bench_add_row(res, &row);
  }
}

int bench_rotation_count(size_t bytes) {
  enum { MIN_COPIES = 2, MAX_COPIES = 64 };
  int device = 0, l2_bytes = 0;
  BENCH_CUDA(cudaGetDevice(&device));
  BENCH_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  if (bytes == 0)
    return MIN_COPIES;
  size_t want = 4 * (size_t)l2_bytes;
  size_t copies = (want + bytes - 1) / bytes;
  if (copies < MIN_COPIES)
    copies = MIN_COPIES;
  if (copies > MAX_COPIES)
    copies = MAX_COPIES;
  return (int)copies;
}

int bench_graph_mode(void) { return graph_on(); }

int bench_gemm_rounds(void) {
  const char *e = getenv("TW_BENCH_GEMM_ROUNDS");
  const int rounds = e ? atoi(e) : 3;
  return rounds < 1 ? 1 : (rounds > BENCH_MAX_ROUNDS ? BENCH_MAX_ROUNDS : rounds);
}

double bench_median(double *t, int n) { return sorted_stats(t, n, NULL, NULL); }

int bench_rounds(int repeats) {
  const char *e = getenv("TW_BENCH_ROUNDS");
  int rounds = e && *e ? atoi(e) : 1;
  if (rounds < 1)
    rounds = 1;
  return rounds > repeats ? (repeats > 0 ? repeats : 1) : rounds;
}

/* The one rounds loop: `rounds` rounds, each timing variant v = 0..nfns-1 in turn for `per`
 * repeats (after `before(arg, v)` where given; the first round after `warmup` calls, later ones
 * after one); per variant the median (p10/p90 optional) of all its repeats. */
static void time_rounds(void (*const *fns)(void *ctx, int iter), int nfns, void *ctx,
                        void (*before)(void *arg, int v), void *arg, cudaStream_t main,
                        cudaStream_t *streams, int nstreams, int warmup, int rounds, int per,
                        double *ms, double *p10, double *p90) {
  double *pool = xcalloc((size_t)nfns * (size_t)(rounds * per), sizeof(double));
  int *len = xcalloc((size_t)nfns, sizeof(int));
  for (int r = 0; r < rounds; r++)
    for (int v = 0; v < nfns; v++) {
      if (before)
        before(arg, v);
      sink = pool + (size_t)v * (size_t)(rounds * per) + len[v];
      sink_len = 0;
      bench_time_multi_ms(fns[v], ctx, main, streams, nstreams, r == 0 ? warmup : 1, per, NULL,
                          NULL);
      len[v] += sink_len;
      sink = NULL;
    }
  for (int v = 0; v < nfns; v++) {
    ms[v] = sorted_stats(pool + (size_t)v * (size_t)(rounds * per), len[v], p10 ? &p10[v] : NULL,
                         p90 ? &p90[v] : NULL);
  }
  free(len);
  free(pool);
}

void bench_time_multi_rounds(void (*const *fns)(void *ctx, int iter), int nfns, void *ctx,
                             cudaStream_t main, cudaStream_t *streams, int nstreams, int warmup,
                             int repeats, double *ms, double *p10, double *p90) {
  const int rounds = bench_rounds(repeats);
  time_rounds(fns, nfns, ctx, NULL, NULL, main, streams, nstreams, warmup, rounds,
              (repeats + rounds - 1) / rounds, ms, p10, p90);
}
