/*
 * tw-bench: runs each op's variants (fused, unfused baseline, compute alone) per shape,
 * then prints one side-by-side table of every row, last, so a long run ends with its
 * summary on screen (progress goes to stderr as it runs). --json / --csv write the same
 * rows for the plot scripts; docs/PERF.md figures are copied from the table with its
 * header line (date, GPU, versions, command).
 *
 * Exit status: 0 every row passed its check; 1 a check failed, an op could not be set up
 * or an output file could not be written; 2 no Hopper GPU; 3 a CUDA call failed
 * (bench_cuda_check); 64 bad command line.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

enum { EXIT_CHECK_FAILED = 1, EXIT_NO_HOPPER = 2, EXIT_USAGE = 64 };

/* ---- command line ------------------------------------------------------------------------- */

typedef struct cli {
  bench_opts_t opts;
  int list;
  int help;
  int all_ops; /* no OP (or "all"): every registered op */
  int have_m, have_n, have_k;
  char command[1024]; /* the command line as typed, for the header and the JSON meta */
} cli_t;

static void usage(FILE *out) {
  fprintf(
      out,
      "usage: tw-bench [OP] [options]\n"
      "       tw-bench --list | --help\n"
      "\n"
      "Runs OP's variants (tilewire fused, unfused baseline, compute alone) over its shape\n"
      "sweep and prints them side by side. Without OP, runs every op's --quick sweep\n"
      "(`make run`); OP \"all\" runs every op's full sweep.\n"
      "\n"
      "options:\n"
      "  --m M --n N --k K  one shape instead of the sweep (meaning per op, see --list);\n"
      "                     a missing one copies the first given, so --m 4096 is 4096^3;\n"
      "                     K/M/G suffixes multiply by 1024^n\n"
      "  --world W          ranks; virtual ranks share a GPU when there are fewer GPUs\n"
      "                     (default: the op's)\n"
      "  --sm-budget S      SMs per rank (default: device SMs / ranks sharing it)\n"
      "  --repeats R        timed repeats per variant, median reported (default 50)\n"
      "  --warmup W         untimed calls first (default 10; then on for TW_BENCH_WARM_MS)\n"
      "  --no-check         skip verifying results before timing\n"
      "  --quick            the op's small sweep\n"
      "  --json FILE        write {\"meta\": {...}, \"rows\": [...]}\n"
      "  --csv FILE         write the rows as CSV\n"
      "  --list             list the ops in this build\n"
      "  --help             this text\n"
      "\n"
      "environment:\n"
      "  TW_BENCH_AB=NAME=v1,v2,...  ag_gemm, gemm_rs, gemm_ar, moe: extra rows of the fused op\n"
      "                     under each value of the library knob NAME, timed in interleaved\n"
      "                     rounds (TW_BENCH_AB_ROUNDS, default 6) so the card's drift hits\n"
      "                     every value alike; one process's ranks only. Compare these\n"
      "                     rows with each other, not with the main rows (shorter blocks)\n"
      "  TW_BENCH_AB_OUTSYM=1 gemm_ar: TW_BENCH_AB rows of the symmetric-output mode too\n"
      "  TW_BENCH_VIRTUAL=1 every rank on GPU 0; TW_BENCH_STAMPS=1 timing stamps and the\n"
      "                     host's enqueue time per repeat on stderr\n"
      "  TW_BENCH_ROUNDS=R  ag_gemm, gemm_rs, gemm_ar: the main rows (NCCL's included) timed\n"
      "                     in R interleaved rounds (default 1: one after another)\n"
      "  TW_BENCH_WARM_MS=T every timing warms up for at least T ms (default 100; 0: the\n"
      "                     --warmup calls only), so each variant is timed at the clock\n"
      "                     its own load settles at on a power-capped card\n"
      "  TW_BENCH_GRAPH=1   multi-rank rows replay one repeat captured in a CUDA graph\n"
      "                     (no host enqueue cost in the figure); gemm: 16 calls per\n"
      "                     graph, a replay's time over 16 (the GPU time per call)\n"
      "  TW_BENCH_BLOCK=B   multi-rank rows: each sample is B back-to-back calls between\n"
      "                     one fork and one join of the ranks' streams, divided by B\n"
      "                     (default 1; the fork/join starts the ranks apart)\n"
      "  TW_BENCH_GROUPED_EXPERTS=E  grouped_gemm: experts of a --m/--n/--k shape (--m: rows\n"
      "                     per expert; default 8); TW_BENCH_GROUPED_SKEW=S adds rows with\n"
      "                     uneven expert sizes (seed S)\n"
      "  TW_BENCH_MOE_EXPERTS=E, TW_BENCH_MOE_TOPK=K  moe: experts and top-k of a --m/--n/--k\n"
      "                     shape (--m: tokens per rank, --n: n_out, --k: hidden; default\n"
      "                     256, 8); TW_BENCH_MOE_SKEW=1 hot-expert routing,\n"
      "                     TW_BENCH_MOE_SEED=N the routing's seed (default 1)\n"
      "  TW_BENCH_RING_BATCH=B, TW_BENCH_RING_LAYOUT=zigzag|contiguous  ring_attention: the\n"
      "                     batch (default 4) and, for a --m/--n/--k shape, the layout\n"
      "                     (default zigzag, causal; contiguous is not causal)\n"
      "\n"
      "exit status: 0 all checks passed, 1 a check or setup failed, 2 no Hopper GPU,\n"
      "3 a CUDA call failed, 64 bad command line.\n");
}

