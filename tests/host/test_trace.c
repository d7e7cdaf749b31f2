/* TW_TRACE summaries (src/runtime/trace.c) from synthetic per-CTA rows. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "runtime/comm.h"
#include "runtime/devcomm.h"
#include "runtime/trace.h"
#include "runtime/watchdog.h"
#include "tw_test.h"

static uint64_t rows[(TW_TRACE_CTAS + 1) * TW_TRACE_FIELDS];
static const uint64_t base = 1000000000ull; /* the stamps' origin, ns */

/* The end-of-call summary line (tw_trace_format). */
static void test_summary_line(void) {
  char line[768];
  memset(rows, 0, sizeof(rows));
  TEST_ASSERT(tw_trace_format(rows, 0, 1, line, sizeof(line)) == 0 && line[0] == 0,
              "no CTA stamped: no line (got \"%s\")", line);
  /* Three CTAs of gemm_rs starting at 1000/1500/2000 ns; CTA 0 reduced first until 11000 ns. */
  rows[TW_TRACE_CTAS * TW_TRACE_FIELDS] = TW_CH_GEMM_RS + 1;
  for (int c = 0; c < 3; c++) {
    uint64_t *r = rows + c * TW_TRACE_FIELDS;
    r[TW_TR_START] = base + 1000 + 500 * (uint64_t)c;
    r[TW_TR_GEMM_END] = base + 100000 + 10000 * (uint64_t)c; /* 99, 109, 119 us */
    r[TW_TR_END] = base + 150000 + 1000 * (uint64_t)c;       /* max 151 us */
    r[TW_TR_WAIT_NS] = 2000 * (uint64_t)(c + 1);             /* 2 + 4 + 6 us */
    r[TW_TR_WAITS] = 1;
  }
  rows[TW_TR_COMM_END] = base + 11000; /* 10 us */
  TEST_ASSERT(tw_trace_format(rows, 3, 7, line, sizeof(line)) == 1, "a line");
  printf("  %s\n", line);
  const char *want[] = {"tw trace: gemm_rs rank 3 call 7: 3 CTAs", "end med 10.0 max 10.0 (1 CTAs)",
                        "GEMM end min 99.0 med 109.0 max 119.0", "end max 151.0",
                        "waits 12.0 us in 3 (CTA max 6.0)"};
  for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
    TEST_ASSERT(strstr(line, want[i]) != NULL, "\"%s\" not in \"%s\"", want[i], line);
  /* tw_gemm_ar: CTAs 1 and 2 began the all-gather at 120 / 130 us with 3 / 1 us of waits
   * behind them (of their 4 / 6): 6 us waited in it, the CTA max 5. No gather: no such part. */
  TEST_ASSERT(strstr(line, "gather") == NULL, "no gather part without gather stamps: \"%s\"", line);
  rows[1 * TW_TRACE_FIELDS + TW_TR_GATHER_AT] = base + 121000;
  rows[1 * TW_TRACE_FIELDS + TW_TR_GATHER_WAIT0] = 3000;
  rows[2 * TW_TRACE_FIELDS + TW_TR_GATHER_AT] = base + 131000;
  rows[2 * TW_TRACE_FIELDS + TW_TR_GATHER_WAIT0] = 1000;
  TEST_ASSERT(tw_trace_format(rows, 3, 8, line, sizeof(line)) == 1, "a line with the gather");
  printf("  %s\n", line);
  TEST_ASSERT(strstr(line, "; gather start min 120.0 med 130.0 max 130.0 (2 CTAs), waits in it "
                           "6.0 us (CTA max 5.0)") != NULL,
              "gather part in \"%s\"", line);
  TEST_ASSERT(strstr(line, "waits 12.0 us in 3 (CTA max 6.0)") != NULL, "all waits still: \"%s\"",
              line);
  rows[1 * TW_TRACE_FIELDS + TW_TR_GATHER_AT] = rows[2 * TW_TRACE_FIELDS + TW_TR_GATHER_AT] = 0;
  /* CTAs 0 and 2 finished GEMM tiles at 50 / 90 us (CTA 1 had none): the last-tile part. */
  TEST_ASSERT(strstr(line, "last tile") == NULL, "no tile part without tiles: \"%s\"", line);
  rows[0 * TW_TRACE_FIELDS + TW_TR_DONE] = TW_TR_TILE(0, 3);
  rows[0 * TW_TRACE_FIELDS + TW_TR_DONE_AT] = base + 51000;
  rows[2 * TW_TRACE_FIELDS + TW_TR_DONE] = TW_TR_TILE(1, 0);
  rows[2 * TW_TRACE_FIELDS + TW_TR_DONE_AT] = base + 91000;
  TEST_ASSERT(tw_trace_format(rows, 3, 9, line, sizeof(line)) == 1, "a line with tiles");
  TEST_ASSERT(strstr(line, "; last tile done min 50.0 med 90.0 max 90.0 (2 CTAs)") != NULL,
              "last-tile part in \"%s\"", line);
  /* Reduce counts: CTA 0 reduced 5 groups before its tiles, CTAs 1 and 2 3 and 4 after. */
  TEST_ASSERT(strstr(line, "groups reduced") == NULL, "no reduce part without counts: \"%s\"",
              line);
  rows[0 * TW_TRACE_FIELDS + TW_TR_REDUCED] = 5;
  rows[1 * TW_TRACE_FIELDS + TW_TR_REDUCED_AFTER] = 3;
  rows[2 * TW_TRACE_FIELDS + TW_TR_REDUCED_AFTER] = 4;
  TEST_ASSERT(tw_trace_format(rows, 3, 10, line, sizeof(line)) == 1, "a line with counts");
  TEST_ASSERT(strstr(line, "; last tile done min 50.0") != NULL &&
                  strstr(line, "; groups reduced 5 before the tiles, 7 after") != NULL,
              "reduce part in \"%s\"", line);
  /* The MoE calls: CTAs 0-2 held the layout at 5 / 7 / 9 us. */
  TEST_ASSERT(strstr(line, "layout") == NULL, "no layout part without stamps: \"%s\"", line);
  for (int c = 0; c < 3; c++)
    rows[c * TW_TRACE_FIELDS + TW_TR_LAYOUT_AT] = base + 6000 + 2000 * (uint64_t)c;
  TEST_ASSERT(tw_trace_format(rows, 3, 11, line, sizeof(line)) == 1, "a line with the layout");
  TEST_ASSERT(strstr(line, "; layout min 5.0 med 7.0 max 9.0 (3 CTAs)") != NULL,
              "layout part in \"%s\"", line);
  /* An unknown channel still prints, named "?"; a short buffer truncates safely. */
  rows[TW_TRACE_CTAS * TW_TRACE_FIELDS] = 99;
  char small[16];
  TEST_ASSERT(tw_trace_format(rows, 0, 1, small, sizeof(small)) == 1 && strlen(small) == 15,
              "truncated line: \"%s\"", small);
  TEST_ASSERT(tw_trace_format(rows, 0, 1, line, sizeof(line)) == 1 && strstr(line, "trace: ? "),
              "unknown channel: \"%s\"", line);
}

