/*
 * The engine thread of one NIC instance, and its send side: send WRs become packets in the
 * destination port's data ring, acks become completions.
 *
 * RC: WRs leave in post order and complete in post order; the first failed WR completes with its
 * error and puts the QP in the error state (the rest flush), and nothing after a failed WR is
 * sent. SRD: WRs leave in post order but the receiver applies them out of order, and each
 * completion is delayed by a random time, so completions come out of order too; a failed WR does
 * not stop the QP (EFA's SRD QPs stay usable), except an injected wc_error.
 *
 * Waits are decided here, before a WR's first packet leaves, both bounded by TW_VD_RNR_MS: for the
 * destination QP to receive (RTR or RTS; a requester retransmits meanwhile; then
 * IBV_WC_RETRY_EXC_ERR, SRD IBV_WC_RESP_TIMEOUT_ERR), and, for a WR that consumes a receive (write
 * with immediate, send), for one of the destination QP's credits (then
 * IBV_WC_RNR_RETRY_EXC_ERR).
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "vd.h"

#define VD_TX_BUDGET 64 /* packets per engine iteration */

/* A WR is finished (delivered or failed); RC emits in order, SRD after a random delay. */
void vd_wr_done(struct vd_ctx *c, struct vd_qp *qp, struct vd_swr *w) {
  w->state = VD_W_DONE;
  if (w->status != IBV_WC_SUCCESS) {
    VD_STAT_ADD(wr_errors, 1);
    if (qp->type == VD_T_RC) {
      w->fatal = 1;
      qp->tx_err = 1;
    }
  }
  if (qp->type == VD_T_SRD) {
    w->due_ns = vd_now_ns() + vd_rand(&c->rng) % VD_SRD_CQE_DELAY_NS;
    qp->done_pending++;
  }
}

static void wr_fail(struct vd_ctx *c, struct vd_qp *qp, struct vd_swr *w, int status) {
  w->status = status;
  w->npkts = w->pkts_sent;
  vd_wr_done(c, qp, w);
}

static int addr_eq(const struct vd_addr *a, const struct vd_addr *b) {
  if (a->is_global != b->is_global)
    return 0;
  return a->is_global ? memcmp(a->gid, b->gid, 16) == 0 : a->lid == b->lid;
}

/* The destination port of addr, through the QP's one-entry cache. 0 or -1 (no such port). */
static int resolve(struct vd_qp *qp, const struct vd_addr *a, uint32_t *slot, uint64_t *gen) {
  if (qp->c_valid && addr_eq(&qp->c_addr, a) && vd_port_live(qp->c_port, qp->c_gen)) {
    *slot = qp->c_port;
    *gen = qp->c_gen;
    return 0;
  }
  if (vd_port_find(a, slot, gen) != 0)
    return -1;
  qp->c_addr = *a;
  qp->c_port = *slot;
  qp->c_gen = *gen;
  qp->c_valid = 1;
  return 0;
}

static int claim_credit(struct vd_fab_qp *e) {
  int64_t v = atomic_load(&e->credits);
  while (v > 0)
    if (atomic_compare_exchange_weak(&e->credits, &v, v - 1))
      return 1;
  return 0;
}

/* Readies a queued WR for sending. 1: send it; 0: not yet (waiting for the destination QP to
 * receive, or for a receive); -1: it finished (failed); -2: the QP went to the error state. */
