/*
 * The verbs test double's internals: an emulated RDMA NIC behind the libibverbs / libefa entry
 * points the inter-node backends call (README.md beside this file is its documentation).
 *
 * Model. Every ibv_open_device is one NIC instance ("port") on a fabric: a file mapped
 * MAP_SHARED by every process that uses the same TW_VD_FABRIC path. The file holds a port table,
 * a QP table (qp_num -> owning port, receive credits) and, per port, two bounded inboxes: a data
 * ring (packets of at most VD_PKT_MAX payload bytes) and an ack ring. Each port has an engine
 * thread: it turns posted send WRs into packets pushed into the destination port's data ring,
 * applies the packets of its own data ring to registered memory, acks each packet into the
 * sender's ack ring, and turns acks into completions. Verbs objects (context, PD, MR, CQ, QP, AH)
 * live in the owning process only; the fabric carries addresses, keys and bytes.
 *
 * Locking. vd_ctx.lock serializes the engine's work with the calls that change the state it
 * walks (create / modify / destroy QP, close); the hot calls (post_send, post_recv, poll_cq) take
 * only their queue's own mutex, and no lock is held across a payload copy by anyone but the
 * engine (which holds only ctx->lock, never a queue or CQ lock, while copying).
 */
#ifndef TW_VD_H_INTERNAL
#define TW_VD_H_INTERNAL

#include <infiniband/efadv.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "tw_vd.h"

#ifndef EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE
/* rdma-core 44's efadv.h predates the name; the kernel ABI value is 1 << 3 */
#define EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE (1 << 3)
#endif

/* ---- limits (what ibv_query_device / efadv_query_device report) */
#define VD_MAX_PORTS 128          /* NIC instances on one fabric at once */
#define VD_QTAB 16384             /* fabric QP table entries (power of 2) */
#define VD_MAX_QP 4096            /* QPs per context */
#define VD_MAX_WR 8192            /* send / recv WRs per queue */
#define VD_MAX_SGE 16             /* SGEs per WR */
#define VD_MAX_INLINE 256         /* inline bytes per send WR (RC) */
#define VD_MAX_CQE (1 << 20)      /* entries per CQ */
#define VD_MAX_MSG (1ull << 30)   /* bytes per message (max_msg_sz, max_rdma_size) */
#define VD_PKT_MAX (256u << 10)   /* payload bytes per packet */
#define VD_DATA_RING (8u << 20)   /* data inbox bytes per port */
#define VD_ACK_RING (1u << 20)    /* ack inbox bytes per port */
#define VD_REC_ALIGN 128          /* ring records are multiples of this (header size) */
#define VD_MAX_RULES 16           /* injected-failure rules per port */
#define VD_SRD_WINDOW 8           /* SRD packets among which the receiver picks at random */
#define VD_SRD_HOLD_NS 60000      /* longest an SRD packet waits for company in the window */
#define VD_SRD_CQE_DELAY_NS 40000 /* SRD completions are delayed by up to this, at random */
#define VD_RX_PENDING 1024        /* records the receiver looks ahead at */
#define VD_DEFAULT_RNR_MS 1000    /* receiver-not-ready bound */

enum { VD_KIND_MLX5 = 1, VD_KIND_EFA = 2 };
enum { VD_T_RC = 1, VD_T_SRD = 2 };
enum { VD_OP_WRITE = 1, VD_OP_WRITE_IMM = 2, VD_OP_SEND = 3 };
enum { VD_REC_PAD = 1, VD_REC_DATA = 2, VD_REC_ACK = 3 };
enum { VD_RULE_WC_ERROR = 1, VD_RULE_QP_ERROR = 2, VD_RULE_SILENT = 3 };

/* ---- the fabric file */
struct vd_fab_hdr {
  uint64_t magic;
  uint32_t version;
  uint32_t max_ports;
  uint64_t size;
  _Atomic uint32_t next_lid;
  _Atomic uint32_t next_qpn;
  _Atomic uint32_t next_key;
  uint32_t pad0;
  _Atomic uint64_t next_guid;
  _Atomic uint64_t next_gen;
};

