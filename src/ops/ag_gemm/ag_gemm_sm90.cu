/*
 * tw_ag_gemm: AllGather + GEMM in one persistent launch per rank.
 *
 * CTAs [0, comm_ctas) first push this rank's shard into every rank's a_gathered
 * (items: target rank x row chunk; the own rank first, then rank-1, rank-2, ...:
 * the order in which the peers' rotated GEMMs reach these rows), setting the
 * target's flag (src = this rank, chunk) to the call's epoch after each chunk;
 * then they join the GEMM through the tile queue. Every CTA runs the GEMM
 * mainloop (src/gemm/gemm_sm90.cuh) with a readiness hook: before a tile's
 * TMA loads the producer waits for the flags of the chunks its 128 rows span.
 * Tiles run in rank-rotated order, starting on this rank's own rows.
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include <string.h>

#include "device/copy.cuh"
#include "device/rail.cuh"
#include "device/signal.cuh"
#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_launch.cuh"
#include "gemm/gemm_sm90.cuh"
#include "ops/ag_gemm/ag_gemm.h"
#include "ops/gemm/gemm_sm90.h"

extern "C" {
#include "core/env.h"
#include "gemm/tma_map.h"
#include "runtime/argcheck.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/comm_net.h"
#include "runtime/cuda_check.h"
#include "runtime/driver.h"
#include "runtime/registry.h"
}

using namespace tw::gemm;

namespace {

/* Two tile shapes, as the plain GEMM: 128x256 with 4 stages, and 128x128 with 6 stages
 * where 128x256 tiles leave a mostly idle last wave (small N per rank). */
template <int BN> struct AgConfig;
template <> struct AgConfig<256> { static constexpr int kStages = 4; };
template <> struct AgConfig<128> { static constexpr int kStages = 6; };
constexpr int kEpiBytes = 16384;

/* Kernel variants (plan.variant; TW_AG_VARIANT overrides): 1 takes the plain GEMM's stage /
 * epilogue split (3 stages and 32 KiB per consumer warpgroup at 128x256; 128x128 tiles keep
 * theirs), chosen where ranks share a GPU. Both claim tiles from the tile queue. */
template <int BN, int V> struct AgVariant {
  static constexpr bool kPlainSplit = (V & 1) != 0;
  static constexpr bool kSplit = kPlainSplit && BN == 256; /* 128-wide tiles: as the default */
  static constexpr int kStages = kSplit ? 3 : AgConfig<BN>::kStages;
  static constexpr int kEpi = kSplit ? 32768 : kEpiBytes;
  static constexpr int kSmem = SmemLayout<kStages, kEpi, BN>::kDynamicBytes;
  static_assert(kSmem <= 232448, "shared memory");
};

/* Readiness hook. Tiles whose rows all belong to this rank's shard read them straight
 * from `a` (own_map) and wait for nothing; other tiles read a_gathered once the chunks
 * holding their 128 rows have landed. */
struct AgWait : NoWait {
  struct Params {
    CUtensorMap own_map; /* this rank's shard `a`, [m_local, K] */
    tw_dev_comm_t dc;
    int32_t m_local;
    int32_t rows_per_chunk;
    int32_t m_total;
    int32_t own_first; /* rank * m_local */
    int32_t ch;        /* TW_CH_AG_GEMM, or TW_CH_AG_GEMM_CE (copy-engine mode) */
    int32_t pad;
    uint64_t host_epoch;   /* copy-engine mode: the epoch the host wrote flags with; else 0 */
    int32_t peer_read;     /* 1: rows of peer s come from peer_map[s] (s's own slot, in place) */
    int32_t write_through; /* peer reads with the gathered output: column block 0's tiles of
                              peer rows store their A boxes into a_gathered (the GEMM's a_map);
                              2: every tile of the row block stores its share of k-blocks */
    CUtensorMap peer_map[TW_AG_PEER_READ_MAX_WORLD]; /* peer s's a_gathered, [m_total, K] */
    int32_t inter; /* ranks on other nodes: the rail path (ag_gemm_rail.cuh) */
    int32_t pad2;
    uint64_t gathered_off; /* a_gathered's heap offset (the rail path) */
    tw_rail_t rail;
  };
  /* This call's epoch: kept on the GPU, or (copy-engine mode) counted by the host. */
  __device__ static uint64_t epoch(const Params &p) {
    return p.host_epoch ? p.host_epoch : tw_op_begin(p.dc, p.ch);
  }
  __device__ static bool all_own(const Params &p, int32_t mb) {
    const int32_t first = mb * kBlockM, end = min(first + kBlockM, p.m_total);
    return first >= p.own_first && end <= p.own_first + p.m_local;
  }
  __device__ static void a_source(const Params &p, int32_t mb, const CUtensorMap *&map,
                                  int32_t &row) {
    if (all_own(p, mb)) {
      map = &p.own_map;
      row = mb * kBlockM - p.own_first;
    } else if (p.peer_read) { /* m_local % 128 == 0: the tile's rows are all peer src's */
      map = &p.peer_map[(mb * kBlockM) / p.m_local];
    }
  }
  /* Every peer row block is written through once: by its tile of column block 0 (mode 1), or
   * a 1 / n_blocks share of its k-blocks by each of its tiles (mode 2). */
  static constexpr bool kWriteThrough = true;
  __device__ static int a_write_through(const Params &p, int32_t mb, int32_t nb) {
    if (!p.write_through || all_own(p, mb))
      return 0;
    return p.write_through == 2 ? 2 : nb == 0 ? 1 : 0;
  }
  __device__ static void before_tile(const Params &p, int32_t mb, int32_t nb) {
    tw_trace_tile(p.dc.trace, TW_TR_CLAIMED, mb, nb);
    if (all_own(p, mb))
      return;
    const uint64_t e = epoch(p);
    const int32_t end = min(mb * kBlockM + kBlockM, p.m_total);
    for (int32_t row = mb * kBlockM; row < end;) {
      const int32_t src = row / p.m_local;
      const int32_t chunk = (row - src * p.m_local) / p.rows_per_chunk;
      /* rows a rail peer sent land here by RDMA, under a net flag; all others under a flag */
      const uint64_t *own = tw_own_flag(p.dc, p.ch, tw_ag_gemm_flag_index(src, chunk));
      const uint64_t *flag =
          p.inter ? tw_rail_ready_flag(p.rail, p.dc, p.ch, src, chunk, own) : own;
      if (!tw_wait_geq(p.dc, p.ch, flag, e, src, chunk))
        break; /* timed out or aborted: recorded; the tile computes garbage, the kernel ends */
      row = min(src * p.m_local + (chunk + 1) * p.rows_per_chunk, (src + 1) * p.m_local);
    }
    tw_fence_proxy_async_global();
  }
  __device__ static void mbar_stuck(const Params &p, int32_t code) {
    tw_pipeline_stall(p.dc, p.ch, code);
  }
};

