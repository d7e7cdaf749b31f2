#include "gemm/gemm_heuristics.h"

/* Fraction of the SM-waves a static persistent schedule keeps busy: tiles / (waves * sms). */
static double wave_efficiency(int64_t tiles, int sms) {
  const int64_t waves = (tiles + sms - 1) / sms;
  return (double)tiles / (double)(waves * sms);
}

/* Throughput of a 128x128 tile relative to a 128x256 one on the same SMs (more operand traffic
 * per flop); measured, see docs/PERF.md (GEMM core section). */
#define TW_GEMM_N128_RELATIVE 0.93

/* The split rules' SM count: nominal (H100 / H200 SXM), never the call's budget, so that a
 * shape's slices, and so its bits, do not depend on the budget. */
#define TW_GEMM_NOMINAL_SMS 132

int tw_gemm_prefers_n128(int64_t m, int64_t n, int sms) {
  const int64_t m_blocks = (m + 127) / 128;
  const int64_t tiles256 = m_blocks * ((n + 255) / 256);
  const int64_t tiles128 = m_blocks * ((n + 127) / 128);
  /* 128x256 tiles, 3 stages and a one-pass epilogue measured best where the waves fill; the
   * 128x128 tile wins where a last, mostly idle wave of big tiles costs more than its extra
   * operand traffic (e.g. 4096^3 on 116 SMs: 256 big tiles are 2.2 waves, 1024 small 8.8). */
  return TW_GEMM_N128_RELATIVE * wave_efficiency(tiles128, sms) > wave_efficiency(tiles256, sms);
}

int tw_gemm_tree_split(int64_t m, int64_t n, int64_t k) {
  const int sms = TW_GEMM_NOMINAL_SMS;
  const int64_t tiles = ((m + 127) / 128) * ((n + 127) / 128);
  const int64_t k_blocks = (k + 63) / 64;
  /* A decode-sized GEMM (M=64 N=1024 K=8192: 8 tiles of 128 x 128) leaves most SMs idle, each
   * busy one streaming 128 K blocks of B alone; its slices spread that stream over more SMs.
   * Each slice keeps at least 16 K blocks. Eighteenth session, H200, tw-bench gemm, ms, split
   * none / 2 / 4 / 8, the slices summed as a tree: M=64 N=1024 K=8192 0.0439 / 0.0332 / 0.0234
   * / 0.0197 (cuBLAS 0.0131); M=16 0.0436 / 0.0328 / 0.0231 / 0.0194; M=256 (16 tiles, at most
   * 4 slices here) 0.0441 / 0.0345 / 0.0260 / 0.0388; M=64 N=8192 K=1024 (16 K blocks: none)
   * 0.0132 / 0.0148 / 0.0243 / 0.0340. Clusters of 8 CTAs (about 200 KB of shared memory
   * each) on more than half the SMs do not all fit at once (a GPC holds whole clusters), so the
   * grid's cap on resident clusters (launch_plain) gives some two tiles: 8 slices only up to 8
   * tiles (at M=256, 16 tiles, split 8 took 1.5x split 4's time). Clusters of 4 fit 30 at once
   * (120 CTAs, scripts/probes/probe_clusters.cu): at 32 tiles (N=4096) 4 slices took two waves,
   * thirty-sixth session, H200, from graphs, ms, none / 2 / 4 slices: M=64 N=4096 K=4096 0.0135 /
   * 0.0148 / 0.0237, M=96 0.0164 / 0.0214 / 0.0308, M=48 N=4096 K=8192 0.0233 / 0.0240 / 0.0353. */
  int s = 1;
  for (;;) {
    const int next = s * 2; /* CTAs of clusters of `next` resident at once: */
    const int64_t resident = next == 2 ? sms : next == 4 ? 120 : sms / 2;
    if (next > 8 || tiles * next > resident || k_blocks < (int64_t)next * 16)
      return s;
    s = next;
  }
}

int tw_gemm_auto_split(int64_t m, int64_t n, int64_t k) {
  const int sms = TW_GEMM_NOMINAL_SMS;
  const int s = tw_gemm_tree_split(m, n, k);
  /* A swapped product unsplit runs 64-row tiles (tw_gemm_swap_half), as many weight streams as
   * n / 64; the tree's slices run on 128-row tiles, n / 128 x s. Where those are no more (2
   * slices), the split adds the tree's sum and nothing streaming: thirty-sixth session, H200,
   * tw_gemm from graphs, ms, unsplit / 2 slices / the same through the workspace: M=64 N=4096
   * K=4096 0.0135 / 0.0148 / 0.0136, M=128 0.0137 / 0.0209 / 0.0152, M=32 0.0131 / 0.0155 /
   * 0.0146, M=64 N=2048 K=3072 0.0106 / 0.0117 / 0.0096, M=64 N=1024 K=2048 0.0080 / 0.0092 /
   * 0.0079, M=16 N=4096 K=8192 0.0229 / 0.0207 / 0.0217 (the one loss). 4 and 8 slices keep
   * splitting: M=64 N=3072 K=8192 0.0233 / 4 slices 0.0199, M=96 N=2048 K=8192 0.0232 / 0.0221
   * (workspace 0.0166), M=64 N=1024 K=8192 0.0230 / 8 slices 0.0131 (workspace 0.0099). */
  /* tw_gemm_swap_half is 0 where the rule does not swap */
  if (s > 1 && tw_gemm_swap_half(-1, m, n, 1, sms) && ((n + 127) / 128) * s <= (n + 63) / 64)
    return 1;
  return s;
}