/* One NIC instance. Live while state == 1 and its process (pid) exists; gen tells incarnations
 * of one slot apart (a packet or QP entry stamped with an older gen is stale). */
struct vd_fab_port {
  _Atomic uint32_t state;
  int32_t pid;
  _Atomic uint64_t gen;
  uint32_t lid;
  uint32_t kind;
  uint8_t gid[16];
  /* some process pinned this slot's data ring for CUDA copies: its pages are never discarded
   * (set under the fabric lock, never cleared) */
  _Atomic uint32_t pinned;
  uint8_t pad[20];
};

/* One QP, at index qpn & (VD_QTAB - 1). credits: receive WRs posted and not yet claimed by a
 * sender (a message that consumes a receive claims one before it leaves, so it never finds the
 * receive queue empty: receiver-not-ready is decided at the sender). */
struct vd_fab_qp {
  _Atomic uint32_t qpn; /* 0: free */
  uint32_t port;
  _Atomic uint64_t port_gen;
  _Atomic int64_t credits;
  uint32_t local_idx;
  uint32_t type;
  _Atomic uint32_t state; /* enum ibv_qp_state: senders wait while it is not RTR / RTS */
  uint8_t pad[28];
};

/* A bounded multi-producer, single-consumer ring of records. Positions are monotonic byte
 * counts (offset = pos % size); a producer reserves [pos, pos + len) by CAS on tail when it fits
 * (tail - head + len <= size), writes the record, and publishes it by storing stamp = pos + 1 last;
 * the consumer takes records in position order and frees them by advancing head. */
struct vd_ring {
  _Atomic uint64_t tail;
  char pad0[56];
  _Atomic uint64_t head;
  char pad1[56];
  uint64_t size;
  char pad2[56];
};

/* A ring record's header (data packet, ack or pad); payload bytes follow it. */
struct vd_pkt {
  _Atomic uint64_t stamp;
  uint32_t rec_len; /* header + payload, rounded up to VD_REC_ALIGN */
  uint8_t kind;
  uint8_t opcode;
  uint8_t transport;
  uint8_t flags;
  uint32_t src_port; /* sender's port slot */
  uint32_t src_lid;
  uint64_t src_gen;
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint64_t seq; /* sender's WR sequence number */
  uint64_t remote_addr;
  uint32_t rkey;
  uint32_t imm; /* __be32, passed through */
  uint32_t qkey;
  uint32_t npkts;
  uint32_t pkt_idx;
  uint32_t len; /* payload bytes of this packet */
  uint64_t msg_off;
  uint64_t msg_len;
  uint64_t arrive_ns; /* not applied before (link shaping); 0: at once */
  int32_t status;     /* acks: an enum ibv_wc_status for the sender's WR */
  uint32_t pad;
};
_Static_assert(sizeof(struct vd_pkt) <= VD_REC_ALIGN, "vd_pkt fits one record unit");

/* ---- process-side objects: each verbs struct first, so the caller's pointer is ours */
struct vd_device {
  struct ibv_device dev;
  int kind;
  int kind_index; /* mlx5_<kind_index> / rdmap<kind_index>s0 */
  int index;      /* position in the latest device list */
};

struct vd_rule {
  int kind;
  uint64_t after;
  uint64_t count;
  int fired;
};

struct vd_cuda_engine; /* vd_cuda.c: the engine thread's CUDA contexts and streams */

struct vd_mr {
  struct ibv_mr mr;
  struct vd_mr *next; /* hash chain in ctx->mr_hash */
  uint64_t iova;      /* addresses in WRs are iova-based */
  char *base;         /* local address of iova */
  uint64_t length;
  int access;
  int dev; /* CUDA device ordinal of the memory; -1: host memory */
};

/* What the engine needs of an MR, copied out under mr_lock (so dereg cannot pull it away) */
struct vd_mr_view {
  struct ibv_pd *pd;
  uint64_t iova;
  char *base;
  uint64_t length;
  int access;
  int dev;
};

struct vd_pd {
  struct ibv_pd pd;
};

