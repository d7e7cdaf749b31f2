/*
 * Bootstrap between processes (contract in bootstrap.h).
 *
 * Three kinds of socket:
 *  - rendezvous: each rank sends a hello to the root thread (made by
 *    tw_bootstrap_create_root) and gets back the table of every rank's info and
 *    listening address, or an error naming what went wrong;
 *  - star: every rank but 0 holds one TCP connection to rank 0, which gathers
 *    and broadcasts the small host collectives;
 *  - fd passing: one abstract unix SOCK_SEQPACKET listener per rank, named from
 *    the group nonce and the rank. A sender connects, sends one message with the
 *    fd attached and closes; the message waits in the receiver's accept queue,
 *    so "everyone sends, then everyone receives" cannot deadlock.
 *
 * Every socket is non-blocking and every wait is a poll() against a
 * CLOCK_MONOTONIC deadline. Wire structs are fixed-size and in host byte order
 * (the ranks of one group share an architecture; the magic catches a mismatch),
 * except IPv4 addresses and ports, which are in network order.
 */
#include "runtime/bootstrap.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "core/env.h"
#include "core/log.h"
#include "core/status.h"

#define HELLO_MAGIC 0x4f4c4c4548575454ULL /* "TTWHELLO": a rank's hello to the root */
#define FRAME_MAGIC 0x454d415246575454ULL /* "TTWFRAME": every other message */

#define LISTEN_BACKLOG 256
/* A connection to the root that sends no complete hello in this long is dropped. */
#define ROOT_HELLO_MS 10000
/* Bound on the root's replies (each a few KiB to a rank that is waiting for it). */
#define ROOT_SEND_MS 5000
/* The root waits at least this long for the first rank (the id may travel slowly). */
#define ROOT_IDLE_MIN_MS (10 * 60 * 1000)
#define ROOT_PENDING_MAX (2 * TW_MAX_WORLD)
/* Accepted fd-passing connections whose message has not been read yet. */
#define FD_PENDING_MAX (4 * TW_MAX_WORLD)
/* Messages of a later fd exchange that arrived during an earlier one. */
#define FD_STASH_MAX (4 * TW_MAX_WORLD)
/* Most fds one received message may carry before it is reported as malformed. */
#define FD_MAX_PER_MSG 8

_Static_assert(sizeof(tw_bootstrap_id_t) <= TW_UNIQUE_ID_BYTES, "tw_bootstrap_id_t too big");

/* A rank's hello to the root. */
typedef struct rdv_hello {
  uint64_t magic; /* HELLO_MAGIC */
  uint64_t nonce;
  int32_t rank;
  int32_t world;
  int32_t timeout_ms;
  int32_t reserved;
  uint32_t listen_addr_be;
  uint16_t listen_port_be;
  uint16_t reserved2;
  tw_peer_info_t info;
} rdv_hello_t;
_Static_assert(sizeof(rdv_hello_t) == 32 + 8 + sizeof(tw_peer_info_t),
               "rdv_hello_t has implicit padding");

/* One row of the table the root sends to every rank. */
typedef struct rdv_entry {
  tw_peer_info_t info;
  uint32_t listen_addr_be;
  uint16_t listen_port_be;
  uint16_t reserved;
} rdv_entry_t;
_Static_assert(sizeof(rdv_entry_t) == sizeof(tw_peer_info_t) + 8,
               "rdv_entry_t has implicit padding");

typedef enum frame_kind {
  KIND_RDV_REPLY = 1, /* root -> rank: the table (or an error) */
  KIND_STAR_HELLO,    /* rank -> rank 0 */
  KIND_STAR_ACK,      /* rank 0 -> rank: the star is complete (or an error) */
  KIND_ALLGATHER,     /* rank -> rank 0: bytes per rank, then this rank's slot */
  KIND_BARRIER,       /* rank -> rank 0 */
  KIND_COLL_REPLY,    /* rank 0 -> rank: world * bytes (or an error) */
  KIND_FD             /* over a unix socket, with one fd attached */
} frame_kind;

/*
 * Header of every message but the hello. A frame whose status is not
 * TW_SUCCESS is followed by `bytes` bytes of error message (no NUL) and
 * replaces whatever the receiver waited for.
 */
typedef struct bs_frame {
  uint64_t magic; /* FRAME_MAGIC */
  uint64_t nonce; /* the group's */
  int32_t kind;   /* frame_kind */
  int32_t status; /* tw_status_t */
  int32_t rank;   /* sender; -1 for the root */
  uint32_t seq;   /* collective sequence number */
  uint64_t bytes; /* payload that follows; per-rank bytes in a collective request */
  uint64_t tag;   /* fd exchange tag */
} bs_frame_t;
_Static_assert(sizeof(bs_frame_t) == 48, "bs_frame_t has implicit padding");

typedef struct fd_stash_entry {
  uint64_t tag;
  int src;
  int fd;
} fd_stash_entry_t;

struct tw_bootstrap {
  int rank;
  int world;
  int timeout_ms;
  uint64_t nonce;
  tw_peer_info_t *peers; /* [world] */
  rdv_entry_t *table;    /* [world]: infos and TCP listening addresses */
  /* This rank's TCP listener (world > 1). Only rank 0's is connected to (by the
   * star); the others stay open so any rank's advertised address stays live. */
  int listen_fd;
  /* Rank 0: star_fd[r] for r in 1..world-1. Other ranks: star_fd[0]. */
  int star_fd[TW_MAX_WORLD];
  int unix_fd; /* abstract unix listener for fd passing (world > 1) */
  uint32_t coll_seq;
  /* A failed collective leaves the star's byte streams out of step: later
   * collectives fail at once with the first failure's message. */
  tw_status_t broken;
  char broken_msg[TW_ERRMSG_LEN];
  int fd_pending[FD_PENDING_MAX];
  int fd_npending;
  fd_stash_entry_t stash[FD_STASH_MAX];
  int nstash;
};

/* ---- small helpers ----------------------------------------------------- */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t deadline_after_ms(int64_t ms) { return now_ns() + ms * 1000000; }

/* Milliseconds left until deadline, rounded up, 0 once it has passed. */
static int remaining_ms(int64_t deadline) {
  int64_t left = deadline - now_ns();
  if (left <= 0)
    return 0;
  left = (left + 999999) / 1000000;
  return left > INT_MAX ? INT_MAX : (int)left;
}

/* How much longer a rank waits for an answer than the one who answers waits
 * for others, so that the answer (which names the culprit) arrives first. */
static int64_t grace_ms(int timeout_ms) { return (int64_t)timeout_ms / 2 + 500; }

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL); /* an early wake-up (EINTR) only shortens a retry delay */
}

static void close_fd(int *fd) {
  if (*fd >= 0)
    close(*fd);
  *fd = -1;
}

static void format_addr(char *out, size_t cap, uint32_t addr_be, uint16_t port_be) {
  char ip[INET_ADDRSTRLEN] = "?";
  struct in_addr in = {.s_addr = addr_be};
  inet_ntop(AF_INET, &in, ip, sizeof(ip));
  snprintf(out, cap, "%s:%u", ip, (unsigned)ntohs(port_be));
}

/* "rank 2" or "ranks 2, 5, 7": the ranks whose flag is set. */
static void format_ranks(char *out, size_t cap, const uint8_t *flags, int world) {
  int count = 0;
  for (int r = 0; r < world; r++)
    count += flags[r] != 0;
  size_t used = (size_t)snprintf(out, cap, "%s", count == 1 ? "rank" : "ranks");
  int first = 1;
  for (int r = 0; r < world && used < cap; r++) {
    if (!flags[r])
      continue;
    used += (size_t)snprintf(out + used, cap - used, "%s %d", first ? "" : ",", r);
    first = 0;
  }
}

static const char *kind_name(int kind) {
  switch (kind) {
  case KIND_RDV_REPLY: return "rendezvous reply";
  case KIND_STAR_HELLO: return "star hello";
  case KIND_STAR_ACK: return "star ack";
  case KIND_ALLGATHER: return "allgather";
  case KIND_BARRIER: return "barrier";
  case KIND_COLL_REPLY: return "collective reply";
  case KIND_FD: return "fd message";
  }
  return "unknown";
}

static uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static uint64_t random_nonce(void) {
  uint64_t nonce = 0;
  ssize_t n;
  do {
    n = getrandom(&nonce, sizeof(nonce), GRND_NONBLOCK);
  } while (n < 0 && errno == EINTR);
  if (n != (ssize_t)sizeof(nonce)) {
    /* Entropy pool not ready (early boot): uniqueness, not secrecy, is what matters. */
    nonce = splitmix64((uint64_t)now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&n);
  }
  return nonce ? nonce : 1;
}

static uint64_t fnv1a(uint64_t hash, const char *text) {
  for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
    hash ^= *p;
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

uint64_t tw_host_hash(char *hostname_out, size_t len) {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0)
    snprintf(host, sizeof(host), "unknown-host");
  /* Containers may share a hostname across machines, and a machine keeps its
   * name across reboots: the boot id tells both apart. */
  char boot_id[64] = {0};
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t n;
    do {
      n = read(fd, boot_id, sizeof(boot_id) - 1);
    } while (n < 0 && errno == EINTR);
    boot_id[n > 0 ? n : 0] = '\0';
    close(fd);
    boot_id[strcspn(boot_id, "\n")] = '\0';
  }
  uint64_t hash = fnv1a(0xcbf29ce484222325ULL, host);
  hash = fnv1a(hash, "\n");
  hash = fnv1a(hash, boot_id);
  if (hostname_out && len > 0)
    snprintf(hostname_out, len, "%s", host);
  return hash;
}

