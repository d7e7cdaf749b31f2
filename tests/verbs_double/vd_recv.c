/*
 * The engine's receive side: packets of this port's data ring are checked (QP, state, peer or
 * qkey, rkey, bounds, access) and placed into registered memory, each then acked into the
 * sender's ack ring; acks of this port's ack ring advance its send WRs.
 *
 * Order. RC packets are applied in ring order, one at a time, each copy complete (device copies
 * synchronized, a full fence after host copies) before the next: a WR's data is placed before any
 * later WR of that QP. SRD packets wait in a window and the receiver applies a random one of the
 * oldest VD_SRD_WINDOW (once the window is full, or its oldest has waited VD_SRD_HOLD_NS), so
 * WRs of one QP, and packets of one WR, land out of order. A message's receive completion comes
 * when all of its packets have landed.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vd.h"

static void ack_push(struct vd_ctx *c, uint32_t port, uint64_t gen, const struct vd_pkt *rec);

static int rc_peer_ok(const struct vd_qp *qp, const struct vd_pkt *p) {
  if (p->src_qpn != qp->remote_qpn || p->src_port >= VD_MAX_PORTS)
    return 0;
  const struct vd_fab_port *sp = vd_fab_port(p->src_port);
  return qp->remote.is_global ? memcmp(sp->gid, qp->remote.gid, 16) == 0
                              : sp->lid == qp->remote.lid;
}

static int place_write(struct vd_ctx *c, struct vd_qp *qp, const struct vd_pkt *p) {
  struct vd_mr_view m;
  if (vd_mr_find(c, p->rkey, &m) != 0 || m.pd != qp->qpx.qp_base.pd ||
      !(m.access & IBV_ACCESS_REMOTE_WRITE) ||
      (qp->type == VD_T_RC && !(qp->access_flags & IBV_ACCESS_REMOTE_WRITE)))
    return IBV_WC_REM_ACCESS_ERR;
  char *dst = vd_mr_translate(&m, p->remote_addr, p->len);
  if (!dst)
    return IBV_WC_REM_ACCESS_ERR;
  if (m.dev >= 0)
    vd_cuda_pin_ring(c, c->slot, m.dev);
  if (vd_copy(c, dst, m.dev, (const char *)p + VD_REC_ALIGN, -1, p->len) != 0)
    return IBV_WC_REM_OP_ERR;
  return IBV_WC_SUCCESS;
}

/* Scatters a send's payload at its message offset into the receive's SGEs. */
static int place_send(struct vd_ctx *c, struct vd_qp *qp, const struct vd_partial *r,
                      const struct vd_pkt *p) {
  uint64_t off = p->msg_off, n = p->len;
  const char *src = (const char *)p + VD_REC_ALIGN;
  for (uint32_t i = 0; i < r->recv_nsge && n; i++) {
    const struct ibv_sge *s = &r->recv_sge[i];
    if (off >= s->length) {
      off -= s->length;
      continue;
    }
    const uint64_t take = s->length - off < n ? s->length - off : n;
    struct vd_mr_view m;
    char *dst = NULL;
    if (vd_mr_find(c, s->lkey, &m) == 0 && m.pd == qp->qpx.qp_base.pd &&
        (m.access & IBV_ACCESS_LOCAL_WRITE))
      dst = vd_mr_translate(&m, s->addr + off, take);
    if (!dst)
      return IBV_WC_LOC_PROT_ERR;
    if (m.dev >= 0)
      vd_cuda_pin_ring(c, c->slot, m.dev);
    if (vd_copy(c, dst, m.dev, src, -1, take) != 0)
      return IBV_WC_LOC_QP_OP_ERR;
    src += take;
    n -= take;
    off = 0;
  }
  return n ? IBV_WC_LOC_LEN_ERR : IBV_WC_SUCCESS;
}