/* A destination address: a LID, or a GID when is_global */
struct vd_addr {
  uint8_t is_global;
  uint16_t lid;
  uint8_t gid[16];
};

struct vd_ah {
  struct ibv_ah ah;
  struct vd_addr addr;
};

struct vd_cq {
  struct ibv_cq cq;
  pthread_mutex_t lock;
  struct ibv_wc *ring;
  uint32_t cap;
  uint64_t head, tail;
  int overflowed;
  int users; /* QPs that use it (destroy_cq refuses while any) */
};

/* A resolved local buffer of a send WR */
struct vd_sge {
  char *ptr;
  uint32_t len;
  int dev;
};

enum { VD_W_QUEUED = 0, VD_W_SENDING, VD_W_SENT, VD_W_DONE, VD_W_EMITTED };

/* A send WR in the SQ ring; sge[max_send_sge] then inline bytes follow it (stride). */
struct vd_swr {
  uint64_t wr_id;
  uint64_t seq;
  uint8_t opcode;
  uint8_t signaled;
  uint8_t inl;
  uint8_t credit;
  uint8_t state;
  uint8_t has_dest;
  uint8_t fatal;  /* its error puts the QP in the error state (RC: every error) */
  uint8_t looked; /* the injected-failure rules have seen it */
  uint16_t nsge;
  int status;
  uint32_t rkey;
  uint32_t imm;
  uint64_t remote_addr;
  uint64_t len;
  uint64_t sent;
  uint32_t npkts, pkts_sent, pkts_acked;
  uint32_t remote_qpn, qkey;
  struct vd_addr dest; /* SRD: from wr_set_ud_addr */
  uint32_t dst_port;
  uint64_t dst_gen;
  uint64_t due_ns;         /* SRD: completion not before */
  uint64_t rnr_deadline;   /* waiting for a receive until then */
  uint64_t retry_deadline; /* waiting for the destination QP to receive until then */
  struct vd_sge sge[];
};

/* A posted receive WR; sge[max_recv_sge] follow it (stride). */
struct vd_rwr {
  uint64_t wr_id;
  uint32_t nsge;
  struct ibv_sge sge[];
};

/* A multi-packet message the receiver has seen part of */
struct vd_partial {
  uint32_t src_port;
  uint32_t src_qpn;
  uint64_t seq;
  uint32_t got;
  int status;
  int have_recv;
  uint64_t recv_wr_id;
  struct ibv_sge recv_sge[VD_MAX_SGE];
  uint32_t recv_nsge;
};

struct vd_qp {
  struct ibv_qp_ex qpx; /* qpx.qp_base is the ibv_qp */
  struct vd_ctx *ctx;
  struct vd_cq *scq, *rcq;
  uint32_t idx;      /* in ctx->qps */
  int type;          /* VD_T_* */
  _Atomic int state; /* enum ibv_qp_state; mirrored in qp_base.state */
  int sq_sig_all;
  uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline;
  uint64_t send_ops_flags;
  uint32_t qkey;
  int access_flags;
  struct vd_addr remote; /* RC: connected peer */
  uint32_t remote_qpn;
  /* the last destination resolved to a port (engine only) */
  struct vd_addr c_addr;
  uint32_t c_port;
  uint64_t c_gen;
  int c_valid;
  /* send queue: slots [sq_head, sq_tail) in use; the engine sends from sq_next */
  pthread_mutex_t sq_lock;
  char *sq;
  size_t sq_stride;
  uint64_t sq_mask;
  uint64_t sq_tail;            /* posters (sq_lock) */
  _Atomic uint64_t sq_posted;  /* published to the engine */
  _Atomic uint64_t sq_head;    /* oldest slot not emitted (engine writes) */
  _Atomic uint64_t sq_emitted; /* WRs completed (engine writes) */
  uint64_t sq_next;            /* engine */
  uint64_t done_pending;       /* SRD: done, completion not yet emitted */
  int tx_err;                  /* RC: a WR failed; nothing after it is sent */
  /* qp_ex batch (wr_start .. wr_complete, sq_lock held between) */
  uint64_t batch_start;
  int batch_err;
  int in_batch;
  /* receive queue */
  pthread_mutex_t rq_lock;
  char *rq;
  size_t rq_stride;
  uint64_t rq_head, rq_tail;
  /* receiver's partial messages */
  struct vd_partial *parts;
  size_t nparts, cap_parts;
};