/* ---- polling I/O -------------------------------------------------------- */

/* 1: fd is ready (or in error: the next call reports it), 0: deadline passed,
 * -1: poll failed (errno set). */
static int poll_one(int fd, short events, int64_t deadline) {
  for (;;) {
    struct pollfd pfd = {.fd = fd, .events = events, .revents = 0};
    int n = poll(&pfd, 1, remaining_ms(deadline));
    if (n > 0)
      return 1;
    if (n == 0) {
      if (remaining_ms(deadline) == 0)
        return 0;
      continue;
    }
    if (errno != EINTR)
      return -1;
  }
}

/* Sends or receives exactly len bytes on a non-blocking socket before deadline.
 * `peer` names the other end in messages ("rank 0 (the star hub)"). */
static tw_status_t io_full(int fd, void *buf, size_t len, int writing, int64_t deadline,
                           const char *peer) {
  char *p = buf;
  size_t done = 0;
  while (done < len) {
    ssize_t n =
        writing ? send(fd, p + done, len - done, MSG_NOSIGNAL) : recv(fd, p + done, len - done, 0);
    if (n > 0) {
      done += (size_t)n;
      continue;
    }
    if (n == 0 && !writing)
      return tw_fail(TW_ERR_REMOTE, "%s closed the connection (%zu of %zu bytes received)", peer,
                     done, len);
    int err = n < 0 ? errno : EAGAIN;
    if (err == EINTR)
      continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      int ready = poll_one(fd, writing ? POLLOUT : POLLIN, deadline);
      if (ready > 0)
        continue;
      if (ready == 0)
        return tw_fail(TW_ERR_TIMEOUT, "timed out %s %s (%zu of %zu bytes done)",
                       writing ? "sending to" : "waiting for", peer, done, len);
      return tw_fail(TW_ERR_SYSTEM, "poll on the connection to %s: %s", peer, strerror(errno));
    }
    if (err == EPIPE || err == ECONNRESET)
      return tw_fail(TW_ERR_REMOTE, "%s closed the connection (%s)", peer, strerror(err));
    return tw_fail(TW_ERR_SYSTEM, "%s %s: %s", writing ? "send to" : "recv from", peer,
                   strerror(err));
  }
  return TW_SUCCESS;
}

static void init_frame(bs_frame_t *f, uint64_t nonce, int kind, int rank) {
  memset(f, 0, sizeof(*f));
  f->magic = FRAME_MAGIC;
  f->nonce = nonce;
  f->kind = kind;
  f->rank = rank;
}

/* Best effort: tells the other end why this side gave up. Keeps this thread's
 * last-error message (the one being sent) intact. */
static void send_error_frame(int fd, uint64_t nonce, int kind, int rank, uint32_t seq,
                             tw_status_t status, const char *msg, int64_t deadline) {
  char saved[TW_ERRMSG_LEN];
  tw_error_copy(saved);
  size_t len = strnlen(msg, TW_ERRMSG_LEN - 1);
  bs_frame_t f;
  init_frame(&f, nonce, kind, rank);
  f.status = status;
  f.seq = seq;
  f.bytes = len;
  if (io_full(fd, &f, sizeof(f), 1, deadline, "a peer") == TW_SUCCESS)
    (void)io_full(fd, (void *)msg, len, 1, deadline, "a peer");
  tw_fail(TW_SUCCESS, "%s", saved);
}

/*
 * Reads one frame from `peer`. A frame carrying an error becomes that failure,
 * with the sender's message (which names itself) as the message: TW_ERR_TIMEOUT
 * stays a timeout, anything else becomes TW_ERR_REMOTE. The kind is checked
 * only on frames that carry no error.
 */
static tw_status_t recv_frame(int fd, uint64_t nonce, int kind, int64_t deadline, const char *peer,
                              bs_frame_t *f) {
  tw_status_t st = io_full(fd, f, sizeof(*f), 0, deadline, peer);
  if (st != TW_SUCCESS)
    return st;
  if (f->magic != FRAME_MAGIC || f->nonce != nonce)
    return tw_fail(TW_ERR_INTERNAL,
                   "%s sent a malformed frame (magic %#llx, nonce %016llx; expected %#llx, "
                   "%016llx)",
                   peer, (unsigned long long)f->magic, (unsigned long long)f->nonce,
                   (unsigned long long)FRAME_MAGIC, (unsigned long long)nonce);
  if (f->status != TW_SUCCESS) {
    char msg[TW_ERRMSG_LEN];
    if (f->bytes >= sizeof(msg))
      return tw_fail(TW_ERR_INTERNAL, "%s reported a failure (status %d) with a %llu-byte message",
                     peer, f->status, (unsigned long long)f->bytes);
    st = io_full(fd, msg, (size_t)f->bytes, 0, deadline, peer);
    if (st != TW_SUCCESS)
      return st;
    msg[f->bytes] = '\0';
    return tw_fail(f->status == TW_ERR_TIMEOUT ? TW_ERR_TIMEOUT : TW_ERR_REMOTE, "%s", msg);
  }
  if (f->kind != kind)
    return tw_fail(TW_ERR_INTERNAL, "%s sent a %s (kind %d) where a %s was expected", peer,
                   kind_name(f->kind), f->kind, kind_name(kind));
  return TW_SUCCESS;
}

/* ---- TCP ---------------------------------------------------------------- */

static tw_status_t tcp_listen(uint32_t addr_be, uint16_t port_be, int *fd_out, uint16_t *port_out) {
  tw_status_t st = TW_SUCCESS;
  char where[48];
  format_addr(where, sizeof(where), addr_be, port_be);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    TW_FAIL(TW_ERR_SYSTEM, "socket(AF_INET) for a listener at %s: %s", where, strerror(errno));
  int one = 1;
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "setsockopt(SO_REUSEADDR) on the listener at %s: %s", where,
            strerror(errno));
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = addr_be;
  sa.sin_port = port_be;
  if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "bind to %s: %s", where, strerror(errno));
  if (listen(fd, LISTEN_BACKLOG) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "listen on %s: %s", where, strerror(errno));
  socklen_t len = sizeof(sa);
  if (getsockname(fd, (struct sockaddr *)&sa, &len) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "getsockname of the listener at %s: %s", where, strerror(errno));
  *fd_out = fd;
  if (port_out)
    *port_out = sa.sin_port;
  return TW_SUCCESS;
fail:
  close_fd(&fd);
  return st;
}

static int connect_retryable(int err) {
  return err == ECONNREFUSED || err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH ||
         err == ECONNRESET || err == ECONNABORTED || err == EAGAIN || err == EADDRNOTAVAIL;
}

static tw_status_t set_nodelay(int fd, const char *peer) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0)
    return tw_fail(TW_ERR_SYSTEM, "setsockopt(TCP_NODELAY) on the connection to %s: %s", peer,
                   strerror(errno));
  return TW_SUCCESS;
}

/* Connects to addr:port, retrying refused or unreachable attempts until deadline. */
static tw_status_t tcp_connect(uint32_t addr_be, uint16_t port_be, int64_t deadline,
                               const char *peer, int *fd_out) {
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = addr_be;
  sa.sin_port = port_be;
  int backoff_ms = 5;
  int last_err = ETIMEDOUT;
  *fd_out = -1;
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return tw_fail(TW_ERR_SYSTEM, "socket(AF_INET) to reach %s: %s", peer, strerror(errno));
    int err = 0;
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
      err = errno;
      if (err == EINPROGRESS || err == EINTR) {
        int ready = poll_one(fd, POLLOUT, deadline);
        if (ready < 0) {
          err = errno;
          close(fd);
          return tw_fail(TW_ERR_SYSTEM, "poll while connecting to %s: %s", peer, strerror(err));
        }
        socklen_t len = sizeof(err);
        if (ready == 0) {
          err = ETIMEDOUT;
        } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
          err = errno;
          close(fd);
          return tw_fail(TW_ERR_SYSTEM, "getsockopt(SO_ERROR) while connecting to %s: %s", peer,
                         strerror(err));
        }
      }
    }
    if (err == 0) {
      tw_status_t st = set_nodelay(fd, peer);
      if (st != TW_SUCCESS) {
        close(fd);
        return st;
      }
      *fd_out = fd;
      return TW_SUCCESS;
    }
    close(fd);
    if (err != ETIMEDOUT || last_err == ETIMEDOUT)
      last_err = err;
    if (!connect_retryable(err))
      return tw_fail(TW_ERR_SYSTEM, "connect to %s: %s", peer, strerror(err));
    int left = remaining_ms(deadline);
    if (left == 0)
      break;
    sleep_ms(backoff_ms < left ? backoff_ms : left);
    backoff_ms = backoff_ms * 2 < 200 ? backoff_ms * 2 : 200;
  }
  return tw_fail(TW_ERR_TIMEOUT, "could not connect to %s in time (last error: %s)", peer,
                 strerror(last_err));
}

