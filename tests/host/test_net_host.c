/*
 * The inter-node transport on host memory, end to end, against the verbs test double
 * (tests/verbs_double): 4 ranks as 2 nodes x 2 in one process, each with its own NIC
 * instance, FIFO and proxy thread. CPU posters follow the kernels' FIFO protocol; the ib (RC)
 * and efa (SRD) backends carry writes with flags to the rail peer, and the receiver checks
 * every byte and, on RC, that a flag never runs ahead of its data. Then the failures a comm
 * must report rather than hang on: an error completion, a peer that stops answering, a command
 * to a rank off the rail, and configurations with no usable NIC.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <dlfcn.h>

#include "transport/fifo.h"
#include "transport/net.h"
#include "transport/proxy.h"
#include "tw_test.h"

#ifndef TW_VERBS_DOUBLE
int main(void) {
  printf("built without rdma-core's headers: no backends to test\n");
  return 77;
}
#else

enum { kMaxWorld = 8, kChunks = 48, kSlots = 4 };
/* the layout of the run (nodes of g_per ranks): 2 x 2 by default */
static int g_world = 4, g_per = 2;
#define CHUNK (64u << 10)
#define HEAP (16u << 20)
#define FLAGS_OFF 0u
#define SRC_OFF (1u << 20)
#define DST_OFF (8u << 20)

typedef struct rank {
  int rank;
  int node_of[kMaxWorld];
  tw_net_config_t cfg;
  tw_net_t *net;
  unsigned char *heap;
  tw_fifo_t fifo;
  _Atomic uint64_t head;
  tw_proxy_t *proxy;
  uint64_t *host_flags;
  _Atomic int errors;
  tw_status_t err_status;
  int err_peer;
  char err_msg[400];
} rank_t;

static rank_t ranks[kMaxWorld];
static int (*vd_inject)(const char *);

static void on_error(void *ctx, tw_status_t st, int peer, const char *msg) {
  rank_t *r = (rank_t *)ctx;
  r->err_status = st;
  r->err_peer = peer;
  snprintf(r->err_msg, sizeof(r->err_msg), "%s", msg);
  atomic_fetch_add(&r->errors, 1);
}

static int rail_of(int r) { return (r + g_per) % g_world; }

static uint64_t *flags_of(rank_t *r) {
  return r->host_flags ? r->host_flags : (uint64_t *)(r->heap + FLAGS_OFF);
}

/* Brings up every rank's backend (named), its windows and its proxy; 0 when open failed. */
static int bring_up(const char *backend, uint64_t timeout_ms) {
  unsigned char *blobs = NULL;
  size_t bytes = 0;
  for (int i = 0; i < g_world; i++) {
    rank_t *r = &ranks[i];
    memset(r, 0, sizeof(*r));
    r->rank = i;
    for (int k = 0; k < g_world; k++)
      r->node_of[k] = k / g_per;
    r->heap = aligned_alloc(4096, HEAP);
    r->host_flags = calloc(TW_NET_FLAGS, sizeof(uint64_t));
    TEST_REQUIRE(r->heap && r->host_flags, "out of memory");
    memset(r->heap, 0, HEAP);
    r->cfg.rank = i;
    r->cfg.world = g_world;
    r->cfg.node_of = r->node_of;
    r->cfg.local_rank = i % g_per;
    r->cfg.local_size = g_per;
    r->cfg.backend = backend;
    r->cfg.devices = "";
    r->cfg.qps = 2;
    r->cfg.flags_off = FLAGS_OFF;
    r->cfg.host_flags = r->host_flags; /* used by efa only, as in the comm */
    tw_status_t st = tw_net_open(&r->cfg, &r->net);
    if (st != TW_SUCCESS) {
      fprintf(stderr, "open(%s) rank %d: %s\n", backend, i, tw_last_error());
      return 0;
    }
    if (strcmp(r->net->ops->name, "efa") != 0) { /* ib: the flags are in the heap */
      free(r->host_flags);
      r->host_flags = NULL;
    }
    if (!blobs) {
      bytes = r->net->ops->info_bytes(r->net);
      blobs = calloc(g_world, bytes);
    }
    TEST_TW_OK(r->net->ops->local_info(r->net, blobs + bytes * (size_t)i));
  }
  tw_net_key_t keys[kMaxWorld];
  for (int i = 0; i < g_world; i++) {
    TEST_TW_OK(ranks[i].net->ops->connect(ranks[i].net, blobs));
    TEST_TW_OK(ranks[i].net->ops->reg(ranks[i].net, 0, ranks[i].heap, HEAP, 0, &keys[i]));
  }
  free(blobs);
  for (int i = 0; i < g_world; i++) {
    rank_t *r = &ranks[i];
    TEST_TW_OK(r->net->ops->set_remote(r->net, 0, keys));
    /* the ring in plain memory: CPU posters, as in test_fifo_host */
    r->fifo.nslots = 64;
    r->fifo.slots = aligned_alloc(64, sizeof(tw_fifo_cmd_t) * r->fifo.nslots);
    r->fifo.tail = calloc(1, 64);
    memset(r->fifo.slots, 0, sizeof(tw_fifo_cmd_t) * r->fifo.nslots);
    tw_proxy_config_t pc;
    memset(&pc, 0, sizeof(pc));
    pc.fifo = &r->fifo;
    pc.net = r->net;
    pc.rank = i;
    pc.max_inflight = 32;
    pc.timeout_ns = timeout_ms * 1000000ull;
    pc.on_error = on_error;
    pc.ctx = r;
    TEST_TW_OK(tw_proxy_start(&pc, &r->proxy));
  }
  return 1;
}

