#include "ref/ref_collectives.h"

extern "C" cudaError_t tw_ref_allgather_memcpy(int world, const void *const *send,
                                               void *const *recv, size_t bytes,
                                               cudaStream_t *streams, cudaEvent_t *events) {
  cudaError_t err = cudaSuccess;
  for (int r = 0; r < world && err == cudaSuccess; r++)
    for (int k = 0; k < world && err == cudaSuccess; k++) {
      int p = (r + k) % world; /* staggered so ranks do not all hit one peer at once */
      err = cudaMemcpyAsync((char *)recv[p] + (size_t)r * bytes, send[r], bytes,
                            cudaMemcpyDeviceToDevice, streams[r]);
    }
  return err == cudaSuccess ? tw_ref_cross_wait(world, streams, events) : err;
}

extern "C" cudaError_t tw_ref_cross_wait(int world, cudaStream_t *streams, cudaEvent_t *events) {
  cudaError_t err = cudaSuccess;
  for (int r = 0; r < world && err == cudaSuccess; r++)
    err = cudaEventRecord(events[r], streams[r]);
  for (int r = 0; r < world && err == cudaSuccess; r++)
    for (int p = 0; p < world && err == cudaSuccess; p++)
      if (p != r)
        err = cudaStreamWaitEvent(streams[r], events[p], 0);
  return err;
}
