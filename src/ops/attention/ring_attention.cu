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

/* Both calls on TW_CH_ATTN (tw_ring_attention and its backward), as ring_call_fields fills them. */
const tw_call_fields_t ring_calls[] = {
    {TW_CH_ATTN,
     "tw_ring_attention / tw_ring_attention_backward",
     {"call (0 forward, 1 backward) | causal << 8 | layout << 9", "batch",
      "heads_q << 32 | heads_kv", "seq_local << 8 | head_dim", "k (heap offset)", "v (heap offset)",
      "q (heap offset; backward)", "dout, lse and workspace (heap offsets, mixed; backward)"}}};

const tw_op_desc_t ring_registration = {"ring_attention", ring_preload, ring_calls, 1};

} // namespace

/* The shapes' contract: TW_ERR_INVALID_ARGUMENT naming the first argument that breaks it. */
static tw_status_t check_shapes(const char *op, const tw_ring_attention_args_t &a) {
  tw_status_t st =
      check_heads(op, a.batch, a.heads_q, a.heads_kv, a.head_dim, a.causal, a.softmax_scale);
  if (st != TW_SUCCESS)
    return st;
  if (a.seq_local < 1 || a.seq_local > kMaxSeqLocal)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: seq_local is %lld; expected 1 .. %lld", op,
                   (long long)a.seq_local, (long long)kMaxSeqLocal);
  if (a.layout != TW_RING_CONTIGUOUS && a.layout != TW_RING_ZIGZAG)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: layout is %d; expected TW_RING_CONTIGUOUS (0) or TW_RING_ZIGZAG (1)", op,
                   (int)a.layout);
  if (a.layout == TW_RING_ZIGZAG && a.seq_local % 2)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: seq_local is %lld; TW_RING_ZIGZAG needs it even (two chunks of "
                   "seq_local / 2)",
                   op, (long long)a.seq_local);
  st = check_extent(op, "seq_local", "heads_q", a.batch, a.seq_local, a.heads_q, a.head_dim);
  if (st == TW_SUCCESS)
    st = check_extent(op, "seq_local", "heads_kv", a.batch, a.seq_local, a.heads_kv, a.head_dim);
  const int64_t m_tiles = (a.seq_local + kBlockM - 1) / kBlockM + 1;
  if (st == TW_SUCCESS && m_tiles * a.heads_q * a.batch > INT32_MAX)
    st = tw_fail(TW_ERR_INVALID_ARGUMENT,
                 "%s: batch x heads_q x the Q tiles is %lld tiles; at most 2^31 - 1", op,
                 (long long)(m_tiles * a.heads_q * a.batch));
  return st;
}

namespace {

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

} // namespace

/* Every field of the kernel's parameters (a's o may be NULL): the maps (rank r's k and v at its
 * mapped address, or for a rank on another node its copy in the gathered regions), the segments
 * (this rank's Q segments, every rank's KV segments in ring order from this rank). */
tw_status_t tw::attn::ring_params(tw_comm_t comm, const tw_ring_attention_args_t &a,
                                  const uint8_t *gathered_k, const uint8_t *gathered_v,
                                  RingParams *p) {
  memset(p, 0, sizeof(*p));
  const int world = comm->world, rank = comm->rank;
  const int64_t d = a.head_dim;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_local * a.heads_kv * d) * 2;
  tw_status_t st = operand_map(&p->a.q_map, a.q, a.batch, a.seq_local, a.heads_q, d,
                               "tw_ring_attention: cuTensorMapEncodeTiled(q)");
  for (int r = 0; r < world && st == TW_SUCCESS; r++) {
    const bool remote = comm->node_of[r] != comm->node; /* its copy gathered here */
    const void *k = r == rank ? a.k
                    : remote  ? (const void *)(gathered_k + r * kv_bytes)
                              : tw_heap_peer_ptr(comm, a.k, r);
    const void *v = r == rank ? a.v
                    : remote  ? (const void *)(gathered_v + r * kv_bytes)
                              : tw_heap_peer_ptr(comm, a.v, r);
    if (!k || !v)
      return tw_fail(TW_ERR_NOT_SUPPORTED, "tw_ring_attention: rank %d's k / v is not mapped here",
                     r);
    st = operand_map(&p->k_maps[r], k, a.batch, a.seq_local, a.heads_kv, d,
                     "tw_ring_attention: cuTensorMapEncodeTiled(k of a peer)");
    if (st == TW_SUCCESS)
      st = operand_map(&p->v_maps[r], v, a.batch, a.seq_local, a.heads_kv, d,
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
  const float scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / sqrtf((float)d);
  p->a.scale_log2 = scale * 1.4426950408889634f;
  p->a.timeout_ns = kTimeoutDefaultNs;
  return TW_SUCCESS;
}

namespace {

template <int D>
tw_status_t ring_launch(tw_comm_t comm, const tw_ring_attention_args_t &a, int sms,
                        cudaStream_t launch) {
  RingParams local;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_local * a.heads_kv * a.head_dim) * 2;
  const size_t regions[2] = {kv_bytes, kv_bytes}; /* ring_gather's: k, v */
  const uint8_t *gathered = (const uint8_t *)a.gathered;
  tw_status_t st =
      ring_params(comm, a, gathered,
                  gathered ? gathered + ring_region_off(comm->world, regions, 1) : NULL, &local);
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
  memcpy(args, &init, offsetof(tw_ring_attention_args_t, gathered) + sizeof(init.gathered));
  return TW_SUCCESS;
}

/* The comm (at most kRingMaxWorld ranks), the shapes and sm_count of a ring call (a's pointers
 * are not looked at), failures naming the argument after `op`. */
tw_status_t tw::attn::ring_check(tw_comm_t comm, const char *op,
                                 const tw_ring_attention_args_t &a) {
  if (comm->world > kRingMaxWorld)
    return tw_fail(TW_ERR_NOT_SUPPORTED, "%s: the comm has %d ranks; at most %d", op, comm->world,
                   kRingMaxWorld);
  tw_status_t st = check_shapes(op, a);
  if (st == TW_SUCCESS && (int64_t)comm->world * a.seq_local > kMaxSeqLocal * kRingMaxWorld)
    st = tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: seq_local x world is %lld positions; at most %lld",
                 op, (long long)(comm->world * a.seq_local),
                 (long long)(kMaxSeqLocal * kRingMaxWorld));
  if (st == TW_SUCCESS && (a.sm_count < 0 || a.sm_count > comm->sm_budget))
    st = tw_fail(TW_ERR_INVALID_ARGUMENT,
                 "%s: sm_count is %d; expected 0 (the comm's budget) or 1 .. %d", op,
                 (int)a.sm_count, comm->sm_budget);
  return st;
}

