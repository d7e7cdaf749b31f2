/*
 * Launch-plan heuristics of tw_gemm and tw_ag_gemm, without a GPU (run in CI): tw_gemm's tile
 * variants, split-K, swap-AB and workspace rules; tw_ag_gemm's plans stay inside their
 * invariants (grid within the SM budget, communication CTAs leave the GEMM some SMs, flag
 * slices not overrun) and make the choices docs/PERF.md measured (128x128 tiles where 128x256
 * leave an idle last wave, L2 groups aligned with shards), its copy-engine and peer-read rules.
 * tw_gemm_rs's plans: test_plans_rs.c; the routes around the fused kernels: test_plans_routes.c.
 */
#include <string.h>

#include "gemm/gemm_heuristics.h"
#include "ops/ag_gemm/ag_gemm.h"
#include "tw_test.h"

static tw_ag_gemm_plan_t ag_plan(int world, int64_t m_local, int64_t n, int64_t k, int budget,
                                 int comm_arg, int group_env) {
  tw_ag_gemm_plan_args_t a = {world, m_local, n, k, budget, comm_arg, 0, group_env, 0, -1};
  tw_ag_gemm_plan_t p;
  tw_ag_gemm_make_plan(&a, &p);
  return p;
}

/* The communication CTA rule at the benchmark shapes (docs/PERF.md has the sweeps behind it). */
static void test_ag_comm_rule(void) {
  tw_ag_gemm_plan_args_t a = {2, 2048, 6144, 12288, 132, 0, 0, 0, 0, -1}; /* flux-tp8, 2 GPUs */
  tw_ag_gemm_plan_t p;
  tw_ag_gemm_make_plan(&a, &p);
  TEST_ASSERT(p.comm_ctas == 5, "flux-tp8 on 2 GPUs: %d comm CTAs (measured best: 5)", p.comm_ctas);
  tw_ag_gemm_plan_args_t c = {2, 4096, 1024, 8192, 132, 0, 0, 0, 0, -1}; /* M=8192: comm-bound */
  tw_ag_gemm_make_plan(&c, &p);
  TEST_ASSERT(p.comm_ctas >= 48, "M=8192 N=1024 on 2 GPUs: %d comm CTAs (48-66 measured best)",
              p.comm_ctas);
  tw_ag_gemm_plan_args_t v = {8, 2048, 2048, 16384, 16, 0, 0, 0, 1, -1}; /* M=16384, 8 vranks */
  tw_ag_gemm_make_plan(&v, &p);
  const int shared = p.comm_ctas;
  /* Kernel variant: the wide-epilogue split where ranks share a GPU (measured faster there,
   * slower on distinct GPUs), TW_AG_VARIANT when set. */
  TEST_ASSERT(p.variant == 1, "shared GPU: variant %d, want 1", p.variant);
  v.shared_gpu = 0;
  tw_ag_gemm_make_plan(&v, &p);
  TEST_ASSERT(shared > p.comm_ctas && shared <= 8,
              "M=16384 on 8 ranks: %d comm CTAs sharing a GPU, %d on distinct GPUs", shared,
              p.comm_ctas);
  TEST_ASSERT(p.variant == 0, "distinct GPUs: variant %d, want 0", p.variant);
  v.variant_env = 1;
  tw_ag_gemm_make_plan(&v, &p);
  TEST_ASSERT(p.variant == 1, "TW_AG_VARIANT=1: variant %d", p.variant);
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
  /* split_k = -1 (tw_gemm_auto_split, the shape alone): 8 slices of 16 K blocks for a
   * decode-sized GEMM (8 narrow tiles, 128 K blocks), none at M=64 N=8192 K=1024 (64 tiles of
   * 16 K blocks: the split measured slower), 4 at M=256 (16 tiles: 4 slices fill 64 of 132 SMs,
   * 8 would not fit twice), none where the tiles fill the SMs. Swapped products stay unsplit
   * where 2 slices of 128-row tiles put no more CTAs on the weights than the unsplit 64-row
   * tiles (M=64 N=1024 K=2048, M=16-128 N=4096: tree 2, auto 1); 4 clusters of 4 slices fit at
   * once up to 120 CTAs, so 32 tiles take 2 slices in the tree (tw_gemm_tree_split, tw_ag_gemm's
   * route), not 4. `tree`: tw_gemm_tree_split's. */
  static const struct {
    int64_t m, n, k;
    int want, tree;
  } sp[] = {{64, 1024, 8192, 8, 8},  {64, 8192, 1024, 1, 1},   {4096, 4096, 4096, 1, 1},
            {64, 1024, 1024, 1, 1},  {256, 1024, 8192, 4, 4},  {512, 2048, 4096, 2, 2},
            {1, 8, 8, 1, 1},         {1, 8, 4096, 4, 4},       {1, 8, 16384, 8, 8},
            {64, 1024, 2048, 1, 2},  {4160, 1000, 4104, 1, 1}, {64, 4096, 4096, 1, 2},
            {128, 4096, 4096, 1, 2}, {16, 4096, 8192, 1, 2},   {96, 4096, 4096, 1, 2},
            {64, 2048, 8192, 4, 4},  {96, 2048, 8192, 4, 4},   {64, 3072, 8192, 4, 4},
            {64, 2048, 3072, 1, 2},  {64, 1088, 3072, 2, 2},   {40, 136, 2056, 2, 2},
            {200, 4096, 8192, 2, 2}, {256, 4096, 8192, 2, 2}};
  for (size_t i = 0; i < sizeof(sp) / sizeof(sp[0]); i++) {
    const int got = tw_gemm_auto_split(sp[i].m, sp[i].n, sp[i].k);
    const int tree = tw_gemm_tree_split(sp[i].m, sp[i].n, sp[i].k);
    TEST_ASSERT(got == sp[i].want && tree == sp[i].tree,
                "auto split M=%lld N=%lld K=%lld: %d (tree %d), want %d (%d)", (long long)sp[i].m,
                (long long)sp[i].n, (long long)sp[i].k, got, tree, sp[i].want, sp[i].tree);
  }
  /* swap-AB's tile width (TW_GEMM_SWAP): 16 up to m 16, 64 up to 64 (forced: up to 128), none
   * above or when off */
  static const struct {
    int env;
    int64_t m;
    int want;
  } sw[] = {{-1, 1, 16},   {-1, 16, 16}, {-1, 17, 64}, {-1, 64, 64}, {-1, 65, 0},
            {-1, 4096, 0}, {0, 1, 0},    {0, 64, 0},   {1, 16, 16},  {1, 64, 64},
            {1, 128, 64},  {2, 100, 64}, {1, 129, 0},  {0, 128, 0}};
  for (size_t i = 0; i < sizeof(sw) / sizeof(sw[0]); i++) {
    const int got = tw_gemm_swap_bn(sw[i].env, sw[i].m);
    TEST_ASSERT(got == sw[i].want, "swap width env %d m %lld: %d, want %d", sw[i].env,
                (long long)sw[i].m, got, sw[i].want);
  }
  /* fp32 output on the 128 x 256 tiles takes the ping-pong loop's 128 x 192; nothing else moves */
  TEST_ASSERT(tw_gemm_out_variant(TW_GEMM_V_S3_E32, 1) == TW_GEMM_V_PP_N192, "fp32 out, 128 x 256");
  TEST_ASSERT(tw_gemm_out_variant(TW_GEMM_V_S3_E32, 0) == TW_GEMM_V_S3_E32, "bf16 out, 128 x 256");
  TEST_ASSERT(tw_gemm_out_variant(TW_GEMM_V_N128_S6, 1) == TW_GEMM_V_N128_S6,
              "fp32 out, 128 x 128");
  TEST_ASSERT(tw_gemm_out_variant(TW_GEMM_V_S4_E16_C2, 1) == TW_GEMM_V_S4_E16_C2,
              "fp32 out, pairs");
  /* tw_gemm's own bound on the rule: 128 unsplit where 2 x n / 128 tiles fit the SMs */
  static const struct {
    int64_t n;
    int split, sms;
    int64_t want;
  } sb[] = {{1024, 1, 132, 128}, {8192, 1, 132, 128}, {8448, 1, 132, 128}, {8449, 1, 132, 64},
            {16384, 1, 132, 64}, {1024, 8, 132, 64},  {4096, 1, 16, 64},   {1024, 1, 16, 128}};
  for (size_t i = 0; i < sizeof(sb) / sizeof(sb[0]); i++) {
    const int64_t got = tw_gemm_swap_rule_max_m(sb[i].n, sb[i].split, sb[i].sms);
    TEST_ASSERT(got == sb[i].want, "swap rule bound n %lld split %d sms %d: %lld, want %lld",
                (long long)sb[i].n, sb[i].split, sb[i].sms, (long long)got, (long long)sb[i].want);
  }
  /* its 64-row tiles: by the rule where 128-row tiles fill at most half the SMs, unsplit (past
   * m 64 where the bound reaches m) */
  static const struct {
    int env;
    int64_t m, n;
    int split, sms, want;
  } sh[] = {{-1, 16, 8192, 1, 132, 1},  {-1, 64, 8192, 1, 132, 1},  {-1, 16, 8192, 1, 66, 0},
            {-1, 16, 8448, 1, 132, 1},  {-1, 16, 8576, 1, 132, 0},  {-1, 32, 28672, 1, 132, 0},
            {-1, 16, 8192, 8, 132, 0},  {-1, 128, 1024, 1, 132, 1}, {-1, 128, 4096, 1, 132, 1},
            {-1, 96, 4352, 1, 132, 0},  {-1, 128, 8192, 1, 132, 0}, {-1, 128, 1024, 8, 132, 0},
            {-1, 129, 1024, 1, 132, 0}, {2, 16, 28672, 1, 132, 1},  {2, 16, 8192, 4, 132, 0},
            {1, 16, 8192, 1, 132, 0},   {0, 16, 8192, 1, 132, 0}};
  for (size_t i = 0; i < sizeof(sh) / sizeof(sh[0]); i++) {
    const int got = tw_gemm_swap_half(sh[i].env, sh[i].m, sh[i].n, sh[i].split, sh[i].sms);
    TEST_ASSERT(got == sh[i].want, "swap 64-row tiles env %d m %lld n %lld split %d sms %d: %d",
                sh[i].env, (long long)sh[i].m, (long long)sh[i].n, sh[i].split, sh[i].sms, got);
  }
  /* their width of A's rows: 32 at m <= 32 where tw_gemm_swap_bn gives 64 */
  static const struct {
    int mt;
    int64_t m;
    int want;
  } hm[] = {{64, 17, 32}, {64, 32, 32}, {64, 33, 64}, {64, 64, 64}, {64, 128, 64}, {16, 16, 16}};
  for (size_t i = 0; i < sizeof(hm) / sizeof(hm[0]); i++) {
    const int got = tw_gemm_swap_half_mt(hm[i].mt, hm[i].m);
    TEST_ASSERT(got == hm[i].want, "swap 64-row tiles' width mt %d m %lld: %d, want %d", hm[i].mt,
                (long long)hm[i].m, got, hm[i].want);
  }
  /* split-K through a workspace: the tree's slices on tiles of 64 of B's rows where twice the
   * CTAs still fit 132 SMs; never unsplit, or where n is one 64-row tile */
  static const struct {
    int64_t m, n, k;
    int mt, want;
    size_t bytes;
  } ws[] = {{16, 1024, 8192, 16, 8, 4096 + 16 * 8 * 2 * 128 * 4 * 4},
            {32, 1024, 8192, 64, 8, 4096 + 16 * 8 * 2 * 128 * 16 * 4},
            {64, 1024, 8192, 64, 8, 4096 + 16 * 8 * 2 * 128 * 16 * 4},
            {9, 2048, 4096, 16, 4, 4096 + 32 * 4 * 2 * 128 * 4 * 4},
            {1, 200, 4096, 16, 4, 4096 + 4 * 4 * 2 * 128 * 4 * 4},
            {40, 136, 2056, 64, 2, 4096 + 3 * 2 * 2 * 128 * 16 * 4},
            {64, 1088, 3072, 64, 2, 4096 + 17 * 2 * 2 * 128 * 16 * 4},
            {64, 2048, 3072, 64, 0, 0}, /* -1 unsplit: 2 slices add no weight stream */
            {64, 3072, 8192, 64, 0, 0}, /* the tree's 4 slices x 48 tiles: over 132 */
            {64, 1024, 8192, 0, 8, 4096 + 16 * 8 * 2 * 128 * 32 * 4}, /* unswapped: 128 x 64 */
            {128, 1024, 8192, 0, 8, 4096 + 16 * 8 * 2 * 128 * 32 * 4},
            {256, 1024, 8192, 0, 4, 4096 + 32 * 4 * 2 * 128 * 32 * 4},
            {100, 520, 4104, 0, 4, 4096 + 9 * 4 * 2 * 128 * 32 * 4},
            {130, 1024, 4096, 0, 4, 4096 + 32 * 4 * 2 * 128 * 32 * 4},
            {512, 1024, 8192, 0, 2, 4096 + 64 * 2 * 2 * 128 * 32 * 4}, /* 2 slices of 32 tiles */
            {512, 2048, 8192, 0, 0, 0}, /* the tree's 2 slices x 128 tiles: over 132 */
            {16, 8192, 1024, 16, 0, 0}, /* unsplit (16 K blocks) */
            {1, 8, 4096, 16, 0, 0},     /* one 64-row tile */
            {16, 4096, 8192, 16, 0, 0}, /* -1 unsplit (2 slices of 32 tree tiles) */
            {4096, 4096, 4096, 0, 0, 0}};
  for (size_t i = 0; i < sizeof(ws) / sizeof(ws[0]); i++) {
    size_t bytes = 0;
    const int got = tw_gemm_ws_split(ws[i].m, ws[i].n, ws[i].k, ws[i].mt, &bytes);
    TEST_ASSERT(got == ws[i].want &&
                    (!got || (bytes == ws[i].bytes &&
                              got == tw_gemm_auto_split(ws[i].m, ws[i].n, ws[i].k) &&
                              bytes <= TW_GEMM_WORKSPACE_BYTES)),
                "workspace split m %lld n %lld k %lld mt %d: %d (%zu bytes), want %d (%zu)",
                (long long)ws[i].m, (long long)ws[i].n, (long long)ws[i].k, ws[i].mt, got, bytes,
                ws[i].want, ws[i].bytes);
  }
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
  /* Peer reads: every rank on this GPU, the SM mode, m_local a multiple of 128, world <= 8;
   * with the gathered output (write-through) under TW_AG_PEER_GATHER=1, or by default (-1)
   * where N per rank <= 4096. */
  static const struct {
    int world, no_gather, sm_mode, all_on_gpu;
    int64_t m_local;
    int gather_env, want_read, want_gather;
    int64_t n;
  } peer[] = {{8, 1, 1, 1, 512, 0, 1, 0, 1024},   {8, 0, 1, 1, 512, 0, 0, 0, 1024},
              {8, 0, 1, 1, 512, 1, 1, 1, 6144},   {8, 0, 1, 1, 100, 1, 0, 0, 1024},
              {8, 0, 1, 0, 512, 1, 0, 0, 1024},   {8, 0, 0, 1, 512, 1, 0, 0, 1024},
              {4, 1, 1, 1, 100, 0, 0, 0, 1024},   {3, 1, 1, 1, 256, 1, 1, 0, 1024},
              {8, 0, 1, 1, 2048, -1, 1, 1, 2048}, {8, 0, 1, 1, 512, -1, 0, 0, 6144},
              {8, 0, 1, 1, 512, -1, 1, 1, 4096},  {8, 1, 1, 1, 512, -1, 1, 0, 1024},
              {8, 0, 1, 1, 512, 2, 1, 2, 6144},   {8, 0, 1, 0, 512, 2, 0, 0, 6144}};
  for (size_t i = 0; i < sizeof(peer) / sizeof(peer[0]); i++) {
    tw_ag_gemm_plan_t p = ag_plan(peer[i].world, peer[i].m_local, peer[i].n, 1024, 16, 0, 0);
    const int comm_before = p.comm_ctas;
    tw_ag_gemm_plan_peer(&p, peer[i].world, peer[i].no_gather, peer[i].sm_mode, peer[i].all_on_gpu,
                         peer[i].m_local, peer[i].n, 0, 0, peer[i].gather_env);
    TEST_ASSERT(p.peer_read == peer[i].want_read && p.peer_gather == peer[i].want_gather,
                "peer case %zu: peer_read %d peer_gather %d, want %d %d", i, p.peer_read,
                p.peer_gather, peer[i].want_read, peer[i].want_gather);
    TEST_ASSERT(p.peer_read ? p.comm_ctas >= 1 && p.comm_ctas <= 4 : p.comm_ctas == comm_before,
                "peer case %zu: %d communication CTAs", i, p.comm_ctas);
  }
}

