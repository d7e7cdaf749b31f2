/*
 * Launch-plan heuristics, without a GPU (run in CI): tw_gemm, tw_ag_gemm and tw_gemm_rs plans
 * stay inside their invariants (grid within the SM budget, communication CTAs leave the GEMM
 * some SMs, flag slices not overrun) and make the choices docs/PERF.md measured (128x128 tiles
 * where 128x256 leave an idle last wave, L2 groups aligned with shards).
 */
#include "ops/ag_gemm.h"
#include "ops/gemm_heuristics.h"
#include "ops/gemm_rs.h"
#include "tw_test.h"

static tw_ag_gemm_plan_t ag_plan(int world, int64_t m_local, int64_t n, int64_t k, int budget,
                                 int comm_arg, int group_env) {
  tw_ag_gemm_plan_args_t a = {world, m_local, n, k, budget, comm_arg, 0, group_env, 0};
  tw_ag_gemm_plan_t p;
  tw_ag_gemm_make_plan(&a, &p);
  return p;
}

/* The communication CTA rule at the benchmark shapes (docs/PERF.md has the sweeps behind it). */
static void test_ag_comm_rule(void) {
  tw_ag_gemm_plan_args_t a = {2, 2048, 6144, 12288, 132, 0, 0, 0, 0}; /* flux-tp8, 2 GPUs */
  tw_ag_gemm_plan_t p;
  tw_ag_gemm_make_plan(&a, &p);
  TEST_ASSERT(p.comm_ctas == 5, "flux-tp8 on 2 GPUs: %d comm CTAs (measured best: 5)", p.comm_ctas);
  tw_ag_gemm_plan_args_t c = {2, 4096, 1024, 8192, 132, 0, 0, 0, 0}; /* M=8192: comm-bound */
  tw_ag_gemm_make_plan(&c, &p);
  TEST_ASSERT(p.comm_ctas >= 48, "M=8192 N=1024 on 2 GPUs: %d comm CTAs (48-66 measured best)",
              p.comm_ctas);
  tw_ag_gemm_plan_args_t v = {8, 2048, 2048, 16384, 16, 0, 0, 0, 1}; /* M=16384, 8 vranks */
  tw_ag_gemm_make_plan(&v, &p);
  const int shared = p.comm_ctas;
  v.shared_gpu = 0;
  tw_ag_gemm_make_plan(&v, &p);
  TEST_ASSERT(shared > p.comm_ctas && shared <= 8,
              "M=16384 on 8 ranks: %d comm CTAs sharing a GPU, %d on distinct GPUs", shared,
              p.comm_ctas);
}

static void test_gemm_plans(void) {
  tw_gemm_plan_t p;
  tw_gemm_plan_make(4096, 512, 4096, 132, &p); /* 64 wide tiles on 132 SMs: half idle */
  TEST_ASSERT(p.variant == TW_GEMM_V_N128_S6, "M=4096 N=512: variant %d", p.variant);
  tw_gemm_plan_make(8192, 8192, 8192, 132, &p);
  TEST_ASSERT(p.variant != TW_GEMM_V_N128_S6, "8192^3: variant %d", p.variant);
  TEST_ASSERT(p.grid >= 1 && p.grid <= 132, "grid %d", p.grid);
  tw_gemm_plan_make(1, 8, 8, 132, &p);
  TEST_ASSERT(p.grid == 1 && p.group_m == 1, "M=1: grid %d group %d", p.grid, p.group_m);
}

