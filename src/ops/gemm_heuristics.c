#include "gemm_heuristics.h"

void tw_gemm_plan_make(int64_t m, int64_t n, int64_t k, int sms, tw_gemm_plan_t *plan) {
  const int64_t m_blocks = (m + 127) / 128;
  const int64_t n_blocks = (n + 255) / 256;
  const int64_t tiles = m_blocks * n_blocks;
  (void)k;
  plan->tiles = (int)tiles;
  plan->grid = tiles < sms ? (int)tiles : sms;
  /* Tiles in flight at once form a block of about group_m x (sms / group_m) tiles; 16 row
   * blocks (2048 rows of A) against ~8 column blocks (2048 rows of B) keeps both operands'
   * working set near-square, so L2 serves each loaded row to many tiles. */
  plan->group_m = 16;
  if (plan->group_m > m_blocks)
    plan->group_m = (int)m_blocks;
  plan->variant = TW_GEMM_V_S4_E16;
}
