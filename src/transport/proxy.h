/*
 * The CPU proxy: one thread per rank that drains the rank's command FIFO (fifo.h) into its
 * inter-node backend (net.h) and reaps what the backend finished.
 *
 * It takes commands in ticket order, at most max_inflight of them unfinished at a time (what
 * the ring holds beyond that waits there, so the kernels' posts feel the backpressure); a
 * command the backend has no room for now is kept, in order, and posted again first. Any
 * failure (an error completion, a refused command, or a command unfinished after timeout_ns:
 * a peer or link that stopped answering) is reported once through on_error, naming the peer,
 * and then the proxy only drains the ring, so posters never block on it. tw_proxy_stop waits
 * for what is in flight (bounded by timeout_ns) and joins the thread.
 */
#ifndef TW_TRANSPORT_PROXY_H
#define TW_TRANSPORT_PROXY_H

#include <stdint.h>

#include "transport/fifo.h"
#include "transport/net.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_proxy_config {
  tw_fifo_t *fifo;
  tw_net_t *net;    /* NULL: only TW_FIFO_OP_TEST_ECHO commands are served */
  int rank;         /* for messages */
  int max_inflight; /* 0: 1024 */
  uint64_t timeout_ns;
  const char *gpu_bus_id; /* the thread runs on the CPUs near this GPU where sysfs says */
  /* Called once, on the proxy thread, with the first failure. */
  void (*on_error)(void *ctx, tw_status_t status, int peer, const char *message);
  void *ctx;
} tw_proxy_config_t;

typedef struct tw_proxy_stats {
  uint64_t commands; /* finished */
  uint64_t bytes;
  uint64_t max_inflight_seen;
  uint64_t echo_sum; /* TW_FIFO_OP_TEST_ECHO: the sum of their tags */
} tw_proxy_stats_t;

typedef struct tw_proxy tw_proxy_t;

tw_status_t tw_proxy_start(const tw_proxy_config_t *cfg, tw_proxy_t **out);
void tw_proxy_stop(tw_proxy_t *p);
void tw_proxy_stats(tw_proxy_t *p, tw_proxy_stats_t *out);

#ifdef __cplusplus
}
#endif
#endif
