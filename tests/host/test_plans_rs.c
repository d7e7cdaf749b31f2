/*
 * tw_gemm_rs's launch plans (tw_gemm_rs_make_plan, shared by tw_gemm_ar), without a GPU (run
 * in CI): the grid within the SM budget, the reduce CTAs leave the GEMM some, the flag layout
 * is the comm's whatever the shape; the unit groups, tile widths, bands, interleaved owners,
 * reduce CTAs, the owner epilogue and the pull the rules choose (docs/PERF.md has the
 * measurements); the unit numbering; the invariants over random plans; and the rail plans across
 * nodes (flags, group sizes). The rules the plan
 * consults for the routes around the fused kernel: test_plans_routes.c.
 */
#include <string.h>

#include "ops/gemm_rs/gemm_rs.h"
#include "ops/gemm_rs/gemm_rs_rail.h"
#include "tw_test.h"

static int rs_interleave(tw_gemm_rs_plan_args_t a) {
  tw_gemm_rs_plan_t p;
  tw_gemm_rs_make_plan(&a, &p);
  return p.interleave;
}

/* Plans over worlds, shapes and both ops keep within the budget and the comm's flag layout. */
static void test_rs_plan_bounds(void) {
  static const int worlds[] = {2, 3, 4, 8};
  static const int64_t ms[] = {8, 96, 4096, 16384};
  for (int wi = 0; wi < 4; wi++)
    for (int mi = 0; mi < 4; mi++)
      for (int ar = 0; ar < 2; ar++) {
        const int w = worlds[wi], budget = 132 / w;
        const int64_t m = ms[mi] * w;
        tw_gemm_rs_plan_args_t a = {w, m, 4096, 512, budget, 0, ar, 0, 4,
                                    0, 0, -1,   -1,  0,      0, 0,  0, 256};
        tw_gemm_rs_plan_t p;
        tw_gemm_rs_make_plan(&a, &p);
        TEST_ASSERT(p.ctas >= 2 && p.ctas <= budget, "ctas %d of %d", p.ctas, budget);
        TEST_ASSERT(p.reduce_ctas >= 1 && p.reduce_ctas < p.ctas,
                    "world %d m %lld: reduce %d of %d", w, (long long)m, p.reduce_ctas, p.ctas);
        TEST_ASSERT(p.group_units >= 1 && p.groups_max >= 1, "groups %d x %d units", p.groups_max,
                    p.group_units);
        TEST_ASSERT(tw_gemm_rs_workspace_bytes(w, m, 4096) >= (size_t)m * 4096 * 4,
                    "workspace holds world partial slabs of m / world rows");
        TEST_ASSERT(p.band >= 1 && p.band <= 16, "band %d of 16 column blocks", p.band);
        /* The flag layout is the comm's, whatever the shape: counters within the stride,
         * the ready flags of world owners after them, clear of the two queues. */
        TEST_ASSERT(p.flag_stride == tw_rs_flag_stride(w) && p.groups_max <= p.flag_stride &&
                        (int64_t)p.flag_stride * (1 + w) <= TW_CHANNEL_FLAGS - 2,
                    "world %d m %lld: %d groups, stride %d", w, (long long)m, p.groups_max,
                    p.flag_stride);
      }
  /* A shape with more units than the stride groups them; the direct all-reduce (planned as
   * one owner of all rows) keeps the comm's stride too. */
  tw_gemm_rs_plan_args_t wide = {8, 65536, 65536, 512, 16, 0, 1, 0, 4,
                                 0, 0,     -1,    -1,  0,  0, 0, 0, 256};
  tw_gemm_rs_plan_t pw;
  tw_gemm_rs_make_plan(&wide, &pw);
  TEST_ASSERT(pw.group_units > 1 && pw.groups_max <= tw_rs_flag_stride(8),
              "m = n = 65536 on 8 ranks: %d groups of %d units", pw.groups_max, pw.group_units);
  tw_gemm_rs_plan_args_t direct = {1, 65536, 65536, 512, 16, 0, 0, 0, 4,
                                   8, 0,     -1,    -1,  0,  0, 0, 0, 256};
  tw_gemm_rs_make_plan(&direct, &pw);
  TEST_ASSERT(pw.flag_stride == tw_rs_flag_stride(8) && pw.groups_max <= pw.flag_stride,
              "direct on 8 ranks: stride %d, %d groups", pw.flag_stride, pw.groups_max);
  wide.group_env = 2; /* below the plan's grouping of this shape */
  tw_gemm_rs_plan_t pg;
  tw_gemm_rs_make_plan(&wide, &pg);
  wide.group_env = 0;
  tw_gemm_rs_make_plan(&wide, &pw);
  TEST_ASSERT(pg.group_units == pw.group_units, "TW_RS_GROUP_UNITS=2 under the plan's %d: %d",
              pw.group_units, pg.group_units);
  direct.interleave_env = 1; /* run_fused relies on it: a direct plan never interleaves */
  tw_gemm_rs_make_plan(&direct, &pw);
  TEST_ASSERT(pw.interleave == 0, "direct (one owner) with TW_RS_INTERLEAVE=1: interleaved");
}

