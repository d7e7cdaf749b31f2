/*
 * TW_TRACE summaries: one line from a kernel's per-CTA trace rows (devcomm.h, TW_TR_*).
 */
#ifndef TW_TRACE_H
#define TW_TRACE_H

#include <stddef.h>
#include <stdint.h>

/* Writes "tw trace: OP rank R call C: ..." into buf (times in microseconds from the first
 * CTA's start) and returns 1; returns 0 (buf empty) when no CTA left a start stamp.
 * rows: (TW_TRACE_CTAS + 1) x TW_TRACE_FIELDS words, the last row {channel + 1}. */
int tw_trace_format(const uint64_t *rows, int rank, uint64_t call, char *buf, size_t len);

#endif
