/*
 * tw_gemm_rs / tw_gemm_ar launch plan. Reduce CTAs: enough that the reduction
 * (reading world partials of this rank's rows, fp32 or bf16, writing bf16) keeps pace
 * with the GEMM, estimated from the per-CTA rates the plan assumes: a GEMM CTA does about
 * 5.5 TFLOP/s, a reduce CTA moves about 60 GB/s (above a copy CTA's rate: the reduce CTA keeps
 * world loads in flight per thread). GEMM CTAs join the reduction when the tile queue runs dry,
 * so the estimate only needs to be close. Traces put a reduce CTA beside a large GEMM below the
 * assumed rate, yet the counts the wave-boundary trim below leaves compared best in A/B runs, so
 * the constant stays until a rate-based estimate is compared against them (CHANGELOG.md's
 * development history has the figures behind the rules of this file).
 */
#include "ops/gemm_rs/gemm_rs.h"
#include "ops/gemm_rs/gemm_rs_rail.h"

#include "gemm/gemm_heuristics.h"
#include "runtime/devcomm.h"

#define TW_RS_REDUCE_GBPS_PER_CTA 60.0
#define TW_RS_GEMM_TFLOPS_PER_CTA 5.5
#define TW_RS_BAND_DEFAULT 8
#define TW_RS_BAND_SHARED 2
#define TW_RS_L2_BYTES (32.0 * 1024 * 1024) /* about half an H100 / H200 L2 */

size_t tw_gemm_rs_workspace_bytes(int world, int64_t m, int64_t n) {
  const size_t m_local = (size_t)(m / (world > 0 ? world : 1));
  return (size_t)world * m_local * (size_t)n * 4 + m_local * (size_t)n * 2;
}

size_t tw_gemm_ar_push_workspace_bytes(int world, int64_t m, int64_t n) {
  const size_t m_local = (size_t)(m / (world > 0 ? world : 1));
  return (size_t)world * m_local * (size_t)n * 6;
}

size_t tw_gemm_ar_direct_workspace_bytes(int world, int64_t m, int64_t n, int partial_bytes) {
  return (size_t)world * (size_t)m * (size_t)n * (size_t)(partial_bytes == 2 ? 2 : 4);
}

int tw_gemm_ar_want_direct(int direct_env, int world, int gpu_shared, int partial_bytes, int64_t m,
                           int64_t k) {
  if (direct_env >= 0)
    return direct_env != 0;
  /* Two ranks on distinct GPUs, bf16 partials, long K, small m: the direct scheme moves the
   * same bytes as reduce-scatter + all-gather in one hop (each rank sends the other its
   * partial tiles) and has no gather phase; it reduces all m rows on each rank, twice the
   * reduction, which a long GEMM hides. At short K the doubled reduction shows (level at K
   * 2048, slower at K 512), and with fp32 partials the doubled bytes do. More ranks multiply
   * its bytes (world - 1 partials of all m rows per rank), so world 2 only. At decode shapes
   * (m < TW_AR_DIRECT_ANY_M, either partials, any K) there is no gather phase to wait for, and
   * it wins; from m 256 it no longer does. */
  return world == 2 && !gpu_shared &&
         ((partial_bytes == 2 && m <= 4096 && k >= 4096) || m < TW_AR_DIRECT_ANY_M);
}

