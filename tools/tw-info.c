/*
 * tw-info: what this tilewire is (version, build), what it runs on (driver, runtime,
 * GPUs) and how it is configured (every TW_* knob: type, default, current value; the user
 * settings first, then the developer switches). `tw-info --env-markdown` prints docs/ENV.md,
 * `tw-info --env-dev-markdown` docs/ENV-DEV.md. Exits 0 on a machine with no GPU or no
 * driver, where it says so: it is the first thing to run on a new machine.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/env_doc.h"
#include "tilewire.h"

enum { EXIT_USAGE = 64, WRAP_COLUMNS = 96 };

static void usage(FILE *out) {
  fprintf(out, "usage: tw-info [--env-markdown | --env-dev-markdown | --help]\n"
               "\n"
               "Prints the tilewire version, build options, CUDA driver/runtime, the GPUs and\n"
               "every TW_* environment knob with its type, default and current value: the user\n"
               "settings, then the developer switches.\n"
               "  --env-markdown      print docs/ENV.md (the user settings as markdown) and exit\n"
               "  --env-dev-markdown  print docs/ENV-DEV.md (the developer switches) and exit\n");
}

static void print_version_code(const char *what, int code) {
  printf("%s %d.%d.%d", what, code / 10000, (code / 100) % 100, code % 100);
}

static void print_cuda_version(const char *what, int version) {
  if (version <= 0)
    printf("%s none", what);
  else
    printf("%s %d.%d", what, version / 1000, (version % 1000) / 10);
}

static void print_build(void) {
  print_version_code("tilewire", tw_version());
  print_version_code(" (library); tw-info built against header", TW_VERSION_CODE);
  printf("%s\n", tw_version() == TW_VERSION_CODE ? "" : "  <- MISMATCH: rebuild tw-info");
  printf("build:\n");
#ifdef TW_BUILD_TYPE
  printf("  build type      %s\n", TW_BUILD_TYPE);
#endif
#ifdef TW_CUDA_GENCODE
  printf("  CUDA targets    %s\n", TW_CUDA_GENCODE);
#endif
#if defined(__clang__)
  printf("  C compiler      clang %s\n", __clang_version__);
#elif defined(__GNUC__)
  printf("  C compiler      gcc %s\n", __VERSION__);
#endif
  printf("  CUDA headers    %d.%d\n", CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10);
#ifdef NDEBUG
  printf("  assertions      off\n");
#else
  printf("  assertions      on\n");
#endif
#if defined(__SANITIZE_ADDRESS__)
  printf("  sanitizers      address (TW_SANITIZE)\n");
#else
  printf("  sanitizers      off\n");
#endif
  printf("  NCCL baselines  tw-bench loads libnccl.so.2 at run time (TW_NCCL_LIB)\n");
}

/* rdma-core and the RDMA devices: what ranks on other nodes would go through. */
static void print_transport(void) {
  char text[4096];
  const tw_status_t st = tw_transport_info(text, sizeof(text));
  printf("inter-node transport (TW_NET=%s): %s%s\n", getenv("TW_NET") ? getenv("TW_NET") : "auto",
         text, st == TW_SUCCESS ? "" : " (ranks of one node are unaffected)");
}

/* Never fails the program: a machine without a driver or a GPU is a valid answer. */
static void print_devices(void) {
  int driver = 0, runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess)
    driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess)
    runtime = 0;
  printf("CUDA: ");
  print_cuda_version("driver", driver);
  print_cuda_version(", runtime", runtime);
  printf("\n");

  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    printf("devices: no CUDA device (%s)\n",
           err != cudaSuccess ? cudaGetErrorString(err) : "the driver reports 0 devices");
    /* A failed query leaves a sticky-looking last error; clear it for what follows. */
    (void)cudaGetLastError();
    return;
  }
  printf("devices: %d\n", count);
  int hopper = 0;
  for (int d = 0; d < count; d++) {
    struct cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, d);
    if (err != cudaSuccess) {
      printf("  %d  (cannot query: %s)\n", d, cudaGetErrorString(err));
      continue;
    }
    int supported = prop.major == 9;
    hopper += supported;
    printf("  %d  %s  sm_%d%d  %d SMs  %.1f GiB  L2 %.0f MiB  %s\n", d, prop.name, prop.major,
           prop.minor, prop.multiProcessorCount,
           (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0),
           (double)prop.l2CacheSize / (1024.0 * 1024.0),
           supported ? "[supported]" : "[not supported: tilewire needs sm_90]");
  }
  if (count > 1) {
    printf("peer access (row can reach column):\n     ");
    for (int j = 0; j < count; j++)
      printf(" %3d", j);
    printf("\n");
    for (int i = 0; i < count; i++) {
      printf("  %3d", i);
      for (int j = 0; j < count; j++) {
        int can = 0;
        if (i == j)
          can = 1;
        else if (cudaDeviceCanAccessPeer(&can, i, j) != cudaSuccess)
          can = -1;
        printf(" %3s", can > 0 ? "yes" : can == 0 ? "no" : "?");
      }
      printf("\n");
    }
  }
  if (hopper == 0)
    printf("no sm_90 GPU: tilewire's ops will return TW_ERR_UNSUPPORTED_DEVICE\n");
  (void)cudaGetLastError();
}

