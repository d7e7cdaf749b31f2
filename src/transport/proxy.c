/* The CPU proxy (proxy.h). */
#include "transport/proxy.h"

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/log.h"
#include "core/status.h"

#define PROXY_BATCH 64
#define PROXY_SPIN_NS 50000ull /* busy polling after the last work, then short sleeps */
#define PROXY_SLEEP_NS 20000

typedef struct inflight {
  uint64_t posted_ns; /* when it was taken from the FIFO */
  uint64_t bytes;
  int32_t peer;
  int16_t done;
  int16_t posted; /* handed to the backend (else still pending) */
} inflight_t;

struct tw_proxy {
  tw_proxy_config_t cfg;
  pthread_t thread;
  _Atomic int stop;
  /* tokens are tickets: inflight[token % cap] */
  inflight_t *inflight;
  uint64_t cap;
  uint64_t oldest, next; /* tokens: [oldest, next) taken, not all finished */
  uint64_t unfinished;
  tw_fifo_cmd_t pending[PROXY_BATCH]; /* taken, not yet posted (the backend was full) */
  int npending;
  int failed;
  /* tw_proxy_stats' counts, read by other threads */
  _Atomic uint64_t commands, bytes, max_inflight_seen, echo_sum;
};

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void fail(tw_proxy_t *p, tw_status_t st, int peer, const char *what) {
  if (p->failed)
    return;
  p->failed = 1;
  char msg[320];
  snprintf(msg, sizeof(msg), "rank %d's proxy: %s", p->cfg.rank, what);
  TW_WARN("%s", msg);
  if (p->cfg.on_error)
    p->cfg.on_error(p->cfg.ctx, st, peer, msg);
}

static void finish(tw_proxy_t *p, uint64_t token) {
  if (token < p->oldest || token >= p->next)
    return;
  inflight_t *e = &p->inflight[token % p->cap];
  if (e->done)
    return;
  e->done = 1;
  p->unfinished--;
  atomic_fetch_add_explicit(&p->commands, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&p->bytes, e->bytes, memory_order_relaxed);
  const uint64_t before = p->oldest;
  while (p->oldest < p->next && p->inflight[p->oldest % p->cap].done)
    p->oldest++;
  if (p->oldest != before && p->cfg.fifo->done) /* the kernels' view: tickets below are done */
    atomic_store_explicit((_Atomic uint64_t *)p->cfg.fifo->done, p->oldest, memory_order_release);
}

/* Posts what is pending, in order; 1 when something was posted. */
static int post_pending(tw_proxy_t *p) {
  int i = 0;
  for (; i < p->npending; i++) {
    const tw_fifo_cmd_t *c = &p->pending[i];
    const uint64_t token = c->seq - 1; /* the ticket */
    tw_net_done_t done;
    int rc = 1;
    if (c->op == TW_FIFO_OP_TEST_ECHO) {
      atomic_fetch_add_explicit(&p->echo_sum, c->tag, memory_order_relaxed);
      finish(p, token);
    } else if (p->failed || !p->cfg.net) {
      finish(p, token); /* drained: the comm is reporting a failure already */
      if (!p->cfg.net)
        fail(p, TW_ERR_INTERNAL, c->peer, "a command for a transport this comm does not have");
    } else {
      rc = p->cfg.net->ops->post(p->cfg.net, c, token, &done);
      if (rc == 0)
        break;
      p->inflight[token % p->cap].posted = 1;
      if (rc < 0) {
        fail(p, done.status, done.peer, done.what);
        finish(p, token);
      }
    }
  }
  if (i) /* what was posted leaves the front, in one move */
    memmove(&p->pending[0], &p->pending[i], sizeof(tw_fifo_cmd_t) * (size_t)(p->npending - i));
  p->npending -= i;
  return i > 0;
}

static int take(tw_proxy_t *p) {
  const uint64_t room = p->cap - (p->next - p->oldest);
  size_t want = (size_t)(PROXY_BATCH - p->npending);
  if (want > room)
    want = (size_t)room;
  if (want == 0)
    return 0;
  const size_t n = tw_fifo_poll(p->cfg.fifo, &p->pending[p->npending], want);
  const uint64_t t = now_ns();
  for (size_t i = 0; i < n; i++) {
    const tw_fifo_cmd_t *c = &p->pending[p->npending + (int)i];
    inflight_t *e = &p->inflight[p->next % p->cap];
    e->posted_ns = t;
    e->bytes = c->op == TW_FIFO_OP_WRITE ? c->bytes : 0;
    e->peer = c->peer;
    e->done = 0;
    e->posted = 0;
    p->next++;
    p->unfinished++;
  }
  p->npending += (int)n;
  if (p->unfinished > atomic_load_explicit(&p->max_inflight_seen, memory_order_relaxed))
    atomic_store_explicit(&p->max_inflight_seen, p->unfinished, memory_order_relaxed);
  return n > 0;
}

static int reap(tw_proxy_t *p) {
  if (!p->cfg.net)
    return 0;
  tw_net_done_t done[32];
  const int n = p->cfg.net->ops->poll(p->cfg.net, done, 32);
  for (int i = 0; i < n; i++) {
    if (done[i].status != TW_SUCCESS)
      fail(p, done[i].status, done[i].peer, done[i].what);
    finish(p, done[i].token);
  }
  return n > 0;
}