template <class Out> struct AgParams {
  GemmParams<EpiTmaStore<Out>, AgWait> gemm;
  const char *a;                /* this rank's shard */
  char *gathered[TW_MAX_WORLD]; /* every rank's a_gathered, mapped here */
  int64_t row_bytes;            /* K * 2 */
  int32_t nchunks;
  int32_t comm_ctas;
  int32_t own_copy; /* push mode: 1 the comm CTAs also copy the shard into the own slot, 0 a
                       copy engine does it (tw_ag_gemm) or it is already there */
};

/* The whole CTA: `rows` rows from src to dst (nothing when they are the same), then a barrier:
 * the copy is done. */
template <class Out>
__device__ __forceinline__ void copy_rows(const AgParams<Out> &p, char *dst, const char *src,
                                          int64_t rows) {
  if (dst != src)
    tw_cta_copy(dst, src, (size_t)(rows * p.row_bytes));
  __syncthreads();
}

/* This rank's rows of `chunk` into `target`'s a_gathered slot for this rank. */
template <class Out>
__device__ __forceinline__ void copy_chunk(const AgParams<Out> &p, int target, int chunk) {
  const AgWait::Params &w = p.gemm.wait;
  const int64_t row0 = (int64_t)chunk * w.rows_per_chunk;
  const int64_t rows = min((int64_t)w.rows_per_chunk, (int64_t)w.m_local - row0);
  copy_rows(p, p.gathered[target] + ((int64_t)w.dc.rank * w.m_local + row0) * p.row_bytes,
            p.a + row0 * p.row_bytes, rows);
}

/* Thread 0: the entry signal, then (`writes`: a CTA that writes into peers) every peer's entry
 * with the same call. Out of line: inlined, its waits cost the GEMM loop registers. */
static __device__ __noinline__ bool enter(const tw_dev_comm_t &dc, int ch, uint64_t epoch,
                                          bool writes) {
  return tw_kernel_enter(dc, ch, epoch) && (!writes || tw_wait_entries(dc, ch, epoch));
}

} // namespace

#include "ops/ag_gemm/ag_gemm_rail.cuh"

