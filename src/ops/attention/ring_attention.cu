/*
 * tw_ring_attention: argument checks, the sequence's segments, the per-rank tensor maps of the
 * peers' k and v (their mapped addresses in the symmetric heap), the call description, and the
 * launch of ring_attention_kernel (ring_attention.cuh) on the rank's launch stream.
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ops/attention/attention_args.h"
#include "ops/attention/ring_attention.cuh"

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

constexpr int64_t kMaxSeqLocal = (INT32_MAX - 2 * kBlockM) / kRingMaxWorld;

static_assert(sizeof(tw_dev_comm_t) + sizeof(RingParams) <= 32764, "kernel parameters");

const char *const kOp = "tw_ring_attention";

template <int D> cudaError_t preload_one() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, (const void *)ring_attention_kernel<D>);
}

tw_status_t ring_preload(void) {
  cudaError_t e = preload_one<64>();
  cudaError_t f = preload_one<128>();
  return tw_cuda_check(e != cudaSuccess ? e : f, "loading the ring attention kernels");
}

const tw_call_fields_t ring_calls[] = {
    {TW_CH_ATTN,
     "tw_ring_attention",
     {"batch", "heads_q", "heads_kv", "seq_local", "head_dim", "causal | layout << 1",
      "k (heap offset)", "v (heap offset)"}}};

const tw_op_desc_t ring_registration = {"ring_attention", ring_preload, ring_calls, 1};

/* The shapes' contract: TW_ERR_INVALID_ARGUMENT naming the first argument that breaks it. */
tw_status_t check_shapes(const tw_ring_attention_args_t &a) {
  tw_status_t st =
      check_heads(kOp, a.batch, a.heads_q, a.heads_kv, a.head_dim, a.causal, a.softmax_scale);
  if (st != TW_SUCCESS)
    return st;
  if (a.seq_local < 1 || a.seq_local > kMaxSeqLocal)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: seq_local is %lld; expected 1 .. %lld", kOp,
                   (long long)a.seq_local, (long long)kMaxSeqLocal);
  if (a.layout != TW_RING_CONTIGUOUS && a.layout != TW_RING_ZIGZAG)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: layout is %d; expected TW_RING_CONTIGUOUS (0) or TW_RING_ZIGZAG (1)", kOp,
                   (int)a.layout);
  if (a.layout == TW_RING_ZIGZAG && a.seq_local % 2)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: seq_local is %lld; TW_RING_ZIGZAG needs it even (two chunks of "
                   "seq_local / 2)",
                   kOp, (long long)a.seq_local);
  st = check_extent(kOp, "seq_local", "heads_q", a.batch, a.seq_local, a.heads_q, a.head_dim);
  if (st == TW_SUCCESS)
    st = check_extent(kOp, "seq_local", "heads_kv", a.batch, a.seq_local, a.heads_kv, a.head_dim);
  const int64_t m_tiles = (a.seq_local + kBlockM - 1) / kBlockM + 1;
  if (st == TW_SUCCESS && m_tiles * a.heads_q * a.batch > INT32_MAX)
    st = tw_fail(TW_ERR_INVALID_ARGUMENT,
                 "%s: batch x heads_q x the Q tiles is %lld tiles; at most 2^31 - 1", kOp,
                 (long long)(m_tiles * a.heads_q * a.batch));
  return st;
}

/* Pointers: q, o, lse device memory of the comm's device, k and v inside one symmetric
 * allocation of this rank each, o and lse overlapping no input (nor each other). */
tw_status_t check_pointers(tw_comm_t comm, const tw_ring_attention_args_t &a) {
  const size_t q_bytes = (size_t)(a.batch * a.seq_local * a.heads_q * a.head_dim) * 2;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_local * a.heads_kv * a.head_dim) * 2;
  const size_t lse_bytes = (size_t)(a.batch * a.heads_q * a.seq_local) * 4;
  const void *const ptrs[kArgCount] = {a.q, a.k, a.v, a.o, a.lse};
  const size_t bytes[kArgCount] = {q_bytes, kv_bytes, kv_bytes, q_bytes, lse_bytes};
  tw_status_t st = check_aligned(kOp, ptrs);
  char what[96];
  for (int i = 0; i < kArgCount && st == TW_SUCCESS; i++) {
    if (!ptrs[i])
      continue;
    const bool kv = i == kArgK || i == kArgV;
    snprintf(what, sizeof(what),
             kv ? "%s: %s (must be symmetric memory: tw_mem_alloc of this comm)" : "%s: %s", kOp,
             kArgNames[i]);
    st = kv ? tw_heap_lookup(comm, ptrs[i], bytes[i], what, NULL)
            : tw_comm_check_range(comm, ptrs[i], bytes[i], what);
  }
  return st == TW_SUCCESS ? check_outputs_disjoint(kOp, ptrs, bytes) : st;
}