/* How many units stand behind each flag (plan.group_units). */
static void test_rs_groups(void) {
  tw_gemm_rs_plan_t pw;
  /* tw_gemm_ar: up to 4 units per group while the owner keeps 2 groups per CTA.
   * TW_RS_GROUP_UNITS: that many units per group, never more than the owner has, groups still
   * within the stride (below what the stride needs it changes nothing); 1 takes the rule back
   * to single units. */
  tw_gemm_rs_plan_args_t gr = {8, 8192, 8192, 1024, 16, 0, 1, 0, 4, 0, 1, -1, 0, 0, 0, 0, 0, 256};
  static const int group_cases[][3] = {/* TW_RS_GROUP_UNITS, units per group, groups */
                                       {0, 4, 64},
                                       {1, 1, 256},
                                       {2, 2, 128},
                                       {3, 3, 86},
                                       {100000, 256, 1}};
  for (int i = 0; i < 5; i++) {
    gr.group_env = group_cases[i][0];
    tw_gemm_rs_make_plan(&gr, &pw);
    TEST_ASSERT(pw.group_units == group_cases[i][1] && pw.groups_max == group_cases[i][2],
                "gemm_ar M=8192 on 8 ranks, TW_RS_GROUP_UNITS=%d: %d groups of %d units, want %d "
                "of %d",
                group_cases[i][0], pw.groups_max, pw.group_units, group_cases[i][2],
                group_cases[i][1]);
  }
  /* Ranks sharing a GPU keep one group per CTA (16 CTAs each): M=4096 N=4096, 64 units per
   * owner, in 16 groups of 4; m 1024 n 8192, 32 units, in 16 of 2. On GPUs of their own, 2
   * groups per CTA. */
  static const struct {
    int64_t m, n;
    int shared, sms, units;
  } ar8[] = {{4096, 4096, 1, 16, 4},
             {1024, 8192, 1, 16, 2},
             {4096, 4096, 0, 16, 2},
             {1024, 8192, 0, 16, 1},
             {4096, 4096, 1, 132, 1}};
  for (int i = 0; i < 5; i++) {
    tw_gemm_rs_plan_args_t a8 = {8, ar8[i].m,      ar8[i].n, 512, ar8[i].sms, 0, 1, 0, 4,
                                 0, ar8[i].shared, -1,       0,   0,          0, 0, 0, 256};
    tw_gemm_rs_make_plan(&a8, &pw);
    TEST_ASSERT(pw.group_units == ar8[i].units,
                "gemm_ar %lldx%lld on 8 ranks of %d SMs, shared %d: %d units per group, want %d",
                (long long)ar8[i].m, (long long)ar8[i].n, ar8[i].sms, ar8[i].shared, pw.group_units,
                ar8[i].units);
  }
  static const struct { /* 2 ranks with 132 SMs each: units per owner, units per group */
    int64_t m, n;
    int units;
  } ar2[] = {
      {1024, 8192, 1}, {4096, 4096, 1}, {4096, 12288, 2}, {8192, 8192, 2}, {16384, 16384, 4}};
  for (int i = 0; i < 5; i++) {
    tw_gemm_rs_plan_args_t a2 = {2, ar2[i].m, ar2[i].n, 2048, 132, 0, 1, 0, 4,
                                 0, 0,        -1,       -1,   0,   0, 0, 0, 256};
    tw_gemm_rs_make_plan(&a2, &pw);
    TEST_ASSERT(pw.group_units == ar2[i].units,
                "gemm_ar %lldx%lld on 2 GPUs: %d units per group, want %d", (long long)ar2[i].m,
                (long long)ar2[i].n, pw.group_units, ar2[i].units);
    a2.sm_budget = 200, a2.plan_sms = 132; /* the groups follow plan_sms, not the rank's own */
    tw_gemm_rs_make_plan(&a2, &pw);
    TEST_ASSERT(pw.group_units == ar2[i].units,
                "gemm_ar %lldx%lld, budget 200, plan_sms 132: %d units per group, want %d",
                (long long)ar2[i].m, (long long)ar2[i].n, pw.group_units, ar2[i].units);
    a2.all_reduce = 0; /* tw_gemm_rs and the direct scheme: single units */
    tw_gemm_rs_make_plan(&a2, &pw);
    TEST_ASSERT(pw.group_units == 1, "gemm_rs %lldx%lld on 2 GPUs: %d units per group",
                (long long)ar2[i].m, (long long)ar2[i].n, pw.group_units);
  }
}

