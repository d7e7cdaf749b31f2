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

tw_status_t fail_arg(const char *fmt, long long value, long long other) {
  char why[256];
  snprintf(why, sizeof(why), fmt, value, other);
  return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_ring_attention: %s", why);
}

/* The 4D map {head_dim, heads, seq, batch} of an operand, boxes {64, 1, 128, 1} (attention.cu's:
 * a box past a batch's last row is zero-filled). */
tw_status_t ring_map(CUtensorMap *map, const void *ptr, int64_t batch, int64_t seq, int64_t heads,
                     int64_t d, const char *what) {
  const tw_driver_api_t *api = NULL;
  tw_status_t st = tw_driver(&api);
  if (st != TW_SUCCESS)
    return st;
  cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)heads, (cuuint64_t)seq, (cuuint64_t)batch};
  cuuint64_t strides[3] = {(cuuint64_t)(d * 2), (cuuint64_t)(heads * d * 2),
                           (cuuint64_t)(seq * heads * d * 2)};
  cuuint32_t box[4] = {(cuuint32_t)kBoxCols, 1, (cuuint32_t)kBlockN, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUresult res = api->cuTensorMapEncodeTiled(
      map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)ptr, dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return tw_cu_check(res, what);
}

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
  const struct {
    int64_t value, most;
    const char *fmt;
  } sizes[4] = {{a.batch, 65535, "batch is %lld; expected 1 .. %lld"},
                {a.heads_q, 65535, "heads_q is %lld; expected 1 .. %lld"},
                {a.heads_kv, 65535, "heads_kv is %lld; expected 1 .. %lld"},
                {a.seq_local, kMaxSeqLocal, "seq_local is %lld; expected 1 .. %lld"}};
  for (int i = 0; i < 4; i++)
    if (sizes[i].value < 1 || sizes[i].value > sizes[i].most)
      return fail_arg(sizes[i].fmt, (long long)sizes[i].value, (long long)sizes[i].most);
  if (a.heads_q % a.heads_kv)
    return fail_arg("heads_q is %lld; expected a multiple of heads_kv (%lld)", (long long)a.heads_q,
                    (long long)a.heads_kv);
  if (a.head_dim != 64 && a.head_dim != 128)
    return fail_arg("head_dim is %lld; expected 64 or 128%.0lld", (long long)a.head_dim, 0);
  if (a.causal != 0 && a.causal != 1)
    return fail_arg("causal is %lld; expected 0 or 1%.0lld", (long long)a.causal, 0);
  if (a.layout != TW_RING_CONTIGUOUS && a.layout != TW_RING_ZIGZAG)
    return fail_arg("layout is %lld; expected TW_RING_CONTIGUOUS (0) or TW_RING_ZIGZAG (1)%.0lld",
                    (long long)a.layout, 0);
  if (a.layout == TW_RING_ZIGZAG && a.seq_local % 2)
    return fail_arg("seq_local is %lld; TW_RING_ZIGZAG needs it even (two chunks of seq_local / "
                    "2)%.0lld",
                    (long long)a.seq_local, 0);
  if (!(a.softmax_scale >= 0.f) || !isfinite(a.softmax_scale))
    return tw_fail(
        TW_ERR_INVALID_ARGUMENT,
        "tw_ring_attention: softmax_scale is %g; expected > 0 (or 0: 1 / sqrt(head_dim))",
        (double)a.softmax_scale);
  const int64_t heads[2] = {a.heads_q, a.heads_kv};
  for (int i = 0; i < 2; i++)
    if (a.seq_local * heads[i] * a.head_dim * 2 >= ((int64_t)1 << 40) ||
        (double)a.batch * (double)(a.seq_local * heads[i] * a.head_dim * 2) >= 4.0e18)
      return fail_arg("seq_local x %s x head_dim is too large (%lld elements a batch); expected "
                      "below 2^39 a batch and 2^61 in all%.0lld",
                      (long long)(a.seq_local * heads[i] * a.head_dim), 0);
  const int64_t m_tiles = (a.seq_local + kBlockM - 1) / kBlockM + 1;
  if (m_tiles * a.heads_q * a.batch > INT32_MAX)
    return fail_arg("batch x heads_q x the Q tiles is %lld tiles; at most %lld",
                    (long long)(m_tiles * a.heads_q * a.batch), (long long)INT32_MAX);
  return TW_SUCCESS;
}

/* Pointers: q, o, lse device memory of the comm's device, k and v inside one symmetric
 * allocation of this rank each, o and lse overlapping no input (nor each other). */