static void usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "tw-bench: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n(see tw-bench --help)\n");
  va_end(ap);
  exit(EXIT_USAGE);
}

/* A non-negative integer with an optional K/M/G suffix (powers of 1024). */
static int parse_count(const char *text, int64_t *value) {
  if (!text || !*text || *text == '-' || *text == '+')
    return -1;
  errno = 0;
  char *end = NULL;
  long long v = strtoll(text, &end, 10);
  if (errno || end == text || v < 0)
    return -1;
  int shift = 0;
  switch (*end) {
  case '\0': break;
  case 'k':
  case 'K': shift = 10; break;
  case 'm':
  case 'M': shift = 20; break;
  case 'g':
  case 'G': shift = 30; break;
  default: return -1;
  }
  if (shift && end[1] != '\0')
    return -1;
  if (v > (INT64_MAX >> shift))
    return -1;
  *value = (int64_t)v << shift;
  return 0;
}

static int64_t count_arg(const char *name, const char *text, int64_t min, int64_t max) {
  int64_t v = 0;
  if (parse_count(text, &v) != 0 || v < min || v > max)
    usage_error("%s wants an integer in [%lld, %lld], got \"%s\"", name, (long long)min,
                (long long)max, text);
  return v;
}

static void record_command(cli_t *cli, int argc, char **argv) {
  size_t used = 0;
  cli->command[0] = '\0';
  for (int i = 0; i < argc; i++) {
    const char *arg = i == 0 ? "tw-bench" : argv[i];
    const char *quote = strpbrk(arg, " \t\"'") ? "'" : "";
    int n = snprintf(cli->command + used, sizeof(cli->command) - used, "%s%s%s%s", i ? " " : "",
                     quote, arg, quote);
    if (n < 0 || (size_t)n >= sizeof(cli->command) - used)
      break;
    used += (size_t)n;
  }
}

