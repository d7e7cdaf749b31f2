/*
 * Bootstrap between processes: rendezvous, star collectives, fd passing, and
 * the failures that must end in a status and a message instead of a hang
 * (a rank that never arrives, world mismatch, a stale id, a duplicate rank,
 * mismatched collectives, a missing or mistagged fd).
 *
 * Ranks run as forked processes (the id is made in the parent first, as a
 * launcher would), or as threads of this process (the part valgrind checks:
 * `test_bootstrap --in-process`).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/status.h"
#include "runtime/bootstrap.h"
#include "tw_test.h"

/* Every child is killed past this, so a hang fails the test instead of stalling it. */
#define CHILD_LIMIT_S 20.0

static tw_peer_info_t make_self(int rank) {
  tw_peer_info_t self;
  memset(&self, 0, sizeof(self));
  self.rank = rank;
  self.pid = (int32_t)getpid();
  self.cuda_device = rank;
  self.sm_budget = 10 + rank; /* travel with the table: comm.c compares them across ranks */
  for (int i = 0; i < TW_PEER_KNOBS; i++)
    self.knobs[i] = 1000 * (int64_t)rank - i;
  return self;
}

/* A memfd holding `value`: what a rank shares in the fd exchange checks. */
static int make_fd_with(int32_t value) {
  int fd = memfd_create("tw-test-bootstrap", MFD_CLOEXEC);
  if (fd < 0)
    return -1;
  if (pwrite(fd, &value, sizeof(value), 0) != (ssize_t)sizeof(value)) {
    close(fd);
    return -1;
  }
  return fd;
}

static int32_t read_fd_value(int fd) {
  int32_t value = -1;
  if (pread(fd, &value, sizeof(value), 0) != (ssize_t)sizeof(value))
    return -1;
  return value;
}

static unsigned char pattern(int rank, size_t i, int round) {
  return (unsigned char)(rank * 37 + (int)(i * 11) + round * 101 + 1);
}

/* ---- running ranks as processes ----------------------------------------- */

typedef int (*rank_body)(const tw_unique_id_t *id, int index, void *arg);

/* Forks nprocs children running body(id, i, arg); each exits 0 when its checks
 * passed. Returns how many children failed, and checks them. */
static int run_procs(const char *name, const tw_unique_id_t *id, int nprocs, rank_body body,
                     void *arg) {
  pid_t pids[TW_MAX_WORLD + 4];
  fflush(stdout);
  fflush(stderr);
  for (int i = 0; i < nprocs; i++) {
    pids[i] = fork();
    TEST_REQUIRE(pids[i] >= 0, "fork: %s", strerror(errno));
    if (pids[i] == 0) {
      tw_test_passed = 0;
      tw_test_failed = 0;
      alarm((unsigned)CHILD_LIMIT_S + 5);
      int rc = body(id, i, arg);
      fflush(stdout);
      fflush(stderr);
      _exit(rc != 0 || tw_test_failed != 0 ? 1 : 0);
    }
  }
  int failed = 0;
  int status[TW_MAX_WORLD + 4];
  char what[112];
  snprintf(what, sizeof(what), "%.96s: process", name);
  tw_test_wait_children(pids, nprocs, CHILD_LIMIT_S, status, what); /* a killed one fails below */
  for (int i = 0; i < nprocs; i++) {
    int ok = WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0;
    failed += !ok;
    TEST_ASSERT(ok, "%s: process %d %s %d", name, i,
                WIFEXITED(status[i]) ? "exited with" : "died of signal",
                WIFEXITED(status[i]) ? WEXITSTATUS(status[i]) : WTERMSIG(status[i]));
  }
  return failed;
}

/* ---- the full flow, used by processes and threads ------------------------ */

typedef struct flow_arg {
  int world;
  int timeout_ms;
  int last_rank_delay_ms; /* the last rank starts this late (within the timeout) */
} flow_arg;

/* The flow also runs on threads, where the global TEST_* counters would race:
 * it counts its own failures in `bad` and the caller checks the total. */
#define FLOW_CHECK(cond, ...)                                                                      \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      (*bad)++;                                                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                              \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fprintf(stderr, "\n");                                                                       \
    }                                                                                              \
  } while (0)
