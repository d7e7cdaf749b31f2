/*
 * Launch-plan heuristics, without a GPU (run in CI): tw_gemm, tw_ag_gemm and tw_gemm_rs plans
 * stay inside their invariants (grid within the SM budget, communication CTAs leave the GEMM
 * some SMs, flag slices not overrun) and make the choices docs/PERF.md measured (128x128 tiles
 * where 128x256 leave an idle last wave, L2 groups aligned with shards).
 */
#include <string.h>

#include "gemm/gemm_heuristics.h"
#include "ops/ag_gemm/ag_gemm.h"
#include "ops/allgather/allgather.h"
#include "ops/gemm_rs/gemm_rs.h"
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

static int rs_interleave(tw_gemm_rs_plan_args_t a) {
  tw_gemm_rs_plan_t p;
  tw_gemm_rs_make_plan(&a, &p);
  return p.interleave;
}

static void test_gemm_rs_plans(void) {
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
  /* The tile width by the rule: the ping-pong loop's 192 columns at long K on GPUs of their
   * own (flux-tp8), 256 at short K, where ranks share a GPU or the owner epilogue is forced,
   * and 192 forced only where no push box holds the start of an owner's rows. */
  {
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
  }
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
  /* tw_gemm_ar's direct scheme: the env wins; by default 2 ranks on distinct GPUs, bf16
   * partials, m <= 4096 with K >= 4096 (flux-tp8's GEMM+AR on 2 GPUs) or m < 128 (decode). */
  TEST_ASSERT(tw_gemm_ar_want_direct(-1, 2, 0, 2, 4096, 6144), "flux-tp8, 2 GPUs, bf16: direct");
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 2, 0, 4, 4096, 6144), "fp32 partials: not direct");
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 2, 1, 2, 4096, 6144), "shared GPU: not direct");
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 4, 0, 2, 4096, 6144), "4 ranks: not direct");
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 2, 0, 2, 8192, 6144), "m 8192: not direct");
  TEST_ASSERT(tw_gemm_ar_want_direct(-1, 2, 0, 2, 64, 1024), "decode M=64 bf16, short K: direct");
  TEST_ASSERT(tw_gemm_ar_want_direct(-1, 2, 0, 4, 64, 1024), "decode M=64 fp32: direct");
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 2, 0, 4, 128, 1024), "M=128 fp32: not direct");
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 2, 1, 4, 64, 1024), "decode M=64 shared GPU: not direct");
  TEST_ASSERT(tw_gemm_rs_call_workspace_bytes(2, 64, 8192) >=
                  tw_gemm_ar_direct_workspace_bytes(2, 64, 8192, 4),
              "the workspace size holds the fp32 direct scheme at decode");
  TEST_ASSERT(tw_gemm_rs_call_workspace_bytes(2, 4096, 12288) ==
                  tw_gemm_ar_push_workspace_bytes(2, 4096, 12288),
              "the workspace size is the push's where the fp32 direct scheme is not taken");
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 2, 0, 2, 256, 1024), "M=256 short K: not direct");
  /* the unfused pipeline: m <= 256 on distinct GPUs, forced by TW_RS_UNFUSED_SMALL=1, never at
   * world 1 or with =0 */
  for (int ar = 0; ar < 2; ar++) {
    TEST_ASSERT(tw_gemm_rs_want_unfused(-1, 2, 0, 64, 1024, 4, ar, 0),
                "decode M=64, 2 GPUs: unfused");
    TEST_ASSERT(tw_gemm_rs_want_unfused(-1, 8, 0, 256, 1024, 4, ar, 0), "M=256, 8 GPUs: unfused");
    TEST_ASSERT(!tw_gemm_rs_want_unfused(-1, 2, 0, 1024, 1024, 4, ar, 0), "M=1024: fused");
    TEST_ASSERT(tw_gemm_rs_want_unfused(-1, 8, 1, 64, 1024, 4, ar, 0) == ar,
                "shared GPU, M=64: GEMM+AR unfused, GEMM+RS fused");
    TEST_ASSERT(!tw_gemm_rs_want_unfused(-1, 8, 1, 128, 1024, 4, ar, 0),
                "shared GPU, M=128: fused");
    TEST_ASSERT(tw_gemm_rs_want_unfused(1, 8, 1, 16384, 1024, 4, ar, 0),
                "TW_RS_UNFUSED_SMALL=1: unfused");
    TEST_ASSERT(!tw_gemm_rs_want_unfused(0, 2, 0, 64, 1024, 4, ar, 0),
                "TW_RS_UNFUSED_SMALL=0: fused");
    TEST_ASSERT(!tw_gemm_rs_want_unfused(1, 1, 0, 64, 1024, 4, ar, 0), "world 1: the plain GEMM");
  }
  /* one case a row: env, world, gpu_shared, m, k, partial bytes, all_reduce, stores_all (into
   * every rank's out: symmetric or peer outs) -> want */
  static const struct {
    int env, world, shared;
    int64_t m, k;
    int pbytes, ar, stores_all, want;
    const char *what;
  } unfused_cases[] = {
      {-1, 2, 0, 16, 1024, 4, 0, 0, 1, "GEMM+RS M=16: unfused"},
      {-1, 2, 0, 16, 1024, 4, 1, 0, 1, "GEMM+AR M=16: unfused"},
      {-1, 2, 0, 264, 1024, 4, 1, 0, 0, "GEMM+AR M=264: fused"},
      {-1, 2, 0, 512, 1024, 4, 0, 0, 1, "GEMM+RS M=512: unfused"},
      {-1, 2, 0, 512, 1024, 4, 1, 0, 0, "GEMM+AR M=512: fused"},
      /* ranks sharing a GPU, K per rank <= 2048, m >= 4096: fp32 partials into out (rs) or
       * symmetric or peer outs (stores_all) */
      {-1, 8, 1, 4096, 512, 4, 0, 0, 1, "shared GPU, K 512: RS unfused"},
      {-1, 8, 1, 8192, 1024, 4, 1, 1, 1, "shared GPU, K 1024, symmetric out: AR unfused"},
      {-1, 8, 1, 4096, 512, 4, 1, 0, 0, "shared GPU, plain out: AR fused"},
      /* tw_gemm_ar below m 4096 there: either partials, K <= 2048, symmetric or peer outs */
      {-1, 8, 1, 1024, 256, 4, 1, 1, 1, "shared GPU, m 1024 K 256, peer outs: AR unfused"},
      {-1, 8, 1, 512, 1024, 2, 1, 1, 1, "shared GPU, m 512, bf16 partials: AR unfused"},
      {-1, 8, 1, 4096, 2048, 2, 1, 1, 1, "shared GPU, m 4096 K 2048 bf16: AR unfused"},
      {-1, 8, 1, 2048, 4096, 4, 1, 1, 0, "shared GPU, m 2048 K 4096: AR fused"},
      {-1, 8, 1, 1024, 256, 4, 1, 0, 0, "shared GPU, m 1024, gather area: AR fused"},
      {-1, 8, 1, 1024, 256, 4, 0, 0, 0, "shared GPU, m 1024: RS fused"},
      {-1, 8, 1, 4096, 512, 2, 0, 0, 0, "shared GPU, bf16 partials: fused"},
      {-1, 8, 1, 16384, 2048, 4, 0, 0, 1, "shared GPU, K 2048: RS unfused"},
      {-1, 8, 1, 16384, 2048, 4, 1, 1, 1, "shared GPU, K 2048, symmetric or peer outs: AR unfused"},
      {-1, 8, 1, 16384, 2049, 4, 0, 0, 0, "shared GPU, K 2049: fused"},
      {-1, 8, 1, 4096, 6144, 4, 1, 1, 0, "shared GPU, flux-tp8's K 6144: fused"},
      {-1, 8, 1, 16384, 2048, 2, 1, 1, 0, "shared GPU, K 2048, bf16 partials: fused"},
      {-1, 8, 1, 2048, 512, 4, 0, 0, 0, "shared GPU, m 2048: fused"},
      {-1, 2, 0, 4096, 512, 4, 0, 0, 0, "distinct GPUs, m 4096: fused"},
      {0, 8, 1, 4096, 512, 4, 0, 0, 0, "TW_RS_UNFUSED_SMALL=0: fused"},
  };
  for (size_t i = 0; i < sizeof(unfused_cases) / sizeof(unfused_cases[0]); i++) {
    const int got = tw_gemm_rs_want_unfused(unfused_cases[i].env, unfused_cases[i].world,
                                            unfused_cases[i].shared, unfused_cases[i].m,
                                            unfused_cases[i].k, unfused_cases[i].pbytes,
                                            unfused_cases[i].ar, unfused_cases[i].stores_all);
    TEST_ASSERT(!got == !unfused_cases[i].want, "%s", unfused_cases[i].what);
  }
  TEST_ASSERT(tw_gemm_rs_unfused_workspace_bytes(64, 8192, 4, 1) == (size_t)64 * 8192 * 6,
              "unfused workspace, fp32 partials and the gather area");
  TEST_ASSERT(tw_gemm_rs_unfused_workspace_bytes(64, 8192, 2, 0) == (size_t)64 * 8192 * 2,
              "unfused workspace, bf16 partials");
  /* the low-latency exchange: two halves of world slots of m / world rows, 2 bytes per data
   * byte, plus tw_gemm_ar's bf16 gather slots */
  TEST_ASSERT(tw_gemm_rs_ll_bytes(2, 16, 8192, 4, 0) == (size_t)2 * 2 * 8 * 8192 * 4 * 2,
              "ll bytes, rs M=16 fp32");
  TEST_ASSERT(tw_gemm_rs_ll_bytes(2, 64, 8192, 2, 1) ==
                  (size_t)2 * (2 * 32 * 8192 * 2 * 2 + 2 * 32 * 8192 * 2 * 2),
              "ll bytes, ar M=64 bf16 partials");
  TEST_ASSERT(tw_gemm_rs_ll_bytes(1, 16, 8192, 4, 1) == 0, "ll bytes, world 1");
  const size_t ll16m = (size_t)16 << 20;
  TEST_ASSERT(tw_gemm_rs_want_ll(1, 2, 64, 8192, 4, 1, ll16m, 0, 128), "=1: M=64 AR fits 16 MiB");
  TEST_ASSERT(tw_gemm_rs_want_ll(-1, 2, 64, 8192, 4, 1, ll16m, 0, 128),
              "rule: M=64 fp32, 2 MiB a peer, a swap-AB shape");
  TEST_ASSERT(!tw_gemm_rs_want_ll(-1, 2, 64, 16384, 4, 0, (size_t)32 << 20, 0, 128),
              "rule: M=64 fp32 n 16384, 4 MiB a peer");
  TEST_ASSERT(tw_gemm_rs_want_ll(-1, 2, 128, 8192, 2, 1, ll16m, 0, 128),
              "rule: M=128 bf16, 2 MiB a peer, swapped in the pipeline");
  TEST_ASSERT(!tw_gemm_rs_want_ll(-1, 2, 192, 4096, 2, 0, ll16m, 0, 128),
              "rule: M=192 bf16, 1.5 MiB a peer, not swapped");
  TEST_ASSERT(
      tw_gemm_swap_bn_upto(-1, 128, tw_gemm_rs_swap_max_m(0)) == 64 &&
          tw_gemm_swap_bn_upto(-1, 129, tw_gemm_rs_swap_max_m(0)) == 0 &&
          tw_gemm_swap_bn_upto(-1, 65, tw_gemm_rs_swap_max_m(1)) == 0 &&
          tw_gemm_swap_bn_upto(0, 100, tw_gemm_rs_swap_max_m(0)) == 0 &&
          tw_gemm_swap_bn_upto(-1, 200, 4096) == 0,
      "the pipeline's swap rule: to m 128 on GPUs of their own, 64 where shared, never past "
      "TW_GEMM_SWAP_FORCED_MAX_M");
  TEST_ASSERT(!tw_gemm_rs_want_ll(-1, 2, 128, 8192, 2, 1, (size_t)64 << 20, 0, 64),
              "rule: M=128 bf16 where ranks share a GPU (not swapped there): 1 MiB");
  TEST_ASSERT(tw_gemm_rs_want_ll(-1, 4, 128, 8192, 2, 0, ll16m, 0, 128),
              "rule: M=128 bf16 on 4 ranks, 1 MiB a peer");
  TEST_ASSERT(tw_gemm_rs_want_ll(-1, 2, 64, 8192, 2, 1, ll16m, 0, 128),
              "rule: M=64 bf16, 1 MiB a peer");
  TEST_ASSERT(tw_gemm_rs_want_ll(-1, 2, 16, 8192, 4, 0, ll16m, 0, 128), "rule: M=16 fp32");
  TEST_ASSERT(tw_gemm_rs_want_ll(-1, 8, 64, 8192, 4, 1, ll16m, 0, 128), "rule: M=64 AR, 8 ranks");
  TEST_ASSERT(tw_gemm_rs_want_ll(1, 2, 128, 8192, 4, 0, ll16m, 0, 128),
              "RS M=128 fp32: 16 MiB, fits");
  TEST_ASSERT(!tw_gemm_rs_want_ll(-1, 2, 256, 8192, 4, 0, ll16m, 0, 128), "RS M=256 fp32: 32 MiB");
  TEST_ASSERT(!tw_gemm_rs_want_ll(-1, 2, 128, 8192, 4, 1, ll16m, 0, 128), "AR M=128 fp32: 24 MiB");
  TEST_ASSERT(!tw_gemm_rs_want_ll(0, 2, 16, 8192, 4, 0, ll16m, 0, 128),
              "TW_RS_UNFUSED_LL=0: the pull");
  TEST_ASSERT(!tw_gemm_rs_want_ll(-1, 2, 16, 8192, 4, 0, 0, 0, 128), "no area: the pull");
  TEST_ASSERT(!tw_gemm_rs_want_ll(-1, 8, 64, 8192, 4, 1, ll16m, 1, 128),
              "rule: shared GPU, AR into every rank's out, fp32: no area");
  TEST_ASSERT(tw_gemm_rs_want_ll(-1, 8, 64, 8192, 2, 1, ll16m, 1, 128),
              "rule: shared GPU, AR into every rank's out, bf16 at M=64: the area");
  TEST_ASSERT(!tw_gemm_rs_want_ll(-1, 8, 1024, 1024, 2, 1, ll16m, 1, 128),
              "rule: shared GPU, AR into every rank's out, bf16 at M=1024: no area");
  TEST_ASSERT(tw_gemm_rs_want_ll(-1, 8, 1024, 1024, 2, 1, ll16m, 0, 128),
              "rule: M=1024 bf16 with a gather area: the area (512 KiB a peer)");
  TEST_ASSERT(tw_gemm_rs_want_ll(1, 8, 64, 8192, 4, 1, ll16m, 1, 128), "=1: the area even so");
  /* tw_gemm_rs's own rows summed in the swap-AB epilogue (TW_RS_LL_REDUCE): the rule at m <= 16,
   * never for tw_gemm_ar */
  TEST_ASSERT(tw_gemm_rs_want_ll_reduce(-1, 0, 16), "ll reduce rule: rs m 16");
  TEST_ASSERT(!tw_gemm_rs_want_ll_reduce(-1, 0, 17), "ll reduce rule: rs m 17");
  TEST_ASSERT(!tw_gemm_rs_want_ll_reduce(-1, 1, 16), "ll reduce rule: ar");
  TEST_ASSERT(tw_gemm_rs_want_ll_reduce(1, 0, 64), "TW_RS_LL_REDUCE=1: rs m 64");
  TEST_ASSERT(!tw_gemm_rs_want_ll_reduce(1, 1, 64), "TW_RS_LL_REDUCE=1: never ar");
  TEST_ASSERT(!tw_gemm_rs_want_ll_reduce(0, 0, 8), "TW_RS_LL_REDUCE=0");
  /* tw_allgather through the area: 2 halves x world slots x 2 bytes per shard byte */
  TEST_ASSERT(tw_ag_ll_bytes(2, 512u << 10) == (size_t)4 << 20, "ag ll bytes, 2 ranks 512 KiB");
  TEST_ASSERT(tw_ag_ll_bytes(1, 4096) == 0, "ag ll bytes, world 1");
  TEST_ASSERT(tw_ag_want_ll(-1, 2, 0, 512u << 10, ll16m), "ag rule: 512 KiB on 2 GPUs");
  TEST_ASSERT(!tw_ag_want_ll(-1, 2, 0, (512u << 10) + 16, ll16m), "ag rule: past 512 KiB");
  TEST_ASSERT(!tw_ag_want_ll(-1, 2, 1, 4096, ll16m), "ag rule: shared GPU keeps the SM push");
  TEST_ASSERT(tw_ag_want_ll(1, 8, 1, 512u << 10, ll16m), "TW_AG_LL=1: 8 x 512 KiB fits 16 MiB");
  TEST_ASSERT(!tw_ag_want_ll(1, 8, 0, (512u << 10) + 16, ll16m), "TW_AG_LL=1: does not fit");
  TEST_ASSERT(!tw_ag_want_ll(0, 2, 0, 4096, ll16m), "TW_AG_LL=0");
  TEST_ASSERT(!tw_ag_want_ll(1, 1, 0, 4096, ll16m), "world 1");
  /* what tw_gemm_rs_workspace_size asks for holds it wherever the rule takes it */
  for (int w = 2; w <= 8; w++)
    for (int64_t m = w; m <= TW_RS_UNFUSED_MAX_M; m += w)
      TEST_ASSERT(tw_gemm_rs_call_workspace_bytes(w, m, 264) >=
                      tw_gemm_rs_unfused_workspace_bytes(m, 264, 4, 1),
                  "world %d m %lld: the asked-for workspace holds the unfused pipeline", w,
                  (long long)m);
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 2, 0, 2, 1024, 2048), "K 2048: not direct");
  TEST_ASSERT(tw_gemm_ar_want_direct(1, 8, 1, 4, 65536, 8), "TW_AR_DIRECT=1 wins");
  TEST_ASSERT(!tw_gemm_ar_want_direct(0, 2, 0, 2, 4096, 6144), "TW_AR_DIRECT=0 wins");
  /* The owner epilogue on 2 ranks: the env wins; by default fp32 partials with K < 4096 per
   * rank and at least 3 waves of tiles, unless the caller set the reduce CTAs. Tiles are
   * 128 x 256: M=16384 2048 of them, M=8192 64 x 32, m 4096 n 4096 32 x 16, m 1024 n 8192 8 x
   * 32. */
  TEST_ASSERT(tw_gemm_rs_want_owner_epi(-1, 0, 4, 2048, 128 * 64, 132),
              "M=16384 (K 2048), fp32: owner epilogue");
  TEST_ASSERT(tw_gemm_rs_want_owner_epi(-1, 0, 4, 1024, 64 * 32, 132),
              "M=8192 (K 1024), fp32: owner epilogue");
  TEST_ASSERT(tw_gemm_rs_want_owner_epi(-1, 0, 4, 512, 32 * 16, 132),
              "m 4096 n 4096 (K 512, 3.9 waves): owner epilogue");
  TEST_ASSERT(tw_gemm_rs_want_owner_epi(-1, 0, 4, 3072, 32 * 48, 132),
              "K 3072, fp32: owner epilogue");
  TEST_ASSERT(!tw_gemm_rs_want_owner_epi(-1, 0, 4, 2048, 8 * 32, 132),
              "small-m on 2 GPUs (1.9 waves): reduce CTAs");
  TEST_ASSERT(tw_gemm_rs_want_owner_epi(-1, 0, 4, 2048, 8 * 32, 66),
              "small-m on 2 virtual ranks (3.9 waves of 66): owner epilogue");
  TEST_ASSERT(!tw_gemm_rs_want_owner_epi(-1, 0, 4, 2048, 395, 132),
              "395 tiles of 132: reduce CTAs");
  TEST_ASSERT(tw_gemm_rs_want_owner_epi(-1, 0, 4, 2048, 396, 132),
              "396 tiles of 132: owner epilogue");
  TEST_ASSERT(!tw_gemm_rs_want_owner_epi(-1, 0, 4, 4096, 2048, 132), "K 4096: reduce CTAs");
  TEST_ASSERT(!tw_gemm_rs_want_owner_epi(-1, 0, 4, 6144, 16 * 48, 132),
              "flux-tp8 (K 6144): reduce CTAs");
  TEST_ASSERT(!tw_gemm_rs_want_owner_epi(-1, 0, 2, 512, 2048, 132), "bf16 partials: reduce CTAs");
  TEST_ASSERT(!tw_gemm_rs_want_owner_epi(-1, 1, 4, 512, 2048, 132), "reduce CTAs set: reduce CTAs");
  TEST_ASSERT(tw_gemm_rs_want_owner_epi(1, 1, 2, 65536, 1, 132), "TW_RS_OWNER_EPI=1 wins");
  TEST_ASSERT(!tw_gemm_rs_want_owner_epi(0, 0, 4, 512, 2048, 132), "TW_RS_OWNER_EPI=0 wins");
  /* The plan takes it where the call can (tw_gemm_rs_make_plan): then no reduce CTA and one
   * unit per group. The plans above pass owner_env 0 (never) and test the rest. Fields: world,
   * m, n, k, sm_budget, reduce_sms_arg, all_reduce, band_env, partial_bytes, comm_world,
   * shared_gpu, interleave_env, reduce_env, group_env, plan_sms, owner_env, pull_env. */
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
  TEST_ASSERT(tw_gemm_ar_direct_workspace_bytes(2, 4096, 12288, 2) <=
                  tw_gemm_ar_push_workspace_bytes(2, 4096, 12288), /* tw_gemm_rs_workspace_size */
              "direct with bf16 partials fits the default workspace on 2 ranks");
  one.band_env = 3;
  one.n = 4096;
  tw_gemm_rs_make_plan(&one, &p);
  TEST_ASSERT(p.band == 3, "TW_RS_BAND=3: band %d", p.band);
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

/* tw_gemm_rs_make_plan over random shapes, worlds, budgets, partials and knob settings: the
 * invariants every plan keeps whatever rule chose it (a net under the per-rule tests above).
 * Deterministic (a fixed xorshift seed); failures print the arguments. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}
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

/* tw_ag_gemm_make_plan + tw_ag_gemm_plan_peer over random shapes, budgets and knobs: the chunks
 * cover the shard within the flag slice, the communication CTAs leave at least one CTA to the
 * GEMM (budgets of 2 and up) and serve no more items than exist, peer reads only where every
 * rank is on this GPU with whole row blocks. */
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
  test_rs_units();
  test_ag_comm_rule();
  test_ag_gemm_plans();
  test_gemm_rs_plans();
  test_gemm_rs_plan_invariants();
  test_ag_gemm_plan_invariants();
  return tw_test_finish();
}