namespace {

template <class Out, int BN, int V>
__global__ void __launch_bounds__(kThreads, 1)
    ag_gemm_kernel(const __grid_constant__ AgParams<Out> p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const tw_dev_comm_t &dc = p.gemm.wait.dc;
  const AgWait::Params &w = p.gemm.wait;
  const int ch = w.ch;
  const uint64_t epoch = AgWait::epoch(w);
  /* Thread 0 decides; __syncthreads_and spreads it, so the CTA leaves the loop together. The
   * CTAs that write into peers (in the copy-engine mode block 0, for the copies) first see
   * every peer enter this call, with the same call. */
  int mine = 1;
  if (threadIdx.x == 0)
    mine = enter(dc, ch, epoch,
                 (int)blockIdx.x < p.comm_ctas || (blockIdx.x == 0 && ch == TW_CH_AG_GEMM_CE));
  int ok = __syncthreads_and(mine);
  uint64_t last_ticket = ~0ull; /* the rail path: this CTA's last RDMA write */
  if ((int)blockIdx.x < p.comm_ctas && w.inter) {
    last_ticket = rail_items(p, epoch, ok);
  } else if ((int)blockIdx.x < p.comm_ctas && w.peer_read) {
    /* Peer reads: the shard only goes into this rank's own slot (when not already there);
     * then every rank's flag (this rank, chunk) says the peers may read it. The slot is free:
     * the exit barrier of the previous call saw every peer finish reading it. */
    const int world = dc.world, rank = dc.rank;
    for (int chunk = blockIdx.x; ok && chunk < p.nchunks; chunk += p.comm_ctas) {
      copy_chunk(p, rank, chunk);
      if (threadIdx.x == 0) {
        tw_fence_acq_rel_sys();
        for (int q = 0; q < world; q++)
          tw_signal_put(tw_peer_flag(dc, q, ch, tw_ag_gemm_flag_index(rank, chunk)), epoch);
      }
    }
    __syncthreads();
  } else if ((int)blockIdx.x < p.comm_ctas) {
    const int world = dc.world, rank = dc.rank;
    const int items = (world - 1 + p.own_copy) * p.nchunks;
    for (int item = blockIdx.x; ok && item < items; item += p.comm_ctas) {
      /* Peers in the order their rotated GEMMs reach this shard (rank-1 first), this
       * rank's own copy (only the gathered output needs it) last. */
      const int target = (rank - 1 - item / p.nchunks + 2 * world) % world;
      const int chunk = item % p.nchunks;
      copy_chunk(p, target, chunk);
      if (threadIdx.x == 0)
        tw_signal_set(tw_peer_flag(dc, target, ch, tw_ag_gemm_flag_index(rank, chunk)), epoch);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && (int)blockIdx.x < p.comm_ctas)
    tw_trace_stamp(dc, TW_TR_COMM_END);
  using Var = AgVariant<BN, V>;
  gemm_cta_loop<Var::kStages, Var::kEpi, EpiTmaStore<Out>, AgWait, true, 1, BN>(
      p.gemm, smem_raw, (int32_t)blockIdx.x, (int32_t)gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0)
    tw_trace_stamp(dc, TW_TR_GEMM_END);
  /* the NIC has read what this CTA posted (the own slot) before the call may end */
  if (threadIdx.x == 0 && last_ticket != ~0ull)
    tw_fifo_wait_done(dc.fifo, dc, ch, last_ticket);
  if (threadIdx.x == 0 && w.peer_read) {
    /* Exit barrier: the peers read this rank's slot until their last tile, so the call ends
     * (and the caller may rewrite the slot) only once every rank's CTAs are all done. The
     * last CTA of each rank tells every peer; the last CTA here waits for every peer. */
    uint64_t *count = tw_own_flag(dc, ch, TW_AG_EXIT_COUNT);
    if (atomicAdd((unsigned long long *)count, 1ull) == (unsigned long long)gridDim.x - 1) {
      *(volatile uint64_t *)count = 0; /* every CTA of this call has counted */
      tw_fence_acq_rel_sys();
      for (int q = 0; q < dc.world; q++)
        tw_signal_put(tw_peer_flag(dc, q, ch, TW_AG_EXIT_FLAG(dc.rank)), epoch);
      for (int q = 0; q < dc.world; q++)
        if (!tw_wait_geq(dc, ch, tw_own_flag(dc, ch, TW_AG_EXIT_FLAG(q)), epoch, q, -2))
          break;
    }
  }
  if (threadIdx.x == 0) {
    tw_trace_stamp(dc, TW_TR_END);
    tw_op_finish(dc, ch, tw_op_begin(dc, ch));
  }
}

static_assert(sizeof(AgParams<float>) <= 4096, "kernel parameters");

template <class Out, int BN, int V>
tw_status_t launch_v(AgParams<Out> &params, int grid, cudaStream_t stream) {
  return launch_persistent<ag_gemm_kernel<Out, BN, V>, AgVariant<BN, V>::kSmem>(
      params, grid, stream, "tw_ag_gemm: cudaFuncSetAttribute", "tw_ag_gemm: kernel launch");
}

template <class Out, int BN>
tw_status_t launch(AgParams<Out> &params, int variant, int grid, cudaStream_t stream) {
  return variant & 1 ? launch_v<Out, BN, 1>(params, grid, stream)
                     : launch_v<Out, BN, 0>(params, grid, stream);
}

template <class Out, int BN> cudaError_t preload_variants() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, ag_gemm_kernel<Out, BN, 0>);
  if (e == cudaSuccess)
    e = cudaFuncGetAttributes(&attr, ag_gemm_kernel<Out, BN, 1>);
  return e;
}

/* A tile order that starts on this node's rows (own and NVLink-pushed shards before those that
 * cross nodes) where the node's ranks are consecutive. */
static void rail_order(const tw_ag_gemm_args_t &a, const tw_rail_t &r, TileOrder *o) {
  for (int l = 1; l < r.local_size; l++)
    if (r.local_rank[l] != r.local_rank[0] + l)
      return;
  o->rotate_mb = (int32_t)(((int64_t)r.local_rank[0] * a.m_local) / kBlockM);
}

template <class Out, int BN>
tw_status_t run(tw_comm_t comm, const tw_ag_gemm_args_t &a, const tw_ag_gemm_plan_t &plan, int ch,
                uint64_t host_epoch, cudaStream_t stream) {
  AgParams<Out> p;
  memset(&p, 0, sizeof(p));
  const int64_t m_total = a.m_local * comm->world;
  tw_status_t st;
  st = operand_maps(&p.gemm.a_map, &p.gemm.b_map, a.a_gathered, m_total, a.k, a.b, a.n, a.ldb, a.k,
                    BN, "tw_ag_gemm", "a_gathered");
  if (st == TW_SUCCESS)
    st = out_map<Out>(&p.gemm.epi.c_map, a.c, a.n, m_total, a.ldc,
                      "tw_ag_gemm: cuTensorMapEncodeTiled(c)");
  if (st != TW_SUCCESS)
    return st;
  TileOrder &o = p.gemm.order;
  o.m_blocks = (int32_t)((m_total + kBlockM - 1) / kBlockM);
  o.n_blocks = (int32_t)((a.n + BN - 1) / BN);
  o.num_tiles = o.m_blocks * o.n_blocks;
  o.order = kOrderRotated;
  o.group_m = plan.group_m < o.m_blocks ? plan.group_m : o.m_blocks;
  o.rotate_mb = (int32_t)(((int64_t)comm->rank * a.m_local) / kBlockM);
  p.gemm.queue = (TileQueue *)comm->ctrl->tile_queue[ch];
  p.gemm.participants = plan.ctas;
  p.gemm.k_blocks = (int32_t)((a.k + kBlockK - 1) / kBlockK);
  p.gemm.mbar_timeout_ns = fused_mbar_timeout_ns(comm->dev.timeout_ns);
  apply_fault_stall(p.gemm);
  p.gemm.wait.dc = comm->dev;
  p.gemm.wait.m_local = (int32_t)a.m_local;
  p.gemm.wait.rows_per_chunk = plan.rows_per_chunk;
  p.gemm.wait.m_total = (int32_t)m_total;
  p.gemm.wait.own_first = (int32_t)(comm->rank * a.m_local);
  p.gemm.wait.ch = ch;
  p.gemm.wait.host_epoch = host_epoch;
  st = tw_tma_map_2d(&p.gemm.wait.own_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, a.a, a.k, a.m_local,
                     a.k, kBlockK, kBlockM, "tw_ag_gemm: cuTensorMapEncodeTiled(a)");
  if (st != TW_SUCCESS)
    return st;
  if (comm->nodes > 1) {
    p.gemm.wait.inter = 1;
    p.gemm.wait.gathered_off = (uint64_t)((const char *)a.a_gathered -
                                          (const char *)tw_group_slot(comm->group, comm->rank, 0));
    st = tw_comm_rail(comm, "tw_ag_gemm", &p.gemm.wait.rail);
    if (st != TW_SUCCESS)
      return st;
    rail_order(a, p.gemm.wait.rail, &o);
  }
  p.gemm.wait.peer_read = plan.peer_read;
  p.gemm.wait.write_through = plan.peer_gather;
  for (int r = 0; plan.peer_read && r < comm->world; r++) {
    st = tw_tma_map_2d(&p.gemm.wait.peer_map[r], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                       tw_heap_peer_ptr(comm, a.a_gathered, r), a.k, m_total, a.k, kBlockK, kBlockM,
                       "tw_ag_gemm: cuTensorMapEncodeTiled(peer a_gathered)");
    if (st != TW_SUCCESS)
      return st;
  }
  p.a = (const char *)a.a;
  for (int r = 0; r < comm->world; r++)
    p.gathered[r] = (char *)tw_heap_peer_ptr(comm, a.a_gathered, r);
  p.row_bytes = a.k * 2;
  p.nchunks = plan.nchunks;
  p.comm_ctas = plan.comm_ctas;
  p.own_copy = plan.own_copy_ce ? 0 : 1;
  return launch<Out, BN>(p, plan.variant, plan.ctas, stream);
}

} // namespace