static void parse_cli(cli_t *cli, int argc, char **argv) {
  memset(cli, 0, sizeof(*cli));
  bench_opts_t *o = &cli->opts;
  o->repeats = 50;
  o->warmup = 10;
  o->check = 1;
  record_command(cli, argc, argv);

  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (arg[0] != '-' || arg[1] == '\0') {
      if (o->op)
        usage_error("one OP at a time; \"%s\" is a second one", arg);
      o->op = arg;
      continue;
    }
    /* --name=value or --name value */
    char name[32];
    const char *value = NULL;
    const char *eq = strchr(arg, '=');
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
    if (len >= sizeof(name))
      usage_error("unknown option %s", arg);
    memcpy(name, arg, len);
    name[len] = '\0';
    if (eq)
      value = eq + 1;

    if (!strcmp(name, "--help") || !strcmp(name, "-h")) {
      cli->help = 1;
      continue;
    }
    if (!strcmp(name, "--list")) {
      cli->list = 1;
      continue;
    }
    if (!strcmp(name, "--no-check")) {
      o->check = 0;
      continue;
    }
    if (!strcmp(name, "--quick")) {
      o->quick = 1;
      continue;
    }
    static const char *const with_value[] = {
        "--m", "--n", "--k", "--world", "--sm-budget", "--repeats", "--warmup", "--json", "--csv"};
    int known = 0;
    for (size_t w = 0; w < sizeof(with_value) / sizeof(with_value[0]); w++)
      if (!strcmp(name, with_value[w]))
        known = 1;
    if (!known)
      usage_error("unknown option %s", arg);
    if (!value) {
      if (i + 1 >= argc)
        usage_error("%s needs a value", name);
      value = argv[++i];
    }

    if (!strcmp(name, "--m")) {
      o->shape.m = count_arg("--m", value, 1, (int64_t)1 << 40);
      cli->have_m = 1;
    } else if (!strcmp(name, "--n")) {
      o->shape.n = count_arg("--n", value, 1, (int64_t)1 << 40);
      cli->have_n = 1;
    } else if (!strcmp(name, "--k")) {
      o->shape.k = count_arg("--k", value, 1, (int64_t)1 << 40);
      cli->have_k = 1;
    } else if (!strcmp(name, "--world")) {
      o->world = (int)count_arg("--world", value, 0, TW_MAX_WORLD);
    } else if (!strcmp(name, "--sm-budget")) {
      o->sm_budget = (int)count_arg("--sm-budget", value, 0, 100000);
    } else if (!strcmp(name, "--repeats")) {
      o->repeats = (int)count_arg("--repeats", value, 1, 1000000);
    } else if (!strcmp(name, "--warmup")) {
      o->warmup = (int)count_arg("--warmup", value, 0, 1000000);
    } else if (!strcmp(name, "--json")) {
      o->json_path = value;
    } else {
      o->csv_path = value;
    }
  }

  if (cli->have_m || cli->have_n || cli->have_k) {
    int64_t first = cli->have_m ? o->shape.m : cli->have_n ? o->shape.n : o->shape.k;
    if (!cli->have_m)
      o->shape.m = first;
    if (!cli->have_n)
      o->shape.n = first;
    if (!cli->have_k)
      o->shape.k = first;
    o->have_shape = 1;
  }
  if (!o->op) {
    /* The default job (`make run`): a quick pass over everything. */
    cli->all_ops = 1;
    o->quick = 1;
  } else if (!strcmp(o->op, "all")) {
    cli->all_ops = 1;
    o->op = NULL;
  }
}

static void list_ops(void) {
  int count = bench_op_count();
  if (count == 0) {
    printf("no ops in this build\n");
    return;
  }
  for (int i = 0; i < count; i++) {
    const bench_op_t *op = bench_op_at(i);
    printf("%-12s %s\n", op->name, op->help ? op->help : "");
    printf("%-12s sweep: %d shapes, quick: %d shapes\n", "", op->sweep_count, op->quick_count);
  }
}

/* ---- the machine -------------------------------------------------------------------------- */

typedef struct machine {
  int device; /* the first Hopper GPU: current while ops run */
  int gpu_count;
  int hopper_count;
  char gpu_name[256];
  int sm_count;
  int cc_major, cc_minor;
  size_t memory_bytes;
  int l2_bytes;
  int driver_version, runtime_version;
  char date[64];
  char host[256];
} machine_t;