/* accept4 that skips transient failures: returns an fd, or -1 with errno EAGAIN
 * when nothing is waiting, or -1 with another errno on a real failure. */
static int accept_one(int listen_fd) {
  for (;;) {
    int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0)
      return fd;
    if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO)
      continue;
    if (errno == EWOULDBLOCK)
      errno = EAGAIN;
    return -1;
  }
}

/* ---- the root ----------------------------------------------------------- */

typedef struct root_pending {
  int fd;
  size_t got;
  int64_t since;
  rdv_hello_t hello;
} root_pending_t;

typedef struct root_state {
  int listen_fd;
  uint64_t nonce;
  char addr[48];
  int64_t idle_ms; /* how long the root waits for the first rank */
  int64_t idle_deadline;
  int started; /* a hello with the right nonce has arrived */
  int world;   /* 0 until a valid first hello */
  int first_rank;
  int timeout_ms;
  int64_t deadline; /* first arrival + that rank's timeout */
  int arrived;
  int rank_fd[TW_MAX_WORLD];
  rdv_entry_t table[TW_MAX_WORLD];
  tw_status_t failed; /* the group is broken: every rank gets `failure` */
  char failure[TW_ERRMSG_LEN];
  root_pending_t pending[ROOT_PENDING_MAX];
  int npending;
} root_state_t;

/* `nonce` is the one the rank brought: it reads the answer only under that. */
static void root_send_error(int fd, uint64_t nonce, tw_status_t status, const char *msg) {
  send_error_frame(fd, nonce, KIND_RDV_REPLY, -1, 0, status, msg, deadline_after_ms(ROOT_SEND_MS));
}

/* Marks the group as failed and tells every rank that has arrived. Ranks that
 * arrive later (until the deadline) get the same message. */
static void root_poison(root_state_t *rs, tw_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void root_poison(root_state_t *rs, tw_status_t status, const char *fmt, ...) {
  if (rs->failed != TW_SUCCESS)
    return;
  char what[TW_ERRMSG_LEN - 80];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof(what), fmt, ap);
  va_end(ap);
  rs->failed = status;
  snprintf(rs->failure, sizeof(rs->failure), "bootstrap root at %s: %s", rs->addr, what);
  TW_INFO("%s", rs->failure); /* every rank reports it as its failure */
  for (int r = 0; r < TW_MAX_WORLD; r++) {
    if (rs->rank_fd[r] < 0)
      continue;
    root_send_error(rs->rank_fd[r], rs->nonce, status, rs->failure);
    close_fd(&rs->rank_fd[r]);
  }
}

/* Takes ownership of p->fd. */
static void root_handle_hello(root_state_t *rs, root_pending_t *p) {
  const rdv_hello_t *h = &p->hello;
  int fd = p->fd;
  p->fd = -1;
  char host[sizeof(h->info.hostname) + 1];
  memcpy(host, h->info.hostname, sizeof(h->info.hostname));
  host[sizeof(h->info.hostname)] = '\0';
  if (h->magic != HELLO_MAGIC) {
    TW_WARN("bootstrap root at %s: dropping a connection that is not a tilewire rank (magic %#llx)",
            rs->addr, (unsigned long long)h->magic);
    close(fd);
    return;
  }
  if (h->nonce != rs->nonce) {
    /* Not this group's rank (a stale id, or a port reused by a new root): reject
     * it alone, the group may still complete. */
    char msg[TW_ERRMSG_LEN];
    snprintf(msg, sizeof(msg),
             "bootstrap root at %s serves nonce %016llx, but rank %d (pid %d on %s) brought an id "
             "with nonce %016llx: the id was made by another tw_get_unique_id call (or is stale)",
             rs->addr, (unsigned long long)rs->nonce, h->rank, h->info.pid, host,
             (unsigned long long)h->nonce);
    TW_WARN("%s", msg);
    root_send_error(fd, h->nonce, TW_ERR_REMOTE, msg);
    close(fd);
    return;
  }
  if (!rs->started) {
    rs->started = 1;
    rs->first_rank = h->rank;
    rs->timeout_ms = h->timeout_ms > 0 ? h->timeout_ms : 1;
    rs->deadline = deadline_after_ms(rs->timeout_ms);
    if (h->world >= 1 && h->world <= TW_MAX_WORLD)
      rs->world = h->world;
  }
  if (rs->failed == TW_SUCCESS) {
    if (rs->world == 0)
      root_poison(rs, TW_ERR_REMOTE, "rank %d (pid %d on %s) says world %d, outside [1, %d]",
                  h->rank, h->info.pid, host, h->world, TW_MAX_WORLD);
    else if (h->world != rs->world)
      root_poison(rs, TW_ERR_REMOTE,
                  "world mismatch: rank %d (pid %d on %s) says world %d, but rank %d (the first "
                  "to arrive) said %d",
                  h->rank, h->info.pid, host, h->world, rs->first_rank, rs->world);
    else if (h->rank < 0 || h->rank >= rs->world)
      root_poison(rs, TW_ERR_REMOTE, "rank %d (pid %d on %s) is outside [0, %d)", h->rank,
                  h->info.pid, host, rs->world);
    else if (rs->rank_fd[h->rank] >= 0)
      root_poison(rs, TW_ERR_REMOTE,
                  "rank %d joined twice (pid %d on %.64s, then pid %d on %s): two processes "
                  "were given the same rank",
                  h->rank, rs->table[h->rank].info.pid, rs->table[h->rank].info.hostname,
                  h->info.pid, host);
  }
  if (rs->failed != TW_SUCCESS) {
    root_send_error(fd, rs->nonce, rs->failed, rs->failure);
    close(fd);
    return;
  }
  rdv_entry_t *e = &rs->table[h->rank];
  memset(e, 0, sizeof(*e));
  e->info = h->info;
  e->info.rank = h->rank;
  e->listen_addr_be = h->listen_addr_be;
  e->listen_port_be = h->listen_port_be;
  rs->rank_fd[h->rank] = fd;
  rs->arrived++;
  TW_DEBUG("bootstrap root at %s: rank %d of %d arrived (pid %d on %s), %d so far", rs->addr,
           h->rank, rs->world, h->info.pid, host, rs->arrived);
}

static void root_send_table(root_state_t *rs) {
  bs_frame_t f;
  init_frame(&f, rs->nonce, KIND_RDV_REPLY, -1);
  f.bytes = (uint64_t)rs->world * sizeof(rdv_entry_t);
  int64_t deadline = deadline_after_ms(ROOT_SEND_MS);
  for (int r = 0; r < rs->world; r++) {
    tw_status_t st = io_full(rs->rank_fd[r], &f, sizeof(f), 1, deadline, "a rank");
    if (st == TW_SUCCESS)
      st = io_full(rs->rank_fd[r], rs->table, (size_t)f.bytes, 1, deadline, "a rank");
    if (st != TW_SUCCESS)
      TW_WARN("bootstrap root at %s: sending the table to rank %d failed: %s", rs->addr, r,
              tw_last_error());
  }
  TW_DEBUG("bootstrap root at %s: all %d ranks arrived; table sent", rs->addr, rs->world);
}

static void root_drop_pending(root_state_t *rs, int i) {
  close_fd(&rs->pending[i].fd);
  rs->pending[i] = rs->pending[--rs->npending];
}

/* Reads what a pending connection has sent; hands a complete hello on. */
static void root_read_pending(root_state_t *rs, int i) {
  root_pending_t *p = &rs->pending[i];
  for (;;) {
    ssize_t n = recv(p->fd, (char *)&p->hello + p->got, sizeof(p->hello) - p->got, 0);
    if (n > 0) {
      p->got += (size_t)n;
      if (p->got < sizeof(p->hello))
        continue;
      root_handle_hello(rs, p);
      rs->pending[i] = rs->pending[--rs->npending];
      return;
    }
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return;
    /* Closed or failed before a whole hello: not a rank we can answer. */
    TW_DEBUG("bootstrap root at %s: a connection closed after %zu of %zu hello bytes", rs->addr,
             p->got, sizeof(p->hello));
    root_drop_pending(rs, i);
    return;
  }
}

static void root_accept(root_state_t *rs) {
  while (rs->npending < ROOT_PENDING_MAX) {
    int fd = accept_one(rs->listen_fd);
    if (fd < 0) {
      if (errno != EAGAIN) {
        /* Out of fds or memory: back off instead of spinning on poll. */
        TW_WARN("bootstrap root at %s: accept: %s", rs->addr, strerror(errno));
        sleep_ms(10);
      }
      return;
    }
    root_pending_t *p = &rs->pending[rs->npending++];
    memset(p, 0, sizeof(*p));
    p->fd = fd;
    p->since = now_ns();
  }
}