#define FLOW_OK(call)                                                                              \
  do {                                                                                             \
    tw_status_t s_ = (call);                                                                       \
    FLOW_CHECK(s_ == TW_SUCCESS, "%s -> %s (%s)", #call, tw_status_string(s_), tw_last_error());   \
  } while (0)

static void check_fds(int *bad, const char *what, int rank, int world, const uint8_t *from,
                      int *fds) {
  for (int r = 0; r < world; r++) {
    if (from[r] && r != rank) {
      int32_t value = fds[r] >= 0 ? read_fd_value(fds[r]) : -2;
      FLOW_CHECK(value == r, "%s: rank %d got fd %d from rank %d, holding %d", what, rank, fds[r],
                 r, (int)value);
    } else {
      FLOW_CHECK(fds[r] == -1, "%s: rank %d: fds_out[%d] = %d, expected -1", what, rank, r, fds[r]);
    }
    if (fds[r] >= 0)
      close(fds[r]);
  }
}

/* One rank: init, check peers, allgathers of several sizes, barriers, three fd
 * exchanges back to back (all-to-all, ring, all-to-all), destroy. Returns the
 * number of failed checks. */
static int flow_rank(const tw_unique_id_t *id, int rank, int world, int timeout_ms) {
  int failures = 0;
  int *bad = &failures;
  tw_bootstrap_t *bs = NULL;
  tw_peer_info_t self = make_self(rank);
  FLOW_OK(tw_bootstrap_init(&bs, id, rank, world, timeout_ms, &self));
  if (!bs)
    return failures;
  FLOW_CHECK(self.host_hash != 0 && self.hostname[0] != '\0', "rank %d: self not filled in", rank);
  const tw_peer_info_t *peers = tw_bootstrap_peers(bs);
  for (int r = 0; r < world; r++) {
    FLOW_CHECK(peers[r].rank == r, "rank %d: peers[%d].rank = %d", rank, r, peers[r].rank);
    FLOW_CHECK(peers[r].cuda_device == r, "rank %d: peers[%d].cuda_device = %d", rank, r,
               peers[r].cuda_device);
    FLOW_CHECK(peers[r].host_hash == self.host_hash, "rank %d: peers[%d] on another host?", rank,
               r);
    FLOW_CHECK(strcmp(peers[r].hostname, self.hostname) == 0, "rank %d: peers[%d].hostname %s",
               rank, r, peers[r].hostname);
    FLOW_CHECK(peers[r].sm_budget == 10 + r, "rank %d: peers[%d].sm_budget = %d", rank, r,
               peers[r].sm_budget);
    for (int i = 0; i < TW_PEER_KNOBS; i++)
      FLOW_CHECK(peers[r].knobs[i] == 1000 * (int64_t)r - i, "rank %d: peers[%d].knobs[%d] = %lld",
                 rank, r, i, (long long)peers[r].knobs[i]);
  }
  FLOW_CHECK(peers[rank].pid == self.pid, "rank %d: own pid %d in the table, expected %d", rank,
             peers[rank].pid, self.pid);

  /* Sizes: odd, one byte, and big enough to need many partial reads/writes. */
  const size_t sizes[] = {41, 1, 256 * 1024};
  for (int round = 0; round < 3; round++) {
    size_t bytes = sizes[round];
    unsigned char *data = malloc(bytes * (size_t)world);
    TEST_REQUIRE(data, "malloc");
    memset(data, 0xEE, bytes * (size_t)world);
    for (size_t i = 0; i < bytes; i++)
      data[(size_t)rank * bytes + i] = pattern(rank, i, round);
    FLOW_OK(tw_bootstrap_allgather(bs, data, bytes));
    size_t wrong = 0;
    for (int r = 0; r < world; r++)
      for (size_t i = 0; i < bytes; i++)
        wrong += data[(size_t)r * bytes + i] != pattern(r, i, round);
    FLOW_CHECK(wrong == 0, "rank %d: allgather of %zu bytes: %zu wrong bytes", rank, bytes, wrong);
    free(data);
    FLOW_OK(tw_bootstrap_barrier(bs));
  }
  FLOW_OK(tw_bootstrap_allgather(bs, NULL, 0));

  /* No barrier between the exchanges: a fast rank's next message may reach a
   * slow rank during the previous exchange. */
  int my_fd = make_fd_with(rank);
  TEST_REQUIRE(my_fd >= 0, "memfd: %s", strerror(errno));
  uint8_t all[TW_MAX_WORLD], next[TW_MAX_WORLD] = {0}, prev[TW_MAX_WORLD] = {0};
  int fds[TW_MAX_WORLD];
  for (int r = 0; r < world; r++)
    all[r] = 1;
  next[(rank + 1) % world] = 1;
  prev[(rank + world - 1) % world] = 1;
  FLOW_OK(tw_bootstrap_exchange_fds(bs, my_fd, all, all, 100, fds));
  check_fds(bad, "all-to-all #1", rank, world, all, fds);
  FLOW_OK(tw_bootstrap_exchange_fds(bs, my_fd, next, prev, 101, fds));
  check_fds(bad, "ring", rank, world, prev, fds);
  FLOW_OK(tw_bootstrap_exchange_fds(bs, my_fd, all, all, 102, fds));
  check_fds(bad, "all-to-all #2", rank, world, all, fds);
  close(my_fd);

  FLOW_OK(tw_bootstrap_barrier(bs));
  tw_bootstrap_destroy(bs);
  return failures;
}

static int flow_body(const tw_unique_id_t *id, int index, void *arg) {
  const flow_arg *fa = arg;
  if (index == fa->world - 1 && fa->last_rank_delay_ms > 0) {
    struct timespec ts = {fa->last_rank_delay_ms / 1000,
                          (long)(fa->last_rank_delay_ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
  }
  return flow_rank(id, index, fa->world, fa->timeout_ms);
}

static void test_flow_procs(int world, int timeout_ms, int last_rank_delay_ms) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_bootstrap_create_root(&id));
  flow_arg fa = {world, timeout_ms, last_rank_delay_ms};
  char name[96];
  snprintf(name, sizeof(name), "flow, world %d%s", world,
           last_rank_delay_ms ? ", last rank late but in time" : "");
  double t0 = tw_test_now();
  run_procs(name, &id, world, flow_body, &fa);
  printf("%s: %.3f s\n", name, tw_test_now() - t0);
}

/* ---- the same flow with threads (valgrind sees every rank) --------------- */

typedef struct thread_arg {
  const tw_unique_id_t *id;
  int rank;
  int world;
  int failures;
} thread_arg;

static void *flow_thread(void *p) {
  thread_arg *ta = p;
  ta->failures = flow_rank(ta->id, ta->rank, ta->world, 20000);
  return NULL;
}

static void test_flow_threads(int world) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_bootstrap_create_root(&id));
  pthread_t threads[TW_MAX_WORLD];
  thread_arg args[TW_MAX_WORLD];
  double t0 = tw_test_now();
  for (int r = 0; r < world; r++) {
    args[r] = (thread_arg){&id, r, world, 0};
    TEST_REQUIRE(pthread_create(&threads[r], NULL, flow_thread, &args[r]) == 0, "pthread_create");
  }
  for (int r = 0; r < world; r++) {
    pthread_join(threads[r], NULL);
    TEST_ASSERT(args[r].failures == 0, "world %d as threads: rank %d had %d failed checks", world,
                r, args[r].failures);
  }
  printf("flow, world %d as threads: %.3f s\n", world, tw_test_now() - t0);
}