/* A command unfinished for longer than the timeout: its peer (or the link) stopped answering. */
static void check_silent(tw_proxy_t *p, uint64_t t) {
  if (p->failed || p->oldest == p->next)
    return;
  const inflight_t *e = &p->inflight[p->oldest % p->cap];
  if (t - e->posted_ns <= p->cfg.timeout_ns)
    return;
  char what[280];
  if (e->posted)
    snprintf(what, sizeof(what),
             "an RDMA write to rank %d (%llu bytes) has not completed after %llu ms: rank %d or "
             "the link to it stopped answering",
             e->peer, (unsigned long long)e->bytes,
             (unsigned long long)(p->cfg.timeout_ns / 1000000ull), e->peer);
  else
    snprintf(what, sizeof(what),
             "an RDMA write to rank %d (%llu bytes) could not be posted for %llu ms: the NIC's "
             "send queue stayed full, or a symmetric allocation it names was not allocated by "
             "every rank of this process (virtual ranks: each rank's tw_mem_alloc)",
             e->peer, (unsigned long long)e->bytes,
             (unsigned long long)(p->cfg.timeout_ns / 1000000ull));
  fail(p, TW_ERR_NETWORK, e->peer, what);
  /* nothing more will be posted; what was taken is written off so the ring keeps draining */
  while (p->oldest < p->next)
    finish(p, p->oldest);
}

/* Pins the calling thread to the CPUs near the GPU (its PCIe device's local_cpulist). */
static void pin_near(const char *gpu_bus_id) {
  if (!gpu_bus_id || !*gpu_bus_id)
    return;
  char path[128], list[1024] = "";
  char lower[32];
  size_t i = 0;
  for (; gpu_bus_id[i] && i + 1 < sizeof(lower); i++)
    lower[i] = (char)((gpu_bus_id[i] >= 'A' && gpu_bus_id[i] <= 'F') ? gpu_bus_id[i] - 'A' + 'a'
                                                                     : gpu_bus_id[i]);
  lower[i] = 0;
  snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/local_cpulist", lower);
  FILE *f = fopen(path, "r");
  if (!f)
    return;
  const int got = fgets(list, sizeof(list), f) != NULL;
  fclose(f);
  if (!got)
    return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (char *p = list; *p && *p != '\n';) {
    char *end;
    long a = strtol(p, &end, 10), b = a;
    if (end == p)
      break;
    if (*end == '-')
      b = strtol(end + 1, &end, 10);
    for (long c = a; c <= b && c < CPU_SETSIZE; c++)
      CPU_SET((int)c, &set);
    p = *end == ',' ? end + 1 : end;
  }
  if (CPU_COUNT(&set) > 0 && pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0)
    TW_DEBUG("proxy: cannot pin to the CPUs of GPU %s", gpu_bus_id);
}

static void *proxy_main(void *arg) {
  tw_proxy_t *p = (tw_proxy_t *)arg;
  pin_near(p->cfg.gpu_bus_id);
  uint64_t last_work = now_ns(), stop_since = 0;
  for (;;) {
    int work = take(p);
    work |= post_pending(p);
    work |= reap(p);
    const uint64_t t = now_ns();
    check_silent(p, t);
    if (atomic_load_explicit(&p->stop, memory_order_acquire)) {
      if (!stop_since)
        stop_since = t;
      /* stop once nothing is unfinished, or after the timeout (a silent peer) */
      if (p->unfinished == 0 || p->failed || t - stop_since > p->cfg.timeout_ns)
        break;
    }
    if (work) {
      last_work = t;
    } else if (t - last_work > PROXY_SPIN_NS) {
      const struct timespec ts = {0, PROXY_SLEEP_NS};
      nanosleep(&ts, NULL);
    }
  }
  return NULL;
}

tw_status_t tw_proxy_start(const tw_proxy_config_t *cfg, tw_proxy_t **out) {
  *out = NULL;
  tw_proxy_t *p = calloc(1, sizeof(*p));
  if (!p)
    return tw_fail(TW_ERR_SYSTEM, "out of host memory");
  p->cfg = *cfg;
  p->cap = cfg->max_inflight > 0 ? (uint64_t)cfg->max_inflight : 1024;
  p->inflight = calloc((size_t)p->cap, sizeof(inflight_t));
  if (!p->inflight) {
    free(p);
    return tw_fail(TW_ERR_SYSTEM, "out of host memory");
  }
  const int rc = pthread_create(&p->thread, NULL, proxy_main, p);
  if (rc != 0) {
    free(p->inflight);
    free(p);
    return tw_fail(TW_ERR_SYSTEM, "pthread_create(proxy): %s", strerror(rc));
  }
  *out = p;
  return TW_SUCCESS;
}

void tw_proxy_stop(tw_proxy_t *p) {
  if (!p)
    return;
  atomic_store_explicit(&p->stop, 1, memory_order_release);
  pthread_join(p->thread, NULL);
  free(p->inflight);
  free(p);
}

void tw_proxy_stats(tw_proxy_t *p, tw_proxy_stats_t *out) {
  out->commands = atomic_load_explicit(&p->commands, memory_order_relaxed);
  out->bytes = atomic_load_explicit(&p->bytes, memory_order_relaxed);
  out->max_inflight_seen = atomic_load_explicit(&p->max_inflight_seen, memory_order_relaxed);
  out->echo_sum = atomic_load_explicit(&p->echo_sum, memory_order_relaxed);
}