/* Rank r's segments (1 contiguous, 2 zigzag) appended at segs[*n]. */
void rank_segments(const tw_ring_attention_args_t &a, int world, int r, RingSeg *segs, int *n) {
  const int32_t s = (int32_t)a.seq_local;
  if (a.layout == TW_RING_CONTIGUOUS) {
    segs[(*n)++] = RingSeg{r, 0, s, 0, (int64_t)r * s};
    return;
  }
  const int32_t h = s / 2;
  segs[(*n)++] = RingSeg{r, 0, h, 0, (int64_t)r * h};
  segs[(*n)++] = RingSeg{r, h, h, 0, (int64_t)(2 * world - 1 - r) * h};
}

/* Every field of the kernel's parameters: the maps (rank r's k and v at its mapped address),
 * the segments (this rank's Q segments, every rank's KV segments in ring order from this rank). */
template <int D>
tw_status_t ring_params(tw_comm_t comm, const tw_ring_attention_args_t &a, RingParams *p) {
  memset(p, 0, sizeof(*p));
  const int world = comm->world, rank = comm->rank;
  tw_status_t st = operand_map(&p->a.q_map, a.q, a.batch, a.seq_local, a.heads_q, D,
                               "tw_ring_attention: cuTensorMapEncodeTiled(q)");
  for (int r = 0; r < world && st == TW_SUCCESS; r++) {
    const void *k = r == rank ? a.k : tw_heap_peer_ptr(comm, a.k, r);
    const void *v = r == rank ? a.v : tw_heap_peer_ptr(comm, a.v, r);
    if (!k || !v)
      return tw_fail(TW_ERR_NOT_SUPPORTED, "tw_ring_attention: rank %d's k / v is not mapped here",
                     r);
    st = operand_map(&p->k_maps[r], k, a.batch, a.seq_local, a.heads_kv, D,
                     "tw_ring_attention: cuTensorMapEncodeTiled(k of a peer)");
    if (st == TW_SUCCESS)
      st = operand_map(&p->v_maps[r], v, a.batch, a.seq_local, a.heads_kv, D,
                       "tw_ring_attention: cuTensorMapEncodeTiled(v of a peer)");
  }
  if (st != TW_SUCCESS)
    return st;
  rank_segments(a, world, rank, p->q_segs, &p->n_q_segs);
  for (int i = 0; i < world; i++)
    rank_segments(a, world, (rank + i) % world, p->kv_segs, &p->n_kv_segs);
  int32_t m_tiles = 0;
  for (int i = 0; i < p->n_q_segs; i++)
    m_tiles += p->q_tiles[i] = (p->q_segs[i].rows + kBlockM - 1) / kBlockM;
  p->a.o = (__nv_bfloat16 *)a.o;
  p->a.lse = a.lse;
  p->a.batch = (int32_t)a.batch;
  p->a.heads_q = (int32_t)a.heads_q;
  p->a.seq_q = p->a.seq_kv = (int32_t)a.seq_local;
  p->a.group = (int32_t)(a.heads_q / a.heads_kv);
  p->a.m_tiles = m_tiles;
  p->a.num_tiles = (int32_t)(m_tiles * a.heads_q * a.batch);
  p->a.causal = a.causal;
  const float scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / sqrtf((float)D);
  p->a.scale_log2 = scale * 1.4426950408889634f;
  p->a.timeout_ns = kTimeoutDefaultNs;
  return TW_SUCCESS;
}