/* The tile width (plan.block_n): the rule, and TW_RS_BLOCK_N. */
static void test_rs_block_n(void) {
  /* The tile width by the rule: the ping-pong loop's 192 columns at long K on GPUs of their
   * own (flux-tp8), 256 at short K, where ranks share a GPU or the owner epilogue is forced,
   * and 192 forced only where no push box holds the start of an owner's rows. */
  tw_gemm_rs_plan_args_t fx = {2, 4096, 12288, 6144, 132, 0, 0,  0,  4,
                               0, 0,    -1,    -1,   0,   0, -1, -1, 0};
  tw_gemm_rs_plan_t pf;
  tw_gemm_rs_make_plan(&fx, &pf);
  TEST_ASSERT(pf.block_n == 192 && !pf.owner_epi, "flux-tp8 on 2 GPUs: block_n %d, owner %d",
              pf.block_n, pf.owner_epi);
  fx.all_reduce = 1;
  tw_gemm_rs_make_plan(&fx, &pf);
  TEST_ASSERT(pf.block_n == 192, "flux-tp8 GEMM+AR on 2 GPUs: block_n %d", pf.block_n);
  tw_gemm_rs_plan_args_t dx = fx; /* tw_gemm_ar's direct scheme: one owner, comm world 2 */
  dx.world = 1, dx.comm_world = 2, dx.all_reduce = 0, dx.partial_bytes = 2;
  tw_gemm_rs_make_plan(&dx, &pf);
  TEST_ASSERT(pf.block_n == 192, "flux-tp8 direct on 2 GPUs: block_n %d", pf.block_n);
  dx.comm_world = 1; /* a comm of one rank */
  tw_gemm_rs_make_plan(&dx, &pf);
  TEST_ASSERT(pf.block_n == 256, "flux-tp8 on a comm of one rank: block_n %d", pf.block_n);
  fx.shared_gpu = 1;
  tw_gemm_rs_make_plan(&fx, &pf);
  TEST_ASSERT(pf.block_n == 256, "flux-tp8 on a shared GPU: block_n %d", pf.block_n);
  fx.shared_gpu = 0, fx.all_reduce = 0, fx.owner_env = 1;
  tw_gemm_rs_make_plan(&fx, &pf);
  TEST_ASSERT(pf.block_n == 256, "flux-tp8, TW_RS_OWNER_EPI=1: block_n %d", pf.block_n);
  fx.owner_env = -1, fx.k = 2048;
  tw_gemm_rs_make_plan(&fx, &pf);
  TEST_ASSERT(pf.block_n == 256, "K 2048 on 2 GPUs: block_n %d", pf.block_n);
  fx.m = 2 * 4000, fx.pull_env = 0, fx.block_n_env = 192; /* m_local 4000: boxes straddle */
  tw_gemm_rs_make_plan(&fx, &pf);
  TEST_ASSERT(pf.block_n != 192, "TW_RS_BLOCK_N=192 with the push over straddling boxes");
  fx.pull_env = -1; /* the plan pulls there: 192 */
  tw_gemm_rs_make_plan(&fx, &pf);
  TEST_ASSERT(pf.block_n == 192 && pf.pull, "TW_RS_BLOCK_N=192, pulled: %d", pf.block_n);
  /* The tile width (plan.block_n): 128 columns where 128 x 256 tiles leave a last wave mostly
   * idle (tw_gemm's rule on plan_sms), else 256; TW_RS_BLOCK_N 128 / 256 wins, other values
   * leave it to the rule. */
  static const struct {
    int64_t m, n;
    int ctas, shared, env, want;
    const char *what;
  } bn[] = {
      {64, 8192, 132, 0, 0, 128, "decode M=64 n 8192: 32 wide tiles on 132 CTAs, 64 narrow"},
      {256, 8192, 132, 0, 0, 128, "M=256: 64 wide tiles, 128 narrow"},
      {4096, 12288, 132, 0, 0, 256, "flux-tp8: 12 full waves of wide tiles"},
      {1024, 8192, 132, 0, 0, 256, "small-m: 256 wide tiles, 2 waves"},
      {16384, 16384, 132, 0, 0, 256, "M=16384"},
      {64, 8192, 16, 1, 0, 256, "decode, 8 ranks sharing a GPU: wide"},
      {64, 8192, 132, 0, 256, 256, "TW_RS_BLOCK_N=256"},
      {4096, 12288, 132, 0, 128, 128, "TW_RS_BLOCK_N=128"},
      {64, 8192, 16, 1, 128, 128, "TW_RS_BLOCK_N=128 on a shared GPU"},
      {64, 8192, 132, 0, 96, 128, "TW_RS_BLOCK_N=96: the rule"},
  };
  for (size_t i = 0; i < sizeof(bn) / sizeof(bn[0]); i++) {
    tw_gemm_rs_plan_args_t a = {2, bn[i].m,      bn[i].n, 1024, bn[i].ctas, 0, 1,  0,  4,
                                0, bn[i].shared, -1,      -1,   0,          0, -1, -1, bn[i].env};
    tw_gemm_rs_plan_t pp;
    tw_gemm_rs_make_plan(&a, &pp);
    TEST_ASSERT(pp.block_n == bn[i].want, "%s: block_n %d, want %d", bn[i].what, pp.block_n,
                bn[i].want);
  }
}