/* A record the receiver has looked at but not yet freed */
struct vd_rx_ent {
  uint64_t pos;
  struct vd_pkt *p;
  uint64_t seen_ns;
  uint8_t applied;
  uint8_t srd;
};

struct vd_backlog {
  uint32_t port;
  uint64_t gen;
  struct vd_pkt rec;
};

struct vd_ctx {
  struct ibv_context ctx;
  struct vd_device *dev;
  int kind;
  uint32_t slot;
  uint64_t gen;
  uint16_t lid;
  uint8_t gid[16];
  uint64_t guid;
  struct vd_ring *data_ring, *ack_ring;
  char *data_base, *ack_base;
  struct vd_ctx *next_open; /* process list of open contexts */
  pthread_mutex_t lock;
  pthread_t thread;
  _Atomic int stop;
  int started;
  struct vd_qp *qps[VD_MAX_QP];
  uint32_t nqp_hi; /* qps[] beyond this are NULL */
  pthread_mutex_t mr_lock;
  struct vd_mr **mr_hash;
  uint32_t mr_mask;
  /* link shaping: ns per byte, one-way latency */
  double ns_per_byte;
  uint64_t lat_ns;
  uint64_t busy_until;
  uint64_t rnr_ns;
  uint64_t rng;
  /* injected failures (rule_lock: tw_vd_inject appends while the engine runs) */
  pthread_mutex_t rule_lock;
  struct vd_rule rules[VD_MAX_RULES];
  _Atomic int nrules;
  uint64_t wr_count, rx_count;
  _Atomic int silent;
  /* receiver look-ahead: entries [rx_first, rx_first + rx_n) of rx_ent (circular) */
  struct vd_rx_ent rx_ent[VD_RX_PENDING];
  uint32_t rx_first, rx_n, rx_srd;
  uint64_t rx_scan;
  /* acks that did not fit the sender's ring yet, in order */
  struct vd_backlog *backlog;
  size_t nbacklog, cap_backlog;
  int overrun; /* a CQ of this context overflowed: its QPs go to the error state */
  struct vd_cuda_engine *cu;
};

/* ---- process-wide statistics (tw_vd_stats) */
struct vd_stats_atomic {
  _Atomic uint64_t packets_sent, bytes_sent, packets_applied, bytes_applied, acks, reordered,
      rnr_waits, wr_errors, cq_overflows, flushed, dropped;
};
extern struct vd_stats_atomic vd_stats;
#define VD_STAT_ADD(field, n) atomic_fetch_add_explicit(&vd_stats.field, (n), memory_order_relaxed)

/* ---- vd_fabric.c */
int vd_fabric_join(void); /* 0 or an errno */
struct vd_fab_hdr *vd_fab(void);
struct vd_fab_port *vd_fab_port(uint32_t slot);
struct vd_fab_qp *vd_fab_qp(uint32_t qpn);
int vd_port_alloc(struct vd_ctx *c); /* fills slot, gen, lid, gid, guid, rings */
void vd_port_free(struct vd_ctx *c);
int vd_port_live(uint32_t slot, uint64_t gen);
int vd_port_find(const struct vd_addr *a, uint32_t *slot, uint64_t *gen); /* 0: found */
uint32_t vd_qpn_alloc(struct vd_ctx *c, uint32_t local_idx, int type);    /* 0: table full */
void vd_qpn_free(uint32_t qpn);
uint32_t vd_key_alloc(void);
struct vd_ring *vd_port_ring(uint32_t slot, int ack, char **data);
struct vd_pkt *vd_ring_reserve(struct vd_ring *r, char *data, uint32_t len, uint64_t *pos);
void vd_ring_publish(struct vd_pkt *p, uint64_t pos);
struct vd_pkt *vd_ring_peek(struct vd_ring *r, char *data, uint64_t pos);
void vd_fabric_after_fork(void);
void vd_port_mark_pinned(uint32_t slot);

