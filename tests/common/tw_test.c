#include "tw_test.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

int tw_test_passed = 0;
int tw_test_failed = 0;

void tw_test_expect_failure(tw_status_t got, tw_status_t want, const char *needle, const char *expr,
                            const char *file, int line) {
  const char *msg = tw_last_error();
  if (got == want && (!needle || strstr(msg, needle))) {
    tw_test_passed++;
    return;
  }
  tw_test_failed++;
  fprintf(stderr, "FAIL %s:%d: %s -> %s (%s); expected %s with a message containing \"%s\"\n", file,
          line, expr, tw_status_string(got), msg, tw_status_string(want), needle ? needle : "");
}

int tw_test_finish(void) {
  printf("%d passed, %d failed\n", tw_test_passed, tw_test_failed);
  fflush(stdout);
  return (tw_test_failed == 0 && tw_test_passed > 0) ? 0 : 1;
}

int tw_test_require_hopper(void) {
  /* Progress lines reach a log even when a hung test is killed. */
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* Virtual ranks: give every stream its own hardware queue (docs/ARCHITECTURE.md). */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  /* Lazy loading of a test's own kernel can wait for a spinning tilewire kernel. */
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    printf("SKIP: no CUDA device (%s)\n",
           err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    exit(77);
  }
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9) {
    printf("SKIP: device 0 is not sm_90\n");
    exit(77);
  }
  return count;
}

int tw_test_devices(int world, int *devices) {
  int count = 1;
  const char *mode = getenv("TW_TEST_DEVICES");
  if (mode && strcmp(mode, "distinct") == 0 &&
      (cudaGetDeviceCount(&count) != cudaSuccess || count < 1))
    count = 1;
  if (!mode || strcmp(mode, "distinct") != 0)
    count = 1;
  for (int r = 0; r < world; r++)
    devices[r] = r % count;
  return world > 1 && count > 1;
}

void tw_test_sync_devices(const int *devices, int world) {
  for (int r = 0; r < world; r++) {
    cudaError_t e = cudaSetDevice(devices[r]);
    if (e == cudaSuccess)
      e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      fprintf(stderr, "FATAL: rank %d's device %d: %s\n", r, devices[r], cudaGetErrorString(e));
      exit(1);
    }
  }
  cudaSetDevice(devices[0]);
}

unsigned long long tw_test_take_counters(unsigned long long *const *counters, const int *devices,
                                         int world) {
  tw_test_sync_devices(devices, world);
  unsigned long long sum = 0;
  for (int r = 0; r < world; r++) {
    unsigned long long one = 0;
    cudaError_t e = cudaSetDevice(devices[r]);
    if (e == cudaSuccess)
      e = cudaMemcpy(&one, counters[r], sizeof(one), cudaMemcpyDeviceToHost);
    if (e == cudaSuccess)
      e = cudaMemset(counters[r], 0, sizeof(one));
    if (e != cudaSuccess) {
      fprintf(stderr, "FATAL: rank %d's counter: %s\n", r, cudaGetErrorString(e));
      exit(1);
    }
    sum += one;
  }
  cudaSetDevice(devices[0]);
  return sum;
}

double tw_test_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int tw_test_wait_children(const pid_t *pids, int n, double bound_s, int *status, const char *what) {
  const double deadline = tw_test_now() + bound_s;
  int left = n, killed = 0;
  char *done = (char *)calloc(n > 0 ? (size_t)n : 1, 1);
  TEST_REQUIRE(done != NULL, "out of host memory");
  while (left > 0) {
    for (int i = 0; i < n; i++)
      if (!done[i] && waitpid(pids[i], &status[i], WNOHANG) == pids[i])
        done[i] = 1, left--;
    if (left > 0 && tw_test_now() > deadline) {
      for (int i = 0; i < n; i++)
        if (!done[i]) {
          fprintf(stderr, "%s %d still running after %.0f s: killed\n", what, i, bound_s);
          kill(pids[i], SIGKILL);
          waitpid(pids[i], &status[i], 0);
          done[i] = 1, left--, killed++;
        }
    }
    if (left > 0) {
      struct timespec ts = {0, 5 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  free(done);
  return killed;
}

uint64_t tw_test_seed(void) {
  const char *env = getenv("TW_TEST_SEED");
  uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
  printf("seed %llu (set TW_TEST_SEED to repeat)\n", (unsigned long long)seed);
  return seed;
}

uint64_t tw_test_xorshift(uint64_t *state) {
  *state ^= *state << 13;
  *state ^= *state >> 7;
  *state ^= *state << 17;
  return *state;
}

void tw_test_on_both_backends(const char *path, void (*run)(const char *backend, uint64_t seed),
                              void (*between)(void), uint64_t seed) {
  tw_test_use_verbs_double(path, "mlx5:8");
  setenv("TW_NET", "ib", 1);
  run("ib (RC)", seed);
  if (between)
    between();
  setenv("TW_VD_NICS", "efa:16", 1);
  setenv("TW_NET", "efa", 1);
  run("efa (SRD)", seed + 4200);
}

float tw_test_bf16_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

uint16_t tw_test_float_to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

void tw_test_rail_sum_bf16(const float *parts, int world, int per_node, size_t count,
                           uint16_t *out) {
  for (size_t i = 0; i < count; i++) {
    float total = 0;
    for (int t = 0; t < world / per_node; t++) {
      float node = parts[(size_t)(t * per_node) * count + i];
      for (int l = 1; l < per_node; l++)
        node += parts[(size_t)(t * per_node + l) * count + i];
      total = t == 0 ? node : total + node;
    }
    out[i] = tw_test_float_to_bf16(total);
  }
}

int tw_test_fork_ranks(int world, int ngpus, tw_test_rank_fn fn, void *arg, double bound_s,
                       int *st) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_get_unique_id(&id));
  fflush(NULL); /* a child must not print the parent's buffered lines again */
  pid_t pids[TW_MAX_WORLD];
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      const int rc = fn(id, r, world, r % ngpus, arg);
      fflush(NULL); /* _exit does not flush: the rank's lines were lost where stdout is a file */
      _exit(rc);
    }
  }
  return tw_test_wait_children(pids, world, bound_s, st, "rank");
}

static char verbs_fabric[64];

static void remove_verbs_fabric(void) { unlink(verbs_fabric); }

void tw_test_use_verbs_double(const char *path, const char *nics) {
  if (!verbs_fabric[0]) {
    snprintf(verbs_fabric, sizeof(verbs_fabric), "/tmp/tw-test-fabric-%d", (int)getpid());
    atexit(remove_verbs_fabric);
  }
  setenv("TW_VD_FABRIC", verbs_fabric, 1);
  setenv("TW_IBVERBS_LIB", path, 1);
  setenv("TW_EFADV_LIB", path, 1);
  setenv("TW_VD_NICS", nics, 1);
}
