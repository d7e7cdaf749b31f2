/*
 * tw_gemm_rs (GEMM + ReduceScatter) and tw_gemm_ar (GEMM + AllReduce): the entry points, the
 * argument checks and the plan (gemm_rs_heuristics.c), the workspace size query, and the op's
 * registration with the runtime. A call runs one of three routes: world 1 the plain GEMM
 * (run_single), decode shapes the unfused pipeline (gemm_rs_unfused.cu), everything else the
 * fused persistent kernel (gemm_rs_fused.cuh, launched by gemm_rs_fused.cu). Geometry, flags
 * and workspace: gemm_rs.h.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdio.h>
#include <string.h>

#include "ops/gemm/gemm_sm90.h"
#include "ops/gemm_rs/gemm_rs.h"
#include "ops/gemm_rs/gemm_rs_impl.h"
#include "ops/gemm_rs/gemm_rs_rail.h"

extern "C" {
#include "core/env.h"
#include "core/log.h"
#include "runtime/argcheck.h"
#include "runtime/calldesc.h"
#include "runtime/comm.h"
#include "runtime/comm_net.h"
#include "runtime/cuda_check.h"
#include "runtime/registry.h"
}

using tw::rs::run_fused;
using tw::rs::run_rail;
using tw::rs::run_unfused;

namespace {

/* World 1: the sum is the product itself; the plain GEMM core writes it as bf16 (the same
 * rounding of the same fp32 accumulators as the fused path would do). */
tw_status_t run_single(tw_comm_t comm, const tw_gemm_rs_args_t &a, cudaStream_t stream) {
  return tw::rs::plain_gemm(comm, a, a.out, TW_BF16, a.ldo, stream);
}

} // namespace

/* The args' a x b^T by tw_gemm's core on the comm's SM budget, into c (c_dtype, ldc);
 * check_pointers covered a and b, and the caller c. */
tw_status_t tw::rs::plain_gemm(tw_comm_t comm, const tw_gemm_rs_args_t &a, void *c,
                               tw_dtype_t c_dtype, int64_t ldc, cudaStream_t stream) {
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.c_dtype = c_dtype;
  g.a = a.a, g.b = a.b, g.c = c;
  g.m = a.m, g.n = a.n, g.k = a.k;
  g.lda = a.lda, g.ldb = a.ldb, g.ldc = ldc;
  g.sm_count = comm->sm_budget;
  tw_gemm_sm90_opts_t opts;
  memset(&opts, 0, sizeof(opts));
  opts.variant = -1;
  opts.pointers_checked = 1;
  return tw_gemm_sm90_launch(&g, (tw_stream_t)stream, &opts);
}

