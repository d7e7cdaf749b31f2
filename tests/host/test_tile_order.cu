/* The GEMM core's tile orders (tile_coords, src/gemm/gemm_sm90.cuh) on the host: every order
 * visits every (row block, column block) exactly once; the bands' orders visit each owner's
 * units (gemm_rs.h) in ascending order, which the reduce queue follows. The interleaved band
 * order is tw_gemm_rs's default for fp32 partials on distinct GPUs. A grouped GEMM's L2 groups
 * (group_tile_index) permute each group's tiles among themselves. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemm/gemm_sm90.cuh"
#include "ops/gemm_rs/gemm_rs.h"
#include "tw_test.h"

using tw::gemm::group_tile_index;
using tw::gemm::TileOrder;

/* Every tile once; with owners (m_local > 0, bands), each owner's units ascending. */
static void check_order(const char *what, TileOrder o, int32_t m_local, int32_t world) {
  const int32_t tiles = o.m_blocks * o.n_blocks;
  o.num_tiles = tiles;
  char *seen = (char *)calloc((size_t)tiles, 1);
  int32_t last_unit[TW_GEMM_RS_MAX_WORLD];
  for (int i = 0; i < TW_GEMM_RS_MAX_WORLD; i++)
    last_unit[i] = -1;
  int bad_range = 0, twice = 0, unordered = 0;
  for (int32_t t = 0; t < tiles; t++) {
    int32_t mb = -1, nb = -1;
    tw::gemm::tile_coords(o, t, mb, nb);
    if (mb < 0 || mb >= o.m_blocks || nb < 0 || nb >= o.n_blocks) {
      bad_range++;
      continue;
    }
    if (seen[mb * o.n_blocks + nb]++)
      twice++;
    if (m_local > 0) { /* whole row blocks per owner here: one owner per tile */
      const int32_t owner = mb * TW_GEMM_RS_BLOCK_M / m_local;
      const int32_t u = tw_rs_unit(mb - tw_rs_mb_first(owner, m_local), nb,
                                   tw_rs_mb_count(owner, m_local), o.n_blocks, o.group_n);
      if (owner < world && u <= last_unit[owner])
        unordered++;
      if (owner < world)
        last_unit[owner] = u;
    }
  }
  int missing = 0;
  for (int32_t i = 0; i < tiles; i++)
    missing += !seen[i];
  free(seen);
  TEST_ASSERT(!bad_range && !twice && !missing,
              "%s (%d x %d tiles): %d out of range, %d twice, %d missing", what, o.m_blocks,
              o.n_blocks, bad_range, twice, missing);
  TEST_ASSERT(!unordered, "%s: %d units out of their owner's order", what, unordered);
}

/* tw_gemm_rs's geometry for rank `rank` of `world`: per_owner row blocks per owner, nbk column
 * blocks, bands of `band` columns, rows from owner rank + 1's; the caller sets order and group_m.
 */
static TileOrder rs_order(int32_t world, int32_t per_owner, int32_t nbk, int32_t band,
                          int32_t rank) {
  TileOrder o;
  memset(&o, 0, sizeof(o));
  o.m_blocks = world * per_owner, o.n_blocks = nbk;
  o.group_n = band < nbk ? band : nbk;
  o.rotate_mb = tw_rs_mb_first((rank + 1) % world, per_owner * TW_GEMM_RS_BLOCK_M);
  return o;
}

/* group_tile_index: inside each group's row blocks [first, last) a permutation of its tiles
 * (so a row-major prefix of whole groups stays that prefix), L2 groups of group_m row blocks in
 * order, column-major inside one; tiles outside the group as they stand. */
static void check_group_order(int32_t n_blocks, int32_t first, int32_t last, int32_t group_m) {
  const int32_t tiles = (last + 3) * n_blocks;
  char *seen = (char *)calloc((size_t)tiles, 1);
  int bad = 0;
  for (int32_t t = 0; t < tiles; t++) {
    const int32_t x = group_tile_index(t, n_blocks, first, last, group_m);
    const int32_t mb0 = t / n_blocks, mb = x / n_blocks, nb = x % n_blocks;
    if (mb0 < first || mb0 >= last) {
      bad += x != t;
      continue;
    }
    bad += x < first * n_blocks || x >= last * n_blocks || seen[x]++;
    /* within an L2 group, row blocks run fastest */
    const int32_t band = (t - first * n_blocks) / (group_m * n_blocks);
    bad += (mb - first) / group_m != band;
    if (t > first * n_blocks && (t - first * n_blocks) % (group_m * n_blocks) != 0) {
      const int32_t y = group_tile_index(t - 1, n_blocks, first, last, group_m);
      bad += !(y / n_blocks + 1 == mb && y % n_blocks == nb) &&
             !(y % n_blocks + 1 == nb && mb == first + band * group_m);
    }
  }
  TEST_ASSERT(bad == 0, "group_tile_index(n_blocks %d, rows [%d, %d), group_m %d): %d wrong",
              n_blocks, first, last, group_m, bad);
  free(seen);
}

