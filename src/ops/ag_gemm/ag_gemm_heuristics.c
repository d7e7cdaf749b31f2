/*
 * tw_ag_gemm launch plan. Communication CTAs: enough that the push of this rank's
 * shard to every rank finishes while the GEMM runs, estimated from the per-CTA rates the
 * plan assumes (below): a copy CTA moves 9.4-15 GB/s, a GEMM CTA does about 5.5 TFLOP/s;
 * each push only has to arrive by the time the rotated GEMM needs it.
 * Chunks: 128 rows (one GEMM row block) unless the shard would need more than TW_AG_GEMM_MAX_CHUNKS
 * flags. The figures behind these rules are in CHANGELOG.md's development history.
 */
#include "gemm/gemm_heuristics.h"
#include "ops/ag_gemm/ag_gemm.h"
#include "ops/allgather/allgather.h"

/* Copy rate of one CTA the plan assumes: 15 GB/s over NVLink to another GPU; about 9.4 GB/s
 * effective where the ranks share one GPU, whose copies and GEMMs all compete for one HBM.
 * Both are fits to sweeps of the communication CTAs' count on H200s (CHANGELOG.md). */
#define TW_COPY_GBPS_PER_CTA 15.0
#define TW_COPY_GBPS_PER_CTA_SHARED 9.4
/* What one rank's whole push reaches, as the plan assumes (the standalone tw_allgather's
 * rate on H200s, docs/PERF.md): about 300 GB/s over NVLink, about 200 GB/s per rank where
 * 8 ranks share one GPU. */
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
   * data arrives at different times, so groups of one shard beat any fixed count of row
   * blocks. */
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
     * slack. (A rule of "the whole push ends by half the GEMM" would give half the CTAs to
     * copies at shapes where a quarter of them suffice.) */
    double want = 1.25 * t_copy1 / t_gemm;
    /* Communication-bound shapes (the push at full link speed takes most of the GEMM time):
     * every CTA the plan may give: more copy CTAs shorten the call up to about half the budget. */
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
   * epilogue per consumer warpgroup: half the store rounds per tile) wins; on distinct GPUs
   * it loses, so they keep 4 stages. */
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
   * where the gathered bytes weigh on the GEMM: they are 1 / n of its flops. Against the push
   * it wins up to N 2048 per rank and loses at flux-tp8's 6144, where the push is already
   * hidden; the rule takes it at N per rank <= 4096. */
  /* TW_AG_PEER_GATHER=2 (an option): every tile of a row block stores a 1 / n_blocks share of
   * its k-blocks instead of column block 0's tile storing all of them. It beats mode 1 at one
   * shape of four, so it is not a default. */
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
  /* With more peers the copy engine serves them one copy at a time, the SM push all at once,
   * so with more than 2 ranks, where the rule is untried, the call keeps the SMs. One process per
   * GPU takes the rule too: the copies are the same peer copies as from one process, and test_mp
   * runs the copy-engine mode one process per GPU. */
  if (world != 2)
    return 0;
  /* Where the push is a large share of a long GEMM, the SM-driven mode holds communication
   * CTAs for most of the GEMM, and a copy engine costs no SM: at a push / GEMM estimate of
   * about 0.6 the copy engine wins, at 0.2 it is level, and above 1 it loses (the chunk flags'
   * latency, and pushes that outlast the GEMM). The same estimates as the plan's. */
  const double share = push_share(world, m_local, n, k, device_sms);
  return share >= 0.3 && share <= 0.8;
}

int tw_ag_gemm_own_copy_ce(int world, int gpu_shared, int64_t m_local, int64_t n, int64_t k,
                           int device_sms, int env) {
  if (env >= 0)
    return env != 0;
  /* Where the push is a small share of a long GEMM, a copy engine's own-shard copy beside the
   * kernel beats the communication CTAs' copy after their pushes (flux-tp8, a push / GEMM
   * estimate of 0.2); where the push is a large share (above 1) it loses. Between 0.3 and 0.8
   * the call takes the copy-engine mode, where this does not apply. 2 ranks on GPUs of their
   * own only: the rule is untried elsewhere. */
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
   * unfused GEMM+RS pipeline's (1 MiB of words per peer). Ranks sharing a GPU keep the SM push
   * (untried there). */
  return !gpu_shared && bytes <= TW_AG_LL_RULE_BYTES;
}