int tw_gemm_rs_want_unfused(int env, int world, int gpu_shared, int64_t m, int64_t k,
                            int partial_bytes, int all_reduce, int stores_all) {
  if (world < 2 || env == 0)
    return 0;
  if (env > 0)
    return 1;
  /* Decode shapes: the GEMM is a few tiles (m <= 512 is 1-4 row blocks), so the fused kernel
   * has little to overlap its communication with, while its entry waits put the ranks' launch
   * skew in front of the GEMM. On GPUs of their own the unfused pipeline wins for tw_gemm_rs up
   * to m 512 and for tw_gemm_ar up to m 256 (at m 512 tw_gemm_ar is slower unfused), from CUDA
   * graphs and eager alike.
   * Where ranks share a GPU (their SMs and HBM are one another's):
   * - tw_gemm_ar at decode m (<= TW_AR_UNFUSED_SHARED_MAX_M). Into a plain out it is slower
   *   unfused above that m, and tw_gemm_rs is slower unfused at decode m.
   * - Short K (per rank <= TW_RS_UNFUSED_SHARED_MAX_K) with fp32 partials at m >=
   *   TW_RS_UNFUSED_SHARED_MIN_M: the GEMM is a few k-blocks that mostly store partials, so it
   *   has little math to hide the reduction behind, and the fused kernel's stores into the
   *   owners' staging and its flags cost more than they overlap; at the large shapes the card
   *   runs at its power limit and the bytes moved decide, not the overlap. Longer K (flux-tp8's
   *   6144) stays fused (slower or level unfused), and so do bf16 partials (mixed). tw_gemm_ar
   *   there only into outputs its pipeline stores straight into (symmetric outputs, or peer
   *   outs: TW_AR_PEER_OUT): into a plain out the pipeline's gather copy loses.
   * - tw_gemm_ar at m <= TW_AR_UNFUSED_SHARED_ANY_PARTIALS_MAX_M with K per rank <=
   * TW_RS_UNFUSED_SHARED_MAX_K, either partials, into symmetric or peer outs: the pipeline's
   * all-gather half is one store per row, and it wins at every shape with n >= 2048. At the
   * smallest shapes an eager call is launch-bound (two launches a rank) and loses, but from CUDA
   * graphs, how small calls run, it wins. tw_gemm_rs there stays fused (mixed). */
  if (gpu_shared) {
    const int short_k = k <= TW_RS_UNFUSED_SHARED_MAX_K;
    if (all_reduce && m <= TW_AR_UNFUSED_SHARED_MAX_M)
      return 1;
    if (all_reduce && stores_all && short_k && m <= TW_AR_UNFUSED_SHARED_ANY_PARTIALS_MAX_M)
      return 1;
    return partial_bytes == 4 && short_k && m >= TW_RS_UNFUSED_SHARED_MIN_M &&
           (!all_reduce || stores_all);
  }
  return m <= (all_reduce ? TW_AR_UNFUSED_MAX_M : TW_RS_UNFUSED_MAX_M);
}

size_t tw_gemm_rs_ll_bytes(int world, int64_t m, int64_t n, int partial_bytes, int all_reduce) {
  if (world < 2)
    return 0;
  const size_t rows = (size_t)(m / world) * (size_t)n; /* one slot's elements */
  const size_t rs = (size_t)world * rows * (size_t)(partial_bytes == 2 ? 2 : 4) * 2;
  const size_t ag = all_reduce ? (size_t)world * rows * 2 * 2 : 0;
  return 2 * (rs + ag);
}

int64_t tw_gemm_rs_swap_max_m(int gpu_shared) { return gpu_shared ? 64 : TW_GEMM_RS_SWAP_MAX_M; }

int tw_gemm_rs_want_ll(int env, int world, int64_t m, int64_t n, int partial_bytes, int all_reduce,
                       size_t ll_bytes, int shared_stores, int64_t swap_max_m) {
  if (env == 0 || world < 2 ||
      tw_gemm_rs_ll_bytes(world, m, n, partial_bytes, all_reduce) > ll_bytes)
    return 0;
  if (env > 0)
    return 1;
  /* Ranks sharing a GPU, tw_gemm_ar storing its rows into every rank's out: the words double
   * the bytes of stores that are HBM traffic anyway, and the stores into the outs win, except
   * with bf16 partials at decode m (<= TW_AR_UNFUSED_SHARED_MAX_M), where the area wins from
   * CUDA graphs (eager level). So the area stays only there. */
  if (shared_stores && (partial_bytes != 2 || m > TW_AR_UNFUSED_SHARED_MAX_M))
    return 0;
  /* The words carry as many flag bytes as data bytes: where a rank's rows for one peer pass
   * TW_LL_RULE_SLOT_BYTES, the pull's remote loads of half the bytes win. With the line layout
   * (tw_ll_item_off) the area still wins up to TW_LL_RULE_SWAP_SLOT_BYTES at the swap-AB
   * shapes, whose GEMM epilogue stores the words as each tile ends; above them, where the
   * reduce kernel pushes the partial after the GEMM, the area is level or slower past
   * TW_LL_RULE_SLOT_BYTES. The swap rule reads the shape and swap_max_m, which comes from the
   * comm's gpu_shared, so every rank decides alike whatever its knobs. The pipeline's GEMM swaps
   * up to m TW_GEMM_RS_SWAP_MAX_M: at m 128 its swapped tiles through the area beat 128-row
   * tiles through the pull. */
  const size_t slot = (size_t)(m / world) * (size_t)n * (size_t)(partial_bytes == 2 ? 2 : 4) * 2;
  return slot <= (tw_gemm_swap_bn_upto(-1, m, swap_max_m) ? TW_LL_RULE_SWAP_SLOT_BYTES
                                                          : TW_LL_RULE_SLOT_BYTES);
}

