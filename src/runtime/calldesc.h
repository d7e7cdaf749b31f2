/*
 * What ranks must agree on in a collective call, and how a disagreement is named.
 *
 * Each op describes its call (tw_call_begin) after its own checks and plan, before anything is
 * enqueued: its channel and up to TW_CALL_FIELDS values that must be alike on every rank (the
 * shapes and dtypes first, then the symmetric buffers as heap offsets, then the plan's choices
 * that fix the exchange: path, chunking, flag layout). The description rides in the kernels'
 * tw_dev_comm_t (comm->dev.call while the call is being enqueued), so it holds under CUDA graphs
 * and across processes: the kernel's entry handshake stores its digest beside the entry word,
 * and every wait for a peer's entry compares it (device/signal.cuh) before the first write into
 * any peer. A mismatch is TW_ERR_MISMATCH in the comm's error block; tw_comm_async_error then
 * reads both ranks' descriptions from their control blocks and names the first field that
 * differs, with the field names from the op's registry entry (runtime/registry.h).
 */
#ifndef TW_RUNTIME_CALLDESC_H
#define TW_RUNTIME_CALLDESC_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/devcomm.h"
#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tw_comm;

/* Sets comm->dev.call to channel's call with `nfields` (<= TW_CALL_FIELDS) values and returns
 * the description it replaces (an op that enqueues another op's kernels inside its call, e.g.
 * tw_allgather, restores the outer one with tw_call_end). */
tw_call_desc_t tw_call_begin(struct tw_comm *comm, int channel, int nfields,
                             const uint64_t *fields);
/* Puts back the description tw_call_begin returned. */
void tw_call_end(struct tw_comm *comm, tw_call_desc_t saved);

/* A buffer as a call field: its offset in the symmetric heap + 1, or 0 when it is not in it
 * (ranks pass the same symmetric buffer at the same offset; plain buffers compare as 0). */
uint64_t tw_call_heap_field(struct tw_comm *comm, const void *ptr);

/* The digest of a description (never 0). */
uint64_t tw_call_digest(const tw_call_desc_t *d);

/* The message of a TW_ERR_MISMATCH block `e` of comm: both ranks' calls read from their control
 * blocks, the first field that differs named. */
void tw_call_format_mismatch(struct tw_comm *comm, const volatile tw_err_block_t *e, char *buf,
                             size_t len);

/* After the message of a TW_ERR_DEVICE_TIMEOUT / TW_ERR_ABORTED block `e` of comm (in buf):
 * appends the ranks that had not entered the call on this rank's channel (a rank that never
 * called, or one that is in another op), read from this rank's entry words. */
void tw_call_format_absent(struct tw_comm *comm, const volatile tw_err_block_t *e, char *buf,
                           size_t len);

/* The first field where a and b differ: its index, TW_CALL_FIELDS when the ops or field counts
 * differ, -1 when they are alike. */
int tw_call_first_difference(const tw_call_desc_t *a, const tw_call_desc_t *b);

#ifdef __cplusplus
}
#endif
#endif
