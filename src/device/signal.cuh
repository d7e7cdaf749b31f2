/*
 * Device-side signalling between ranks: the contract.
 *
 *   producer: data stores (plain or TMA; TMA stores then cp.async.bulk.wait_group 0)
 *             -> CTA barrier -> one thread: tw_signal_set(flag, epoch)  [fence.acq_rel.sys +
 * st.relaxed.sys] consumer: one thread: tw_wait_geq(dc, op, flag, epoch, peer, item)
 * [ld.acquire.sys, bounded]
 *             -> (before TMA reads the data) tw_fence_proxy_async_global() -> CTA barrier
 *
 * Every wait is bounded by dc.timeout_ns (globaltimer). On expiry the first
 * failing wait of the rank records {rank, op, flag, expected, seen, peer,
 * block, item} in the comm's host-mapped error block, raises the abort word on
 * every rank it can reach, and returns false; waits that see the abort word
 * return false at once. Callers then skip their remaining work and still run
 * tw_op_finish, so the kernel exits and nothing hangs. With TW_WAIT_TRAP=1 the
 * first failure also executes `trap`.
 *
 * Epochs: tw_op_begin() returns this call's epoch on a channel (calls done + 1,
 * read from device memory); tw_op_finish() (one thread per CTA, after the CTA's
 * last signal) lets the last CTA store the epoch back. No host resets, so CUDA
 * graph replays stay correct.
 */
#ifndef TW_DEVICE_SIGNAL_CUH
#define TW_DEVICE_SIGNAL_CUH

#include <stdint.h>

#include "runtime/devcomm.h"

/* ---- memory-model primitives --------------------------------------------------------------- */