/* The message's record of packets seen; created at its first packet. NULL: out of memory. */
static struct vd_partial *partial_get(struct vd_qp *qp, const struct vd_pkt *p) {
  for (size_t i = 0; i < qp->nparts; i++) {
    struct vd_partial *r = &qp->parts[i];
    if (r->src_port == p->src_port && r->src_qpn == p->src_qpn && r->seq == p->seq)
      return r;
  }
  if (qp->nparts == qp->cap_parts) {
    size_t cap = qp->cap_parts ? 2 * qp->cap_parts : 8;
    struct vd_partial *np = realloc(qp->parts, cap * sizeof(*np));
    if (!np)
      return NULL;
    qp->parts = np;
    qp->cap_parts = cap;
  }
  struct vd_partial *r = &qp->parts[qp->nparts++];
  memset(r, 0, sizeof(*r));
  r->src_port = p->src_port;
  r->src_qpn = p->src_qpn;
  r->seq = p->seq;
  r->status = IBV_WC_SUCCESS;
  return r;
}

static void partial_drop(struct vd_qp *qp, struct vd_partial *r) { *r = qp->parts[--qp->nparts]; }

static void recv_complete(struct vd_qp *qp, const struct vd_pkt *p, uint64_t wr_id, int status) {
  struct ibv_wc wc = {.wr_id = wr_id,
                      .status = (enum ibv_wc_status)status,
                      .opcode = p->opcode == VD_OP_SEND ? IBV_WC_RECV : IBV_WC_RECV_RDMA_WITH_IMM,
                      .byte_len = (uint32_t)p->msg_len,
                      .qp_num = qp->qpx.qp_base.qp_num,
                      .src_qp = p->src_qpn,
                      .slid = (uint16_t)p->src_lid};
  if (p->opcode == VD_OP_WRITE_IMM) {
    wc.wc_flags = IBV_WC_WITH_IMM;
    wc.imm_data = p->imm;
  }
  vd_emit(qp->rcq, &wc);
}

/* A message's last packet landed: its receive completion (write with imm, send). */
static void message_done(struct vd_qp *qp, const struct vd_pkt *p, struct vd_partial *r) {
  if (p->opcode == VD_OP_WRITE)
    return;
  if (p->opcode == VD_OP_SEND) {
    if (r->have_recv)
      recv_complete(qp, p, r->recv_wr_id, r->status);
    return;
  }
  struct ibv_sge sge[VD_MAX_SGE];
  uint32_t nsge;
  uint64_t wr_id;
  if (r->status != IBV_WC_SUCCESS) { /* nothing consumed: the sender's credit comes back */
    atomic_fetch_add(&vd_fab_qp(qp->qpx.qp_base.qp_num)->credits, 1);
    return;
  }
  if (vd_rq_pop(qp, &wr_id, sge, &nsge) == 0)
    recv_complete(qp, p, wr_id, IBV_WC_SUCCESS);
}

/* Applies one data packet; returns the status its ack carries. */
static int apply(struct vd_ctx *c, const struct vd_pkt *p) {
  const int rc = p->transport == VD_T_RC;
  struct vd_qp *qp = vd_qp_by_num(c, p->dst_qpn);
  /* no such QP, or not receiving: an RC requester would retry until exhausted; EFA reports a
   * bad destination QPN, which is also what a wrong qkey gets */
  const int unreachable = rc ? IBV_WC_RETRY_EXC_ERR : IBV_WC_REM_INV_RD_REQ_ERR;
  if (!qp || qp->type != p->transport)
    return unreachable;
  const int st = atomic_load(&qp->state);
  if (st != IBV_QPS_RTR && st != IBV_QPS_RTS)
    return unreachable;
  if (rc ? !rc_peer_ok(qp, p) : p->qkey != qp->qkey)
    return rc ? IBV_WC_REM_INV_REQ_ERR : unreachable;
  struct vd_partial one, *r = &one;
  if (p->npkts > 1) {
    r = partial_get(qp, p);
    if (!r)
      return IBV_WC_REM_OP_ERR;
  } else {
    memset(&one, 0, sizeof(one));
    one.status = IBV_WC_SUCCESS;
  }
  int status = IBV_WC_SUCCESS, sender_status;
  if (p->opcode == VD_OP_SEND) {
    if (!r->have_recv && r->got == 0) {
      /* the sender claimed a credit: a receive is there unless the QP was flushed */
      if (vd_rq_pop(qp, &r->recv_wr_id, r->recv_sge, &r->recv_nsge) == 0)
        r->have_recv = 1;
    }
    status = r->have_recv ? place_send(c, qp, r, p) : IBV_WC_LOC_QP_OP_ERR;
    sender_status = status == IBV_WC_SUCCESS       ? IBV_WC_SUCCESS
                    : status == IBV_WC_LOC_LEN_ERR ? IBV_WC_REM_INV_REQ_ERR
                                                   : IBV_WC_REM_OP_ERR;
  } else {
    if (p->len)
      status = place_write(c, qp, p);
    sender_status = status;
  }
  if (status != IBV_WC_SUCCESS && r->status == IBV_WC_SUCCESS)
    r->status = status;
  r->got++;
  if (r->got == p->npkts) {
    message_done(qp, p, r);
    if (r != &one)
      partial_drop(qp, r);
  }
  /* RC: a remote access or request error is fatal for the responder's QP as well */
  if (rc && sender_status != IBV_WC_SUCCESS)
    vd_qp_to_error(qp);
  return sender_status;
}