static void version_string(int version, char *out, size_t size) {
  if (version <= 0)
    snprintf(out, size, "none");
  else
    snprintf(out, size, "%d.%d", version / 1000, (version % 1000) / 10);
}

/* Fills *m from the first sm_90 GPU, or exits 2 saying why there is none. */
static void find_hopper(machine_t *m) {
  memset(m, 0, sizeof(*m));
  time_t now = time(NULL);
  struct tm local;
  if (localtime_r(&now, &local))
    strftime(m->date, sizeof(m->date), "%Y-%m-%d %H:%M:%S %z", &local);
  if (gethostname(m->host, sizeof(m->host)) != 0)
    snprintf(m->host, sizeof(m->host), "unknown");
  m->host[sizeof(m->host) - 1] = '\0';

  cudaError_t err = cudaGetDeviceCount(&m->gpu_count);
  if (err != cudaSuccess || m->gpu_count == 0) {
    fprintf(stderr, "tw-bench: no Hopper (sm_90) GPU found: %s\n",
            err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device");
    exit(EXIT_NO_HOPPER);
  }
  m->device = -1;
  char seen[512] = "";
  size_t used = 0;
  for (int d = 0; d < m->gpu_count; d++) {
    struct cudaDeviceProp prop;
    BENCH_CUDA(cudaGetDeviceProperties(&prop, d));
    if (prop.major == 9) {
      m->hopper_count++;
      if (m->device < 0) {
        m->device = d;
        snprintf(m->gpu_name, sizeof(m->gpu_name), "%s", prop.name);
        m->sm_count = prop.multiProcessorCount;
        m->cc_major = prop.major;
        m->cc_minor = prop.minor;
        m->memory_bytes = prop.totalGlobalMem;
        m->l2_bytes = prop.l2CacheSize;
      }
    }
    int n = snprintf(seen + used, sizeof(seen) - used, "%sdevice %d is %s (sm_%d%d)", d ? ", " : "",
                     d, prop.name, prop.major, prop.minor);
    if (n > 0 && (size_t)n < sizeof(seen) - used)
      used += (size_t)n;
  }
  if (m->device < 0) {
    fprintf(stderr, "tw-bench: no Hopper (sm_90) GPU found: %s\n", seen);
    exit(EXIT_NO_HOPPER);
  }
  if (m->hopper_count < m->gpu_count)
    fprintf(stderr, "tw-bench: warning: not every GPU is sm_90 (%s); using device %d\n", seen,
            m->device);
  BENCH_CUDA(cudaSetDevice(m->device));
  BENCH_CUDA(cudaDriverGetVersion(&m->driver_version));
  BENCH_CUDA(cudaRuntimeGetVersion(&m->runtime_version));
}

static void header_line(const machine_t *m, FILE *out) {
  char driver[16], runtime[16];
  version_string(m->driver_version, driver, sizeof(driver));
  version_string(m->runtime_version, runtime, sizeof(runtime));
  int v = tw_version();
  fprintf(out,
          "tw-bench %s | %s x%d | %d SMs, sm_%d%d, %.0f GiB, L2 %d MiB | driver %s, runtime %s | "
          "tilewire %d.%d.%d | host %s\n",
          m->date, m->gpu_name, m->hopper_count, m->sm_count, m->cc_major, m->cc_minor,
          (double)m->memory_bytes / (1024.0 * 1024.0 * 1024.0), m->l2_bytes >> 20, driver, runtime,
          v / 10000, (v / 100) % 100, v % 100, m->host);
}

/* ---- the table ---------------------------------------------------------------------------- */

enum {
  COL_OP,
  COL_SHAPE,
  COL_VARIANT,
  COL_MS,
  COL_SPREAD,
  COL_TFLOPS,
  COL_GBPS,
  COL_SPEEDUP,
  COL_OVERLAP,
  COL_CHECK,
  NUM_COLS
};
static const char *const col_title[NUM_COLS] = {"op",      "shape", "variant", "ms",      "p10-p90",
                                                "TFLOP/s", "GB/s",  "speedup", "overlap", "check"};
/* Text columns are left-aligned, numbers right-aligned. */
static const int col_left[NUM_COLS] = {1, 1, 1, 0, 0, 0, 0, 0, 0, 1};

enum { CELL = 112 };

static int positive(double x) { return isfinite(x) && x > 0.0; }

static void format_ms(double ms, char *out) {
  if (!positive(ms))
    snprintf(out, CELL, "-");
  else if (ms < 0.1)
    snprintf(out, CELL, "%.4f", ms);
  else if (ms < 10.0)
    snprintf(out, CELL, "%.3f", ms);
  else if (ms < 1000.0)
    snprintf(out, CELL, "%.2f", ms);
  else
    snprintf(out, CELL, "%.1f", ms);
}

/* A positive figure with `decimals` digits and a unit suffix, or "-" when not applicable. */
static void format_figure(double x, int decimals, const char *suffix, char *out) {
  if (positive(x))
    snprintf(out, CELL, "%.*f%s", decimals, x, suffix);
  else
    snprintf(out, CELL, "-");
}

static void format_cells(const bench_row_t *r, char cells[NUM_COLS][CELL]) {
  snprintf(cells[COL_OP], CELL, "%s", r->op);
  snprintf(cells[COL_SHAPE], CELL, "%s", r->shape);
  snprintf(cells[COL_VARIANT], CELL, "%s", r->variant);
  format_ms(r->ms, cells[COL_MS]);
  if (positive(r->ms) && isfinite(r->ms_p10) && isfinite(r->ms_p90) && r->ms_p90 >= r->ms_p10)
    snprintf(cells[COL_SPREAD], CELL, "%.1f%%", 100.0 * (r->ms_p90 - r->ms_p10) / r->ms);
  else
    snprintf(cells[COL_SPREAD], CELL, "-");
  format_figure(r->tflops, 1, "", cells[COL_TFLOPS]);
  format_figure(r->gbps, 1, "", cells[COL_GBPS]);
  format_figure(r->speedup, 2, "x", cells[COL_SPEEDUP]);
  format_figure(r->overlap, 2, "", cells[COL_OVERLAP]);
  snprintf(cells[COL_CHECK], CELL, "%s", r->ok ? "ok" : "FAIL");
}

static void print_cells(FILE *out, char cells[NUM_COLS][CELL], const int *width) {
  for (int c = 0; c < NUM_COLS; c++) {
    const char *sep = c ? "  " : "";
    if (c == NUM_COLS - 1)
      fprintf(out, "%s%s", sep, cells[c]); /* no trailing padding */
    else if (col_left[c])
      fprintf(out, "%s%-*s", sep, width[c], cells[c]);
    else
      fprintf(out, "%s%*s", sep, width[c], cells[c]);
  }
  fputc('\n', out);
}

static void print_table(FILE *out, const bench_results_t *res, const machine_t *m,
                        const cli_t *cli) {
  static char cells[NUM_COLS][CELL];
  int width[NUM_COLS];
  for (int c = 0; c < NUM_COLS; c++)
    width[c] = (int)strlen(col_title[c]);
  const int nrows = bench_results_count(res);
  for (int i = 0; i < nrows; i++) {
    format_cells(bench_results_row(res, i), cells);
    for (int c = 0; c < NUM_COLS; c++) {
      int len = (int)strlen(cells[c]);
      if (len > width[c])
        width[c] = len;
    }
  }

  fputc('\n', out);
  header_line(m, out);
  fprintf(out, "command: %s | repeats %d, warm-up %d calls and %g ms, check %s\n\n", cli->command,
          cli->opts.repeats, cli->opts.warmup, bench_warm_ms(), cli->opts.check ? "on" : "off");
  for (int c = 0; c < NUM_COLS; c++)
    snprintf(cells[c], CELL, "%s", col_title[c]);
  print_cells(out, cells, width);
  int total = 0;
  for (int c = 0; c < NUM_COLS; c++)
    total += width[c] + (c ? 2 : 0);
  for (int i = 0; i < total; i++)
    fputc('-', out);
  fputc('\n', out);
  for (int i = 0; i < nrows; i++) {
    const bench_row_t *r = bench_results_row(res, i), *prev = bench_results_row(res, i - 1);
    /* A blank line between shapes keeps each side-by-side group together. */
    if (prev && (strcmp(r->op, prev->op) || strcmp(r->shape, prev->shape)))
      fputc('\n', out);
    format_cells(r, cells);
    print_cells(out, cells, width);
  }
  if (nrows == 0)
    fprintf(out, "(no rows)\n");
  fprintf(out, "\nms: median; p10-p90: (p90 - p10) / median; TFLOP/s: per GPU; speedup: the op's "
               "baseline time / this time;\noverlap: max(t_compute, t_comm) / t_fused.\n");
}

/* ---- JSON and CSV ------------------------------------------------------------------------- */

static void json_string(FILE *out, const char *s) {
  fputc('"', out);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    switch (*p) {
    case '"': fputs("\\\"", out); break;
    case '\\': fputs("\\\\", out); break;
    case '\n': fputs("\\n", out); break;
    case '\t': fputs("\\t", out); break;
    case '\r': fputs("\\r", out); break;
    default:
      if (*p < 0x20)
        fprintf(out, "\\u%04x", *p);
      else
        fputc(*p, out);
    }
  }
  fputc('"', out);
}

