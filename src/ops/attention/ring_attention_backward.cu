/*
 * tw_ring_attention_backward (contract in tilewire.h): the arguments checked (ring_check for
 * the comm and shapes, then every pointer: the symmetric ones inside this rank's heap), the
 * kernels' parameters (ring_params for the dq side, the peers' q, dout, lse and dsum for the
 * dkdv side), the call description, and three launches on the rank's launch stream:
 * dsum_kernel, ring_dkdv_kernel, ring_dq_kernel (ring_attention_bwd.cuh).
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ops/attention/attention_args.h"
#include "ops/attention/ring_attention_bwd.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/argcheck.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "runtime/registry.h"
}

using namespace tw::attn;

namespace {

const char *const kOp = "tw_ring_attention_backward";
const char *const kNames[10] = {"q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "workspace"};

static_assert(sizeof(tw_dev_comm_t) + sizeof(RingBwdParams) <= 32764, "kernel parameters");

template <int D> cudaError_t preload_one() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, (const void *)ring_dkdv_kernel<D>);
  return e == cudaSuccess ? cudaFuncGetAttributes(&attr, (const void *)ring_dq_kernel<D>) : e;
}

tw_status_t ring_backward_preload(void) {
  cudaError_t e = preload_one<64>();
  if (e == cudaSuccess)
    e = preload_one<128>();
  return tw_cuda_check(e, "loading the ring attention backward's kernels");
}

/* Its calls are described on TW_CH_ATTN by tw_ring_attention's registration (ring_calls). */
const tw_op_desc_t ring_backward_registration = {"ring_attention_backward", ring_backward_preload};

/* The forward's arguments of this backward (for ring_check, ring_params, ring_call_fields). */
tw_ring_attention_args_t forward_args(const tw_ring_attention_backward_args_t &a) {
  tw_ring_attention_args_t f = TW_RING_ATTENTION_ARGS_INIT;
  f.causal = a.causal;
  f.q = a.q, f.k = a.k, f.v = a.v;
  f.lse = (float *)a.lse;
  f.batch = a.batch, f.heads_q = a.heads_q, f.heads_kv = a.heads_kv;
  f.seq_local = a.seq_local, f.head_dim = a.head_dim;
  f.softmax_scale = a.softmax_scale;
  f.layout = a.layout;
  f.sm_count = a.sm_count;
  return f;
}

/* Across nodes, `gathered`'s regions, in order: q, k, v, dout, lse, dsum (world slots each; the
 * bytes of this rank's tensor in bytes[], a slot rounded up to 16). */
enum { kRegions = 6 };
void region_bytes(const tw_ring_attention_backward_args_t &a, size_t bytes[kRegions]) {
  const size_t q_bytes = (size_t)(a.batch * a.seq_local * a.heads_q * a.head_dim) * 2;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_local * a.heads_kv * a.head_dim) * 2;
  const size_t rows_bytes = (size_t)(a.batch * a.heads_q * a.seq_local) * 4;
  const size_t b[kRegions] = {q_bytes, kv_bytes, kv_bytes, q_bytes, rows_bytes, rows_bytes};
  memcpy(bytes, b, sizeof(b));
}

/* Region i of `gathered` on a comm of `world` ranks (ring_gather's layout), and its whole size. */
uint8_t *region_at(const tw_ring_attention_backward_args_t &a, int world, int i) {
  size_t bytes[kRegions];
  region_bytes(a, bytes);
  return (uint8_t *)a.gathered + ring_region_off(world, bytes, i);
}

size_t gathered_size(const tw_ring_attention_backward_args_t &a, int world) {
  size_t bytes[kRegions];
  region_bytes(a, bytes);
  return ring_region_off(world, bytes, kRegions);
}

/* Every pointer set and aligned (16 bytes; lse and workspace 4); q, k, v, dout, lse and
 * workspace inside one symmetric allocation of this rank each, o, dq, dk, dv device memory of
 * the comm's device; the outputs (dq, dk, dv, workspace) overlapping no input nor each other. */
