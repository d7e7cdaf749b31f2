/*
 * Where an op's kernel runs (comm.h: tw_launch_begin / tw_launch_end): the caller's stream, or
 * for ranks that share a GPU the rank's own stream joined to the caller's by events; and the
 * TW_TRACE / TW_WATCHDOG_S hooks that follow every launch.
 */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "runtime/comm.h"
#include "runtime/cuda_check.h"
#include "runtime/trace.h"

tw_status_t tw_launch_begin(tw_comm_t comm, tw_stream_t user, cudaStream_t *launch) {
  if (!comm->launch_stream) {
    *launch = (cudaStream_t)user;
    return TW_SUCCESS;
  }
  tw_status_t st = tw_cuda_check(cudaEventRecord(comm->launch_in, (cudaStream_t)user),
                                 "cudaEventRecord(stream)");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaStreamWaitEvent(comm->launch_stream, comm->launch_in, 0),
                       "cudaStreamWaitEvent(rank stream)");
  *launch = comm->launch_stream;
  return st;
}

/* Host callback (no CUDA calls): the comm itself is the argument, so graph replays of a
 * captured call print too; the stream orders the copy before it. With the rows in host-mapped
 * memory (TW_WATCHDOG_S) the callback copies and clears them itself: the kernel's writes are
 * visible once it has completed, and the stream's next work waits for the callback. */
static void CUDART_CB trace_print(void *p) {
  tw_comm_t comm = (tw_comm_t)p;
  char line[768];
  if (comm->trace_live) {
    memcpy(comm->trace_host, comm->trace_live, TW_TRACE_BYTES);
    memset(comm->trace_live, 0, TW_TRACE_BYTES);
  }
  ++comm->trace_calls;
  if (comm->trace_print &&
      tw_trace_format(comm->trace_host, comm->rank, comm->trace_calls, line, sizeof(line)))
    fprintf(stderr, "%s\n", line);
  __atomic_fetch_add(&comm->calls_done, 1, __ATOMIC_RELEASE);
}

/* TW_TRACE: copy the kernel's trace out, clear it, print it when the stream gets there. */
static tw_status_t trace_after(tw_comm_t comm, cudaStream_t s) {
  tw_status_t st = TW_SUCCESS;
  if (!comm->trace_live) {
    st = tw_cuda_check(cudaMemcpyAsync(comm->trace_host, comm->dev.trace, TW_TRACE_BYTES,
                                       cudaMemcpyDeviceToHost, s),
                       "TW_TRACE: cudaMemcpyAsync");
    if (st == TW_SUCCESS)
      st = tw_cuda_check(cudaMemsetAsync(comm->dev.trace, 0, TW_TRACE_BYTES, s),
                         "TW_TRACE: cudaMemsetAsync");
  }
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaLaunchHostFunc(s, trace_print, comm), "TW_TRACE: cudaLaunchHostFunc");
  return st;
}

tw_status_t tw_launch_end(tw_comm_t comm, tw_stream_t user) {
  if (comm->dev.trace) {
    __atomic_fetch_add(&comm->calls_enqueued, 1, __ATOMIC_RELEASE);
    tw_status_t st =
        trace_after(comm, comm->launch_stream ? comm->launch_stream : (cudaStream_t)user);
    if (st != TW_SUCCESS)
      return st;
  }
  if (!comm->launch_stream)
    return TW_SUCCESS;
  tw_status_t st = tw_cuda_check(cudaEventRecord(comm->launch_out, comm->launch_stream),
                                 "cudaEventRecord(rank stream)");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaStreamWaitEvent((cudaStream_t)user, comm->launch_out, 0),
                       "cudaStreamWaitEvent(stream)");
  return st;
}

/* On `device`: a non-blocking stream and two events without timing (a side stream and the
 * events that order it against the user's stream). */
static tw_status_t make_stream_events(int device, cudaStream_t *stream, cudaEvent_t *in,
                                      cudaEvent_t *out, const char *what) {
  int prev;
  tw_status_t st = tw_set_device(device, &prev);
  if (st != TW_SUCCESS)
    return st;
  st = tw_cuda_check(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking), what);
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaEventCreateWithFlags(in, cudaEventDisableTiming), "cudaEventCreate");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaEventCreateWithFlags(out, cudaEventDisableTiming), "cudaEventCreate");
  cudaSetDevice(prev);
  return st;
}

/* Kernels of ranks sharing a GPU wait on each other: each rank gets its own stream,
 * made one after another so that they land on distinct hardware queues (two
 * streams on one queue serialise, and a waiting kernel would block its peer). */
tw_status_t tw_make_launch_streams(tw_comm_t *comms, int world) {
  tw_status_t st = TW_SUCCESS;
  for (int r = 0; r < world && st == TW_SUCCESS; r++) {
    tw_comm_t c = comms[r];
    if (c->ranks_on_device >= 2)
      st = make_stream_events(c->device, &c->launch_stream, &c->launch_in, &c->launch_out,
                              "cudaStreamCreate(rank stream)");
  }
  return st;
}

tw_status_t tw_comm_ce_stream(tw_comm_t comm) {
  if (comm->ce_stream)
    return TW_SUCCESS;
  return make_stream_events(comm->device, &comm->ce_stream, &comm->ce_in, &comm->ce_done,
                            "cudaStreamCreate(copy-engine stream)");
}