int tw_gemm_rs_want_ll_reduce(int env, int all_reduce, int64_t m) {
  if (all_reduce || env == 0)
    return 0;
  /* The epilogue's sum wins only at the 16-wide swap tiles (m <= TW_RS_LL_REDUCE_MAX_M); at m
   * 64 it is level with the reduce kernel. */
  return env > 0 || m <= TW_RS_LL_REDUCE_MAX_M;
}

size_t tw_gemm_rs_unfused_workspace_bytes(int64_t m, int64_t n, int partial_bytes, int gather) {
  return (size_t)m * (size_t)n * (size_t)(partial_bytes == 2 ? 2 : 4) +
         (gather ? (size_t)m * (size_t)n * 2 : 0);
}

size_t tw_gemm_rs_call_workspace_bytes(int world, int64_t m, int64_t n) {
  size_t bytes = tw_gemm_ar_push_workspace_bytes(world, m, n);
  /* tw_gemm_ar's direct scheme with fp32 partials where the rule may take it (2 ranks, m < 128):
   * world x m x n fp32, more than the push's world x m_local x n x 6 */
  if (world == 2 && m < TW_AR_DIRECT_ANY_M) {
    const size_t direct = tw_gemm_ar_direct_workspace_bytes(world, m, n, 4);
    if (direct > bytes)
      bytes = direct;
  }
  return bytes;
}

int tw_gemm_rs_want_owner_epi(int env, int reduce_set, int partial_bytes, int64_t k, int64_t tiles,
                              int ctas) {
  if (env >= 0)
    return env != 0;
  if (reduce_set)
    return 0;
  /* The own tile's epilogue saves its fp32 partial's store and re-read (and the reduce CTAs)
   * but stalls its consumer warpgroups on the peer's partial: a gain where the GEMM is short
   * of HBM bandwidth (short K), a loss where it is bound by the tensor cores (from K 4096, on 2
   * GPUs and on 2 virtual ranks alike). bf16 partials, half the bytes to save, lose at every K
   * but 512. So fp32 partials below K 4096.
   * The own tiles trail the peer's by two waves of CTAs, so with few tiles they all wait at the
   * end: under 2 waves it loses, from 3.9 it wins. So at least 3 waves. */
  return partial_bytes == 4 && k < 4096 && tiles >= 3 * (int64_t)ctas;
}

/* What the steps of tw_gemm_rs_make_plan share: the call's geometry once the tile width is
 * chosen. */
typedef struct rs_shape {
  int32_t m_local;   /* rows per owner */
  int plan_ctas;     /* plan_sms, else sm_budget: the CTA count every rank sizes alike by */
  int block_n;       /* the tile width */
  int64_t n_blocks;  /* column blocks of block_n */
  int64_t tiles;     /* 128 x block_n tiles of the m x n product (the wave and owner-epilogue
                        rules) */
  int64_t units_max; /* units of the owner with the most */
  int64_t stride;    /* the comm's flag stride (gemm_rs.h) */
} rs_shape_t;

/* The tile width: 128 columns (6 stages) where 128 x 256 tiles would leave a last wave of the
 * rank's CTAs mostly idle, by tw_gemm's own rule (decode shapes: M=64 n 8192 on 132 CTAs is
 * 32 wide tiles or 64 narrow ones; traces show the wide tiles' GEMM phase well behind
 * tw_gemm's on the narrow ones). Every rank decides alike (the shape, plan_sms and
 * gpu_shared). Not where ranks share a GPU: there the wide tiles win at decode m. */