/* JSON has no NaN or infinity: those become null. */
static void json_number(FILE *out, double x) {
  if (isfinite(x))
    fprintf(out, "%.6g", x);
  else
    fputs("null", out);
}

static int write_json(const char *path, const bench_results_t *res, const machine_t *m,
                      const cli_t *cli) {
  FILE *out = fopen(path, "w");
  if (!out)
    return -1;
  char driver[16], runtime[16], tilewire[32];
  version_string(m->driver_version, driver, sizeof(driver));
  version_string(m->runtime_version, runtime, sizeof(runtime));
  int v = tw_version();
  snprintf(tilewire, sizeof(tilewire), "%d.%d.%d", v / 10000, (v / 100) % 100, v % 100);
  const bench_opts_t *o = &cli->opts;

  fputs("{\n  \"meta\": {\n    \"tool\": \"tw-bench\",\n    \"date\": ", out);
  json_string(out, m->date);
  fputs(",\n    \"command\": ", out);
  json_string(out, cli->command);
  fputs(",\n    \"host\": ", out);
  json_string(out, m->host);
  fputs(",\n    \"gpu\": ", out);
  json_string(out, m->gpu_name);
  fprintf(out,
          ",\n    \"gpu_count\": %d,\n    \"sm_count\": %d,\n    \"compute_capability\": "
          "\"%d.%d\",\n    \"memory_bytes\": %zu,\n    \"l2_bytes\": %d,\n",
          m->hopper_count, m->sm_count, m->cc_major, m->cc_minor, m->memory_bytes, m->l2_bytes);
  fprintf(out,
          "    \"driver\": \"%s\",\n    \"runtime\": \"%s\",\n    \"tilewire\": \"%s\",\n"
          "    \"repeats\": %d,\n    \"warmup\": %d,\n    \"warm_ms\": %g,\n    \"check\": %s,\n   "
          " \"quick\": %s,\n"
          "    \"world\": %d,\n    \"sm_budget\": %d\n  },\n  \"rows\": [",
          driver, runtime, tilewire, o->repeats, o->warmup, bench_warm_ms(),
          o->check ? "true" : "false", o->quick ? "true" : "false", o->world, o->sm_budget);
  const int nrows = bench_results_count(res);
  for (int i = 0; i < nrows; i++) {
    const bench_row_t *r = bench_results_row(res, i);
    fputs(i ? ",\n    {\"op\": " : "\n    {\"op\": ", out);
    json_string(out, r->op);
    fputs(", \"shape\": ", out);
    json_string(out, r->shape);
    fputs(", \"variant\": ", out);
    json_string(out, r->variant);
    const char *names[] = {"ms", "ms_p10", "ms_p90", "tflops", "gbps", "speedup", "overlap"};
    const double values[] = {r->ms,   r->ms_p10,  r->ms_p90, r->tflops,
                             r->gbps, r->speedup, r->overlap};
    for (int f = 0; f < 7; f++) {
      fprintf(out, ", \"%s\": ", names[f]);
      json_number(out, values[f]);
    }
    fprintf(out, ", \"ok\": %s}", r->ok ? "true" : "false");
  }
  fputs(nrows ? "\n  ]\n}\n" : "]\n}\n", out);
  int failed = ferror(out);
  if (fclose(out) != 0)
    failed = 1;
  return failed ? -1 : 0;
}