static void test_ag_gemm_plans(void) {
  static const int64_t m_locals[] = {1, 100, 128, 300, 384, 512, 1024, 2048, 4096, 70000};
  static const int worlds[] = {1, 2, 3, 8};
  for (int wi = 0; wi < 4; wi++)
    for (int mi = 0; mi < 10; mi++) {
      const int w = worlds[wi];
      const int64_t ml = m_locals[mi];
      const int budget = 132 / w;
      tw_ag_gemm_plan_t p = ag_plan(w, ml, 1024, 4096, budget, 0, 0);
      TEST_ASSERT(p.ctas == budget, "ctas %d != budget %d", p.ctas, budget);
      TEST_ASSERT(p.comm_ctas >= 1 && (p.comm_ctas < budget || budget == 1) &&
                      p.comm_ctas <= w * p.nchunks,
                  "world %d m_local %lld: comm_ctas %d of %d (items %d)", w, (long long)ml,
                  p.comm_ctas, budget, w * p.nchunks);
      TEST_ASSERT(p.nchunks >= 1 && p.nchunks <= TW_AG_GEMM_MAX_CHUNKS &&
                      (int64_t)p.nchunks * p.rows_per_chunk >= ml &&
                      (int64_t)(p.nchunks - 1) * p.rows_per_chunk < ml,
                  "m_local %lld: %d chunks of %d rows", (long long)ml, p.nchunks, p.rows_per_chunk);
      TEST_ASSERT(p.rows_per_chunk % 128 == 0, "rows per chunk %d", p.rows_per_chunk);
      TEST_ASSERT(p.group_m >= 1 && p.group_m <= 16, "group %d", p.group_m);
      if (ml % 128 == 0)
        TEST_ASSERT((ml / 128) % p.group_m == 0, "m_local %lld: group %d straddles shards",
                    (long long)ml, p.group_m);
      TEST_ASSERT(p.block_n == 128 || p.block_n == 256, "block_n %d", p.block_n);
    }
  TEST_ASSERT(ag_plan(8, 512, 6144, 12288, 16, 0, 0).group_m == 4, "flux-tp8: one shard per group");
  TEST_ASSERT(ag_plan(8, 2048, 2048, 16384, 16, 0, 0).group_m == 16, "m_local 2048: 16 row blocks");
  TEST_ASSERT(ag_plan(8, 384, 1024, 1024, 16, 0, 0).group_m == 3, "m_local 384: 3 row blocks");
  TEST_ASSERT(ag_plan(8, 512, 6144, 12288, 16, 0, 5).group_m == 5, "TW_AG_GROUP_M wins");
  TEST_ASSERT(ag_plan(8, 512, 6144, 12288, 16, 3, 0).comm_ctas == 3, "args.comm_sms wins");
  TEST_ASSERT(ag_plan(1, 4096, 512, 4096, 132, 0, 0).block_n == 128, "N=512 at world 1: 128 wide");
  TEST_ASSERT(ag_plan(1, 4096, 6144, 12288, 132, 0, 0).block_n == 256, "flux at world 1: 256 wide");
}

static void test_gemm_rs_plans(void) {
  static const int worlds[] = {2, 3, 4, 8};
  static const int64_t ms[] = {8, 96, 4096, 16384};
  for (int wi = 0; wi < 4; wi++)
    for (int mi = 0; mi < 4; mi++)
      for (int ar = 0; ar < 2; ar++) {
        const int w = worlds[wi], budget = 132 / w;
        const int64_t m = ms[mi] * w;
        tw_gemm_rs_plan_args_t a = {w, m, 4096, 512, budget, 0, ar};
        tw_gemm_rs_plan_t p;
        tw_gemm_rs_make_plan(&a, &p);
        TEST_ASSERT(p.ctas >= 2 && p.ctas <= budget, "ctas %d of %d", p.ctas, budget);
        TEST_ASSERT(p.reduce_ctas >= 1 && p.reduce_ctas < p.ctas,
                    "world %d m %lld: reduce %d of %d", w, (long long)m, p.reduce_ctas, p.ctas);
        TEST_ASSERT(p.group_units >= 1 && p.groups_max >= 1, "groups %d x %d units", p.groups_max,
                    p.group_units);
        TEST_ASSERT(tw_gemm_rs_workspace_bytes(w, m, 4096) >= (size_t)m * 4096 * 4,
                    "workspace holds world partial slabs of m / world rows");
      }
}

int main(void) {
  test_gemm_plans();
  test_ag_comm_rule();
  test_ag_gemm_plans();
  test_gemm_rs_plans();
  return tw_test_finish();
}