static void *root_main(void *arg) {
  root_state_t *rs = arg;
  for (;;) {
    int64_t until = rs->started ? rs->deadline : rs->idle_deadline;
    int64_t now = now_ns();
    if (now >= until)
      break;
    int64_t wake = until;
    for (int i = rs->npending - 1; i >= 0; i--) {
      int64_t expiry = rs->pending[i].since + (int64_t)ROOT_HELLO_MS * 1000000;
      if (now >= expiry) {
        TW_DEBUG("bootstrap root at %s: dropping a connection that sent no hello", rs->addr);
        root_drop_pending(rs, i);
      } else if (expiry < wake) {
        wake = expiry;
      }
    }
    struct pollfd pfds[1 + ROOT_PENDING_MAX];
    int npfds = 0;
    for (int i = 0; i < rs->npending; i++)
      pfds[npfds++] = (struct pollfd){.fd = rs->pending[i].fd, .events = POLLIN};
    if (rs->npending < ROOT_PENDING_MAX)
      pfds[npfds++] = (struct pollfd){.fd = rs->listen_fd, .events = POLLIN};
    int n = poll(pfds, (nfds_t)npfds, remaining_ms(wake));
    if (n < 0) {
      if (errno == EINTR)
        continue;
      TW_WARN("bootstrap root at %s: poll: %s; the root exits", rs->addr, strerror(errno));
      break;
    }
    /* Pending connections first, from the back, so removals keep indices valid;
     * pfds[i] is pending[i] for i < the count at poll time. */
    int polled_pending = rs->npending;
    for (int i = polled_pending - 1; i >= 0; i--)
      if (pfds[i].revents)
        root_read_pending(rs, i);
    if (npfds > polled_pending && pfds[polled_pending].revents)
      root_accept(rs);
    if (rs->failed == TW_SUCCESS && rs->world > 0 && rs->arrived == rs->world) {
      root_send_table(rs);
      break;
    }
  }
  if (!rs->started) {
    TW_WARN("bootstrap root at %s: no rank arrived in %lld ms; the root exits", rs->addr,
            (long long)rs->idle_ms);
  } else if (rs->failed == TW_SUCCESS && rs->arrived < rs->world) {
    uint8_t missing[TW_MAX_WORLD] = {0};
    for (int r = 0; r < rs->world; r++)
      missing[r] = rs->rank_fd[r] < 0;
    char list[512];
    format_ranks(list, sizeof(list), missing, rs->world);
    root_poison(rs, TW_ERR_TIMEOUT, "%s of %d never arrived within %d ms", list, rs->world,
                rs->timeout_ms);
  }
  for (int r = 0; r < TW_MAX_WORLD; r++)
    close_fd(&rs->rank_fd[r]);
  while (rs->npending > 0)
    root_drop_pending(rs, rs->npending - 1);
  close_fd(&rs->listen_fd);
  free(rs);
  return NULL;
}

/* The root's address: TW_BOOTSTRAP_ADDR ("a.b.c.d" or "a.b.c.d:port"), else the
 * first up, non-loopback IPv4 interface, else 127.0.0.1. */
static tw_status_t root_address(uint32_t *addr_be, uint16_t *port_be) {
  const char *knob = tw_env_str(TW_BOOTSTRAP_ADDR_ID);
  *port_be = 0;
  if (knob && *knob) {
    char ip[64];
    const char *colon = strchr(knob, ':');
    size_t len = colon ? (size_t)(colon - knob) : strlen(knob);
    if (len >= sizeof(ip))
      return tw_fail(TW_ERR_INVALID_ARGUMENT, "TW_BOOTSTRAP_ADDR=\"%s\": not an IPv4 address",
                     knob);
    memcpy(ip, knob, len);
    ip[len] = '\0';
    struct in_addr in;
    if (inet_pton(AF_INET, ip, &in) != 1)
      return tw_fail(TW_ERR_INVALID_ARGUMENT,
                     "TW_BOOTSTRAP_ADDR=\"%s\": not an IPv4 address (expected a.b.c.d or "
                     "a.b.c.d:port)",
                     knob);
    if (colon) {
      char *end = NULL;
      errno = 0;
      long port = strtol(colon + 1, &end, 10);
      if (errno || end == colon + 1 || *end != '\0' || port < 0 || port > 65535)
        return tw_fail(TW_ERR_INVALID_ARGUMENT,
                       "TW_BOOTSTRAP_ADDR=\"%s\": the port is not a number in [0, 65535]", knob);
      *port_be = htons((uint16_t)port);
    }
    *addr_be = in.s_addr;
    return TW_SUCCESS;
  }
  *addr_be = htonl(INADDR_LOOPBACK);
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs) != 0) {
    TW_WARN("getifaddrs: %s; the bootstrap root listens on 127.0.0.1", strerror(errno));
    return TW_SUCCESS;
  }
  for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET)
      continue;
    if (!(i->ifa_flags & IFF_UP) || !(i->ifa_flags & IFF_RUNNING))
      continue;
    if (i->ifa_flags & IFF_LOOPBACK)
      continue;
    *addr_be = ((const struct sockaddr_in *)(const void *)i->ifa_addr)->sin_addr.s_addr;
    TW_DEBUG("bootstrap root: using interface %s", i->ifa_name);
    break;
  }
  freeifaddrs(ifs);
  return TW_SUCCESS;
}

tw_status_t tw_bootstrap_create_root(tw_unique_id_t *id) {
  TW_ARG_CHECK(id != NULL, "id: NULL");
  tw_status_t st = TW_SUCCESS;
  root_state_t *rs = NULL;
  int listen_fd = -1;
  uint32_t addr_be = 0;
  uint16_t port_be = 0;
  TW_CHECK(root_address(&addr_be, &port_be));
  TW_CHECK(tcp_listen(addr_be, port_be, &listen_fd, &port_be));

  rs = calloc(1, sizeof(*rs));
  if (!rs)
    TW_FAIL(TW_ERR_SYSTEM, "out of host memory for the bootstrap root (%zu bytes)", sizeof(*rs));
  rs->listen_fd = listen_fd;
  rs->nonce = random_nonce();
  format_addr(rs->addr, sizeof(rs->addr), addr_be, port_be);
  rs->idle_ms = 2 * tw_env_int(TW_BOOTSTRAP_TIMEOUT_MS_ID);
  if (rs->idle_ms < ROOT_IDLE_MIN_MS)
    rs->idle_ms = ROOT_IDLE_MIN_MS;
  rs->idle_deadline = deadline_after_ms(rs->idle_ms);
  for (int r = 0; r < TW_MAX_WORLD; r++)
    rs->rank_fd[r] = -1;

  tw_bootstrap_id_t bid;
  memset(&bid, 0, sizeof(bid));
  bid.magic = TW_BOOTSTRAP_ID_MAGIC;
  bid.nonce = rs->nonce;
  bid.addr_be = addr_be;
  bid.port_be = port_be;
  uint64_t nonce = rs->nonce;
  char addr[48];
  memcpy(addr, rs->addr, sizeof(addr));

  /* The root thread takes no signals: they belong to the application's threads. */
  pthread_attr_t attr;
  int err = pthread_attr_init(&attr);
  if (err)
    TW_FAIL(TW_ERR_SYSTEM, "pthread_attr_init: %s", strerror(err));
  err = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (err) {
    pthread_attr_destroy(&attr);
    TW_FAIL(TW_ERR_SYSTEM, "pthread_attr_setdetachstate: %s", strerror(err));
  }
  sigset_t all, old;
  sigfillset(&all);
  err = pthread_sigmask(SIG_SETMASK, &all, &old);
  if (err) {
    pthread_attr_destroy(&attr);
    TW_FAIL(TW_ERR_SYSTEM, "pthread_sigmask: %s", strerror(err));
  }
  pthread_t thread;
  err = pthread_create(&thread, &attr, root_main, rs);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  if (err)
    TW_FAIL(TW_ERR_SYSTEM, "pthread_create for the bootstrap root: %s", strerror(err));
  /* rs and listen_fd now belong to the root thread. */

  memset(id, 0, sizeof(*id));
  memcpy(id->internal, &bid, sizeof(bid));
  TW_DEBUG("bootstrap root listening at %s (nonce %016llx)", addr, (unsigned long long)nonce);
  return TW_SUCCESS;
fail:
  free(rs);
  close_fd(&listen_fd);
  return st;
}

/* ---- fd-passing socket -------------------------------------------------- */