static void csv_field(FILE *out, const char *s) {
  if (!strpbrk(s, ",\"\n\r")) {
    fputs(s, out);
    return;
  }
  fputc('"', out);
  for (const char *p = s; *p; p++) {
    if (*p == '"')
      fputc('"', out);
    fputc(*p, out);
  }
  fputc('"', out);
}

static void csv_number(FILE *out, double x) {
  if (isfinite(x))
    fprintf(out, "%.6g", x);
}

static int write_csv(const char *path, const bench_results_t *res) {
  FILE *out = fopen(path, "w");
  if (!out)
    return -1;
  fputs("op,shape,variant,ms,ms_p10,ms_p90,tflops,gbps,speedup,overlap,ok\n", out);
  for (int i = 0; i < bench_results_count(res); i++) {
    const bench_row_t *r = bench_results_row(res, i);
    csv_field(out, r->op);
    fputc(',', out);
    csv_field(out, r->shape);
    fputc(',', out);
    csv_field(out, r->variant);
    const double values[] = {r->ms,   r->ms_p10,  r->ms_p90, r->tflops,
                             r->gbps, r->speedup, r->overlap};
    for (int f = 0; f < 7; f++) {
      fputc(',', out);
      csv_number(out, values[f]);
    }
    fprintf(out, ",%d\n", r->ok ? 1 : 0);
  }
  int failed = ferror(out);
  if (fclose(out) != 0)
    failed = 1;
  return failed ? -1 : 0;
}