/* ---- vd_device.c */
uint64_t vd_now_ns(void);
uint64_t vd_rand(uint64_t *state);
void vd_lock(pthread_mutex_t *m);
void vd_unlock(pthread_mutex_t *m);

/* ---- vd_inject.c */
int vd_rules_for_new_port(struct vd_ctx *c); /* 0 or EINVAL (bad TW_VD_FAIL) */
void vd_register_ctx(struct vd_ctx *c);
void vd_unregister_ctx(struct vd_ctx *c);
void vd_inject_after_fork(void);
/* The port's send-WR counter advanced: the rule kind that fires for this WR, or 0 */
int vd_rule_on_send_wr(struct vd_ctx *c);
/* The port received a data packet: nonzero once it is to go silent */
int vd_rule_on_rx(struct vd_ctx *c);

/* ---- vd_mr.c */
int vd_mr_find(struct vd_ctx *c, uint32_t key, struct vd_mr_view *out); /* 0: found */
/* The local address of [addr, addr + len) in the MR's iova space, or NULL when out of range */
char *vd_mr_translate(const struct vd_mr_view *m, uint64_t addr, uint64_t len);

/* ---- vd_cuda.c */
int vd_cuda_classify(const void *addr); /* CUDA device ordinal, or -1 for host memory */
/* Copies n bytes, from device memory too, on the engine's non-blocking stream (synchronized
 * before it returns). 0 or -1 (CUDA failed). */
int vd_copy(struct vd_ctx *c, void *dst, int dst_dev, const void *src, int src_dev, size_t n);
void vd_cuda_engine_free(struct vd_ctx *c);
/* Pins port slot's data ring in this process (once; best effort) so CUDA copies to and from it
 * are DMA, not staged; dev: the device the copy involves. */
void vd_cuda_pin_ring(struct vd_ctx *c, uint32_t slot, int dev);

/* ---- vd_cq.c */
/* Adds a completion; on overflow marks the CQ, complains once and returns -1 */
int vd_cq_push(struct vd_cq *cq, const struct ibv_wc *wc);
int vd_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc);
/* vd_cq_push for the engine: an overrun marks the context (its QPs then go to the error state) */
void vd_emit(struct vd_cq *cq, const struct ibv_wc *wc);
int vd_cq_overflowed(struct vd_cq *cq);

/* ---- vd_qp.c */
struct vd_swr *vd_sq_slot(struct vd_qp *qp, uint64_t idx);
struct vd_rwr *vd_rq_slot(struct vd_qp *qp, uint64_t idx);
/* Moves the QP to the error state and flushes every WR it holds (ctx->lock held) */
void vd_qp_to_error(struct vd_qp *qp);
/* Completes the WRs posted to a QP in the error state since the last flush (ctx->lock held) */
int vd_qp_flush(struct vd_qp *qp);
struct vd_qp *vd_qp_by_num(struct vd_ctx *c, uint32_t qpn); /* this context's QP, or NULL */

/* ---- vd_post.c */
int vd_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
int vd_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);
void vd_qpx_init(struct vd_qp *qp);
/* Pops the oldest receive WR into *out (sge array of VD_MAX_SGE); 0 or -1 when none */
int vd_rq_pop(struct vd_qp *qp, uint64_t *wr_id, struct ibv_sge *sge, uint32_t *nsge);

/* ---- vd_engine.c, vd_recv.c */
int vd_engine_start(struct vd_ctx *c); /* 0 or an errno */
void vd_engine_stop(struct vd_ctx *c);
int vd_tx(struct vd_ctx *c);       /* sends what it can; returns work done */
int vd_complete(struct vd_ctx *c); /* emits send completions */
int vd_rx_data(struct vd_ctx *c);
int vd_rx_acks(struct vd_ctx *c);
int vd_flush_backlog(struct vd_ctx *c);
/* A send WR delivered or failed (all its packets acked): ready for its completion */
void vd_wr_done(struct vd_ctx *c, struct vd_qp *qp, struct vd_swr *w);

#endif