static int plan_block_n(const tw_gemm_rs_plan_args_t *a, int32_t m_local, int plan_ctas) {
  const int world = a->world;
  /* 192 (the ping-pong loop, TW_RS_BLOCK_N=192) only where no epilogue box holds the start of
   * an owner's rows with the push (its epilogue has no row copy: RsEpi's kNoRowCopy), i.e. not
   * where m_local is no multiple of 64 and the pull is switched off. */
  const int pp_ok = world == 1 || m_local % (TW_GEMM_RS_BLOCK_M / 2) == 0 || a->pull_env != 0;
  const int n128 = !a->shared_gpu && tw_gemm_prefers_n128(a->m, a->n, plan_ctas);
  /* The rule takes the ping-pong loop's 128 x 192 tiles at long K on GPUs of their own, where
   * the owner epilogue (256-column tiles, K < 4096 by its rule) is not forced: there they win
   * for both ops and both partials (tw_gemm_ar's direct scheme, which bf16 partials take there,
   * is planned as one owner: so the comm's world counts). At K 2048 and below they are mixed, so
   * those shapes keep 256. */
  const int comm_world = a->comm_world > 0 ? a->comm_world : world; /* the direct scheme: 1 here */
  const int pp_rule =
      !a->shared_gpu && comm_world > 1 && a->k >= 4096 && a->owner_env != 1 && !n128;
  return a->block_n_env == 128 || a->block_n_env == 256 || (a->block_n_env == 192 && pp_ok)
             ? a->block_n_env
         : n128             ? 128
         : pp_rule && pp_ok ? 192
                            : TW_GEMM_RS_BLOCK_N;
}

static rs_shape_t plan_shape(const tw_gemm_rs_plan_args_t *a) {
  const int world = a->world;
  rs_shape_t s;
  s.m_local = (int32_t)(a->m / world);
  s.plan_ctas = a->plan_sms > 0 ? a->plan_sms : a->sm_budget;
  s.block_n = plan_block_n(a, s.m_local, s.plan_ctas);
  s.n_blocks = (a->n + s.block_n - 1) / s.block_n;
  s.tiles = ((a->m + TW_GEMM_RS_BLOCK_M - 1) / TW_GEMM_RS_BLOCK_M) * s.n_blocks;
  s.units_max = 0;
  for (int o = 0; o < world; o++) {
    int64_t u = (int64_t)tw_rs_mb_count(o, s.m_local) * s.n_blocks;
    if (u > s.units_max)
      s.units_max = u;
  }
  /* Counters within the comm's fixed flag stride (gemm_rs.h), whatever this call's shape. */
  s.stride = tw_rs_flag_stride(a->comm_world > 0 ? a->comm_world : world);
  return s;
}

/* Units behind one flag: at least what keeps the owner's groups within the flag stride. */
static int64_t plan_group_units(const tw_gemm_rs_plan_args_t *a, const rs_shape_t *s) {
  const int64_t units_max = s->units_max;
  const int64_t g_min = units_max > s->stride ? (units_max + s->stride - 1) / s->stride : 1;
  int64_t g = g_min;
  /* Coarser work items for tw_gemm_ar (not the direct scheme, planned with all_reduce 0): a
   * group is what one reduce item reduces and one gather item copies, and each costs a queue
   * claim and a flag wait, and the reduction a system-scope fence and world - 1 flag stores;
   * with one 128 x 256 unit per group a gather item copies 64 KiB. Up to 4 units per group
   * while the owner keeps at least 2 groups per CTA of the rank (of the rank with the fewest,
   * plan_sms: every rank must number the groups alike); with fewer groups per CTA coarser
   * groups lose. tw_gemm_rs, which has no gather, gains at no count, so it keeps single units.
   * Where ranks share a GPU (comm->gpu_shared, alike on every rank) one group per CTA is
   * enough: there 8 units per group lose again and the larger shapes already take 4. */
  if (a->all_reduce) {
    const int64_t per_cta = a->shared_gpu ? 1 : 2;
    int64_t want = 1;
    while (want < 4 && units_max / (want * 2) >= per_cta * s->plan_ctas)
      want *= 2;
    if (want > g)
      g = want;
  }
  /* TW_RS_GROUP_UNITS: this many units per group instead, at most the owner's units, never
   * fewer than the flag slice needs. */
  if (a->group_env > 0) {
    const int64_t e = a->group_env < units_max ? a->group_env : (units_max > 0 ? units_max : 1);
    g = e > g_min ? e : g_min;
  }
  return g;
}