static socklen_t unix_name(struct sockaddr_un *sa, uint64_t nonce, int rank) {
  memset(sa, 0, sizeof(*sa));
  sa->sun_family = AF_UNIX;
  /* sun_path[0] == '\0': the abstract namespace, so nothing to unlink and no
   * file left behind by a crash. */
  int n = snprintf(sa->sun_path + 1, sizeof(sa->sun_path) - 1, "tilewire-%016llx-%d",
                   (unsigned long long)nonce, rank);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static tw_status_t unix_listen(tw_bootstrap_t *bs) {
  tw_status_t st = TW_SUCCESS;
  struct sockaddr_un sa;
  socklen_t len = unix_name(&sa, bs->nonce, bs->rank);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    TW_FAIL(TW_ERR_SYSTEM, "socket(AF_UNIX) for fd passing: %s", strerror(errno));
  if (bind(fd, (struct sockaddr *)&sa, len) != 0) {
    if (errno == EADDRINUSE)
      TW_FAIL(TW_ERR_SYSTEM,
              "bind to the abstract unix socket @%s: another process on this host already holds "
              "it (rank %d of this group started twice?)",
              sa.sun_path + 1, bs->rank);
    TW_FAIL(TW_ERR_SYSTEM, "bind to the abstract unix socket @%s: %s", sa.sun_path + 1,
            strerror(errno));
  }
  if (listen(fd, LISTEN_BACKLOG) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "listen on the abstract unix socket @%s: %s", sa.sun_path + 1,
            strerror(errno));
  bs->unix_fd = fd;
  return TW_SUCCESS;
fail:
  close_fd(&fd);
  return st;
}

/* ---- the star ------------------------------------------------------------ */

/* Rank 0: accepts one connection from every other rank, then acknowledges. */
static tw_status_t star_accept(tw_bootstrap_t *bs) {
  tw_status_t st = TW_SUCCESS;
  int64_t deadline = deadline_after_ms(bs->timeout_ms);
  int pend_fd[ROOT_PENDING_MAX];
  size_t pend_got[ROOT_PENDING_MAX];
  bs_frame_t pend_frame[ROOT_PENDING_MAX];
  int npend = 0;
  int connected = 1;
  while (connected < bs->world) {
    /* Checked before every poll: stray traffic must not keep us past the deadline. */
    if (remaining_ms(deadline) == 0) {
      uint8_t missing[TW_MAX_WORLD] = {0};
      for (int r = 1; r < bs->world; r++)
        missing[r] = bs->star_fd[r] < 0;
      char list[512];
      format_ranks(list, sizeof(list), missing, bs->world);
      TW_FAIL(TW_ERR_TIMEOUT, "%s did not connect to rank 0 within %d ms", list, bs->timeout_ms);
    }
    struct pollfd pfds[1 + ROOT_PENDING_MAX];
    int npfds = 0;
    for (int i = 0; i < npend; i++)
      pfds[npfds++] = (struct pollfd){.fd = pend_fd[i], .events = POLLIN};
    if (npend < ROOT_PENDING_MAX)
      pfds[npfds++] = (struct pollfd){.fd = bs->listen_fd, .events = POLLIN};
    int n = poll(pfds, (nfds_t)npfds, remaining_ms(deadline));
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      TW_FAIL(TW_ERR_SYSTEM, "poll for star connections: %s", strerror(errno));
    int polled = npend;
    for (int i = polled - 1; i >= 0; i--) {
      if (!pfds[i].revents)
        continue;
      ssize_t got = recv(pend_fd[i], (char *)&pend_frame[i] + pend_got[i],
                         sizeof(bs_frame_t) - pend_got[i], 0);
      if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
        continue;
      if (got > 0) {
        pend_got[i] += (size_t)got;
        if (pend_got[i] < sizeof(bs_frame_t))
          continue;
        const bs_frame_t *f = &pend_frame[i];
        if (f->magic != FRAME_MAGIC || f->nonce != bs->nonce || f->kind != KIND_STAR_HELLO) {
          TW_WARN("bootstrap rank 0: dropping a star connection with a foreign hello");
        } else if (f->rank < 1 || f->rank >= bs->world || bs->star_fd[f->rank] >= 0) {
          TW_FAIL(TW_ERR_INTERNAL, "star hello from rank %d: %s", f->rank,
                  f->rank < 1 || f->rank >= bs->world ? "outside [1, world)" : "connected twice");
        } else {
          bs->star_fd[f->rank] = pend_fd[i];
          pend_fd[i] = -1;
          connected++;
        }
      }
      /* Handed on to star_fd, foreign, or closed before a whole hello. */
      close_fd(&pend_fd[i]);
      npend--;
      pend_fd[i] = pend_fd[npend];
      pend_got[i] = pend_got[npend];
      pend_frame[i] = pend_frame[npend];
    }
    if (npfds > polled && pfds[polled].revents) {
      while (npend < ROOT_PENDING_MAX) {
        int fd = accept_one(bs->listen_fd);
        if (fd < 0) {
          if (errno != EAGAIN)
            TW_FAIL(TW_ERR_SYSTEM, "accept on the star listener: %s", strerror(errno));
          break;
        }
        st = set_nodelay(fd, "a star connection");
        if (st != TW_SUCCESS) {
          close(fd);
          goto fail;
        }
        pend_fd[npend] = fd;
        pend_got[npend] = 0;
        npend++;
      }
    }
  }
  bs_frame_t ack;
  init_frame(&ack, bs->nonce, KIND_STAR_ACK, 0);
  for (int r = 1; r < bs->world; r++) {
    char peer[32];
    snprintf(peer, sizeof(peer), "rank %d", r);
    TW_CHECK(
        io_full(bs->star_fd[r], &ack, sizeof(ack), 1, deadline_after_ms(bs->timeout_ms), peer));
  }
  return TW_SUCCESS;
fail:
  for (int i = 0; i < npend; i++)
    close_fd(&pend_fd[i]);
  {
    char msg[TW_ERRMSG_LEN];
    snprintf(msg, sizeof(msg), "rank 0 could not complete the star: %s", tw_last_error());
    int64_t deadline_err = deadline_after_ms(1000);
    for (int r = 1; r < bs->world; r++)
      if (bs->star_fd[r] >= 0)
        send_error_frame(bs->star_fd[r], bs->nonce, KIND_STAR_ACK, 0, 0, st, msg, deadline_err);
  }
  return st;
}

/* A send to rank 0 failed because it closed the connection. It may have said
 * why just before (an error frame waiting in our receive buffer): prefer that. */
static tw_status_t explain_closed(const tw_bootstrap_t *bs, int kind, tw_status_t st) {
  if (st != TW_ERR_REMOTE)
    return st;
  char saved[TW_ERRMSG_LEN];
  tw_error_copy(saved);
  bs_frame_t f;
  memset(&f, 0, sizeof(f));
  tw_status_t why =
      recv_frame(bs->star_fd[0], bs->nonce, kind, deadline_after_ms(100), "rank 0", &f);
  if (why != TW_SUCCESS && f.magic == FRAME_MAGIC && f.status != TW_SUCCESS)
    return why;
  tw_fail(st, "%s", saved);
  return st;
}

/* Ranks 1..world-1: connect to rank 0 and wait for its acknowledgement. */
static tw_status_t star_connect(tw_bootstrap_t *bs) {
  tw_status_t st = TW_SUCCESS;
  int64_t deadline = deadline_after_ms(bs->timeout_ms);
  char peer[96], where[48];
  format_addr(where, sizeof(where), bs->table[0].listen_addr_be, bs->table[0].listen_port_be);
  snprintf(peer, sizeof(peer), "rank 0 (star hub at %s)", where);
  TW_CHECK(tcp_connect(bs->table[0].listen_addr_be, bs->table[0].listen_port_be, deadline, peer,
                       &bs->star_fd[0]));
  bs_frame_t f;
  init_frame(&f, bs->nonce, KIND_STAR_HELLO, bs->rank);
  st = io_full(bs->star_fd[0], &f, sizeof(f), 1, deadline, peer);
  if (st != TW_SUCCESS)
    TW_CHECK(explain_closed(bs, KIND_STAR_ACK, st));
  TW_CHECK(recv_frame(bs->star_fd[0], bs->nonce, KIND_STAR_ACK,
                      deadline + grace_ms(bs->timeout_ms) * 1000000, peer, &f));
  return TW_SUCCESS;
fail:
  return st;
}

/* ---- init / destroy ------------------------------------------------------ */

static tw_bootstrap_t *bootstrap_alloc(int rank, int world, int timeout_ms, uint64_t nonce) {
  tw_bootstrap_t *bs = calloc(1, sizeof(*bs));
  if (!bs)
    return NULL;
  bs->rank = rank;
  bs->world = world;
  bs->timeout_ms = timeout_ms;
  bs->nonce = nonce;
  bs->listen_fd = -1;
  bs->unix_fd = -1;
  for (int r = 0; r < TW_MAX_WORLD; r++)
    bs->star_fd[r] = -1;
  bs->peers = calloc((size_t)world, sizeof(*bs->peers));
  bs->table = calloc((size_t)world, sizeof(*bs->table));
  if (!bs->peers || !bs->table) {
    free(bs->peers);
    free(bs->table);
    free(bs);
    return NULL;
  }
  return bs;
}

/* Sends this rank's hello to the root and reads the table back into bs. */
static tw_status_t rendezvous(tw_bootstrap_t *bs, const tw_bootstrap_id_t *bid,
                              const tw_peer_info_t *self, int64_t deadline) {
  tw_status_t st = TW_SUCCESS;
  int root_fd = -1;
  char where[48], peer[96];
  format_addr(where, sizeof(where), bid->addr_be, bid->port_be);
  snprintf(peer, sizeof(peer), "the bootstrap root at %s", where);
  TW_CHECK(tcp_connect(bid->addr_be, bid->port_be, deadline, peer, &root_fd));

  /* Listen on the interface that reaches the root: the others reach us through it too. */
  struct sockaddr_in local;
  socklen_t len = sizeof(local);
  if (getsockname(root_fd, (struct sockaddr *)&local, &len) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "getsockname of the connection to %s: %s", peer, strerror(errno));
  uint16_t listen_port_be = 0;
  if (bs->world > 1)
    TW_CHECK(tcp_listen(local.sin_addr.s_addr, 0, &bs->listen_fd, &listen_port_be));

  rdv_hello_t hello;
  memset(&hello, 0, sizeof(hello));
  hello.magic = HELLO_MAGIC;
  hello.nonce = bid->nonce;
  hello.rank = bs->rank;
  hello.world = bs->world;
  hello.timeout_ms = bs->timeout_ms;
  hello.listen_addr_be = bs->world > 1 ? local.sin_addr.s_addr : 0;
  hello.listen_port_be = listen_port_be;
  hello.info = *self;
  TW_CHECK(io_full(root_fd, &hello, sizeof(hello), 1, deadline, peer));

  /* The root's deadline starts at the first arrival, a little after ours. */
  bs_frame_t f;
  TW_CHECK(recv_frame(root_fd, bid->nonce, KIND_RDV_REPLY,
                      deadline + grace_ms(bs->timeout_ms) * 1000000, peer, &f));
  if (f.bytes != (uint64_t)bs->world * sizeof(rdv_entry_t))
    TW_FAIL(TW_ERR_INTERNAL, "%s sent a %llu-byte table; expected %d entries of %zu bytes", peer,
            (unsigned long long)f.bytes, bs->world, sizeof(rdv_entry_t));
  TW_CHECK(io_full(root_fd, bs->table, (size_t)f.bytes, 0, deadline_after_ms(ROOT_SEND_MS), peer));
  for (int r = 0; r < bs->world; r++) {
    if (bs->table[r].info.rank != r)
      TW_FAIL(TW_ERR_INTERNAL, "%s sent a table whose entry %d is rank %d", peer, r,
              bs->table[r].info.rank);
    bs->peers[r] = bs->table[r].info;
  }
  close_fd(&root_fd);
  return TW_SUCCESS;
fail:
  close_fd(&root_fd);
  return st;
}

tw_status_t tw_bootstrap_init(tw_bootstrap_t **bs_out, const tw_unique_id_t *id, int rank,
                              int world, int timeout_ms, tw_peer_info_t *self) {
  TW_ARG_CHECK(bs_out != NULL, "bs: NULL");
  *bs_out = NULL;
  TW_ARG_CHECK(id != NULL, "id: NULL");
  TW_ARG_CHECK(self != NULL, "self: NULL");
  TW_ARG_CHECK(world >= 1 && world <= TW_MAX_WORLD, "world: %d is outside [1, %d]", world,
               TW_MAX_WORLD);
  TW_ARG_CHECK(rank >= 0 && rank < world, "rank: %d is outside [0, %d)", rank, world);
  TW_ARG_CHECK(timeout_ms > 0, "timeout_ms: %d, expected > 0", timeout_ms);
  TW_ARG_CHECK(self->rank == rank, "self->rank: %d, but rank is %d", self->rank, rank);
  tw_bootstrap_id_t bid;
  memcpy(&bid, id->internal, sizeof(bid));
  TW_ARG_CHECK(bid.magic == TW_BOOTSTRAP_ID_MAGIC,
               "id: not made by tw_get_unique_id (magic %#llx, expected %#llx)",
               (unsigned long long)bid.magic, (unsigned long long)TW_BOOTSTRAP_ID_MAGIC);

  tw_status_t st = TW_SUCCESS;
  int64_t deadline = deadline_after_ms(timeout_ms);
  tw_bootstrap_t *bs = bootstrap_alloc(rank, world, timeout_ms, bid.nonce);
  if (!bs)
    TW_FAIL(TW_ERR_SYSTEM, "out of host memory for the bootstrap of %d ranks", world);
  memset(self->hostname, 0, sizeof(self->hostname));
  self->host_hash = tw_host_hash(self->hostname, sizeof(self->hostname));

  TW_CHECK(rendezvous(bs, &bid, self, deadline));
  if (world > 1) {
    /* The fd socket exists before the star completes, so once any rank's init
     * returns, every rank's fd socket accepts connections. */
    TW_CHECK(unix_listen(bs));
    TW_CHECK(rank == 0 ? star_accept(bs) : star_connect(bs));
  }
  TW_DEBUG("bootstrap rank %d of %d ready (nonce %016llx)", rank, world,
           (unsigned long long)bs->nonce);
  *bs_out = bs;
  return TW_SUCCESS;
fail:
  tw_error_prefix("bootstrap init, rank %d of %d", rank, world);
  tw_bootstrap_destroy(bs);
  return st;
}

const tw_peer_info_t *tw_bootstrap_peers(const tw_bootstrap_t *bs) { return bs ? bs->peers : NULL; }

void tw_bootstrap_destroy(tw_bootstrap_t *bs) {
  if (!bs)
    return;
  for (int i = 0; i < bs->nstash; i++)
    close_fd(&bs->stash[i].fd);
  for (int i = 0; i < bs->fd_npending; i++)
    close_fd(&bs->fd_pending[i]);
  close_fd(&bs->unix_fd);
  for (int r = 0; r < TW_MAX_WORLD; r++)
    close_fd(&bs->star_fd[r]);
  close_fd(&bs->listen_fd);
  free(bs->table);
  free(bs->peers);
  free(bs);
}

/* ---- collectives over the star ------------------------------------------ */

/* Rank 0: gathers every rank's slot into data, then sends data to all. */
static tw_status_t star_gather_bcast(tw_bootstrap_t *bs, int kind, char *data, size_t bytes,
                                     uint32_t seq, const char *what) {
  tw_status_t st = TW_SUCCESS;
  const int world = bs->world;
  const size_t header = sizeof(bs_frame_t);
  size_t got[TW_MAX_WORLD] = {0};
  bs_frame_t req[TW_MAX_WORLD];
  uint8_t done[TW_MAX_WORLD] = {0};
  uint8_t replied[TW_MAX_WORLD] = {0};
  int ndone = 1;
  done[0] = 1;
  int64_t deadline = deadline_after_ms(bs->timeout_ms);
  while (ndone < world) {
    if (remaining_ms(deadline) == 0) {
      uint8_t missing[TW_MAX_WORLD];
      for (int r = 0; r < world; r++)
        missing[r] = !done[r];
      char list[512];
      format_ranks(list, sizeof(list), missing, world);
      TW_FAIL(TW_ERR_TIMEOUT, "%s: %s did not answer rank 0 within %d ms", what, list,
              bs->timeout_ms);
    }
    struct pollfd pfds[TW_MAX_WORLD];
    int who[TW_MAX_WORLD];
    int npfds = 0;
    for (int r = 1; r < world; r++) {
      if (done[r])
        continue;
      who[npfds] = r;
      pfds[npfds++] = (struct pollfd){.fd = bs->star_fd[r], .events = POLLIN};
    }
    int n = poll(pfds, (nfds_t)npfds, remaining_ms(deadline));
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      TW_FAIL(TW_ERR_SYSTEM, "%s: poll: %s", what, strerror(errno));
    for (int i = 0; i < npfds; i++) {
      if (!pfds[i].revents)
        continue;
      int r = who[i];
      char *dst;
      size_t want;
      if (got[r] < header) {
        dst = (char *)&req[r] + got[r];
        want = header - got[r];
      } else {
        dst = data + (size_t)r * bytes + (got[r] - header);
        want = header + bytes - got[r];
      }
      ssize_t nread = recv(bs->star_fd[r], dst, want, 0);
      if (nread < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
        continue;
      if (nread == 0 || (nread < 0 && errno == ECONNRESET))
        TW_FAIL(TW_ERR_REMOTE, "%s: rank %d closed its connection to rank 0 (exited?)", what, r);
      if (nread < 0)
        TW_FAIL(TW_ERR_SYSTEM, "%s: recv from rank %d: %s", what, r, strerror(errno));
      got[r] += (size_t)nread;
      if (got[r] == header) {
        const bs_frame_t *f = &req[r];
        if (f->magic != FRAME_MAGIC || f->nonce != bs->nonce || f->rank != r)
          TW_FAIL(TW_ERR_INTERNAL, "%s: malformed request from rank %d (magic %#llx, rank %d)",
                  what, r, (unsigned long long)f->magic, f->rank);
        if (f->kind != kind || f->seq != seq || f->bytes != bytes)
          TW_FAIL(TW_ERR_INTERNAL,
                  "%s: rank %d called %s #%u with %llu bytes per rank while rank 0 called %s #%u "
                  "with %zu: the ranks disagree on the order of collectives",
                  what, r, kind_name(f->kind), f->seq, (unsigned long long)f->bytes,
                  kind_name(kind), seq, bytes);
      }
      if (got[r] == header + bytes) {
        done[r] = 1;
        ndone++;
      }
    }
  }
  bs_frame_t reply;
  init_frame(&reply, bs->nonce, KIND_COLL_REPLY, 0);
  reply.seq = seq;
  reply.bytes = (uint64_t)world * bytes;
  deadline = deadline_after_ms(bs->timeout_ms);
  for (int r = 1; r < world; r++) {
    char peer[32];
    snprintf(peer, sizeof(peer), "rank %d", r);
    replied[r] = 1;
    TW_CHECK(io_full(bs->star_fd[r], &reply, sizeof(reply), 1, deadline, peer));
    TW_CHECK(io_full(bs->star_fd[r], data, (size_t)reply.bytes, 1, deadline, peer));
  }
  return TW_SUCCESS;
fail : {
  char msg[TW_ERRMSG_LEN];
  snprintf(msg, sizeof(msg), "rank 0 reports: %s", tw_last_error());
  int64_t deadline_err = deadline_after_ms(1000);
  for (int r = 1; r < world; r++)
    if (!replied[r])
      send_error_frame(bs->star_fd[r], bs->nonce, KIND_COLL_REPLY, 0, seq, st, msg, deadline_err);
}
  return st;
}

/* Ranks 1..world-1: send this rank's slot, receive everyone's. */
static tw_status_t star_send_recv(tw_bootstrap_t *bs, int kind, char *data, size_t bytes,
                                  uint32_t seq, const char *what) {
  tw_status_t st = TW_SUCCESS;
  int fd = bs->star_fd[0];
  int64_t deadline = deadline_after_ms(bs->timeout_ms);
  char peer[128];
  snprintf(peer, sizeof(peer), "rank 0 (the star hub) in %s", what);
  bs_frame_t f;
  init_frame(&f, bs->nonce, kind, bs->rank);
  f.seq = seq;
  f.bytes = bytes;
  st = io_full(fd, &f, sizeof(f), 1, deadline, peer);
  if (st == TW_SUCCESS)
    st = io_full(fd, data + (size_t)bs->rank * bytes, bytes, 1, deadline, peer);
  if (st != TW_SUCCESS)
    TW_CHECK(explain_closed(bs, KIND_COLL_REPLY, st));
  TW_CHECK(recv_frame(fd, bs->nonce, KIND_COLL_REPLY, deadline + grace_ms(bs->timeout_ms) * 1000000,
                      peer, &f));
  if (f.seq != seq || f.bytes != (uint64_t)bs->world * bytes)
    TW_FAIL(TW_ERR_INTERNAL, "%s: rank 0 replied to #%u with %llu bytes; expected #%u with %zu",
            what, f.seq, (unsigned long long)f.bytes, seq, (size_t)bs->world * bytes);
  TW_CHECK(
      io_full(fd, data, (size_t)f.bytes, 0, deadline + grace_ms(bs->timeout_ms) * 1000000, peer));
  return TW_SUCCESS;
fail:
  return st;
}

static tw_status_t star_collective(tw_bootstrap_t *bs, int kind, void *data, size_t bytes) {
  if (bs->broken != TW_SUCCESS)
    return tw_fail(bs->broken,
                   "bootstrap rank %d of %d: unusable after an earlier failed collective: %s",
                   bs->rank, bs->world, bs->broken_msg);
  uint32_t seq = ++bs->coll_seq;
  if (bs->world == 1)
    return TW_SUCCESS;
  char what[96];
  if (kind == KIND_ALLGATHER)
    snprintf(what, sizeof(what), "allgather #%u (%zu bytes per rank)", seq, bytes);
  else
    snprintf(what, sizeof(what), "barrier #%u", seq);
  tw_status_t st = bs->rank == 0 ? star_gather_bcast(bs, kind, data, bytes, seq, what)
                                 : star_send_recv(bs, kind, data, bytes, seq, what);
  if (st != TW_SUCCESS) {
    bs->broken = st;
    tw_error_copy(bs->broken_msg);
    tw_error_prefix("bootstrap rank %d of %d", bs->rank, bs->world);
  }
  return st;
}

tw_status_t tw_bootstrap_allgather(tw_bootstrap_t *bs, void *data, size_t bytes) {
  TW_ARG_CHECK(bs != NULL, "bs: NULL");
  TW_ARG_CHECK(data != NULL || bytes == 0, "data: NULL with bytes = %zu", bytes);
  TW_ARG_CHECK(bytes <= SIZE_MAX / (size_t)bs->world, "bytes: %zu times world %d overflows", bytes,
               bs->world);
  return star_collective(bs, KIND_ALLGATHER, data, bytes);
}

tw_status_t tw_bootstrap_barrier(tw_bootstrap_t *bs) {
  TW_ARG_CHECK(bs != NULL, "bs: NULL");
  return star_collective(bs, KIND_BARRIER, NULL, 0);
}

/* ---- fd exchange ---------------------------------------------------------- */

/* Connects to rank dst's fd socket and sends fd with a header. The message
 * waits in dst's accept queue: no need for dst to be receiving yet. */
static tw_status_t fd_send(tw_bootstrap_t *bs, int dst, int fd, uint64_t tag, int64_t deadline) {
  tw_status_t st = TW_SUCCESS;
  struct sockaddr_un sa;
  socklen_t salen = unix_name(&sa, bs->nonce, dst);
  int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (sock < 0)
    TW_FAIL(TW_ERR_SYSTEM, "socket(AF_UNIX) to send an fd to rank %d: %s", dst, strerror(errno));
  for (;;) {
    if (connect(sock, (struct sockaddr *)&sa, salen) == 0)
      break;
    int err = errno;
    if (err == EISCONN)
      break;
    if (err == EINTR)
      continue;
    if (err == EAGAIN || err == EINPROGRESS || err == EALREADY) {
      /* EAGAIN: dst's accept queue is full; it drains as dst receives. */
      int left = remaining_ms(deadline);
      if (left == 0)
        TW_FAIL(TW_ERR_TIMEOUT, "rank %d's fd socket @%s stayed full (not receiving?)", dst,
                sa.sun_path + 1);
      sleep_ms(left < 2 ? left : 2);
      continue;
    }
    if (err == ECONNREFUSED || err == ENOENT)
      TW_FAIL(TW_ERR_REMOTE,
              "rank %d's fd socket @%s refused the connection: has rank %d exited or destroyed its "
              "bootstrap?",
              dst, sa.sun_path + 1, dst);
    TW_FAIL(TW_ERR_SYSTEM, "connect to rank %d's fd socket @%s: %s", dst, sa.sun_path + 1,
            strerror(err));
  }
  bs_frame_t f;
  init_frame(&f, bs->nonce, KIND_FD, bs->rank);
  f.tag = tag;
  struct iovec iov = {.iov_base = &f, .iov_len = sizeof(f)};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } control;
  memset(&control, 0, sizeof(control));
  struct msghdr msg;
  memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.buf;
  msg.msg_controllen = sizeof(control.buf);
  struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  for (;;) {
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n == (ssize_t)sizeof(f))
      break;
    if (n >= 0)
      TW_FAIL(TW_ERR_INTERNAL, "sendmsg to rank %d sent %zd of %zu bytes of a seqpacket", dst, n,
              sizeof(f));
    int err = errno;
    if (err == EINTR)
      continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      int ready = poll_one(sock, POLLOUT, deadline);
      if (ready > 0)
        continue;
      if (ready == 0)
        TW_FAIL(TW_ERR_TIMEOUT, "sending an fd to rank %d: its socket stayed full", dst);
      TW_FAIL(TW_ERR_SYSTEM, "poll while sending an fd to rank %d: %s", dst, strerror(errno));
    }
    if (err == EPIPE || err == ECONNRESET)
      TW_FAIL(TW_ERR_REMOTE, "rank %d closed its fd socket while we sent an fd", dst);
    TW_FAIL(TW_ERR_SYSTEM, "sendmsg of an fd to rank %d: %s", dst, strerror(err));
  }
  /* Closing is safe: the message (and the fd in it) stays queued for dst. */
  close_fd(&sock);
  return TW_SUCCESS;