static __device__ __forceinline__ uint64_t tw_ld_acquire_sys(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

static __device__ __forceinline__ uint64_t tw_ld_acquire_gpu(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

static __device__ __forceinline__ uint32_t tw_ld_relaxed_sys_u32(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

static __device__ __forceinline__ void tw_st_release_sys(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ void tw_st_release_gpu(uint64_t *p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* One thread: a relaxed system-scope store of a 64-bit flag (no fence before it). */
static __device__ __forceinline__ void tw_st_relaxed_sys(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ void tw_st_relaxed_sys_u32(uint32_t *p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ void tw_red_release_sys_add(uint64_t *p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* After a tw_fence_acq_rel_sys(): the add is then a release (the fence and a strong write),
 * without the second fence that red.release makes. */
static __device__ __forceinline__ void tw_red_relaxed_sys_add(uint64_t *p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ void tw_red_release_gpu_add(uint64_t *p, uint64_t v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ void tw_fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

static __device__ __forceinline__ void tw_fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

/* After an acquire, before TMA (the async proxy) reads data other ranks wrote. */
static __device__ __forceinline__ void tw_fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

static __device__ __forceinline__ uint64_t tw_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* Publishes everything this CTA wrote before the preceding CTA barrier, then
 * sets the flag. Call from one thread after __syncthreads(). The fence and the relaxed store
 * are a release (PTX's release pattern); st.release would fence a second time, and a system
 * fence is costly even with nothing outstanding (docs/ARCHITECTURE.md, the protocol). */
static __device__ __forceinline__ void tw_signal_set(uint64_t *flag, uint64_t epoch) {
  tw_fence_acq_rel_sys();
  tw_st_relaxed_sys(flag, epoch);
}

/* A fan-out: one tw_fence_acq_rel_sys() after the stores to publish, then tw_signal_put for
 * each flag. Each store with that one fence is a release, so telling W ranks costs one system
 * fence, not W. */
static __device__ __forceinline__ void tw_signal_put(uint64_t *flag, uint64_t epoch) {
  tw_st_relaxed_sys(flag, epoch);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static __device__ __forceinline__ void
tw_record_wait_failure(const tw_dev_comm_t &dc, uint32_t status, int op, const uint64_t *flag,
                       uint64_t expected, uint64_t seen, int peer, int item) {
  if (atomicCAS(&dc.ctrl->err_claim, 0u, 1u) == 0u) {
    tw_err_block_t *e = dc.err;
    e->rank = dc.rank;
    e->op = op;
    e->peer = peer;
    e->flag_addr = (uint64_t)(uintptr_t)flag;
    e->flag_offset = (uint64_t)((uintptr_t)flag - (uintptr_t)dc.ctrl);
    e->expected = expected;
    e->seen = seen;
    e->block = (int32_t)blockIdx.x;
    e->what = item;
    __threadfence_system();
    e->status = status;
    __threadfence_system();
  }
  if (status == TW_ERR_DEVICE_TIMEOUT || status == TW_ERR_MISMATCH) {
    /* Tell every reachable rank (this one too) to stop waiting; a mismatch only this one: every
     * rank finds one itself (a rank that agreed with every peer would leave none disagreeing),
     * so each names it rather than an abort. */
    for (int p = 0; p < dc.world; p++)
      if (dc.peer_ctrl[p] && (status == TW_ERR_DEVICE_TIMEOUT || p == dc.rank)) {
        tw_st_relaxed_sys_u32(&dc.peer_ctrl[p]->abort, 1u);
        /* Release the copy-engine streams of tw_ag_gemm: they wait (cuStreamWaitValue64,
         * which has no bound) for entry words on this channel. */
        for (int q = 0; q < dc.world; q++)
          tw_st_release_sys(&dc.peer_ctrl[p]->entry[TW_CH_AG_GEMM_CE][q], ~0ull);
      }
    tw_fence_acq_rel_sys();
    if (dc.trap_on_timeout)
      __trap();
  }
}

/* An internal stall: an mbarrier wait of the GEMM pipeline expired (`code`: the GEMM core's
 * kStuck* * 16 + stage). Recorded in the comm's error block (peer TW_ERR_PEER_PIPELINE), every
 * reachable rank told to stop waiting, then a trap: this CTA cannot finish its loop. */
static __device__ __forceinline__ void tw_pipeline_stall(const tw_dev_comm_t &dc, int op,
                                                         int code) {
  tw_record_wait_failure(dc, TW_ERR_DEVICE_TIMEOUT, op, (const uint64_t *)dc.ctrl, 0, 0,
                         TW_ERR_PEER_PIPELINE, code);
  __trap();
}

static __device__ __forceinline__ bool tw_aborted(const tw_dev_comm_t &dc) {
  return tw_ld_relaxed_sys_u32(&dc.ctrl->abort) != 0u;
}

/* One thread: rank `peer`'s call on channel op differs from this rank's (their digests:
 * `theirs`, dc.call.digest). Recorded as TW_ERR_MISMATCH and every reachable rank told to stop;
 * the host names the field from both ranks' ctrl->call[op]. */
static __device__ __forceinline__ void tw_call_mismatch(const tw_dev_comm_t &dc, int op,
                                                        const uint64_t *where, int peer,
                                                        uint64_t theirs) {
  tw_record_wait_failure(dc, TW_ERR_MISMATCH, op, where, dc.call.digest, theirs, peer, -1);
}

/* At a kernel's start: false (and TW_ERR_ABORTED recorded) if the comm was aborted. */
static __device__ __forceinline__ bool tw_op_usable(const tw_dev_comm_t &dc, int op) {
  if (!tw_aborted(dc))
    return true;
  tw_record_wait_failure(dc, TW_ERR_ABORTED, op, (const uint64_t *)&dc.ctrl->abort, 0, 1, -1, -1);
  return false;
}

/* ---- TW_TRACE ----------------------------------------------------------------------------------
 */

/* Thread 0 of a CTA: stamps `field` of this CTA's trace row with the globaltimer. */
static __device__ __forceinline__ void tw_trace_stamp(const tw_dev_comm_t &dc, int field) {
  if (dc.trace && blockIdx.x < TW_TRACE_CTAS)
    dc.trace[blockIdx.x * TW_TRACE_FIELDS + field] = tw_globaltimer();
}

/* Thread 0 of a CTA: sets `field` of this CTA's trace row to a count. */
static __device__ __forceinline__ void tw_trace_count(const tw_dev_comm_t &dc, int field,
                                                      uint64_t n) {
  if (dc.trace && blockIdx.x < TW_TRACE_CTAS)
    dc.trace[blockIdx.x * TW_TRACE_FIELDS + field] = n;
}

/* Thread 0 of a CTA: stamps TW_TR_GATHER_AT and notes the wait total so far in
 * TW_TR_GATHER_WAIT0, so that the summary splits the waits before and in the all-gather role. */
static __device__ __forceinline__ void tw_trace_gather_start(const tw_dev_comm_t &dc) {
  if (dc.trace && blockIdx.x < TW_TRACE_CTAS) {
    uint64_t *row = dc.trace + blockIdx.x * TW_TRACE_FIELDS;
    row[TW_TR_GATHER_WAIT0] = row[TW_TR_WAIT_NS];
    row[TW_TR_GATHER_AT] = tw_globaltimer();
  }
}

/* Thread 0 of block 0, once per kernel: which channel the trace belongs to. */
static __device__ __forceinline__ void tw_trace_channel(const tw_dev_comm_t &dc, int ch) {
  if (dc.trace && blockIdx.x == 0)
    dc.trace[TW_TRACE_CTAS * TW_TRACE_FIELDS] = (uint64_t)ch + 1;
}

/* ---- waits ----------------------------------------------------------------------------------- */

/* A bounded wait's trace row (TW_TRACE / TW_WATCHDOG_S): thread 0 of a CTA notes where it waits
 * (op, peer, item) and since when, so the watchdog can name it; the end adds its time. The row
 * is NULL without a trace or in other threads. */
static __device__ __forceinline__ uint64_t *
tw_trace_wait_begin(const tw_dev_comm_t &dc, int op, int peer, int item, uint64_t start) {
  uint64_t *row = dc.trace && threadIdx.x == 0 && blockIdx.x < TW_TRACE_CTAS
                      ? dc.trace + blockIdx.x * TW_TRACE_FIELDS
                      : (uint64_t *)0;
  if (row) {
    row[TW_TR_WAIT_SINCE] = start;
    row[TW_TR_WAITING] = TW_TR_WAIT_DESC(op, peer, item);
  }
  return row;
}

static __device__ __forceinline__ void tw_trace_wait_end(uint64_t *row, uint64_t start) {
  if (row) {
    row[TW_TR_WAIT_NS] += tw_globaltimer() - start;
    row[TW_TR_WAITS] += 1;
    row[TW_TR_WAITING] = 0;
  }
}

/* A wait gave up (timeout or abort): marks its row expired and records the failure. */
static __device__ __forceinline__ void tw_wait_failed(const tw_dev_comm_t &dc, uint64_t *row,
                                                      bool aborted, int op, const uint64_t *flag,
                                                      uint64_t target, uint64_t seen, int peer,
                                                      int item) {
  if (row)
    row[TW_TR_WAITING] = TW_TR_WAIT_DESC(op, peer, item) | TW_TR_WAIT_EXPIRED;
  tw_record_wait_failure(dc, aborted ? TW_ERR_ABORTED : TW_ERR_DEVICE_TIMEOUT, op, flag, target,
                         seen, peer, item);
}

/* One thread: spins until *flag >= target. false on timeout or abort (recorded). */
static __device__ __forceinline__ bool tw_wait_geq(const tw_dev_comm_t &dc, int op,
                                                   const uint64_t *flag, uint64_t target, int peer,
                                                   int item) {
  uint64_t seen = tw_ld_acquire_sys(flag);
  if (seen >= target)
    return true;
  const uint64_t start = tw_globaltimer();
  uint64_t *row = tw_trace_wait_begin(dc, op, peer, item, start);
  uint32_t backoff = 32;
  for (;;) {
    __nanosleep(backoff);
    if (backoff < 256)
      backoff <<= 1;
    seen = tw_ld_acquire_sys(flag);
    if (seen >= target) {
      tw_trace_wait_end(row, start);
      return true;
    }
    const bool aborted = tw_aborted(dc);
    if (aborted || tw_globaltimer() - start > dc.timeout_ns) {
      tw_wait_failed(dc, row, aborted, op, flag, target, seen, peer, item);
      return false;
    }
  }
}

/* ---- low-latency words (comm.h's low-latency area) ------------------------------------------
 * A 16-byte word {d0, flag, d1, flag}: 8 data bytes, each 4 beside the call's flag, stored with
 * one 16-byte store whose 8-byte halves each land whole. A reader that sees the flag in both
 * halves has the data of that call: no fence on the writer's side, no acquire on the reader's,
 * one NVLink latency from store to use. Flags are tw_ll_flag(seq) of a comm-wide call sequence;
 * a word's previous content is an older call's (or zero), never the same flag. */
static __device__ __forceinline__ uint32_t tw_ll_flag(uint64_t seq) {
  return (uint32_t)(seq % 0xffffffffull) + 1u; /* never 0 (the area's initial content) */
}

/* A word's two flags in call seq of a call with digest `digest` (dc.call.digest): x the call's
 * flag, y that flag mixed with the digest's folded bits, so that ranks which disagree on the call
 * store words whose first flag is this call's and whose second is not (tw_ll_wait names that a
 * mismatch). Digest 0 (no call described) leaves both alike. */
static __device__ __forceinline__ uint2 tw_ll_flags(uint64_t seq, uint64_t digest) {
  const uint32_t f = tw_ll_flag(seq);
  return make_uint2(f, f ^ (uint32_t)(digest ^ (digest >> 32)));
}

static __device__ __forceinline__ void tw_ll_store(uint4 *word, uint32_t d0, uint32_t d1,
                                                   uint2 flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(word), "r"(d0),
               "r"(flag.x), "r"(d1), "r"(flag.y)
               : "memory");
}

/* Where item `item` (16 data bytes as two words) of a slot of `items` items keeps its word w
 * (0 or 1), in bytes from the slot's start: items go 8 to a 256-byte group, the group's first
 * words in one 128-byte line and its second words in the next (a last group of k < 8 items:
 * its k first words, then its k second words), so 8 lanes storing 8 consecutive items' word w
 * fill one whole line, and a slot is items x 32 bytes. With the two words side by side each
 * store instruction of a warp would write every other 16 bytes of its lines, which crossed
 * NVLink markedly slower. */
static __device__ __forceinline__ uint64_t tw_ll_item_off(uint64_t item, uint64_t items, int w) {
  const uint64_t group = item >> 3, left = items - (group << 3);
  return (group << 8) + (((uint64_t)w * (left < 8 ? left : 8) + (item & 7)) << 4);
}

/* Item `item` of the slot at `slot` (`items` items): its 16 data bytes as two words. */
static __device__ __forceinline__ void tw_ll_put_item(uint8_t *slot, uint64_t item, uint64_t items,
                                                      uint4 d, uint2 flag) {
  tw_ll_store(reinterpret_cast<uint4 *>(slot + tw_ll_item_off(item, items, 0)), d.x, d.y, flag);
  tw_ll_store(reinterpret_cast<uint4 *>(slot + tw_ll_item_off(item, items, 1)), d.z, d.w, flag);
}

static __device__ __forceinline__ uint4 tw_ll_load(const uint4 *word) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(word)
               : "memory");
  return v;
}

/* A word whose first flag is this call's but whose second stays another digest's for this many
 * spins (each sleeps 64 ns or more: some 30 us) was stored by a rank that disagrees on the call
 * (a torn read of a word being stored resolves within nanoseconds). */
#define TW_LL_MISMATCH_SPINS 512u

/* One thread, in block 0 of a kernel exchanging through the low-latency area, first: tells
 * every peer which call its words belong to (ctrl->ll_call; `flag` = tw_ll_flags(seq, ...)). */
static __device__ __forceinline__ void tw_ll_announce(const tw_dev_comm_t &dc, uint2 flag) {
  for (int p = 0; p < dc.world; p++)
    if (p != dc.rank && dc.peer_ctrl[p])
      *(volatile uint64_t *)&dc.peer_ctrl[p]->ll_call[dc.rank][0] = dc.call.digest;
  tw_fence_acq_rel_sys(); /* every digest before any tag (one fence, not one a peer) */
  for (int p = 0; p < dc.world; p++)
    if (p != dc.rank && dc.peer_ctrl[p])
      tw_signal_put(&dc.peer_ctrl[p]->ll_call[dc.rank][1], flag.x);
}

/* Whether `peer`'s announced exchange (tw_ll_announce) shows that its call differs from this
 * one, whose words carry `flag`: the same call with another digest, or a later call than this
 * (its words of this call would have come before it). Sets *theirs to its digest. */
static __device__ __forceinline__ bool tw_ll_peer_differs(const tw_dev_comm_t &dc, int peer,
                                                          uint2 flag, uint64_t *theirs) {
  if (!dc.call.digest || peer < 0 || peer >= dc.world)
    return false;
  const uint32_t tag = (uint32_t)tw_ld_acquire_sys(&dc.ctrl->ll_call[peer][1]);
  *theirs = *(const volatile uint64_t *)&dc.ctrl->ll_call[peer][0];
  if (tag == flag.x)
    return *theirs != dc.call.digest;
  return tag && (int32_t)(tag - flag.x) > 0;
}

/* Any thread: spins until `word` holds `flag` (tw_ll_flags) and returns its data as {d0, d1};
 * false on timeout or abort (recorded under op, naming `peer`, the writer, and `item`), or on a
 * word of this call from a rank whose call differs, or such a rank's announcement
 * (TW_ERR_MISMATCH). */
static __device__ __forceinline__ bool tw_ll_wait(const tw_dev_comm_t &dc, int op,
                                                  const uint4 *word, uint2 flag, int peer, int item,
                                                  uint2 *data) {
  uint4 v = tw_ll_load(word);
  if (v.y != flag.x || v.w != flag.y) {
    const uint64_t start = tw_globaltimer();
    uint64_t *row = tw_trace_wait_begin(dc, op, peer, item, start);
    uint32_t other = 0; /* the spin that first saw a word of this call with another digest */
    for (uint32_t spin = 1;; spin++) {
      if (spin > 64)
        __nanosleep(64);
      v = tw_ll_load(word);
      if (v.y == flag.x && v.w == flag.y)
        break;
      if ((spin & 15) == 0) {
        const bool aborted = tw_aborted(dc);
        if (!aborted && v.y == flag.x && !other)
          other = spin;
        uint64_t theirs = v.w ^ flag.x;
        /* a torn read resolves within a few spins; TW_LL_MISMATCH_SPINS spins sleep longer */
        if (!aborted && ((other && spin - other > TW_LL_MISMATCH_SPINS) ||
                         tw_ll_peer_differs(dc, peer, flag, &theirs))) {
          if (row)
            row[TW_TR_WAITING] = TW_TR_WAIT_DESC(op, peer, item) | TW_TR_WAIT_EXPIRED;
          tw_call_mismatch(dc, op, (const uint64_t *)word, peer, theirs);
          return false;
        }
        if (aborted || tw_globaltimer() - start > dc.timeout_ns) {
          tw_wait_failed(dc, row, aborted, op, (const uint64_t *)word, flag.x, v.y, peer, item);
          return false;
        }
      }
    }
    tw_trace_wait_end(row, start);
  }
  *data = make_uint2(v.x, v.z);
  return true;
}

/* Any thread: tw_ll_wait for both words of item `item` of the slot at `slot` (`items` items,
 * tw_ll_put_item's layout) and its 16 data bytes; false as tw_ll_wait. */
static __device__ __forceinline__ bool tw_ll_wait_item(const tw_dev_comm_t &dc, int op,
                                                       const uint8_t *slot, uint64_t item,
                                                       uint64_t items, uint2 flag, int peer,
                                                       uint4 *data) {
  uint2 lo, hi;
  if (!tw_ll_wait(dc, op, reinterpret_cast<const uint4 *>(slot + tw_ll_item_off(item, items, 0)),
                  flag, peer, (int)item, &lo) ||
      !tw_ll_wait(dc, op, reinterpret_cast<const uint4 *>(slot + tw_ll_item_off(item, items, 1)),
                  flag, peer, (int)item, &hi))
    return false;
  *data = make_uint4(lo.x, lo.y, hi.x, hi.y);
  return true;
}

/* The call's sequence number of the low-latency area (every exchange through it counts, any
 * op), from the comm's ctrl->ll_seq: all threads may read it; tw_ll_call_end stores it back. */
static __device__ __forceinline__ uint64_t tw_ll_seq_after(const uint64_t *ll_seq) {
  return *(const volatile uint64_t *)ll_seq + 1;
}
static __device__ __forceinline__ uint64_t tw_ll_next_seq(const tw_dev_comm_t &dc) {
  return tw_ll_seq_after(&dc.ctrl->ll_seq);
}

/* Call seq's half of an area (halves of half_bytes, alternating by call): its byte offset. */
static __device__ __forceinline__ uint64_t tw_ll_half(uint64_t seq, uint64_t half_bytes) {
  return (seq & 1) * half_bytes;
}

/* Thread 0 (the GEMM producer) or a consumer thread: tile (mb, nb) reached `field`
 * (TW_TR_CLAIMED or TW_TR_DONE) of this CTA's row of `trace` (dc.trace), for the watchdog. */
static __device__ __forceinline__ void tw_trace_tile(uint64_t *trace, int field, int32_t mb,
                                                     int32_t nb) {
  if (trace && blockIdx.x < TW_TRACE_CTAS) {
    uint64_t *row = trace + blockIdx.x * TW_TRACE_FIELDS;
    row[field] = TW_TR_TILE(mb, nb);
    row[field + 1] = tw_globaltimer();
  }
}

/* ---- epochs and entry handshake -------------------------------------------------------------- */

/* This call's epoch on channel ch (all threads may call). */
static __device__ __forceinline__ uint64_t tw_op_begin(const tw_dev_comm_t &dc, int ch) {
  return *(volatile uint64_t *)&dc.ctrl->epoch[ch] + 1;
}

/* One thread per CTA, after the CTA's last signal: counts the CTA out of call `epoch` on ch and
 * returns true in the grid's last CTA (the count is reset for the next kernel). With `release`,
 * that CTA first tells every reachable rank that this rank no longer reads its buffers in the
 * call (done[ch][rank] = epoch; tw_wait_released waits for it). */
static __device__ __forceinline__ bool tw_op_exit(const tw_dev_comm_t &dc, int ch, uint64_t epoch,
                                                  bool release) {
  if (release)
    tw_fence_acq_rel_sys();
  else
    __threadfence();
  unsigned done = atomicAdd(&dc.ctrl->exit_count[ch], 1u);
  if (done != gridDim.x * gridDim.y * gridDim.z - 1)
    return false;
  dc.ctrl->exit_count[ch] = 0;
  if (release) {
    tw_fence_acq_rel_sys();
    for (int q = 0; q < dc.world; q++)
      if (dc.peer_ctrl[q])
        tw_signal_put(&dc.peer_ctrl[q]->done[ch][dc.rank], epoch);
  }
  return true;
}

/* One thread: call `epoch` on ch is over for this rank; the next call on the stream sees
 * epoch + 1. */
static __device__ __forceinline__ void tw_op_end(const tw_dev_comm_t &dc, int ch, uint64_t epoch) {
  *(volatile uint64_t *)&dc.ctrl->epoch[ch] = epoch;
  __threadfence();
}

/* One thread per CTA, after the CTA's last signal: the last CTA of the grid (tw_op_exit, with
 * `release` as there) ends the call (tw_op_end). */
static __device__ __forceinline__ void tw_op_finish(const tw_dev_comm_t &dc, int ch, uint64_t epoch,
                                                    bool release = false) {
  if (tw_op_exit(dc, ch, epoch, release))
    tw_op_end(dc, ch, epoch);
}

/* One thread: waits until every peer has released this rank's buffers after its previous
 * call on each of the `n` channels `chans` (done[c][peer] >= this rank's epoch on c; the
 * calls of a channel are the same on every rank). Failures are recorded under `op`. */
static __device__ __forceinline__ bool tw_wait_released(const tw_dev_comm_t &dc, int op,
                                                        const int *chans, int n) {
  for (int i = 0; i < n; i++) {
    const uint64_t prev = *(volatile uint64_t *)&dc.ctrl->epoch[chans[i]];
    for (int q = 0; q < dc.world; q++)
      if (q != dc.rank && !tw_wait_geq(dc, op, &dc.ctrl->done[chans[i]][q], prev, q, -1))
        return false;
  }
  return true;
}

/* One thread: tells every reachable rank that this rank entered call `epoch` on ch
 * (so everything before it in this rank's stream, e.g. reads of its receive
 * buffers, is complete and peers may write into them). */
static __device__ __forceinline__ void tw_signal_entry(const tw_dev_comm_t &dc, int ch,
                                                       uint64_t epoch) {
  for (int p = 0; p < dc.world; p++)
    if (dc.peer_ctrl[p]) {
      *(volatile uint64_t *)&dc.peer_ctrl[p]->call_digest[ch][dc.rank] = dc.call.digest;
      *(volatile uint64_t *)&dc.peer_ctrl[p]->current[dc.rank] = epoch << 8 | (uint64_t)(ch + 1);
    }
  /* one fence orders everything before it (the digests and current calls above, and the
   * stream's earlier work) before every entry word */
  tw_fence_acq_rel_sys();
  for (int p = 0; p < dc.world; p++)
    if (dc.peer_ctrl[p])
      tw_signal_put(&dc.peer_ctrl[p]->entry[ch][dc.rank], epoch);
}

/* One thread, in block 0 of a call's kernel that has no entry signal (the low-latency
 * exchanges): tells every peer which call this rank is in (ctrl->current). */
static __device__ __forceinline__ void tw_signal_current(const tw_dev_comm_t &dc, int ch,
                                                         uint64_t epoch) {
  for (int p = 0; p < dc.world; p++)
    if (dc.peer_ctrl[p])
      *(volatile uint64_t *)&dc.peer_ctrl[p]->current[dc.rank] = epoch << 8 | (uint64_t)(ch + 1);
}

/* One thread, in block 0 of a call's kernel before its first signal: this rank's call on ch,
 * whole, into its control block (read by the hosts on a mismatch). */
static __device__ __forceinline__ void tw_call_publish(const tw_dev_comm_t &dc, int ch) {
  volatile uint64_t *dst = (volatile uint64_t *)&dc.ctrl->call[ch];
  const uint64_t *src = (const uint64_t *)&dc.call;
  for (unsigned i = 0; i < sizeof(tw_call_desc_t) / 8; i++)
    dst[i] = src[i];
}

/* Thread 0 of every CTA of a kernel on channel ch, first thing: the trace's start stamp, and
 * (block 0) the entry signal of call `epoch`. Returns whether the channel is usable (false:
 * an earlier wait timed out or the comm was aborted, and nothing was signalled). */
static __device__ __forceinline__ bool tw_kernel_enter(const tw_dev_comm_t &dc, int ch,
                                                       uint64_t epoch) {
  tw_trace_stamp(dc, TW_TR_START);
  tw_trace_channel(dc, ch);
  const bool usable = tw_op_usable(dc, ch);
  if (blockIdx.x == 0 && usable) {
    tw_call_publish(dc, ch);
    tw_signal_entry(dc, ch, epoch);
  }
  return usable;
}

/* One thread: waits until `peer` entered call `epoch` on ch, then compares its call's digest
 * with this rank's (false, TW_ERR_MISMATCH recorded, where they differ). The digest read is
 * this call's: `peer` stores its next call's only after it finished this one, which needs this
 * rank's writes of this call, made after this check (every op that checks calls this before its
 * first write into any peer, for every peer: tw_wait_entries). */
static __device__ __forceinline__ bool tw_wait_entry(const tw_dev_comm_t &dc, int ch, int peer,
                                                     uint64_t epoch) {
  const uint64_t *entry = &dc.ctrl->entry[ch][peer];
  uint64_t seen = tw_ld_acquire_sys(entry);
  if (seen < epoch) {
    /* tw_wait_geq's loop, which also looks at the call the peer is in: a call on another channel
     * that this rank has not completed (its epoch there is past this rank's) means the ranks'
     * calls went different ways, since a comm's calls run in one order on every rank. */
    const uint64_t start = tw_globaltimer();
    uint64_t *row = tw_trace_wait_begin(dc, ch, peer, -1, start);
    uint32_t backoff = 32;
    for (;;) {
      __nanosleep(backoff);
      if (backoff < 256)
        backoff <<= 1;
      seen = tw_ld_acquire_sys(entry);
      if (seen >= epoch) {
        tw_trace_wait_end(row, start);
        break;
      }
      const uint64_t cur = *(const volatile uint64_t *)&dc.ctrl->current[peer];
      const int other = (int)(cur & 0xff) - 1;
      if (dc.call.digest && other >= 0 && other < TW_NUM_CHANNELS && other != ch &&
          (cur >> 8) > *(const volatile uint64_t *)&dc.ctrl->epoch[other] && !tw_aborted(dc)) {
        if (row)
          row[TW_TR_WAITING] = TW_TR_WAIT_DESC(ch, peer, -1) | TW_TR_WAIT_EXPIRED;
        tw_record_wait_failure(dc, TW_ERR_MISMATCH, ch, &dc.ctrl->current[peer], dc.call.digest,
                               cur, peer, other);
        return false;
      }
      const bool aborted = tw_aborted(dc);
      if (aborted || tw_globaltimer() - start > dc.timeout_ns) {
        tw_wait_failed(dc, row, aborted, ch, entry, epoch, seen, peer, -1);
        return false;
      }
    }
  }
  const uint64_t *slot = &dc.ctrl->call_digest[ch][peer];
  const uint64_t theirs = *(const volatile uint64_t *)slot;
  if (dc.call.digest && theirs != dc.call.digest) {
    if (tw_aborted(dc)) /* the entry word was released by an abort (~0), not by the peer */
      tw_record_wait_failure(dc, TW_ERR_ABORTED, ch, &dc.ctrl->entry[ch][peer], epoch, 0, peer, -1);
    else
      tw_call_mismatch(dc, ch, slot, peer, theirs);
    return false;
  }
  return true;
}

/* One thread: tw_wait_entry for every peer of this node (ranks on other nodes signal their
 * entry through the inter-node transport: device/net.cuh); with it before a CTA's first write
 * into any peer, no rank writes into a peer when any two ranks' calls differ. */
static __device__ __forceinline__ bool tw_wait_entries(const tw_dev_comm_t &dc, int ch,
                                                       uint64_t epoch) {
  for (int q = 0; q < dc.world; q++)
    if (q != dc.rank && dc.peer_ctrl[q] && !tw_wait_entry(dc, ch, q, epoch))
      return false;
  return true;
}

/* Flag slot `index` of channel ch in rank `peer`'s control block (NULL if unreachable). */
static __device__ __forceinline__ uint64_t *tw_peer_flag(const tw_dev_comm_t &dc, int peer, int ch,
                                                         int index) {
  tw_ctrl_t *c = dc.peer_ctrl[peer];
  return c ? &c->flags[ch][index] : (uint64_t *)0;
}

static __device__ __forceinline__ uint64_t *tw_own_flag(const tw_dev_comm_t &dc, int ch,
                                                        int index) {
  return &dc.ctrl->flags[ch][index];
}

/* Every thread of every CTA, last, in a kernel that exchanged through the area on channel ch:
 * the grid's last CTA stores the sequence and ends the call (after a failure too: nothing
 * waits for its end). */
static __device__ __forceinline__ void tw_ll_call_end(const tw_dev_comm_t &dc, int ch,
                                                      uint64_t epoch, uint64_t seq) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0)
    last = tw_op_exit(dc, ch, epoch, false);
  __syncthreads();
  if (threadIdx.x == 0 && last) {
    *(volatile uint64_t *)&dc.ctrl->ll_seq = seq;
    tw_trace_stamp(dc, TW_TR_END);
    tw_op_end(dc, ch, epoch);
  }
}

#endif