/* Band width of the tile order: B of a band (band x 256 x k bf16) stays in L2 while A
 * streams once per band.
 * - Ranks with GPUs of their own: bands of 8 where A outgrows L2; where A fits, wider bands
 *   only coarsen the reduction's pipeline, so single columns.
 * - Ranks sharing a GPU share its L2, and eight ranks' bands of 8 outgrow it. Single columns
 *   keep 16 row blocks x 1 column in flight on a 16-CTA rank, so every tile loads its A rows
 *   from HBM; bands of 2 share each A row block between two in-flight tiles while the ranks'
 *   B bands still fit (bands of 4 are level with 2), taken where the ranks' A together reach
 *   half of L2 (TW_RS_L2_BYTES). */
static int plan_band(const tw_gemm_rs_plan_args_t *a, int64_t n_blocks) {
  const double a_bytes = (double)a->m * (double)a->k * 2.0;
  int band = a->band_env > 0 ? a->band_env
             : a->shared_gpu ? (a_bytes * a->world >= TW_RS_L2_BYTES ? TW_RS_BAND_SHARED : 1)
             : a_bytes > TW_RS_L2_BYTES ? TW_RS_BAND_DEFAULT
                                        : 1;
  if (band > n_blocks)
    band = (int)n_blocks;
  return band < 1 ? 1 : band;
}

/* Interleaved owners (every world consecutive tiles to world owners; owners of whole row
 * blocks only): fp32 partials on distinct GPUs, where a band's stretch of stores to one peer
 * outran NVLink. bf16 partials, smaller shapes and virtual ranks gain nothing from it. */
static int plan_interleave(const tw_gemm_rs_plan_args_t *a, int32_t m_local) {
  const int want =
      a->interleave_env >= 0 ? a->interleave_env != 0 : a->partial_bytes != 2 && !a->shared_gpu;
  return want && a->world > 1 && m_local % TW_GEMM_RS_BLOCK_M == 0;
}

/* The fewest reduce CTAs (up to half the budget) whose reduction, at the rates the plan
 * assumes, takes at most 0.8 of the GEMM on the CTAs left. Sized by the partials' bytes: with
 * bf16 ones the fp32 count is too many. */
static int reduce_ctas_by_rate(const tw_gemm_rs_plan_args_t *a) {
  const double pbytes = a->partial_bytes == 2 ? 2.0 : 4.0;
  const double bytes = (double)a->m * (double)a->n * pbytes * (a->all_reduce ? 1.5 : 1.0);
  const double flops = 2.0 * (double)a->m * (double)a->n * (double)a->k;
  int reduce = 1;
  for (; reduce < a->sm_budget / 2; reduce++) {
    const double t_red = bytes / (TW_RS_REDUCE_GBPS_PER_CTA * 1e9 * reduce);
    const double t_gemm = flops / (TW_RS_GEMM_TFLOPS_PER_CTA * 1e12 * (a->sm_budget - reduce));
    if (t_red <= 0.8 * t_gemm)
      break;
  }
  return reduce;
}

/* The estimate of the reduce CTAs, where neither the caller nor a knob sets them and the
 * ranks have GPUs of their own. */
static int estimate_reduce_ctas(const tw_gemm_rs_plan_args_t *a, int64_t tiles) {
  int reduce = reduce_ctas_by_rate(a);
  /* tw_gemm_ar's reduce CTAs also gather every other owner's rows: at least 4 of them where
   * the ranks have GPUs of their own. Where they share one, with work stealing, the signal
   * warp and bands of 2, fewer reduce CTAs win, so there the estimate stands. */
  if (a->all_reduce && reduce < 4 && !a->shared_gpu)
    reduce = a->sm_budget / 2 < 4 ? a->sm_budget / 2 : 4;
  /* The wave boundary: where the GEMM CTAs left over run one wave more than a few CTAs
   * fewer reduce CTAs would (flux-tp8 on 132 SMs: 1536 tiles on 127 CTAs are 12.1 waves, on
   * 128 exactly 12), trim the estimate to the largest count that saves the wave: GEMM+RS
   * no lower than half the estimate, GEMM+AR no lower than its 4. */
  const int floor_ar = a->all_reduce && !a->shared_gpu ? 4 : 0;
  const int lo = a->all_reduce ? floor_ar : (reduce + 1) / 2;
  if (reduce < a->sm_budget) {
    const int64_t waves = (tiles + a->sm_budget - reduce - 1) / (a->sm_budget - reduce);
    for (int r = reduce - 1; r >= lo && r >= 1; r--)
      if ((tiles + a->sm_budget - r - 1) / (a->sm_budget - r) < waves) {
        reduce = r;
        break;
      }
  }
  return reduce;
}