tw_status_t check_pointers(tw_comm_t comm, const tw_ring_attention_args_t &a) {
  char what[96];
  const size_t q_bytes = (size_t)(a.batch * a.seq_local * a.heads_q * a.head_dim) * 2;
  const size_t kv_bytes = (size_t)(a.batch * a.seq_local * a.heads_kv * a.head_dim) * 2;
  const size_t lse_bytes = (size_t)(a.batch * a.heads_q * a.seq_local) * 4;
  const void *ptrs[5] = {a.q, a.k, a.v, a.o, a.lse};
  const size_t bytes[5] = {q_bytes, kv_bytes, kv_bytes, q_bytes, lse_bytes};
  const char *names[5] = {"q", "k", "v", "o", "lse"};
  for (int i = 0; i < 5; i++) {
    if (!ptrs[i] && i < 4)
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_ring_attention: %s is NULL", names[i]);
    const int align = i < 4 ? 16 : 4;
    if ((uintptr_t)ptrs[i] % align)
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "tw_ring_attention: %s (%p) is not %d-byte aligned",
                     names[i], ptrs[i], align);
  }
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < 5 && st == TW_SUCCESS; i++) {
    if (!ptrs[i])
      continue;
    if (i == 1 || i == 2)
      snprintf(what, sizeof(what),
               "tw_ring_attention: %s (must be symmetric memory: tw_mem_alloc of this comm)",
               names[i]);
    else
      snprintf(what, sizeof(what), "tw_ring_attention: %s", names[i]);
    st = (i == 1 || i == 2) ? tw_heap_lookup(comm, ptrs[i], bytes[i], what, NULL)
                            : tw_comm_check_range(comm, ptrs[i], bytes[i], what);
  }
  for (int out = 3; out < 5 && st == TW_SUCCESS; out++)
    for (int in = 0; in < out && st == TW_SUCCESS; in++) {
      if (!ptrs[out] || !ptrs[in])
        continue;
      snprintf(what, sizeof(what), "tw_ring_attention: %s", names[out]);
      st = tw_check_disjoint(ptrs[out], bytes[out], what, ptrs[in], bytes[in], names[in]);
    }
  return st;
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
  tw_status_t st = ring_map(&p->a.q_map, a.q, a.batch, a.seq_local, a.heads_q, D,
                            "tw_ring_attention: cuTensorMapEncodeTiled(q)");
  for (int r = 0; r < world && st == TW_SUCCESS; r++) {
    const void *k = r == rank ? a.k : tw_heap_peer_ptr(comm, a.k, r);
    const void *v = r == rank ? a.v : tw_heap_peer_ptr(comm, a.v, r);
    if (!k || !v)
      return tw_fail(TW_ERR_NOT_SUPPORTED, "tw_ring_attention: rank %d's k / v is not mapped here",
                     r);
    st = ring_map(&p->k_maps[r], k, a.batch, a.seq_local, a.heads_kv, D,
                  "tw_ring_attention: cuTensorMapEncodeTiled(k of a peer)");
    if (st == TW_SUCCESS)
      st = ring_map(&p->v_maps[r], v, a.batch, a.seq_local, a.heads_kv, D,
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
  if (!in)
    return tw_fail(TW_ERR_INVALID_ARGUMENT, "%s: args is NULL", kOp);
  if (in->size < offsetof(tw_ring_attention_args_t, sm_count) ||
      in->size > sizeof(tw_ring_attention_args_t) + 4096)
    return tw_fail(TW_ERR_INVALID_ARGUMENT,
                   "%s: args->size is %zu; expected sizeof(tw_ring_attention_args_t) = %zu "
                   "(initialise with TW_RING_ATTENTION_ARGS_INIT)",
                   kOp, in->size, sizeof(tw_ring_attention_args_t));
  const tw_ring_attention_args_t init = TW_RING_ATTENTION_ARGS_INIT;
  *a = init;
  memcpy(a, in, in->size < sizeof(*a) ? in->size : sizeof(*a));
  a->size = sizeof(*a);
  if (comm->nodes != 1)
    return tw_fail(TW_ERR_NOT_SUPPORTED,
                   "%s: the comm spans %d nodes; ring attention reads the peers' k and v in "
                   "place and runs inside one node only",
                   kOp, comm->nodes);
  if (comm->world > kRingMaxWorld)
    return tw_fail(TW_ERR_NOT_SUPPORTED, "%s: the comm has %d ranks; at most %d", kOp, comm->world,
                   kRingMaxWorld);
  tw_status_t st = check_shapes(*a);
  if (st == TW_SUCCESS && (int64_t)comm->world * a->seq_local > kMaxSeqLocal * kRingMaxWorld)
    st = fail_arg("seq_local x world is %lld positions; at most %lld",
                  (long long)(comm->world * a->seq_local),
                  (long long)(kMaxSeqLocal * kRingMaxWorld));
  if (st == TW_SUCCESS && (a->sm_count < 0 || a->sm_count > comm->sm_budget))
    st = fail_arg("sm_count is %lld; expected 0 (the comm's budget) or 1 .. %lld",
                  (long long)a->sm_count, (long long)comm->sm_budget);
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
