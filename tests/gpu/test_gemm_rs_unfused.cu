/*
 * The unfused pipeline of tw_gemm_rs and tw_gemm_ar at small m (tw_gemm into the workspace,
 * then the reduce kernel or the low-latency exchange; the default at m <= 256 on distinct GPUs,
 * everywhere under TW_RS_UNFUSED_SMALL=1) on virtual ranks (one GPU), through the checks of
 * tests/common/tw_test_gemm_rs.h (bitwise the pipeline built from tw_gemm and the reference
 * reduction, within bf16 tolerance of an fp32 reference): its knobs over worlds 2, 3, 4, 8 with
 * fp32 and bf16 partials, symmetric and peer outputs, the low-latency area and the pull,
 * swap-AB shapes, back-to-back calls that turn the area over, and the pipeline and the fused
 * kernel in turn on one comm. The fused kernel: test_gemm_rs.cu.
 * `--small` runs a reduced set (for compute-sanitizer). TW_TEST_DEVICES=distinct puts rank r on
 * GPU r % (number of GPUs) (the graph replays then run on one GPU only).
 */
#include <string.h>

#include "tw_test.h"
#include "tw_test_gemm_rs.h"

/* Where the pipeline runs (TW_RS_UNFUSED_SMALL=1) and where it does not (=0). */
static const rs_env_cases_t cases[] = {
    /* TW_RS_UNFUSED_SMALL=1: tw_gemm into the workspace, then the reduce kernel, at every
     * shape (the default takes it at m <= 256 on distinct GPUs); same bits, fp32 and bf16
     * partials; =0: the fused kernel where the default would not. */
    {"TW_RS_UNFUSED_SMALL",
     "1",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
     260,
     4,
     1},
    {"TW_RS_UNFUSED_SMALL",
     "1",
     NULL,
     TW_PARTIALS_BF16,
     {{128, 520, 256, 0}, {300, 1032, 264, 1}, {1, 8, 8, 0}},
     270,
     3,
     0},
    {"TW_RS_UNFUSED_SMALL",
     "0",
     NULL,
     TW_PARTIALS_FP32,
     {{16, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
     280,
     2,
     1},
};

/* Under TW_RS_UNFUSED_SMALL=1: the unfused pipeline into symmetric outputs (tw_gemm_ar pushes
 * into every rank's out); same bits */
static const rs_env_cases_t unfused_cases[] = {
    {"TW_TEST_OUT_SYMMETRIC",
     "1",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
     290,
     3,
     1},
    {NULL,
     "",
     NULL,
     TW_PARTIALS_BF16,
     {{100, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
     297,
     3,
     1},
    /* tw_gemm_ar into plain outs through a gather area and a copy where every rank shares
     * this process and GPU (the default there stores into the peers' outs, TW_AR_PEER_OUT;
     * the first two shapes are too large for the low-latency area, so the reduce kernel runs) */
    {"TW_AR_PEER_OUT",
     "0",
     NULL,
     TW_PARTIALS_FP32,
     {{300, 1032, 264, 0}, {256, 1024, 512, 0}, {1, 8, 8, 0}},
     296,
     3,
     1},
    /* the pull (the default exchanges through the comm's low-latency area where the rows
     * fit: here at world 2-4 for the first two shapes, world 8 for the first) */
    {"TW_RS_UNFUSED_LL",
     "0",
     NULL,
     TW_PARTIALS_FP32,
     {{100, 264, 200, 0}, {32, 8192, 1024, 0}, {1, 8, 8, 0}},
     298,
     3,
     1},
    {"TW_RS_UNFUSED_LL",
     "0",
     NULL,
     TW_PARTIALS_BF16,
     {{64, 1032, 264, 0}, {8, 8192, 520, 0}, {1, 8, 8, 0}},
     299,
     2,
     0},
    /* through the area at swap-AB shapes (m <= 64 up to world 4): the GEMM's epilogue stores
     * the words; both partials */
    {NULL,
     "",
     NULL,
     TW_PARTIALS_FP32,
     {{8, 1032, 264, 0}, {16, 8192, 520, 0}, {3, 1000, 72, 0}},
     300,
     2,
     1},
    {NULL,
     "",
     NULL,
     TW_PARTIALS_BF16,
     {{16, 8192, 1032, 0}, {5, 520, 4104, 0}, {1, 8, 8, 0}},
     301,
     2,
     1},
    /* tw_gemm_rs's own rows summed in that epilogue (TW_RS_LL_REDUCE=1; tw_gemm_ar as
     * before), both partials, back-to-back calls (rs and ar in turn) and a graph */
    {"TW_RS_LL_REDUCE",
     "1",
     NULL,
     TW_PARTIALS_FP32,
     {{8, 1032, 264, 0}, {16, 8192, 520, 0}, {3, 1000, 72, 0}},
     303,
     2,
     1},
    {"TW_RS_LL_REDUCE",
     "1",
     NULL,
     TW_PARTIALS_BF16,
     {{16, 8192, 1032, 0}, {5, 520, 4104, 0}, {1, 8, 8, 0}},
     304,
     4,
     1},
};

/* Under TW_RS_UNFUSED_SMALL=1 and TW_RS_UNFUSED_LL=1: swap-AB forced past m 64 (TW_GEMM_SWAP=1
 * or 2 reach m 128: at world 2 the shapes' m 128, 100 and 66 run two 64-wide tiles of tokens),
 * its low-latency epilogue through the area wherever the rows fit; larger worlds' m past 128
 * unswapped */
static const rs_env_cases_t swap_cases[] = {
    {"TW_GEMM_SWAP",
     "1",
     NULL,
     TW_PARTIALS_BF16,
     {{64, 8192, 1032, 0}, {50, 520, 264, 0}, {33, 1000, 72, 0}},
     305,
     2,
     1},
    {"TW_GEMM_SWAP",
     "2",
     NULL,
     TW_PARTIALS_FP32,
     {{64, 1032, 264, 0}, {40, 8192, 520, 0}, {3, 1000, 72, 0}},
     306,
     2,
     0},
};

int main(int argc, char **argv) {
  tw_test_require_hopper();
  int small = argc > 1 && strcmp(argv[1], "--small") == 0;
  uint64_t seed = tw_test_seed();
  static const int worlds[] = {1, 2, 3, 4, 8};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    rs_run_env_cases(&cases[i], small, seed);
  setenv("TW_RS_UNFUSED_SMALL", "1", 1);
  for (size_t i = 0; i < sizeof(unfused_cases) / sizeof(unfused_cases[0]); i++)
    rs_run_env_cases(&unfused_cases[i], small, seed);
  setenv("TW_RS_UNFUSED_LL", "1", 1);
  for (size_t i = 0; i < sizeof(swap_cases) / sizeof(swap_cases[0]); i++)
    rs_run_env_cases(&swap_cases[i], small, seed);
  unsetenv("TW_RS_UNFUSED_LL");
  /* 1000 back-to-back calls of the unfused pipeline with fresh inputs (rs and ar alternating),
   * on 2 ranks: the distinct GPUs under TW_TEST_DEVICES=distinct */
  rs_test_back_to_back(2, small ? 20 : 1000, seed + 7500);
  /* and at a swap-AB shape (m 32: the GEMM's epilogue stores the low-latency words), so the
   * area's two halves turn over hundreds of times with fresh data */
  rs_test_back_to_back_at(2, small ? 20 : 500, 16, seed + 7600);
  /* the same with tw_gemm_rs's own rows summed in the GEMM's epilogue (TW_RS_LL_REDUCE=1),
   * rs and ar in turn on one comm, on 2 and 8 ranks (m 64: 8 rows a rank) */
  setenv("TW_RS_LL_REDUCE", "1", 1);
  rs_test_back_to_back_at(2, small ? 20 : 500, 16, seed + 7700);
  rs_test_back_to_back_at(small ? 2 : 8, small ? 20 : 200, 8, seed + 7800);
  unsetenv("TW_RS_LL_REDUCE");
  unsetenv("TW_RS_UNFUSED_SMALL");
  for (int wi = 1; wi < (small ? 2 : 5); wi++) /* worlds 2, 3, 4, 8 */
    rs_test_unfused_mixed(worlds[wi], small ? 16 : 64, seed + 7000 + wi);
  return tw_test_finish();
}
