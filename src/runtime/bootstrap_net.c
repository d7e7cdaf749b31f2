/* The bootstrap's clocks, polling I/O, frames and TCP sockets (bootstrap_impl.h). */
#include "runtime/bootstrap_impl.h"

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

/* ---- small helpers ----------------------------------------------------- */

int64_t bs_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t bs_deadline_after_ms(int64_t ms) { return bs_now_ns() + ms * 1000000; }

/* Milliseconds left until deadline, rounded up, 0 once it has passed. */
int bs_remaining_ms(int64_t deadline) {
  int64_t left = deadline - bs_now_ns();
  if (left <= 0)
    return 0;
  left = (left + 999999) / 1000000;
  return left > INT_MAX ? INT_MAX : (int)left;
}

/* How much longer a rank waits for an answer than the one who answers waits
 * for others, so that the answer (which names the culprit) arrives first. */
int64_t bs_grace_ms(int timeout_ms) { return (int64_t)timeout_ms / 2 + 500; }

void bs_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL); /* an early wake-up (EINTR) only shortens a retry delay */
}

void bs_close_fd(int *fd) {
  if (*fd >= 0)
    close(*fd);
  *fd = -1;
}

void bs_format_addr(char *out, size_t cap, uint32_t addr_be, uint16_t port_be) {
  char ip[INET_ADDRSTRLEN] = "?";
  struct in_addr in = {.s_addr = addr_be};
  inet_ntop(AF_INET, &in, ip, sizeof(ip));
  snprintf(out, cap, "%s:%u", ip, (unsigned)ntohs(port_be));
}

/* "rank 2" or "ranks 2, 5, 7": the ranks whose flag is set. */
void bs_format_ranks(char *out, size_t cap, const uint8_t *flags, int world) {
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

const char *bs_kind_name(int kind) {
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

uint64_t bs_random_nonce(void) {
  uint64_t nonce = 0;
  ssize_t n;
  do {
    n = getrandom(&nonce, sizeof(nonce), GRND_NONBLOCK);
  } while (n < 0 && errno == EINTR);
  if (n != (ssize_t)sizeof(nonce)) {
    /* Entropy pool not ready (early boot): uniqueness, not secrecy, is what matters. */
    nonce =
        splitmix64((uint64_t)bs_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&n);
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
int bs_poll_one(int fd, short events, int64_t deadline) {
  for (;;) {
    struct pollfd pfd = {.fd = fd, .events = events, .revents = 0};
    int n = poll(&pfd, 1, bs_remaining_ms(deadline));
    if (n > 0)
      return 1;
    if (n == 0) {
      if (bs_remaining_ms(deadline) == 0)
        return 0;
      continue;
    }
    if (errno != EINTR)
      return -1;
  }
}

/* Sends or receives exactly len bytes on a non-blocking socket before deadline.
 * `peer` names the other end in messages ("rank 0 (the star hub)"). */
tw_status_t bs_io_full(int fd, void *buf, size_t len, int writing, int64_t deadline,
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
      int ready = bs_poll_one(fd, writing ? POLLOUT : POLLIN, deadline);
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

void bs_init_frame(bs_frame_t *f, uint64_t nonce, int kind, int rank) {
  memset(f, 0, sizeof(*f));
  f->magic = FRAME_MAGIC;
  f->nonce = nonce;
  f->kind = kind;
  f->rank = rank;
}

/* Best effort: tells the other end why this side gave up. Keeps this thread's
 * last-error message (the one being sent) intact. */
void bs_send_error_frame(int fd, uint64_t nonce, int kind, int rank, uint32_t seq,
                         tw_status_t status, const char *msg, int64_t deadline) {
  char saved[TW_ERRMSG_LEN];
  tw_error_copy(saved);
  size_t len = strnlen(msg, TW_ERRMSG_LEN - 1);
  bs_frame_t f;
  bs_init_frame(&f, nonce, kind, rank);
  f.status = status;
  f.seq = seq;
  f.bytes = len;
  if (bs_io_full(fd, &f, sizeof(f), 1, deadline, "a peer") == TW_SUCCESS)
    (void)bs_io_full(fd, (void *)msg, len, 1, deadline, "a peer");
  tw_fail(TW_SUCCESS, "%s", saved);
}

/*
 * Reads one frame from `peer`. A frame carrying an error becomes that failure,
 * with the sender's message (which names itself) as the message: TW_ERR_TIMEOUT
 * stays a timeout, anything else becomes TW_ERR_REMOTE. The kind is checked
 * only on frames that carry no error.
 */
tw_status_t bs_recv_frame(int fd, uint64_t nonce, int kind, int64_t deadline, const char *peer,
                          bs_frame_t *f) {
  tw_status_t st = bs_io_full(fd, f, sizeof(*f), 0, deadline, peer);
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
    st = bs_io_full(fd, msg, (size_t)f->bytes, 0, deadline, peer);
    if (st != TW_SUCCESS)
      return st;
    msg[f->bytes] = '\0';
    return tw_fail(f->status == TW_ERR_TIMEOUT ? TW_ERR_TIMEOUT : TW_ERR_REMOTE, "%s", msg);
  }
  if (f->kind != kind)
    return tw_fail(TW_ERR_INTERNAL, "%s sent a %s (kind %d) where a %s was expected", peer,
                   bs_kind_name(f->kind), f->kind, bs_kind_name(kind));
  return TW_SUCCESS;
}

/* ---- TCP ---------------------------------------------------------------- */

tw_status_t bs_tcp_listen(uint32_t addr_be, uint16_t port_be, int *fd_out, uint16_t *port_out) {
  tw_status_t st = TW_SUCCESS;
  char where[48];
  bs_format_addr(where, sizeof(where), addr_be, port_be);
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
  bs_close_fd(&fd);
  return st;
}

static int connect_retryable(int err) {
  return err == ECONNREFUSED || err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH ||
         err == ECONNRESET || err == ECONNABORTED || err == EAGAIN || err == EADDRNOTAVAIL;
}

tw_status_t bs_set_nodelay(int fd, const char *peer) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0)
    return tw_fail(TW_ERR_SYSTEM, "setsockopt(TCP_NODELAY) on the connection to %s: %s", peer,
                   strerror(errno));
  return TW_SUCCESS;
}

/* Connects to addr:port, retrying refused or unreachable attempts until deadline. */
tw_status_t bs_tcp_connect(uint32_t addr_be, uint16_t port_be, int64_t deadline, const char *peer,
                           int *fd_out) {
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
        int ready = bs_poll_one(fd, POLLOUT, deadline);
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
      tw_status_t st = bs_set_nodelay(fd, peer);
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
    int left = bs_remaining_ms(deadline);
    if (left == 0)
      break;
    bs_sleep_ms(backoff_ms < left ? backoff_ms : left);
    backoff_ms = backoff_ms * 2 < 200 ? backoff_ms * 2 : 200;
  }
  return tw_fail(TW_ERR_TIMEOUT, "could not connect to %s in time (last error: %s)", peer,
                 strerror(last_err));
}

/* accept4 that skips transient failures: returns an fd, or -1 with errno EAGAIN
 * when nothing is waiting, or -1 with another errno on a real failure. */
int bs_accept_one(int listen_fd) {
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