template <int D>
tw_status_t ring_launch(tw_comm_t comm, const tw_ring_attention_args_t &a, int sms,
                        cudaStream_t launch) {
  RingParams local;
  tw_status_t st = ring_params<D>(comm, a, &local);
  if (st != TW_SUCCESS)
    return st;
  constexpr int kSmem = AttnSmem<D>::kDynamicBytes;
  static uint64_t configured; /* a bit per device */
  st = tw_kernel_smem_once((const void *)ring_attention_kernel<D>, kSmem, &configured,
                           "tw_ring_attention: cudaFuncSetAttribute(max dynamic shared memory)");
  if (st != TW_SUCCESS)
    return st;
  const int grid = local.a.num_tiles < sms ? local.a.num_tiles : sms;
  void *params[2] = {(void *)&comm->dev, (void *)&local};
  return tw_cuda_check(cudaLaunchKernel((const void *)ring_attention_kernel<D>, dim3(grid),
                                        dim3(kThreads), params, (size_t)kSmem, launch),
                       "tw_ring_attention: kernel launch");
}

} // namespace

TW_OP_REGISTER(ring_attention, ring_registration);

extern "C" tw_status_t tw_ring_attention_args_init(tw_ring_attention_args_t *args) {
  if (!args)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_ring_attention_args_init: args is NULL");
  const tw_ring_attention_args_t init = TW_RING_ATTENTION_ARGS_INIT;
  memset(args, 0, sizeof(*args)); /* the padding too */
  memcpy(args, &init, offsetof(tw_ring_attention_args_t, sm_count) + sizeof(init.sm_count));
  return TW_SUCCESS;
}

/* The comm and the arguments checked, copied into *a (sizes as this library knows them). */
static tw_status_t ring_prepare(tw_comm_t comm, const tw_ring_attention_args_t *in,
                                tw_ring_attention_args_t *a) {
  const tw_ring_attention_args_t init = TW_RING_ATTENTION_ARGS_INIT;
  *a = init;
  tw_status_t st = tw_args_copy(in, a, sizeof(*a), offsetof(tw_ring_attention_args_t, sm_count),
                                kOp, "tw_ring_attention_args_t", "TW_RING_ATTENTION_ARGS_INIT");
  if (st != TW_SUCCESS)
    return st;
  if (comm->nodes != 1)
    return tw_fail(TW_ERR_NOT_SUPPORTED,
                   "%s: the comm spans %d nodes; ring attention reads the peers' k and v in "
                   "place and runs inside one node only",
                   kOp, comm->nodes);
  if (comm->world > kRingMaxWorld)
    return tw_fail(TW_ERR_NOT_SUPPORTED, "%s: the comm has %d ranks; at most %d", kOp, comm->world,
                   kRingMaxWorld);
  st = check_shapes(*a);
  if (st == TW_SUCCESS && (int64_t)comm->world * a->seq_local > kMaxSeqLocal * kRingMaxWorld)
    st = tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: seq_local x world is %lld positions; at most %lld",
                 kOp, (long long)(comm->world * a->seq_local),
                 (long long)(kMaxSeqLocal * kRingMaxWorld));
  if (st == TW_SUCCESS && (a->sm_count < 0 || a->sm_count > comm->sm_budget))
    st = tw_fail(TW_ERR_INVALID_ARGUMENT,
                 "%s: sm_count is %d; expected 0 (the comm's budget) or 1 .. %d", kOp,
                 (int)a->sm_count, comm->sm_budget);
  if (st == TW_SUCCESS)
    st = check_pointers(comm, *a);
  return st;
}

extern "C" tw_status_t tw_ring_attention(tw_comm_t comm, const tw_ring_attention_args_t *args,
                                         tw_stream_t stream) {
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_ring_attention_args_t a;
  st = ring_prepare(comm, args, &a);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const uint64_t fields[8] = {(uint64_t)a.batch,
                              (uint64_t)a.heads_q,
                              (uint64_t)a.heads_kv,
                              (uint64_t)a.seq_local,
                              (uint64_t)a.head_dim,
                              (uint64_t)a.causal | (uint64_t)a.layout << 1,
                              tw_call_heap_field(comm, a.k),
                              tw_call_heap_field(comm, a.v)};
  int prev = 0;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const tw_call_desc_t outer = tw_call_begin(comm, TW_CH_ATTN, 8, fields);
  cudaStream_t launch = NULL;
  st = tw_launch_begin(comm, stream, &launch);
  /* every rank's CTAs must be resident together (the entry and release waits): the budget */
  const int sms = a.sm_count > 0 ? a.sm_count : comm->sm_budget;
  if (st == TW_SUCCESS)
    st = a.head_dim == 128 ? ring_launch<128>(comm, a, sms, launch)
                           : ring_launch<64>(comm, a, sms, launch);
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  tw_call_end(comm, outer);
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}