/* ---- running ------------------------------------------------------------------------------ */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void describe_shape(const bench_shape_t *s, char *out, size_t size) {
  snprintf(out, size, "m=%lld n=%lld k=%lld%s%s", (long long)s->m, (long long)s->n, (long long)s->k,
           s->label ? " " : "", s->label ? s->label : "");
}

/* Runs every shape of one op; returns the number of shapes that failed to run. */
static int run_op(const bench_op_t *op, const cli_t *cli, bench_results_t *res, int device) {
  bench_opts_t opts = cli->opts;
  opts.op = op->name;
  const bench_shape_t *shapes = opts.have_shape ? &opts.shape
                                : opts.quick    ? op->quick_sweep
                                                : op->sweep;
  int count = opts.have_shape ? 1 : opts.quick ? op->quick_count : op->sweep_count;
  if (!opts.have_shape && opts.quick && (count <= 0 || !shapes)) {
    /* An op without a quick sweep: its first full shape stands in. */
    shapes = op->sweep;
    count = op->sweep_count > 0 ? 1 : 0;
  }
  if (count <= 0 || !shapes) {
    fprintf(stderr, "tw-bench: %s: the op defines no shapes; give --m/--n/--k\n", op->name);
    bench_add_error_row(res, op->name, "-", "no-shapes");
    return 1;
  }

  int failures = 0;
  for (int i = 0; i < count; i++) {
    char shape[128];
    describe_shape(&shapes[i], shape, sizeof(shape));
    fprintf(stderr, "[%s %d/%d] %s ...\n", op->name, i + 1, count, shape);
    double t0 = now_s();
    int rows_before = bench_results_count(res);
    BENCH_CUDA(cudaSetDevice(device));
    int rc = op->run(&opts, &shapes[i], res);
    cudaError_t err = cudaGetLastError();
    if (rc != 0) {
      const char *msg = tw_last_error();
      fprintf(stderr, "tw-bench: %s %s: setup failed (%d)%s%s\n", op->name, shape, rc,
              msg && *msg ? ": " : "", msg && *msg ? msg : "");
      bench_add_error_row(res, op->name, shape, "setup-error");
      failures++;
    }
    if (err != cudaSuccess) {
      fprintf(stderr, "tw-bench: %s %s: left a CUDA error behind: %s (%s)\n", op->name, shape,
              cudaGetErrorName(err), cudaGetErrorString(err));
      bench_add_error_row(res, op->name, shape, "cuda-error");
      failures++;
    }
    fprintf(stderr, "[%s %d/%d] %d rows, %d failed, %.1f s\n", op->name, i + 1, count,
            bench_results_count(res) - rows_before, bench_results_failed(res, rows_before),
            now_s() - t0);
  }
  return failures;
}