static tw_status_t tw_ag_gemm_preload(void) {
  cudaError_t e = preload_variants<__nv_bfloat16, 256>();
  if (e == cudaSuccess)
    e = preload_variants<float, 256>();
  if (e == cudaSuccess)
    e = preload_variants<__nv_bfloat16, 128>();
  if (e == cudaSuccess)
    e = preload_variants<float, 128>();
  return tw_cuda_check(e, "loading the ag_gemm kernels");
}

/* tw_ag_gemm, registered with the runtime (runtime/registry.h). */
/* What tw_ag_gemm's calls must have alike (describe_call sets them), on either channel. */
#define AG_GEMM_CALL_FIELDS                                                                        \
  {                                                                                                \
    "m_local", "k", "a_gathered (heap offset)",                                                    \
        "route (0 the SM push, 1 peer reads, 2 the copy engine, 3 the rail path across nodes)",    \
        "rows_per_chunk"                                                                           \
  }
static const tw_call_fields_t ag_gemm_calls[] = {
    {TW_CH_AG_GEMM, "tw_ag_gemm", AG_GEMM_CALL_FIELDS},
    {TW_CH_AG_GEMM_CE, "tw_ag_gemm", AG_GEMM_CALL_FIELDS}};
#undef AG_GEMM_CALL_FIELDS
static const tw_op_desc_t ag_gemm_registration = {"ag_gemm", tw_ag_gemm_preload, ag_gemm_calls, 2};
TW_OP_REGISTER(ag_gemm, ag_gemm_registration);

extern "C" tw_status_t tw_ag_gemm_args_init(tw_ag_gemm_args_t *args) {
  TW_ARG_CHECK(args != NULL, "args: NULL");
  tw_ag_gemm_args_t init = TW_AG_GEMM_ARGS_INIT;
  *args = init;
  return TW_SUCCESS;
}

/* Across nodes: layouts the rail path serves, and the modes it has. */
static tw_status_t rail_check(tw_comm_t comm, tw_ag_gemm_args_t *a) {
  tw_rail_t r;
  const tw_status_t st = tw_comm_rail(comm, "tw_ag_gemm", &r);
  if (st != TW_SUCCESS)
    return st;
  if (a->comm_mode == TW_AG_COMM_COPY_ENGINE)
    return tw_fail(TW_ERR_NOT_SUPPORTED,
                   "args->comm_mode: TW_AG_COMM_COPY_ENGINE reaches ranks of one node only; across "
                   "nodes use TW_AG_COMM_SM or TW_AG_COMM_AUTO");
  a->comm_mode = TW_AG_COMM_SM;
  return TW_SUCCESS;
}

