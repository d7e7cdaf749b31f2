/*
 * Posting: ibv_post_send (RC), ibv_post_recv (both kinds) and the ibv_qp_ex WR builder
 * (wr_start .. wr_complete; SRD sends use only this). A send WR's local SGEs are resolved to
 * addresses when it is posted (a bad lkey or range makes it complete with IBV_WC_LOC_PROT_ERR);
 * inline bytes are copied then. Slots in [sq_posted, sq_tail) belong to the poster (sq_lock);
 * the engine reads only slots below sq_posted, published with a release store.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "vd.h"

static uint8_t *inline_buf(struct vd_qp *qp, struct vd_swr *w) {
  return (uint8_t *)(w->sge + qp->max_send_sge);
}

/* Room for one more WR: fewer than max_send_wr outstanding, and a free slot. */
static int sq_has_room(struct vd_qp *qp) {
  return qp->sq_tail - atomic_load_explicit(&qp->sq_emitted, memory_order_acquire) <
             qp->max_send_wr &&
         qp->sq_tail - atomic_load_explicit(&qp->sq_head, memory_order_acquire) <= qp->sq_mask;
}

static struct vd_swr *sq_new(struct vd_qp *qp, int opcode, uint64_t wr_id, int signaled) {
  struct vd_swr *w = vd_sq_slot(qp, qp->sq_tail);
  memset(w, 0, sizeof(*w));
  w->wr_id = wr_id;
  w->seq = qp->sq_tail;
  w->opcode = (uint8_t)opcode;
  w->signaled = (uint8_t)(signaled || qp->sq_sig_all);
  w->status = IBV_WC_SUCCESS;
  w->state = VD_W_QUEUED;
  return w;
}

/* Resolves the local SGEs; a bad one marks the WR for IBV_WC_LOC_PROT_ERR. */
static void set_sges(struct vd_qp *qp, struct vd_swr *w, const struct ibv_sge *sg, size_t n) {
  uint64_t total = 0;
  w->nsge = 0;
  w->inl = 0;
  for (size_t i = 0; i < n; i++) {
    if (!sg[i].length)
      continue;
    struct vd_mr_view m;
    char *p = NULL;
    if (vd_mr_find(qp->ctx, sg[i].lkey, &m) == 0 && m.pd == qp->qpx.qp_base.pd)
      p = vd_mr_translate(&m, sg[i].addr, sg[i].length);
    if (!p) {
      w->status = IBV_WC_LOC_PROT_ERR;
      continue;
    }
    w->sge[w->nsge].ptr = p;
    w->sge[w->nsge].len = sg[i].length;
    w->sge[w->nsge].dev = m.dev;
    w->nsge++;
    total += sg[i].length;
  }
  w->len = total;
  if (total > VD_MAX_MSG && w->status == IBV_WC_SUCCESS)
    w->status = IBV_WC_LOC_LEN_ERR;
}

/* Copies inline bytes now; EINVAL when they exceed max_inline_data. */
static int set_inline(struct vd_qp *qp, struct vd_swr *w, size_t n, const struct ibv_data_buf *b) {
  size_t total = 0;
  for (size_t i = 0; i < n; i++)
    total += b[i].length;
  if (total > qp->max_inline)
    return EINVAL;
  uint8_t *dst = inline_buf(qp, w);
  for (size_t i = 0; i < n; i++) {
    memcpy(dst, b[i].addr, b[i].length);
    dst += b[i].length;
  }
  w->inl = 1;
  w->nsge = 0;
  w->len = total;
  return 0;
}

