/* Call descriptions and the mismatch message (calldesc.h). */
#include "runtime/calldesc.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "runtime/comm.h"
#include "runtime/registry.h"
#include "runtime/trace.h"

/* splitmix64's finaliser: every input bit reaches every output bit. */
static uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t tw_call_digest(const tw_call_desc_t *d) {
  uint64_t h = mix64(0x7477u ^ ((uint64_t)d->op << 32 | d->nfields));
  for (uint32_t i = 0; i < d->nfields && i < TW_CALL_FIELDS; i++)
    h = mix64(h ^ mix64(d->field[i] + i + 1));
  return h ? h : 1;
}

tw_call_desc_t tw_call_begin(tw_comm_t comm, int channel, int nfields, const uint64_t *fields) {
  const tw_call_desc_t saved = comm->dev.call;
  tw_call_desc_t d;
  memset(&d, 0, sizeof(d));
  d.op = (uint32_t)channel;
  d.nfields = (uint32_t)(nfields < TW_CALL_FIELDS ? nfields : TW_CALL_FIELDS);
  for (uint32_t i = 0; i < d.nfields; i++)
    d.field[i] = fields[i];
  d.digest = tw_call_digest(&d);
  comm->dev.call = d;
  return saved;
}

void tw_call_end(tw_comm_t comm, tw_call_desc_t saved) { comm->dev.call = saved; }

uint64_t tw_call_heap_field(tw_comm_t comm, const void *ptr) {
  const uintptr_t p = (uintptr_t)ptr;
  const uintptr_t base = (uintptr_t)tw_group_slot(comm->group, comm->rank, 0);
  if (!ptr || p < base || p >= base + comm->group->heap_va)
    return 0;
  return (uint64_t)(p - base) + 1;
}

int tw_call_first_difference(const tw_call_desc_t *a, const tw_call_desc_t *b) {
  if (a->op != b->op || a->nfields != b->nfields)
    return TW_CALL_FIELDS;
  for (uint32_t i = 0; i < a->nfields && i < TW_CALL_FIELDS; i++)
    if (a->field[i] != b->field[i])
      return (int)i;
  return -1;
}

/* A channel's public entry, e.g. "tw_gemm_rs". */
static const char *entry_name(uint32_t op) {
  const tw_call_fields_t *f = tw_call_fields((int)op);
  if (f)
    return f->entry;
  const char *name = tw_channel_name((int)op);
  return name ? name : "an unknown op";
}

static void format_value(const tw_call_fields_t *f, int i, uint64_t v, char *buf, size_t len) {
  const char *name = f && f->field[i] ? f->field[i] : "field";
  if (strstr(name, "(heap offset)"))
    snprintf(buf, len, v ? "%s %llu" : "%s: not a symmetric buffer", name,
             (unsigned long long)(v - 1));
  else
    snprintf(buf, len, "%s = %llu", name, (unsigned long long)v);
}

/* Copies `bytes` at `field` of this rank's control block, in rank `rank`'s control block (mapped
 * here when it is another rank's), into dst; 0 when it cannot be read. */
static int read_ctrl(tw_comm_t comm, int rank, const void *field, void *dst, size_t bytes) {
  const void *src = tw_heap_peer_ptr(comm, field, rank);
  if (!src)
    return 0;
  /* A stream of its own that does not wait for the comm's (possibly still spinning) kernels. */
  cudaStream_t s = NULL;
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(comm->device) != cudaSuccess)
    return 0;
  int ok = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess &&
           cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s) == cudaSuccess &&
           cudaStreamSynchronize(s) == cudaSuccess;
  if (s)
    cudaStreamDestroy(s);
  cudaSetDevice(prev);
  (void)cudaGetLastError();
  return ok;
}

/* Rank `rank`'s description of its call on `ch` into *d; 0 when it cannot be read. */
static int read_call(tw_comm_t comm, int rank, uint32_t ch, tw_call_desc_t *d) {
  return ch < TW_NUM_CHANNELS && read_ctrl(comm, rank, &comm->ctrl->call[ch], d, sizeof(*d));
}