/* Validates (naming the bad argument), resolves defaults, and plans the launch. */
extern "C" tw_status_t tw_ag_gemm_prepare(tw_comm_t comm, const tw_ag_gemm_args_t *in,
                                          tw_ag_gemm_args_t *a, tw_ag_gemm_plan_t *plan) {
  TW_ARG_CHECK(in != NULL, "args: NULL");
  TW_ARG_CHECK(in->size >= offsetof(tw_ag_gemm_args_t, comm_sms) && in->size <= 65536,
               "args->size: %zu; initialise with TW_AG_GEMM_ARGS_INIT", in->size);
  TW_ARG_CHECK(in->version >= 1 && in->version <= TW_AG_GEMM_ARGS_VERSION,
               "args->version: %u; this library knows 1..%d", in->version, TW_AG_GEMM_ARGS_VERSION);
  tw_ag_gemm_args_t init = TW_AG_GEMM_ARGS_INIT;
  *a = init;
  memcpy(a, in, in->size < sizeof(*a) ? in->size : sizeof(*a));
  a->size = sizeof(*a);
  const int world = comm->world;
  TW_ARG_CHECK(a->c_dtype == TW_BF16 || a->c_dtype == TW_FP32,
               "args->c_dtype: %d; expected TW_BF16 or TW_FP32", (int)a->c_dtype);
  TW_ARG_CHECK(a->comm_mode == TW_AG_COMM_SM || a->comm_mode == TW_AG_COMM_COPY_ENGINE ||
                   a->comm_mode == TW_AG_COMM_AUTO,
               "args->comm_mode: %d; expected TW_AG_COMM_SM, TW_AG_COMM_COPY_ENGINE or "
               "TW_AG_COMM_AUTO",
               (int)a->comm_mode);
  TW_ARG_CHECK(a->a && a->b && a->c && a->a_gathered, "args->%s: NULL",
               !a->a   ? "a"
               : !a->b ? "b"
               : !a->c ? "c"
                       : "a_gathered");
  TW_ARG_CHECK(a->m_local >= 1 && a->m_local * world <= INT32_MAX,
               "args->m_local: %lld; expected 1 <= m_local and world * m_local < 2^31",
               (long long)a->m_local);
  TW_ARG_CHECK(a->n >= 8 && a->n % 8 == 0 && a->n <= INT32_MAX,
               "args->n: %lld; expected a positive multiple of 8", (long long)a->n);
  TW_ARG_CHECK(a->k >= 8 && a->k % 8 == 0 && a->k <= INT32_MAX,
               "args->k: %lld; expected a positive multiple of 8", (long long)a->k);
  if (a->ldb == 0)
    a->ldb = a->k;
  if (a->ldc == 0)
    a->ldc = a->n;
  const int c_bytes = a->c_dtype == TW_BF16 ? 2 : 4;
  TW_ARG_CHECK(a->ldb >= a->k && a->ldb % 8 == 0,
               "args->ldb: %lld; expected >= k (%lld) and a multiple of 8", (long long)a->ldb,
               (long long)a->k);
  TW_ARG_CHECK(a->ldc >= a->n && (a->ldc * c_bytes) % 16 == 0,
               "args->ldc: %lld; expected >= n (%lld) and 16-byte rows", (long long)a->ldc,
               (long long)a->n);
  TW_ARG_CHECK((uintptr_t)a->a % 16 == 0, "args->a: %p is not 16-byte aligned", a->a);
  TW_ARG_CHECK((uintptr_t)a->b % 16 == 0, "args->b: %p is not 16-byte aligned", a->b);
  TW_ARG_CHECK((uintptr_t)a->c % 16 == 0, "args->c: %p is not 16-byte aligned", a->c);
  TW_ARG_CHECK((uintptr_t)a->a_gathered % 16 == 0, "args->a_gathered: %p is not 16-byte aligned",
               a->a_gathered);
  const size_t shard_bytes = (size_t)a->m_local * (size_t)a->k * 2;
  tw_status_t st =
      tw_heap_lookup(comm, a->a_gathered, shard_bytes * (size_t)world, "args->a_gathered", NULL);
  if (st != TW_SUCCESS)
    return st;
  const char *g0 = (const char *)a->a_gathered, *own = g0 + shard_bytes * (size_t)comm->rank;
  const char *a0 = (const char *)a->a;
  TW_ARG_CHECK(a0 == own || a0 + shard_bytes <= g0 || a0 >= g0 + shard_bytes * (size_t)world,
               "args->a: %p overlaps a_gathered but is not a_gathered + rank * m_local * k (%p)",
               a->a, (const void *)own);
  /* the operands as large as the shapes make them; c and a_gathered (both written) overlap no
   * other argument */
  const size_t gathered_bytes = shard_bytes * (size_t)world;
  const size_t b_bytes = (size_t)((a->n - 1) * a->ldb + a->k) * 2;
  const size_t c_total = (size_t)((a->m_local * world - 1) * a->ldc + a->n) * (size_t)c_bytes;
  if (a0 != own && (st = tw_comm_check_range(comm, a->a, shard_bytes, "args->a")) != TW_SUCCESS)
    return st;
  if ((st = tw_comm_check_range(comm, a->b, b_bytes, "args->b")) != TW_SUCCESS ||
      (st = tw_comm_check_range(comm, a->c, c_total, "args->c")) != TW_SUCCESS ||
      (st = tw_check_disjoint(a->c, c_total, "args->c", a->a, shard_bytes, "args->a")) !=
          TW_SUCCESS ||
      (st = tw_check_disjoint(a->c, c_total, "args->c", a->b, b_bytes, "args->b")) != TW_SUCCESS ||
      (st = tw_check_disjoint(a->c, c_total, "args->c", a->a_gathered, gathered_bytes,
                              "args->a_gathered")) != TW_SUCCESS ||
      (st = tw_check_disjoint(a->a_gathered, gathered_bytes, "args->a_gathered", a->b, b_bytes,
                              "args->b")) != TW_SUCCESS)
    return st;
  if (comm->nodes > 1) {
    st = rail_check(comm, a);
    if (st != TW_SUCCESS)
      return st;
  }
  for (int r = 0; r < world; r++)
    if (comm->node_of[r] == comm->node && !tw_heap_peer_ptr(comm, a->a_gathered, r))
      return tw_fail(TW_ERR_NOT_SUPPORTED,
                     "args->a_gathered: rank %d's allocation is not mapped here (a rank of this "
                     "node in another process that cannot share GPU memory?)",
                     r);
  tw_ag_gemm_plan_args_t pa = {world,
                               a->m_local,
                               a->n,
                               a->k,
                               comm->sm_budget,
                               a->comm_sms,
                               (int)tw_env_int(TW_AG_COMM_SMS_ID),
                               (int)tw_env_int(TW_AG_GROUP_M_ID),
                               comm->ranks_on_device > 1,
                               (int)tw_env_int(TW_AG_VARIANT_ID)};
  tw_ag_gemm_make_plan(&pa, plan);
  if (comm->nodes > 1) {
    /* the rail path: the SMs push and forward (no peer reads, no copy engine); one net flag
     * per (node, chunk) */
    while (plan->nchunks > TW_RAIL_MAX_CHUNKS) {
      plan->rows_per_chunk *= 2;
      plan->nchunks = (int)((a->m_local + plan->rows_per_chunk - 1) / plan->rows_per_chunk);
    }
    /* each forward item waits for a network arrival: enough comm CTAs that one slow chunk holds
     * up only its own CTA (two per destination kind, send first), at most half the budget */
    const int items = plan->nchunks * (comm->local_size + comm->nodes - 1);
    const int rail_ctas = 2 * (comm->local_size + comm->nodes - 2) + 1;
    if (plan->comm_ctas < rail_ctas && a->comm_sms <= 0 && tw_env_int(TW_AG_COMM_SMS_ID) <= 0)
      plan->comm_ctas = rail_ctas < plan->ctas / 2 ? rail_ctas : plan->ctas / 2;
    if (plan->comm_ctas > items)
      plan->comm_ctas = items;
    if (plan->comm_ctas < 1)
      plan->comm_ctas = 1;
    return TW_SUCCESS;
  }
  /* TW_AG_COMM_AUTO: the copy engine where its rule takes it (ag_gemm_heuristics.c); tw_ag_gemm
   * keeps the SMs instead under graph capture. Decided alike on every rank: gpu_shared is the
   * comm's, and the GEMM estimate takes the device's SMs, not the rank's budget (budgets may
   * differ between ranks: test_mp runs odd ranks on 8 SMs). */
  plan->auto_ce = a->comm_mode == TW_AG_COMM_AUTO &&
                  tw_ag_gemm_auto_copy_engine(world, comm->gpu_shared, a->m_local, a->n, a->k,
                                              comm->sm_count, (int)tw_env_int(TW_AG_AUTO_CE_ID));
  if (a->comm_mode == TW_AG_COMM_AUTO)
    a->comm_mode = plan->auto_ce ? TW_AG_COMM_COPY_ENGINE : TW_AG_COMM_SM;
  tw_ag_gemm_plan_peer(plan, world, a->no_gathered_out, a->comm_mode == TW_AG_COMM_SM,
                       comm->ranks_on_device == world, a->m_local, a->n, a->a == (const void *)own,
                       a->comm_sms, (int)tw_env_int(TW_AG_PEER_GATHER_ID));
  /* The own-slot copy by a copy engine (tw_ag_gemm_own_copy_ce), pushing mode only. Where no
   * tile straddles this shard and a peer's (world 1, or shards of whole 128-row blocks), the
   * own copy only feeds the gathered output (the shard's tiles read `a`), so it can run beside
   * the kernel. A straddling tile reads its own rows from the slot and waits for their chunk
   * flags: the CTAs copy and flag them then (a copy engine there would leave the flags
   * unset). */
  plan->own_copy_ce = a->comm_mode == TW_AG_COMM_SM && !plan->peer_read &&
                      a->a != (const void *)own && (world == 1 || a->m_local % 128 == 0) &&
                      tw_ag_gemm_own_copy_ce(world, comm->gpu_shared, a->m_local, a->n, a->k,
                                             comm->sm_count, (int)tw_env_int(TW_AG_OWN_COPY_CE_ID));
  return TW_SUCCESS;
}