static int tx_start(struct vd_ctx *c, struct vd_qp *qp, struct vd_swr *w) {
  const int rc = qp->type == VD_T_RC;
  if (!w->looked) { /* a WR's first look, not a retry */
    w->looked = 1;
    const int fire = vd_rule_on_send_wr(c);
    if (fire == VD_RULE_QP_ERROR) {
      vd_qp_to_error(qp);
      return -2;
    }
    if (fire == VD_RULE_WC_ERROR) {
      w->fatal = 1;
      wr_fail(c, qp, w, IBV_WC_RETRY_EXC_ERR);
      return -1;
    }
  }
  if (w->status != IBV_WC_SUCCESS) { /* found when posted (lkey, length) */
    wr_fail(c, qp, w, w->status);
    return -1;
  }
  if (!rc && w->opcode == VD_OP_SEND && w->len > VD_PKT_MAX) {
    wr_fail(c, qp, w, IBV_WC_LOC_LEN_ERR);
    return -1;
  }
  const struct vd_addr *a = rc ? &qp->remote : &w->dest;
  const uint32_t qpn = rc ? qp->remote_qpn : w->remote_qpn;
  uint32_t slot;
  uint64_t gen;
  if (resolve(qp, a, &slot, &gen) != 0) {
    wr_fail(c, qp, w, rc ? IBV_WC_RETRY_EXC_ERR : IBV_WC_RESP_TIMEOUT_ERR);
    return -1;
  }
  struct vd_fab_qp *e = vd_fab_qp(qpn);
  if (atomic_load_explicit(&e->qpn, memory_order_acquire) != qpn || e->port != slot ||
      atomic_load(&e->port_gen) != gen || e->type != (uint32_t)qp->type) {
    /* no such QP there: RC retries until exhausted, EFA reports a bad destination QPN */
    wr_fail(c, qp, w, rc ? IBV_WC_RETRY_EXC_ERR : IBV_WC_REM_INV_RD_REQ_ERR);
    return -1;
  }
  /* a QP that does not receive yet (or any more): the real requester retransmits until its
   * retries run out, so a peer still on its way to RTR is waited for */
  const uint32_t dst_state = atomic_load(&e->state);
  if (dst_state != IBV_QPS_RTR && dst_state != IBV_QPS_RTS) {
    const uint64_t now = vd_now_ns();
    if (!w->retry_deadline)
      w->retry_deadline = now + c->rnr_ns;
    if (now < w->retry_deadline)
      return 0;
    wr_fail(c, qp, w, rc ? IBV_WC_RETRY_EXC_ERR : IBV_WC_RESP_TIMEOUT_ERR);
    return -1;
  }
  if ((w->opcode == VD_OP_WRITE_IMM || w->opcode == VD_OP_SEND) && !w->credit) {
    if (!claim_credit(e)) {
      const uint64_t now = vd_now_ns();
      if (!w->rnr_deadline) {
        w->rnr_deadline = now + c->rnr_ns;
        VD_STAT_ADD(rnr_waits, 1);
      }
      if (now < w->rnr_deadline)
        return 0;
      wr_fail(c, qp, w, IBV_WC_RNR_RETRY_EXC_ERR);
      return -1;
    }
    w->credit = 1;
  }
  w->dst_port = slot;
  w->dst_gen = gen;
  w->npkts = w->len ? (uint32_t)((w->len + VD_PKT_MAX - 1) / VD_PKT_MAX) : 1;
  w->state = VD_W_SENDING;
  return 1;
}

/* Copies message bytes [off, off + n) of the WR into dst. 0 or -1 (a CUDA copy failed). */
static int gather(struct vd_ctx *c, struct vd_qp *qp, struct vd_swr *w, uint64_t off, uint64_t n,
                  char *dst) {
  if (w->inl) {
    memcpy(dst, (char *)(w->sge + qp->max_send_sge) + off, n);
    return 0;
  }
  for (uint32_t i = 0; i < w->nsge && n; i++) {
    if (off >= w->sge[i].len) {
      off -= w->sge[i].len;
      continue;
    }
    const uint64_t take = w->sge[i].len - off < n ? w->sge[i].len - off : n;
    if (w->sge[i].dev >= 0)
      vd_cuda_pin_ring(c, w->dst_port, w->sge[i].dev);
    if (vd_copy(c, dst, -1, w->sge[i].ptr + off, w->sge[i].dev, take) != 0)
      return -1;
    dst += take;
    n -= take;
    off = 0;
  }
  return 0;
}

/* Link shaping: when a packet of `bytes` on the wire arrives (0 when unshaped). */
static uint64_t shape(struct vd_ctx *c, uint64_t bytes) {
  if (c->ns_per_byte <= 0 && !c->lat_ns)
    return 0;
  const uint64_t now = vd_now_ns();
  const uint64_t depart = c->busy_until > now ? c->busy_until : now;
  const uint64_t ser = (uint64_t)((double)bytes * c->ns_per_byte);
  c->busy_until = depart + ser;
  return depart + ser + c->lat_ns;
}

