/*
 * Test helpers: tests are standalone programs that exit 0 (pass), 1 (fail)
 * or 77 (skip). Each prints "N passed, N failed" last.
 */
#ifndef TW_TEST_H
#define TW_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

extern int tw_test_passed;
extern int tw_test_failed;

#define TEST_ASSERT(cond, ...)                                                                     \
  do {                                                                                             \
    if (cond) {                                                                                    \
      tw_test_passed++;                                                                            \
    } else {                                                                                       \
      tw_test_failed++;                                                                            \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                              \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fprintf(stderr, "\n");                                                                       \
    }                                                                                              \
  } while (0)

/* Expects a tilewire call to succeed; prints the status and last error if not. */
#define TEST_TW_OK(call)                                                                           \
  do {                                                                                             \
    tw_status_t s_ = (call);                                                                       \
    TEST_ASSERT(s_ == TW_SUCCESS, "%s -> %s (%s)", #call, tw_status_string(s_), tw_last_error());  \
  } while (0)

/* Expects a tilewire call to fail with `status` and a message containing `needle`. */
#define TEST_TW_FAILS(call, status, needle)                                                        \
  tw_test_expect_failure((call), (status), (needle), #call, __FILE__, __LINE__)
void tw_test_expect_failure(tw_status_t got, tw_status_t want, const char *needle, const char *expr,
                            const char *file, int line);

/* A CUDA runtime call that must succeed (CUDA sources): stops the test naming the call and the
 * error otherwise. */
#define TEST_CUDA_OK(call)                                                                         \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    TEST_REQUIRE(e_ == cudaSuccess, "%s -> %s", #call, cudaGetErrorString(e_));                    \
  } while (0)

/* Stops the test at once (a condition later checks depend on). */
#define TEST_REQUIRE(cond, ...)                                                                    \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "FATAL %s:%d: %s: ", __FILE__, __LINE__, #cond);                             \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fprintf(stderr, "\n");                                                                       \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

/* Prints the closing line and returns the exit code (1 if any check failed or none ran). */
int tw_test_finish(void);

/* Exits 77 unless a Hopper (sm_90) GPU is present; returns the number of GPUs. */
int tw_test_require_hopper(void);

/* Devices for `world` ranks of one process: all on GPU 0 (virtual ranks), or with
 * TW_TEST_DEVICES=distinct rank r on GPU r % (number of GPUs). Returns 1 when some
 * ranks are on different GPUs. */
int tw_test_devices(int world, int *devices);
/* cudaDeviceSynchronize on every rank's device, then devices[0] current; exits on an error. */
void tw_test_sync_devices(const int *devices, int world);
/* After tw_test_sync_devices: the sum of the ranks' device counters (counters[r] on
 * devices[r], e.g. tw_test_count_diff_async's), each then zeroed; devices[0] current. */
unsigned long long tw_test_take_counters(unsigned long long *const *counters, const int *devices,
                                         int world);

/* Seconds since an arbitrary origin (CLOCK_MONOTONIC). */
double tw_test_now(void);
/* Waits for the n child processes pids[0..n), polling, for at most bound_s seconds; any still
 * running then is named on stderr ("<what> <i> still running after N s: killed"), killed and
 * reaped. status[i]: process i's wait status. Returns how many had to be killed (hangs). */
/* Points the inter-node backends at the verbs test double at `path` (TW_IBVERBS_LIB and
 * TW_EFADV_LIB) with the NICs `nics` (TW_VD_NICS), on a fabric file of this process's own
 * (TW_VD_FABRIC, which the processes it forks share; removed when this one exits). */
void tw_test_use_verbs_double(const char *path, const char *nics);
/* The verbs test double at `path` as 8 ConnectX NICs on the ib backend: run("ib (RC)", seed),
 * then between() (NULL: nothing), then as 16 EFA NICs on the efa backend: run("efa (SRD)",
 * seed + 4200). What the tests of an op across nodes do on each backend. */
void tw_test_on_both_backends(const char *path, void (*run)(const char *backend, uint64_t seed),
                              void (*between)(void), uint64_t seed);

/* A rank's body in a forked process: its exit status (0 pass). */
typedef int (*tw_test_rank_fn)(tw_unique_id_t id, int rank, int world, int device, void *arg);
/* Makes a unique id, forks `world` processes that run fn (rank r on device r % ngpus) and waits
 * for them as tw_test_wait_children does; st[r]: rank r's wait status. Returns how many were
 * killed. CUDA must not have started in the caller. */
int tw_test_fork_ranks(int world, int ngpus, tw_test_rank_fn fn, void *arg, double bound_s,
                       int *st);
int tw_test_wait_children(const pid_t *pids, int n, double bound_s, int *status, const char *what);

/* Seed for fresh random inputs: TW_TEST_SEED if set, else time-based (printed). */
uint64_t tw_test_seed(void);
/* The next number of a xorshift64 sequence (shifts 13, 7, 17) kept in *state: a fixed seed gives
 * a fixed list of generated cases. */
uint64_t tw_test_xorshift(uint64_t *state);

/* bf16 bits to float, and float to bf16 bits rounded to nearest even (finite values). */
float tw_test_bf16_to_float(uint16_t h);
uint16_t tw_test_float_to_bf16(float x);
/* The sum across nodes of tw_gemm_rs / tw_gemm_ar (ops/gemm_rs/gemm_rs_rail.h), element by
 * element of `count`: parts[r * count + i] is rank r's partial, the ranks in nodes of per_node;
 * each node's partials summed in rank order, then the nodes' in node order, fp32, rounded to
 * bf16 into out[i]. */
void tw_test_rail_sum_bf16(const float *parts, int world, int per_node, size_t count,
                           uint16_t *out);

/* ---- device helpers (tests/common/tw_test_gpu.cu) -------------------------------------- */
/* Fills n bf16 values with uniform random numbers in [-1, 1) from `seed`. */
void tw_test_fill_bf16(void *dst, size_t n, uint64_t seed, tw_stream_t stream);
/* Fills n bytes with a byte pattern derived from seed. */
void tw_test_fill_bytes(void *dst, size_t n, uint64_t seed, tw_stream_t stream);
/* Adds to *counter (device memory) the number of differing 32-bit words of two device
 * buffers (bytes a multiple of 4), on `stream`, without synchronising. */
void tw_test_count_diff_async(const void *a, const void *b, size_t bytes,
                              unsigned long long *counter, tw_stream_t stream);
/* Fills bytes with 0xFF (a NaN pattern for bf16/fp32): poison before a run. */
void tw_test_poison(void *dst, size_t bytes, tw_stream_t stream);
/* Number of differing bytes between two device buffers (synchronises). */
size_t tw_test_count_diff(const void *a, const void *b, size_t bytes);
/* Max |a-b| / max(|b|) over n elements of bf16 a and fp32/bf16 ref, with NaN counted
 * (synchronises). */
double tw_test_rel_err_bf16(const void *a, const void *ref, int ref_is_fp32, size_t n,
                            size_t *nan_count);
/* Same, over max(|scale|) (fp32, n elements) instead of max(|ref|): for a sum of rounded terms
 * the error scales with the sum of their magnitudes, not with the (possibly cancelled) sum. */
double tw_test_rel_err_bf16_scaled(const void *a, const void *ref, int ref_is_fp32,
                                   const float *scale, size_t n, size_t *nan_count);
/* Max |a-b| / max(|b|) for fp32 a and ref, non-finite a counted (synchronises). */
double tw_test_rel_err_fp32(const float *a, const float *ref, size_t n, size_t *nan_count);

/* Captures into one CUDA graph: prologue(ctx) (may be NULL) on streams[0], then the work
 * fn(ctx) enqueues on streams[0..n) (one device): streams 1..n-1 fork from streams[0] after
 * the prologue and join back into it through events. Returns the instantiated graph (replay
 * it on streams[0]); exits the test on a CUDA error. */
struct CUgraphExec_st;
struct CUstream_st;
struct CUgraphExec_st *tw_test_capture(struct CUstream_st **streams, int n,
                                       void (*prologue)(void *ctx), void (*fn)(void *ctx),
                                       void *ctx);

#ifdef __cplusplus
}
#endif
#endif
