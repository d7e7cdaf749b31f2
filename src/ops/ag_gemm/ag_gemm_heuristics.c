/*
 * tw_ag_gemm launch plan. Communication CTAs: enough that the push of this rank's
 * shard to every rank finishes while the GEMM runs, estimated from measured
 * per-SM rates (docs/PERF.md): a copy CTA moves 9.4-15 GB/s (below), a GEMM CTA
 * does about 5.5 TFLOP/s; each push only has to arrive by the time the rotated GEMM needs it.
 * Chunks: 128 rows (one GEMM row block) unless the shard would need more than TW_AG_GEMM_MAX_CHUNKS
 * flags.
 */
#include "gemm/gemm_heuristics.h"
#include "ops/ag_gemm/ag_gemm.h"
#include "ops/allgather/allgather.h"

/* Copy rate of one CTA, as the plan needs it (docs/PERF.md, 2026-11-29 sweeps): 15 GB/s over
 * NVLink to another GPU (2 H200s: flux-tp8 best at 5 CTAs, M=16384 flat from 10 to 24); about
 * 9.4 GB/s effective where the ranks share one GPU, whose copies and GEMMs all compete for one
 * HBM (8 virtual ranks: M=16384 ran 19.7 ms with 8 CTAs, 21.2 ms with 4). */
#define TW_COPY_GBPS_PER_CTA 15.0
#define TW_COPY_GBPS_PER_CTA_SHARED 9.4
/* What one rank's whole push reaches (the standalone tw_allgather): about 290 GB/s over NVLink
 * between two H200s, about 200 GB/s per rank with 8 virtual ranks on one. */
#define TW_PUSH_GBPS 300.0
#define TW_PUSH_GBPS_SHARED 200.0
#define TW_GEMM_TFLOPS_PER_CTA 5.5

void tw_ag_gemm_make_plan(const tw_ag_gemm_plan_args_t *a, tw_ag_gemm_plan_t *plan) {
  plan->ctas = a->sm_budget;
  /* Tile width as the plain GEMM would choose on these SMs (wave quantisation). */
  tw_gemm_plan_t g;
  tw_gemm_plan_make(a->m_local * a->world, a->n, a->k, a->sm_budget, &g);
  plan->block_n = g.variant == TW_GEMM_V_N128_S6 ? 128 : 256;
  int64_t rpc = 128;
  while ((a->m_local + rpc - 1) / rpc > TW_AG_GEMM_MAX_CHUNKS)
    rpc *= 2;
  plan->rows_per_chunk = (int)rpc;
  plan->nchunks = (int)((a->m_local + rpc - 1) / rpc);
  /* L2 groups aligned with shards: a group that straddles two ranks' rows mixes tiles whose
   * data arrives at different times (measured, docs/PERF.md: flux-tp8 on 8 virtual ranks ran
   * 9.8 ms with groups of one shard against 11.5-12.9 ms with 1, 2, 8, 16 or 32 row blocks). */
  int64_t shard_blocks = a->m_local / 128;
  int group = (a->m_local % 128 == 0 && shard_blocks >= 1)
                  ? (int)(shard_blocks < 16 ? shard_blocks : 16)
                  : 8;
  while (group > 1 && shard_blocks % group)
    group--;
  plan->group_m = a->group_m_env > 0 ? a->group_m_env : group;
  int comm = a->comm_sms_arg > 0 ? a->comm_sms_arg : a->comm_sms_env;
  if (comm <= 0) {
    /* Bytes pushed to the world - 1 peers; the own copy (skipped in place) only feeds the
     * gathered output, no tile waits for it. */
    double bytes =
        (double)a->m_local * (double)a->k * 2.0 * (double)(a->world > 1 ? a->world - 1 : 1);
    double flops = 2.0 * (double)a->m_local * (double)a->world * (double)a->n * (double)a->k;
    double rate = a->shared_gpu ? TW_COPY_GBPS_PER_CTA_SHARED : TW_COPY_GBPS_PER_CTA;
    double t_copy1 = bytes / (rate * 1e9); /* with one comm CTA */
    double t_gemm = flops / (TW_GEMM_TFLOPS_PER_CTA * 1e12 * a->sm_budget);
    /* Just in time: the rotated GEMM of rank r - k reaches this shard after k / world of its
     * work and then reads it row block by row block, while the push serves r - 1, r - 2, ...
     * in that order, chunk by chunk. The k-th push ends at k / (world - 1) of the push time
     * and its shard is consumed until (k + 1) / world of the GEMM, so the push keeps ahead
     * when it takes no longer than the GEMM: c CTAs with t_copy1 / c <= t_gemm, plus 25%
     * slack. (The rule before, "the whole push ends by half the GEMM", gave 8 of 16 CTAs to
     * copies at M=16384 on 8 virtual ranks where about 4 suffice.) */
    double want = 1.25 * t_copy1 / t_gemm;
    /* Communication-bound shapes (the push at full link speed takes most of the GEMM time):
     * every CTA the plan may give. Measured on 2 H200s, M=8192 N=1024 K=8192: 30 CTAs 0.356 ms,
     * 48: 0.292, 66: 0.293. */
    double t_push = bytes / ((a->shared_gpu ? TW_PUSH_GBPS_SHARED : TW_PUSH_GBPS) * 1e9);
    if (t_push > 0.8 * t_gemm)
      want = a->sm_budget / 2;
    comm = (int)want;
    if ((double)comm < want)
      comm++;
    if (comm > a->sm_budget / 2)
      comm = a->sm_budget / 2;
    if (comm < 1)
      comm = 1;
  }
  if (comm >= a->sm_budget)
    comm = a->sm_budget > 1 ? a->sm_budget - 1 : 1;
  int items = a->world * plan->nchunks;
  if (comm > items)
    comm = items;
  if (comm < 1)
    comm = 1;
  plan->comm_ctas = comm;
  /* Kernel variant. Where ranks share a GPU, the plain GEMM's split (3 stages, 32 KiB of
   * epilogue per consumer warpgroup: half the store rounds per tile) measured faster on 8
   * virtual ranks: flux-tp8 8.5-8.9 ms against 10.5-11.6, M=16384 without copies 15.5 against
   * 16.4-18.3 (two runs, 2026-11-29, docs/PERF.md). On 2 H200s it was slower (flux-tp8 0.899
   * against 0.860 ms, M=16384 1.669 against 1.600), so distinct GPUs keep 4 stages. */
  plan->variant = a->variant_env >= 0 ? (a->variant_env & 1) : (a->shared_gpu ? 1 : 0);
  plan->own_copy_ce = 0;
  plan->peer_read = 0;
  plan->peer_gather = 0;
  plan->auto_ce = 0;
}