/* Pushes the WR's next packets. Returns packets pushed; stops at a full ring or the budget. */
static int tx_packets(struct vd_ctx *c, struct vd_qp *qp, struct vd_swr *w, int *budget) {
  char *data;
  struct vd_ring *r = vd_port_ring(w->dst_port, 0, &data);
  int n = 0;
  while (w->pkts_sent<w->npkts && * budget> 0) {
    if (!vd_port_live(w->dst_port, w->dst_gen)) {
      wr_fail(c, qp, w, qp->type == VD_T_RC ? IBV_WC_RETRY_EXC_ERR : IBV_WC_RESP_TIMEOUT_ERR);
      return n;
    }
    const uint64_t left = w->len - w->sent;
    const uint32_t len = (uint32_t)(left < VD_PKT_MAX ? left : VD_PKT_MAX);
    const uint32_t rec = (uint32_t)((VD_REC_ALIGN + len + VD_REC_ALIGN - 1) & ~(VD_REC_ALIGN - 1));
    uint64_t pos;
    struct vd_pkt *p = vd_ring_reserve(r, data, rec, &pos);
    if (!p)
      return n;
    memset((char *)p + sizeof(p->stamp), 0, sizeof(*p) - sizeof(p->stamp));
    p->rec_len = rec;
    p->kind = VD_REC_DATA;
    p->opcode = w->opcode;
    p->transport = (uint8_t)qp->type;
    p->src_port = c->slot;
    p->src_lid = c->lid;
    p->src_gen = c->gen;
    p->src_qpn = qp->qpx.qp_base.qp_num;
    p->dst_qpn = qp->type == VD_T_RC ? qp->remote_qpn : w->remote_qpn;
    p->seq = w->seq;
    p->remote_addr = w->remote_addr + w->sent;
    p->rkey = w->rkey;
    p->imm = w->imm;
    p->qkey = w->qkey;
    p->npkts = w->npkts;
    p->pkt_idx = w->pkts_sent;
    p->len = len;
    p->msg_off = w->sent;
    p->msg_len = w->len;
    if (gather(c, qp, w, w->sent, len, (char *)p + VD_REC_ALIGN) != 0) {
      p->kind = VD_REC_PAD; /* the slot is reserved: hand it back as padding */
      vd_ring_publish(p, pos);
      wr_fail(c, qp, w, IBV_WC_GENERAL_ERR);
      return n;
    }
    p->arrive_ns = shape(c, (uint64_t)len + VD_REC_ALIGN);
    vd_ring_publish(p, pos);
    w->sent += len;
    w->pkts_sent++;
    (*budget)--;
    n++;
    VD_STAT_ADD(packets_sent, 1);
    VD_STAT_ADD(bytes_sent, len);
  }
  return n;
}

static int tx_qp(struct vd_ctx *c, struct vd_qp *qp, int *budget) {
  const int st = atomic_load(&qp->state);
  if (st == IBV_QPS_ERR)
    return vd_qp_flush(qp);
  if (st != IBV_QPS_RTS)
    return 0;
  int work = 0;
  const uint64_t posted = atomic_load_explicit(&qp->sq_posted, memory_order_acquire);
  while (qp->sq_next<posted && * budget> 0) {
    struct vd_swr *w = vd_sq_slot(qp, qp->sq_next);
    if (w->state == VD_W_QUEUED) {
      if (qp->tx_err)
        break;
      const int r = tx_start(c, qp, w);
      if (r == 0 || r == -2)
        return work + (r == -2);
      if (r < 0) {
        qp->sq_next++;
        work++;
        continue;
      }
    }
    if (w->state == VD_W_SENDING) {
      work += tx_packets(c, qp, w, budget);
      if (w->state == VD_W_SENDING && w->pkts_sent == w->npkts) {
        w->state = VD_W_SENT;
        if (w->pkts_acked == w->npkts)
          vd_wr_done(c, qp, w);
      }
    }
    if (w->state == VD_W_SENDING)
      break; /* ring full or out of budget */
    qp->sq_next++;
  }
  return work;
}

int vd_tx(struct vd_ctx *c) {
  if (atomic_load_explicit(&c->silent, memory_order_relaxed))
    return 0;
  int budget = VD_TX_BUDGET, work = 0;
  for (uint32_t i = 0; i < c->nqp_hi; i++)
    if (c->qps[i])
      work += tx_qp(c, c->qps[i], &budget);
  return work;
}