static tw_status_t run_dtype(tw_comm_t comm, const tw_ag_gemm_args_t &a,
                             const tw_ag_gemm_plan_t &plan, int ch, uint64_t host_epoch,
                             cudaStream_t stream) {
  if (a.c_dtype == TW_BF16)
    return plan.block_n == 128 ? run<__nv_bfloat16, 128>(comm, a, plan, ch, host_epoch, stream)
                               : run<__nv_bfloat16, 256>(comm, a, plan, ch, host_epoch, stream);
  return plan.block_n == 128 ? run<float, 128>(comm, a, plan, ch, host_epoch, stream)
                             : run<float, 256>(comm, a, plan, ch, host_epoch, stream);
}

/* The comm's copy-engine stream joins the caller's: work enqueued on it after this starts once
 * the caller's stream reached this point (created on first use). */
static tw_status_t ce_fork(tw_comm_t comm, tw_stream_t user) {
  tw_status_t st = tw_comm_ce_stream(comm);
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaEventRecord(comm->ce_in, (cudaStream_t)user), "cudaEventRecord");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaStreamWaitEvent(comm->ce_stream, comm->ce_in, 0), "cudaStreamWaitEvent");
  return st;
}

/* The caller's stream waits for everything enqueued on the copy-engine stream so far (graph
 * capture keeps the fork and the join). */
static tw_status_t ce_join(tw_comm_t comm, tw_stream_t user) {
  tw_status_t st =
      tw_cuda_check(cudaEventRecord(comm->ce_done, comm->ce_stream), "cudaEventRecord");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaStreamWaitEvent((cudaStream_t)user, comm->ce_done, 0),
                       "cudaStreamWaitEvent");
  return st;
}

/* Whether the caller's stream is being captured into a CUDA graph (the copy-engine mode is eager
 * only). */
static tw_status_t capturing(tw_stream_t stream, int *yes) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  tw_status_t st =
      tw_cuda_check(cudaStreamIsCapturing((cudaStream_t)stream, &status), "cudaStreamIsCapturing");
  *yes = st == TW_SUCCESS && status != cudaStreamCaptureStatusNone;
  return st;
}

/* Copy-engine mode: the shard goes by cudaMemcpyAsync on the comm's side stream, each chunk
 * followed by a flag written by the stream (cuStreamWriteValue64, which fences first); the
 * side stream waits (cuStreamWaitValue64) for a peer's entry into the call before writing
 * into it. The epoch is counted on the host, so this mode is eager only. Every CTA computes. */