/* ---- single-process checks ------------------------------------------------ */

static void test_host_hash(void) {
  char name1[64], name2[64];
  uint64_t h1 = tw_host_hash(name1, sizeof(name1));
  uint64_t h2 = tw_host_hash(name2, sizeof(name2));
  TEST_ASSERT(h1 == h2 && h1 != 0, "tw_host_hash: %llx then %llx", (unsigned long long)h1,
              (unsigned long long)h2);
  TEST_ASSERT(strcmp(name1, name2) == 0 && name1[0] != '\0', "hostname \"%s\" then \"%s\"", name1,
              name2);
  char tiny[4];
  TEST_ASSERT(tw_host_hash(tiny, sizeof(tiny)) == h1 && strlen(tiny) < sizeof(tiny),
              "a short buffer changes the hash or overflows");
  TEST_ASSERT(tw_host_hash(NULL, 0) == h1, "no buffer changes the hash");
}

static void test_arguments(void) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_bootstrap_create_root(&id));
  tw_bootstrap_t *bs = (tw_bootstrap_t *)&id; /* must be reset to NULL on failure */
  tw_peer_info_t self = make_self(0);
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &id, 0, 0, 1000, &self), TW_ERR_INVALID_ARGUMENT, "world");
  TEST_ASSERT(bs == NULL, "bs not reset on failure");
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &id, 0, TW_MAX_WORLD + 1, 1000, &self),
                TW_ERR_INVALID_ARGUMENT, "world");
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &id, 2, 2, 1000, &self), TW_ERR_INVALID_ARGUMENT, "rank");
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &id, -1, 2, 1000, &self), TW_ERR_INVALID_ARGUMENT, "rank");
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &id, 0, 2, 0, &self), TW_ERR_INVALID_ARGUMENT, "timeout");
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &id, 1, 2, 1000, &self), TW_ERR_INVALID_ARGUMENT,
                "self->rank");
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &id, 0, 2, 1000, NULL), TW_ERR_INVALID_ARGUMENT, "self");
  TEST_TW_FAILS(tw_bootstrap_init(&bs, NULL, 0, 2, 1000, &self), TW_ERR_INVALID_ARGUMENT, "id");
  TEST_TW_FAILS(tw_bootstrap_init(NULL, &id, 0, 2, 1000, &self), TW_ERR_INVALID_ARGUMENT, "bs");
  tw_unique_id_t junk;
  memset(&junk, 0x5A, sizeof(junk));
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &junk, 0, 1, 1000, &self), TW_ERR_INVALID_ARGUMENT,
                "tw_get_unique_id");
  TEST_TW_FAILS(tw_bootstrap_create_root(NULL), TW_ERR_INVALID_ARGUMENT, "id");
  TEST_TW_FAILS(tw_bootstrap_allgather(NULL, NULL, 0), TW_ERR_INVALID_ARGUMENT, "bs");
  TEST_TW_FAILS(tw_bootstrap_barrier(NULL), TW_ERR_INVALID_ARGUMENT, "bs");
  TEST_ASSERT(tw_bootstrap_peers(NULL) == NULL, "peers of NULL");
  tw_bootstrap_destroy(NULL);
}