static int post_one(struct vd_qp *qp, const struct ibv_send_wr *wr) {
  int opcode;
  switch (wr->opcode) {
  case IBV_WR_RDMA_WRITE: opcode = VD_OP_WRITE; break;
  case IBV_WR_RDMA_WRITE_WITH_IMM: opcode = VD_OP_WRITE_IMM; break;
  case IBV_WR_SEND: opcode = VD_OP_SEND; break;
  default: return EINVAL;
  }
  if (wr->num_sge < 0 || (uint32_t)wr->num_sge > qp->max_send_sge ||
      (wr->num_sge > 0 && !wr->sg_list))
    return EINVAL;
  if (!sq_has_room(qp))
    return ENOMEM;
  struct vd_swr *w = sq_new(qp, opcode, wr->wr_id, (wr->send_flags & IBV_SEND_SIGNALED) != 0);
  if (wr->send_flags & IBV_SEND_INLINE) {
    struct ibv_data_buf bufs[VD_MAX_SGE];
    for (int i = 0; i < wr->num_sge; i++) {
      bufs[i].addr = (void *)(uintptr_t)wr->sg_list[i].addr;
      bufs[i].length = wr->sg_list[i].length;
    }
    if (set_inline(qp, w, (size_t)wr->num_sge, bufs) != 0)
      return EINVAL;
  } else {
    set_sges(qp, w, wr->sg_list, (size_t)wr->num_sge);
  }
  if (opcode != VD_OP_SEND) {
    w->rkey = wr->wr.rdma.rkey;
    w->remote_addr = wr->wr.rdma.remote_addr;
  }
  if (opcode == VD_OP_WRITE_IMM)
    w->imm = wr->imm_data;
  qp->sq_tail++;
  return 0;
}

int vd_post_send(struct ibv_qp *ibqp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
  struct vd_qp *qp = (struct vd_qp *)ibqp;
  int err = 0;
  if (qp->type != VD_T_RC) {
    err = EOPNOTSUPP; /* SRD sends go through the ibv_qp_ex builder */
  } else {
    const int st = atomic_load(&qp->state);
    if (st != IBV_QPS_RTS && st != IBV_QPS_ERR) /* in the error state: accepted, flushed */
      err = EINVAL;
  }
  if (err) {
    if (bad)
      *bad = wr;
    return err;
  }
  vd_lock(&qp->sq_lock);
  for (; wr; wr = wr->next) {
    err = post_one(qp, wr);
    if (err)
      break;
  }
  atomic_store_explicit(&qp->sq_posted, qp->sq_tail, memory_order_release);
  vd_unlock(&qp->sq_lock);
  if (err && bad)
    *bad = wr;
  return err;
}

int vd_post_recv(struct ibv_qp *ibqp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
  struct vd_qp *qp = (struct vd_qp *)ibqp;
  int err = 0;
  int64_t added = 0;
  const int st = atomic_load(&qp->state);
  if (st == IBV_QPS_RESET) {
    if (bad)
      *bad = wr;
    return EINVAL;
  }
  vd_lock(&qp->rq_lock);
  for (; wr; wr = wr->next) {
    if (wr->num_sge < 0 || (uint32_t)wr->num_sge > qp->max_recv_sge ||
        (wr->num_sge > 0 && !wr->sg_list)) {
      err = EINVAL;
      break;
    }
    if (qp->rq_tail - qp->rq_head >= qp->max_recv_wr) {
      err = ENOMEM;
      break;
    }
    struct vd_rwr *r = vd_rq_slot(qp, qp->rq_tail);
    r->wr_id = wr->wr_id;
    r->nsge = (uint32_t)wr->num_sge;
    if (wr->num_sge)
      memcpy(r->sge, wr->sg_list, (size_t)wr->num_sge * sizeof(struct ibv_sge));
    qp->rq_tail++;
    added++;
  }
  vd_unlock(&qp->rq_lock);
  /* credits after the WRs are queued: a sender that claims one finds its receive there */
  if (added && atomic_load(&qp->state) != IBV_QPS_ERR)
    atomic_fetch_add(&vd_fab_qp(ibqp->qp_num)->credits, added);
  if (err && bad)
    *bad = wr;
  return err;
}

int vd_rq_pop(struct vd_qp *qp, uint64_t *wr_id, struct ibv_sge *sge, uint32_t *nsge) {
  int rc = -1;
  vd_lock(&qp->rq_lock);
  if (qp->rq_head != qp->rq_tail) {
    struct vd_rwr *r = vd_rq_slot(qp, qp->rq_head);
    *wr_id = r->wr_id;
    *nsge = r->nsge;
    memcpy(sge, r->sge, r->nsge * sizeof(struct ibv_sge));
    qp->rq_head++;
    rc = 0;
  }
  vd_unlock(&qp->rq_lock);
  return rc;
}

/* ---- the ibv_qp_ex builder. wr_start takes sq_lock; wr_complete / wr_abort release it. */

static struct vd_qp *QX(struct ibv_qp_ex *x) { return (struct vd_qp *)x; }

static void bx_fail(struct vd_qp *qp, int err) {
  if (!qp->batch_err)
    qp->batch_err = err;
}