/* Bands of column blocks (plan.band), interleaved owners and the count of reduce CTAs. */
static void test_rs_bands_interleave_reduce(void) {
  tw_gemm_rs_plan_args_t one = {2, 4096, 256, 512, 66, 0, 0, 0, 4,
                                0, 0,    -1,  -1,  0,  0, 0, 0, 256}; /* one column block */
  tw_gemm_rs_plan_t p;
  tw_gemm_rs_make_plan(&one, &p);
  TEST_ASSERT(p.band == 1, "n = 256: band %d", p.band);
  tw_gemm_rs_plan_args_t big = {2, 16384, 16384, 2048, 132, 0, 0, 0, 4,
                                0, 0,     -1,    -1,   0,   0, 0, 0, 256}; /* A 64 MiB: bands */
  tw_gemm_rs_make_plan(&big, &p);
  TEST_ASSERT(p.band == 8, "M=16384 K=2048: band %d, want 8", p.band);
  /* Interleaved owners: fp32 partials on distinct GPUs, owners of whole row blocks. */
  TEST_ASSERT(p.interleave == 1, "fp32 partials, 2 GPUs: interleave %d", p.interleave);
  tw_gemm_rs_plan_args_t v = big;
  v.partial_bytes = 2;
  TEST_ASSERT(!rs_interleave(v), "bf16 partials: interleaved");
  v.partial_bytes = 4, v.shared_gpu = 1;
  TEST_ASSERT(!rs_interleave(v), "shared GPU: interleaved");
  v.interleave_env = 1;
  TEST_ASSERT(rs_interleave(v), "TW_RS_INTERLEAVE=1 wins");
  v.shared_gpu = 0, v.interleave_env = 0;
  TEST_ASSERT(!rs_interleave(v), "TW_RS_INTERLEAVE=0 wins");
  v.interleave_env = -1, v.m = 2 * 200; /* m_local 200: tiles straddle owners */
  TEST_ASSERT(!rs_interleave(v), "m_local 200: interleaved");
  big.shared_gpu = 1; /* ranks sharing a GPU share its L2: bands of 2 */
  tw_gemm_rs_make_plan(&big, &p);
  TEST_ASSERT(p.band == 2, "M=16384 K=2048 on a shared GPU: band %d, want 2", p.band);
  tw_gemm_rs_plan_args_t small = big;
  small.world = 8, small.m = 4096, small.n = 4096, small.k = 512, small.sm_budget = 16;
  tw_gemm_rs_make_plan(&small, &p); /* 8 ranks' A, 4 MiB each: half of L2 together */
  TEST_ASSERT(p.band == 2, "M=4096 K=512 on 8 ranks of a shared GPU: band %d, want 2", p.band);
  small.k = 256;
  tw_gemm_rs_make_plan(&small, &p); /* 2 MiB each: 16 MiB together */
  TEST_ASSERT(p.band == 1, "M=4096 K=256 on 8 ranks of a shared GPU: band %d, want 1", p.band);
  small.k = 512;
  small.all_reduce = 1, small.n = 12288, small.k = 6144; /* flux-tp8: the estimate, 1 CTA */
  tw_gemm_rs_make_plan(&small, &p);
  TEST_ASSERT(p.reduce_ctas < 4, "GEMM+AR, 8 ranks of a shared GPU: %d reduce CTAs", p.reduce_ctas);
  TEST_ASSERT(p.reduce_ctas == 0, "8 ranks of a shared GPU: %d reduce CTAs, want 0 (GEMM first)",
              p.reduce_ctas);
  small.reduce_sms_arg = 3; /* the args win */
  tw_gemm_rs_make_plan(&small, &p);
  TEST_ASSERT(p.reduce_ctas == 3, "shared GPU, reduce_sms 3: %d reduce CTAs", p.reduce_ctas);
  small.reduce_sms_arg = 0;
  small.shared_gpu = 0; /* distinct GPUs: at least 4 */
  tw_gemm_rs_make_plan(&small, &p);
  TEST_ASSERT(p.reduce_ctas >= 4, "GEMM+AR, distinct GPUs: %d reduce CTAs", p.reduce_ctas);
  big.shared_gpu = 0;
  tw_gemm_rs_make_plan(&big, &p);
  const int reduce_fp32 = p.reduce_ctas;
  big.partial_bytes = 2; /* bf16 partials: half the bytes, fewer reduce CTAs */
  tw_gemm_rs_make_plan(&big, &p);
  TEST_ASSERT(p.reduce_ctas >= 1 && p.reduce_ctas < reduce_fp32,
              "bf16 partials: %d reduce CTAs, fp32 %d", p.reduce_ctas, reduce_fp32);
  big.partial_bytes = 4;
  big.m = 8192, big.k = 1024; /* A 16 MiB fits L2: single columns */
  tw_gemm_rs_make_plan(&big, &p);
  TEST_ASSERT(p.band == 1, "M=8192 K=1024: band %d, want 1", p.band);
  /* TW_RS_REDUCE_CTAS: any count, 0 included. */
  tw_gemm_rs_plan_args_t r = big;
  r.reduce_env = 0;
  tw_gemm_rs_make_plan(&r, &p);
  TEST_ASSERT(p.reduce_ctas == 0 && p.single == 0, "TW_RS_REDUCE_CTAS=0: %d reduce CTAs",
              p.reduce_ctas);
  r.reduce_env = 3;
  tw_gemm_rs_make_plan(&r, &p);
  TEST_ASSERT(p.reduce_ctas == 3, "TW_RS_REDUCE_CTAS=3: %d", p.reduce_ctas);
  r.reduce_env = 0, r.reduce_sms_arg = 2; /* the args win */
  tw_gemm_rs_make_plan(&r, &p);
  TEST_ASSERT(p.reduce_ctas == 2, "reduce_sms 2 with TW_RS_REDUCE_CTAS=0: %d", p.reduce_ctas);
  r.reduce_sms_arg = 0, r.reduce_env = 500;
  tw_gemm_rs_make_plan(&r, &p);
  TEST_ASSERT(p.reduce_ctas == 131, "TW_RS_REDUCE_CTAS=500 of 132: %d", p.reduce_ctas);
  one.band_env = 3;
  one.n = 4096;
  tw_gemm_rs_make_plan(&one, &p);
  TEST_ASSERT(p.band == 3, "TW_RS_BAND=3: band %d", p.band);
}

/* The owner epilogue (its rule: tw_gemm_rs_want_owner_epi, test_plans_routes.c): the plan
 * takes it where the call can, then no reduce CTA and one unit per group. The plans of the
 * other tests here mostly pass owner_env 0 (never) and test the rest. Fields: world, m, n, k,
 * sm_budget, reduce_sms_arg, all_reduce, band_env, partial_bytes, comm_world, shared_gpu,
 * interleave_env, reduce_env, group_env, plan_sms, owner_env, pull_env, block_n_env. */