int main(void) {
  char what[128];
  for (int32_t nb = 1; nb <= 56; nb += 11)
    for (int32_t first = 0; first <= 9; first += 3)
      for (int32_t rows = 1; rows <= 40; rows += 13)
        for (int32_t gm = 1; gm <= 16; gm += 5)
          check_group_order(nb, first, first + rows, gm);
  /* The plain and rotated grouped orders. */
  for (int32_t mbk = 1; mbk <= 37; mbk += 6)
    for (int32_t nbk = 1; nbk <= 19; nbk += 3)
      for (int32_t g = 1; g <= 16; g *= 2) {
        TileOrder o;
        memset(&o, 0, sizeof(o));
        o.m_blocks = mbk, o.n_blocks = nbk, o.group_m = g < mbk ? g : mbk;
        o.order = tw::gemm::kOrderDefault;
        snprintf(what, sizeof(what), "default order, group %d", o.group_m);
        check_order(what, o, 0, 0);
        o.order = tw::gemm::kOrderRotated;
        o.rotate_mb = mbk / 3;
        snprintf(what, sizeof(what), "rotated order, group %d from %d", o.group_m, o.rotate_mb);
        check_order(what, o, 0, 0);
      }
  /* Bands (tw_gemm_rs), rows rotated to owner rank + 1, and interleaved owners. */
  for (int32_t world = 2; world <= 8; world++)
    for (int32_t per_owner = 1; per_owner <= 5; per_owner += 2)
      for (int32_t nbk = 1; nbk <= 21; nbk += 4)
        for (int32_t band = 1; band <= 8; band *= 2)
          for (int32_t rank = 0; rank < world; rank++) {
            const int32_t m_local = per_owner * TW_GEMM_RS_BLOCK_M;
            TileOrder o = rs_order(world, per_owner, nbk, band, rank);
            o.order = tw::gemm::kOrderBands;
            o.group_m = o.m_blocks;
            snprintf(what, sizeof(what), "bands of %d, world %d, rank %d, %d rows per owner",
                     o.group_n, world, rank, per_owner);
            check_order(what, o, m_local, world);
            o.order = tw::gemm::kOrderBandsInterleaved;
            o.group_m = world;
            snprintf(what, sizeof(what), "interleaved bands of %d, world %d, rank %d, %d rows",
                     o.group_n, world, rank, per_owner);
            check_order(what, o, m_local, world);
          }
  /* The own-lag order (tw_gemm_rs's owner epilogue on 2 ranks; tested for up to 8): a bijection
   * with every owner's units ascending, and each own unit at least `lag` positions after the peers'
   * tiles of it in their orders (the last own units have only that; those in the middle about world
   * * lag): the margin that lets the own tile's epilogue find the peers' partials landed. */
  for (int32_t world = 2; world <= 8; world++)
    for (int32_t per_owner = 1; per_owner <= 5; per_owner += 2)
      for (int32_t nbk = 1; nbk <= 21; nbk += 4)
        for (int32_t band = 1; band <= 8; band *= 2)
          for (int32_t lag = 0; lag <= 40; lag += 13) {
            const int32_t m_local = per_owner * TW_GEMM_RS_BLOCK_M, units = per_owner * nbk;
            const int32_t tiles = world * units;
            /* pos[r][mb * n + nb]: where rank r's order visits the tile */
            int32_t *pos = (int32_t *)malloc(sizeof(int32_t) * (size_t)world * (size_t)tiles);
            for (int32_t rank = 0; rank < world; rank++) {
              TileOrder o = rs_order(world, per_owner, nbk, band, rank);
              o.order = tw::gemm::kOrderBandsOwnerLag;
              o.group_m = world, o.lag = lag;
              snprintf(what, sizeof(what),
                       "own-lag bands of %d, lag %d, world %d, rank %d, %d rows", o.group_n, lag,
                       world, rank, per_owner);
              check_order(what, o, m_local, world);
              for (int32_t t = 0; t < tiles; t++) {
                int32_t mb, nb;
                tw::gemm::tile_coords(o, t, mb, nb);
                if (mb >= 0 && mb < o.m_blocks && nb >= 0 && nb < nbk)
                  pos[(size_t)rank * tiles + mb * nbk + nb] = t;
              }
            }
            const int32_t g = band < nbk ? band : nbk, eff = lag < units ? lag : units;
            int32_t worst = 1 << 30;
            for (int32_t r = 0; r < world; r++)
              for (int32_t mb = r * per_owner; mb < (r + 1) * per_owner; mb++)
                for (int32_t nb = 0; nb < nbk; nb++)
                  for (int32_t q = 0; q < world; q++)
                    if (q != r) {
                      const int32_t d = pos[(size_t)r * tiles + mb * nbk + nb] -
                                        pos[(size_t)q * tiles + mb * nbk + nb];
                      worst = d < worst ? d : worst;
                    }
            TEST_ASSERT(eff == 0 || worst >= eff,
                        "own-lag, world %d, %d rows, %d cols, band %d, lag %d: an own unit only %d "
                        "positions after a peer's tile of it",
                        world, per_owner, nbk, g, lag, worst);
            free(pos);
          }
  return tw_test_finish();
}