/* Prints text word-wrapped at WRAP_COLUMNS, every line indented by `indent`. */
static void print_wrapped(const char *text, int indent) {
  int column = 0;
  const char *p = text;
  while (*p) {
    while (*p == ' ')
      p++;
    if (!*p)
      break;
    int word = (int)strcspn(p, " ");
    if (column > 0 && column + 1 + word > WRAP_COLUMNS) {
      printf("\n");
      column = 0;
    }
    if (column == 0) {
      printf("%*s", indent, "");
      column = indent;
    } else {
      printf(" ");
      column++;
    }
    printf("%.*s", word, p);
    column += word;
    p += word;
  }
  printf("\n");
}

/* The knobs of one class (developer 0: user settings; 1: developer switches), each with its
 * type, default, current value, whether ranks must set it alike, and its description. */
static int print_env_group(int developer, int name_width, int default_width) {
  int count = 0, in_group = 0;
  const tw_env_doc_row *rows = tw_env_doc_rows(&count);
  for (int i = 0; i < count; i++)
    in_group += rows[i].developer == developer;
  printf("%s (%d; %s):\n", developer ? "developer switches" : "environment settings", in_group,
         developer ? "docs/ENV-DEV.md" : "docs/ENV.md");
  printf("  %-*s  %-4s  %-*s  %-5s  %s\n", name_width, "name", "type", default_width, "default",
         "alike", "current");
  for (int i = 0; i < count; i++) {
    if (rows[i].developer != developer)
      continue;
    const char *name = NULL, *current = NULL;
    if (tw_env_describe(i, &name, NULL, NULL, &current, NULL) != TW_SUCCESS)
      return -1;
    if (strcmp(name, rows[i].name) != 0) { /* tw-info's table copy against the library's */
      fprintf(stderr, "tw-info: knob %d is %s in the library but %s here: rebuild tw-info\n", i,
              name, rows[i].name);
      return -1;
    }
    const char *set = getenv(name);
    printf("  %-*s  %-4s  %-*s  %-5s  %s%s\n", name_width, name, rows[i].type, default_width,
           *rows[i].default_value ? rows[i].default_value : "\"\"", rows[i].alike ? "yes" : "no",
           *current ? current : "\"\"", set ? "  (set in the environment)" : "");
    print_wrapped(rows[i].description, 6);
  }
  return 0;
}

static int print_env(void) {
  int count = 0;
  const tw_env_doc_row *rows = tw_env_doc_rows(&count);
  if (count != tw_env_count()) {
    fprintf(stderr, "tw-info: the library has %d knobs, tw-info %d: rebuild tw-info\n",
            tw_env_count(), count);
    return -1;
  }
  int name_width = 4, default_width = 7;
  for (int i = 0; i < count; i++) {
    if ((int)strlen(rows[i].name) > name_width)
      name_width = (int)strlen(rows[i].name);
    if ((int)strlen(rows[i].default_value) > default_width)
      default_width = (int)strlen(rows[i].default_value);
  }
  if (print_env_group(0, name_width, default_width) != 0)
    return -1;
  printf("\n");
  return print_env_group(1, name_width, default_width);
}

int main(int argc, char **argv) {
  if (argc > 2) {
    usage(stderr);
    return EXIT_USAGE;
  }
  if (argc == 2) {
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(argv[1], "--env-markdown") || !strcmp(argv[1], "--env-dev-markdown")) {
      if (tw_env_markdown(stdout, !strcmp(argv[1], "--env-dev-markdown")) != 0 ||
          fflush(stdout) != 0) {
        fprintf(stderr, "tw-info: writing the markdown failed\n");
        return 1;
      }
      return 0;
    }
    fprintf(stderr, "tw-info: unknown argument \"%s\"\n", argv[1]);
    usage(stderr);
    return EXIT_USAGE;
  }

  print_build();
  print_devices();
  print_transport();
  if (print_env() != 0) {
    fprintf(stderr, "tw-info: reading the knob table failed: %s\n", tw_last_error());
    return 1;
  }
  return fflush(stdout) == 0 ? 0 : 1;
}
