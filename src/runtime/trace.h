/*
 * TW_TRACE summaries: one line from a kernel's per-CTA trace rows (devcomm.h, TW_TR_*).
 */
#ifndef TW_TRACE_H
#define TW_TRACE_H

#include <stddef.h>
#include <stdint.h>

/* Channel ch's name (TW_CH_*), NULL when out of range. */
const char *tw_channel_name(int ch);

/* Writes "tw trace: OP rank R call C: ..." into buf (times in microseconds from the first
 * CTA's start) and returns 1; returns 0 (buf empty) when no CTA left a start stamp.
 * rows: (TW_TRACE_CTAS + 1) x TW_TRACE_FIELDS words, the last row {channel + 1}. */
int tw_trace_format(const uint64_t *rows, int rank, uint64_t call, char *buf, size_t len);

/* The watchdog's report (TW_WATCHDOG_S) on a call that has not finished after stalled_s
 * seconds, from rows the kernel is still writing (host-mapped): a header line, then one line
 * per unfinished CTA (the first 32): the bounded wait it spins in (channel, peer, item, for how
 * long), the last GEMM tile its producer claimed and its consumers finished, and whether it is
 * past its GEMM loop; times in ms before the newest stamp of the call. Returns 1, or 0 when out
 * of host memory. */
int tw_trace_format_live(const volatile uint64_t *live, int rank, uint64_t call, double stalled_s,
                         char *buf, size_t len);

#endif
