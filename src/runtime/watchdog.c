/* TW_WATCHDOG_S: see watchdog.h. */
#include "runtime/watchdog.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/env.h"
#include "runtime/comm.h"
#include "runtime/trace.h"

#define TW_WATCHDOG_MAX 64 /* comms watched at once (virtual ranks of a process and more) */

typedef struct {
  struct tw_comm *comm;
  uint64_t seen_done; /* calls_done when last looked at */
  double since;       /* when calls_done last moved (or the comm went idle) */
  int reported;       /* this stall was printed */
} watched_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static watched_t g_watched[TW_WATCHDOG_MAX];
static int g_started;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void check(watched_t *w, double now, double limit) {
  struct tw_comm *c = w->comm;
  const uint64_t done = __atomic_load_n(&c->calls_done, __ATOMIC_ACQUIRE);
  const uint64_t enq = __atomic_load_n(&c->calls_enqueued, __ATOMIC_ACQUIRE);
  if (done != w->seen_done || enq <= done) { /* progress, or nothing in flight */
    w->seen_done = done, w->since = now, w->reported = 0;
    return;
  }
  if (w->reported || now - w->since < limit)
    return;
  w->reported = 1;
  static char text[16384];
  tw_trace_format_live(c->trace_live, c->rank, done + 1, now - w->since, text, sizeof(text));
  fprintf(stderr, "%s", text);
  fflush(stderr);
}

static void *watch(void *arg) {
  (void)arg;
  const double limit = (double)tw_env_int(TW_WATCHDOG_S_ID);
  for (;;) {
    struct timespec nap = {0, 200 * 1000 * 1000};
    nanosleep(&nap, NULL);
    const double now = now_s();
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < TW_WATCHDOG_MAX; i++)
      if (g_watched[i].comm)
        check(&g_watched[i], now, limit);
    pthread_mutex_unlock(&g_lock);
  }
  return NULL;
}

void tw_watchdog_add(struct tw_comm *comm) {
  pthread_mutex_lock(&g_lock);
  int slot = -1;
  for (int i = 0; i < TW_WATCHDOG_MAX && slot < 0; i++)
    if (!g_watched[i].comm)
      slot = i;
  if (slot >= 0) {
    g_watched[slot].comm = comm;
    g_watched[slot].seen_done = 0;
    g_watched[slot].since = now_s();
    g_watched[slot].reported = 0;
  } else {
    fprintf(stderr, "tw watchdog: more than %d comms; rank %d is not watched\n", TW_WATCHDOG_MAX,
            comm->rank);
  }
  if (!g_started) {
    pthread_t t;
    if (pthread_create(&t, NULL, watch, NULL) == 0) {
      pthread_detach(t);
      g_started = 1;
    } else {
      fprintf(stderr, "tw watchdog: pthread_create failed; nothing is watched\n");
    }
  }
  pthread_mutex_unlock(&g_lock);
}

void tw_watchdog_remove(struct tw_comm *comm) {
  pthread_mutex_lock(&g_lock);
  for (int i = 0; i < TW_WATCHDOG_MAX; i++)
    if (g_watched[i].comm == comm)
      g_watched[i].comm = NULL;
  pthread_mutex_unlock(&g_lock);
}