static void test_rs_owner_epi_plans(void) {
  static const struct {
    tw_gemm_rs_plan_args_t a;
    int owner_epi;
    const char *what;
  } oe[] = {
      {{2, 16384, 16384, 2048, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, 0, 256}, 1, "RS M=16384"},
      {{2, 16384, 16384, 2048, 132, 0, 1, 0, 4, 0, 0, -1, -1, 0, 132, -1, 0, 256}, 1, "AR M=16384"},
      {{2, 16384, 16384, 2048, 132, 4, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, 0, 256},
       0,
       "RS, reduce_sms set"},
      {{2, 16384, 16384, 2048, 132, 4, 1, 0, 4, 0, 0, -1, -1, 0, 132, -1, 0, 256},
       1,
       "AR, reduce_sms set (may differ by rank: not read)"},
      {{2, 16384, 16384, 2048, 132, 0, 1, 0, 4, 0, 0, -1, 4, 0, 132, -1, 0, 256},
       1,
       "AR, TW_RS_REDUCE_CTAS set (not read)"},
      {{2, 16384, 16384, 2048, 132, 0, 1, 0, 4, 0, 0, -1, -1, 3, 132, -1, 0, 256},
       0,
       "AR, TW_RS_GROUP_UNITS=3"},
      {{2, 16384, 16384, 2048, 132, 0, 0, 0, 4, 0, 0, -1, -1, 3, 132, -1, 0, 256},
       0,
       "RS, TW_RS_GROUP_UNITS=3"},
      {{2, 16384, 16384, 2048, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, 1, 256},
       0,
       "TW_RS_PULL=1"},
      {{4, 16384, 16384, 2048, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, 1, 0, 256}, 0, "4 ranks"},
      {{2, 200, 16384, 2048, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, 1, 0, 256},
       0,
       "m / 2 not whole row blocks"},
      {{2, 1024, 8192, 2048, 132, 0, 1, 0, 4, 0, 0, -1, -1, 0, 132, -1, 0, 256},
       0,
       "AR small-m, 1.9 waves"},
      {{2, 1024, 8192, 2048, 66, 0, 1, 0, 4, 0, 1, -1, -1, 0, 66, -1, 0, 256},
       1,
       "AR small-m on 2 virtual ranks, 3.9 waves"},
      {{2, 8192, 8192, 1024, 132, 0, 0, 0, 2, 0, 0, -1, -1, 0, 132, -1, 0, 256},
       0,
       "bf16 partials"},
      {{2, 8192, 8192, 1024, 132, 0, 0, 0, 2, 0, 0, -1, -1, 0, 132, 1, 0, 256},
       1,
       "bf16 partials, TW_RS_OWNER_EPI=1"},
      {{1, 8192, 8192, 1024, 132, 0, 0, 0, 4, 2, 0, -1, -1, 0, 132, 1, 0, 256},
       0,
       "world 1 (the direct scheme's plan)"},
  };
  for (size_t i = 0; i < sizeof(oe) / sizeof(oe[0]); i++) {
    tw_gemm_rs_plan_t po;
    tw_gemm_rs_make_plan(&oe[i].a, &po);
    TEST_ASSERT(po.owner_epi == oe[i].owner_epi, "%s: owner_epi %d, want %d", oe[i].what,
                po.owner_epi, oe[i].owner_epi);
    if (po.owner_epi) {
      const int units = (int)(oe[i].a.m / 2 / 128) * (int)((oe[i].a.n + 255) / 256);
      TEST_ASSERT(po.reduce_ctas == 0 && po.group_units == 1 && po.groups_max == units,
                  "%s: reduce_ctas %d, %d groups of %d units (want 0, %d of 1)", oe[i].what,
                  po.reduce_ctas, po.groups_max, po.group_units, units);
    }
  }
}