static void tear_down(void) {
  for (int i = 0; i < g_world; i++) {
    rank_t *r = &ranks[i];
    const double t0 = tw_test_now();
    tw_proxy_stop(r->proxy);
    TEST_ASSERT(tw_test_now() - t0 < 5.0, "rank %d's proxy took %.1f s to stop", i,
                tw_test_now() - t0);
    if (r->net)
      r->net->ops->close(r->net);
    free(r->fifo.slots);
    free((void *)r->fifo.tail);
    free(r->heap);
    free(r->host_flags);
  }
}

/* The device's tw_fifo_post on the CPU; 0 when the ring stayed full for 10 s. */
static int post(rank_t *r, tw_fifo_cmd_t cmd) {
  const uint64_t ticket = atomic_fetch_add(&r->head, 1);
  const double t0 = tw_test_now();
  while (ticket >= atomic_load_explicit((_Atomic uint64_t *)r->fifo.tail, memory_order_acquire) +
                       r->fifo.nslots) {
    if (tw_test_now() - t0 > 10.0)
      return 0;
    usleep(50);
  }
  tw_fifo_cmd_t *slot = &r->fifo.slots[ticket & (r->fifo.nslots - 1)];
  memcpy((char *)slot + 8, (const char *)&cmd + 8, sizeof(cmd) - 8);
  atomic_store_explicit((_Atomic uint64_t *)&slot->seq, ticket + 1, memory_order_release);
  return 1;
}

static unsigned char pattern(int rank, size_t i) {
  return (unsigned char)(rank * 37 + (int)(i * 7 + i / 4096));
}

/* Writes carrying one flag: on RC several (in order, each raising the flag's value), on SRD one
 * (a flag's value says only that the write carrying it landed: earlier ones to the same flag may
 * still be on their way). */
static int slots_for(int ordered) { return ordered ? kSlots : kChunks; }

static tw_fifo_cmd_t write_cmd(int peer, int k, int slots) {
  tw_fifo_cmd_t c;
  memset(&c, 0, sizeof(c));
  c.op = TW_FIFO_OP_WRITE;
  c.peer = peer;
  c.local_off = SRC_OFF + (uint64_t)k * CHUNK;
  c.remote_off = DST_OFF + (uint64_t)k * CHUNK;
  c.bytes = CHUNK;
  c.flag_off = (uint64_t)(k % slots) + 1;
  c.flag_value = (uint64_t)(k / slots) + 1; /* the k-th write carrying this flag carries k */
  return c;
}