static tw_status_t copy_engine_call(tw_comm_t comm, const tw_ag_gemm_args_t &a,
                                    tw_ag_gemm_plan_t plan, tw_stream_t user) {
  const tw_driver_api_t *cu;
  tw_status_t st = tw_driver(&cu);
  if (st != TW_SUCCESS)
    return st;
  /* tw_ag_gemm refused (or, for TW_AG_COMM_AUTO, left) this mode under graph capture. */
  /* Ranks sharing a GPU have no copy engine between them (the copies are HBM to HBM on the
   * same chip), and on 3 virtual ranks of one GPU this mode was seen to hang in test_ag_gemm
   * (not understood; 2 ranks per GPU and ranks on distinct GPUs passed). Refuse it. */
  if (comm->ranks_on_device > 1)
    return tw_fail(TW_ERR_NOT_SUPPORTED,
                   "args->comm_mode: TW_AG_COMM_COPY_ENGINE needs every rank on its own GPU; "
                   "%d ranks share GPU %d (use TW_AG_COMM_SM)",
                   comm->ranks_on_device, comm->device);
  st = tw_comm_ce_stream(comm); /* before the epoch counts this call */
  if (st != TW_SUCCESS)
    return st;
  const uint64_t epoch = ++comm->ce_epoch;
  const int ch = TW_CH_AG_GEMM_CE, world = comm->world, rank = comm->rank;
  plan.comm_ctas = 0;
  /* Each chunk costs a copy and a flag write to enqueue: at most 8 chunks per shard here. */
  while (plan.nchunks > 8) {
    plan.rows_per_chunk *= 2;
    plan.nchunks = (int)((a.m_local + plan.rows_per_chunk - 1) / plan.rows_per_chunk);
  }
  /* The copies read the shard: they start once the caller's stream reached this call. */
  st = ce_fork(comm, user);
  cudaStream_t launch = NULL;
  if (st == TW_SUCCESS)
    st = tw_launch_begin(comm, user, &launch);
  if (st == TW_SUCCESS)
    st = run_dtype(comm, a, plan, ch, epoch, launch);
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, user);
  const size_t row_bytes = (size_t)a.k * 2;
  for (int k = 1; k <= world && st == TW_SUCCESS; k++) {
    const int target = ((rank - k) % world + world) % world; /* rank-1 first, own copy last */
    if (target != rank)
      st = tw_cu_check(
          cu->cuStreamWaitValue64((CUstream)comm->ce_stream,
                                  (CUdeviceptr)(uintptr_t)&comm->ctrl->entry[ch][target], epoch,
                                  CU_STREAM_WAIT_VALUE_GEQ),
          "cuStreamWaitValue64(peer entry)");
    char *dst_base = (char *)tw_heap_peer_ptr(comm, a.a_gathered, target) +
                     (size_t)rank * (size_t)a.m_local * row_bytes;
    for (int chunk = 0; chunk < plan.nchunks && st == TW_SUCCESS; chunk++) {
      const size_t row0 = (size_t)chunk * plan.rows_per_chunk;
      const size_t rows =
          row0 + plan.rows_per_chunk <= (size_t)a.m_local ? plan.rows_per_chunk : a.m_local - row0;
      char *dst = dst_base + row0 * row_bytes;
      const char *src = (const char *)a.a + row0 * row_bytes;
      if (dst != src)
        st = tw_cuda_check(
            cudaMemcpyAsync(dst, src, rows * row_bytes, cudaMemcpyDeviceToDevice, comm->ce_stream),
            "cudaMemcpyAsync(chunk)");
      uint64_t *flag = (uint64_t *)tw_heap_peer_ptr(
          comm, &comm->ctrl->flags[ch][tw_ag_gemm_flag_index(rank, chunk)], target);
      if (st == TW_SUCCESS)
        st = tw_cu_check(cu->cuStreamWriteValue64((CUstream)comm->ce_stream,
                                                  (CUdeviceptr)(uintptr_t)flag, epoch,
                                                  CU_STREAM_WRITE_VALUE_DEFAULT),
                         "cuStreamWriteValue64(chunk flag)");
    }
  }
  /* The call is complete for the caller once the copies (the gathered output) are too. */
  return st == TW_SUCCESS ? ce_join(comm, user) : st;
}

/* The plain GEMM of `rows` gathered rows at `a_rows` (packed, K wide) into the call's C, on the
 * rank's SMs; split_k -1 (K split by the shape where few tiles meet a long K) or 0. after_grid:
 * launched as a programmatic dependent of the allgather just enqueued (tw_gemm_sm90_opts_t). */
static tw_status_t gathered_gemm(tw_comm_t comm, const tw_ag_gemm_args_t &a, const void *a_rows,
                                 int64_t rows, int split_k, tw_stream_t stream,
                                 int after_grid = 0) {
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.c_dtype = a.c_dtype;
  g.a = a_rows, g.b = a.b, g.c = a.c;
  g.m = rows, g.n = a.n, g.k = a.k;
  g.lda = a.k, g.ldb = a.ldb, g.ldc = a.ldc;
  g.sm_count = comm->sm_budget;
  g.split_k = split_k;
  if (split_k < 0) { /* the slices as single CTAs through the workspace: more CTAs, same bits */
    g.workspace = comm->gemm_ws;
    g.workspace_bytes = TW_GEMM_WORKSPACE_BYTES;
  }
  tw_gemm_sm90_opts_t opts;
  memset(&opts, 0, sizeof(opts));
  opts.variant = -1;
  opts.after_grid = after_grid;
  opts.pointers_checked = 1; /* tw_ag_gemm's checks cover a_gathered, b and c */
  return tw_gemm_sm90_launch(&g, stream, &opts);
}

/* The fused kernel's call (runtime/calldesc.h) on channel ch: what every rank must have alike.
 * The copy-engine mode cuts its chunks later (copy_engine_call), from these alike values. */
static tw_call_desc_t describe_call(tw_comm_t comm, const tw_ag_gemm_args_t &a,
                                    const tw_ag_gemm_plan_t &plan, int ch) {
  const uint64_t route = ch == TW_CH_AG_GEMM_CE ? 2 : plan.peer_read ? 1 : comm->nodes > 1 ? 3 : 0;
  const uint64_t fields[] = {(uint64_t)a.m_local, (uint64_t)a.k,
                             tw_call_heap_field(comm, a.a_gathered), route,
                             (uint64_t)plan.rows_per_chunk};
  /* What only this rank's side of the product shapes stays out: n and c_dtype (B and C are the
   * rank's own) and the write-through gather (plan.peer_gather: this rank's own slots; it
   * follows args->no_gathered_out). Where they change the exchange, route says so. */
  return tw_call_begin(comm, ch, 5, fields);
}