int main(int argc, char **argv) {
  /* Virtual ranks: every stream its own hardware queue (docs/ARCHITECTURE.md). */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  setenv("CUDA_MODULE_LOADING", "EAGER", 0); /* see runtime/registry.h */
  cli_t cli;
  parse_cli(&cli, argc, argv);
  if (cli.help) {
    usage(stdout);
    return 0;
  }
  if (cli.list) {
    list_ops();
    return 0;
  }

  const bench_op_t *only = NULL;
  if (!cli.all_ops) {
    only = bench_op_find(cli.opts.op);
    if (!only) {
      fprintf(stderr, "tw-bench: unknown op \"%s\"; this build has:", cli.opts.op);
      for (int i = 0; i < bench_op_count(); i++)
        fprintf(stderr, " %s", bench_op_at(i)->name);
      fprintf(stderr, "%s\n", bench_op_count() ? "" : " none");
      return EXIT_USAGE;
    }
  } else if (bench_op_count() == 0) {
    fprintf(stderr, "tw-bench: no ops in this build\n");
    return EXIT_CHECK_FAILED;
  }

  machine_t machine;
  find_hopper(&machine);
  header_line(&machine, stderr);

  bench_results_t *res = bench_results_create();
  int failures = 0;
  if (only) {
    failures += run_op(only, &cli, res, machine.device);
  } else {
    for (int i = 0; i < bench_op_count(); i++)
      failures += run_op(bench_op_at(i), &cli, res, machine.device);
  }

  fflush(stderr);
  print_table(stdout, res, &machine, &cli);
  const int failed_rows = bench_results_failed(res, 0);
  printf("%d rows, %d failed\n", bench_results_count(res), failed_rows);
  fflush(stdout);

  int status = (failed_rows || failures) ? EXIT_CHECK_FAILED : 0;
  if (cli.opts.json_path && write_json(cli.opts.json_path, res, &machine, &cli) != 0) {
    fprintf(stderr, "tw-bench: cannot write %s: %s\n", cli.opts.json_path, strerror(errno));
    status = EXIT_CHECK_FAILED;
  }
  if (cli.opts.csv_path && write_csv(cli.opts.csv_path, res) != 0) {
    fprintf(stderr, "tw-bench: cannot write %s: %s\n", cli.opts.csv_path, strerror(errno));
    status = EXIT_CHECK_FAILED;
  }
  bench_results_destroy(res);
  return status;
}
