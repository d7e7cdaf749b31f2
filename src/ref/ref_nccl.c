#include "ref/ref_nccl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef TW_HAVE_NCCL_H /* CMake found nccl.h (TW_NCCL_INCLUDE_DIR) */
#include <nccl.h>     /* types and enums only: the functions come from dlsym */

typedef struct nccl_api {
  ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                                ncclComm_t, cudaStream_t);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  const char *(*GetErrorString)(ncclResult_t);
  ncclResult_t (*GetVersion)(int *);
} nccl_api;

static nccl_api api;
static int api_ok;
static char api_why[256];
static pthread_once_t api_once = PTHREAD_ONCE_INIT;
static _Thread_local char last_error[256];

struct tw_ref_nccl {
  int world;
  ncclComm_t comms[64];
};

static void load(void) {
  const char *path = getenv("TW_NCCL_LIB");
  if (!path || !*path)
    path = "libnccl.so.2";
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(api_why, sizeof(api_why), "dlopen(%s): %s (set TW_NCCL_LIB)", path, dlerror());
    return;
  }
#define SYM(field, name)                                                                           \
  do {                                                                                             \
    *(void **)&api.field = dlsym(lib, name);                                                       \
    if (!api.field) {                                                                              \
      snprintf(api_why, sizeof(api_why), "%s: no symbol %s", path, name);                          \
      return;                                                                                      \
    }                                                                                              \
  } while (0)
  SYM(CommInitAll, "ncclCommInitAll");
  SYM(CommDestroy, "ncclCommDestroy");
  SYM(AllGather, "ncclAllGather");
  SYM(ReduceScatter, "ncclReduceScatter");
  SYM(AllReduce, "ncclAllReduce");
  SYM(GroupStart, "ncclGroupStart");
  SYM(GroupEnd, "ncclGroupEnd");
  SYM(GetErrorString, "ncclGetErrorString");
  SYM(GetVersion, "ncclGetVersion");
#undef SYM
  api_ok = 1;
}

int tw_ref_nccl_available(char *why, size_t why_len) {
  pthread_once(&api_once, load);
  if (!api_ok && why)
    snprintf(why, why_len, "%s", api_why);
  return api_ok;
}

const char *tw_ref_nccl_error(void) { return last_error; }

static int check(ncclResult_t res, const char *what) {
  if (res == ncclSuccess)
    return 0;
  snprintf(last_error, sizeof(last_error), "%s: %s", what, api.GetErrorString(res));
  return -1;
}

int tw_ref_nccl_create(tw_ref_nccl_t **out, int world, const int *devices, char *why,
                       size_t why_len) {
  *out = NULL;
  if (!tw_ref_nccl_available(why, why_len))
    return -1;
  if (world < 1 || world > 64) {
    snprintf(why, why_len, "world %d outside [1, 64]", world);
    return -1;
  }
  for (int i = 0; i < world; i++)
    for (int j = 0; j < i; j++)
      if (devices[i] == devices[j]) {
        snprintf(why, why_len, "ranks %d and %d share GPU %d: NCCL needs distinct GPUs", j, i,
                 devices[i]);
        return -1;
      }
  tw_ref_nccl_t *n = calloc(1, sizeof(*n));
  if (!n) {
    snprintf(why, why_len, "out of host memory");
    return -1;
  }
  n->world = world;
  if (check(api.CommInitAll(n->comms, world, devices), "ncclCommInitAll")) {
    snprintf(why, why_len, "%s", last_error);
    free(n);
    return -1;
  }
  *out = n;
  return 0;
}

void tw_ref_nccl_destroy(tw_ref_nccl_t *n) {
  if (!n)
    return;
  for (int i = 0; i < n->world; i++)
    api.CommDestroy(n->comms[i]);
  free(n);
}

/* One collective per rank inside a group (one thread drives every rank). */
#define GROUP(call_for_rank_i)                                                                     \
  do {                                                                                             \
    if (check(api.GroupStart(), "ncclGroupStart"))                                                 \
      return -1;                                                                                   \
    int failed_ = 0;                                                                               \
    for (int i = 0; i < n->world && !failed_; i++)                                                 \
      failed_ = check(call_for_rank_i, #call_for_rank_i);                                          \
    if (check(api.GroupEnd(), "ncclGroupEnd") || failed_)                                          \
      return -1;                                                                                   \
    return 0;                                                                                      \
  } while (0)

int tw_ref_nccl_allgather(tw_ref_nccl_t *n, const void *const *send, void *const *recv,
                          size_t bytes, cudaStream_t *streams) {
  GROUP(api.AllGather(send[i], recv[i], bytes, ncclUint8, n->comms[i], streams[i]));
}

int tw_ref_nccl_reduce_scatter(tw_ref_nccl_t *n, const void *const *send, void *const *recv,
                               size_t count, int bf16, cudaStream_t *streams) {
  GROUP(api.ReduceScatter(send[i], recv[i], count / (size_t)n->world,
                          bf16 ? ncclBfloat16 : ncclFloat32, ncclSum, n->comms[i], streams[i]));
}

int tw_ref_nccl_all_reduce(tw_ref_nccl_t *n, const void *const *send, void *const *recv,
                           size_t count, int bf16, cudaStream_t *streams) {
  GROUP(api.AllReduce(send[i], recv[i], count, bf16 ? ncclBfloat16 : ncclFloat32, ncclSum,
                      n->comms[i], streams[i]));
}

#else /* built without nccl.h: no NCCL baselines, every entry point says why */

static const char no_nccl[] = "NCCL baselines unavailable: tilewire was built without nccl.h";

int tw_ref_nccl_available(char *why, size_t why_len) {
  if (why && why_len)
    snprintf(why, why_len, "%s", no_nccl);
  return 0;
}

const char *tw_ref_nccl_error(void) { return no_nccl; }

int tw_ref_nccl_create(tw_ref_nccl_t **out, int world, const int *devices, char *why,
                       size_t why_len) {
  (void)world;
  (void)devices;
  *out = NULL;
  tw_ref_nccl_available(why, why_len);
  return -1;
}

void tw_ref_nccl_destroy(tw_ref_nccl_t *n) { (void)n; }

int tw_ref_nccl_allgather(tw_ref_nccl_t *n, const void *const *send, void *const *recv,
                          size_t bytes, cudaStream_t *streams) {
  (void)n, (void)send, (void)recv, (void)bytes, (void)streams;
  return -1;
}

int tw_ref_nccl_reduce_scatter(tw_ref_nccl_t *n, const void *const *send, void *const *recv,
                               size_t count, int bf16, cudaStream_t *streams) {
  (void)n, (void)send, (void)recv, (void)count, (void)bf16, (void)streams;
  return -1;
}

int tw_ref_nccl_all_reduce(tw_ref_nccl_t *n, const void *const *send, void *const *recv,
                           size_t count, int bf16, cudaStream_t *streams) {
  (void)n, (void)send, (void)recv, (void)count, (void)bf16, (void)streams;
  return -1;
}
#endif