/* Across nodes `gathered` (the arguments' `n` buffers beside it) must be set, 16-byte aligned,
 * inside one symmetric allocation of `bytes`, and overlap none of them; inside one node it is
 * not read. */
tw_status_t tw::attn::ring_check_gathered(tw_comm_t comm, const char *op, const void *gathered,
                                          size_t bytes, int n, const void *const *others,
                                          const size_t *other_bytes, const char *const *names) {
  if (comm->nodes == 1)
    return TW_SUCCESS;
  if (!gathered)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: gathered is NULL; the comm spans %d nodes, and the other nodes' shards are "
                   "gathered there (symmetric, %zu bytes)",
                   op, comm->nodes, bytes);
  if ((uintptr_t)gathered % 16)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: gathered (%p) is not 16-byte aligned", op,
                   gathered);
  char what[112];
  snprintf(what, sizeof(what), "%s: gathered (must be symmetric memory: tw_mem_alloc of this comm)",
           op);
  tw_status_t st = tw_heap_lookup(comm, gathered, bytes, what, NULL);
  snprintf(what, sizeof(what), "%s: gathered", op);
  for (int i = 0; i < n && st == TW_SUCCESS; i++)
    if (others[i])
      st = tw_check_disjoint(gathered, bytes, what, others[i], other_bytes[i], names[i]);
  return st;
}

/* Across nodes, on `stream`, before the ring's kernels: each of the n tensors (this rank's
 * bytes[i] at src[i]) gathered by tw_allgather into region i of `gathered` (world slots of
 * bytes[i] rounded up to 16, regions back to back); a tensor whose bytes are not a multiple of
 * 16 is first copied into this rank's slot, which then is the send buffer. */
size_t tw::attn::ring_slot(size_t bytes) { return (bytes + 15) / 16 * 16; }

size_t tw::attn::ring_region_off(int world, const size_t *bytes, int i) {
  size_t off = 0;
  for (int j = 0; j < i; j++)
    off += (size_t)world * ring_slot(bytes[j]);
  return off;
}

tw_status_t tw::attn::ring_gather(tw_comm_t comm, const char *op, void *gathered, int n,
                                  const void *const *src, const size_t *bytes, tw_stream_t stream) {
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < n && st == TW_SUCCESS; i++) {
    uint8_t *region = (uint8_t *)gathered + ring_region_off(comm->world, bytes, i);
    const size_t slot = ring_slot(bytes[i]);
    const void *send = src[i];
    if (slot != bytes[i]) {
      send = region + (size_t)comm->rank * slot;
      int prev = 0;
      st = tw_set_device(comm->device, &prev);
      if (st == TW_SUCCESS)
        st = tw_cuda_check(cudaMemcpyAsync((void *)send, src[i], bytes[i], cudaMemcpyDefault,
                                           (cudaStream_t)stream),
                           op);
      cudaSetDevice(prev);
    }
    if (st == TW_SUCCESS)
      st = tw_allgather(comm, send, region, slot, stream);
  }
  return st;
}