/* The WR the last wr_<op> started, or NULL */
static struct vd_swr *bx_cur(struct vd_qp *qp) {
  if (!qp->in_batch || qp->sq_tail == qp->batch_start || qp->batch_err)
    return NULL;
  return vd_sq_slot(qp, qp->sq_tail - 1);
}

static struct vd_swr *bx_new(struct ibv_qp_ex *x, int opcode, uint64_t op_flag) {
  struct vd_qp *qp = QX(x);
  if (!qp->in_batch || qp->batch_err) {
    bx_fail(qp, EINVAL);
    return NULL;
  }
  if (!(qp->send_ops_flags & op_flag)) {
    bx_fail(qp, EOPNOTSUPP); /* not among the QP's send_ops_flags */
    return NULL;
  }
  if (!sq_has_room(qp)) {
    bx_fail(qp, ENOMEM);
    return NULL;
  }
  struct vd_swr *w = sq_new(qp, opcode, x->wr_id, (x->wr_flags & IBV_SEND_SIGNALED) != 0);
  qp->sq_tail++;
  return w;
}

static void bx_start(struct ibv_qp_ex *x) {
  struct vd_qp *qp = QX(x);
  vd_lock(&qp->sq_lock);
  qp->in_batch = 1;
  qp->batch_start = qp->sq_tail;
  qp->batch_err = 0;
}

static void bx_write(struct ibv_qp_ex *x, uint32_t rkey, uint64_t addr) {
  struct vd_swr *w = bx_new(x, VD_OP_WRITE, IBV_QP_EX_WITH_RDMA_WRITE);
  if (w) {
    w->rkey = rkey;
    w->remote_addr = addr;
  }
}

static void bx_write_imm(struct ibv_qp_ex *x, uint32_t rkey, uint64_t addr, __be32 imm) {
  struct vd_swr *w = bx_new(x, VD_OP_WRITE_IMM, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM);
  if (w) {
    w->rkey = rkey;
    w->remote_addr = addr;
    w->imm = imm;
  }
}

static void bx_send(struct ibv_qp_ex *x) { bx_new(x, VD_OP_SEND, IBV_QP_EX_WITH_SEND); }

static void bx_set_sge(struct ibv_qp_ex *x, uint32_t lkey, uint64_t addr, uint32_t length) {
  struct vd_qp *qp = QX(x);
  struct vd_swr *w = bx_cur(qp);
  struct ibv_sge sge = {.addr = addr, .length = length, .lkey = lkey};
  if (!w)
    bx_fail(qp, EINVAL);
  else if (qp->max_send_sge < 1)
    bx_fail(qp, EINVAL);
  else
    set_sges(qp, w, &sge, 1);
}

static void bx_set_sge_list(struct ibv_qp_ex *x, size_t n, const struct ibv_sge *sg) {
  struct vd_qp *qp = QX(x);
  struct vd_swr *w = bx_cur(qp);
  if (!w || n > qp->max_send_sge || (n && !sg))
    bx_fail(qp, EINVAL);
  else
    set_sges(qp, w, sg, n);
}

static void bx_set_inline(struct ibv_qp_ex *x, void *addr, size_t length) {
  struct vd_qp *qp = QX(x);
  struct vd_swr *w = bx_cur(qp);
  struct ibv_data_buf b = {.addr = addr, .length = length};
  if (!w || set_inline(qp, w, 1, &b) != 0)
    bx_fail(qp, EINVAL);
}

static void bx_set_inline_list(struct ibv_qp_ex *x, size_t n, const struct ibv_data_buf *b) {
  struct vd_qp *qp = QX(x);
  struct vd_swr *w = bx_cur(qp);
  if (!w || n > VD_MAX_SGE || set_inline(qp, w, n, b) != 0)
    bx_fail(qp, EINVAL);
}

static void bx_set_ud_addr(struct ibv_qp_ex *x, struct ibv_ah *ah, uint32_t qpn, uint32_t qkey) {
  struct vd_qp *qp = QX(x);
  struct vd_swr *w = bx_cur(qp);
  if (!w || !ah) {
    bx_fail(qp, EINVAL);
    return;
  }
  w->dest = ((struct vd_ah *)ah)->addr;
  w->remote_qpn = qpn;
  w->qkey = qkey;
  w->has_dest = 1;
}