fail:
  close_fd(&sock);
  return st;
}

typedef enum fd_recv_result { FD_RECV_NONE, FD_RECV_GOT, FD_RECV_DROP } fd_recv_result;

/* Reads one message from an accepted fd connection. FD_RECV_NONE: nothing yet;
 * FD_RECV_DROP: closed or foreign (the caller closes conn); FD_RECV_GOT: *src,
 * *tag, *fd_out filled. A failure returns a status with *result unset. */
static tw_status_t fd_recv(tw_bootstrap_t *bs, int conn, fd_recv_result *result, int *src,
                           uint64_t *tag, int *fd_out) {
  bs_frame_t f;
  union {
    char buf[CMSG_SPACE(FD_MAX_PER_MSG * sizeof(int))];
    struct cmsghdr align;
  } control;
  struct iovec iov = {.iov_base = &f, .iov_len = sizeof(f)};
  struct msghdr msg;
  ssize_t n;
  for (;;) {
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.buf;
    msg.msg_controllen = sizeof(control.buf);
    n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    if (n >= 0 || errno != EINTR)
      break;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    *result = FD_RECV_NONE;
    return TW_SUCCESS;
  }
  if (n < 0 && errno == ECONNRESET) {
    *result = FD_RECV_DROP;
    return TW_SUCCESS;
  }
  if (n < 0)
    return tw_fail(TW_ERR_SYSTEM, "recvmsg on the fd socket: %s", strerror(errno));
  int fds[FD_MAX_PER_MSG];
  int nfds = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
      continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count && nfds < FD_MAX_PER_MSG; i++)
      memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
  }
  tw_status_t st = TW_SUCCESS;
  *result = FD_RECV_DROP;
  if (n == 0 && nfds == 0)
    return TW_SUCCESS; /* sender closed without a message */
  if ((size_t)n != sizeof(f) || (msg.msg_flags & MSG_TRUNC) || f.magic != FRAME_MAGIC ||
      f.nonce != bs->nonce || f.kind != KIND_FD) {
    TW_WARN("bootstrap rank %d: dropping a foreign message (%zd bytes) on the fd socket", bs->rank,
            n);
  } else if (msg.msg_flags & MSG_CTRUNC) {
    st = tw_fail(TW_ERR_SYSTEM,
                 "the fd from rank %d (tag %#llx) was cut off in transit: out of file descriptors "
                 "(RLIMIT_NOFILE)?",
                 f.rank, (unsigned long long)f.tag);
  } else if (f.rank < 0 || f.rank >= bs->world || f.rank == bs->rank) {
    st = tw_fail(TW_ERR_INTERNAL,
                 "an fd message (tag %#llx) names source rank %d: not a peer of "
                 "rank %d in [0, %d)",
                 (unsigned long long)f.tag, f.rank, bs->rank, bs->world);
  } else if (nfds != 1) {
    st = tw_fail(TW_ERR_INTERNAL, "rank %d sent %d fds with tag %#llx; expected exactly 1", f.rank,
                 nfds, (unsigned long long)f.tag);
  } else {
    *result = FD_RECV_GOT;
    *src = f.rank;
    *tag = f.tag;
    *fd_out = fds[0];
    return TW_SUCCESS;
  }
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  return st;
}