int tw_gemm_swap_bn_upto(int env, int64_t m, int64_t rule_max_m) {
  /* A decode product (m <= 64) on 128-row tiles wastes at least half of every wgmma and of
   * every A box on rows past m; swapped, its few rows are the wgmma's N (16 or 64) and B's rows
   * fill the 128. cuBLAS's nvjet kernels at these shapes are swapped too (ncu, twentieth
   * session: M=16 N=8192 K=1024 runs nvjet_sm90_tst_64x16_..._TNT, 7.6 us against our 11.1).
   * Past m 64 (forced, env 1 or 2, up to TW_GEMM_SWAP_FORCED_MAX_M, or a caller's rule bound):
   * 64-wide tiles of A's rows, two at m 128. Thirty-first session, H200, N=8192 K=1024 from
   * graphs, ms, 128-row tiles / swapped on 128 of B's rows / on 64 (cuBLAS): M=128 0.0096 /
   * 0.0087 / 0.0111 (0.0075), M=96 0.0095 / 0.0087 / 0.0111 (0.0073). tw_gemm's own bound:
   * tw_gemm_swap_rule_max_m (more shapes); tw_gemm_rs's decode pipeline takes 128
   * (TW_GEMM_RS_SWAP_MAX_M) where ranks have GPUs of their own. */
  const int64_t rule =
      rule_max_m < TW_GEMM_SWAP_FORCED_MAX_M ? rule_max_m : TW_GEMM_SWAP_FORCED_MAX_M;
  if (env == 0 || m > (env > 0 ? TW_GEMM_SWAP_FORCED_MAX_M : rule))
    return 0;
  return m <= 16 ? 16 : 64;
}

int tw_gemm_swap_bn(int env, int64_t m) { return tw_gemm_swap_bn_upto(env, m, 64); }

int64_t tw_gemm_swap_rule_max_m(int64_t n, int split, int sms) {
  /* Thirty-second session (group s87), H200, tw_gemm from graphs, ms, 128-row tiles / swapped on
   * 128 of B's rows / on 64 (cuBLAS), M=96 and M=128 alike within 0.0013:
   *   N=1024 K=8192   0.0399 / 0.0348 / 0.0302 (0.011, split-K)
   *   N=4096 K=4096   0.0224 / 0.0198 / 0.0174 (0.0154)
   *   N=8192 K=1024   0.0096 / 0.0087 / 0.0111 (0.0075; s85)
   *   N=8192 K=4096   0.0245 / 0.0238 / 0.0326 (0.0205)
   *   N=16384 K=2048  0.0217 / 0.0240 / 0.0327 (0.0204)
   *   N=28672 K=8192  0.130 / 0.168 / 0.227 (0.122)
   * Swapped wins where its tiles (2 x n / 128 at m 128) fit the SMs in one wave, and loses where
   * they take two; the 64-row tiles (tw_gemm_swap_half) where they do too. Split GEMMs keep 64
   * (their swapped slices were not measured past it). */
  if (split > 1)
    return 64;
  return 2 * ((n + 127) / 128) <= (int64_t)sms ? TW_GEMM_SWAP_FORCED_MAX_M : 64;
}

int tw_gemm_out_variant(int plan_variant, int fp32_out) {
  /* Thirty-second session (group s89, H200, tw-bench gemm, ms, fp32 out, cooperative 128 x 256 /
   * ping-pong 128 x 192 / cuBLAS): M=4096 N=12288 K=6144 0.971 / 0.933 / 0.939, N=6144 K=12288
   * 0.922 / 0.915 / 0.932, M=N=16384 K=2048 1.803 / 1.685 / 1.781, 8192^3 1.667 / 1.649 /
   * 1.664, M=N=8192 K=1024 0.252 / 0.228 / 0.254, M=N=4096 K=512 0.0438 / 0.0430 / 0.0434: the
   * epilogue of twice bf16's bytes runs under the other warpgroup's mainloop. With bf16 output
   * the two were level (within 2% either way), so bf16 keeps the 128 x 256 tiles. */
  return fp32_out && plan_variant == TW_GEMM_V_S3_E32 ? TW_GEMM_V_PP_N192 : plan_variant;
}