/* CTAs that start on the reduction, in order: the args' reduce_sms; TW_RS_REDUCE_CTAS (any
 * count, 0 included: then every CTA runs the GEMM first and the reduction after its tiles, the
 * unfused timeline inside one launch, the partials still travelling during the GEMM); none
 * where ranks share a GPU; else the estimate. Always fewer than the budget; 0: the GEMM CTAs
 * reduce after their tiles. */
static int plan_reduce_ctas(const tw_gemm_rs_plan_args_t *a, int64_t tiles) {
  int reduce = a->reduce_sms_arg;
  if (reduce <= 0 && a->reduce_env >= 0) {
    reduce = a->reduce_env;
  } else if (reduce <= 0 && a->shared_gpu) {
    /* Every CTA runs its GEMM tiles first and reduces after them: the GPU's SMs are all busy
     * with some rank's GEMM, so reducing early only takes them from a GEMM. On 2 GPUs no
     * reduce CTA is mixed: the estimate stays there. */
    reduce = 0;
  } else if (reduce <= 0) {
    reduce = estimate_reduce_ctas(a, tiles);
  }
  if (reduce >= a->sm_budget)
    reduce = a->sm_budget - 1;
  return reduce < 0 ? 0 : reduce;
}

/* The pull (TW_RS_PULL): each rank's epilogue stores its whole partial into its own [m, n]
 * buffer in the tile's place, as tw_gemm stores its output, and each owner's reduction reads
 * its rows from every rank. Where more than 2 ranks share a GPU (comm->gpu_shared, alike on
 * every rank; every store is HBM traffic there either way) it beats storing each box into
 * its owner's staging slot. On 2 GPUs the push wins, and so it does on 2 ranks sharing a
 * GPU, where the owner epilogue (push layout) wins.
 *
 * Also wherever owners' rows start inside a 64-row box of the epilogue (m_local not a multiple
 * of 64: decode shapes). With the push such a box's rows of the later owner cannot go by TMA
 * (a negative row coordinate) and one thread copies them with 16-byte stores over NVLink,
 * which leaves the reduction waiting on them. The pull stores every box at its own rows. */
static int plan_pull(const tw_gemm_rs_plan_args_t *a, int32_t m_local) {
  const int straddle = m_local % (TW_GEMM_RS_BLOCK_M / 2) != 0;
  return a->world > 1 &&
         (a->pull_env >= 0 ? a->pull_env != 0 : (a->shared_gpu && a->world > 2) || straddle);
}

/* The owner epilogue on 2 ranks (RsEpi::combine): each rank's own tiles come after the
 * peer's partials of them and are reduced in their epilogue. It needs whole row blocks per
 * owner, one unit per counter (the combine waits for the peer's one count of its unit) and
 * the push layout (not TW_RS_PULL); tw_gemm_ar's direct scheme is planned at world 1.
 * tw_gemm_rs: ranks may differ in it (the peer's stores and counts are the same either way),
 * so the rule leaves the reduce CTAs running where this rank's caller set them.
 * tw_gemm_ar: the own tile also stores its reduced rows where the peer's gather finds them
 * and sets the unit's ready flag, and the gather items become single units (the groups of
 * 2-4 of plan_group_units give way), so every rank must choose alike: the choice reads only
 * what every rank shares (the shapes, the partials, plan_sms and the alike knobs
 * TW_RS_OWNER_EPI, TW_RS_PULL, TW_RS_GROUP_UNITS), not the reduce-CTA count, which may differ
 * by rank; the gather runs on the GEMM CTAs after their tiles. */
