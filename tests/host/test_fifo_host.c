/*
 * The command FIFO's proxy side (transport/fifo.h) against posters that follow the device's
 * protocol on the CPU (C11 atomics in place of PTX): several threads post through a small ring
 * while the proxy thread polls; every command arrives exactly once, in ticket order, whole; a
 * ring nobody polls makes the posters' bounded wait give up.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "transport/fifo.h"
#include "tw_test.h"

enum { kSlots = 8, kPosters = 4, kPerPoster = 5000 };

typedef struct {
  tw_fifo_t f;
  _Atomic uint64_t head;
  _Atomic int failures;
} ring_t;

/* The device's tw_fifo_post on the CPU; 0 when the ring stayed full for bound_s. */
static int post(ring_t *r, tw_fifo_cmd_t cmd, double bound_s) {
  const uint64_t ticket = atomic_fetch_add(&r->head, 1);
  const double t0 = tw_test_now();
  while (ticket >=
         atomic_load_explicit((_Atomic uint64_t *)r->f.tail, memory_order_acquire) + r->f.nslots)
    if (tw_test_now() - t0 > bound_s)
      return 0;
    else
      sched_yield(); /* more threads than cores (CI has 2): let the proxy run */
  tw_fifo_cmd_t *slot = &r->f.slots[ticket & (r->f.nslots - 1)];
  cmd.seq = 0;
  memcpy((char *)slot + 8, (const char *)&cmd + 8, sizeof(cmd) - 8);
  atomic_store_explicit((_Atomic uint64_t *)&slot->seq, ticket + 1, memory_order_release);
  return 1;
}

typedef struct {
  ring_t *r;
  int id;
} poster_arg_t;

static void *poster(void *p) {
  const poster_arg_t *a = (const poster_arg_t *)p;
  for (int i = 0; i < kPerPoster; i++) {
    tw_fifo_cmd_t c;
    memset(&c, 0, sizeof(c));
    c.op = TW_FIFO_OP_TEST_ECHO;
    c.peer = a->id;
    c.local_off = (uint64_t)i;
    c.bytes = (uint64_t)i * 3 + (uint64_t)a->id;
    c.tag = (uint64_t)a->id << 32 | (uint64_t)i;
    if (!post(a->r, c, 10.0)) {
      atomic_fetch_add(&a->r->failures, 1);
      return NULL;
    }
  }
  return NULL;
}

static void ring_init(ring_t *r, uint64_t slots) {
  memset(r, 0, sizeof(*r));
  r->f.slots = (tw_fifo_cmd_t *)calloc(slots, sizeof(tw_fifo_cmd_t));
  r->f.tail = (uint64_t *)calloc(1, sizeof(uint64_t));
  r->f.nslots = slots;
  TEST_REQUIRE(r->f.slots && r->f.tail, "calloc");
}

static void test_many_posters(void) {
  ring_t r;
  ring_init(&r, kSlots);
  pthread_t th[kPosters];
  poster_arg_t args[kPosters];
  for (int p = 0; p < kPosters; p++) {
    args[p].r = &r, args[p].id = p;
    pthread_create(&th[p], NULL, poster, &args[p]);
  }
  int next[kPosters] = {0};
  int bad = 0;
  uint64_t total = 0, seq_expected = 1;
  tw_fifo_cmd_t got[4];
  const double t0 = tw_test_now();
  while (total < (uint64_t)kPosters * kPerPoster && tw_test_now() - t0 < 30.0) {
    const size_t n = tw_fifo_poll(&r.f, got, 4);
    if (!n)
      sched_yield();
    for (size_t i = 0; i < n; i++, total++) {
      const tw_fifo_cmd_t *c = &got[i];
      const int p = c->peer;
      /* ticket order overall; each poster's commands in its own order, whole */
      if (c->seq != seq_expected++ || p < 0 || p >= kPosters || c->local_off != (uint64_t)next[p] ||
          c->bytes != c->local_off * 3 + (uint64_t)p ||
          c->tag != ((uint64_t)p << 32 | c->local_off) || c->op != TW_FIFO_OP_TEST_ECHO)
        bad++;
      else
        next[p]++;
    }
  }
  for (int p = 0; p < kPosters; p++)
    pthread_join(th[p], NULL);
  TEST_ASSERT(total == (uint64_t)kPosters * kPerPoster, "took %llu of %d commands",
              (unsigned long long)total, kPosters * kPerPoster);
  TEST_ASSERT(bad == 0, "%d commands out of order or torn", bad);
  TEST_ASSERT(atomic_load(&r.failures) == 0, "%d posters gave up", atomic_load(&r.failures));
  TEST_ASSERT(*r.f.tail == total, "tail %llu after %llu commands", (unsigned long long)*r.f.tail,
              (unsigned long long)total);
  TEST_ASSERT(tw_fifo_poll(&r.f, got, 4) == 0, "a command past the last");
  printf("  %d posters x %d commands through %d slots: %.2f s\n", kPosters, kPerPoster, kSlots,
         tw_test_now() - t0);
  free(r.f.slots), free(r.f.tail);
}

static void test_nobody_polls(void) {
  ring_t r;
  ring_init(&r, 4);
  tw_fifo_cmd_t c;
  memset(&c, 0, sizeof(c));
  int posted = 0;
  while (posted < 8 && post(&r, c, 0.2))
    posted++;
  TEST_ASSERT(posted == 4, "posted %d commands into a ring of 4 nobody polls", posted);
  /* the proxy, when it comes, takes the four and frees the ring */
  tw_fifo_cmd_t got[8];
  TEST_ASSERT(tw_fifo_poll(&r.f, got, 8) == 4, "the proxy took other than the four");
  free(r.f.slots), free(r.f.tail);
}

int main(void) {
  test_many_posters();
  test_nobody_polls();
  return tw_test_finish();
}