/*
 * Files one received fd: into fds_out if it is the one this exchange waits for
 * from src, into the stash if it belongs to a later exchange. Each sender's
 * messages reach us in the order it sent them (one accept queue), so a wrong
 * tag from a rank we still wait for means the ranks disagree on the exchanges.
 */
static tw_status_t fd_file(tw_bootstrap_t *bs, int src, uint64_t msg_tag, int fd, uint64_t tag,
                           const uint8_t *needed, int *fds_out, int *missing) {
  if (needed[src] && fds_out[src] < 0) {
    if (msg_tag != tag) {
      close(fd);
      return tw_fail(TW_ERR_INTERNAL,
                     "fd exchange with tag %#llx: rank %d sent tag %#llx instead: the ranks "
                     "disagree on the order or tags of fd exchanges",
                     (unsigned long long)tag, src, (unsigned long long)msg_tag);
    }
    fds_out[src] = fd;
    (*missing)--;
    return TW_SUCCESS;
  }
  if (bs->nstash == FD_STASH_MAX) {
    close(fd);
    return tw_fail(TW_ERR_INTERNAL,
                   "fd exchange with tag %#llx: %d unclaimed fds from other exchanges are queued "
                   "(latest: tag %#llx from rank %d); are ranks sending fds nobody receives?",
                   (unsigned long long)tag, FD_STASH_MAX, (unsigned long long)msg_tag, src);
  }
  bs->stash[bs->nstash++] = (fd_stash_entry_t){.tag = msg_tag, .src = src, .fd = fd};
  TW_DEBUG("bootstrap rank %d: holding an fd from rank %d with tag %#llx for a later exchange",
           bs->rank, src, (unsigned long long)msg_tag);
  return TW_SUCCESS;
}

