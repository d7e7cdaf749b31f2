/*
 * tw_gemm_rs / tw_gemm_ar launch plan. Reduce CTAs: enough that the reduction
 * (reading world partials of this rank's rows, fp32 or bf16, writing bf16) keeps pace
 * with the GEMM, estimated from per-SM rates: a GEMM CTA does about 5.5 TFLOP/s,
 * a reduce CTA moves about 60 GB/s (a copy CTA measured 40 GB/s; the reduce CTA
 * keeps world loads in flight per thread). GEMM CTAs join the reduction when the
 * tile queue runs dry, so the estimate only needs to be close. Measured since (twenty-fifth
 * session, TW_TRACE's counts, docs/PERF.md): beside flux-tp8's GEMM on 2 H200s a reduce CTA
 * moved 25 GB/s with fp32 partials, 32 with ItemWalk; the counts the wave-boundary trim below
 * leaves were measured best in A/B runs all the same, so the constant stays until a rate-based
 * estimate is measured against them.
 */
#include "ops/gemm_rs/gemm_rs.h"

#include "gemm/gemm_heuristics.h"
#include "runtime/devcomm.h"

#define TW_RS_REDUCE_GBPS_PER_CTA 60.0
#define TW_RS_GEMM_TFLOPS_PER_CTA 5.5
#define TW_RS_BAND_DEFAULT 8
#define TW_RS_BAND_SHARED 2
#define TW_RS_L2_BYTES (32.0 * 1024 * 1024) /* about half an H100 / H200 L2 */

size_t tw_gemm_rs_workspace_bytes(int world, int64_t m, int64_t n) {
  const size_t m_local = (size_t)(m / (world > 0 ? world : 1));
  return (size_t)world * m_local * (size_t)n * 4 + m_local * (size_t)n * 2;
}

size_t tw_gemm_ar_push_workspace_bytes(int world, int64_t m, int64_t n) {
  const size_t m_local = (size_t)(m / (world > 0 ? world : 1));
  return (size_t)world * m_local * (size_t)n * 6;
}

size_t tw_gemm_ar_direct_workspace_bytes(int world, int64_t m, int64_t n, int partial_bytes) {
  return (size_t)world * (size_t)m * (size_t)n * (size_t)(partial_bytes == 2 ? 2 : 4);
}

int tw_gemm_ar_want_direct(int direct_env, int world, int gpu_shared, int partial_bytes, int64_t m,
                           int64_t k) {
  if (direct_env >= 0)
    return direct_env != 0;
  /* Two ranks on distinct GPUs, bf16 partials, long K, small m: the direct scheme moves the
   * same bytes as reduce-scatter + all-gather in one hop (each rank sends the other its
   * partial tiles) and has no gather phase; it reduces all m rows on each rank, twice the
   * reduction, which a long GEMM hides. Measured on 2 H200s (seventh session, three suites),
   * flux-tp8 (m 4096, K 6144): 1.095 / 1.109 / 1.126 ms against 1.128 / 1.136 / 1.159 for the
   * default (NCCL bf16 + cuBLAS 1.131-1.143); at K 2048 (m 1024) level (0.134-0.144 against
   * 0.139-0.141), at K 512 slower (0.190 against 0.150), with fp32 partials slower everywhere.
   * More ranks multiply its bytes (world - 1 partials of all m rows per rank), so world 2 only.
   * Also at decode shapes (m / 2 < 64 rows, any K): no gather phase to wait for. Seventeenth
   * session, 2 H200s, n 8192 K 1024, tw-bench's bf16-partials rows of one run each, default /
   * direct, ms: M=64 0.0463 / 0.0429 (decode17), 0.0452 / 0.0421 (the suite); M=16 0.0438 /
   * 0.0404; M=256 0.0528 / 0.0536 (level, not taken). With fp32 partials too at m < 128:
   * eighteenth session, 2 H200s, n 8192 K 1024, A/B TW_AR_DIRECT=0,1 both orders, M=64 0.0432 /
   * 0.0401 and 0.0431 / 0.0403 ms (bf16 partials 0.0408 / 0.0354, 0.0405 / 0.0354); M=16 0.0411 /
   * 0.0361; M=256 0.0547 / 0.0652 (slower: not taken). */
  return world == 2 && !gpu_shared &&
         ((partial_bytes == 2 && m <= 4096 && k >= 4096) || m < TW_AR_DIRECT_ANY_M);
}