typedef struct {
  int world, shared;
  int64_t m_local, n, k;
  int env, want;
} ag_rule_case_t;

/* One of ag_gemm's copy-engine rules (same arguments; 132 SMs) against a table of cases. */
static void check_ag_rule(const char *what,
                          int (*rule)(int, int, int64_t, int64_t, int64_t, int, int),
                          const ag_rule_case_t *cases, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const int got = rule(cases[i].world, cases[i].shared, cases[i].m_local, cases[i].n, cases[i].k,
                         132, cases[i].env);
    TEST_ASSERT(got == cases[i].want,
                "%s, world %d shared %d m_local %lld n %lld k %lld env %d: %d, want %d", what,
                cases[i].world, cases[i].shared, (long long)cases[i].m_local, (long long)cases[i].n,
                (long long)cases[i].k, cases[i].env, got, cases[i].want);
  }
}

/* TW_AG_COMM_AUTO's copy-engine rule at the benchmark shapes on 2 GPUs (measured, docs/PERF.md):
 * the copy engine at M=16384 N=2048 K=16384, the SMs at flux-tp8 (level), M=8192 and M=4096
 * (slower with the copy engine); never where ranks share a GPU or at world 1; TW_AG_AUTO_CE.
 * Then the own-shard copy's rule in SM mode (TW_AG_OWN_COPY_CE): the copy engine at flux-tp8
 * (faster), the CTAs at M=8192 and M=4096 (slower with it); 2 ranks on GPUs of their own only. */