tw_status_t check_pointers(tw_comm_t comm, const tw_ring_attention_backward_args_t &a) {
  enum { kCount = 10, kInputs = 6 };
  const size_t q_bytes = (size_t)(a.batch * a.seq_local * a.heads_q * a.head_dim) * 2;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_local * a.heads_kv * a.head_dim) * 2;
  const size_t rows_bytes = (size_t)(a.batch * a.heads_q * a.seq_local) * 4;
  const void *const ptrs[kCount] = {a.q,   a.k,  a.v,  a.o,  a.dout,
                                    a.lse, a.dq, a.dk, a.dv, a.workspace};
  const char *const *names = kNames;
  const size_t sizes[kCount] = {q_bytes,    kv_bytes, kv_bytes, q_bytes,  q_bytes,
                                rows_bytes, q_bytes,  kv_bytes, kv_bytes, rows_bytes};
  const bool symmetric[kCount] = {true, true, true, false, true, true, false, false, false, true};
  char what[112];
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < kCount && st == TW_SUCCESS; i++) {
    const int align = i == 5 || i == 9 ? 4 : 16;
    if (!ptrs[i])
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s is NULL", kOp, names[i]);
    if ((uintptr_t)ptrs[i] % align)
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: %s (%p) is not %d-byte aligned", kOp, names[i],
                     ptrs[i], align);
    snprintf(what, sizeof(what),
             symmetric[i] ? "%s: %s (must be symmetric memory: tw_mem_alloc of this comm)"
                          : "%s: %s",
             kOp, names[i]);
    st = symmetric[i] ? tw_heap_lookup(comm, ptrs[i], sizes[i], what, NULL)
                      : tw_comm_check_range(comm, ptrs[i], sizes[i], what);
  }
  for (int out = kInputs; out < kCount && st == TW_SUCCESS; out++)
    for (int other = 0; other < out && st == TW_SUCCESS; other++) {
      snprintf(what, sizeof(what), "%s: %s", kOp, names[out]);
      st = tw_check_disjoint(ptrs[out], sizes[out], what, ptrs[other], sizes[other], names[other]);
    }
  return st;
}

/* Rank r's address of a symmetric pointer of this rank (this rank's own for r == rank). */
const void *peer_of(tw_comm_t comm, const void *ptr, int r) {
  return r == comm->rank ? ptr : tw_heap_peer_ptr(comm, ptr, r);
}

/* Every field of the kernels' parameters. */
tw_status_t backward_params(tw_comm_t comm, const tw_ring_attention_backward_args_t &a,
                            RingBwdParams *p) {
  memset(p, 0, sizeof(*p));
  const tw_ring_attention_args_t f = forward_args(a);
  const bool nodes = comm->nodes > 1;
  tw_status_t st = ring_params(comm, f, nodes ? region_at(a, comm->world, 1) : NULL,
                               nodes ? region_at(a, comm->world, 2) : NULL, &p->r);
  if (st == TW_SUCCESS)
    st = operand_map(&p->do_map, a.dout, a.batch, a.seq_local, a.heads_q, a.head_dim,
                     "tw_ring_attention_backward: cuTensorMapEncodeTiled(dout)");
  size_t bytes[kRegions];
  region_bytes(a, bytes);
  const int block_q = a.head_dim == 64 ? kBwdBlockQ<64> : kBwdBlockQ<128>; /* dkdv's Q boxes */
  for (int r = 0; r < comm->world && st == TW_SUCCESS; r++) {
    const void *q = peer_of(comm, a.q, r), *dout = peer_of(comm, a.dout, r);
    p->lse[r] = (const float *)peer_of(comm, a.lse, r);
    p->dsum[r] = (const float *)peer_of(comm, a.workspace, r);
    if (r != comm->rank && comm->node_of[r] != comm->node) { /* its copies gathered here */
      const int at[4] = {0, 3, 4, 5};
      const void **dst[4] = {&q, &dout, (const void **)&p->lse[r], (const void **)&p->dsum[r]};
      for (int i = 0; i < 4; i++)
        *dst[i] = region_at(a, comm->world, at[i]) + (size_t)r * ring_slot(bytes[at[i]]);
    }
    if (!q || !dout || !p->lse[r] || !p->dsum[r])
      return tw_fail(TW_ERR_NOT_SUPPORTED,
                     "%s: rank %d's q / dout / lse / workspace is not mapped here", kOp, r);
    st = operand_map(&p->q64_maps[r], q, a.batch, a.seq_local, a.heads_q, a.head_dim,
                     "tw_ring_attention_backward: cuTensorMapEncodeTiled(q of a peer)", block_q);
    if (st == TW_SUCCESS)
      st = operand_map(&p->do64_maps[r], dout, a.batch, a.seq_local, a.heads_q, a.head_dim,
                       "tw_ring_attention_backward: cuTensorMapEncodeTiled(dout of a peer)",
                       block_q);
  }
  if (st != TW_SUCCESS)
    return st;
  BwdParams &b = p->b;
  b.o = (const __nv_bfloat16 *)a.o;
  b.dout = (const __nv_bfloat16 *)a.dout;
  b.lse = a.lse;
  b.dsum = a.workspace;
  b.dq = (__nv_bfloat16 *)a.dq;
  b.dk = (__nv_bfloat16 *)a.dk;
  b.dv = (__nv_bfloat16 *)a.dv;
  b.batch = (int32_t)a.batch;
  b.heads_q = (int32_t)a.heads_q;
  b.heads_kv = (int32_t)a.heads_kv;
  b.seq_q = b.seq_kv = (int32_t)a.seq_local;
  b.group = (int32_t)(a.heads_q / a.heads_kv);
  b.causal = a.causal;
  b.scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / sqrtf((float)a.head_dim);
  b.scale_log2 = b.scale * 1.4426950408889634f;
  b.timeout_ns = kTimeoutDefaultNs;
  p->num_kv_tiles = (int32_t)(p->r.a.m_tiles * a.heads_kv * a.batch);
  return TW_SUCCESS;
}

