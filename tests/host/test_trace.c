/* TW_TRACE summaries (src/runtime/trace.c) from synthetic per-CTA rows. */
#include <stdint.h>
#include <string.h>

#include "devcomm.h"
#include "trace.h"
#include "tw_test.h"

static uint64_t rows[(TW_TRACE_CTAS + 1) * TW_TRACE_FIELDS];

int main(void) {
  char line[512];
  memset(rows, 0, sizeof(rows));
  TEST_ASSERT(tw_trace_format(rows, 0, 1, line, sizeof(line)) == 0 && line[0] == 0,
              "no CTA stamped: no line (got \"%s\")", line);
  /* Three CTAs of gemm_rs starting at 1000/1500/2000 ns; CTA 0 reduced first until 11000 ns. */
  const uint64_t base = 1000000000ull;
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
  /* An unknown channel still prints, named "?"; a short buffer truncates safely. */
  rows[TW_TRACE_CTAS * TW_TRACE_FIELDS] = 99;
  char small[16];
  TEST_ASSERT(tw_trace_format(rows, 0, 1, small, sizeof(small)) == 1 && strlen(small) == 15,
              "truncated line: \"%s\"", small);
  TEST_ASSERT(tw_trace_format(rows, 0, 1, line, sizeof(line)) == 1 && strstr(line, "trace: ? "),
              "unknown channel: \"%s\"", line);
  return tw_test_finish();
}
