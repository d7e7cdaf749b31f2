/*
 * The rules that route tw_gemm_rs, tw_gemm_ar and tw_allgather around their fused kernels,
 * without a GPU (run in CI): tw_gemm_ar's direct scheme, the unfused pipeline at small m, the
 * comm's low-latency area (its sizes, and when tw_gemm_rs, tw_gemm_ar and tw_allgather go
 * through it), the owner epilogue's rule, and the workspace sizes that hold each route. The
 * plans of the fused kernel: test_plans_rs.c.
 */
#include "gemm/gemm_heuristics.h"
#include "ops/allgather/allgather.h"
#include "ops/gemm_rs/gemm_rs.h"
#include "tw_test.h"

static void test_ar_direct(void) {
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
  TEST_ASSERT(!tw_gemm_ar_want_direct(-1, 2, 0, 2, 1024, 2048), "K 2048: not direct");
  TEST_ASSERT(tw_gemm_ar_want_direct(1, 8, 1, 4, 65536, 8), "TW_AR_DIRECT=1 wins");
  TEST_ASSERT(!tw_gemm_ar_want_direct(0, 2, 0, 2, 4096, 6144), "TW_AR_DIRECT=0 wins");
  TEST_ASSERT(tw_gemm_ar_direct_workspace_bytes(2, 4096, 12288, 2) <=
                  tw_gemm_ar_push_workspace_bytes(2, 4096, 12288), /* tw_gemm_rs_workspace_size */
              "direct with bf16 partials fits the default workspace on 2 ranks");
}

static void test_unfused(void) {
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
  /* what tw_gemm_rs_workspace_size asks for holds it wherever the rule takes it */
  for (int w = 2; w <= 8; w++)
    for (int64_t m = w; m <= TW_RS_UNFUSED_MAX_M; m += w)
      TEST_ASSERT(tw_gemm_rs_call_workspace_bytes(w, m, 264) >=
                      tw_gemm_rs_unfused_workspace_bytes(m, 264, 4, 1),
                  "world %d m %lld: the asked-for workspace holds the unfused pipeline", w,
                  (long long)m);
}

static void test_ll_area(void) {
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
}

/* The owner epilogue's rule (tw_gemm_rs_want_owner_epi; the plans that take it:
 * test_plans_rs.c). */
static void test_owner_epi_rule(void) {
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
}

int main(void) {
  test_ar_direct();
  test_unfused();
  test_ll_area();
  test_owner_epi_rule();
  return tw_test_finish();
}
