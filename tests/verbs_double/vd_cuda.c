/*
 * CUDA device memory, for MRs that register it. libcuda is loaded lazily by dlopen (the double
 * links neither libcuda nor the runtime; without libcuda.so.1, or without a GPU, every MR is
 * host memory). Copies that touch device memory go on a non-blocking stream of the engine thread,
 * synchronized before the copy counts as placed: never the legacy default stream, which would
 * wait on a persistent kernel that runs while the NIC writes.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vd.h"

#define VD_CU_MAX_DEV 64

typedef CUresult (*pfn_init)(unsigned int);
typedef CUresult (*pfn_ptr_attr)(void *, CUpointer_attribute, CUdeviceptr);
typedef CUresult (*pfn_dev_get)(CUdevice *, int);
typedef CUresult (*pfn_ctx_retain)(CUcontext *, CUdevice);
typedef CUresult (*pfn_ctx_release)(CUdevice);
typedef CUresult (*pfn_ctx_set)(CUcontext);
typedef CUresult (*pfn_stream_create)(CUstream *, unsigned int);
typedef CUresult (*pfn_stream_destroy)(CUstream);
typedef CUresult (*pfn_memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*pfn_stream_sync)(CUstream);
typedef CUresult (*pfn_host_register)(void *, size_t, unsigned int);

static struct {
  int ok;
  pfn_init init;
  pfn_ptr_attr ptr_attr;
  pfn_dev_get dev_get;
  pfn_ctx_retain ctx_retain;
  pfn_ctx_release ctx_release;
  pfn_ctx_set ctx_set;
  pfn_stream_create stream_create;
  pfn_stream_destroy stream_destroy;
  pfn_memcpy_async memcpy_async;
  pfn_stream_sync stream_sync;
  pfn_host_register host_register;
} g_cu;
static pthread_once_t g_cu_once = PTHREAD_ONCE_INIT;

struct vd_cuda_engine {
  CUcontext ctx[VD_CU_MAX_DEV];
  CUstream stream[VD_CU_MAX_DEV];
  int failed[VD_CU_MAX_DEV];
  CUcontext current;
};

/* dlsym takes the exported names: plain ones where the plain name is the current ABI (the
 * non-per-thread-stream variants), _v2 where only that is current (cuStreamDestroy,
 * cuDevicePrimaryCtxRelease, cuMemHostRegister). */
static void cu_load(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h)
    return;
  g_cu.init = (pfn_init)dlsym(h, "cuInit");
  g_cu.ptr_attr = (pfn_ptr_attr)dlsym(h, "cuPointerGetAttribute");
  g_cu.dev_get = (pfn_dev_get)dlsym(h, "cuDeviceGet");
  g_cu.ctx_retain = (pfn_ctx_retain)dlsym(h, "cuDevicePrimaryCtxRetain");
  g_cu.ctx_release = (pfn_ctx_release)dlsym(h, "cuDevicePrimaryCtxRelease_v2");
  g_cu.ctx_set = (pfn_ctx_set)dlsym(h, "cuCtxSetCurrent");
  g_cu.stream_create = (pfn_stream_create)dlsym(h, "cuStreamCreate");
  g_cu.stream_destroy = (pfn_stream_destroy)dlsym(h, "cuStreamDestroy_v2");
  g_cu.memcpy_async = (pfn_memcpy_async)dlsym(h, "cuMemcpyAsync");
  g_cu.stream_sync = (pfn_stream_sync)dlsym(h, "cuStreamSynchronize");
  g_cu.host_register = (pfn_host_register)dlsym(h, "cuMemHostRegister_v2"); /* optional */
  if (!g_cu.init || !g_cu.ptr_attr || !g_cu.dev_get || !g_cu.ctx_retain || !g_cu.ctx_set ||
      !g_cu.stream_create || !g_cu.memcpy_async || !g_cu.stream_sync) {
    fprintf(stderr, "tw-verbs-double: libcuda.so.1 lacks a driver entry point; device memory "
                    "is not supported\n");
    return; /* the handle stays open: harmless, and dlclose could race other users */
  }
  if (g_cu.init(0) != CUDA_SUCCESS)
    return; /* no GPU: everything is host memory */
  g_cu.ok = 1;
}

int vd_cuda_classify(const void *addr) {
  pthread_once(&g_cu_once, cu_load);
  if (!g_cu.ok)
    return -1;
  unsigned int type = 0;
  CUresult r = g_cu.ptr_attr(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)addr);
  if (r != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE)
    return -1; /* pageable, pinned host or unknown to CUDA: the CPU can copy it */
  int ordinal = -1;
  r = g_cu.ptr_attr(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)(uintptr_t)addr);
  if (r != CUDA_SUCCESS || ordinal < 0 || ordinal >= VD_CU_MAX_DEV) {
    fprintf(stderr,
            "tw-verbs-double: device memory %p: no usable device ordinal (%d); "
            "assuming device 0\n",
            addr, (int)r);
    ordinal = 0;
  }
  return ordinal;
}