static int plan_owner_epi(const tw_gemm_rs_plan_args_t *a, const rs_shape_t *s, int pull,
                          int64_t group_units) {
  const int can =
      a->world == 2 && !pull && s->m_local % TW_GEMM_RS_BLOCK_M == 0 && s->block_n == 256 &&
      (a->all_reduce ? s->units_max <= s->stride && a->group_env <= 0 : group_units == 1);
  const int reduce_set = !a->all_reduce && (a->reduce_sms_arg > 0 || a->reduce_env >= 0);
  return can && tw_gemm_rs_want_owner_epi(a->owner_env, reduce_set, a->partial_bytes == 2 ? 2 : 4,
                                          a->k, s->tiles, s->plan_ctas);
}

void tw_gemm_rs_make_plan(const tw_gemm_rs_plan_args_t *a, tw_gemm_rs_plan_t *plan) {
  const rs_shape_t s = plan_shape(a);
  const int64_t g = plan_group_units(a, &s);
  plan->block_n = s.block_n;
  plan->group_units = (int)g;
  plan->flag_stride = (int)s.stride;
  plan->band = plan_band(a, s.n_blocks);
  plan->interleave = plan_interleave(a, s.m_local);
  plan->groups_max = (int)((s.units_max + g - 1) / g);
  plan->ctas = a->sm_budget;
  plan->reduce_ctas = plan_reduce_ctas(a, s.tiles);
  /* set by the caller where they apply */
  plan->single = 0;
  plan->direct = 0;
  plan->ar_push = 0;
  plan->ar_out_sym = 0;
  plan->ll = 0;
  plan->pull = plan_pull(a, s.m_local);
  plan->owner_epi = plan_owner_epi(a, &s, plan->pull, g);
  if (plan->owner_epi) {
    plan->reduce_ctas = 0;
    plan->group_units = 1;
    plan->groups_max = (int)s.units_max;
  }
}

void tw_gemm_rs_make_rail_plan(const tw_gemm_rs_plan_args_t *a, int nodes, int unfused_env,
                               tw_gemm_rs_plan_t *plan) {
  tw_gemm_rs_make_plan(a, plan);
  plan->direct = plan->pull = plan->owner_epi = plan->interleave = 0;
  plan->ar_push = plan->ar_out_sym = plan->ll = plan->ar_peer_out = 0;
  plan->rail = 1;
  plan->unfused = unfused_env == 1;
  if (plan->block_n != 128)
    plan->block_n = TW_GEMM_RS_BLOCK_N; /* not the ping-pong loop's 192 */
  /* CTAs that start on the reduce beside the GEMM: the args' reduce_sms or TW_RS_REDUCE_CTAS
   * where set (0: every CTA reduces after its tiles), else at least 1 in 16 of the CTAs, so
   * the node partials start on the network while the GEMM runs (across nodes the network is
   * the slowest link; the one-node estimate, which leaves shared GPUs none, is the floor). */
  if (a->reduce_sms_arg <= 0 && a->reduce_env < 0) {
    int want_reduce = plan->ctas / 16 > 1 ? plan->ctas / 16 : 1;
    if (plan->reduce_ctas < want_reduce)
      plan->reduce_ctas = want_reduce;
  }
  if (plan->reduce_ctas >= plan->ctas)
    plan->reduce_ctas = plan->ctas - 1;
  tw_rs_rail_layout_t lay;
  tw_rs_rail_layout(a->world, nodes, a->m, a->n, plan->block_n, &lay);
  int64_t cap = tw_rs_rail_stride(nodes, a->world);
  if (tw_rs_rail_gcap(nodes) < cap)
    cap = tw_rs_rail_gcap(nodes);
  const int64_t fit = (lay.units_max + cap - 1) / cap; /* the flags must hold the groups */
  /* a group is one RDMA write: at least TW_RS_RAIL_WRITE_BYTES of node partials (fp32) */
  int64_t want = (TW_RS_RAIL_WRITE_BYTES + lay.unit_elems * 4 - 1) / (lay.unit_elems * 4);
  if (a->group_env > 0)
    want = a->group_env;
  if (plan->group_units < want)
    plan->group_units = (int)want;
  if (plan->group_units < fit)
    plan->group_units = (int)fit;
  plan->groups_max = (int)((lay.units_max + plan->group_units - 1) / plan->group_units);
  plan->flag_stride = tw_rs_rail_stride(nodes, a->world);
}
