/* The bootstrap's file-descriptor exchange over unix sockets (bootstrap_impl.h). */
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

/* ---- fd exchange ---------------------------------------------------------- */

/* Connects to rank dst's fd socket and sends fd with a header. The message
 * waits in dst's accept queue: no need for dst to be receiving yet. */
static tw_status_t fd_send(tw_bootstrap_t *bs, int dst, int fd, uint64_t tag, int64_t deadline) {
  tw_status_t st = TW_SUCCESS;
  struct sockaddr_un sa;
  socklen_t salen = bs_unix_name(&sa, bs->nonce, dst);
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
      int left = bs_remaining_ms(deadline);
      if (left == 0)
        TW_FAIL(TW_ERR_TIMEOUT, "rank %d's fd socket @%s stayed full (not receiving?)", dst,
                sa.sun_path + 1);
      bs_sleep_ms(left < 2 ? left : 2);
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
  bs_init_frame(&f, bs->nonce, KIND_FD, bs->rank);
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
      int ready = bs_poll_one(sock, POLLOUT, deadline);
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
  bs_close_fd(&sock);
  return TW_SUCCESS;
fail:
  bs_close_fd(&sock);
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
  bs_close_fd(&bs->fd_pending[i]);
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
  int64_t deadline = bs_deadline_after_ms(bs->timeout_ms);
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
      int conn = bs_accept_one(bs->unix_fd);
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
    if (bs_remaining_ms(deadline) == 0) {
      uint8_t late[TW_MAX_WORLD] = {0};
      for (int r = 0; r < world; r++)
        late[r] = needed[r] && fds_out[r] < 0;
      char list[512];
      bs_format_ranks(list, sizeof(list), late, world);
      TW_FAIL(TW_ERR_TIMEOUT, "fd exchange with tag %#llx: %s sent no fd within %d ms",
              (unsigned long long)tag, list, bs->timeout_ms);
    }
    struct pollfd pfds[1 + FD_PENDING_MAX];
    int npfds = 0;
    for (int i = 0; i < bs->fd_npending; i++)
      pfds[npfds++] = (struct pollfd){.fd = bs->fd_pending[i], .events = POLLIN};
    if (bs->fd_npending < FD_PENDING_MAX)
      pfds[npfds++] = (struct pollfd){.fd = bs->unix_fd, .events = POLLIN};
    int n = poll(pfds, (nfds_t)npfds, bs_remaining_ms(deadline));
    if (n < 0 && errno != EINTR)
      TW_FAIL(TW_ERR_SYSTEM, "poll on the fd socket: %s", strerror(errno));
  }
  return TW_SUCCESS;
fail:
  if (fds_out)
    for (int r = 0; r < world; r++)
      bs_close_fd(&fds_out[r]);
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