static void deliver(struct vd_ctx *c, const struct vd_pkt *p) {
  const int status = apply(c, p);
  /* a full fence: the data (maybe non-temporal stores) is visible before the ack, and before
   * any later packet's bytes */
  atomic_thread_fence(memory_order_seq_cst);
  VD_STAT_ADD(packets_applied, 1);
  VD_STAT_ADD(bytes_applied, p->len);
  struct vd_pkt ack;
  memset(&ack, 0, sizeof(ack));
  ack.rec_len = VD_REC_ALIGN;
  ack.kind = VD_REC_ACK;
  ack.src_port = c->slot;
  ack.src_lid = c->lid;
  ack.src_gen = c->gen;
  ack.dst_qpn = p->src_qpn;
  ack.seq = p->seq;
  ack.status = status;
  ack.arrive_ns = c->lat_ns ? vd_now_ns() + c->lat_ns : 0;
  ack_push(c, p->src_port, p->src_gen, &ack);
}

static int ack_try(uint32_t port, const struct vd_pkt *rec) {
  char *data;
  struct vd_ring *r = vd_port_ring(port, 1, &data);
  uint64_t pos;
  struct vd_pkt *p = vd_ring_reserve(r, data, VD_REC_ALIGN, &pos);
  if (!p)
    return -1;
  memcpy((char *)p + sizeof(p->stamp), (const char *)rec + sizeof(rec->stamp),
         sizeof(*rec) - sizeof(rec->stamp));
  vd_ring_publish(p, pos);
  return 0;
}

/* Sends an ack, or queues it behind earlier ones when the sender's ring is full. */
static void ack_push(struct vd_ctx *c, uint32_t port, uint64_t gen, const struct vd_pkt *rec) {
  if (!vd_port_live(port, gen))
    return; /* the sender is gone */
  if (!c->nbacklog && ack_try(port, rec) == 0)
    return;
  if (c->nbacklog == c->cap_backlog) {
    size_t cap = c->cap_backlog ? 2 * c->cap_backlog : 64;
    struct vd_backlog *nb = realloc(c->backlog, cap * sizeof(*nb));
    if (!nb) {
      fprintf(stderr, "tw-verbs-double: out of memory for acks: one lost\n");
      return;
    }
    c->backlog = nb;
    c->cap_backlog = cap;
  }
  struct vd_backlog *b = &c->backlog[c->nbacklog++];
  b->port = port;
  b->gen = gen;
  b->rec = *rec;
}

int vd_flush_backlog(struct vd_ctx *c) {
  size_t i = 0;
  while (i < c->nbacklog) {
    const struct vd_backlog *b = &c->backlog[i];
    if (vd_port_live(b->port, b->gen) && ack_try(b->port, &b->rec) != 0)
      break;
    i++;
  }
  if (i) {
    memmove(c->backlog, c->backlog + i, (c->nbacklog - i) * sizeof(*c->backlog));
    c->nbacklog -= i;
  }
  return (int)i;
}

/* The oldest pending SRD packets, at most VD_SRD_WINDOW; their rx_ent indices in idx[]. */
static uint32_t srd_window(struct vd_ctx *c, uint32_t *idx) {
  uint32_t n = 0;
  for (uint32_t k = 0; k < c->rx_n && n < VD_SRD_WINDOW; k++) {
    const uint32_t i = (c->rx_first + k) % VD_RX_PENDING;
    if (c->rx_ent[i].srd && !c->rx_ent[i].applied)
      idx[n++] = i;
  }
  return n;
}