static void test_rs_pull_plans(void) {
  /* The pull (plan.pull): by default where more than 2 ranks share a GPU (measured there);
   * and wherever an owner's rows start inside a 64-row box (m_local % 64, decode shapes);
   * TW_RS_PULL 0 / 1 wins; never at world 1 (the direct scheme's plan); on 2 ranks sharing a
   * GPU the push stays and with it the owner epilogue. The reduce CTAs at the wave boundary
   * (trimmed to save a wave of GEMM tiles; GEMM+RS to half the estimate at most, GEMM+AR to
   * its floor of 4): flux-tp8 on 2 GPUs, 1536 tiles, the estimate's 5 (GEMM+RS) / 7 (GEMM+AR)
   * leave 12.1 / 12.3 waves, 4 exactly 12; small-m GEMM+AR (256 tiles) 19 -> 4 (3 waves -> 2);
   * a count the caller sets stays; where ranks share a GPU none starts. reduce -1: not
   * checked. */
  static const struct {
    tw_gemm_rs_plan_args_t a;
    int pull, owner_epi, reduce;
    const char *what;
  } pl[] = {
      {{8, 4096, 4096, 512, 16, 0, 0, 0, 4, 0, 1, -1, -1, 0, 16, -1, -1, 256}, 1, 0, 0, "8 shared"},
      {{8, 4096, 4096, 512, 16, 0, 1, 0, 2, 0, 1, -1, -1, 0, 16, -1, -1, 256},
       1,
       0,
       0,
       "8 shared, AR, bf16"},
      {{3, 3072, 4096, 512, 44, 0, 0, 0, 4, 0, 1, -1, -1, 0, 44, -1, -1, 256}, 1, 0, 0, "3 shared"},
      {{8, 4096, 4096, 512, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, -1, 256},
       0,
       0,
       -1,
       "8 GPUs"},
      {{2, 16384, 16384, 2048, 66, 0, 0, 0, 4, 0, 1, -1, -1, 0, 66, -1, -1, 256},
       0,
       1,
       0,
       "2 shared: push, owner epilogue"},
      {{2, 16384, 16384, 2048, 132, 0, 1, 0, 4, 0, 0, -1, -1, 0, 132, -1, -1, 256},
       0,
       1,
       0,
       "2 GPUs: push, owner epilogue"},
      {{8, 4096, 4096, 512, 16, 0, 0, 0, 4, 0, 1, -1, -1, 0, 16, -1, 0, 256},
       0,
       0,
       0,
       "TW_RS_PULL=0"},
      {{2, 16384, 16384, 2048, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, 1, 256},
       1,
       0,
       -1,
       "TW_RS_PULL=1 on 2 GPUs"},
      {{1, 8192, 8192, 1024, 132, 0, 0, 0, 4, 8, 1, -1, -1, 0, 132, -1, 1, 256},
       0,
       0,
       -1,
       "world 1 (the direct scheme's plan)"},
      {{2, 4096, 12288, 6144, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, -1, 256},
       0,
       0,
       4,
       "RS flux"},
      {{2, 4096, 12288, 6144, 132, 0, 1, 0, 4, 0, 0, -1, -1, 0, 132, -1, -1, 256},
       0,
       0,
       4,
       "AR flux"},
      {{2, 1024, 8192, 2048, 132, 0, 1, 0, 4, 0, 0, -1, -1, 0, 132, -1, -1, 256},
       0,
       0,
       4,
       "AR small-m"},
      {{2, 4096, 12288, 6144, 132, 0, 0, 0, 4, 0, 0, -1, 5, 0, 132, -1, -1, 256},
       0,
       0,
       5,
       "TW_RS_REDUCE_CTAS=5 as set"},
      {{2, 4096, 12288, 6144, 132, 5, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, -1, 256},
       0,
       0,
       5,
       "reduce_sms 5 as set"},
      {{2, 64, 8192, 1024, 132, 0, 1, 0, 4, 0, 0, -1, -1, 0, 132, -1, -1, 256},
       1,
       0,
       -1,
       "AR decode M=64: boxes straddle owners, pull"},
      {{2, 256, 8192, 1024, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, -1, 256},
       0,
       0,
       -1,
       "RS M=256: whole boxes, push"},
      {{2, 64, 8192, 1024, 132, 0, 0, 0, 4, 0, 0, -1, -1, 0, 132, -1, 0, 256},
       0,
       0,
       -1,
       "RS M=64 with TW_RS_PULL=0: push"},
  };
  for (size_t i = 0; i < sizeof(pl) / sizeof(pl[0]); i++) {
    tw_gemm_rs_plan_t pp;
    tw_gemm_rs_make_plan(&pl[i].a, &pp);
    TEST_ASSERT(pp.pull == pl[i].pull && pp.owner_epi == pl[i].owner_epi &&
                    (pl[i].reduce < 0 || pp.reduce_ctas == pl[i].reduce),
                "%s: pull %d owner_epi %d reduce_ctas %d, want %d %d %d", pl[i].what, pp.pull,
                pp.owner_epi, pp.reduce_ctas, pl[i].pull, pl[i].owner_epi, pl[i].reduce);
  }
}

/* Unit numbering (gemm_rs.h): a bijection onto [0, units) whatever the band, its inverse, the
 * column-major numbering at band 1, and band-major order (a band's units come before the next
 * band's, row-major inside). */
static void test_rs_units(void) {
  static const int32_t mbos[] = {1, 2, 5, 64};
  static const int32_t nbs[] = {1, 3, 8, 48, 64};
  static const int32_t bands[] = {1, 2, 5, 8, 16, 100};
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 5; j++)
      for (int b = 0; b < 6; b++) {
        const int32_t mbo = mbos[i], nbl = nbs[j], band = bands[b];
        static unsigned char seen[64 * 64];
        memset(seen, 0, sizeof(seen));
        int32_t prev_band = 0, bad = 0;
        for (int32_t u = 0; u < mbo * nbl; u++) {
          int32_t mb, nb;
          tw_rs_unit_coords(u, mbo, nbl, band, &mb, &nb);
          bad += mb < 0 || mb >= mbo || nb < 0 || nb >= nbl;
          if (bad)
            break;
          bad += seen[mb * nbl + nb]++ != 0;
          bad += tw_rs_unit(mb, nb, mbo, nbl, band) != u;
          bad += nb / band < prev_band;
          prev_band = nb / band;
          if (band == 1)
            bad += u != nb * mbo + mb;
        }
        TEST_ASSERT(bad == 0, "units mbo %d n_blocks %d band %d: %d mismatches", mbo, nbl, band,
                    bad);
      }
}

