/*
 * Unfused reductions of GEMM partials for tests and benchmarks (not in
 * libtilewire): the second half of the unfused GEMM+ReduceScatter and
 * GEMM+AllReduce pipelines (tw_gemm with fp32 output on every rank, or bf16
 * output for tw_gemm_rs's TW_PARTIALS_BF16, then these). partial_bytes: 4 (fp32
 * partials) or 2 (bf16 partials); the sum is fp32 either way.
 *
 * The in-process versions sum in rank order (acc = p[0]; acc += p[1]; ...; in
 * fp32, then round to bf16), the order tw_gemm_rs / tw_gemm_ar promise, so the
 * fused result equals them bitwise. They serve ranks of one process, virtual
 * (one GPU) or on distinct GPUs, reading peers through the peer pointers of a
 * symmetric buffer (tw_mem_peer_ptr). The NCCL version (loaded at run time, ranks on
 * distinct GPUs) reduces in NCCL's order: a timing baseline, not bitwise.
 */
#ifndef TW_REF_REDUCE_H
#define TW_REF_REDUCE_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "ref/ref_nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * ReduceScatter among `world` ranks of this process. partial_peers[r * world + s]
 * is rank s's fp32 partial [m, n] (leading dimension n) as reachable from rank r's
 * device. out[r] (bf16 [m / world, n], leading dimension ldo) receives rows
 * [r * m / world, (r + 1) * m / world) of the rank-ordered sum. Each rank's stream
 * first waits for every rank's stream (the partials are complete), runs the reduce
 * kernel on at most `max_ctas` CTAs (0: 132), and then every stream waits for every
 * reduce, so the partials may be overwritten by whatever follows on any stream.
 * events[r] are per-rank events (recorded on streams[r]). Returns the first error.
 */
cudaError_t tw_ref_reduce_scatter(int world, const void *const *partial_peers, int partial_bytes,
                                  void *const *out, int64_t m, int64_t n, int64_t ldo, int max_ctas,
                                  cudaStream_t *streams, cudaEvent_t *events);

/*
 * AllReduce, as a reduce-scatter whose rows are pushed to every rank:
 * out_peers[r * world + p] is rank p's output [m, n] (bf16, leading dimension ldo,
 * a symmetric buffer) as reachable from rank r; rank r sums its m / world rows and
 * writes them into every rank's output. Same stream ordering as above.
 */
cudaError_t tw_ref_all_reduce(int world, const void *const *partial_peers, int partial_bytes,
                              void *const *out_peers, int64_t m, int64_t n, int64_t ldo,
                              int max_ctas, cudaStream_t *streams, cudaEvent_t *events);

/*
 * One rank's share, for one process per rank (no cross-stream ordering: the caller
 * puts tw_barrier before it, so the partials are complete, and after it, before
 * anything overwrites them). partial_peers[s]: rank s's partial mapped for this
 * rank. Reduce-scatter: outs[0] is this rank's [m / world, n]. All-reduce
 * (all_reduce = 1): outs[p] is rank p's symmetric [m, n] mapped for this rank.
 */
cudaError_t tw_ref_reduce_rank(int world, int rank, const void *const *partial_peers,
                               int partial_bytes, void *const *outs, int all_reduce, int64_t m,
                               int64_t n, int64_t ldo, int max_ctas, cudaStream_t stream);

/* NCCL (ranks on distinct GPUs of this process, ref_nccl.h): ncclReduceScatter
 * (all_reduce: ncclAllReduce) of every rank's fp32 partial[r] [m, n] into scratch[r]
 * (fp32, [m / world, n]; all-reduce: [m, n]) in one NCCL group, then a bf16 conversion
 * into out[r] (leading dimension ldo) on rank r's device (devices[r]). NCCL's summation
 * order: a timing baseline, not bitwise. Returns cudaErrorUnknown on an NCCL failure
 * (tw_ref_nccl_error() says which). */
cudaError_t tw_ref_nccl_reduce_fp32(tw_ref_nccl_t *nccl, int world, const int *devices,
                                    const float *const *partial, float *const *scratch,
                                    void *const *out, int all_reduce, int64_t m, int64_t n,
                                    int64_t ldo, cudaStream_t *streams);

#ifdef __cplusplus
}
#endif
#endif
