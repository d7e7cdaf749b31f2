#include "runtime/trace.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime/devcomm.h"

static int cmp_u64(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

const char *tw_channel_name(int ch) {
  static const char *const names[TW_NUM_CHANNELS] = {
      "barrier",   "allgather", "ag_gemm",
      "gemm_rs",   "gemm_ar",   "moe",
      "attention", "test",      "ag_gemm (copy engine)"};
  return ch >= 0 && ch < TW_NUM_CHANNELS ? names[ch] : NULL;
}

/* The trace row's {channel + 1}: its name, "?" when unknown. */
static const char *channel_name(uint64_t ch1) {
  const char *name = ch1 >= 1 && ch1 <= TW_NUM_CHANNELS ? tw_channel_name((int)ch1 - 1) : NULL;
  return name ? name : "?";
}

int tw_trace_format(const uint64_t *rows, int rank, uint64_t call, char *buf, size_t len) {
  if (len)
    buf[0] = 0;
  const uint64_t ch1 = rows[TW_TRACE_CTAS * TW_TRACE_FIELDS];
  uint64_t t0 = UINT64_MAX, comm[TW_TRACE_CTAS], gemm[TW_TRACE_CTAS], gather[TW_TRACE_CTAS],
           done[TW_TRACE_CTAS], layout[TW_TRACE_CTAS], end_max = 0, wait = 0, waits = 0,
           wait_max = 0, gwait = 0, gwait_max = 0, reduced = 0, reduced_after = 0;
  int ctas = 0, ncomm = 0, ngemm = 0, ngather = 0, ndone = 0, nlayout = 0;
  for (int c = 0; c < TW_TRACE_CTAS; c++) {
    const uint64_t start = rows[c * TW_TRACE_FIELDS + TW_TR_START];
    if (start && start < t0)
      t0 = start;
  }
  for (int c = 0; c < TW_TRACE_CTAS; c++) {
    const uint64_t *r = rows + c * TW_TRACE_FIELDS;
    if (!r[TW_TR_START])
      continue;
    ctas++;
    if (r[TW_TR_COMM_END] >= t0 && r[TW_TR_COMM_END])
      comm[ncomm++] = r[TW_TR_COMM_END] - t0;
    if (r[TW_TR_GEMM_END] >= t0 && r[TW_TR_GEMM_END])
      gemm[ngemm++] = r[TW_TR_GEMM_END] - t0;
    if (r[TW_TR_LAYOUT_AT] >= t0 && r[TW_TR_LAYOUT_AT])
      layout[nlayout++] = r[TW_TR_LAYOUT_AT] - t0;
    if (r[TW_TR_DONE_AT] >= t0 && r[TW_TR_DONE] && r[TW_TR_DONE_AT]) /* CTAs that had tiles */
      done[ndone++] = r[TW_TR_DONE_AT] - t0;
    if (r[TW_TR_END] > t0 && r[TW_TR_END] - t0 > end_max)
      end_max = r[TW_TR_END] - t0;
    wait += r[TW_TR_WAIT_NS], waits += r[TW_TR_WAITS];
    reduced += r[TW_TR_REDUCED], reduced_after += r[TW_TR_REDUCED_AFTER];
    if (r[TW_TR_WAIT_NS] > wait_max)
      wait_max = r[TW_TR_WAIT_NS];
    if (r[TW_TR_GATHER_AT] >= t0 && r[TW_TR_GATHER_AT]) { /* tw_gemm_ar's all-gather role */
      gather[ngather++] = r[TW_TR_GATHER_AT] - t0;
      const uint64_t w = r[TW_TR_WAIT_NS] - r[TW_TR_GATHER_WAIT0];
      gwait += w;
      if (w > gwait_max)
        gwait_max = w;
    }
  }
  if (!ctas)
    return 0;
  qsort(comm, (size_t)ncomm, sizeof(uint64_t), cmp_u64);
  qsort(gemm, (size_t)ngemm, sizeof(uint64_t), cmp_u64);
  qsort(gather, (size_t)ngather, sizeof(uint64_t), cmp_u64);
  qsort(done, (size_t)ndone, sizeof(uint64_t), cmp_u64);
  qsort(layout, (size_t)nlayout, sizeof(uint64_t), cmp_u64);
  int n = snprintf(
      buf, len,
      "tw trace: %s rank %d call %llu: %d CTAs; us from the first start: comm/reduce-first "
      "end med %.1f max %.1f (%d CTAs), GEMM end min %.1f med %.1f max %.1f, end max %.1f; "
      "waits %.1f us in %llu (CTA max %.1f); first start at %.1f us (globaltimer)",
      channel_name(ch1), rank, (unsigned long long)call, ctas, ncomm ? comm[ncomm / 2] * 1e-3 : 0.0,
      ncomm ? comm[ncomm - 1] * 1e-3 : 0.0, ncomm, ngemm ? gemm[0] * 1e-3 : 0.0,
      ngemm ? gemm[ngemm / 2] * 1e-3 : 0.0, ngemm ? gemm[ngemm - 1] * 1e-3 : 0.0, end_max * 1e-3,
      wait * 1e-3, (unsigned long long)waits, wait_max * 1e-3, (double)t0 * 1e-3);
  /* The MoE calls: when the CTAs held the layout (the count exchange done) */
  if (nlayout && n > 0 && (size_t)n < len)
    n +=
        snprintf(buf + n, len - (size_t)n, "; layout min %.1f med %.1f max %.1f (%d CTAs)",
                 layout[0] * 1e-3, layout[nlayout / 2] * 1e-3, layout[nlayout - 1] * 1e-3, nlayout);
  /* When the CTAs that ran GEMM tiles finished their last one (stored and signalled): the
   * GEMM end above also counts CTAs that found the tile queue empty. */
  if (ndone && n > 0 && (size_t)n < len)
    n += snprintf(buf + n, len - (size_t)n, "; last tile done min %.1f med %.1f max %.1f (%d CTAs)",
                  done[0] * 1e-3, done[ndone / 2] * 1e-3, done[ndone - 1] * 1e-3, ndone);
  /* tw_gemm_ar: when the CTAs began the all-gather, and how long they waited in it for the
   * owners' reduced rows (the rest of the waits came before). */
  if (ngather && n > 0 && (size_t)n < len)
    n += snprintf(
        buf + n, len - (size_t)n,
        "; gather start min %.1f med %.1f max %.1f (%d CTAs), waits in it %.1f us (CTA max "
        "%.1f)",
        gather[0] * 1e-3, gather[ngather / 2] * 1e-3, gather[ngather - 1] * 1e-3, ngather,
        gwait * 1e-3, gwait_max * 1e-3);
  /* tw_gemm_rs / tw_gemm_ar: who reduced the unit groups, the CTAs that started on the
   * reduction or those that reduced after their tiles */
  if ((reduced || reduced_after) && n > 0 && (size_t)n < len)
    snprintf(buf + n, len - (size_t)n, "; groups reduced %llu before the tiles, %llu after",
             (unsigned long long)reduced, (unsigned long long)reduced_after);
  return 1;
}

/* Appends to buf at *pos (stops quietly when full). */
static void put(char *buf, size_t len, size_t *pos, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void put(char *buf, size_t len, size_t *pos, const char *fmt, ...) {
  if (*pos >= len)
    return;
  va_list ap;
  va_start(ap, fmt);
  const int n = vsnprintf(buf + *pos, len - *pos, fmt, ap);
  va_end(ap);
  if (n > 0)
    *pos = *pos + (size_t)n < len ? *pos + (size_t)n : len;
}

/* ms from stamp t to the newest one (0 when t is unset). */
static double age_ms(uint64_t newest, uint64_t t) {
  return t && newest > t ? (double)(newest - t) * 1e-6 : 0.0;
}

int tw_trace_format_live(const volatile uint64_t *live, int rank, uint64_t call, double stalled_s,
                         char *buf, size_t len) {
  enum { kShow = 32 };
  static const int stamps[] = {TW_TR_START,      TW_TR_COMM_END,   TW_TR_GEMM_END, TW_TR_END,
                               TW_TR_WAIT_SINCE, TW_TR_CLAIMED_AT, TW_TR_DONE_AT};
  const size_t words = (size_t)(TW_TRACE_CTAS + 1) * TW_TRACE_FIELDS;
  uint64_t *rows = (uint64_t *)malloc(words * sizeof(uint64_t));
  size_t pos = 0;
  if (len)
    buf[0] = 0;
  if (!rows)
    return 0;
  for (size_t i = 0; i < words; i++) /* one snapshot: the device keeps writing */
    rows[i] = live[i];
  uint64_t newest = 0;
  int started = 0, finished = 0, gemm_done = 0;
  for (int c = 0; c < TW_TRACE_CTAS; c++) {
    const uint64_t *r = rows + c * TW_TRACE_FIELDS;
    if (!r[TW_TR_START])
      continue;
    started++;
    finished += r[TW_TR_END] != 0;
    gemm_done += r[TW_TR_GEMM_END] != 0;
    for (size_t k = 0; k < sizeof(stamps) / sizeof(stamps[0]); k++)
      if (r[stamps[k]] > newest)
        newest = r[stamps[k]];
  }
  put(buf, len, &pos,
      "tw watchdog: rank %d: call %llu on %s has not finished after %.1f s; %d CTAs started, "
      "%d finished, %d past the GEMM loop (\"ago\": before the newest stamp)\n",
      rank, (unsigned long long)call, channel_name(rows[TW_TRACE_CTAS * TW_TRACE_FIELDS]),
      stalled_s, started, finished, gemm_done);
  int shown = 0, hidden = 0;
  for (int c = 0; c < TW_TRACE_CTAS; c++) {
    const uint64_t *r = rows + c * TW_TRACE_FIELDS;
    if (!r[TW_TR_START] || r[TW_TR_END])
      continue;
    if (shown == kShow) {
      hidden++;
      continue;
    }
    shown++;
    put(buf, len, &pos, "  cta %d:", c);
    const uint64_t w = r[TW_TR_WAITING];
    if (w)
      put(buf, len, &pos, " %s ch %s peer %d item %d for %.1f ms;",
          (w & TW_TR_WAIT_EXPIRED) ? "gave up waiting on" : "waits on",
          channel_name(((w >> 48) & 0xff) + 1), (int)(int16_t)((w >> 32) & 0xffff),
          (int)(int32_t)(uint32_t)w, age_ms(newest, r[TW_TR_WAIT_SINCE]));
    const uint64_t claimed = r[TW_TR_CLAIMED], done = r[TW_TR_DONE];
    if (claimed)
      put(buf, len, &pos, " claimed tile (%u, %u) %.1f ms ago;", (unsigned)((claimed - 1) >> 32),
          (unsigned)((claimed - 1) & 0xffffffffu), age_ms(newest, r[TW_TR_CLAIMED_AT]));
    if (done)
      put(buf, len, &pos, " finished tile (%u, %u) %.1f ms ago;", (unsigned)((done - 1) >> 32),
          (unsigned)((done - 1) & 0xffffffffu), age_ms(newest, r[TW_TR_DONE_AT]));
    put(buf, len, &pos, "%s\n",
        r[TW_TR_GEMM_END] ? " past its GEMM loop"
        : !claimed        ? " no GEMM tile yet"
                          : "");
  }
  if (hidden)
    put(buf, len, &pos, "  and %d more unfinished CTAs\n", hidden);
  free(rows);
  return 1;
}
