#include "trace.h"

#include <stdio.h>
#include <stdlib.h>

#include "devcomm.h"

static int cmp_u64(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

int tw_trace_format(const uint64_t *rows, int rank, uint64_t call, char *buf, size_t len) {
  static const char *names[TW_NUM_CHANNELS] = {"barrier", "allgather", "ag_gemm",
                                               "gemm_rs", "gemm_ar",   "moe",
                                               "attn",    "test",      "ag_gemm(ce)"};
  if (len)
    buf[0] = 0;
  const uint64_t ch1 = rows[TW_TRACE_CTAS * TW_TRACE_FIELDS];
  uint64_t t0 = UINT64_MAX, comm[TW_TRACE_CTAS], gemm[TW_TRACE_CTAS], end_max = 0, wait = 0,
           waits = 0, wait_max = 0;
  int ctas = 0, ncomm = 0, ngemm = 0;
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
    if (r[TW_TR_END] > t0 && r[TW_TR_END] - t0 > end_max)
      end_max = r[TW_TR_END] - t0;
    wait += r[TW_TR_WAIT_NS], waits += r[TW_TR_WAITS];
    if (r[TW_TR_WAIT_NS] > wait_max)
      wait_max = r[TW_TR_WAIT_NS];
  }
  if (!ctas)
    return 0;
  qsort(comm, (size_t)ncomm, sizeof(uint64_t), cmp_u64);
  qsort(gemm, (size_t)ngemm, sizeof(uint64_t), cmp_u64);
  snprintf(buf, len,
           "tw trace: %s rank %d call %llu: %d CTAs; us from the first start: comm/reduce-first "
           "end med %.1f max %.1f (%d CTAs), GEMM end min %.1f med %.1f max %.1f, end max %.1f; "
           "waits %.1f us in %llu (CTA max %.1f)",
           ch1 >= 1 && ch1 <= TW_NUM_CHANNELS ? names[ch1 - 1] : "?", rank,
           (unsigned long long)call, ctas, ncomm ? comm[ncomm / 2] * 1e-3 : 0.0,
           ncomm ? comm[ncomm - 1] * 1e-3 : 0.0, ncomm, ngemm ? gemm[0] * 1e-3 : 0.0,
           ngemm ? gemm[ngemm / 2] * 1e-3 : 0.0, ngemm ? gemm[ngemm - 1] * 1e-3 : 0.0,
           end_max * 1e-3, wait * 1e-3, (unsigned long long)waits, wait_max * 1e-3);
  return 1;
}
