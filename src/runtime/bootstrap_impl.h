/*
 * Internal to the bootstrap (bootstrap.c: init, the star, collectives; bootstrap_net.c:
 * clocks, polling I/O, frames and TCP; bootstrap_root.c: the rendezvous root thread;
 * bootstrap_fd.c: passing file descriptors). The contract is bootstrap.h's.
 */
#ifndef TW_RUNTIME_BOOTSTRAP_IMPL_H
#define TW_RUNTIME_BOOTSTRAP_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "core/status.h"
#include "runtime/bootstrap.h"

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

/* bootstrap_net.c */
int64_t bs_now_ns(void);
int64_t bs_deadline_after_ms(int64_t ms);
int bs_remaining_ms(int64_t deadline);
int64_t bs_grace_ms(int timeout_ms);
void bs_sleep_ms(int ms);
void bs_close_fd(int *fd);
void bs_format_addr(char *out, size_t cap, uint32_t addr_be, uint16_t port_be);
void bs_format_ranks(char *out, size_t cap, const uint8_t *flags, int world);
const char *bs_kind_name(int kind);
uint64_t bs_random_nonce(void);
int bs_poll_one(int fd, short events, int64_t deadline);
tw_status_t bs_io_full(int fd, void *buf, size_t len, int writing, int64_t deadline,
                       const char *peer);
void bs_init_frame(bs_frame_t *f, uint64_t nonce, int kind, int rank);
void bs_send_error_frame(int fd, uint64_t nonce, int kind, int rank, uint32_t seq,
                         tw_status_t status, const char *msg, int64_t deadline);
tw_status_t bs_recv_frame(int fd, uint64_t nonce, int kind, int64_t deadline, const char *peer,
                          bs_frame_t *f);
tw_status_t bs_tcp_listen(uint32_t addr_be, uint16_t port_be, int *fd_out, uint16_t *port_out);
tw_status_t bs_set_nodelay(int fd, const char *peer);
tw_status_t bs_tcp_connect(uint32_t addr_be, uint16_t port_be, int64_t deadline, const char *peer,
                           int *fd_out);
int bs_accept_one(int listen_fd);

/* bootstrap.c */
socklen_t bs_unix_name(struct sockaddr_un *sa, uint64_t nonce, int rank);

#endif