extern "C" tw_status_t tw_ag_gemm(tw_comm_t comm, const tw_ag_gemm_args_t *args,
                                  tw_stream_t stream) {
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_ag_gemm_args_t a;
  tw_ag_gemm_plan_t plan;
  st = tw_ag_gemm_prepare(comm, args, &a, &plan);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const size_t shard_bytes = (size_t)a.m_local * (size_t)a.k * 2;
  const void *own_slot = (const char *)a.a_gathered + shard_bytes * (size_t)comm->rank;
  /* World 1 with nothing to gather and nothing to copy: the plain GEMM, whatever the mode. */
  const int plain = comm->world == 1 && (a.a == own_slot || a.no_gathered_out);
  /* Few output tiles over a long K (decode: M=64 N=1024 K=8192 is 8 tiles of 128 x 128): the
   * fused kernel's GEMM leaves most SMs idle and its communication overlaps nothing, so the call
   * is the unfused pipeline, tw_allgather then tw_gemm with K split over CTA clusters (split_k
   * -1: the slices by the shape alone, the same bits as that pipeline run by the caller; the
   * route by tw_gemm_tree_split, so -1 may also keep a swapped product unsplit there). At
   * these shapes the fused op trails NCCL + cuBLAS while the pipeline beats them (its figures:
   * docs/PERF.md, the decode rows). TW_AG_UNFUSED_SMALL=0 keeps the fused kernel. */
  const int small_unfused = tw_env_int(TW_AG_UNFUSED_SMALL_ID) != 0;
  /* (across nodes the fused kernel's rail path always: tw_allgather has none) */
  const int unfused = !plain && small_unfused && comm->nodes == 1 &&
                      tw_gemm_tree_split(a.m_local * comm->world, a.n, a.k) > 1;
  if (!plain && !unfused && a.comm_mode == TW_AG_COMM_COPY_ENGINE) {
    /* The copy-engine mode is eager only (its flag values are fixed when enqueued): under
     * capture AUTO keeps the SMs (the plan is the same for both modes where it can choose the
     * copy engine: no peer reads, no own-slot copy engine); an explicit request fails. */
    int captured = 0;
    st = capturing(stream, &captured);
    if (st == TW_SUCCESS && captured && !plan.auto_ce)
      st = tw_fail(TW_ERR_NOT_SUPPORTED,
                   "args->comm_mode: TW_AG_COMM_COPY_ENGINE cannot be captured into a CUDA graph "
                   "(its flag values are fixed when enqueued); use TW_AG_COMM_SM");
    if (st != TW_SUCCESS)
      return tw_comm_result(comm, st);
    if (captured)
      a.comm_mode = TW_AG_COMM_SM;
  }
  int prev;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (plain) {
    /* Nothing to gather and nothing to copy: the product is the plain GEMM of the shard
     * (the same core and tile order rules, so the same bits as the unfused pipeline), without
     * the fused kernel's handshakes, flags and larger parameter block. */
    st = gathered_gemm(comm, a, a.a, a.m_local, small_unfused ? -1 : 0, stream);
    if (st == TW_SUCCESS && a.no_gathered_out && a.a != own_slot)
      st = tw_cuda_check(cudaMemcpyAsync((void *)own_slot, a.a, shard_bytes,
                                         cudaMemcpyDeviceToDevice, (cudaStream_t)stream),
                         "tw_ag_gemm: cudaMemcpyAsync(own slot)");
  } else if (unfused) {
    /* On GPUs of their own the GEMM's CTAs start beside the allgather's (which
     * wait only on their peers' allgathers, never on this GPU's other work) and stream B into
     * L2 meanwhile; on a shared GPU they could hold the SMs a co-resident rank's allgather
     * needs, so they start after it there. */
    const int pdl = !comm->gpu_shared; /* a programmatic dependent of the allgather */
    st = tw_allgather(comm, a.a, a.a_gathered, shard_bytes, stream);
    if (st == TW_SUCCESS)
      st = gathered_gemm(comm, a, a.a_gathered, a.m_local * comm->world, -1, stream, pdl);
  } else if (a.comm_mode == TW_AG_COMM_COPY_ENGINE) {
    const tw_call_desc_t outer = describe_call(comm, a, plan, TW_CH_AG_GEMM_CE);
    st = copy_engine_call(comm, a, plan, stream);
    tw_call_end(comm, outer);
  } else {
    const tw_call_desc_t outer = describe_call(comm, a, plan, TW_CH_AG_GEMM);
    /* plan.own_copy_ce (tw_ag_gemm_prepare): a copy engine fills the own slot, forked from and
     * joined back into the caller's stream. */
    if (plan.own_copy_ce) {
      st = ce_fork(comm, stream);
      if (st == TW_SUCCESS)
        st = tw_cuda_check(cudaMemcpyAsync((void *)own_slot, a.a, shard_bytes,
                                           cudaMemcpyDeviceToDevice, comm->ce_stream),
                           "tw_ag_gemm: cudaMemcpyAsync(own slot)");
    }
    cudaStream_t launch = NULL;
    if (st == TW_SUCCESS)
      st = tw_launch_begin(comm, stream, &launch);
    if (st == TW_SUCCESS)
      st = run_dtype(comm, a, plan, TW_CH_AG_GEMM, 0, launch);
    if (st == TW_SUCCESS)
      st = tw_launch_end(comm, stream);
    if (st == TW_SUCCESS && plan.own_copy_ce)
      st = ce_join(comm, stream);
    tw_call_end(comm, outer);
  }
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}