/* One copy stream per device for the whole process, shared by every engine thread (copies on it
 * are made one at a time, under g_copy_lock): each stream takes one of the GPU's hardware work
 * queues (CUDA_DEVICE_MAX_CONNECTIONS, at most 32), and a copy whose stream shares a queue with a
 * persistent kernel that waits for the copy would never run. One stream per NIC instance (8
 * ranks x 4 NICs) ran out of queues. */
static CUstream g_stream[VD_CU_MAX_DEV];
static pthread_mutex_t g_copy_lock = PTHREAD_MUTEX_INITIALIZER;

/* The engine's context and the process's stream for a device, created on first use. 0 or -1. */
static int cu_engine_stream(struct vd_ctx *c, int dev, CUstream *out) {
  if (!c->cu) {
    c->cu = calloc(1, sizeof(*c->cu));
    if (!c->cu)
      return -1;
  }
  struct vd_cuda_engine *e = c->cu;
  if (e->failed[dev])
    return -1;
  if (!e->stream[dev]) {
    CUdevice d;
    CUresult r = g_cu.dev_get(&d, dev);
    if (r == CUDA_SUCCESS)
      r = g_cu.ctx_retain(&e->ctx[dev], d);
    if (r == CUDA_SUCCESS)
      r = g_cu.ctx_set(e->ctx[dev]);
    if (r == CUDA_SUCCESS) {
      e->current = e->ctx[dev];
      vd_lock(&g_copy_lock);
      if (!g_stream[dev])
        r = g_cu.stream_create(&g_stream[dev], CU_STREAM_NON_BLOCKING);
      e->stream[dev] = g_stream[dev];
      pthread_mutex_unlock(&g_copy_lock);
    }
    if (r != CUDA_SUCCESS) {
      fprintf(stderr, "tw-verbs-double: CUDA setup for device %d failed (CUresult %d)\n", dev,
              (int)r);
      e->failed[dev] = 1;
      e->stream[dev] = NULL;
      return -1;
    }
  }
  if (e->current != e->ctx[dev]) {
    if (g_cu.ctx_set(e->ctx[dev]) != CUDA_SUCCESS)
      return -1;
    e->current = e->ctx[dev];
  }
  *out = e->stream[dev];
  return 0;
}

int vd_copy(struct vd_ctx *c, void *dst, int dst_dev, const void *src, int src_dev, size_t n) {
  if (n == 0)
    return 0;
  if (dst_dev < 0 && src_dev < 0) {
    memcpy(dst, src, n);
    return 0;
  }
  if (!g_cu.ok)
    return -1;
  CUstream s;
  if (cu_engine_stream(c, dst_dev >= 0 ? dst_dev : src_dev, &s) != 0)
    return -1;
  vd_lock(&g_copy_lock);
  CUresult r = g_cu.memcpy_async((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n, s);
  if (r == CUDA_SUCCESS)
    r = g_cu.stream_sync(s);
  pthread_mutex_unlock(&g_copy_lock);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "tw-verbs-double: cuMemcpyAsync(%p <- %p, %zu) failed (CUresult %d)\n", dst,
            src, n, (int)r);
    return -1;
  }
  return 0;
}

void vd_cuda_engine_free(struct vd_ctx *c) {
  struct vd_cuda_engine *e = c->cu;
  if (!e)
    return;
  for (int d = 0; d < VD_CU_MAX_DEV; d++) {
    if (!e->stream[d])
      continue; /* the stream is the process's: it lives as long as the library */
    CUdevice dev;
    if (g_cu.ctx_release && g_cu.dev_get(&dev, d) == CUDA_SUCCESS)
      g_cu.ctx_release(dev);
  }
  free(e);
  c->cu = NULL;
}

/* Per process: 0 not tried, 1 pinned, 2 failed (copies then use pageable staging) */
static pthread_mutex_t g_pin_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic unsigned char g_pin[VD_MAX_PORTS];

void vd_cuda_pin_ring(struct vd_ctx *c, uint32_t slot, int dev) {
  if (!g_cu.ok || !g_cu.host_register || slot >= VD_MAX_PORTS || dev < 0 ||
      atomic_load_explicit(&g_pin[slot], memory_order_acquire))
    return;
  CUstream s;
  if (cu_engine_stream(c, dev, &s) != 0) /* a current context for the registration */
    return;
  vd_lock(&g_pin_lock);
  if (!atomic_load(&g_pin[slot])) {
    char *data;
    vd_port_ring(slot, 0, &data);
    vd_port_mark_pinned(slot); /* before pinning: the owner must not discard the pages after */
    CUresult r = g_cu.host_register(data, VD_DATA_RING, CU_MEMHOSTREGISTER_PORTABLE);
    if (r != CUDA_SUCCESS)
      fprintf(stderr,
              "tw-verbs-double: cuMemHostRegister(inbox of port slot %u) failed "
              "(CUresult %d): CUDA copies through it are staged\n",
              slot, (int)r);
    atomic_store_explicit(&g_pin[slot], r == CUDA_SUCCESS ? 1 : 2, memory_order_release);
  }
  vd_unlock(&g_pin_lock);
}
