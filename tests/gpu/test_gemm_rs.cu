/*
 * tw_gemm_rs and tw_gemm_ar's fused kernel on virtual ranks (one GPU), through the checks of
 * tests/common/tw_test_gemm_rs.h (bitwise the unfused pipeline built from the same core, and
 * within bf16 tolerance of an fp32 reference): for worlds 1, 2, 3, 4, 8 and shapes with tails
 * (m / world = 1, 100, 300, ...) and one where tw_gemm_ar groups its units (1024 x 8448); 1000
 * back-to-back calls of each op with changing inputs, each checked on the GPU; shapes changing
 * on one comm; a CUDA graph replay; every knob of the fused kernel over worlds 2, 3, 4, 8,
 * with fp32 and bf16 partials (TW_PARTIALS_BF16); world 1; bad arguments. The pipeline that
 * small m takes instead (TW_RS_UNFUSED_SMALL): test_gemm_rs_unfused.cu.
 * `--small` runs a reduced set (for compute-sanitizer). TW_TEST_DEVICES=distinct puts rank r on
 * GPU r % (number of GPUs) (the fp32 reference is then summed on rank 0's GPU from copies; the
 * graph replay runs on one GPU only).
 */
#include <string.h>

#include "tw_test.h"
#include "tw_test_gemm_rs.h"