/* world == 1: the rendezvous, then everything is local. */
static void test_world1(void) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_bootstrap_create_root(&id));
  tw_bootstrap_t *bs = NULL;
  tw_peer_info_t self = make_self(0);
  TEST_TW_OK(tw_bootstrap_init(&bs, &id, 0, 1, 2000, &self));
  if (!bs)
    return;
  TEST_ASSERT(tw_bootstrap_peers(bs)[0].pid == self.pid, "peer 0 is not us");
  unsigned char data[5] = {1, 2, 3, 4, 5};
  TEST_TW_OK(tw_bootstrap_allgather(bs, data, sizeof(data)));
  TEST_ASSERT(data[0] == 1 && data[4] == 5, "world-1 allgather changed the data");
  TEST_TW_FAILS(tw_bootstrap_allgather(bs, NULL, 4), TW_ERR_INVALID_ARGUMENT, "data");
  TEST_TW_OK(tw_bootstrap_barrier(bs));
  uint8_t one = 1;
  int fds[1] = {42};
  TEST_TW_OK(tw_bootstrap_exchange_fds(bs, -1, &one, &one, 7, fds));
  TEST_ASSERT(fds[0] == -1, "world-1 exchange: fds_out[0] = %d", fds[0]);
  tw_bootstrap_destroy(bs);
}