/* tw_trace_format_live; its rows stay in `rows` for test_watchdog_thread. */
static void test_live_report(void) {
  /* The watchdog's live report: CTA 0 finished; CTA 1 waits (gemm_rs, peer 2, item 17) and
   * has claimed tile (3, 5) and finished (2, 5); CTA 2's wait expired; 40 more unfinished CTAs
   * with a start stamp only (32 lines, then "and N more"). */
  memset(rows, 0, sizeof(rows));
  rows[TW_TRACE_CTAS * TW_TRACE_FIELDS] = TW_CH_GEMM_RS + 1;
  for (int c = 0; c < 43; c++)
    rows[c * TW_TRACE_FIELDS + TW_TR_START] = base;
  rows[TW_TR_END] = base + 1000;
  uint64_t *r1 = rows + 1 * TW_TRACE_FIELDS, *r2 = rows + 2 * TW_TRACE_FIELDS;
  r1[TW_TR_WAITING] = TW_TR_WAIT_DESC(TW_CH_GEMM_RS, 2, 17);
  r1[TW_TR_WAIT_SINCE] = base + 2000000; /* 8 ms before the newest stamp (10 ms) */
  r1[TW_TR_CLAIMED] = TW_TR_TILE(3, 5);
  r1[TW_TR_CLAIMED_AT] = base + 10000000;
  r1[TW_TR_DONE] = TW_TR_TILE(2, 5);
  r1[TW_TR_DONE_AT] = base + 9000000;
  r2[TW_TR_WAITING] = TW_TR_WAIT_DESC(TW_CH_GEMM_RS, -1, -1) | TW_TR_WAIT_EXPIRED;
  r2[TW_TR_WAIT_SINCE] = base;
  r2[TW_TR_GEMM_END] = base + 500;
  static char report[16384];
  TEST_ASSERT(tw_trace_format_live(rows, 1, 42, 12.5, report, sizeof(report)) == 1, "a report");
  printf("%s", report);
  const char *want_live[] = {
      "tw watchdog: rank 1: call 42 on gemm_rs has not finished after 12.5 s; 43 CTAs started, 1 "
      "finished, 1 past the GEMM loop",
      "  cta 1: waits on ch gemm_rs peer 2 item 17 for 8.0 ms; claimed tile (3, 5) 0.0 ms ago; "
      "finished tile (2, 5) 1.0 ms ago;\n",
      "  cta 2: gave up waiting on ch gemm_rs peer -1 item -1 for 10.0 ms; past its GEMM loop\n",
      "  cta 3: no GEMM tile yet\n", "  and 10 more unfinished CTAs\n"};
  for (size_t i = 0; i < sizeof(want_live) / sizeof(want_live[0]); i++)
    TEST_ASSERT(strstr(report, want_live[i]) != NULL, "\"%s\" not in the report", want_live[i]);
  TEST_ASSERT(strstr(report, "cta 0:") == NULL, "a finished CTA is not listed");
  TEST_ASSERT(strstr(report, "cta 32:") != NULL && strstr(report, "cta 33:") == NULL,
              "32 CTAs listed (1 .. 32)");
  char tiny[40]; /* truncates safely */
  TEST_ASSERT(tw_trace_format_live(rows, 1, 42, 1.0, tiny, sizeof(tiny)) == 1 &&
                  strlen(tiny) == sizeof(tiny) - 1,
              "truncated report: \"%s\"", tiny);
}