/* Knob settings of the fused kernel, each over worlds 2, 3, 4, 8 (rs_run_env_cases). */
static const rs_env_cases_t cases[] = {
    /* TW_RS_PULL=1: partials stored locally, owners read them when reducing; same bits. */
    {"TW_RS_PULL",
     "1",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {1, 8, 8, 0}},
     100,
     4,
     1},
    /* TW_RS_BLOCK_N=128: 128 x 128 tiles (units of 128 columns, 6 stages) at every shape, not
     * only where the plan takes them (few tiles); same bits, fp32 and bf16 partials. */
    {"TW_RS_BLOCK_N",
     "128",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {32, 8192, 1024, 0}},
     240,
     4,
     1},
    {"TW_RS_BLOCK_N",
     "128",
     NULL,
     TW_PARTIALS_BF16,
     {{128, 520, 256, 0}, {300, 1032, 264, 1}, {1, 8, 8, 0}},
     250,
     2,
     0},
    /* TW_RS_BLOCK_N=192: the ping-pong loop's 128 x 192 tiles (units of 192 columns, tails
     * in n); same bits, fp32 and bf16 partials, with and without bands; the long-K bf16
     * shape (m 320 on 2 ranks: fused, not the decode pipeline) takes tw_gemm_ar's direct scheme
     * on 2 distinct GPUs. */
    {"TW_RS_BLOCK_N",
     "192",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {512, 3000, 1032, 1}},
     270,
     4,
     1},
    {"TW_RS_BLOCK_N",
     "192",
     "8",
     TW_PARTIALS_BF16,
     {{128, 520, 256, 0}, {1024, 2056, 264, 1}, {160, 1032, 4104, 0}},
     280,
     2,
     0},
    /* TW_RS_PULL=0: the push where the default pulls (more than 2 ranks sharing a GPU). */
    {"TW_RS_PULL",
     "0",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {300, 520, 1032, 0}},
     105,
     4,
     1},
    /* Symmetric outputs (args.out_symmetric, set by the test): the owners write every
     * rank's out; same bits, fp32 and bf16 partials (tw_gemm_rs ignores it). */
    {"TW_TEST_OUT_SYMMETRIC",
     "1",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {1, 8, 8, 0}},
     210,
     4,
     1},
    {"TW_TEST_OUT_SYMMETRIC",
     "1",
     NULL,
     TW_PARTIALS_BF16,
     {{128, 520, 256, 0}, {300, 1032, 264, 1}, {1, 8, 8, 0}},
     220,
     3,
     0},
    /* bf16 partials with a long K: on 2 distinct GPUs the default takes tw_gemm_ar's direct
     * scheme there (tw_gemm_ar_want_direct); same bits. */
    {NULL,
     "",
     NULL,
     TW_PARTIALS_BF16,
     {{256, 264, 4096, 0}, {100, 520, 4104, 1}, {1, 8, 4096, 0}},
     230,
     2,
     0},
    /* TW_AR_DIRECT=1: tw_gemm_ar's direct scheme (small m); the same bits as the unfused
     * pipeline (tw_gemm_rs is unaffected). */
    {"TW_AR_DIRECT",
     "1",
     NULL,
     TW_PARTIALS_FP32,
     {{16, 264, 200, 0}, {1, 8, 8, 0}, {100, 520, 1032, 2}},
     90,
     8,
     1},
    /* Bands narrower than the column blocks (last band partial, owners straddling tiles),
     * and band 1 (column sweeps); same bits. */
    {NULL,
     "",
     "3",
     TW_PARTIALS_FP32,
     {{100, 2056, 200, 0}, {300, 1800, 264, 2}, {1, 1032, 8, 0}},
     150,
     8,
     1},
    {NULL,
     "",
     "1",
     TW_PARTIALS_FP32,
     {{100, 1032, 200, 0}, {1024, 1024, 512, 1}, {3, 520, 64, 0}},
     160,
     3,
     0},
    /* Bands of 3 with whole row blocks per owner (no box straddles owners); same bits. */
    {NULL,
     "",
     "3",
     TW_PARTIALS_FP32,
     {{128, 2056, 200, 0}, {1024, 1800, 264, 2}, {256, 1032, 8, 0}},
     200,
     3,
     0},
    /* Bands of 3 with pull and with the direct all-reduce (their unit numbering follows the
     * band order too). */
    {"TW_RS_PULL",
     "1",
     "3",
     TW_PARTIALS_FP32,
     {{100, 2056, 200, 0}, {256, 1800, 128, 2}, {1, 1032, 8, 0}},
     180,
     3,
     0},
    {"TW_AR_DIRECT",
     "1",
     "3",
     TW_PARTIALS_FP32,
     {{16, 2056, 200, 0}, {100, 1032, 64, 2}, {1, 1032, 8, 0}},
     190,
     2,
     0},
    /* TW_RS_INTERLEAVE=1 / 0: the owners' row blocks interleaved in each band (the default
     * for fp32 partials on distinct GPUs only) and not (shapes of whole row blocks per
     * owner, where it applies; bands of 3 for several bands); same bits. */
    {"TW_RS_INTERLEAVE",
     "1",
     "3",
     TW_PARTIALS_FP32,
     {{128, 256, 256, 0}, {1024, 1800, 512, 2}, {256, 1032, 128, 0}},
     177,
     4,
     0},
    {"TW_RS_INTERLEAVE",
     "0",
     NULL,
     TW_PARTIALS_FP32,
     {{128, 256, 256, 0}, {1024, 1024, 512, 2}, {256, 1032, 128, 0}},
     178,
     2,
     0},
    /* TW_AR_PUSH=1 / 0: tw_gemm_ar's owners store their reduced rows into every rank's
     * workspace (the default on distinct GPUs, forced here where ranks share one), or the
     * ranks load them from the owners (the default on a shared GPU, and what a workspace
     * below tw_gemm_rs_workspace_size() gets); same bits. */
    {"TW_AR_PUSH",
     "1",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {128, 1032, 128, 0}},
     176,
     4,
     1},
    {"TW_AR_PUSH",
     "0",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {128, 1032, 128, 0}},
     179,
     4,
     1},
    /* TW_RS_GROUP_UNITS=3: three units behind each flag (a last group short), where the
     * plan takes one; the reduce and gather items cover three units; same bits. At world 2
     * the owner epilogue, which needs one unit per counter, gives way to the reduce CTAs. */
    {"TW_RS_GROUP_UNITS",
     "3",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {300, 520, 1032, 0}},
     186,
     4,
     1},
    /* TW_RS_OWNER_EPI=1: on 2 ranks with whole row blocks per owner and one unit per
     * counter, each rank's own tiles come after the peer's partials of them and are reduced
     * in their epilogue, whatever K, the partials and the tile count (by default: fp32 below
     * K 4096 with at least 3 waves of tiles, as the m 2048 n 8192 default case); same bits.
     * Other worlds and shapes fall back to the reduce CTAs. */
    {"TW_RS_OWNER_EPI",
     "1",
     NULL,
     TW_PARTIALS_FP32,
     {{128, 264, 200, 0}, {1024, 1024, 4096, 2}, {256, 1032, 128, 0}},
     187,
     2,
     1},
    {"TW_RS_OWNER_EPI",
     "1",
     "3",
     TW_PARTIALS_BF16,
     {{128, 264, 200, 0}, {512, 1800, 512, 0}, {100, 264, 200, 0}},
     188,
     2,
     1},
    /* TW_RS_OWNER_EPI=0: the reduce CTAs where the default takes the owner epilogue. */
    {"TW_RS_OWNER_EPI",
     "0",
     NULL,
     TW_PARTIALS_FP32,
     {{128, 264, 200, 0}, {1024, 1024, 512, 0}, {256, 1032, 128, 0}},
     189,
     2,
     1},
    /* TW_RS_REDUCE_CTAS=0: no CTA starts on the reduction; every CTA runs its GEMM tiles,
     * then reduces (and gathers) through the queues; same bits. */
    {"TW_RS_REDUCE_CTAS",
     "0",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {1024, 1024, 512, 0}, {1, 8, 8, 0}},
     181,
     4,
     1},
    /* TW_PARTIALS_BF16: bf16 partials, fp32 rank-ordered sum; bitwise the unfused pipeline
     * with bf16 GEMM output. The default path, then pull and the direct all-reduce. */
    {NULL,
     "",
     NULL,
     TW_PARTIALS_BF16,
     {{100, 264, 200, 0}, {1024, 1024, 512, 2}, {1, 8, 8, 0}},
     110,
     4,
     1},
    {"TW_RS_PULL",
     "1",
     NULL,
     TW_PARTIALS_BF16,
     {{300, 520, 1032, 0}, {1000, 512, 256, 3}, {128, 256, 256, 0}},
     120,
     3,
     0},
    {"TW_AR_DIRECT",
     "1",
     NULL,
     TW_PARTIALS_BF16,
     {{16, 264, 200, 0}, {100, 520, 1032, 2}, {1, 8, 8, 0}},
     130,
     2,
     0},
};