/* Data from every rank's rail peer lands whole, and (ordered) no flag runs ahead of its data. */
static void run_writes(const char *backend, int ordered) {
  if (!bring_up(backend, 10000)) {
    TEST_ASSERT(0, "the %s backend did not come up", backend);
    return;
  }
  if (strcmp(backend, "auto") == 0) /* efa where an EFA device exists, else ib */
    TEST_ASSERT(strcmp(ranks[0].net->ops->name, getenv("TW_VD_NICS")[0] == 'e' ? "efa" : "ib") == 0,
                "auto chose %s", ranks[0].net->ops->name);
  for (int i = 0; i < g_world; i++)
    for (size_t b = 0; b < (size_t)kChunks * CHUNK; b++)
      ranks[i].heap[SRC_OFF + b] = pattern(i, b);
  for (int i = 0; i < g_world; i++)
    for (int k = 0; k < kChunks; k++)
      TEST_REQUIRE(post(&ranks[i], write_cmd(rail_of(i), k, slots_for(ordered))),
                   "rank %d: the ring stayed full", i);
  int early = 0;
  for (int i = 0; i < g_world; i++) {
    rank_t *r = &ranks[i];
    const int from = rail_of(i);
    volatile uint64_t *flags = flags_of(r);
    const double t0 = tw_test_now();
    int done = 0;
    while (!done && tw_test_now() - t0 < 20.0 && !atomic_load(&r->errors)) {
      done = 1;
      for (int s = 0; s < slots_for(ordered); s++) {
        const uint64_t v = flags[s];
        done &= v == (uint64_t)(kChunks / slots_for(ordered));
        if (!ordered || v == 0)
          continue;
        /* flag s at v: chunks s, s + kSlots, ... of the first v writes have landed */
        const int k = s + (int)(v - 1) * kSlots;
        const size_t off = (size_t)k * CHUNK + CHUNK - 1;
        early += r->heap[DST_OFF + off] != pattern(from, off);
      }
      if (!done)
        usleep(100);
    }
    TEST_ASSERT(done, "%s: rank %d's flags did not all arrive (error: %s)", backend, i, r->err_msg);
    size_t bad = 0;
    for (size_t b = 0; b < (size_t)kChunks * CHUNK; b++)
      bad += r->heap[DST_OFF + b] != pattern(from, b);
    TEST_ASSERT(bad == 0, "%s: rank %d: %zu bytes from rank %d differ", backend, i, bad, from);
    TEST_ASSERT(atomic_load(&r->errors) == 0, "%s: rank %d: %s", backend, i, r->err_msg);
  }
  TEST_ASSERT(early == 0, "%s: a flag was seen %d time(s) before its data", backend, early);
  /* every command finished: the proxies' counts */
  for (int i = 0; i < g_world; i++) {
    tw_proxy_stats_t s;
    const double t0 = tw_test_now();
    do {
      tw_proxy_stats(ranks[i].proxy, &s);
    } while (s.commands < kChunks && tw_test_now() - t0 < 5.0 && usleep(100) == 0);
    TEST_ASSERT(s.commands == kChunks && s.bytes == (uint64_t)kChunks * CHUNK,
                "%s: rank %d's proxy finished %llu commands, %llu bytes", backend, i,
                (unsigned long long)s.commands, (unsigned long long)s.bytes);
    TEST_ASSERT(s.max_inflight_seen <= 32, "in flight %llu > the cap 32",
                (unsigned long long)s.max_inflight_seen);
  }
  tear_down();
}

/* Waits up to bound_s for rank i's proxy to report; checks the status and that the message
 * has `needle`. */