/* tw_watchdog_add, on the rows test_live_report left. */
static void test_watchdog_thread(void) {
  /* The watchdog thread (TW_WATCHDOG_S=1) on a comm whose call 3 does not finish: a report on
   * stderr once the call has stalled a second (polled for up to 20 s, so a slow machine only
   * waits longer), and no second one for the same stall 1.5 s later. The comm is a fake: rows,
   * counters and rank. */
  setenv("TW_WATCHDOG_S", "1", 1);
  struct tw_comm *fake = (struct tw_comm *)calloc(1, sizeof(struct tw_comm));
  TEST_REQUIRE(fake != NULL, "calloc");
  fake->rank = 5;
  fake->trace_live = rows;
  fake->calls_enqueued = 3, fake->calls_done = 2;
  fflush(stderr);
  FILE *cap = tmpfile();
  TEST_REQUIRE(cap != NULL, "tmpfile");
  const int saved = dup(2);
  dup2(fileno(cap), 2);
  tw_watchdog_add(fake);
  static char got[32768];
  const struct timespec nap = {0, 100 * 1000 * 1000};
  int reported = 0;
  for (int i = 0; i < 200 && !reported; i++) {
    nanosleep(&nap, NULL);
    reported = lseek(fileno(cap), 0, SEEK_END) > 0; /* stderr shares this file offset */
  }
  for (int i = 0; i < 15; i++) /* a second report of this stall would come in this time */
    nanosleep(&nap, NULL);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  tw_watchdog_remove(fake);
  rewind(cap);
  const size_t n = fread(got, 1, sizeof(got) - 1, cap);
  got[n] = 0;
  fclose(cap);
  TEST_ASSERT(strstr(got, "tw watchdog: rank 5: call 3 on gemm_rs has not finished after") != NULL,
              "the watchdog reported the stalled call: \"%.200s\"", got);
  const char *first = strstr(got, "tw watchdog:");
  TEST_ASSERT(first && !strstr(first + 1, "tw watchdog:"), "one report per stall");
  free(fake);
}

static void test_error_messages(void) {
  /* The messages of recorded device errors (tw_comm_async_error): an expired flag wait, and a
   * stalled GEMM pipeline (an expired mbarrier wait, which traps). */
  tw_err_block_t e;
  memset(&e, 0, sizeof(e));
  char msg[1024];
  e.status = TW_ERR_DEVICE_TIMEOUT, e.rank = 3, e.op = TW_CH_GEMM_AR, e.peer = 1;
  e.flag_offset = 0x40, e.expected = 7, e.seen = 6, e.block = 12, e.what = 5;
  tw_err_block_format(&e, 10000, msg, sizeof(msg));
  TEST_ASSERT(strstr(msg, "rank 3, op gemm_ar, block 12, item 5") && strstr(msg, "reach 7") &&
                  strstr(msg, "last saw 6") && strstr(msg, "signal: 1") && strstr(msg, "10000 ms"),
              "flag wait message: \"%s\"", msg);
  e.peer = TW_ERR_PEER_PIPELINE, e.what = 2 * 16 + 1; /* kStuckConsumerFull, stage 1 */
  tw_err_block_format(&e, 10000, msg, sizeof(msg));
  TEST_ASSERT(strstr(msg, "rank 3, op gemm_ar, block 12: internal stall in the GEMM pipeline "
                          "(consumer waiting for a stage's loads, stage 1)") &&
                  strstr(msg, "20000 ms") && strstr(msg, "trapped"),
              "pipeline stall message: \"%s\"", msg);
  setenv("TW_FAULT_STALL_TILE", "2", 1); /* the injected stall's bound (test_stall) */
  tw_err_block_format(&e, 10000, msg, sizeof(msg));
  TEST_ASSERT(strstr(msg, "(500 ms: TW_FAULT_STALL_TILE is set)") && !strstr(msg, "20000 ms"),
              "injected stall message: \"%s\"", msg);
  unsetenv("TW_FAULT_STALL_TILE");
  e.what = 5 * 16 + 2; /* kStuckSplitFull, round 2 */
  tw_err_block_format(&e, 10000, msg, sizeof(msg));
  TEST_ASSERT(strstr(msg, "(split-K reader waiting for its sender, stage 2)") != NULL,
              "split-K stall message: \"%s\"", msg);
  e.what = 9 * 16; /* an unknown role still formats */
  tw_err_block_format(&e, 10000, msg, sizeof(msg));
  TEST_ASSERT(strstr(msg, "(?, stage 0)") != NULL, "unknown role: \"%s\"", msg);
}

int main(void) {
  test_summary_line();
  test_live_report();
  test_watchdog_thread();
  test_error_messages();
  return tw_test_finish();
}
