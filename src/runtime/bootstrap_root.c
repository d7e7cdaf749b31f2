/* The bootstrap's rendezvous root: a thread that collects every rank's hello and sends back
 * the table (bootstrap_impl.h). */
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
  bs_send_error_frame(fd, nonce, KIND_RDV_REPLY, -1, 0, status, msg,
                      bs_deadline_after_ms(ROOT_SEND_MS));
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
    bs_close_fd(&rs->rank_fd[r]);
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
    rs->deadline = bs_deadline_after_ms(rs->timeout_ms);
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
  bs_init_frame(&f, rs->nonce, KIND_RDV_REPLY, -1);
  f.bytes = (uint64_t)rs->world * sizeof(rdv_entry_t);
  int64_t deadline = bs_deadline_after_ms(ROOT_SEND_MS);
  for (int r = 0; r < rs->world; r++) {
    tw_status_t st = bs_io_full(rs->rank_fd[r], &f, sizeof(f), 1, deadline, "a rank");
    if (st == TW_SUCCESS)
      st = bs_io_full(rs->rank_fd[r], rs->table, (size_t)f.bytes, 1, deadline, "a rank");
    if (st != TW_SUCCESS)
      TW_WARN("bootstrap root at %s: sending the table to rank %d failed: %s", rs->addr, r,
              tw_last_error());
  }
  TW_DEBUG("bootstrap root at %s: all %d ranks arrived; table sent", rs->addr, rs->world);
}

static void root_drop_pending(root_state_t *rs, int i) {
  bs_close_fd(&rs->pending[i].fd);
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
    int fd = bs_accept_one(rs->listen_fd);
    if (fd < 0) {
      if (errno != EAGAIN) {
        /* Out of fds or memory: back off instead of spinning on poll. */
        TW_WARN("bootstrap root at %s: accept: %s", rs->addr, strerror(errno));
        bs_sleep_ms(10);
      }
      return;
    }
    root_pending_t *p = &rs->pending[rs->npending++];
    memset(p, 0, sizeof(*p));
    p->fd = fd;
    p->since = bs_now_ns();
  }
}

static void *root_main(void *arg) {
  root_state_t *rs = arg;
  for (;;) {
    int64_t until = rs->started ? rs->deadline : rs->idle_deadline;
    int64_t now = bs_now_ns();
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
    int n = poll(pfds, (nfds_t)npfds, bs_remaining_ms(wake));
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
    bs_format_ranks(list, sizeof(list), missing, rs->world);
    root_poison(rs, TW_ERR_TIMEOUT, "%s of %d never arrived within %d ms", list, rs->world,
                rs->timeout_ms);
  }
  for (int r = 0; r < TW_MAX_WORLD; r++)
    bs_close_fd(&rs->rank_fd[r]);
  while (rs->npending > 0)
    root_drop_pending(rs, rs->npending - 1);
  bs_close_fd(&rs->listen_fd);
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
  TW_CHECK(bs_tcp_listen(addr_be, port_be, &listen_fd, &port_be));

  rs = calloc(1, sizeof(*rs));
  if (!rs)
    TW_FAIL(TW_ERR_SYSTEM, "out of host memory for the bootstrap root (%zu bytes)", sizeof(*rs));
  rs->listen_fd = listen_fd;
  rs->nonce = bs_random_nonce();
  bs_format_addr(rs->addr, sizeof(rs->addr), addr_be, port_be);
  rs->idle_ms = 2 * tw_env_int(TW_BOOTSTRAP_TIMEOUT_MS_ID);
  if (rs->idle_ms < ROOT_IDLE_MIN_MS)
    rs->idle_ms = ROOT_IDLE_MIN_MS;
  rs->idle_deadline = bs_deadline_after_ms(rs->idle_ms);
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
  bs_close_fd(&listen_fd);
  return st;
}