void tw_ag_gemm_plan_peer(tw_ag_gemm_plan_t *plan, int world, int no_gathered_out, int sm_mode,
                          int all_on_gpu, int64_t m_local, int64_t n, int own_in_place,
                          int comm_sms_arg, int peer_gather_env) {
  /* Peer reads (see tilewire.h, no_gathered_out): every rank on this GPU, shards of whole
   * 128-row blocks (a tile reads one peer's slot), the SM-driven mode. With the gathered
   * output the GEMM writes the peers' rows through to a_gathered (the write-through gather)
   * where the gathered bytes weigh on the GEMM: they are 1 / n of its flops. Seventh session,
   * 8 virtual ranks, against the push, interleaved A/B in both orders (docs/PERF.md): N=512
   * per rank 0.387 -> 0.364 ms, N=1024 2.32 -> 2.25, N=2048 (M=16384) 18.5 -> 17.1; at
   * flux-tp8 (N=6144) it lost, 8.8-9.1 -> 9.7-10.0, where the push is already hidden. */
  /* TW_AG_PEER_GATHER=2 (an option): every tile of a row block stores a 1 / n_blocks share of
   * its k-blocks instead of column block 0's tile storing all of them. Eighth session, 8 virtual
   * ranks, A/B rounds in both orders (modes 0 / 1 / 2, ms): flux-tp8 8.77-8.73 / 9.81-9.82 /
   * 8.95-9.04, N=512 0.39-0.41 / 0.37-0.40 / 0.37-0.40, N=1024 2.31 / 2.25-2.26 / 2.12,
   * M=16384 18.1-18.4 / 17.0-17.2 / 17.7: better than mode 1 at one shape of four, so not a
   * default. */
  const int peer_gather = no_gathered_out                    ? 0
                          : peer_gather_env == 2             ? 2
                          : peer_gather_env > 0              ? 1
                          : peer_gather_env < 0 && n <= 4096 ? 1
                                                             : 0;
  plan->peer_read = (no_gathered_out || peer_gather) && sm_mode && all_on_gpu &&
                    world <= TW_AG_PEER_READ_MAX_WORLD && m_local % 128 == 0;
  plan->peer_gather = plan->peer_read ? peer_gather : 0;
  if (plan->peer_read) { /* the communication CTAs only copy the own slot and set the flags */
    const int want = own_in_place ? 1 : (plan->nchunks < 4 ? plan->nchunks : 4);
    plan->comm_ctas = comm_sms_arg > 0 && comm_sms_arg < want ? comm_sms_arg : want;
    if (plan->comm_ctas >= plan->ctas)
      plan->comm_ctas = plan->ctas > 1 ? plan->ctas - 1 : 1;
  }
}