int tw_gemm_rs_want_unfused(int env, int world, int gpu_shared, int64_t m, int64_t k,
                            int partial_bytes, int all_reduce, int stores_all) {
  if (world < 2 || env == 0)
    return 0;
  if (env > 0)
    return 1;
  /* Decode shapes: the GEMM is a few tiles (m <= 512 is 1-4 row blocks), so the fused kernel
   * has little to overlap its communication with, while its entry waits put the ranks' launch
   * skew in front of the GEMM. Nineteenth session, 2 H200s, n 8192 K 1024, ms, fused / unfused:
   *   bench_dist --graph 20 (one process per GPU, CUDA graphs: how decode runs), GEMM+RS M=64
   *   0.0271 / 0.0231; GEMM+AR M=64 0.0291 / 0.0265, M=16 0.0282 / 0.0238 (bf16 partials
   *   0.0252 / 0.0230; A/B both orders);
   *   tw-bench from graphs (TW_BENCH_GRAPH=1, one process): GEMM+RS M=256 0.0541 / 0.0447,
   *   GEMM+AR M=64 0.0450 / 0.0363;
   *   eager A/B (TW_BENCH_AB=TW_RS_UNFUSED_SMALL=0,1), two runs, GEMM+RS fp32 M=16 0.0423 /
   *   0.0396 and 0.0417 / 0.0337, M=64 0.0408 / 0.0434 and 0.0398 / 0.0363, M=256 0.0532 /
   *   0.0473 and 0.0534 / 0.0472, M=512 0.0800 / 0.0682 and 0.0744 / 0.0684 (bf16 partials
   *   alike); GEMM+AR M=16 0.0393 / 0.0451 and 0.0391 / 0.0363, M=64 0.0432 / 0.0443 and 0.0428 /
   *   0.0391, M=256 level (0.057), M=512 0.0875 / 0.0916 and 0.0894 / 0.0908 (slower: not taken).
   * So tw_gemm_rs at m <= 512, tw_gemm_ar at m <= 256.
   * Ranks sharing a GPU (twenty-third session, 8 virtual ranks, TW_BENCH_AB=TW_RS_UNFUSED_SMALL
   * -1,1 and 1,-1, n 8192 K 1024, ms, fused / unfused): GEMM+AR M=64 0.141 / 0.121 and 0.143 /
   * 0.121 (bf16 partials 0.135 / 0.121 and 0.140 / 0.171); GEMM+RS M=64 0.103 / 0.115 and 0.121
   * / 0.135; every larger shape slower unfused (GEMM+AR M=4096 K 512 0.665 / 0.905). So there
   * tw_gemm_ar at m <= 64 only. Group s32 (twenty-fourth session, same shapes, TW_BENCH_AB=
   * TW_RS_UNFUSED_SMALL=0,-1 and -1,0 with this rule): GEMM+AR M=64 0.158 / 0.117 and 0.153 /
   * 0.128; M=16 0.137 / 0.160 and 0.140 / 0.136 (within the noise of 8 ranks on one GPU); M=256
   * level (0.20).
   * Short K where ranks share a GPU (twenty-sixth session, group s51, 8 virtual ranks, n = m,
   * TW_BENCH_AB=TW_RS_UNFUSED_SMALL=0,1 and 1,0, ms, fused / unfused): with fp32 partials the
   * GEMM is a few k-blocks that mostly store partials, so it has little math to hide the
   * reduction behind, and the fused kernel's stores into the owners' staging and its flags
   * cost more than they overlap. GEMM+RS M=4096 K 512 0.564 / 0.531 and 0.555 / 0.529, M=8192
   * K 1024 2.987 / 2.949 (one order); GEMM+AR into symmetric outputs M=4096 0.647 / 0.594 and
   * 0.651 / 0.591, M=8192 3.237 / 3.143. Not taken: bf16 partials (M=4096 GEMM+RS 0.418 /
   * 0.499), tw_gemm_ar into a plain out (0.662 / 0.913: the unfused pipeline's gather copy;
   * since the twenty-seventh session taken where the unfused pipeline stores into the peers'
   * plain outs, TW_AR_PEER_OUT: 0.669 -> 0.605 ms), and m below 4096 (not measured; at M=64
   * GEMM+RS is faster fused).
   * K 2048 (twenty-seventh session, group s55, one H200, 8 virtual ranks, M=16384 n 16384,
   * TW_RS_UNFUSED_SMALL=0,1 and 1,0, ms, fused / unfused): GEMM+AR into a plain out 21.21 /
   * 20.07 and 21.27 / 20.05, into symmetric outputs 20.50 / 19.87 and 20.54 / 19.91; GEMM+RS
   * 19.69 / 19.52 and 19.68 / 19.55: there the large shapes run at the card's power limit and
   * the bytes moved decide, not the overlap. So the limit is K per rank <= 2048. Not taken:
   * flux-tp8's K 6144 (GEMM+RS 9.044 / 9.256, GEMM+AR 9.239 / 9.259, symmetric 9.265 / 9.327), and
   * bf16 partials (M=16384: GEMM+RS 17.52 / 17.55, GEMM+AR into symmetric outputs 18.65 / 18.41
   * and 18.55 / 18.53, level; into a plain out 19.53 / 18.03 and 19.47 / 18.74 faster
   * unfused, but slower at K <= 1024, above).
   * tw_gemm_ar below m 4096 where ranks share a GPU (twenty-eighth session, group s64, one
   * H200, 8 virtual ranks, TW_BENCH_AB=TW_RS_UNFUSED_SMALL=-1,1 and 1,-1, eager, ms, fused /
   * unfused, fp32 partials then bf16): with the peer outs the unfused pipeline's all-gather half
   * is one store per row, and it won at every shape with n >= 2048: m 512 n 8192 K 1024 0.278 /
   * 0.246 and 0.279 / 0.250 (bf16 0.245 / 0.212, 0.245 / 0.215); m 1024 n 8192 K 2048 0.694 /
   * 0.646, 0.698 / 0.648 (0.621 / 0.583, 0.625 / 0.587); m 2048 n 4096 K 512 0.368 / 0.333, 0.372
   * / 0.338 (0.290 / 0.262, 0.294 / 0.263); m 2048 n 2048 K 2048 0.377 / 0.370, 0.380 / 0.374
   * (0.339 / 0.334, 0.342 / 0.336). At m 1024 n 1024 K 256 (tw-bench's --quick shape) it lost
   * eager (0.127 / 0.152, 0.125 / 0.131: two launches a rank where the call is launch-bound) and
   * won from CUDA graphs (0.112 -> 0.081 ms, symmetric out 0.117 -> 0.080), how small calls run;
   * from graphs M=4096 K 512 bf16 partials 0.514 -> 0.442 (level eager, twenty-seventh session).
   * So tw_gemm_ar at m <= 4096 and K per rank <= 2048, either partials, into symmetric or peer
   * outs. tw_gemm_rs there stays fused: mixed (m 1024 n 8192 K 2048 0.632 / 0.615, m 2048 n 2048
   * K 2048 0.333 / 0.352, m 1024 n 1024 K 256 0.095 / 0.135). */
  if (gpu_shared) {
    const int short_k = k <= TW_RS_UNFUSED_SHARED_MAX_K;
    if (all_reduce && m <= TW_AR_UNFUSED_SHARED_MAX_M)
      return 1;
    if (all_reduce && stores_all && short_k && m <= TW_AR_UNFUSED_SHARED_ANY_PARTIALS_MAX_M)
      return 1;
    return partial_bytes == 4 && short_k && m >= TW_RS_UNFUSED_SHARED_MIN_M &&
           (!all_reduce || stores_all);
  }
  return m <= (all_reduce ? TW_AR_UNFUSED_MAX_M : TW_RS_UNFUSED_MAX_M);
}