static void bx_rollback(struct vd_qp *qp) {
  qp->sq_tail = qp->batch_start;
  qp->in_batch = 0;
  vd_unlock(&qp->sq_lock);
}

static int bx_complete(struct ibv_qp_ex *x) {
  struct vd_qp *qp = QX(x);
  if (!qp->in_batch)
    return EINVAL;
  int err = qp->batch_err;
  const int st = atomic_load(&qp->state);
  if (!err && st != IBV_QPS_RTS && st != IBV_QPS_ERR)
    err = EINVAL;
  for (uint64_t i = qp->batch_start; !err && i < qp->sq_tail; i++)
    if (qp->type == VD_T_SRD && !vd_sq_slot(qp, i)->has_dest)
      err = EINVAL; /* an SRD WR without wr_set_ud_addr */
  if (err) {
    bx_rollback(qp);
    return err;
  }
  atomic_store_explicit(&qp->sq_posted, qp->sq_tail, memory_order_release);
  qp->in_batch = 0;
  vd_unlock(&qp->sq_lock);
  return 0;
}

static void bx_abort(struct ibv_qp_ex *x) {
  struct vd_qp *qp = QX(x);
  if (qp->in_batch)
    bx_rollback(qp);
}

/* Operations the double does not emulate: the batch fails at wr_complete with EOPNOTSUPP. */
static void bx_no_cas(struct ibv_qp_ex *x, uint32_t r, uint64_t a, uint64_t c, uint64_t s) {
  (void)r, (void)a, (void)c, (void)s;
  bx_fail(QX(x), EOPNOTSUPP);
}
static void bx_no_fadd(struct ibv_qp_ex *x, uint32_t r, uint64_t a, uint64_t add) {
  (void)r, (void)a, (void)add;
  bx_fail(QX(x), EOPNOTSUPP);
}
static void bx_no_bind(struct ibv_qp_ex *x, struct ibv_mw *mw, uint32_t r,
                       const struct ibv_mw_bind_info *b) {
  (void)mw, (void)r, (void)b;
  bx_fail(QX(x), EOPNOTSUPP);
}
static void bx_no_key(struct ibv_qp_ex *x, uint32_t key) {
  (void)key;
  bx_fail(QX(x), EOPNOTSUPP);
}
static void bx_no_read(struct ibv_qp_ex *x, uint32_t r, uint64_t a) {
  (void)r, (void)a;
  bx_fail(QX(x), EOPNOTSUPP);
}
static void bx_no_send_imm(struct ibv_qp_ex *x, __be32 imm) {
  (void)imm;
  bx_fail(QX(x), EOPNOTSUPP);
}
static void bx_no_tso(struct ibv_qp_ex *x, void *h, uint16_t hs, uint16_t mss) {
  (void)h, (void)hs, (void)mss;
  bx_fail(QX(x), EOPNOTSUPP);
}
static void bx_no_atomic_write(struct ibv_qp_ex *x, uint32_t r, uint64_t a, const void *w) {
  (void)r, (void)a, (void)w;
  bx_fail(QX(x), EOPNOTSUPP);
}

void vd_qpx_init(struct vd_qp *qp) {
  struct ibv_qp_ex *x = &qp->qpx;
  x->comp_mask = 0;
  x->wr_atomic_cmp_swp = bx_no_cas;
  x->wr_atomic_fetch_add = bx_no_fadd;
  x->wr_bind_mw = bx_no_bind;
  x->wr_local_inv = bx_no_key;
  x->wr_rdma_read = bx_no_read;
  x->wr_rdma_write = bx_write;
  x->wr_rdma_write_imm = bx_write_imm;
  x->wr_send = bx_send;
  x->wr_send_imm = bx_no_send_imm;
  x->wr_send_inv = bx_no_key;
  x->wr_send_tso = bx_no_tso;
  x->wr_set_ud_addr = bx_set_ud_addr;
  x->wr_set_xrc_srqn = bx_no_key;
  x->wr_set_inline_data = bx_set_inline;
  x->wr_set_inline_data_list = bx_set_inline_list;
  x->wr_set_sge = bx_set_sge;
  x->wr_set_sge_list = bx_set_sge_list;
  x->wr_start = bx_start;
  x->wr_complete = bx_complete;
  x->wr_abort = bx_abort;
  x->wr_atomic_write = bx_no_atomic_write;
}
