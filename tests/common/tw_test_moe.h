/*
 * The unfused MoE layer on virtual ranks of one GPU (tests/common/tw_test_moe.cu), for the CUDA
 * tests test_moe.cu (one node) and test_moe_nodes.cu (virtual nodes of tw_config.ranks_per_node
 * ranks): a world of comms with their buffers, routings of several kinds, the layer as
 * tw_moe_dispatch, tw_grouped_gemm and tw_moe_combine on every rank's stream, and its check
 * against the host. Rank r's node is r / per_node; expert e sits on rank e / (experts / world).
 */
#ifndef TW_TEST_MOE_H
#define TW_TEST_MOE_H

#include <stdint.h>

#include "tw_test.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int world, per_node, experts, top_k, index_bits;
  int64_t hidden, n, max_tokens, recv_rows;
  int64_t tokens[TW_MAX_WORLD];
  tw_comm_t comms[TW_MAX_WORLD];
  struct CUstream_st *streams[TW_MAX_WORLD];
  void *x[TW_MAX_WORLD], *idx[TW_MAX_WORLD], *w[TW_MAX_WORLD], *weights[TW_MAX_WORLD];
  void *recv[TW_MAX_WORLD], *eout[TW_MAX_WORLD], *out[TW_MAX_WORLD], *ws[TW_MAX_WORLD];
  int32_t *offsets[TW_MAX_WORLD];
  int32_t *h_idx[TW_MAX_WORLD]; /* host routing, [tokens][top_k] */
  float *h_w[TW_MAX_WORLD];
} moe_world_t;

/* `world` ranks in nodes of per_node (per_node == world: one node), the workspace sized for the
 * wider of hidden and n, recv and expert_out of recv_rows, each rank's experts' weights random. */
void moe_world_init(moe_world_t *m, int world, int per_node, int experts, int top_k, int64_t hidden,
                    int64_t n, int64_t max_tokens, int64_t recv_rows, int index_bits);
void moe_world_fini(moe_world_t *m);

enum { kMoeRandom, kMoeSkewed, kMoeHoles };
/* A routing of m->tokens[r] tokens a rank: top_k distinct experts per token (skewed: mostly the
 * first few), some slots -1 (kMoeHoles), fresh token values and weights; recv and out poisoned. */
void moe_route(moe_world_t *m, int kind, uint64_t *rng);
/* An expert for slot j of a token whose slots 0 .. j-1 hold `chosen`: uniform over the experts, or
 * (skewed) 3 times in 4 one of the first top_k + 1, distinct from the chosen ones and, where
 * `allowed` is given, one it allows. Draws from *rng. */
int32_t moe_pick_expert(const int32_t *chosen, int j, int experts, int top_k, int skewed,
                        uint64_t *rng, int (*allowed)(const void *ctx, int32_t e), const void *ctx);
/* Host routing of T tokens into idx and w [T][top_k]: moe_pick_expert's experts (skewed), a slot
 * in 5 left unused (-1) where holes, weights in [0, 1). */
void moe_fill_routing(int32_t *idx, float *w, int64_t T, int experts, int top_k, int skewed,
                      int holes, uint64_t *rng);
tw_moe_args_t moe_args_of(const moe_world_t *m, int r);
/* tw_moe_dispatch, tw_grouped_gemm and tw_moe_combine on every rank's stream, then a sync. */
void moe_run_layer(moe_world_t *m);
/* Every rank's recv holds, bitwise, each local expert's rows from every source in rank order,
 * each source's in token order, at offsets padded to 128 (padding untouched); the offsets are
 * exact; out is bitwise the host's sum of the weighted expert outputs (across nodes: each token's
 * slots of its own node in slot order, then per other node in node order the partial of that
 * node's slots, in slot order, rounded to bf16; fp32 throughout, fmaf); a few tokens are within
 * bf16 tolerance of an fp64 reference of the whole layer; no rank reports an error. */
void moe_check_layer(moe_world_t *m, const char *what);
/* A routing error found on the device: an expert index out of range on one rank (which 0), a
 * recv too small for a hot expert (which 1); every rank reports TW_ERR_INVALID_ARGUMENT naming it
 * and no rank's recv was written. */
void moe_test_routing_error(int world, int per_node, int which);

#ifdef __cplusplus
}
#endif
#endif