static void expect_error(int i, double bound_s, const char *needle, const char *what) {
  const double t0 = tw_test_now();
  while (!atomic_load(&ranks[i].errors) && tw_test_now() - t0 < bound_s)
    usleep(1000);
  TEST_ASSERT(atomic_load(&ranks[i].errors) == 1, "%s: rank %d reported %d errors", what, i,
              atomic_load(&ranks[i].errors));
  TEST_ASSERT(ranks[i].err_status == TW_ERR_NETWORK, "%s: status %d", what,
              (int)ranks[i].err_status);
  TEST_ASSERT(strstr(ranks[i].err_msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what,
              ranks[i].err_msg, needle);
}

static void run_failures(void) {
  /* an error completion on rank 0's NIC (device 0: ranks 0 and 2 share it by local rank) */
  TEST_REQUIRE(vd_inject("wc_error:dev=0:after=5") == 0, "tw_vd_inject");
  if (bring_up("ib", 10000)) {
    for (int k = 0; k < 16; k++)
      post(&ranks[0], write_cmd(2, k, kSlots));
    expect_error(0, 5.0, "rank 2", "error completion");
    /* the proxy keeps draining the ring after a failure: posters never block */
    int posted = 1;
    for (int k = 0; k < 200 && posted; k++)
      posted = post(&ranks[0], write_cmd(2, k % kChunks, kSlots));
    TEST_ASSERT(posted, "after a failure the ring stopped draining");
    tear_down();
  }
  TEST_REQUIRE(vd_inject("clear") == 0, "tw_vd_inject(clear)");
  /* a peer that stops answering: rank 3's NIC goes silent; rank 1's writes never complete */
  TEST_REQUIRE(vd_inject("silent:dev=1:after=0") == 0, "tw_vd_inject");
  if (bring_up("ib", 300)) {
    for (int k = 0; k < 4; k++)
      post(&ranks[1], write_cmd(3, k, kSlots));
    expect_error(1, 5.0, "stopped answering", "silent peer");
    TEST_ASSERT(ranks[1].err_peer == 3, "silent peer named %d", ranks[1].err_peer);
    tear_down();
  }
  TEST_REQUIRE(vd_inject("clear") == 0, "tw_vd_inject(clear)");
  /* a command to a rank of the same node: refused, named */
  if (bring_up("ib", 10000)) {
    post(&ranks[0], write_cmd(1, 0, kSlots));
    expect_error(0, 5.0, "not a peer of this rank's rail", "off-rail command");
    tear_down();
  }
}

/* Registers a CHUNK-byte window at heap offset HEAP (past the heap's) on every rank, without the
 * keys (set_remote): the state of a window of virtual ranks that a later rank has not allocated
 * yet. Fills rank 0's with its pattern. */
static void reg_late_window(unsigned char **extra, tw_net_key_t *keys) {
  for (int i = 0; i < g_world; i++) {
    extra[i] = aligned_alloc(4096, CHUNK);
    TEST_REQUIRE(extra[i] != NULL, "out of memory");
    for (size_t b = 0; b < CHUNK; b++)
      extra[i][b] = i == 0 ? pattern(0, b) : 0;
    TEST_TW_OK(ranks[i].net->ops->reg(ranks[i].net, HEAP, extra[i], CHUNK, 0, &keys[i]));
  }
}

/* A command naming a window whose keys are not all in waits for them (not refused), and lands
 * once they are; one whose window never goes live is named at the proxy's bound. */
static void run_late_windows(void) {
  unsigned char *extra[kMaxWorld];
  tw_net_key_t keys[kMaxWorld];
  tw_fifo_cmd_t c;
  memset(&c, 0, sizeof(c));
  c.op = TW_FIFO_OP_WRITE;
  c.peer = 2;
  c.local_off = HEAP, c.remote_off = HEAP, c.bytes = CHUNK;
  c.flag_off = 1, c.flag_value = 7;
  if (bring_up("ib", 10000)) {
    reg_late_window(extra, keys);
    TEST_REQUIRE(post(&ranks[0], c), "the ring stayed full");
    usleep(50000);
    TEST_ASSERT(atomic_load(&ranks[0].errors) == 0, "a window being registered: refused (%s)",
                ranks[0].err_msg);
    TEST_ASSERT(flags_of(&ranks[2])[0] == 0, "a write landed before its window was live");
    for (int i = 0; i < g_world; i++)
      TEST_TW_OK(ranks[i].net->ops->set_remote(ranks[i].net, HEAP, keys));
    const double t0 = tw_test_now();
    while (((volatile uint64_t *)flags_of(&ranks[2]))[0] != 7 && tw_test_now() - t0 < 5.0)
      usleep(100);
    TEST_ASSERT(flags_of(&ranks[2])[0] == 7, "the write did not land once its window went live");
    size_t bad = 0;
    for (size_t b = 0; b < CHUNK; b++)
      bad += extra[2][b] != pattern(0, b);
    TEST_ASSERT(bad == 0, "late window: %zu bytes differ", bad);
    TEST_ASSERT(atomic_load(&ranks[0].errors) == 0, "late window: %s", ranks[0].err_msg);
    tear_down();
    for (int i = 0; i < g_world; i++)
      free(extra[i]);
  }
  if (bring_up("ib", 300)) {
    reg_late_window(extra, keys);
    TEST_REQUIRE(post(&ranks[0], c), "the ring stayed full");
    expect_error(0, 5.0, "could not be posted", "a window that never went live");
    tear_down();
    for (int i = 0; i < g_world; i++)
      free(extra[i]);
  }
}

static void run_bad_configs(void) {
  tw_net_t *net = NULL;
  int node_of[4] = {0, 0, 1, 1};
  tw_net_config_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.world = 4;
  cfg.node_of = node_of;
  cfg.local_size = 2;
  cfg.qps = 2;
  cfg.backend = "ib";
  cfg.devices = "mlx5_9";
  TEST_TW_FAILS(tw_net_open(&cfg, &net), TW_ERR_NOT_SUPPORTED, "TW_NET_DEVICES=mlx5_9");
  cfg.devices = "";
  cfg.backend = "efa";
  uint64_t flags[TW_NET_FLAGS];
  cfg.host_flags = flags;
  TEST_TW_FAILS(tw_net_open(&cfg, &net), TW_ERR_NOT_SUPPORTED, "no usable EFA device");
  cfg.backend = "carrier-pigeon";
  TEST_TW_FAILS(tw_net_open(&cfg, &net), TW_ERR_INVALID_ARGUMENT, "TW_NET=carrier-pigeon");
  cfg.backend = "ib";
  cfg.qps = 9;
  TEST_TW_FAILS(tw_net_open(&cfg, &net), TW_ERR_INVALID_ARGUMENT, "TW_NET_QPS");
  setenv("TW_VD_NICS", "efa:2", 1);
  cfg.qps = 2;
  TEST_TW_FAILS(tw_net_open(&cfg, &net), TW_ERR_NOT_SUPPORTED, "can serve the ib backend");
  setenv("TW_VD_NICS", "mlx5:2", 1);
}

int main(void) {
  tw_test_use_verbs_double(TW_VERBS_DOUBLE, "mlx5:2");
  void *vd = dlopen(TW_VERBS_DOUBLE, RTLD_NOW | RTLD_LOCAL);
  TEST_REQUIRE(vd != NULL, "dlopen(%s): %s", TW_VERBS_DOUBLE, dlerror());
  *(void **)&vd_inject = dlsym(vd, "tw_vd_inject");
  TEST_REQUIRE(vd_inject != NULL, "the double has no tw_vd_inject");
  run_writes("ib", 1);
  setenv("TW_VD_NICS", "efa:4", 1); /* two EFA NICs per rank, as on a p5 */
  run_writes("efa", 0);
  run_writes("auto", 0); /* auto takes efa where an EFA device exists */
  /* 2 nodes x 4: two NICs per rank */
  g_world = 8, g_per = 4;
  setenv("TW_VD_NICS", "mlx5:8", 1);
  run_writes("ib", 1);
  setenv("TW_VD_NICS", "efa:16", 1);
  run_writes("efa", 0);
  g_world = 4, g_per = 2;
  setenv("TW_VD_NICS", "mlx5:2", 1);
  run_failures();
  run_late_windows();
  run_bad_configs();
  return tw_test_finish();
}
#endif