/* The id names a port where nothing listens: TW_ERR_TIMEOUT, bounded. */
static void test_no_root(void) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_bootstrap_create_root(&id));
  tw_bootstrap_id_t bid;
  memcpy(&bid, id.internal, sizeof(bid));
  /* A port that was free a moment ago: bind, read it, close. */
  int probe = socket(AF_INET, SOCK_STREAM, 0);
  TEST_REQUIRE(probe >= 0, "socket: %s", strerror(errno));
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = bid.addr_be;
  socklen_t len = sizeof(sa);
  TEST_REQUIRE(bind(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
                   getsockname(probe, (struct sockaddr *)&sa, &len) == 0,
               "bind: %s", strerror(errno));
  close(probe);
  bid.port_be = sa.sin_port;
  memcpy(id.internal, &bid, sizeof(bid));
  tw_bootstrap_t *bs = NULL;
  tw_peer_info_t self = make_self(0);
  double t0 = tw_test_now();
  TEST_TW_FAILS(tw_bootstrap_init(&bs, &id, 0, 2, 500, &self), TW_ERR_TIMEOUT, "could not connect");
  double elapsed = tw_test_now() - t0;
  TEST_ASSERT(elapsed >= 0.45 && elapsed < 1.5, "no root: gave up after %.3f s (timeout 0.5 s)",
              elapsed);
  TEST_ASSERT(bs == NULL, "bs set on failure");
}

/* TW_BOOTSTRAP_ADDR picks the root's address; a bad value is named. */
static void test_addr_knob(int in_process) {
  setenv("TW_BOOTSTRAP_ADDR", "127.0.0.1", 1);
  tw_unique_id_t id;
  TEST_TW_OK(tw_bootstrap_create_root(&id));
  tw_bootstrap_id_t bid;
  memcpy(&bid, id.internal, sizeof(bid));
  TEST_ASSERT(bid.addr_be == htonl(INADDR_LOOPBACK) && bid.port_be != 0,
              "TW_BOOTSTRAP_ADDR=127.0.0.1: the id holds %08x:%u", ntohl(bid.addr_be),
              ntohs(bid.port_be));
  if (!in_process) {
    flow_arg fa = {2, 10000, 0};
    run_procs("flow at 127.0.0.1", &id, 2, flow_body, &fa);
  }
  setenv("TW_BOOTSTRAP_ADDR", "localhost", 1);
  TEST_TW_FAILS(tw_bootstrap_create_root(&id), TW_ERR_INVALID_ARGUMENT, "TW_BOOTSTRAP_ADDR");
  setenv("TW_BOOTSTRAP_ADDR", "127.0.0.1:99999", 1);
  TEST_TW_FAILS(tw_bootstrap_create_root(&id), TW_ERR_INVALID_ARGUMENT, "port");
  unsetenv("TW_BOOTSTRAP_ADDR");
}

/* ---- failures across processes ------------------------------------------ */

typedef struct fail_case {
  int ranks[8];  /* the rank each process claims */
  int worlds[8]; /* the world each process claims */
  int timeout_ms;
  int bad_nonce_index; /* this process brings an id with another nonce (-1: none) */
  tw_status_t expect[8];
  const char *needle[8];
  double max_s; /* each process must be done within this */
} fail_case;

static int fail_body(const tw_unique_id_t *id, int index, void *arg) {
  const fail_case *fc = arg;
  tw_unique_id_t my_id = *id;
  if (index == fc->bad_nonce_index) {
    tw_bootstrap_id_t bid;
    memcpy(&bid, my_id.internal, sizeof(bid));
    bid.nonce ^= 0x1234;
    memcpy(my_id.internal, &bid, sizeof(bid));
  }
  tw_bootstrap_t *bs = NULL;
  tw_peer_info_t self = make_self(fc->ranks[index]);
  double t0 = tw_test_now();
  tw_status_t st =
      tw_bootstrap_init(&bs, &my_id, fc->ranks[index], fc->worlds[index], fc->timeout_ms, &self);
  double elapsed = tw_test_now() - t0;
  TEST_TW_FAILS(st, fc->expect[index], fc->needle[index]);
  TEST_ASSERT(elapsed < fc->max_s, "process %d failed after %.3f s, expected < %.1f s", index,
              elapsed, fc->max_s);
  TEST_ASSERT(bs == NULL, "bs set on failure");
  if (getenv("TW_TEST_VERBOSE"))
    printf("  process %d: %s\n", index, tw_last_error());
  tw_bootstrap_destroy(bs);
  return 0;
}

static void run_fail_case(const char *name, int nprocs, const fail_case *fc) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_bootstrap_create_root(&id));
  double t0 = tw_test_now();
  run_procs(name, &id, nprocs, fail_body, (void *)fc);
  printf("%s: %.3f s\n", name, tw_test_now() - t0);
}