int tw_gemm_swap_half(int env, int64_t m, int64_t n, int split, int sms) {
  const int mt = tw_gemm_swap_bn_upto(env, m, tw_gemm_swap_rule_max_m(n, split, sms));
  if (!mt || split > 1 || env == 1)
    return 0;
  if (env == 2)
    return 1;
  /* Where 128-row tiles fill at most half the SMs (decode, N <= ~8K per product), 64-row tiles
   * put twice the CTAs on B's stream, each with half the rows: cuBLAS's decode kernels run 64 x
   * 16 tiles on 128 CTAs at M=16 N=8192 (ncu, twentieth session: 7.6 us against our 8.5-8.8 on
   * 64 CTAs of 128 rows). */
  const int64_t tiles128 = ((n + 127) / 128) * ((m + mt - 1) / mt);
  return tiles128 * 2 <= (int64_t)sms;
}

int tw_gemm_swap_half_mt(int mt, int64_t m) {
  /* Thirty-fifth session (group s101, H200, tw_gemm from graphs, ms, 64-row tiles 64 / 32 of A's
   * rows wide, cuBLAS): M=32 N=4096 K=4096 0.0147 / 0.0132 (0.0132), M=32 N=8192 K=1024 0.0077
   * / 0.0071 (0.0068): at m <= 32 half the 64-wide tile's wgmma columns lie past m. At m 33-64
   * the 32-wide tiles (twice the CTAs) gained 1% where they fit one wave (M=64 N=4096 K=4096
   * 0.0135 / 0.0133, M=48 0.0135 / 0.0133, M=64 N=4096 K=8192 0.0234 / 0.0233) and lost where
   * they took two (M=64 N=8192 K=1024 0.0073 / 0.0090), so 64 stays there. */
  return mt == 64 && m <= 32 ? 32 : mt;
}

size_t tw_gemm_ws_bytes(int64_t tiles, int split, int cols) {
  /* per warpgroup 128 threads x cols / 2 fp32 accumulators */
  return TW_GEMM_WS_COUNTERS + (size_t)tiles * (size_t)split * 2 * 128 * (size_t)(cols / 2) * 4;
}

int tw_gemm_ws_split(int64_t m, int64_t n, int64_t k, int swap_mt, size_t *bytes) {
  const int sms = TW_GEMM_NOMINAL_SMS;
  /* The cluster tree's slices (so the same K ranges, the same tree, the same bits) as single
   * CTAs on tiles of half the tree's width of B's rows: swapped, 64 of B's rows x swap_mt of
   * A's; unswapped, 128 of A's rows x 64 of B's (either bitwise the wider tiles' products).
   * Twice the CTAs where they still fit the SMs at once: clusters of 8 CTAs fit 15 at once on
   * an H200 (twenty-second session, scripts/probes/probe_clusters.cu), so the tree itself stops
   * at 64 CTAs on 8 tiles. */
  const int s = tw_gemm_auto_split(m, n, k);
  const int64_t rows = swap_mt ? (m + swap_mt - 1) / swap_mt : (m + 127) / 128;
  const int64_t tiles = ((n + 63) / 64) * rows, tree_tiles = ((n + 127) / 128) * rows;
  if (s < 2 || tiles * s > sms || tiles <= tree_tiles)
    return 0;
  if (bytes)
    *bytes = tw_gemm_ws_bytes(tiles, s, swap_mt ? swap_mt / 2 : 64);
  return s;
}

void tw_gemm_plan_make(int64_t m, int64_t n, int64_t k, int sms, tw_gemm_plan_t *plan) {
  const int64_t m_blocks = (m + 127) / 128;
  const int64_t tiles256 = m_blocks * ((n + 255) / 256);
  const int64_t tiles128 = m_blocks * ((n + 127) / 128);
  (void)k;
  const int small = tw_gemm_prefers_n128(m, n, sms);
  plan->variant = small ? TW_GEMM_V_N128_S6 : TW_GEMM_V_S3_E32;
  plan->tiles = (int)(small ? tiles128 : tiles256);
  plan->grid = plan->tiles < sms ? plan->tiles : sms;
  /* Tiles in flight at once form a block of about group_m x (sms / group_m) tiles; 16 row
   * blocks (2048 rows of A) against ~8 column blocks (2048 rows of B) keeps both operands'
   * working set near-square, so L2 serves each loaded row to many tiles. */
  plan->group_m = 16;
  if (plan->group_m > m_blocks)
    plan->group_m = (int)m_blocks;
}