static void test_ag_auto_ce(void) {
  static const ag_rule_case_t mode[] = {
      {2, 0, 8192, 2048, 16384, -1, 1}, /* M=16384: push 0.59 of the GEMM */
      {2, 0, 2048, 6144, 12288, -1, 0}, /* flux-tp8: 0.20 */
      {2, 0, 4096, 1024, 8192, -1, 0},  /* M=8192: 1.2, communication-bound */
      {2, 0, 2048, 512, 4096, -1, 0},   /* M=4096: 2.3 */
      {8, 1, 2048, 2048, 16384, -1, 0}, /* ranks sharing a GPU: no copy engine between them */
      {8, 0, 512, 6144, 12288, -1, 0},  /* 8 GPUs: not measured, the SMs */
      {1, 0, 8192, 2048, 16384, 1, 0},  /* world 1: nothing to move */
      {2, 0, 2048, 512, 4096, 1, 1},    /* TW_AG_AUTO_CE=1 */
      {2, 1, 2048, 512, 4096, 1, 0},    /* ... but never on a shared GPU */
      {2, 0, 8192, 2048, 16384, 0, 0},  /* TW_AG_AUTO_CE=0 */
  };
  check_ag_rule("auto copy engine", tw_ag_gemm_auto_copy_engine, mode,
                sizeof(mode) / sizeof(mode[0]));
  static const ag_rule_case_t own[] = {
      {2, 0, 2048, 6144, 12288, -1, 1}, /* flux-tp8: push 0.20 of the GEMM */
      {2, 0, 4096, 1024, 8192, -1, 0},  /* M=8192: 1.2 */
      {2, 0, 2048, 512, 4096, -1, 0},   /* M=4096: 2.3 */
      {2, 1, 2048, 6144, 12288, -1, 0}, /* 2 ranks sharing a GPU: not measured */
      {8, 0, 512, 6144, 12288, -1, 0},  /* 8 GPUs: not measured */
      {2, 0, 2048, 512, 4096, 1, 1},    /* TW_AG_OWN_COPY_CE=1 */
      {2, 0, 2048, 6144, 12288, 0, 0},  /* TW_AG_OWN_COPY_CE=0 */
  };
  check_ag_rule("own copy by copy engine", tw_ag_gemm_own_copy_ce, own,
                sizeof(own) / sizeof(own[0]));
}