/* The call's description on TW_CH_ATTN (ring_calls names the fields): call 0 forward, 1 the
 * backward, whose other symmetric buffers (q, dout, lse, workspace: `bwd`) every rank must also
 * pass at the same heap offsets. */
void tw::attn::ring_call_fields(tw_comm_t comm, int call, const tw_ring_attention_args_t &a,
                                const void *const bwd[4], uint64_t fields[8]) {
  fields[0] = (uint64_t)call | (uint64_t)a.causal << 8 | (uint64_t)a.layout << 9;
  fields[1] = (uint64_t)a.batch;
  fields[2] = (uint64_t)a.heads_q << 32 | (uint64_t)a.heads_kv;
  fields[3] = (uint64_t)a.seq_local << 8 | (uint64_t)a.head_dim;
  fields[4] = tw_call_heap_field(comm, a.k);
  fields[5] = tw_call_heap_field(comm, a.v);
  fields[6] = bwd ? tw_call_heap_field(comm, bwd[0]) : 0;
  fields[7] = 0;
  for (int i = 1; bwd && i < 4; i++) /* distinct odd multipliers: a swap of two differs too */
    fields[7] = fields[7] * 0x9e3779b97f4a7c15ull + tw_call_heap_field(comm, bwd[i]) * (2 * i + 1);
}

/* The comm and the arguments checked, copied into *a (sizes as this library knows them). */
static tw_status_t ring_prepare(tw_comm_t comm, const tw_ring_attention_args_t *in,
                                tw_ring_attention_args_t *a) {
  const tw_ring_attention_args_t init = TW_RING_ATTENTION_ARGS_INIT;
  *a = init;
  tw_status_t st = tw_args_copy(in, a, sizeof(*a), offsetof(tw_ring_attention_args_t, sm_count),
                                kOp, "tw_ring_attention_args_t", "TW_RING_ATTENTION_ARGS_INIT");
  if (st == TW_SUCCESS)
    st = ring_check(comm, kOp, *a);
  if (st == TW_SUCCESS)
    st = check_pointers(comm, *a);
  if (st != TW_SUCCESS) /* the shapes are checked: the sizes below are in range */
    return st;
  const size_t kv_bytes = (size_t)(a->batch * a->seq_local * a->heads_kv * a->head_dim) * 2;
  const size_t q_bytes = (size_t)(a->batch * a->seq_local * a->heads_q * a->head_dim) * 2;
  const void *others[5] = {a->q, a->k, a->v, a->o, a->lse};
  const size_t other_bytes[5] = {q_bytes, kv_bytes, kv_bytes, q_bytes,
                                 (size_t)(a->batch * a->heads_q * a->seq_local) * 4};
  const size_t regions[2] = {kv_bytes, kv_bytes};
  return ring_check_gathered(comm, kOp, a->gathered, ring_region_off(comm->world, regions, 2), 5,
                             others, other_bytes, kArgNames);
}

/* The rest of a ring call whose arguments are checked (tw_ring_attention and its backward): the
 * comm's device, the call's description, the launch stream and launch(comm, args, head_dim, sms,
 * stream) with sms the SMs the kernels may use (sm_count, else the comm's budget: every rank's
 * CTAs must be resident together, for the entry and release waits); the result recorded. */
tw_status_t tw::attn::ring_run(tw_comm_t comm, tw_stream_t stream, const uint64_t fields[8],
                               int sm_count, int64_t head_dim, ring_launch_t launch,
                               const void *args) {
  int prev = 0;
  tw_status_t st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const tw_call_desc_t outer = tw_call_begin(comm, TW_CH_ATTN, 8, fields);
  cudaStream_t on = NULL;
  st = tw_launch_begin(comm, stream, &on);
  const int sms = sm_count > 0 ? sm_count : comm->sm_budget;
  if (st == TW_SUCCESS)
    st = launch(comm, args, head_dim, sms, on);
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  tw_call_end(comm, outer);
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}

static tw_status_t forward_launch(tw_comm_t comm, const void *args, int64_t head_dim, int sms,
                                  cudaStream_t on) {
  const tw_ring_attention_args_t &a = *(const tw_ring_attention_args_t *)args;
  return head_dim == 128 ? ring_launch<128>(comm, a, sms, on) : ring_launch<64>(comm, a, sms, on);
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
  if (comm->nodes > 1) { /* the other nodes' k and v into `gathered`, then read from there */
    const size_t kv_bytes = (size_t)(a.batch * a.seq_local * a.heads_kv * a.head_dim) * 2;
    const void *src[2] = {a.k, a.v};
    const size_t bytes[2] = {kv_bytes, kv_bytes};
    st = ring_gather(comm, kOp, a.gathered, 2, src, bytes, stream);
    if (st != TW_SUCCESS)
      return tw_comm_result(comm, st);
  }
  uint64_t fields[8];
  ring_call_fields(comm, 0, a, NULL, fields);
  return ring_run(comm, stream, fields, a.sm_count, a.head_dim, forward_launch, &a);
}