int main(int argc, char **argv) {
  tw_test_require_hopper();
  int small = argc > 1 && strcmp(argv[1], "--small") == 0;
  uint64_t seed = tw_test_seed();
  static const int worlds[] = {1, 2, 3, 4, 8};
  for (int wi = 0; wi < 5; wi++) {
    int w = worlds[wi];
    rs_test_case(w, 128, 256, 256, 0, seed + w);
    rs_test_case(w, 100, 264, 200, 0, seed + 10 * w); /* tiles straddle owners, N/K tails */
    if (small)
      continue;
    rs_test_case(w, 1, 8, 8, 0, seed + 20 * w);
    rs_test_case(w, 300, 520, 1032, 0, seed + 30 * w);
    rs_test_case(w, 1024, 1024, 512, 0, seed + 40 * w);
    if (w > 1) {
      rs_test_case(w, 1000, 512, 256, 3, seed + 50 * w);
      /* 264 units per owner: tw_gemm_ar's plan puts 2 or 4 behind each flag (2 groups per CTA
       * of the rank with the fewest SMs; with 3 ranks on 2 GPUs, 66 and 132 SMs, every rank
       * must count 66 or the groups disagree). */
      rs_test_case(w, 1024, 8448, 64, 0, seed + 60 * w);
      /* a decode shape: owners' rows start inside a 64-row box, so the plan pulls */
      rs_test_case(w, 32 / (w > 4 ? 4 : 1), 8192, 1024, 0, seed + 65 * w);
    }
    /* m 2048 n 8192: 512 tiles, at least 3 waves of 132 CTAs, so on 2 ranks the rule takes the
     * owner epilogue for both ops (fp32 partials, K < 4096); same bits. */
    if (w == 2) {
      rs_test_case(w, 1024, 8192, 256, 0, seed + 70 * w);
      /* and into symmetric outputs: the own tiles' second store goes into the peer's out */
      setenv("TW_TEST_OUT_SYMMETRIC", "1", 1);
      rs_test_case(w, 1024, 8192, 256, 0, seed + 71 * w);
      unsetenv("TW_TEST_OUT_SYMMETRIC");
    }
    /* m 4096 K 512 on 4 ranks (the plain-out case is above): where they share a GPU the rule
     * runs the unfused pipeline for GEMM+RS and for GEMM+AR into symmetric outputs with fp32
     * partials (tw_gemm_rs_want_unfused), and into plain outs where they share this process
     * too (the peers' outs, TW_AR_PEER_OUT); same bits. */
    if (w == 4) {
      setenv("TW_TEST_OUT_SYMMETRIC", "1", 1);
      rs_test_case(w, 1024, 1024, 512, 0, seed + 72 * w);
      unsetenv("TW_TEST_OUT_SYMMETRIC");
    }
  }
  rs_test_back_to_back(small ? 2 : 4, small ? 20 : 1000, seed + 5000);
  for (int wi = 1; wi < (small ? 2 : 5); wi++) /* worlds 2, 3, 4, 8 */
    rs_test_shape_changes(worlds[wi], seed + 5500 + wi);
  rs_test_graph(small ? 2 : 4, 10, seed + 6000);
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    rs_run_env_cases(&cases[i], small, seed);
  rs_partials = TW_PARTIALS_BF16;
  rs_test_case(1, 300, 520, 1032, 0, seed + 140); /* world 1: the plain GEMM either way */
  rs_partials = TW_PARTIALS_FP32;
  /* TW_RS_FUSED_W1=1: world 1 through the fused kernel (for profiling); the same bits, fp32
   * and bf16 partials, with and without reduce CTAs at the start. */
  setenv("TW_RS_FUSED_W1", "1", 1);
  rs_test_case(1, 300, 520, 1032, 0, seed + 150);
  rs_test_case(1, 1024, 1024, 512, 2, seed + 151);
  setenv("TW_RS_REDUCE_CTAS", "0", 1);
  rs_test_case(1, 1000, 512, 256, 0, seed + 152);
  unsetenv("TW_RS_REDUCE_CTAS");
  rs_partials = TW_PARTIALS_BF16;
  rs_test_case(1, 300, 520, 1032, 0, seed + 153);
  rs_partials = TW_PARTIALS_FP32;
  unsetenv("TW_RS_FUSED_W1");
  rs_test_bad_arguments();
  return tw_test_finish();
}