size_t tw_gemm_rs_ll_bytes(int world, int64_t m, int64_t n, int partial_bytes, int all_reduce) {
  if (world < 2)
    return 0;
  const size_t rows = (size_t)(m / world) * (size_t)n; /* one slot's elements */
  const size_t rs = (size_t)world * rows * (size_t)(partial_bytes == 2 ? 2 : 4) * 2;
  const size_t ag = all_reduce ? (size_t)world * rows * 2 * 2 : 0;
  return 2 * (rs + ag);
}

int64_t tw_gemm_rs_swap_max_m(int gpu_shared) { return gpu_shared ? 64 : TW_GEMM_RS_SWAP_MAX_M; }

int tw_gemm_rs_want_ll(int env, int world, int64_t m, int64_t n, int partial_bytes, int all_reduce,
                       size_t ll_bytes, int shared_stores, int64_t swap_max_m) {
  if (env == 0 || world < 2 ||
      tw_gemm_rs_ll_bytes(world, m, n, partial_bytes, all_reduce) > ll_bytes)
    return 0;
  if (env > 0)
    return 1;
  /* Ranks sharing a GPU, tw_gemm_ar storing its rows into every rank's out: the words double
   * the bytes of stores that are HBM traffic anyway. Twenty-eighth session, group s66, one H200,
   * 8 virtual ranks, from graphs (TW_BENCH_GRAPH=1, 30 repeats), ms, stores into the outs / the
   * area: M=1024 N=1024 K 256 bf16 partials 0.0789 / 0.103 (symmetric outs 0.0770 / 0.103; fp32
   * does not fit the area there); decode M=64 n 8192 K 1024 fp32 0.106 / 0.112 (symmetric 0.103 /
   * 0.113), but bf16 partials 0.100 / 0.0901 (0.100 / 0.0898); eager A/B level within the noise
   * of eight ranks' launches. So the area stays only for bf16 partials at decode m. */
  if (shared_stores && (partial_bytes != 2 || m > TW_AR_UNFUSED_SHARED_MAX_M))
    return 0;
  /* The words carry as many flag bytes as data bytes: where a rank's rows for one peer pass
   * TW_LL_RULE_SLOT_BYTES, the pull's remote loads of half the bytes win. Twenty-first session,
   * 2 H200s, bench_dist from graphs, n 8192 K 1024, ms, pull / area: M=16 (256 KiB of words per
   * peer fp32) GEMM+RS 0.0178 / 0.0144, GEMM+AR 0.0202 / 0.0160, bf16 partials 0.0177 / 0.0137
   * and 0.0197 / 0.0155; M=64 bf16 partials (1 MiB) 0.0193 / 0.0162 and 0.0227 / 0.0199; M=64
   * fp32 (2 MiB) 0.0208 / 0.0218 and 0.0244 / 0.0257 (slower: not taken). */
  /* Thirty-first session, with the line layout (tw_ll_item_off), the same bench from graphs, ms,
   * area / pull (TW_RS_UNFUSED_LL=1,-1,-1,1): at the swap-AB shapes, whose GEMM epilogue stores
   * the words as each tile ends, M=64 fp32 (2 MiB) GEMM+RS 0.0190 / 0.0213, GEMM+AR 0.0220 /
   * 0.0249; above them, where the reduce kernel pushes the partial after the GEMM, M=128 fp32
   * (4 MiB) GEMM+RS 0.0306 / 0.0265, bf16 partials (2 MiB) 0.0232 / 0.0232 (GEMM+AR 0.0285 /
   * 0.0288), M=256 bf16 partials (4 MiB) 0.0308 / 0.0274. So 2 MiB where the GEMM is swapped (by
   * the swap rule on the shape and swap_max_m, which comes from the comm's gpu_shared: every rank
   * decides alike whatever its knobs), 1 MiB elsewhere.
   * The pipeline's GEMM swaps up to m 128 (TW_GEMM_RS_SWAP_MAX_M; same session, M=128 n 8192 K
   * 1024 bench_dist from graphs, ms, 128-row tiles through the pull / swapped through the area /
   * swapped through the pull, each twice: GEMM+RS bf16 partials 0.0233 / 0.0194 / 0.0226
   * (NCCL bf16 + torch 0.0208), fp32 (4 MiB: the pull) 0.0266 / 0.0282 / 0.0257; GEMM+AR bf16
   * partials 0.0290 / 0.0253 / 0.0280, fp32 (does not fit) 0.0330 / 0.0320 / 0.0320). */
  const size_t slot = (size_t)(m / world) * (size_t)n * (size_t)(partial_bytes == 2 ? 2 : 4) * 2;
  return slot <= (tw_gemm_swap_bn_upto(-1, m, swap_max_m) ? TW_LL_RULE_SWAP_SLOT_BYTES
                                                          : TW_LL_RULE_SLOT_BYTES);
}

