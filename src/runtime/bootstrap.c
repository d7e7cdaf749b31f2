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

/* ---- fd-passing socket -------------------------------------------------- */

socklen_t bs_unix_name(struct sockaddr_un *sa, uint64_t nonce, int rank) {
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
  socklen_t len = bs_unix_name(&sa, bs->nonce, bs->rank);
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
  bs_close_fd(&fd);
  return st;
}

/* ---- the star ------------------------------------------------------------ */

/* Rank 0: accepts one connection from every other rank, then acknowledges. */
static tw_status_t star_accept(tw_bootstrap_t *bs) {
  tw_status_t st = TW_SUCCESS;
  int64_t deadline = bs_deadline_after_ms(bs->timeout_ms);
  int pend_fd[ROOT_PENDING_MAX];
  size_t pend_got[ROOT_PENDING_MAX];
  bs_frame_t pend_frame[ROOT_PENDING_MAX];
  int npend = 0;
  int connected = 1;
  while (connected < bs->world) {
    /* Checked before every poll: stray traffic must not keep us past the deadline. */
    if (bs_remaining_ms(deadline) == 0) {
      uint8_t missing[TW_MAX_WORLD] = {0};
      for (int r = 1; r < bs->world; r++)
        missing[r] = bs->star_fd[r] < 0;
      char list[512];
      bs_format_ranks(list, sizeof(list), missing, bs->world);
      TW_FAIL(TW_ERR_TIMEOUT, "%s did not connect to rank 0 within %d ms", list, bs->timeout_ms);
    }
    struct pollfd pfds[1 + ROOT_PENDING_MAX];
    int npfds = 0;
    for (int i = 0; i < npend; i++)
      pfds[npfds++] = (struct pollfd){.fd = pend_fd[i], .events = POLLIN};
    if (npend < ROOT_PENDING_MAX)
      pfds[npfds++] = (struct pollfd){.fd = bs->listen_fd, .events = POLLIN};
    int n = poll(pfds, (nfds_t)npfds, bs_remaining_ms(deadline));
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
      bs_close_fd(&pend_fd[i]);
      npend--;
      pend_fd[i] = pend_fd[npend];
      pend_got[i] = pend_got[npend];
      pend_frame[i] = pend_frame[npend];
    }
    if (npfds > polled && pfds[polled].revents) {
      while (npend < ROOT_PENDING_MAX) {
        int fd = bs_accept_one(bs->listen_fd);
        if (fd < 0) {
          if (errno != EAGAIN)
            TW_FAIL(TW_ERR_SYSTEM, "accept on the star listener: %s", strerror(errno));
          break;
        }
        st = bs_set_nodelay(fd, "a star connection");
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
  bs_init_frame(&ack, bs->nonce, KIND_STAR_ACK, 0);
  for (int r = 1; r < bs->world; r++) {
    char peer[32];
    snprintf(peer, sizeof(peer), "rank %d", r);
    TW_CHECK(bs_io_full(bs->star_fd[r], &ack, sizeof(ack), 1, bs_deadline_after_ms(bs->timeout_ms),
                        peer));
  }
  return TW_SUCCESS;
fail:
  for (int i = 0; i < npend; i++)
    bs_close_fd(&pend_fd[i]);
  {
    char msg[TW_ERRMSG_LEN];
    snprintf(msg, sizeof(msg), "rank 0 could not complete the star: %s", tw_last_error());
    int64_t deadline_err = bs_deadline_after_ms(1000);
    for (int r = 1; r < bs->world; r++)
      if (bs->star_fd[r] >= 0)
        bs_send_error_frame(bs->star_fd[r], bs->nonce, KIND_STAR_ACK, 0, 0, st, msg, deadline_err);
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
      bs_recv_frame(bs->star_fd[0], bs->nonce, kind, bs_deadline_after_ms(100), "rank 0", &f);
  if (why != TW_SUCCESS && f.magic == FRAME_MAGIC && f.status != TW_SUCCESS)
    return why;
  tw_fail(st, "%s", saved);
  return st;
}

/* Ranks 1..world-1: connect to rank 0 and wait for its acknowledgement. */
static tw_status_t star_connect(tw_bootstrap_t *bs) {
  tw_status_t st = TW_SUCCESS;
  int64_t deadline = bs_deadline_after_ms(bs->timeout_ms);
  char peer[96], where[48];
  bs_format_addr(where, sizeof(where), bs->table[0].listen_addr_be, bs->table[0].listen_port_be);
  snprintf(peer, sizeof(peer), "rank 0 (star hub at %s)", where);
  TW_CHECK(bs_tcp_connect(bs->table[0].listen_addr_be, bs->table[0].listen_port_be, deadline, peer,
                          &bs->star_fd[0]));
  bs_frame_t f;
  bs_init_frame(&f, bs->nonce, KIND_STAR_HELLO, bs->rank);
  st = bs_io_full(bs->star_fd[0], &f, sizeof(f), 1, deadline, peer);
  if (st != TW_SUCCESS)
    TW_CHECK(explain_closed(bs, KIND_STAR_ACK, st));
  TW_CHECK(bs_recv_frame(bs->star_fd[0], bs->nonce, KIND_STAR_ACK,
                         deadline + bs_grace_ms(bs->timeout_ms) * 1000000, peer, &f));
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
  bs_format_addr(where, sizeof(where), bid->addr_be, bid->port_be);
  snprintf(peer, sizeof(peer), "the bootstrap root at %s", where);
  TW_CHECK(bs_tcp_connect(bid->addr_be, bid->port_be, deadline, peer, &root_fd));

  /* Listen on the interface that reaches the root: the others reach us through it too. */
  struct sockaddr_in local;
  socklen_t len = sizeof(local);
  if (getsockname(root_fd, (struct sockaddr *)&local, &len) != 0)
    TW_FAIL(TW_ERR_SYSTEM, "getsockname of the connection to %s: %s", peer, strerror(errno));
  uint16_t listen_port_be = 0;
  if (bs->world > 1)
    TW_CHECK(bs_tcp_listen(local.sin_addr.s_addr, 0, &bs->listen_fd, &listen_port_be));

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
  TW_CHECK(bs_io_full(root_fd, &hello, sizeof(hello), 1, deadline, peer));

  /* The root's deadline starts at the first arrival, a little after ours. */
  bs_frame_t f;
  TW_CHECK(bs_recv_frame(root_fd, bid->nonce, KIND_RDV_REPLY,
                         deadline + bs_grace_ms(bs->timeout_ms) * 1000000, peer, &f));
  if (f.bytes != (uint64_t)bs->world * sizeof(rdv_entry_t))
    TW_FAIL(TW_ERR_INTERNAL, "%s sent a %llu-byte table; expected %d entries of %zu bytes", peer,
            (unsigned long long)f.bytes, bs->world, sizeof(rdv_entry_t));
  TW_CHECK(
      bs_io_full(root_fd, bs->table, (size_t)f.bytes, 0, bs_deadline_after_ms(ROOT_SEND_MS), peer));
  for (int r = 0; r < bs->world; r++) {
    if (bs->table[r].info.rank != r)
      TW_FAIL(TW_ERR_INTERNAL, "%s sent a table whose entry %d is rank %d", peer, r,
              bs->table[r].info.rank);
    bs->peers[r] = bs->table[r].info;
  }
  bs_close_fd(&root_fd);
  return TW_SUCCESS;
fail:
  bs_close_fd(&root_fd);
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
  int64_t deadline = bs_deadline_after_ms(timeout_ms);
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
    bs_close_fd(&bs->stash[i].fd);
  for (int i = 0; i < bs->fd_npending; i++)
    bs_close_fd(&bs->fd_pending[i]);
  bs_close_fd(&bs->unix_fd);
  for (int r = 0; r < TW_MAX_WORLD; r++)
    bs_close_fd(&bs->star_fd[r]);
  bs_close_fd(&bs->listen_fd);
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
  int64_t deadline = bs_deadline_after_ms(bs->timeout_ms);
  while (ndone < world) {
    if (bs_remaining_ms(deadline) == 0) {
      uint8_t missing[TW_MAX_WORLD];
      for (int r = 0; r < world; r++)
        missing[r] = !done[r];
      char list[512];
      bs_format_ranks(list, sizeof(list), missing, world);
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
    int n = poll(pfds, (nfds_t)npfds, bs_remaining_ms(deadline));
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
                  what, r, bs_kind_name(f->kind), f->seq, (unsigned long long)f->bytes,
                  bs_kind_name(kind), seq, bytes);
      }
      if (got[r] == header + bytes) {
        done[r] = 1;
        ndone++;
      }
    }
  }
  bs_frame_t reply;
  bs_init_frame(&reply, bs->nonce, KIND_COLL_REPLY, 0);
  reply.seq = seq;
  reply.bytes = (uint64_t)world * bytes;
  deadline = bs_deadline_after_ms(bs->timeout_ms);
  for (int r = 1; r < world; r++) {
    char peer[32];
    snprintf(peer, sizeof(peer), "rank %d", r);
    replied[r] = 1;
    TW_CHECK(bs_io_full(bs->star_fd[r], &reply, sizeof(reply), 1, deadline, peer));
    TW_CHECK(bs_io_full(bs->star_fd[r], data, (size_t)reply.bytes, 1, deadline, peer));
  }
  return TW_SUCCESS;
fail : {
  char msg[TW_ERRMSG_LEN];
  snprintf(msg, sizeof(msg), "rank 0 reports: %s", tw_last_error());
  int64_t deadline_err = bs_deadline_after_ms(1000);
  for (int r = 1; r < world; r++)
    if (!replied[r])
      bs_send_error_frame(bs->star_fd[r], bs->nonce, KIND_COLL_REPLY, 0, seq, st, msg,
                          deadline_err);
}
  return st;
}

/* Ranks 1..world-1: send this rank's slot, receive everyone's. */
static tw_status_t star_send_recv(tw_bootstrap_t *bs, int kind, char *data, size_t bytes,
                                  uint32_t seq, const char *what) {
  tw_status_t st = TW_SUCCESS;
  int fd = bs->star_fd[0];
  int64_t deadline = bs_deadline_after_ms(bs->timeout_ms);
  char peer[128];
  snprintf(peer, sizeof(peer), "rank 0 (the star hub) in %s", what);
  bs_frame_t f;
  bs_init_frame(&f, bs->nonce, kind, bs->rank);
  f.seq = seq;
  f.bytes = bytes;
  st = bs_io_full(fd, &f, sizeof(f), 1, deadline, peer);
  if (st == TW_SUCCESS)
    st = bs_io_full(fd, data + (size_t)bs->rank * bytes, bytes, 1, deadline, peer);
  if (st != TW_SUCCESS)
    TW_CHECK(explain_closed(bs, KIND_COLL_REPLY, st));
  TW_CHECK(bs_recv_frame(fd, bs->nonce, KIND_COLL_REPLY,
                         deadline + bs_grace_ms(bs->timeout_ms) * 1000000, peer, &f));
  if (f.seq != seq || f.bytes != (uint64_t)bs->world * bytes)
    TW_FAIL(TW_ERR_INTERNAL, "%s: rank 0 replied to #%u with %llu bytes; expected #%u with %zu",
            what, f.seq, (unsigned long long)f.bytes, seq, (size_t)bs->world * bytes);
  TW_CHECK(bs_io_full(fd, data, (size_t)f.bytes, 0,
                      deadline + bs_grace_ms(bs->timeout_ms) * 1000000, peer));
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