static void test_missing_rank(void) {
  /* world 3, rank 2 never starts. */
  fail_case fc = {.ranks = {0, 1},
                  .worlds = {3, 3},
                  .timeout_ms = 1500,
                  .bad_nonce_index = -1,
                  .expect = {TW_ERR_TIMEOUT, TW_ERR_TIMEOUT},
                  .needle = {"rank 2 of 3 never arrived within 1500 ms",
                             "rank 2 of 3 never arrived within 1500 ms"},
                  .max_s = 3.0};
  run_fail_case("missing rank", 2, &fc);
  /* Two missing ranks are both named. */
  fail_case fc2 = {.ranks = {1, 3},
                   .worlds = {4, 4},
                   .timeout_ms = 800,
                   .bad_nonce_index = -1,
                   .expect = {TW_ERR_TIMEOUT, TW_ERR_TIMEOUT},
                   .needle = {"ranks 0, 2 of 4 never arrived", "ranks 0, 2 of 4 never arrived"},
                   .max_s = 1.6};
  run_fail_case("missing ranks", 2, &fc2);
}

static void test_world_mismatch(void) {
  fail_case fc = {.ranks = {0, 1},
                  .worlds = {3, 2},
                  .timeout_ms = 5000,
                  .bad_nonce_index = -1,
                  .expect = {TW_ERR_REMOTE, TW_ERR_REMOTE},
                  .needle = {"world mismatch", "world mismatch"},
                  .max_s = 2.0};
  run_fail_case("world mismatch", 2, &fc);
}

static void test_wrong_nonce(void) {
  /* Process 1 holds a stale id: it is turned away at once; rank 0 waits for
   * the real rank 1, which never comes. */
  fail_case fc = {.ranks = {0, 1},
                  .worlds = {2, 2},
                  .timeout_ms = 1000,
                  .bad_nonce_index = 1,
                  .expect = {TW_ERR_TIMEOUT, TW_ERR_REMOTE},
                  .needle = {"rank 1 of 2 never arrived", "nonce"},
                  .max_s = 2.0};
  run_fail_case("wrong nonce", 2, &fc);
}

static void test_duplicate_rank(void) {
  fail_case fc = {.ranks = {0, 1, 1},
                  .worlds = {3, 3, 3},
                  .timeout_ms = 5000,
                  .bad_nonce_index = -1,
                  .expect = {TW_ERR_REMOTE, TW_ERR_REMOTE, TW_ERR_REMOTE},
                  .needle = {"rank 1 joined twice", "rank 1 joined twice", "rank 1 joined twice"},
                  .max_s = 2.0};
  run_fail_case("duplicate rank", 3, &fc);
}

/* ---- collective and fd failures after a good init ------------------------ */

typedef enum after_init {
  MISMATCHED_COLLECTIVE, /* rank 2 calls barrier while the others allgather */
  SILENT_RANK,           /* rank 2 skips the barrier, then lingers */
  WRONG_TAG,             /* rank 1 uses tag 7 where rank 0 uses 8 */
  MISSING_FD,            /* rank 0 waits for an fd rank 1 never sends */
} after_init;

typedef struct after_arg {
  after_init what;
  int world;
  int timeout_ms;
} after_arg;