/* tw_gemm_rs_make_plan over random shapes, worlds, budgets, partials and knob settings: the
 * invariants every plan keeps whatever rule chose it (a net under the per-rule tests above).
 * Deterministic (a fixed xorshift seed); failures print the arguments. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void) { return tw_test_xorshift(&rng_state); }
static int pick(const int *v, int n) { return v[rng() % (uint64_t)n]; }

static void test_gemm_rs_plan_invariants(void) {
  static const int worlds[] = {2, 3, 4, 5, 6, 7, 8};
  static const int budgets[] = {2, 3, 16, 18, 33, 44, 66, 116, 132};
  static const int ks[] = {8, 64, 512, 1024, 2048, 4096, 6144, 12288};
  static const int envs[] = {-1, -1, -1, 0, 1};
  int bad = 0;
  for (int it = 0; it < 20000 && bad < 10; it++) {
    tw_gemm_rs_plan_args_t a;
    memset(&a, 0, sizeof(a));
    a.world = pick(worlds, 7);
    a.m = (int64_t)a.world * (int64_t)(1 + rng() % 4096);
    a.n = 8 * (int64_t)(1 + rng() % 4096);
    a.k = pick(ks, 8);
    a.sm_budget = pick(budgets, 9);
    a.reduce_sms_arg = rng() % 4 == 0 ? (int)(rng() % 40) : 0;
    a.all_reduce = (int)(rng() % 2);
    a.band_env = rng() % 8 == 0 ? (int)(1 + rng() % 9) : 0;
    a.partial_bytes = rng() % 2 ? 4 : 2;
    a.comm_world = a.world + (int)(rng() % 2) * (8 - a.world);
    a.shared_gpu = (int)(rng() % 2);
    a.interleave_env = pick(envs, 5);
    a.reduce_env = rng() % 6 == 0 ? (int)(rng() % 20) : -1;
    a.group_env = rng() % 6 == 0 ? (int)(rng() % 9) : 0;
    a.plan_sms = rng() % 2 ? a.sm_budget : 0;
    a.owner_env = pick(envs, 5);
    a.pull_env = pick(envs, 5);
    static const int widths[] = {0, 128, 256, 64, 192};
    a.block_n_env = widths[rng() % 5];
    tw_gemm_rs_plan_t p;
    tw_gemm_rs_make_plan(&a, &p);
    const int64_t m_local = a.m / a.world, n_blocks = (a.n + p.block_n - 1) / p.block_n;
    const int64_t units_owner_max = ((m_local + 127) / 128 + 1) * n_blocks;
    const int stride = tw_rs_flag_stride(a.comm_world);
    const char *why = NULL;
    if (p.ctas != a.sm_budget)
      why = "ctas is the budget";
    else if (p.block_n != 128 && p.block_n != 192 && p.block_n != 256)
      why = "tiles of 128, 192 or 256 columns";
    else if ((a.block_n_env == 128 || a.block_n_env == 256) && p.block_n != a.block_n_env)
      why = "TW_RS_BLOCK_N as set";
    else if (p.block_n == 192 && (p.owner_epi || (a.world > 1 && !p.pull && m_local % 64 != 0)))
      why = "192-column tiles (the ping-pong loop): no owner epilogue, no push of straddling boxes";
    else if (p.owner_epi && p.block_n != 256)
      why = "the owner epilogue on 256-column tiles";
    else if (p.reduce_ctas < 0 || p.reduce_ctas >= p.ctas)
      why = "reduce CTAs in [0, ctas)";
    else if (p.band < 1 || p.band > n_blocks)
      why = "band in [1, column blocks]";
    else if (p.group_units < 1 || p.groups_max < 1 || p.groups_max > stride ||
             (int64_t)p.group_units * p.groups_max > 2 * units_owner_max + p.group_units)
      why = "groups within the flag stride";
    else if (p.flag_stride != stride)
      why = "the comm's flag stride";
    else if (p.pull && (a.pull_env == 0 ||
                        (a.pull_env < 0 && !(a.shared_gpu && a.world > 2) && m_local % 64 == 0)))
      why = "pull only where asked, more than 2 ranks share a GPU or boxes straddle owners";
    else if (a.world > 1 && a.pull_env < 0 && m_local % 64 != 0 && !p.pull)
      why = "boxes straddling owners pull";
    else if (a.pull_env == 1 && !p.pull)
      why = "TW_RS_PULL=1 pulls";
    else if (p.owner_epi && (a.world != 2 || p.pull || p.reduce_ctas != 0 || p.group_units != 1 ||
                             m_local % 128 != 0 || a.owner_env == 0))
      why = "owner epilogue: 2 ranks, whole row blocks, push, no reduce CTA, single units";
    else if (p.interleave && (m_local % 128 != 0 || a.interleave_env == 0))
      why = "interleave: whole row blocks, not when TW_RS_INTERLEAVE=0";
    else if (p.single || p.direct || p.ar_push || p.ar_out_sym)
      why = "the caller's fields start at 0";
    if (why) {
      bad++;
      TEST_ASSERT(0,
                  "%s: world %d m %lld n %lld k %lld budget %d reduce_sms %d ar %d band_env %d "
                  "pbytes %d comm_world %d shared %d interleave_env %d reduce_env %d "
                  "group_env %d plan_sms %d owner_env %d pull_env %d -> ctas %d reduce %d band %d "
                  "groups %d x %d stride %d pull %d owner_epi %d interleave %d",
                  why, a.world, (long long)a.m, (long long)a.n, (long long)a.k, a.sm_budget,
                  a.reduce_sms_arg, a.all_reduce, a.band_env, a.partial_bytes, a.comm_world,
                  a.shared_gpu, a.interleave_env, a.reduce_env, a.group_env, a.plan_sms,
                  a.owner_env, a.pull_env, p.ctas, p.reduce_ctas, p.band, p.groups_max,
                  p.group_units, p.flag_stride, p.pull, p.owner_epi, p.interleave);
    }
  }
  TEST_ASSERT(bad == 0, "random plans: %d broke an invariant", bad);
}

/* Across nodes (tw_gemm_rs_make_rail_plan): at every layout of up to 8 ranks and shapes from
 * one row per rank to 64 Ki rows, the plan has none of the one-node schemes, 128- or 256-column
 * tiles, its groups fit the rail's flags (ctrl flags and net flags of the channel), each group
 * carries at least 1 MiB of node partials where the owner has that many, and a TW_RS_GROUP_UNITS
 * above that is kept. */