void tw_call_format_absent(tw_comm_t comm, const volatile tw_err_block_t *e, char *buf,
                           size_t len) {
  const uint32_t ch = (uint32_t)e->op;
  /* waits on control-block words, in calls with entry signals (not the low-latency words) */
  if (ch == TW_CH_BARRIER || ch >= TW_NUM_CHANNELS || e->flag_offset >= sizeof(tw_ctrl_t))
    return;
  uint64_t entry[TW_MAX_WORLD];
  if (!read_ctrl(comm, comm->rank, &comm->ctrl->entry[ch][0], entry,
                 sizeof(uint64_t) * (size_t)comm->world))
    return;
  const uint64_t epoch = entry[comm->rank]; /* this rank's own entry: the failed call's */
  if (epoch == 0 || epoch == ~0ull)
    return;
  size_t used = strlen(buf);
  int missing = 0;
  for (int q = 0; q < comm->world && used + 64 < len; q++) {
    if (q == comm->rank || entry[q] >= epoch) /* ~0: released by an abort, unknown */
      continue;
    if (!missing)
      used += (size_t)snprintf(buf + used, len - used,
                               " Ranks that had not entered this call (#%llu on its channel): %d",
                               (unsigned long long)epoch, q);
    else
      used += (size_t)snprintf(buf + used, len - used, ", %d", q);
    missing++;
  }
  if (missing && used + 2 < len)
    snprintf(buf + used, len - used, ".");
}

/* Whether description d is the one of digest `seen`: whole, or folded to the 32 bits a
 * low-latency word carries (tw_ll_flags). */
static int is_call(const tw_call_desc_t *d, uint64_t seen) {
  return d->digest && (d->digest == seen || (uint32_t)(d->digest ^ (d->digest >> 32)) == seen);
}

void tw_call_format_mismatch(tw_comm_t comm, const volatile tw_err_block_t *e, char *buf,
                             size_t len) {
  const int me = e->rank, peer = e->peer;
  const uint32_t ch = (uint32_t)e->op;
  const char *tail = "Every rank returned without writing into a peer. The comm is unusable: "
                     "destroy it.";
  if (e->flag_offset == offsetof(tw_ctrl_t, current) + (uint64_t)peer * sizeof(uint64_t)) {
    /* tw_wait_entry: the peer entered a call on another channel that this rank has not made */
    const uint64_t cur = e->seen;
    snprintf(buf, len,
             "TW_ERR_MISMATCH: ranks called different ops: rank %d called %s, while rank %d "
             "entered %s (its call #%llu of it) instead. %s",
             me, entry_name(ch), peer, entry_name((uint32_t)((cur & 0xff) - 1)),
             (unsigned long long)(cur >> 8), tail);
    return;
  }
  tw_call_desc_t mine, theirs;
  int have = read_call(comm, me, ch, &mine) && mine.digest == (uint64_t)e->expected;
  /* the peer's call: on this channel, or (another op on the low-latency words) on the channel
   * whose description has the digest its words or announcement carried */
  int found = 0;
  for (uint32_t c = 0; have && !found && c < TW_NUM_CHANNELS; c++) {
    const uint32_t q = c == 0 ? ch : c == ch ? 0 : c;
    found = read_call(comm, peer, q, &theirs) && is_call(&theirs, e->seen);
  }
  if (have && !found && comm->node_of[peer] != comm->node_of[me]) {
    /* a rail peer: its digest came with its entry flag over the network; its description
     * stays on its node */
    snprintf(buf, len,
             "TW_ERR_MISMATCH: rank %d's call of %s differs from rank %d's, on node %d (call "
             "digests %#llx and %#llx): the ranks' arguments, buffers or knobs disagree. %s",
             me, entry_name(ch), peer, comm->node_of[peer], (unsigned long long)e->expected,
             (unsigned long long)e->seen, tail);
    return;
  }
  if (!have || !found) {
    snprintf(buf, len,
             "TW_ERR_MISMATCH: rank %d's call of %s differs from rank %d's (call digests %#llx "
             "and %#llx; the descriptions could not be read back). %s",
             me, entry_name(ch), peer, (unsigned long long)e->expected, (unsigned long long)e->seen,
             tail);
    return;
  }
  const int i = tw_call_first_difference(&mine, &theirs);
  if (i == TW_CALL_FIELDS || i < 0) {
    snprintf(buf, len,
             "TW_ERR_MISMATCH: ranks called different ops: rank %d called %s, rank %d called %s. "
             "%s",
             me, entry_name(mine.op), peer, entry_name(theirs.op), tail);
    return;
  }
  const tw_call_fields_t *f = tw_call_fields((int)ch);
  char a[160], b[160];
  format_value(f, i, mine.field[i], a, sizeof(a));
  format_value(f, i, theirs.field[i], b, sizeof(b));
  snprintf(buf, len,
           "TW_ERR_MISMATCH: ranks disagree on a call of %s: rank %d has %s, rank %d has %s (the "
           "first field that differs). %s",
           entry_name(ch), me, a, peer, b, tail);
}