/* Tries to read pending connection i. *removed: it was consumed (and closed). */
static tw_status_t fd_read_pending(tw_bootstrap_t *bs, int i, uint64_t tag, const uint8_t *needed,
                                   int *fds_out, int *missing, int *removed) {
  fd_recv_result result = FD_RECV_DROP;
  int src = -1, fd = -1;
  uint64_t msg_tag = 0;
  *removed = 0;
  tw_status_t st = fd_recv(bs, bs->fd_pending[i], &result, &src, &msg_tag, &fd);
  if (st == TW_SUCCESS && result == FD_RECV_NONE)
    return TW_SUCCESS;
  /* Keep accept order: it is each sender's sending order. */
  close_fd(&bs->fd_pending[i]);
  memmove(&bs->fd_pending[i], &bs->fd_pending[i + 1],
          (size_t)(bs->fd_npending - i - 1) * sizeof(int));
  bs->fd_npending--;
  *removed = 1;
  if (st != TW_SUCCESS || result != FD_RECV_GOT)
    return st;
  return fd_file(bs, src, msg_tag, fd, tag, needed, fds_out, missing);
}

static tw_status_t fd_exchange(tw_bootstrap_t *bs, int fd, const uint8_t *to_ranks,
                               const uint8_t *from_ranks, uint64_t tag, int *fds_out) {
  tw_status_t st = TW_SUCCESS;
  const int world = bs->world;
  int64_t deadline = deadline_after_ms(bs->timeout_ms);
  uint8_t needed[TW_MAX_WORLD] = {0};
  int missing = 0;
  for (int r = 0; r < world; r++) {
    needed[r] = from_ranks && from_ranks[r] && r != bs->rank;
    missing += needed[r];
  }
  for (int r = 0; r < world; r++)
    if (to_ranks && to_ranks[r] && r != bs->rank)
      TW_CHECK(fd_send(bs, r, fd, tag, deadline));

  /* Messages that arrived during earlier exchanges, in arrival order. */
  for (int i = 0; i < bs->nstash && missing > 0;) {
    fd_stash_entry_t e = bs->stash[i];
    if (!needed[e.src] || fds_out[e.src] >= 0) {
      i++;
      continue;
    }
    memmove(&bs->stash[i], &bs->stash[i + 1], (size_t)(bs->nstash - i - 1) * sizeof(e));
    bs->nstash--;
    TW_CHECK(fd_file(bs, e.src, e.tag, e.fd, tag, needed, fds_out, &missing));
  }
  while (missing > 0) {
    /* Accept everything queued, then try every pending connection oldest first.
     * A sender connects for its next message only after sending this one, so
     * whenever a newer connection of a sender is in the list, its older ones
     * already hold their messages: reading in list order keeps its order. */
    while (bs->fd_npending < FD_PENDING_MAX) {
      int conn = accept_one(bs->unix_fd);
      if (conn < 0) {
        if (errno != EAGAIN)
          TW_FAIL(TW_ERR_SYSTEM, "accept on the fd socket: %s", strerror(errno));
        break;
      }
      bs->fd_pending[bs->fd_npending++] = conn;
    }
    for (int i = 0; i < bs->fd_npending && missing > 0;) {
      int removed = 0;
      TW_CHECK(fd_read_pending(bs, i, tag, needed, fds_out, &missing, &removed));
      if (!removed)
        i++;
    }
    if (missing == 0)
      break;
    if (remaining_ms(deadline) == 0) {
      uint8_t late[TW_MAX_WORLD] = {0};
      for (int r = 0; r < world; r++)
        late[r] = needed[r] && fds_out[r] < 0;
      char list[512];
      format_ranks(list, sizeof(list), late, world);
      TW_FAIL(TW_ERR_TIMEOUT, "fd exchange with tag %#llx: %s sent no fd within %d ms",
              (unsigned long long)tag, list, bs->timeout_ms);
    }
    struct pollfd pfds[1 + FD_PENDING_MAX];
    int npfds = 0;
    for (int i = 0; i < bs->fd_npending; i++)
      pfds[npfds++] = (struct pollfd){.fd = bs->fd_pending[i], .events = POLLIN};
    if (bs->fd_npending < FD_PENDING_MAX)
      pfds[npfds++] = (struct pollfd){.fd = bs->unix_fd, .events = POLLIN};
    int n = poll(pfds, (nfds_t)npfds, remaining_ms(deadline));
    if (n < 0 && errno != EINTR)
      TW_FAIL(TW_ERR_SYSTEM, "poll on the fd socket: %s", strerror(errno));
  }
  return TW_SUCCESS;
fail:
  if (fds_out)
    for (int r = 0; r < world; r++)
      close_fd(&fds_out[r]);
  return st;
}

tw_status_t tw_bootstrap_exchange_fds(tw_bootstrap_t *bs, int fd, const uint8_t *to_ranks,
                                      const uint8_t *from_ranks, uint64_t tag, int *fds_out) {
  TW_ARG_CHECK(bs != NULL, "bs: NULL");
  int sends = 0, receives = 0;
  for (int r = 0; r < bs->world; r++) {
    sends += to_ranks && to_ranks[r] && r != bs->rank;
    receives += from_ranks && from_ranks[r] && r != bs->rank;
  }
  TW_ARG_CHECK(fd >= 0 || sends == 0, "fd: %d, but to_ranks names %d peers", fd, sends);
  TW_ARG_CHECK(fds_out != NULL || receives == 0, "fds_out: NULL, but from_ranks names %d peers",
               receives);
  if (fds_out)
    for (int r = 0; r < bs->world; r++)
      fds_out[r] = -1;
  if (sends == 0 && receives == 0)
    return TW_SUCCESS;
  tw_status_t st = fd_exchange(bs, fd, to_ranks, from_ranks, tag, fds_out);
  if (st != TW_SUCCESS)
    tw_error_prefix("bootstrap rank %d of %d", bs->rank, bs->world);
  return st;
}