static void test_rs_rail_plans(void) {
  static const int layouts[][2] = {{2, 1}, {2, 2}, {2, 4}, {3, 2}, {4, 2}, {8, 1}, {2, 3}};
  static const int64_t m_locals[] = {1, 100, 2048, 8192};
  static const int64_t ns[] = {8, 264, 4096, 16384};
  for (size_t li = 0; li < sizeof(layouts) / sizeof(layouts[0]); li++)
    for (int mi = 0; mi < 4; mi++)
      for (int ni = 0; ni < 4; ni++)
        for (int ge = 0; ge < 2; ge++) {
          const int nodes = layouts[li][0], world = nodes * layouts[li][1];
          const int64_t m = m_locals[mi] * world, n = ns[ni];
          tw_gemm_rs_plan_args_t a = {world, m, n,  4096, 132 / world, 0, 1, 0, 4,
                                      world, 0, -1, -1,   0,           0, 0, 0, 0};
          a.group_env = ge ? 600 : 0;
          tw_gemm_rs_plan_t p;
          memset(&p, 0, sizeof(p));
          tw_gemm_rs_make_rail_plan(&a, nodes, -1, &p);
          tw_rs_rail_layout_t lay;
          tw_rs_rail_layout(world, nodes, m, n, p.block_n, &lay);
          const int stride = tw_rs_rail_stride(nodes, world), gcap = tw_rs_rail_gcap(nodes);
          TEST_ASSERT(p.rail == 1 && !p.direct && !p.pull && !p.owner_epi && !p.interleave &&
                          !p.ar_push && !p.ar_out_sym && !p.ll && !p.unfused,
                      "%dx%d m %lld n %lld: one-node schemes in the rail plan", nodes,
                      world / nodes, (long long)m, (long long)n);
          TEST_ASSERT(p.reduce_ctas >= 1 && p.reduce_ctas >= p.ctas / 16 && p.reduce_ctas < p.ctas,
                      "%dx%d m %lld n %lld: %d reduce CTAs of %d", nodes, world / nodes,
                      (long long)m, (long long)n, p.reduce_ctas, p.ctas);
          TEST_ASSERT(p.block_n == 128 || p.block_n == 256, "block_n %d", p.block_n);
          TEST_ASSERT(p.groups_max >= 1 && p.groups_max <= stride && p.groups_max <= gcap &&
                          (int64_t)p.groups_max * p.group_units >= lay.units_max,
                      "%dx%d m %lld n %lld: %d groups of %d units for %lld units (stride %d, net "
                      "cap %d)",
                      nodes, world / nodes, (long long)m, (long long)n, p.groups_max, p.group_units,
                      (long long)lay.units_max, stride, gcap);
          TEST_ASSERT((int64_t)(nodes + world) * stride <= TW_CHANNEL_FLAGS - 2 &&
                          2 * nodes * gcap <= TW_NET_CH_FLAGS - 64,
                      "%dx%d: the flag areas overlap the queues or the entry flags", nodes,
                      world / nodes);
          const int64_t group_bytes = (int64_t)p.group_units * lay.unit_elems * 4;
          TEST_ASSERT(group_bytes >= TW_RS_RAIL_WRITE_BYTES || p.groups_max == 1,
                      "%dx%d m %lld n %lld: groups of %lld bytes", nodes, world / nodes,
                      (long long)m, (long long)n, (long long)group_bytes);
          TEST_ASSERT(!ge || p.group_units >= 600, "TW_RS_GROUP_UNITS 600 gave %d", p.group_units);
        }
  tw_gemm_rs_plan_args_t a = {4, 4096, 4096, 4096, 33, 0, 0, 0, 4, 4, 0, -1, -1, 0, 0, 0, 0, 192};
  tw_gemm_rs_plan_t p;
  memset(&p, 0, sizeof(p));
  tw_gemm_rs_make_rail_plan(&a, 2, 1, &p);
  TEST_ASSERT(p.unfused && p.block_n == 256,
              "TW_RS_UNFUSED_SMALL=1 and TW_RS_BLOCK_N=192: "
              "unfused %d, block_n %d",
              p.unfused, p.block_n);
  a.reduce_env = 0; /* TW_RS_REDUCE_CTAS=0: every CTA computes first */
  tw_gemm_rs_make_rail_plan(&a, 2, -1, &p);
  TEST_ASSERT(p.reduce_ctas == 0, "TW_RS_REDUCE_CTAS=0: %d reduce CTAs", p.reduce_ctas);
  a.reduce_env = -1;
  a.reduce_sms_arg = 5; /* the args win */
  tw_gemm_rs_make_rail_plan(&a, 2, -1, &p);
  TEST_ASSERT(p.reduce_ctas == 5, "reduce_sms 5: %d reduce CTAs", p.reduce_ctas);
  a.reduce_sms_arg = 0;
  a.shared_gpu = 1; /* virtual nodes on one GPU still start some */
  tw_gemm_rs_make_rail_plan(&a, 2, -1, &p);
  TEST_ASSERT(p.reduce_ctas == 2, "shared GPU, 33 CTAs: %d reduce CTAs, want 2", p.reduce_ctas);
}

int main(void) {
  test_rs_units();
  test_rs_rail_plans();
  test_rs_plan_bounds();
  test_rs_groups();
  test_rs_block_n();
  test_rs_bands_interleave_reduce();
  test_rs_owner_epi_plans();
  test_rs_pull_plans();
  test_gemm_rs_plan_invariants();
  return tw_test_finish();
}
