#include "gemm/gemm_heuristics.h"

/* Fraction of the SM-waves a static persistent schedule keeps busy: tiles / (waves * sms). */
static double wave_efficiency(int64_t tiles, int sms) {
  const int64_t waves = (tiles + sms - 1) / sms;
  return (double)tiles / (double)(waves * sms);
}

/* Throughput of a 128x128 tile relative to a 128x256 one on the same SMs (more operand traffic
 * per flop), as the plan assumes it: a fit to tw_gemm's runs of both tiles (CHANGELOG.md has the
 * rule's results). */
#define TW_GEMM_N128_RELATIVE 0.93

/* The split rules' SM count: nominal (H100 / H200 SXM), never the call's budget, so that a
 * shape's slices, and so its bits, do not depend on the budget. */
#define TW_GEMM_NOMINAL_SMS 132

int tw_gemm_prefers_n128(int64_t m, int64_t n, int sms) {
  const int64_t m_blocks = (m + 127) / 128;
  const int64_t tiles256 = m_blocks * ((n + 255) / 256);
  const int64_t tiles128 = m_blocks * ((n + 127) / 128);
  /* 128x256 tiles, 3 stages and a one-pass epilogue are the best tiles where the waves fill; the
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
   * Each slice keeps at least 16 K blocks: with fewer, the tree's sum costs more than the
   * slices save. Clusters of 8 CTAs (about 200 KB of shared memory each) on more than half the
   * SMs do not all fit at once (a GPC holds whole clusters), so the grid's cap on resident
   * clusters (launch_plain) gives some two tiles: 8 slices only up to 8 tiles. Clusters of 4
   * fit 30 at once on an H200 (120 CTAs, the figure the rule assumes): past that, 4 slices take
   * two waves and lose to fewer. */
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
   * slices), the split adds the tree's sum and nothing streaming, and the unsplit product
   * wins; 4 and 8 slices add streams and keep splitting. */
  /* tw_gemm_swap_half is 0 where the rule does not swap */
  if (s > 1 && tw_gemm_swap_half(-1, m, n, 1, sms) && ((n + 127) / 128) * s <= (n + 63) / 64)
    return 1;
  return s;
}

int tw_gemm_swap_bn_upto(int env, int64_t m, int64_t rule_max_m) {
  /* A decode product (m <= 64) on 128-row tiles wastes at least half of every wgmma and of
   * every A box on rows past m; swapped, its few rows are the wgmma's N (16 or 64) and B's rows
   * fill the 128. cuBLAS's kernels at these shapes are swapped too (ncu shows its 64 x 16 tiles
   * on the transposed product).
   * Past m 64 (forced, env 1 or 2, up to TW_GEMM_SWAP_FORCED_MAX_M, or a caller's rule bound):
   * 64-wide tiles of A's rows, two at m 128, which beat 128-row tiles up to there where they fit
   * one wave. tw_gemm's own bound: tw_gemm_swap_rule_max_m (more shapes); tw_gemm_rs's decode
   * pipeline takes 128 (TW_GEMM_RS_SWAP_MAX_M) where ranks have GPUs of their own. */
  const int64_t rule =
      rule_max_m < TW_GEMM_SWAP_FORCED_MAX_M ? rule_max_m : TW_GEMM_SWAP_FORCED_MAX_M;
  if (env == 0 || m > (env > 0 ? TW_GEMM_SWAP_FORCED_MAX_M : rule))
    return 0;
  return m <= 16 ? 16 : 64;
}

int tw_gemm_swap_bn(int env, int64_t m) { return tw_gemm_swap_bn_upto(env, m, 64); }

int64_t tw_gemm_swap_rule_max_m(int64_t n, int split, int sms) {
  /* At m 96-128 the swapped tiles win where they (2 x n / 128 at m 128) fit the SMs in one
   * wave, and lose where they take two; the 64-row tiles (tw_gemm_swap_half) where they do
   * too. Split GEMMs keep 64 (their swapped slices are untried past it). */
  if (split > 1)
    return 64;
  return 2 * ((n + 127) / 128) <= (int64_t)sms ? TW_GEMM_SWAP_FORCED_MAX_M : 64;
}

int tw_gemm_out_variant(int plan_variant, int fp32_out) {
  /* With fp32 output the ping-pong loop's 128 x 192 tiles beat the cooperative 128 x 256 ones:
   * the epilogue of twice bf16's bytes runs under the other warpgroup's mainloop. With bf16
   * output the two are level, so bf16 keeps the 128 x 256 tiles. */
  return fp32_out && plan_variant == TW_GEMM_V_S3_E32 ? TW_GEMM_V_PP_N192 : plan_variant;
}

int tw_gemm_swap_half(int env, int64_t m, int64_t n, int split, int sms) {
  const int mt = tw_gemm_swap_bn_upto(env, m, tw_gemm_swap_rule_max_m(n, split, sms));
  if (!mt || split > 1 || env == 1)
    return 0;
  if (env == 2)
    return 1;
  /* Where 128-row tiles fill at most half the SMs (decode, N <= ~8K per product), 64-row tiles
   * put twice the CTAs on B's stream, each with half the rows, as cuBLAS's decode kernels do
   * (64 x 16 tiles on 128 CTAs at M=16 N=8192). */
  const int64_t tiles128 = ((n + 127) / 128) * ((m + mt - 1) / mt);
  return tiles128 * 2 <= (int64_t)sms;
}

int tw_gemm_swap_half_mt(int mt, int64_t m) {
  /* At m <= 32 half the 64-wide tile's wgmma columns lie past m, so 32-wide tiles. At m 33-64
   * the 32-wide tiles (twice the CTAs) gain little where they fit one wave and lose where they
   * take two, so 64 stays there. */
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
   * an H200, so the tree itself stops at 64 CTAs on 8 tiles. */
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
