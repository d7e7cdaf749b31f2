/*
 * NCCL baselines for tests and benchmarks (not in libtilewire), loaded at run
 * time with dlopen: tw-bench and the tests run where libnccl is absent, and
 * where it is present (e.g. the copy a PyTorch install ships) they gain the
 * NCCL rows. Ranks on distinct GPUs of this process only (NCCL refuses two ranks
 * on one GPU in one process). TW_NCCL_LIB names the library file; default
 * "libnccl.so.2" through the loader's path.
 */
#ifndef TW_REF_NCCL_H
#define TW_REF_NCCL_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_ref_nccl tw_ref_nccl_t;

/* 1 if libnccl could be loaded and every entry point resolved; else 0 and `why` says why. */
int tw_ref_nccl_available(char *why, size_t why_len);

/* One NCCL comm per rank (ncclCommInitAll over devices[0..world)); the devices must be
 * distinct. Returns 0, or -1 with the reason in `why`. */
int tw_ref_nccl_create(tw_ref_nccl_t **out, int world, const int *devices, char *why,
                       size_t why_len);
void tw_ref_nccl_destroy(tw_ref_nccl_t *nccl);

/* AllGather of `bytes` per rank: recv[r] + p * bytes <- send[p] for all r, p, rank r on
 * streams[r], inside one NCCL group. */
int tw_ref_nccl_allgather(tw_ref_nccl_t *nccl, const void *const *send, void *const *recv,
                          size_t bytes, cudaStream_t *streams);
/* Sums (fp32, or bf16 when `bf16`): ReduceScatter (recv[r] gets count / world elements of
 * rank r's block) and AllReduce (recv[r] gets all `count`). */
int tw_ref_nccl_reduce_scatter(tw_ref_nccl_t *nccl, const void *const *send, void *const *recv,
                               size_t count, int bf16, cudaStream_t *streams);
int tw_ref_nccl_all_reduce(tw_ref_nccl_t *nccl, const void *const *send, void *const *recv,
                           size_t count, int bf16, cudaStream_t *streams);
/* Message of the last failure of the calls above. */
const char *tw_ref_nccl_error(void);

#ifdef __cplusplus
}
#endif
#endif