static int after_body(const tw_unique_id_t *id, int rank, void *arg) {
  const after_arg *aa = arg;
  tw_bootstrap_t *bs = NULL;
  tw_peer_info_t self = make_self(rank);
  tw_status_t st = tw_bootstrap_init(&bs, id, rank, aa->world, aa->timeout_ms, &self);
  TEST_TW_OK(st);
  if (st != TW_SUCCESS)
    return 1;
  const double limit_s = 2.0 * aa->timeout_ms / 1000.0 + 0.5;
  double t0 = tw_test_now();
  if (aa->what == MISMATCHED_COLLECTIVE) {
    uint64_t data[8] = {0};
    st = rank == 2 ? tw_bootstrap_barrier(bs) : tw_bootstrap_allgather(bs, data, sizeof(data[0]));
    TEST_ASSERT(st != TW_SUCCESS && strstr(tw_last_error(), "rank 2 called barrier"),
                "rank %d: mismatched collective -> %s (%s)", rank, tw_status_string(st),
                tw_last_error());
    TEST_TW_FAILS(tw_bootstrap_barrier(bs), st, "unusable after an earlier failed collective");
  } else if (aa->what == SILENT_RANK) {
    if (rank == 2) {
      struct timespec ts = {0, 0};
      ts.tv_sec = (time_t)(limit_s + 0.5);
      nanosleep(&ts, NULL);
    } else {
      TEST_TW_FAILS(tw_bootstrap_barrier(bs), TW_ERR_TIMEOUT, "rank 2 did not answer");
    }
  } else if (aa->what == WRONG_TAG) {
    int my_fd = make_fd_with(rank);
    uint8_t other[2] = {rank != 0, rank != 1};
    int fds[2];
    TEST_TW_FAILS(tw_bootstrap_exchange_fds(bs, my_fd, other, other, rank == 0 ? 8 : 7, fds),
                  TW_ERR_INTERNAL, "tag");
    TEST_ASSERT(fds[0] == -1 && fds[1] == -1, "rank %d: fds left after a failed exchange", rank);
    close(my_fd);
  } else if (aa->what == MISSING_FD) {
    int my_fd = make_fd_with(rank);
    uint8_t none[2] = {0, 0}, from1[2] = {0, 1};
    int fds[2];
    if (rank == 0)
      TEST_TW_FAILS(tw_bootstrap_exchange_fds(bs, my_fd, none, from1, 9, fds), TW_ERR_TIMEOUT,
                    "rank 1 sent no fd");
    else
      TEST_TW_OK(tw_bootstrap_exchange_fds(bs, my_fd, none, none, 9, fds));
    close(my_fd);
  }
  double elapsed = tw_test_now() - t0;
  TEST_ASSERT(aa->what == SILENT_RANK && rank == 2 ? 1 : elapsed < limit_s,
              "rank %d gave up after %.3f s, limit %.1f s", rank, elapsed, limit_s);
  if (getenv("TW_TEST_VERBOSE"))
    printf("  rank %d: %s\n", rank, tw_last_error());
  /* Keep the connections open until every rank has seen its failure. */
  if (aa->what == MISSING_FD && rank == 1) {
    struct timespec ts = {0, 0};
    ts.tv_sec = (time_t)(limit_s + 0.5);
    nanosleep(&ts, NULL);
  }
  tw_bootstrap_destroy(bs);
  return 0;
}

static void run_after_case(const char *name, after_init what, int world, int timeout_ms) {
  tw_unique_id_t id;
  TEST_TW_OK(tw_bootstrap_create_root(&id));
  after_arg aa = {what, world, timeout_ms};
  double t0 = tw_test_now();
  run_procs(name, &id, world, after_body, &aa);
  printf("%s: %.3f s\n", name, tw_test_now() - t0);
}

int main(int argc, char **argv) {
  int in_process = argc > 1 && strcmp(argv[1], "--in-process") == 0;
  double t0 = tw_test_now();
  test_host_hash();
  test_arguments();
  test_world1();
  test_no_root();
  test_addr_knob(in_process);
  test_flow_threads(4);
  if (!in_process) {
    const int worlds[] = {1, 2, 3, 4, 8};
    for (size_t i = 0; i < sizeof(worlds) / sizeof(worlds[0]); i++)
      test_flow_procs(worlds[i], 10000, 0);
    test_flow_procs(3, 1500, 700);
    test_missing_rank();
    test_world_mismatch();
    test_wrong_nonce();
    test_duplicate_rank();
    run_after_case("mismatched collective", MISMATCHED_COLLECTIVE, 3, 3000);
    run_after_case("silent rank", SILENT_RANK, 3, 1000);
    run_after_case("wrong fd tag", WRONG_TAG, 2, 3000);
    run_after_case("missing fd", MISSING_FD, 2, 800);
  }
  double total = tw_test_now() - t0;
  printf("total %.3f s\n", total);
  TEST_ASSERT(total < 30.0, "the whole test took %.1f s, budget 30 s", total);
  return tw_test_finish();
}