static void emit(struct vd_qp *qp, struct vd_swr *w) {
  if (w->signaled || w->status != IBV_WC_SUCCESS) {
    struct ibv_wc wc = {.wr_id = w->wr_id,
                        .status = (enum ibv_wc_status)w->status,
                        .opcode = w->opcode == VD_OP_SEND ? IBV_WC_SEND : IBV_WC_RDMA_WRITE,
                        .byte_len = (uint32_t)w->len,
                        .qp_num = qp->qpx.qp_base.qp_num};
    vd_emit(qp->scq, &wc);
  }
  w->state = VD_W_EMITTED;
  atomic_fetch_add_explicit(&qp->sq_emitted, 1, memory_order_release);
}

static int complete_qp(struct vd_qp *qp) {
  int work = 0, fatal = 0;
  uint64_t head = atomic_load(&qp->sq_head);
  if (qp->type == VD_T_RC) {
    while (head < qp->sq_next && !fatal) {
      struct vd_swr *w = vd_sq_slot(qp, head);
      if (w->state != VD_W_DONE)
        break;
      fatal = w->status != IBV_WC_SUCCESS;
      emit(qp, w);
      head++;
      work++;
    }
  } else if (qp->done_pending) {
    const uint64_t now = vd_now_ns();
    for (uint64_t i = head; i < qp->sq_next && !fatal; i++) {
      struct vd_swr *w = vd_sq_slot(qp, i);
      if (w->state != VD_W_DONE || w->due_ns > now)
        continue;
      fatal = w->fatal;
      emit(qp, w);
      qp->done_pending--;
      work++;
    }
    while (head < qp->sq_next && vd_sq_slot(qp, head)->state == VD_W_EMITTED)
      head++;
  }
  atomic_store_explicit(&qp->sq_head, head, memory_order_release);
  if (fatal)
    vd_qp_to_error(qp);
  return work;
}

int vd_complete(struct vd_ctx *c) {
  int work = 0;
  for (uint32_t i = 0; i < c->nqp_hi; i++) {
    struct vd_qp *qp = c->qps[i];
    if (qp && atomic_load(&qp->state) != IBV_QPS_ERR)
      work += complete_qp(qp);
  }
  if (c->overrun) {
    c->overrun = 0;
    for (uint32_t i = 0; i < c->nqp_hi; i++) {
      struct vd_qp *qp = c->qps[i];
      if (qp && atomic_load(&qp->state) != IBV_QPS_ERR &&
          (vd_cq_overflowed(qp->scq) || vd_cq_overflowed(qp->rcq)))
        vd_qp_to_error(qp);
    }
  }
  return work;
}

static void sleep_ns(long ns) {
  struct timespec ts = {0, ns};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static void *engine_main(void *arg) {
  struct vd_ctx *c = arg;
  char name[16];
  snprintf(name, sizeof(name), "tw-vd-%u", (unsigned)c->lid);
  pthread_setname_np(pthread_self(), name);
  /* short sleeps should be short: the default 50 us slack would double them */
  if (prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) != 0)
    fprintf(stderr, "tw-verbs-double: prctl(PR_SET_TIMERSLACK): %s\n", strerror(errno));
  uint64_t idle = 0;
  while (!atomic_load_explicit(&c->stop, memory_order_acquire)) {
    vd_lock(&c->lock);
    int work = vd_rx_acks(c);
    work += vd_rx_data(c);
    work += vd_flush_backlog(c);
    work += vd_tx(c);
    work += vd_complete(c);
    vd_unlock(&c->lock);
    if (work) {
      idle = 0;
      continue;
    }
    /* idle: spin a little, then sleep 20 us, and 50 us once idle for long */
    idle++;
    if (idle < 32)
      sched_yield();
    else
      sleep_ns(idle < 2000 ? 20000 : 50000);
  }
  return NULL;
}

int vd_engine_start(struct vd_ctx *c) {
  int e = pthread_create(&c->thread, NULL, engine_main, c);
  if (e) {
    fprintf(stderr, "tw-verbs-double: pthread_create(engine): %s\n", strerror(e));
    return e;
  }
  c->started = 1;
  return 0;
}

void vd_engine_stop(struct vd_ctx *c) {
  if (!c->started)
    return;
  atomic_store_explicit(&c->stop, 1, memory_order_release);
  int e = pthread_join(c->thread, NULL);
  if (e)
    fprintf(stderr, "tw-verbs-double: pthread_join(engine): %s\n", strerror(e));
  c->started = 0;
}