static int rx_scan(struct vd_ctx *c, uint64_t now) {
  int work = 0;
  while (c->rx_n < VD_RX_PENDING) {
    struct vd_pkt *p = vd_ring_peek(c->data_ring, c->data_base, c->rx_scan);
    if (!p || (p->kind == VD_REC_DATA && p->arrive_ns > now))
      break; /* nothing more, or not yet arrived (link shaping) */
    struct vd_rx_ent *e = &c->rx_ent[(c->rx_first + c->rx_n) % VD_RX_PENDING];
    c->rx_n++;
    e->pos = c->rx_scan;
    e->p = p;
    e->seen_ns = now;
    e->applied = 1;
    e->srd = 0;
    c->rx_scan += p->rec_len;
    work++;
    if (p->kind != VD_REC_DATA)
      continue;
    if (vd_rule_on_rx(c)) { /* silent: like a dead peer, nothing applied, nothing acked */
      VD_STAT_ADD(dropped, 1);
      continue;
    }
    if (p->transport == VD_T_SRD) {
      e->applied = 0;
      e->srd = 1;
      c->rx_srd++;
      continue;
    }
    deliver(c, p);
  }
  return work;
}

int vd_rx_data(struct vd_ctx *c) {
  const uint64_t now = vd_now_ns();
  int work = rx_scan(c, now);
  while (c->rx_srd) {
    uint32_t idx[VD_SRD_WINDOW];
    const uint32_t n = srd_window(c, idx);
    struct vd_rx_ent *oldest = &c->rx_ent[idx[0]];
    if (n < VD_SRD_WINDOW && now - oldest->seen_ns < VD_SRD_HOLD_NS && c->rx_n < VD_RX_PENDING)
      break; /* wait for company: the window is what lets later packets overtake */
    const uint32_t k = (uint32_t)(vd_rand(&c->rng) % n);
    struct vd_rx_ent *e = &c->rx_ent[idx[k]];
    deliver(c, e->p);
    e->applied = 1;
    c->rx_srd--;
    if (k)
      VD_STAT_ADD(reordered, 1);
    work++;
  }
  /* free the applied prefix */
  uint64_t head = 0;
  int moved = 0;
  while (c->rx_n && c->rx_ent[c->rx_first].applied) {
    const struct vd_rx_ent *e = &c->rx_ent[c->rx_first];
    head = e->pos + e->p->rec_len;
    c->rx_first = (c->rx_first + 1) % VD_RX_PENDING;
    c->rx_n--;
    moved = 1;
  }
  if (moved)
    atomic_store_explicit(&c->data_ring->head, head, memory_order_release);
  return work;
}

static void take_ack(struct vd_ctx *c, const struct vd_pkt *a) {
  VD_STAT_ADD(acks, 1);
  struct vd_qp *qp = vd_qp_by_num(c, a->dst_qpn);
  if (!qp || atomic_load(&qp->state) == IBV_QPS_ERR)
    return;
  struct vd_swr *w = vd_sq_slot(qp, a->seq);
  if (w->seq != a->seq || (w->state != VD_W_SENDING && w->state != VD_W_SENT))
    return; /* a WR already flushed or failed */
  if (a->status != IBV_WC_SUCCESS && w->status == IBV_WC_SUCCESS) {
    w->status = a->status;
    if (qp->type == VD_T_RC)
      qp->tx_err = 1; /* nothing more leaves behind a failed WR */
  }
  w->pkts_acked++;
  if (w->state == VD_W_SENT && w->pkts_acked == w->npkts)
    vd_wr_done(c, qp, w);
}

int vd_rx_acks(struct vd_ctx *c) {
  int work = 0;
  const uint64_t now = vd_now_ns();
  uint64_t pos = atomic_load_explicit(&c->ack_ring->head, memory_order_relaxed);
  const int silent = atomic_load_explicit(&c->silent, memory_order_relaxed);
  for (int n = 0; n < 4096; n++) {
    struct vd_pkt *p = vd_ring_peek(c->ack_ring, c->ack_base, pos);
    if (!p || (p->kind == VD_REC_ACK && p->arrive_ns > now))
      break;
    if (p->kind == VD_REC_ACK && !silent)
      take_ack(c, p);
    pos += p->rec_len;
    work++;
  }
  if (work)
    atomic_store_explicit(&c->ack_ring->head, pos, memory_order_release);
  return work;
}