int tw_gemm_rs_want_ll_reduce(int env, int all_reduce, int64_t m) {
  if (all_reduce || env == 0)
    return 0;
  /* Thirtieth session, group s79, 2 H200s, n 8192 K 1024, ms, reduce kernel / epilogue: one
   * process per GPU from graphs (bench_dist --graph 10, alternated 0,1,1,0) M=16 fp32 0.0135 /
   * 0.0124, bf16 partials 0.0115 / 0.0104; M=64 fp32 0.0212 / 0.0212, bf16 partials 0.0170 /
   * 0.0168. One process driving both, graphs of 10 calls a fork (TW_BENCH_AB): M=16 0.0138 /
   * 0.0128 and 0.0120 / 0.0110, M=64 0.0221 / 0.0220 and 0.0174 / 0.0182. So the rule takes it
   * at the 16-wide swap tiles only. */
  return env > 0 || m <= TW_RS_LL_REDUCE_MAX_M;
}

size_t tw_gemm_rs_unfused_workspace_bytes(int64_t m, int64_t n, int partial_bytes, int gather) {
  return (size_t)m * (size_t)n * (size_t)(partial_bytes == 2 ? 2 : 4) +
         (gather ? (size_t)m * (size_t)n * 2 : 0);
}

size_t tw_gemm_rs_call_workspace_bytes(int world, int64_t m, int64_t n) {
  size_t bytes = tw_gemm_ar_push_workspace_bytes(world, m, n);
  /* tw_gemm_ar's direct scheme with fp32 partials where the rule may take it (2 ranks, m < 128):
   * world x m x n fp32, more than the push's world x m_local x n x 6 */
  if (world == 2 && m < TW_AR_DIRECT_ANY_M) {
    const size_t direct = tw_gemm_ar_direct_workspace_bytes(world, m, n, 4);
    if (direct > bytes)
      bytes = direct;
  }
  return bytes;
}

int tw_gemm_rs_want_owner_epi(int env, int reduce_set, int partial_bytes, int64_t k, int64_t tiles,
                              int ctas) {
  if (env >= 0)
    return env != 0;
  if (reduce_set)
    return 0;
  /* The own tile's epilogue saves its fp32 partial's store and re-read (and the reduce CTAs)
   * but stalls its consumer warpgroups on the peer's partial: a gain where the GEMM is short
   * of HBM bandwidth (short K), a loss where it is bound by the tensor cores. Twelfth session
   * (docs/PERF.md), A/B TW_RS_OWNER_EPI=0/1, ms, 2 H200s | 2 virtual ranks: fp32 partials, m
   * 4096 n 12288 K 2048 0.513 -> 0.496 | 0.993 -> 0.895, K 3072 0.680 -> 0.657 | 1.327 ->
   * 1.249, K 4096 0.849 -> 0.866 | 1.604 -> 1.583, K 6144 (flux-tp8) 1.158 -> 1.173 | 2.208
   * -> 2.282; M=8192 (K 1024) 0.484 -> 0.448 | 0.880 -> 0.758, M=16384 (K 2048) 2.455 ->
   * 2.288 | 4.976 -> 4.569. bf16 partials, half the bytes to save, lost at every K but 512
   * (flux-tp8 1.083 -> 1.183, M=8192 0.351 -> 0.375). So fp32 partials below K 4096.
   * The own tiles trail the peer's by two waves of CTAs, so with few tiles they all wait at the
   * end. Thirteenth session, tw_gemm_ar (2 H200s | 2 virtual ranks, 0 -> 1): m 1024 n 8192 K
   * 2048, 256 tiles, 1.9 waves of 132 CTAs | 3.9 of 66: 0.159 -> 0.181 | 0.201 -> 0.183; m 4096
   * n 4096 K 512, 3.9 waves: 0.192 -> 0.181; M=8192 0.647 -> 0.639, M=16384 2.739 -> 2.601. So
   * at least 3 waves. */
  return partial_bytes == 4 && k < 4096 && tiles >= 3 * (int64_t)ctas;
}

