/*
 * Internal (ops layer): the host pieces tw_attention (attention.cu) and tw_ring_attention
 * (ring_attention.cu) share: an operand's tensor map and the argument contract common to both.
 * Every failure is TW_ERR_INVALID_ARGUMENT with a message that starts with `op` and names the
 * argument.
 */
#ifndef TW_OPS_ATTENTION_ARGS_H
#define TW_OPS_ATTENTION_ARGS_H

#include <cuda.h>
#include <stddef.h>
#include <stdint.h>

#include "tilewire.h"

namespace tw {
namespace attn {

/* The operands in the order ptrs[] and bytes[] below hold them; lse may be NULL. */
enum { kArgQ, kArgK, kArgV, kArgO, kArgLse, kArgCount };
extern const char *const kArgNames[kArgCount];

/* The 4D map {head_dim, heads, seq, batch} of a [batch, seq, heads, head_dim] bf16 operand,
 * boxes {64, 1, box_rows, 1} with 128B swizzle (a box past a batch's last row is zero-filled,
 * so a tail never reads the next batch's rows); `what` names it in the error message. */
tw_status_t operand_map(CUtensorMap *map, const void *ptr, int64_t batch, int64_t seq,
                        int64_t heads, int64_t d, const char *what, int box_rows = 128);

/* batch, heads_q and heads_kv 1 .. 65535, heads_q a multiple of heads_kv, head_dim 64 or 128,
 * causal 0 or 1, softmax_scale finite and >= 0 (0: 1 / sqrt(head_dim)). */
tw_status_t check_heads(const char *op, int64_t batch, int64_t heads_q, int64_t heads_kv,
                        int64_t head_dim, int64_t causal, float softmax_scale);

/* seq_q and seq_kv 1 .. kMaxSeq (rows index in int32 with a tile to spare), q_offset and
 * kv_offset 0 .. 2^62. */
constexpr int64_t kMaxSeq = INT32_MAX - 2 * 128;
tw_status_t check_seqs(const char *op, int64_t seq_q, int64_t seq_kv, int64_t q_offset,
                       int64_t kv_offset);

/* An operand of `seq` (named seq_name) rows of `heads` (heads_name) heads: below 2^39 elements
 * a batch (its map's outermost stride below 2^40 bytes) and 2^61 in all. */
tw_status_t check_extent(const char *op, const char *seq_name, const char *heads_name,
                         int64_t batch, int64_t seq, int64_t heads, int64_t head_dim);

/* q, k, v and o set and 16-byte aligned, lse (if set) 4-byte aligned. */
tw_status_t check_aligned(const char *op, const void *const ptrs[kArgCount]);

/* o and lse (if set) overlap no input nor each other. */
tw_status_t check_outputs_disjoint(const char *op, const void *const ptrs[kArgCount],
                                   const size_t bytes[kArgCount]);

} // namespace attn
} // namespace tw
#endif