namespace {

/* The caller's arguments over this library's defaults (an older caller's struct is shorter),
 * after checking that it is one: not NULL, initialised with TW_GEMM_RS_ARGS_INIT. */
tw_status_t copy_args(const char *op, const tw_gemm_rs_args_t *in, tw_gemm_rs_args_t *a) {
  TW_ARG_CHECK(in != NULL, "%s: args: NULL", op);
  TW_ARG_CHECK(in->size >= offsetof(tw_gemm_rs_args_t, reduce_sms) && in->size <= 65536,
               "%s: args->size: %zu; initialise with TW_GEMM_RS_ARGS_INIT", op, in->size);
  TW_ARG_CHECK(in->version >= 1 && in->version <= TW_GEMM_RS_ARGS_VERSION,
               "%s: args->version: %u; this library knows 1..%d", op, in->version,
               TW_GEMM_RS_ARGS_VERSION);
  tw_gemm_rs_args_t init = TW_GEMM_RS_ARGS_INIT;
  *a = init;
  memcpy(a, in, in->size < sizeof(*a) ? in->size : sizeof(*a));
  a->size = sizeof(*a);
  return TW_SUCCESS;
}

/* The arguments every route needs (types, shape, leading dimensions, alignment, reduce_sms),
 * naming the bad one; resolves the leading dimensions' defaults. */
tw_status_t check_args(tw_comm_t comm, const char *op, tw_gemm_rs_args_t *a) {
  const int world = comm->world;
  TW_ARG_CHECK(a->out_dtype == TW_BF16, "%s: args->out_dtype: %d; expected TW_BF16", op,
               (int)a->out_dtype);
  TW_ARG_CHECK(a->partials == TW_PARTIALS_FP32 || a->partials == TW_PARTIALS_BF16,
               "%s: args->partials: %d; expected TW_PARTIALS_FP32 (0) or TW_PARTIALS_BF16 (1)", op,
               (int)a->partials);
  TW_ARG_CHECK(a->a && a->b && a->out, "%s: args->%s: NULL", op, !a->a ? "a" : !a->b ? "b" : "out");
  TW_ARG_CHECK(a->m >= 1 && a->m <= INT32_MAX, "%s: args->m: %lld; expected 1 <= m < 2^31", op,
               (long long)a->m);
  TW_ARG_CHECK(a->m % world == 0,
               "%s: args->m: %lld is not divisible by the world size %d (each rank owns m / "
               "world rows)",
               op, (long long)a->m, world);
  TW_ARG_CHECK(a->n >= 8 && a->n % 8 == 0 && a->n <= INT32_MAX,
               "%s: args->n: %lld; expected a positive multiple of 8", op, (long long)a->n);
  TW_ARG_CHECK(a->k >= 8 && a->k % 8 == 0 && a->k <= INT32_MAX,
               "%s: args->k: %lld; expected a positive multiple of 8", op, (long long)a->k);
  if (a->lda == 0)
    a->lda = a->k;
  if (a->ldb == 0)
    a->ldb = a->k;
  if (a->ldo == 0)
    a->ldo = a->n;
  TW_ARG_CHECK(a->lda >= a->k && a->lda % 8 == 0,
               "%s: args->lda: %lld; expected >= k (%lld) and a multiple of 8", op,
               (long long)a->lda, (long long)a->k);
  TW_ARG_CHECK(a->ldb >= a->k && a->ldb % 8 == 0,
               "%s: args->ldb: %lld; expected >= k (%lld) and a multiple of 8", op,
               (long long)a->ldb, (long long)a->k);
  TW_ARG_CHECK(a->ldo >= a->n && a->ldo % 8 == 0,
               "%s: args->ldo: %lld; expected >= n (%lld) and a multiple of 8", op,
               (long long)a->ldo, (long long)a->n);
  TW_ARG_CHECK((uintptr_t)a->a % 16 == 0, "%s: args->a: %p is not 16-byte aligned", op, a->a);
  TW_ARG_CHECK((uintptr_t)a->b % 16 == 0, "%s: args->b: %p is not 16-byte aligned", op, a->b);
  TW_ARG_CHECK((uintptr_t)a->out % 16 == 0, "%s: args->out: %p is not 16-byte aligned", op, a->out);
  TW_ARG_CHECK(a->reduce_sms >= 0 && a->reduce_sms < comm->sm_budget,
               "%s: args->reduce_sms: %d; expected 0 (heuristic) or fewer than the rank's %d SMs",
               op, a->reduce_sms, comm->sm_budget);
  return TW_SUCCESS;
}

/* The operands are memory of the rank's device as large as the shapes make them (out: this
 * rank's m / world rows for tw_gemm_rs, all m for tw_gemm_ar), and out and the workspace (both
 * written) overlap no other argument. */
tw_status_t check_pointers(tw_comm_t comm, const char *op, const tw_gemm_rs_args_t &a,
                           int all_reduce) {
  char what[64];
  const int64_t out_rows = all_reduce ? a.m : a.m / comm->world;
  const size_t a_bytes = (size_t)((a.m - 1) * a.lda + a.k) * 2;
  const size_t b_bytes = (size_t)((a.n - 1) * a.ldb + a.k) * 2;
  const size_t out_bytes = (size_t)((out_rows - 1) * a.ldo + a.n) * 2;
  const size_t ws_bytes = !a.workspace ? 0
                          : comm->nodes > 1
                              ? tw_rs_rail_workspace_bytes(comm->world, comm->nodes, a.m, a.n)
                              : tw_gemm_rs_workspace_bytes(comm->world, a.m, a.n);
  const void *ptrs[3] = {a.a, a.b, a.out};
  const size_t sizes[3] = {a_bytes, b_bytes, out_bytes};
  const char *names[3] = {"a", "b", "out"};
  tw_status_t st = TW_SUCCESS;
  for (int i = 0; i < 3 && st == TW_SUCCESS; i++) {
    snprintf(what, sizeof(what), "%s: args->%s", op, names[i]);
    st = tw_comm_check_range(comm, ptrs[i], sizes[i], what);
  }
  for (int i = 0; i < 2 && st == TW_SUCCESS; i++) {
    snprintf(what, sizeof(what), "%s: args->out", op);
    st = tw_check_disjoint(a.out, out_bytes, what, ptrs[i], sizes[i], names[i]);
  }
  for (int i = 0; i < 3 && st == TW_SUCCESS && a.workspace; i++) {
    snprintf(what, sizeof(what), "%s: args->workspace", op);
    st = tw_check_disjoint(a.workspace, ws_bytes, what, ptrs[i], sizes[i], names[i]);
  }
  return st;
}

/* What the fused op and the unfused pipeline need of the comm and the workspace: two SMs,
 * at most TW_GEMM_RS_MAX_WORLD ranks, a workspace in the symmetric heap that holds one call,
 * and every rank mapped into this process. */
tw_status_t check_comm(tw_comm_t comm, const char *op, const tw_gemm_rs_args_t &a) {
  const int world = comm->world;
  if (comm->sm_budget < 2)
    return tw_fail(TW_ERR_NOT_SUPPORTED,
                   "%s: the rank's SM budget is %d; the fused op needs at least 2 (a GEMM CTA and "
                   "a reduce CTA)",
                   op, comm->sm_budget);
  if (world > TW_GEMM_RS_MAX_WORLD)
    return tw_fail(TW_ERR_NOT_SUPPORTED, "%s: world %d; the fused op serves 1 to %d ranks", op,
                   world, TW_GEMM_RS_MAX_WORLD);
  TW_ARG_CHECK(a.workspace != NULL,
               "%s: args->workspace: NULL; allocate tw_gemm_rs_workspace_size() bytes with "
               "tw_mem_alloc",
               op);
  TW_ARG_CHECK((uintptr_t)a.workspace % 128 == 0, "%s: args->workspace: %p is not 128-byte aligned",
               op, a.workspace);
  if (comm->nodes > 1) { /* the rail path (gemm_rs_rail.h) */
    tw_rail_t r;
    tw_status_t st = tw_comm_rail(comm, op, &r);
    if (st != TW_SUCCESS)
      return st;
    const size_t need = tw_rs_rail_workspace_bytes(world, comm->nodes, a.m, a.n);
    st = tw_heap_lookup(comm, a.workspace, 1, "args->workspace", NULL);
    if (st != TW_SUCCESS)
      return st;
    if (tw_heap_avail(comm, a.workspace) < need)
      return tw_fail(TW_ERR_INVALID_ARGUMENT,
                     "%s: args->workspace: %zu bytes from it in the heap allocation; across %d "
                     "nodes the op needs %zu (tw_gemm_rs_workspace_size on this comm)",
                     op, tw_heap_avail(comm, a.workspace), comm->nodes, need);
    return TW_SUCCESS;
  }
  tw_status_t st = tw_heap_lookup(comm, a.workspace, tw_gemm_rs_workspace_bytes(world, a.m, a.n),
                                  "args->workspace", NULL);
  if (st != TW_SUCCESS)
    return st;
  for (int r = 0; r < world; r++)
    if (!tw_heap_peer_ptr(comm, a.workspace, r) || !comm->dev.peer_ctrl[r])
      return tw_fail(TW_ERR_INTERNAL, "%s: rank %d of this node is not mapped here", op, r);
  return TW_SUCCESS;
}

/* Bytes of one partial's element: 2 (TW_PARTIALS_BF16) or 4. */
int partial_bytes(const tw_gemm_rs_args_t &a) { return a.partials == TW_PARTIALS_BF16 ? 2 : 4; }

/* The planner's inputs for a call planned on plan_world ranks (1 for tw_gemm_ar's direct
 * scheme): the shapes, the comm's placement facts and the knobs. */
tw_gemm_rs_plan_args_t plan_args(tw_comm_t comm, const tw_gemm_rs_args_t &a, int plan_world,
                                 int all_reduce) {
  tw_gemm_rs_plan_args_t pa;
  memset(&pa, 0, sizeof(pa));
  pa.world = plan_world;
  pa.m = a.m, pa.n = a.n, pa.k = a.k;
  pa.sm_budget = comm->sm_budget;
  pa.reduce_sms_arg = a.reduce_sms;
  pa.all_reduce = all_reduce;
  pa.band_env = (int)tw_env_int(TW_RS_BAND_ID);
  pa.partial_bytes = partial_bytes(a);
  pa.comm_world = comm->world;
  pa.shared_gpu = comm->gpu_shared;
  pa.interleave_env = (int)tw_env_int(TW_RS_INTERLEAVE_ID);
  pa.reduce_env = (int)tw_env_int(TW_RS_REDUCE_CTAS_ID);
  pa.group_env = (int)tw_env_int(TW_RS_GROUP_UNITS_ID);
  pa.plan_sms = comm->plan_sms;
  pa.owner_env = (int)tw_env_int(TW_RS_OWNER_EPI_ID);
  pa.pull_env = (int)tw_env_int(TW_RS_PULL_ID);
  pa.block_n_env = (int)tw_env_int(TW_RS_BLOCK_N_ID);
  return pa;
}

/* The fused kernel's plan (gemm_rs_heuristics.c), plan->direct included. */
void plan_fused(tw_comm_t comm, const tw_gemm_rs_args_t &a, int all_reduce,
                tw_gemm_rs_plan_t *plan) {
  const int world = comm->world;
  /* tw_gemm_ar's direct scheme (tw_gemm_ar_want_direct, TW_AR_DIRECT), where the workspace
   * holds it: planned as a reduce-scatter with one owner of all m rows (every rank reduces them
   * all). */
  const int pbytes = partial_bytes(a);
  const int direct = all_reduce &&
                     tw_gemm_ar_want_direct((int)tw_env_int(TW_AR_DIRECT_ID), world,
                                            comm->gpu_shared, pbytes, a.m, a.k) &&
                     tw_heap_avail(comm, a.workspace) >=
                         tw_gemm_ar_direct_workspace_bytes(world, a.m, a.n, pbytes);
  tw_gemm_rs_plan_args_t pa = plan_args(comm, a, direct ? 1 : world, direct ? 0 : all_reduce);
  tw_gemm_rs_make_plan(&pa, plan);
  plan->direct = direct;
}

/* Symmetric outputs (args.out_symmetric): the owners store their reduced rows into every
 * rank's out (NVLink stores, or HBM where ranks share a GPU) and nobody copies them, neither
 * the push's nor the pull's copy. */
tw_status_t plan_out_symmetric(tw_comm_t comm, const char *op, const tw_gemm_rs_args_t &a,
                               int all_reduce, tw_gemm_rs_plan_t *plan) {
  if (!all_reduce || !a.out_symmetric)
    return TW_SUCCESS;
  TW_ARG_CHECK(a.out_symmetric == 1, "%s: args->out_symmetric: %d; expected 0 or 1", op,
               (int)a.out_symmetric);
  tw_status_t st = tw_heap_lookup(comm, a.out, (size_t)((a.m - 1) * a.ldo + a.n) * 2,
                                  "args->out (out_symmetric)", NULL);
  if (st != TW_SUCCESS)
    return st;
  plan->ar_out_sym = !plan->direct;
  return TW_SUCCESS;
}

/* The unfused pipeline (tw_gemm_rs_want_unfused) where the workspace holds this rank's
 * partial (and, for tw_gemm_ar into a plain out, every rank's reduced rows after it). */
void plan_unfused(tw_comm_t comm, const tw_gemm_rs_args_t &a, int all_reduce,
                  tw_gemm_rs_plan_t *plan) {
  const int world = comm->world, pbytes = partial_bytes(a);
  /* tw_gemm_ar into a plain out where every rank lives in this process on this GPU: the
   * unfused pipeline can store into the peers' outs themselves (TW_AR_PEER_OUT), as into
   * symmetric outputs, with no gather area */
  const int peer_out = all_reduce && !a.out_symmetric && comm->one_process &&
                       comm->ranks_on_device == world && tw_env_int(TW_AR_PEER_OUT_ID) != 0;
  /* tw_gemm_ar's unfused pipeline can store its rows straight into every rank's out */
  const int stores_all = all_reduce && (a.out_symmetric || peer_out);
  plan->unfused =
      tw_gemm_rs_want_unfused((int)tw_env_int(TW_RS_UNFUSED_SMALL_ID), world, comm->gpu_shared, a.m,
                              a.k, pbytes, all_reduce, stores_all) &&
      tw_heap_avail(comm, a.workspace) >=
          tw_gemm_rs_unfused_workspace_bytes(a.m, a.n, pbytes, all_reduce && !stores_all);
  if (plan->unfused)
    plan->ar_out_sym = all_reduce && a.out_symmetric; /* checked by plan_out_symmetric */
  /* its rows through the comm's low-latency area where they fit (TW_RS_UNFUSED_LL) */
  plan->ll = plan->unfused &&
             tw_gemm_rs_want_ll((int)tw_env_int(TW_RS_UNFUSED_LL_ID), world, a.m, a.n, pbytes,
                                all_reduce, comm->ll_bytes, comm->gpu_shared && stores_all,
                                tw_gemm_rs_swap_max_m(comm->gpu_shared));
  plan->ar_peer_out = plan->unfused && !plan->ll && peer_out;
}

/* tw_gemm_ar's push gather (TW_AR_PUSH, the default) where the workspace holds every owner's
 * reduced rows (tw_gemm_rs_workspace_size asks for that much) and no two ranks share a GPU
 * (comm->gpu_shared, which every rank sees alike, as the choice must be: by ranks_on_device,
 * 3 ranks on 2 GPUs would mix push and pull in one call).
 * On GPUs of their own the push turns the gather's NVLink loads into stores, which are faster.
 * Where ranks share a GPU they keep loading: there the owner's world - 1 extra copies are HBM
 * traffic that loads do not add (figures: docs/PERF.md). */
void plan_push(tw_comm_t comm, const tw_gemm_rs_args_t &a, int all_reduce,
               tw_gemm_rs_plan_t *plan) {
  const int64_t push_env = tw_env_int(TW_AR_PUSH_ID);
  plan->ar_push =
      all_reduce && !plan->direct && !plan->unfused && !plan->ar_out_sym &&
      (push_env > 0 || (push_env < 0 && !comm->gpu_shared)) &&
      tw_heap_avail(comm, a.workspace) >= tw_gemm_ar_push_workspace_bytes(comm->world, a.m, a.n);
}

/* Across nodes (plan->rail, gemm_rs_rail.cu): the fused plan's tiling and CTAs, without the
 * schemes of one node (direct, pull, owner epilogue, push, symmetric outputs, low-latency
 * rows); the unfused pipeline only where TW_RS_UNFUSED_SMALL=1 asks for it. Unit groups are
 * made large enough that an owner's fit the rail flags (gemm_rs_rail.h), and (unless
 * TW_RS_GROUP_UNITS sets them) that each carries TW_RS_RAIL_WRITE_BYTES. */
void plan_rail(tw_comm_t comm, const tw_gemm_rs_args_t &a, tw_gemm_rs_plan_t *plan) {
  const int world = comm->world, nodes = comm->nodes;
  tw_gemm_rs_plan_args_t pa = plan_args(comm, a, world, 0);
  pa.interleave_env = pa.owner_env = pa.pull_env = 0; /* schemes of one node */
  tw_gemm_rs_make_rail_plan(&pa, nodes, (int)tw_env_int(TW_RS_UNFUSED_SMALL_ID), plan);
}

/* Validates (naming the bad argument), resolves defaults and plans the call: world 1 the plain
 * GEMM (plan->single), else the fused kernel or the unfused pipeline and their options. */
tw_status_t prepare(tw_comm_t comm, const tw_gemm_rs_args_t *in, int all_reduce,
                    tw_gemm_rs_args_t *a, tw_gemm_rs_plan_t *plan) {
  const char *op = all_reduce ? "tw_gemm_ar" : "tw_gemm_rs";
  tw_status_t st = copy_args(op, in, a);
  if (st == TW_SUCCESS)
    st = check_args(comm, op, a);
  if (st == TW_SUCCESS)
    st = check_pointers(comm, op, *a, all_reduce);
  if (st != TW_SUCCESS)
    return st;
  /* World 1 is the plain GEMM, unless TW_RS_FUSED_W1 asks for the fused kernel (measurement:
   * with no peer to wait for it can run under ncu's kernel replay). */
  if (comm->world == 1 && !tw_env_int(TW_RS_FUSED_W1_ID)) {
    plan->single = 1;
    return TW_SUCCESS;
  }
  st = check_comm(comm, op, *a);
  if (st != TW_SUCCESS)
    return st;
  if (comm->nodes > 1) {
    plan_rail(comm, *a, plan);
    TW_DEBUG("%s rank %d: the rail path, m %lld n %lld k %lld: ctas %d, block_n %d, reduce_ctas "
             "%d, band %d, group_units %d, unfused %d",
             op, comm->rank, (long long)a->m, (long long)a->n, (long long)a->k, plan->ctas,
             plan->block_n, plan->reduce_ctas, plan->band, plan->group_units, plan->unfused);
    return TW_SUCCESS;
  }
  plan_fused(comm, *a, all_reduce, plan);
  st = plan_out_symmetric(comm, op, *a, all_reduce, plan);
  if (st != TW_SUCCESS)
    return st;
  plan_unfused(comm, *a, all_reduce, plan);
  plan_push(comm, *a, all_reduce, plan);
  TW_DEBUG(
      "%s rank %d: m %lld n %lld k %lld, %s partials: ctas %d, block_n %d, reduce_ctas %d, band "
      "%d, group_units %d, interleave %d, direct %d, owner_epi %d, pull %d, ar_push %d, "
      "ar_out_sym %d, unfused %d, ll %d, ar_peer_out %d",
      op, comm->rank, (long long)a->m, (long long)a->n, (long long)a->k,
      partial_bytes(*a) == 2 ? "bf16" : "fp32", plan->ctas, plan->block_n, plan->reduce_ctas,
      plan->band, plan->group_units, plan->interleave, plan->direct, plan->owner_epi, plan->pull,
      plan->ar_push, plan->ar_out_sym, plan->unfused, plan->ll, plan->ar_peer_out);
  return TW_SUCCESS;
}

/* The call (runtime/calldesc.h): what every rank must have alike, the plan's choices that fix
 * the exchange included (every input of the plan is alike on every rank). */
tw_call_desc_t describe_call(tw_comm_t comm, const tw_gemm_rs_args_t &a,
                             const tw_gemm_rs_plan_t &plan, int all_reduce) {
  const uint64_t path = (uint64_t)plan.unfused | (uint64_t)plan.ll << 1 |
                        (uint64_t)plan.direct << 2 | (uint64_t)plan.pull << 3 |
                        (uint64_t)plan.owner_epi << 4 | (uint64_t)plan.interleave << 5 |
                        (uint64_t)plan.ar_push << 6 | (uint64_t)plan.ar_peer_out << 7 |
                        (uint64_t)plan.ar_out_sym << 8 | (uint64_t)plan.rail << 9;
  const uint64_t tiling = (uint64_t)(uint16_t)plan.band | (uint64_t)(uint16_t)plan.block_n << 16 |
                          (uint64_t)(uint32_t)plan.group_units << 32;
  /* k stays out: the partials are m x n whatever each rank's share of K; where it changes the
   * plan's exchange, path and tiling say so. */
  const uint64_t fields[] = {(uint64_t)a.m,
                             (uint64_t)a.n,
                             (uint64_t)partial_bytes(a),
                             tw_call_heap_field(comm, a.workspace),
                             plan.ar_out_sym ? tw_call_heap_field(comm, a.out) : 0,
                             path,
                             tiling};
  return tw_call_begin(comm, all_reduce ? TW_CH_GEMM_AR : TW_CH_GEMM_RS, 7, fields);
}

tw_status_t gemm_rs_op(tw_comm_t comm, const tw_gemm_rs_args_t *args, int all_reduce,
                       tw_stream_t stream) {
  tw_status_t st = tw_comm_check_call(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  tw_gemm_rs_args_t a;
  tw_gemm_rs_plan_t plan;
  memset(&plan, 0, sizeof(plan)); /* the fields a route's planner leaves alone are off */
  st = prepare(comm, args, all_reduce, &a, &plan);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  int prev;
  st = tw_set_device(comm->device, &prev);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  const tw_call_desc_t outer = describe_call(comm, a, plan, all_reduce);
  cudaStream_t launch_stream = NULL;
  st = tw_launch_begin(comm, stream, &launch_stream);
  if (st == TW_SUCCESS)
    st = plan.single ? run_single(comm, a, launch_stream)
         : plan.rail ? (a.partials == TW_PARTIALS_BF16
                            ? run_rail<__nv_bfloat16>(comm, a, plan, all_reduce, launch_stream)
                            : run_rail<float>(comm, a, plan, all_reduce, launch_stream))
         : plan.unfused
             ? (a.partials == TW_PARTIALS_BF16
                    ? run_unfused<__nv_bfloat16>(comm, a, plan, all_reduce, launch_stream)
                    : run_unfused<float>(comm, a, plan, all_reduce, launch_stream))
         : a.partials == TW_PARTIALS_BF16
             ? run_fused<__nv_bfloat16>(comm, a, plan, all_reduce, launch_stream)
             : run_fused<float>(comm, a, plan, all_reduce, launch_stream);
  if (st == TW_SUCCESS)
    st = tw_launch_end(comm, stream);
  tw_call_end(comm, outer);
  cudaSetDevice(prev);
  return tw_comm_result(comm, st);
}

} // namespace

static tw_status_t tw_gemm_rs_preload(void) {
  cudaError_t e = tw::rs::preload_fused();
  if (e == cudaSuccess)
    e = tw::rs::preload_unfused();
  if (e == cudaSuccess)
    e = tw::rs::preload_rail();
  return tw_cuda_check(e, "loading the gemm_rs kernels");
}

/* tw_gemm_rs and tw_gemm_ar, registered with the runtime (runtime/registry.h). */
#define GEMM_RS_CALL_FIELDS                                                                        \
  {                                                                                                \
    "m", "n", "partial bytes (args->partials)", "workspace (heap offset)", "out (heap offset)",    \
        "path (bits: unfused, ll, direct, pull, owner_epi, interleave, ar_push, ar_peer_out, "     \
        "ar_out_sym, rail)",                                                                       \
        "tiling (band | block_n << 16 | group_units << 32)"                                        \
  }
static const tw_call_fields_t gemm_rs_calls[] = {
    {TW_CH_GEMM_RS, "tw_gemm_rs", GEMM_RS_CALL_FIELDS},
    {TW_CH_GEMM_AR, "tw_gemm_ar", GEMM_RS_CALL_FIELDS}};
#undef GEMM_RS_CALL_FIELDS
static const tw_op_desc_t gemm_rs_registration = {"gemm_rs", tw_gemm_rs_preload, gemm_rs_calls, 2};
TW_OP_REGISTER(gemm_rs, gemm_rs_registration);

extern "C" tw_status_t tw_gemm_rs_args_init(tw_gemm_rs_args_t *args) {
  TW_ARG_CHECK(args != NULL, "args: NULL");
  tw_gemm_rs_args_t init = TW_GEMM_RS_ARGS_INIT;
  *args = init;
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_gemm_rs_workspace_size(tw_comm_t comm, int64_t m, int64_t n,
                                                 size_t *bytes) {
  tw_status_t st = tw_comm_check(comm);
  if (st != TW_SUCCESS)
    return tw_comm_result(comm, st);
  if (!bytes)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT, "bytes: NULL"));
  if (m < 1 || m % comm->world)
    return tw_comm_result(comm, tw_fail(TW_ERR_INVALID_ARGUMENT,
                                        "m: %lld; expected a positive multiple of the world "
                                        "size %d",
                                        (long long)m, comm->world));
  if (n < 8 || n % 8)
    return tw_comm_result(comm,
                          tw_fail(TW_ERR_INVALID_ARGUMENT,
                                  "n: %lld; expected a positive multiple of 8", (long long)n));
  *bytes = tw_gemm_rs_call_workspace_bytes(comm->world, m, n);
  if (comm->nodes > 1) /* the rail path's (gemm_rs_rail.h) */
    *bytes = tw_rs_rail_workspace_bytes(comm->world, comm->nodes, m, n);
  return TW_SUCCESS;
}

extern "C" tw_status_t tw_gemm_rs(tw_comm_t comm, const tw_gemm_rs_args_t *args,
                                  tw_stream_t stream) {
  return gemm_rs_op(comm, args, 0, stream);
}

extern "C" tw_status_t tw_gemm_ar(tw_comm_t comm, const tw_gemm_rs_args_t *args,
                                  tw_stream_t stream) {
  return gemm_rs_op(comm, args, 1, stream);
}
