/*
 * The verbs test double's own entry points, for tests (README.md beside this file). Resolve them
 * with dlsym from the library that also provides the ibv_* / efadv_* names.
 */
#ifndef TW_VD_H
#define TW_VD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Process-wide counters since the library was loaded (all NIC instances of this process). */
struct tw_vd_stats {
  uint64_t packets_sent;    /* data packets pushed into a destination's inbox */
  uint64_t bytes_sent;      /* their payload bytes */
  uint64_t packets_applied; /* data packets placed by a receiving engine of this process */
  uint64_t bytes_applied;
  uint64_t acks;      /* acks taken by senders of this process */
  uint64_t reordered; /* SRD packets applied before an older pending one */
  uint64_t rnr_waits; /* sends held because the destination had no receive posted */
  uint64_t wr_errors; /* send WRs completed with an error other than a flush */
  uint64_t cq_overflows;
  uint64_t flushed; /* WRs completed with IBV_WC_WR_FLUSH_ERR */
  uint64_t dropped; /* packets discarded by a silent NIC instance */
};

/* Fills *out; returns 0 (-1 when out is NULL). */
int tw_vd_stats(struct tw_vd_stats *out);
typedef int (*tw_vd_stats_fn)(struct tw_vd_stats *out);

/* Adds injected failures, same syntax as TW_VD_FAIL ("kind:sel:after=N;..."), to the NIC
 * instances open now that match and to those opened later; "clear" removes every rule (of open
 * instances too). Returns 0, or -1 on a bad spec (nothing added). */
int tw_vd_inject(const char *spec);
typedef int (*tw_vd_inject_fn)(const char *spec);

#ifdef __cplusplus
}
#endif

#endif