template <int D>
tw_status_t backward_launch(tw_comm_t comm, const tw_ring_attention_backward_args_t &a, int sms,
                            cudaStream_t launch, bool dsum) {
  RingBwdParams p;
  tw_status_t st = backward_params(comm, a, &p);
  static uint64_t dkdv_configured, dq_configured; /* a bit per device */
  if (st == TW_SUCCESS)
    st = tw_kernel_smem_once((const void *)ring_dkdv_kernel<D>, DkvSmem<D>::kDynamicBytes,
                             &dkdv_configured,
                             "tw_ring_attention_backward: cudaFuncSetAttribute"
                             "(dkdv shared memory)");
  if (st == TW_SUCCESS)
    st = tw_kernel_smem_once((const void *)ring_dq_kernel<D>, DqSmem<D>::kDynamicBytes,
                             &dq_configured,
                             "tw_ring_attention_backward: cudaFuncSetAttribute"
                             "(dq shared memory)");
  if (st != TW_SUCCESS)
    return st;
  if (dsum) {
    dsum_kernel<D><<<dsum_grid(a.batch * a.seq_local * a.heads_q, sms), 256, 0, launch>>>(p.b);
    if ((st = tw_cuda_check(cudaGetLastError(), "tw_ring_attention_backward: dsum launch")) !=
        TW_SUCCESS)
      return st;
  }
  void *params[2] = {(void *)&comm->dev, (void *)&p};
  const int kv_grid = p.num_kv_tiles < sms ? p.num_kv_tiles : sms;
  st = tw_cuda_check(cudaLaunchKernel((const void *)ring_dkdv_kernel<D>, dim3(kv_grid),
                                      dim3(kThreads), params, (size_t)DkvSmem<D>::kDynamicBytes,
                                      launch),
                     "tw_ring_attention_backward: dkdv launch");
  const int q_grid = p.r.a.num_tiles < sms ? p.r.a.num_tiles : sms;
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaLaunchKernel((const void *)ring_dq_kernel<D>, dim3(q_grid),
                                        dim3(kThreads), params, (size_t)DqSmem<D>::kDynamicBytes,
                                        launch),
                       "tw_ring_attention_backward: dq launch");
  return st;
}

/* Inside one node the call's kernels are dsum, dkdv and dq; across nodes dsum ran before the
 * gathers (its output is gathered too). */
tw_status_t launch_any(tw_comm_t comm, const void *args, int64_t head_dim, int sms,
                       cudaStream_t on) {
  const tw_ring_attention_backward_args_t &a = *(const tw_ring_attention_backward_args_t *)args;
  const bool dsum = comm->nodes == 1;
  return head_dim == 128 ? backward_launch<128>(comm, a, sms, on, dsum)
                         : backward_launch<64>(comm, a, sms, on, dsum);
}

