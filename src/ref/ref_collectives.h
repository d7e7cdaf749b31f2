/*
 * Unfused reference collectives for tests and benchmarks (not in libtilewire):
 * copy-engine (cudaMemcpyAsync) versions for ranks in one process, virtual or
 * on distinct GPUs, and NCCL versions for ranks on distinct GPUs.
 */
#ifndef TW_REF_COLLECTIVES_H
#define TW_REF_COLLECTIVES_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* AllGather among `world` ranks of this process: recv[p] + r * bytes <- send[r]
 * for every r, p, by cudaMemcpyAsync on each source rank's stream; then every
 * stream waits for every other (events[r] recorded on streams[r]), so each
 * rank's stream is ordered after all data landed. Returns the first error. */
cudaError_t tw_ref_allgather_memcpy(int world, const void *const *send, void *const *recv,
                                    size_t bytes, cudaStream_t *streams, cudaEvent_t *events);

/* Every rank's stream waits for everything enqueued so far on every other (events[r] is
 * recorded on streams[r]). Returns the first error. */
cudaError_t tw_ref_cross_wait(int world, cudaStream_t *streams, cudaEvent_t *events);

#ifdef __cplusplus
}
#endif
#endif