/* The push's estimated time over the GEMM's (both from the plan's per-SM rates). */
static double push_share(int world, int64_t m_local, int64_t n, int64_t k, int device_sms) {
  const double bytes = (double)m_local * (double)k * 2.0 * (double)(world - 1);
  const double flops = 2.0 * (double)m_local * (double)world * (double)n * (double)k;
  const double t_push = bytes / (TW_PUSH_GBPS * 1e9);
  const double t_gemm = flops / (TW_GEMM_TFLOPS_PER_CTA * 1e12 * (device_sms > 0 ? device_sms : 1));
  return t_push / t_gemm;
}

int tw_ag_gemm_auto_copy_engine(int world, int gpu_shared, int64_t m_local, int64_t n, int64_t k,
                                int device_sms, int env) {
  /* Copy engines exist between GPUs only; and the mode is the AUTO default's to take. */
  if (world < 2 || gpu_shared || env == 0)
    return 0;
  if (env > 0)
    return 1;
  /* Measured on 2 GPUs only: with more peers the copy engine serves them one copy at a time,
   * the SM push all at once, so they keep the SMs until measured. One process per GPU takes
   * the rule too: test_mp ran every other call in the copy-engine mode on 2 H200s, one process
   * each (ninth session), and the copies are the same peer copies as from one process. */
  if (world != 2)
    return 0;
  /* Where the push is a large share of a long GEMM, the SM-driven mode holds communication
   * CTAs for most of the GEMM, and a copy engine costs no SM. Ninth session, 2 H200s,
   * TW_BENCH_AB=TW_AG_AUTO_CE=0,1 (6 interleaved rounds, each block warmed 100 ms), SMs / copy
   * engine: M=16384 N=2048/rank K=16384 (push / GEMM estimate 0.59) 1.869 / 1.696 ms; flux-tp8
   * (0.20) 0.948 / 0.952, level; M=8192 N=1024 K=8192 (1.18) 0.306 / 0.330 and M=4096 N=512
   * K=4096 (2.3) 0.102 / 0.136, slower (the chunk flags' latency, and pushes that outlast the
   * GEMM). (The eighth session's 1.475 / 1.630 at M=16384 were timed without the warm-up, in
   * the clock state the previous row left.) The same estimates as the plan's. */
  const double share = push_share(world, m_local, n, k, device_sms);
  return share >= 0.3 && share <= 0.8;
}

int tw_ag_gemm_own_copy_ce(int world, int gpu_shared, int64_t m_local, int64_t n, int64_t k,
                           int device_sms, int env) {
  if (env >= 0)
    return env != 0;
  /* Where the push is a small share of a long GEMM, a copy engine's own-shard copy beside the
   * kernel beat the communication CTAs' copy after their pushes; where the push is a large
   * share it lost. Seventeenth session, 2 H200s, one process per GPU (bench_dist, 30 repeats,
   * not in place), TW_AG_OWN_COPY_CE=0 / 1, each in both orders, ms: flux-tp8 (push / GEMM
   * estimate 0.20) 1.020 / 0.950 and 1.007 / 0.957 (next17: 1.002 / 0.946); M=8192 N=1024
   * K=8192 (1.18) 0.295 / 0.301 and 0.296 / 0.302; M=4096 N=512 K=4096 (2.3) 0.0897 / 0.0932
   * and 0.0908 / 0.0934; M=16384 (0.59) runs the copy-engine mode, where the knob does not
   * apply (level). 2 ranks on GPUs of their own only (measured there). */
  return world == 2 && !gpu_shared && push_share(world, m_local, n, k, device_sms) < 0.3;
}

size_t tw_ag_ll_bytes(int world, size_t bytes) {
  return world < 2 ? 0 : 2 * (size_t)world * bytes * 2;
}

int tw_ag_want_ll(int env, int world, int gpu_shared, size_t bytes, size_t ll_bytes) {
  if (env == 0 || world < 2 || tw_ag_ll_bytes(world, bytes) > ll_bytes)
    return 0;
  if (env > 0)
    return 1;
  /* Decode shards (tw_ag_gemm's tw_allgather at M <= 64, K 8192: 128-512 KiB): one NVLink
   * latency instead of the entry handshake, the copy and the fenced flags; the threshold is the
   * unfused GEMM+RS pipeline's (1 MiB of words per peer, twenty-first session). Ranks sharing a
   * GPU keep the SM push (not measured). */
  return !gpu_shared && bytes <= TW_AG_LL_RULE_BYTES;
}