void tw_gemm_rs_make_plan(const tw_gemm_rs_plan_args_t *a, tw_gemm_rs_plan_t *plan) {
  const int world = a->world;
  const int32_t m_local = (int32_t)(a->m / world);
  /* The tile width: 128 columns (6 stages) where 128 x 256 tiles would leave a last wave of the
   * rank's CTAs mostly idle, by tw_gemm's own rule (decode shapes: M=64 n 8192 on 132 CTAs is
   * 32 wide tiles or 64 narrow ones). Seventeenth session, 2 H200s, GEMM+AR M=64 n 8192 K 1024
   * (TW_TRACE): the 32 wide tiles finished 17-26 us after the kernel's start while tw_gemm, which
   * takes the narrow tiles there, ran in 11-13 us. Every rank decides alike (the shape,
   * plan_sms and gpu_shared). Not where ranks share a GPU: eighteenth session, 8 virtual ranks,
   * GEMM+AR M=64 n 8192 K 1024, A/B TW_RS_BLOCK_N=256,128: 0.138 / 0.157 ms (bf16 partials 0.133 /
   * 0.157), while on 2 H200s the narrow tiles won at M=16-256 (M=64, both orders: GEMM+AR 0.0493 /
   * 0.0431 and 0.0498 / 0.0434, GEMM+RS 0.0455 / 0.0381 and 0.0456 / 0.0377). */
  const int plan_ctas = a->plan_sms > 0 ? a->plan_sms : a->sm_budget;
  /* 192 (the ping-pong loop, TW_RS_BLOCK_N=192) only where no epilogue box holds the start of
   * an owner's rows with the push (its epilogue has no row copy: RsEpi's kNoRowCopy), i.e. not
   * where m_local is no multiple of 64 and the pull is switched off. */
  const int pp_ok = world == 1 || m_local % (TW_GEMM_RS_BLOCK_M / 2) == 0 || a->pull_env != 0;
  const int n128 = !a->shared_gpu && tw_gemm_prefers_n128(a->m, a->n, plan_ctas);
  /* The rule takes the ping-pong loop's 128 x 192 tiles at long K on GPUs of their own, where
   * the owner epilogue (256-column tiles, K < 4096 by its rule) is not forced. Thirty-second
   * session, 2 H200s, flux-tp8 (M=4096 N=12288 K=6144), TW_BENCH_AB=TW_RS_BLOCK_N=0,192 and
   * 192,0, ms, 256 / 192: GEMM+RS fp32 1.123 / 1.092 and 1.125 / 1.086, bf16 partials 1.077 /
   * 1.075 and 1.080 / 1.058; GEMM+AR fp32 1.222 / 1.194 and 1.232 / 1.182, bf16 partials 1.149
   * / 1.131 and 1.156 / 1.132 (tw_gemm_ar's direct scheme, which the bf16 partials take there,
   * planned as one owner: so the comm's world counts). At K 2048 and below it was mixed (M=16384
   * GEMM+AR fp32 2.56 / 2.69 with the owner epilogue against it, M=8192 K 1024 GEMM+RS fp32 0.452 /
   * 0.482, M=4096 K 512 bf16 partials 0.100 / 0.111), so they keep 256 (docs/PERF.md). */
  const int comm_world = a->comm_world > 0 ? a->comm_world : world; /* the direct scheme: 1 here */
  const int pp_rule =
      !a->shared_gpu && comm_world > 1 && a->k >= 4096 && a->owner_env != 1 && !n128;
  const int block_n =
      a->block_n_env == 128 || a->block_n_env == 256 || (a->block_n_env == 192 && pp_ok)
          ? a->block_n_env
      : n128             ? 128
      : pp_rule && pp_ok ? 192
                         : TW_GEMM_RS_BLOCK_N;
  plan->block_n = block_n;
  const int64_t n_blocks = (a->n + block_n - 1) / block_n;
  /* 128 x block_n tiles of the m x n product (the wave rule and the owner-epilogue rule) */
  const int64_t tiles = ((a->m + TW_GEMM_RS_BLOCK_M - 1) / TW_GEMM_RS_BLOCK_M) * n_blocks;
  int64_t units_max = 0;
  for (int o = 0; o < world; o++) {
    int64_t u = (int64_t)tw_rs_mb_count(o, m_local) * n_blocks;
    if (u > units_max)
      units_max = u;
  }
  /* Counters within the comm's fixed flag stride (gemm_rs.h), whatever this call's shape. */
  const int64_t stride = tw_rs_flag_stride(a->comm_world > 0 ? a->comm_world : world);
  const int64_t g_min = units_max > stride ? (units_max + stride - 1) / stride : 1;
  int64_t g = g_min;
  /* Coarser work items for tw_gemm_ar (not the direct scheme, planned with all_reduce 0): a
   * group is what one reduce item reduces and one gather item copies, and each costs a queue
   * claim and a flag wait, and the reduction a system-scope fence and world - 1 flag stores;
   * with one 128 x 256 unit per group a gather item copies 64 KiB. Up to 4 units per group
   * while the owner keeps at least 2 groups per CTA of the rank (of the rank with the fewest,
   * plan_sms: every rank must number the groups alike). Tenth session (docs/PERF.md),
   * TW_RS_GROUP_UNITS in A/B, GEMM+AR fp32, single units -> the rule's: 8 virtual ranks
   * flux-tp8 9.68 -> 9.47 ms (4), M=4096 0.796 -> 0.745 (2), 8192 3.82 -> 3.61 (4), 16384
   * 23.2 -> 21.9 (4); 2 H200s flux-tp8 1.268 -> 1.230 (2), 8192 0.672 -> 0.647 (2), 16384
   * 2.99 -> 2.81 (4); bf16 partials and symmetric outputs (no gather copy, the same waits)
   * alike. With fewer groups per CTA it lost (2 H200s, M=4096 N=4096: 0.191 -> 0.206 ms at 2
   * units, 0.232 at 4). tw_gemm_rs, which has no gather, was level or slower at every count,
   * so it keeps single units. Where ranks share a GPU (comm->gpu_shared, alike on every rank)
   * one group per CTA is enough: thirteenth session, 8 virtual ranks, GEMM+AR, units per group
   * 1 / 2 / 4 / 8, ms: m 4096 n 4096 K 512 0.799 / 0.749 / 0.727 / 0.796 (bf16 partials 0.623
   * / 0.571 / 0.553 / 0.619), m 1024 n 8192 K 2048 0.766 / 0.748 / 0.764 / 0.842 (0.661 /
   * 0.640 / 0.665 / 0.714); the larger shapes already take 4. */
  if (a->all_reduce) {
    const int64_t per_cta = a->shared_gpu ? 1 : 2;
    int64_t want = 1;
    while (want < 4 && units_max / (want * 2) >= per_cta * plan_ctas)
      want *= 2;
    if (want > g)
      g = want;
  }
  /* TW_RS_GROUP_UNITS (measurement): this many units per group instead, at most the owner's
   * units, never fewer than the flag slice needs. */
  if (a->group_env > 0) {
    const int64_t e = a->group_env < units_max ? a->group_env : (units_max > 0 ? units_max : 1);
    g = e > g_min ? e : g_min;
  }
  plan->group_units = (int)g;
  plan->flag_stride = (int)stride;
  /* Band width of the tile order: B of a band (band x 256 x k bf16) stays in L2 while A
   * streams once per band (docs/PERF.md has every measurement below).
   * - Ranks with GPUs of their own: bands of 8 where A outgrows L2 (2 H200s, M=16384 K=2048,
   *   A 64 MiB: 2.89 -> 2.65 ms fp32, 2.50 -> 2.19 bf16 partials); where A fits, wider bands
   *   only coarsen the reduction's pipeline (M=4096 N=4096 0.144 -> 0.174 ms), so single
   *   columns.
   * - Ranks sharing a GPU share its L2, and eight ranks' bands of 8 outgrow it (8 virtual
   *   ranks, flux-tp8 GEMM+RS 10.3 against 9.3 ms for single columns). Single columns keep 16
   *   row blocks x 1 column in flight on a 16-CTA rank, so every tile loads its A rows from
   *   HBM; bands of 2 share each A row block between two in-flight tiles while the ranks' B
   *   bands still fit (flux-tp8 9.55 -> 8.88 ms, M=16384 20.7 -> 19.8; bands of 4 level with
   *   2), taken where the ranks' A together reach half of L2 (twelfth session, A/B on 8 virtual
   *   ranks at M=4096 K 512, 32 MiB of A in all: bands of 1 / 2 / 4 / 8, GEMM+RS fp32 0.615 /
   *   0.604 / 0.601 / 0.609 ms, bf16 partials 0.446 / 0.431 / 0.429 / 0.430, GEMM+AR fp32 0.755
   *   / 0.739 / 0.739 / 0.746; until then it took bands of 2 only above 32 MiB). */
  const double a_bytes = (double)a->m * (double)a->k * 2.0;
  int band = a->band_env > 0 ? a->band_env
             : a->shared_gpu ? (a_bytes * world >= TW_RS_L2_BYTES ? TW_RS_BAND_SHARED : 1)
             : a_bytes > TW_RS_L2_BYTES ? TW_RS_BAND_DEFAULT
                                        : 1;
  if (band > n_blocks)
    band = (int)n_blocks;
  plan->band = band < 1 ? 1 : band;
  /* Interleaved owners (every world consecutive tiles to world owners; owners of whole row
   * blocks only): fp32 partials on distinct GPUs, where a band's stretch of stores to one peer
   * outran NVLink (2 H200s, fourth and fifth sessions, two alternations each: RS M=16384
   * 2.60 -> 2.35 ms, AR 3.55 -> 3.30; bf16 partials 2.09 -> 2.15, smaller shapes and virtual
   * ranks level). The fourth session held it back after test_gemm_rs hung with it on virtual
   * ranks; the fifth ran that test clean 4 times and saw the same stall without it. */
  const int want =
      a->interleave_env >= 0 ? a->interleave_env != 0 : a->partial_bytes != 2 && !a->shared_gpu;
  plan->interleave = want && world > 1 && m_local % TW_GEMM_RS_BLOCK_M == 0;
  plan->groups_max = (int)((units_max + g - 1) / g);
  plan->ctas = a->sm_budget;

  /* In order: the args' reduce_sms; TW_RS_REDUCE_CTAS (any count, 0 included: then every CTA
   * runs the GEMM first and the reduction after its tiles, the unfused timeline inside one
   * launch, the partials still travelling during the GEMM); none where ranks share a GPU; else
   * the estimate. */
  int reduce = a->reduce_sms_arg;
  if (reduce <= 0 && a->reduce_env >= 0) {
    reduce = a->reduce_env;
  } else if (reduce <= 0 && a->shared_gpu) {
    /* Every CTA runs its GEMM tiles first and reduces after them: the GPU's SMs are all busy
     * with some rank's GEMM, so reducing early only takes them from a GEMM. Seventh session, 8
     * virtual ranks, interleaved A/B (docs/PERF.md), the estimate against 0: GEMM+RS fp32
     * flux-tp8 9.52 -> 8.97 ms, M=4096 0.664 -> 0.617, 8192 3.19 -> 3.09, 16384 20.4 -> 20.0;
     * GEMM+AR fp32 9.46 -> 9.34, 0.863 -> 0.781, 3.92 -> 3.67, 23.2 -> 22.5; bf16 partials
     * level or faster everywhere. On 2 GPUs 0 was mixed (RS flux-tp8 1.058 -> 1.035 ms, M=4096
     * 0.145 -> 0.167): the estimate stays there. */
    reduce = 0;
  } else if (reduce <= 0) {
    /* Sized by the partials' bytes: with bf16 ones the fp32 count was too many (2 H200s,
     * flux-tp8 GEMM+RS 1.05 ms with the fp32 count of 5, 0.98 with 2; M=16384 2.17 -> 2.12). */
    const double pbytes = a->partial_bytes == 2 ? 2.0 : 4.0;
    const double bytes = (double)a->m * (double)a->n * pbytes * (a->all_reduce ? 1.5 : 1.0);
    const double flops = 2.0 * (double)a->m * (double)a->n * (double)a->k;
    reduce = 1;
    for (; reduce < a->sm_budget / 2; reduce++) {
      const double t_red = bytes / (TW_RS_REDUCE_GBPS_PER_CTA * 1e9 * reduce);
      const double t_gemm = flops / (TW_RS_GEMM_TFLOPS_PER_CTA * 1e12 * (a->sm_budget - reduce));
      if (t_red <= 0.8 * t_gemm)
        break;
    }
    /* tw_gemm_ar's reduce CTAs also gather every other owner's rows: at least 4 of them where
     * the ranks have GPUs of their own. Where they share one (without stealing), the first
     * design measured 4 of 16 SMs 1.30x faster than 1 at Flux's shape; with work stealing,
     * the signal warp and bands of 2 one was faster (sixth session, 8 virtual ranks,
     * flux-tp8: 9.53-10.03 ms against 10.43-11.15 with 4), so there the estimate stands. */
    if (a->all_reduce && reduce < 4 && !a->shared_gpu)
      reduce = a->sm_budget / 2 < 4 ? a->sm_budget / 2 : 4;
    /* The wave boundary: where the GEMM CTAs left over run one wave more than a few CTAs
     * fewer reduce CTAs would (flux-tp8 on 132 SMs: 1536 tiles on 127 CTAs are 12.1 waves, on
     * 128 exactly 12), trim the estimate to the largest count that saves the wave: GEMM+RS
     * no lower than half the estimate, GEMM+AR no lower than its 4. Fifteenth session, 2
     * H200s, A/B in both orders (docs/PERF.md, group wave15), the rule against the estimate,
     * ms: GEMM+RS flux-tp8 (4 / 5) 1.142 / 1.163 and 1.150 / 1.153; bf16 partials GEMM+AR
     * M=16384 (9 / 11) 2.534 / 2.553 and 2.528 / 2.576, GEMM+RS M=8192 and 16384 level;
     * GEMM+AR flux-tp8 (4 / 7) level; GEMM+AR small m (4 / 19, 256 tiles: 2 waves against 3)
     * 0.151 / 0.158 and 0.151 / 0.159, bf16 partials 0.130 / 0.135 and 0.129 / 0.135. */
    const int floor_ar = a->all_reduce && !a->shared_gpu ? 4 : 0;
    const int lo = a->all_reduce ? floor_ar : (reduce + 1) / 2;
    if (reduce < a->sm_budget) {
      const int64_t waves = (tiles + a->sm_budget - reduce - 1) / (a->sm_budget - reduce);
      for (int r = reduce - 1; r >= lo && r >= 1; r--)
        if ((tiles + a->sm_budget - r - 1) / (a->sm_budget - r) < waves) {
          reduce = r;
          break;
        }
    }
  }
  if (reduce >= a->sm_budget)
    reduce = a->sm_budget - 1;
  plan->reduce_ctas = reduce < 0 ? 0 : reduce; /* the GEMM CTAs reduce after their tiles */
  plan->single = 0;
  plan->direct = 0;
  plan->ar_push = 0;
  plan->ar_out_sym = 0;
  plan->ll = 0;
  /* The pull (TW_RS_PULL): each rank's epilogue stores its whole partial into its own [m, n]
   * buffer in the tile's place, as tw_gemm stores its output, and each owner's reduction reads
   * its rows from every rank. Where more than 2 ranks share a GPU (comm->gpu_shared, alike on
   * every rank; every store is HBM traffic there either way) it is faster than storing each
   * box into its owner's staging slot. Fourteenth session, 8 virtual ranks, A/B in both orders
   * (docs/PERF.md), push -> pull, ms: GEMM+RS fp32 M=4096 K 512 0.607 -> 0.564, M=8192 K 1024
   * 3.23 -> 3.03, m 1024 n 8192 K 2048 0.681 -> 0.643, M=16384 20.4 -> 19.5; GEMM+AR fp32
   * 0.721 -> 0.677, 3.60 -> 3.41, 0.743 -> 0.707, 22.0 -> 21.3; bf16 partials level or
   * faster. On 2 GPUs the push stays (fourth session: pull 3.19 against 2.81 ms at M=16384),
   * and so it does on 2 ranks sharing a GPU, where the owner epilogue (push layout) wins.
   *
   * Also wherever owners' rows start inside a 64-row box of the epilogue (m_local not a multiple
   * of 64: decode shapes). With the push such a box's rows of the later owner cannot go by TMA
   * (a negative row coordinate) and one thread copies them with 16-byte stores over NVLink.
   * Seventeenth session, 2 H200s, n 8192 K 1024 (docs/PERF.md): GEMM+AR at M=64 took 0.123 ms
   * against 0.033 for tw_gemm then the reduce, M=16 0.069, while M=256 (whole boxes) 0.065;
   * the trace put the time in the reduction's waits. The pull stores every box at its own rows. */
  const int straddle = m_local % (TW_GEMM_RS_BLOCK_M / 2) != 0;
  plan->pull =
      world > 1 && (a->pull_env >= 0 ? a->pull_env != 0 : (a->shared_gpu && world > 2) || straddle);
  /* The owner epilogue on 2 ranks (RsEpi::combine): each rank's own tiles come after the
   * peer's partials of them and are reduced in their epilogue. It needs whole row blocks per
   * owner, one unit per counter (the combine waits for the peer's one count of its unit) and
   * the push layout (not TW_RS_PULL); tw_gemm_ar's direct scheme is planned at world 1.
   * tw_gemm_rs: ranks may differ in it (the peer's stores and counts are the same either way),
   * so the rule leaves the reduce CTAs running where this rank's caller set them.
   * tw_gemm_ar: the own tile also stores its reduced rows where the peer's gather finds them
   * and sets the unit's ready flag, and the gather items become single units (the groups of
   * 2-4 above give way), so every rank must choose alike: the choice reads only what every rank
   * shares (the shapes, the partials, plan_sms and the alike knobs TW_RS_OWNER_EPI,
   * TW_RS_PULL, TW_RS_GROUP_UNITS), not the reduce-CTA count, which may differ by rank; the
   * gather runs on the GEMM CTAs after their tiles. */
  const int can = world == 2 && !plan->pull && m_local % TW_GEMM_RS_BLOCK_M == 0 &&
                  block_n == 256 &&
                  (a->all_reduce ? units_max <= stride && a->group_env <= 0 : g == 1);
  const int reduce_set = !a->all_reduce && (a->reduce_sms_arg > 0 || a->reduce_env >= 0);
  plan->owner_epi =
      can && tw_gemm_rs_want_owner_epi(a->owner_env, reduce_set, a->partial_bytes == 2 ? 2 : 4,
                                       a->k, tiles, plan_ctas);
  if (plan->owner_epi) {
    plan->reduce_ctas = 0;
    plan->group_units = 1;
    plan->groups_max = (int)units_max;
  }
}