/* Across nodes: dsum on `stream`, then every tensor the peers read gathered into `gathered`. */
template <int D>
tw_status_t dsum_and_gather(tw_comm_t comm, const tw_ring_attention_backward_args_t &a,
                            tw_stream_t stream) {
  BwdParams b;
  memset(&b, 0, sizeof(b));
  b.o = (const __nv_bfloat16 *)a.o, b.dout = (const __nv_bfloat16 *)a.dout, b.dsum = a.workspace;
  b.batch = (int32_t)a.batch, b.heads_q = (int32_t)a.heads_q, b.seq_q = (int32_t)a.seq_local;
  int prev = 0;
  tw_status_t st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return st;
  const int sms = a.sm_count > 0 ? a.sm_count : comm->sm_budget;
  dsum_kernel<D>
      <<<dsum_grid(a.batch * a.seq_local * a.heads_q, sms), 256, 0, (cudaStream_t)stream>>>(b);
  st = tw_cuda_check(cudaGetLastError(), "tw_ring_attention_backward: dsum launch");
  cudaSetDevice(prev);
  const void *src[kRegions] = {a.q, a.k, a.v, a.dout, a.lse, a.workspace};
  size_t bytes[kRegions];
  region_bytes(a, bytes);
  return st == TW_SUCCESS ? ring_gather(comm, kOp, a.gathered, kRegions, src, bytes, stream) : st;
}

} // namespace

TW_OP_REGISTER(ring_attention_backward, ring_backward_registration);

extern "C" tw_status_t
tw_ring_attention_backward_args_init(tw_ring_attention_backward_args_t *args) {
  if (!args)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_ring_attention_backward_args_init: args is NULL");
  const tw_ring_attention_backward_args_t init = TW_RING_ATTENTION_BACKWARD_ARGS_INIT;
  memset(args, 0, sizeof(*args)); /* the padding too */
  memcpy(args, &init,
         offsetof(tw_ring_attention_backward_args_t, gathered) + sizeof(init.gathered));
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_ring_attention_backward_gathered_bytes(tw_comm_t comm, int64_t batch,
                                                                 int64_t heads_q, int64_t heads_kv,
                                                                 int64_t seq_local,
                                                                 int64_t head_dim, size_t *bytes) {
  const char *op = "tw_ring_attention_backward_gathered_bytes";
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return st;
  if (!bytes)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: bytes is NULL", op));
  tw_ring_attention_backward_args_t a = TW_RING_ATTENTION_BACKWARD_ARGS_INIT;
  a.batch = batch, a.heads_q = heads_q, a.heads_kv = heads_kv, a.seq_local = seq_local;
  a.head_dim = head_dim, a.layout = TW_RING_CONTIGUOUS;
  st = ring_check(comm, op, forward_args(a));
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  *bytes = comm->nodes > 1 ? gathered_size(a, comm->world) : 0;
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_ring_attention_backward(tw_comm_t comm,
                                                  const tw_ring_attention_backward_args_t *args,
                                                  tw_stream_t stream) {
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_ring_attention_backward_args_t a = TW_RING_ATTENTION_BACKWARD_ARGS_INIT;
  st = tw_args_copy(args, &a, sizeof(a), offsetof(tw_ring_attention_backward_args_t, sm_count), kOp,
                    "tw_ring_attention_backward_args_t", "TW_RING_ATTENTION_BACKWARD_ARGS_INIT");
  const tw_ring_attention_args_t f = forward_args(a);
  if (st == TW_SUCCESS)
    st = ring_check(comm, kOp, f);
  if (st == TW_SUCCESS)
    st = check_pointers(comm, a);
  if (st == TW_SUCCESS) {
    const void *others[10] = {a.q, a.k, a.v, a.o, a.dout, a.lse, a.dq, a.dk, a.dv, a.workspace};
    size_t r[kRegions], q_bytes, other_bytes[10];
    region_bytes(a, r);
    q_bytes = r[0];
    const size_t sizes[10] = {q_bytes, r[1],    r[1], q_bytes, q_bytes,
                              r[4],    q_bytes, r[1], r[1],    r[5]};
    memcpy(other_bytes, sizes, sizeof(sizes));
    st = ring_check_gathered(comm, kOp, a.gathered, gathered_size(a, comm->world), 10, others,
                             other_bytes, kNames);
  }
  if (st == TW_SUCCESS && comm->nodes > 1)
    st = a.head_dim == 128 ? dsum_and_gather<128>(comm, a, stream)
                           : dsum_and_gather<64>(comm, a, stream);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const void *const bwd[4] = {a.q, a.dout, a.lse, a.workspace};
  uint64_t fields[8];
  ring_call_fields(comm, 1, f, bwd, fields);
  return ring_run(comm, stream, fields, a.sm_count, a.head_dim, launch_any, &a);
}
