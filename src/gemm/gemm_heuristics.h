/* Tile/config choice for the sm90 GEMM core, per shape (host C, no CUDA headers). */
#ifndef TW_OPS_GEMM_HEURISTICS_H
#define TW_OPS_GEMM_HEURISTICS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Kernel variants compiled in src/ops/gemm/gemm_sm90.cu (tile 128x256x64 unless said). */
typedef enum tw_gemm_variant {
  TW_GEMM_V_S3_E32 = 0,    /* 3 stages, 32 KiB epilogue buffer per consumer warpgroup */
  TW_GEMM_V_S4_E16 = 1,    /* 4 stages, 16 KiB epilogue buffer (two store passes for bf16) */
  TW_GEMM_V_S4_E16_C2 = 2, /* as S4_E16, CTA pairs along M multicasting B (static schedule) */
  TW_GEMM_V_S3_E32_C2 = 3, /* as S3_E32, CTA pairs along M multicasting B (static schedule) */
  TW_GEMM_V_N128_S6 = 4,   /* 128x128 tile, 6 stages: for shapes whose 128x256 tiles quantize
                              badly onto the SMs (a last wave mostly idle) */
  TW_GEMM_V_PP_N128 = 5,   /* 128x128 tiles, each a whole tile of one consumer warpgroup, the
                              two alternating (ping-pong: one's epilogue under the other's
                              mainloop; src/gemm/gemm_pp_sm90.cuh), 6 stages, 16 KiB */
  TW_GEMM_V_PP_N192 = 6,   /* the same on 128x192 tiles, 4 stages, 24 KiB */
  TW_GEMM_V_COUNT = 7
} tw_gemm_variant_t;

typedef struct tw_gemm_plan {
  int variant; /* tw_gemm_variant_t */
  int group_m; /* row blocks per L2 group of the default tile order */
  int grid;    /* CTAs: min(tiles, SMs given) */
  int tiles;   /* 128x256 output tiles */
} tw_gemm_plan_t;

/* Whether 128x128 tiles (6 stages) beat 128x256 ones for an m x n output on `sms` CTAs: where
 * the big tiles leave a last wave mostly idle (also tw_gemm_rs / tw_gemm_ar's tile choice). */
int tw_gemm_prefers_n128(int64_t m, int64_t n, int sms);

/* K slices per tile of a cluster tree: 2, 4 or 8 where the m x n output has so few 128 x 128
 * tiles that twice the slices still fit an H100 / H200's SMs at once (132 CTAs of pairs, 120 of
 * clusters of 4, 66 of 8) and each slice keeps 16 or more K blocks of 64; else 1 (also
 * tw_ag_gemm's decode route: few tiles over a long K). */
int tw_gemm_tree_split(int64_t m, int64_t n, int64_t k);
/* K slices per tile for tw_gemm's split_k = -1: tw_gemm_tree_split's, except 1 where the
 * product runs swap-AB's 64-row tiles unsplit (env -1's rule) and the slices would not put more
 * CTAs on the weights' stream (n / 128 x slices <= n / 64). A function of the shape alone, so
 * that every caller (any SM budget) gets the same slices and so the same bits. */
int tw_gemm_auto_split(int64_t m, int64_t n, int64_t k);

/* Swap-AB's tile width for an m-row product under TW_GEMM_SWAP = env (-1: the rule, 1 or 2: on,
 * 0: never): 16 for m <= 16, 64 for m <= 64 (forced: m <= TW_GEMM_SWAP_FORCED_MAX_M), 0 (no
 * swap) above. */
#define TW_GEMM_SWAP_FORCED_MAX_M 128
int tw_gemm_swap_bn(int env, int64_t m);
/* The same with the rule (env -1) reaching m <= rule_max_m (at most TW_GEMM_SWAP_FORCED_MAX_M;
 * tw_gemm_sm90_opts_t.swap_max_m). */
int tw_gemm_swap_bn_upto(int env, int64_t m, int64_t rule_max_m);
/* tw_gemm's own bound for that rule (a caller's tw_gemm_sm90_opts_t.swap_max_m overrides it):
 * 128 where the GEMM is unsplit and the swapped tiles of 128 of B's rows at m 128 (two tiles of
 * 64 of A's rows each) fit the `sms` CTAs at once (n <= 8448 on 132), else 64. */
int64_t tw_gemm_swap_rule_max_m(int64_t n, int split, int sms);
/* Whether swap-AB runs tiles of 64 of B's rows (one consumer warpgroup taking the tile's whole
 * width of A's rows, tw_gemm_swap_half_mt) instead of 128: env 2 wherever unsplit, 1 or 0 never, -1
 * unsplit where the n x m product has at most sms / 2 tiles of 128 rows (m up to
 * tw_gemm_swap_rule_max_m's bound). The same bits either way. */
int tw_gemm_swap_half(int env, int64_t m, int64_t n, int split, int sms);
/* The width of A's rows of those 64-row tiles, unsplit (the workspace's slices keep mt): 32
 * where tw_gemm_swap_bn's width mt is 64 and m <= 32, else mt. */
int tw_gemm_swap_half_mt(int mt, int64_t m);

/* Split-K through a workspace (tw_gemm_args_t.workspace, split_k -1): tw_gemm_auto_split's
 * slices (so the same bits) run as single CTAs on tiles of 64 of B's rows (swapped: 64 x swap_mt;
 * unswapped: 128 x 64), twice the CTAs of the cluster tree, where those still fit 132 SMs at
 * once; else 0. By the shape alone (swap_mt: tw_gemm_swap_bn's width, 0 unswapped). *bytes: the
 * workspace it uses. */
int tw_gemm_ws_split(int64_t m, int64_t n, int64_t k, int swap_mt, size_t *bytes);
/* Bytes of workspace for `split` slices of `tiles` tiles of `cols` accumulator columns per
 * consumer warpgroup: a 4 KiB counter block, then every (tile, slice, warpgroup)'s partial. */
size_t tw_gemm_ws_bytes(int64_t tiles, int split, int cols);
#define TW_GEMM_WS_COUNTERS 4096

/* The variant tw_gemm runs where its plan chose plan_variant and nothing else decides (no forced
 * variant, unsplit, static schedule, no programmatic launch): with fp32 output (fp32_out) the
 * 128 x 256 tiles give way to the ping-pong loop's 128 x 192 (the same bits); else plan_variant. */
int tw_gemm_out_variant(int plan_variant, int fp32_out);

/* Plans C[m,n] = A[m,k] * B[n,k]^T on `sms` SMs. */
void tw_gemm_plan_make(int64_t m, int64_t n, int64_t k, int sms, tw_gemm_plan_t *plan);

#ifdef __cplusplus
}
#endif
#endif