/* tw_ag_gemm_make_plan + tw_ag_gemm_plan_peer over random shapes, budgets and knobs: the chunks
 * cover the shard within the flag slice, the communication CTAs leave at least one CTA to the
 * GEMM (budgets of 2 and up) and serve no more items than exist, peer reads only where every
 * rank is on this GPU with whole row blocks. Deterministic (a fixed xorshift seed: the state
 * that test_plans_rs.c's 20000 random tw_gemm_rs plans leave, so these are the cases this test
 * ran when both shared one sequence in test_plans.c); failures print the arguments. */
static uint64_t rng_state = 0xeba48a00209634e5ull;
static uint64_t rng(void) { return tw_test_xorshift(&rng_state); }
static int pick(const int *v, int n) { return v[rng() % (uint64_t)n]; }

static void test_ag_gemm_plan_invariants(void) {
  static const int budgets[] = {2, 3, 16, 18, 33, 66, 116, 132};
  int bad = 0;
  for (int it = 0; it < 20000 && bad < 10; it++) {
    tw_ag_gemm_plan_args_t a;
    memset(&a, 0, sizeof(a));
    a.world = 1 + (int)(rng() % 8);
    a.m_local = 1 + (int64_t)(rng() % (rng() % 2 ? 70000 : 4096));
    a.n = 8 * (int64_t)(1 + rng() % 2048);
    a.k = 8 * (int64_t)(1 + rng() % 2048);
    a.sm_budget = pick(budgets, 8);
    a.comm_sms_arg = rng() % 4 == 0 ? (int)(rng() % 140) : 0;
    a.comm_sms_env = rng() % 6 == 0 ? (int)(rng() % 140) : 0;
    a.group_m_env = rng() % 6 == 0 ? (int)(1 + rng() % 32) : 0;
    a.shared_gpu = (int)(rng() % 2);
    a.variant_env = rng() % 4 == 0 ? (int)(rng() % 2) : -1;
    tw_ag_gemm_plan_t p;
    tw_ag_gemm_make_plan(&a, &p);
    const int no_gathered = (int)(rng() % 2), own_in_place = (int)(rng() % 2);
    tw_ag_gemm_plan_peer(&p, a.world, no_gathered, (int)(rng() % 2), a.shared_gpu, a.m_local, a.n,
                         own_in_place, a.comm_sms_arg, rng() % 4 ? -1 : 1);
    const char *why = NULL;
    if (p.ctas != a.sm_budget)
      why = "ctas is the budget";
    else if (p.nchunks < 1 || p.nchunks > TW_AG_GEMM_MAX_CHUNKS ||
             (int64_t)p.nchunks * p.rows_per_chunk < a.m_local ||
             (int64_t)(p.nchunks - 1) * p.rows_per_chunk >= a.m_local)
      why = "chunks cover the shard, within the flag slice";
    else if (p.comm_ctas < 1 || p.comm_ctas >= p.ctas)
      why = "communication CTAs in [1, ctas)";
    else if (!p.peer_read && p.comm_ctas > a.world * p.nchunks)
      why = "no more communication CTAs than items";
    else if (p.peer_read &&
             (!a.shared_gpu || a.m_local % 128 != 0 || a.world > TW_AG_PEER_READ_MAX_WORLD))
      why = "peer reads: every rank on this GPU, whole row blocks";
    else if (p.peer_gather && (!p.peer_read || no_gathered))
      why = "the write-through gather only with peer reads and a gathered output";
    else if (p.group_m < 1 || (p.block_n != 128 && p.block_n != 256) || p.variant < 0 ||
             p.variant > 1)
      why = "group, tile width and variant in range";
    if (why) {
      bad++;
      TEST_ASSERT(0,
                  "%s: world %d m_local %lld n %lld k %lld budget %d comm_sms %d/%d group_env %d "
                  "shared %d variant_env %d no_gathered %d in_place %d -> comm %d chunks %d x %d "
                  "peer_read %d peer_gather %d",
                  why, a.world, (long long)a.m_local, (long long)a.n, (long long)a.k, a.sm_budget,
                  a.comm_sms_arg, a.comm_sms_env, a.group_m_env, a.shared_gpu, a.variant_env,
                  no_gathered, own_in_place, p.comm_ctas, p.nchunks, p.rows_per_chunk, p.peer_read,
                  p.peer_gather);
    }
  }
  TEST_ASSERT(bad == 0, "random ag_gemm plans: %d broke an invariant", bad);
}

int main(void) {
  test_ag_auto_ce();
  test_gemm_plans();
  test_ag_comm_rule();
  test_ag_gemm_plans();
  test_ag_gemm_plan_invariants();
  return tw_test_finish();
}
