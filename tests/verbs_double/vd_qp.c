/*
 * Queue pairs: RC (mlx5 kind, ibv_create_qp) and SRD (EFA kind, efadv_create_qp_ex, qp_type
 * IBV_QPT_DRIVER), the state machine of ibv_modify_qp, the error state and its flushes, and
 * efadv_query_device.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vd.h"

static uint64_t pow2_at_least(uint64_t v) {
  uint64_t p = 2;
  while (p < v)
    p <<= 1;
  return p;
}

struct vd_swr *vd_sq_slot(struct vd_qp *qp, uint64_t idx) {
  return (struct vd_swr *)(qp->sq + (idx & qp->sq_mask) * qp->sq_stride);
}

struct vd_rwr *vd_rq_slot(struct vd_qp *qp, uint64_t idx) {
  return (struct vd_rwr *)(qp->rq +
                           (idx % (qp->max_recv_wr ? qp->max_recv_wr : 1)) * qp->rq_stride);
}

struct vd_qp *vd_qp_by_num(struct vd_ctx *c, uint32_t qpn) {
  struct vd_fab_qp *e = vd_fab_qp(qpn);
  if (atomic_load_explicit(&e->qpn, memory_order_acquire) != qpn || e->port != c->slot ||
      atomic_load(&e->port_gen) != c->gen || e->local_idx >= VD_MAX_QP)
    return NULL;
  struct vd_qp *qp = c->qps[e->local_idx];
  return qp && qp->qpx.qp_base.qp_num == qpn ? qp : NULL;
}

struct vd_qp_req {
  struct ibv_pd *pd;
  struct ibv_cq *send_cq, *recv_cq;
  struct ibv_srq *srq;
  struct ibv_qp_cap *cap;
  void *qp_context;
  int sq_sig_all;
  int type;
  enum ibv_qp_type qp_type;
  uint64_t send_ops_flags;
};

static int check_caps(struct vd_ctx *c, const struct vd_qp_req *r) {
  const struct ibv_qp_cap *cap = r->cap;
  if (!r->pd || r->pd->context != &c->ctx || !r->send_cq || !r->recv_cq ||
      r->send_cq->context != &c->ctx || r->recv_cq->context != &c->ctx)
    return EINVAL;
  if (r->srq)
    return EOPNOTSUPP;
  if (cap->max_send_wr > VD_MAX_WR || cap->max_recv_wr > VD_MAX_WR ||
      cap->max_send_sge > VD_MAX_SGE || cap->max_recv_sge > VD_MAX_SGE)
    return EINVAL;
  /* SRD reports inline_buf_size 0 (efadv_query_device): no inline sends */
  if (cap->max_inline_data > (r->type == VD_T_RC ? VD_MAX_INLINE : 0))
    return EINVAL;
  return 0;
}

static struct vd_qp *qp_alloc(const struct vd_qp_req *r) {
  const struct ibv_qp_cap *cap = r->cap;
  struct vd_qp *qp = calloc(1, sizeof(*qp));
  if (!qp)
    return NULL;
  qp->type = r->type;
  qp->max_send_wr = cap->max_send_wr;
  qp->max_recv_wr = cap->max_recv_wr;
  qp->max_send_sge = cap->max_send_sge;
  qp->max_recv_sge = cap->max_recv_sge;
  qp->max_inline = cap->max_inline_data;
  qp->sq_sig_all = r->sq_sig_all;
  qp->send_ops_flags = r->send_ops_flags;
  /* twice the WRs: an SRD slot is reused only after every older one completed */
  const uint64_t slots = pow2_at_least(2ull * (cap->max_send_wr ? cap->max_send_wr : 1));
  qp->sq_mask = slots - 1;
  qp->sq_stride = (sizeof(struct vd_swr) + cap->max_send_sge * sizeof(struct vd_sge) +
                   cap->max_inline_data + 7) &
                  ~(size_t)7;
  qp->sq = calloc(slots, qp->sq_stride);
  qp->rq_stride = sizeof(struct vd_rwr) + cap->max_recv_sge * sizeof(struct ibv_sge);
  qp->rq = calloc(cap->max_recv_wr ? cap->max_recv_wr : 1, qp->rq_stride);
  if (!qp->sq || !qp->rq) {
    free(qp->sq);
    free(qp->rq);
    free(qp);
    return NULL;
  }
  pthread_mutex_init(&qp->sq_lock, NULL);
  pthread_mutex_init(&qp->rq_lock, NULL);
  return qp;
}

static void qp_release(struct vd_qp *qp) {
  pthread_mutex_destroy(&qp->sq_lock);
  pthread_mutex_destroy(&qp->rq_lock);
  free(qp->parts);
  free(qp->sq);
  free(qp->rq);
  free(qp);
}

static struct ibv_qp *qp_create(struct vd_ctx *c, const struct vd_qp_req *r) {
  int err = check_caps(c, r);
  struct vd_qp *qp = NULL;
  if (err)
    goto fail;
  qp = qp_alloc(r);
  if (!qp) {
    err = ENOMEM;
    goto fail;
  }
  qp->ctx = c;
  qp->scq = (struct vd_cq *)r->send_cq;
  qp->rcq = (struct vd_cq *)r->recv_cq;
  struct ibv_qp *b = &qp->qpx.qp_base;
  b->context = &c->ctx;
  b->qp_context = r->qp_context;
  b->pd = r->pd;
  b->send_cq = r->send_cq;
  b->recv_cq = r->recv_cq;
  b->srq = NULL;
  b->state = IBV_QPS_RESET;
  b->qp_type = r->qp_type;
  pthread_mutex_init(&b->mutex, NULL);
  pthread_cond_init(&b->cond, NULL);
  atomic_store(&qp->state, IBV_QPS_RESET);
  vd_qpx_init(qp);
  vd_lock(&c->lock);
  uint32_t idx = 0;
  while (idx < VD_MAX_QP && c->qps[idx])
    idx++;
  uint32_t qpn = idx < VD_MAX_QP ? vd_qpn_alloc(c, idx, r->type) : 0;
  if (qpn) {
    qp->idx = idx;
    b->handle = idx;
    b->qp_num = qpn;
    c->qps[idx] = qp;
    if (idx + 1 > c->nqp_hi)
      c->nqp_hi = idx + 1;
    qp->scq->users++;
    qp->rcq->users++;
  }
  vd_unlock(&c->lock);
  if (!qpn) {
    err = ENOMEM;
    goto fail;
  }
  return b;
fail:
  if (qp)
    qp_release(qp);
  errno = err;
  return NULL;
}

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr) {
  if (!pd || !attr) {
    errno = EINVAL;
    return NULL;
  }
  struct vd_ctx *c = (struct vd_ctx *)pd->context;
  /* EFA has no RC (and the double emulates no UD): SRD comes from efadv_create_qp_ex */
  if (c->kind != VD_KIND_MLX5 || attr->qp_type != IBV_QPT_RC) {
    errno = EOPNOTSUPP;
    return NULL;
  }
  struct vd_qp_req r = {.pd = pd,
                        .send_cq = attr->send_cq,
                        .recv_cq = attr->recv_cq,
                        .srq = attr->srq,
                        .cap = &attr->cap,
                        .qp_context = attr->qp_context,
                        .sq_sig_all = attr->sq_sig_all,
                        .type = VD_T_RC,
                        .qp_type = IBV_QPT_RC,
                        .send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE |
                                          IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND};
  return qp_create(c, &r);
}

struct ibv_qp *efadv_create_qp_ex(struct ibv_context *ibvctx, struct ibv_qp_init_attr_ex *attr_ex,
                                  struct efadv_qp_init_attr *efa_attr, uint32_t inlen) {
  struct vd_ctx *c = (struct vd_ctx *)ibvctx;
  const uint64_t ops_known =
      IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND;
  if (!c || !attr_ex || !efa_attr) {
    errno = EINVAL;
    return NULL;
  }
  if (c->kind != VD_KIND_EFA) {
    errno = EOPNOTSUPP;
    return NULL;
  }
  if (inlen < offsetof(struct efadv_qp_init_attr, reserved) ||
      efa_attr->driver_qp_type != EFADV_QP_DRIVER_TYPE_SRD || attr_ex->qp_type != IBV_QPT_DRIVER ||
      !(attr_ex->comp_mask & IBV_QP_INIT_ATTR_PD)) {
    errno = EINVAL;
    return NULL;
  }
  uint64_t ops = 0;
  if (attr_ex->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) {
    ops = attr_ex->send_ops_flags;
    if (ops & ~ops_known) {
      errno = EOPNOTSUPP;
      return NULL;
    }
  }
  struct vd_qp_req r = {.pd = attr_ex->pd,
                        .send_cq = attr_ex->send_cq,
                        .recv_cq = attr_ex->recv_cq,
                        .srq = attr_ex->srq,
                        .cap = &attr_ex->cap,
                        .qp_context = attr_ex->qp_context,
                        .sq_sig_all = attr_ex->sq_sig_all,
                        .type = VD_T_SRD,
                        .qp_type = IBV_QPT_DRIVER,
                        .send_ops_flags = ops};
  return qp_create(c, &r);
}

struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *qp) {
  return qp ? &((struct vd_qp *)qp)->qpx : NULL;
}

int ibv_destroy_qp(struct ibv_qp *ibqp) {
  if (!ibqp)
    return EINVAL;
  struct vd_qp *qp = (struct vd_qp *)ibqp;
  struct vd_ctx *c = qp->ctx;
  vd_lock(&c->lock);
  c->qps[qp->idx] = NULL;
  while (c->nqp_hi && !c->qps[c->nqp_hi - 1])
    c->nqp_hi--;
  qp->scq->users--;
  qp->rcq->users--;
  vd_qpn_free(ibqp->qp_num);
  vd_unlock(&c->lock);
  pthread_mutex_destroy(&ibqp->mutex);
  pthread_cond_destroy(&ibqp->cond);
  qp_release(qp);
  return 0;
}

static int wc_opcode(int op) { return op == VD_OP_SEND ? IBV_WC_SEND : IBV_WC_RDMA_WRITE; }

int vd_qp_flush(struct vd_qp *qp) {
  int n = 0;
  const uint32_t qpn = qp->qpx.qp_base.qp_num;
  const uint64_t posted = atomic_load_explicit(&qp->sq_posted, memory_order_acquire);
  for (uint64_t i = atomic_load(&qp->sq_head); i < posted; i++) {
    struct vd_swr *w = vd_sq_slot(qp, i);
    if (w->state == VD_W_EMITTED)
      continue;
    /* a WR already done keeps its own status; the rest are flushed, signaled or not */
    struct ibv_wc wc = {.wr_id = w->wr_id,
                        .status = w->state == VD_W_DONE ? (enum ibv_wc_status)w->status
                                                        : IBV_WC_WR_FLUSH_ERR,
                        .opcode = wc_opcode(w->opcode),
                        .qp_num = qpn};
    if (wc.status != IBV_WC_SUCCESS || w->signaled)
      vd_emit(qp->scq, &wc);
    if (wc.status == IBV_WC_WR_FLUSH_ERR)
      VD_STAT_ADD(flushed, 1);
    w->state = VD_W_EMITTED;
    atomic_fetch_add(&qp->sq_emitted, 1);
    n++;
  }
  atomic_store(&qp->sq_head, posted);
  qp->sq_next = posted;
  qp->done_pending = 0;
  uint64_t wr_id;
  struct ibv_sge sge[VD_MAX_SGE];
  uint32_t nsge;
  while (vd_rq_pop(qp, &wr_id, sge, &nsge) == 0) {
    struct ibv_wc wc = {
        .wr_id = wr_id, .status = IBV_WC_WR_FLUSH_ERR, .opcode = IBV_WC_RECV, .qp_num = qpn};
    vd_emit(qp->rcq, &wc);
    VD_STAT_ADD(flushed, 1);
    n++;
  }
  qp->nparts = 0;
  return n;
}

/* The state, where the caller sees it (qp->state) and where senders do (the fabric entry) */
static void set_state(struct vd_qp *qp, int st) {
  atomic_store(&qp->state, st);
  qp->qpx.qp_base.state = (enum ibv_qp_state)st;
  atomic_store(&vd_fab_qp(qp->qpx.qp_base.qp_num)->state, (uint32_t)st);
}

void vd_qp_to_error(struct vd_qp *qp) {
  set_state(qp, IBV_QPS_ERR);
  atomic_store(&vd_fab_qp(qp->qpx.qp_base.qp_num)->credits, 0);
  vd_qp_flush(qp);
}

/* RESET: every queued WR is dropped without a completion, as the real one does. */
static void qp_reset(struct vd_qp *qp) {
  const uint64_t posted = atomic_load(&qp->sq_posted);
  const uint64_t head = atomic_load(&qp->sq_head);
  atomic_fetch_add(&qp->sq_emitted, posted - head);
  atomic_store(&qp->sq_head, posted);
  qp->sq_next = posted;
  qp->done_pending = 0;
  qp->tx_err = 0;
  vd_lock(&qp->rq_lock);
  qp->rq_head = qp->rq_tail;
  vd_unlock(&qp->rq_lock);
  atomic_store(&vd_fab_qp(qp->qpx.qp_base.qp_num)->credits, 0);
  qp->nparts = 0;
  qp->c_valid = 0;
}

struct vd_trans {
  int from, to, type;
  int req, opt;
};

#define M(x) IBV_QP_##x
static const struct vd_trans g_trans[] = {
    {IBV_QPS_RESET, IBV_QPS_INIT, VD_T_RC, M(STATE) | M(PKEY_INDEX) | M(PORT) | M(ACCESS_FLAGS), 0},
    {IBV_QPS_INIT, IBV_QPS_INIT, VD_T_RC, M(STATE), M(PKEY_INDEX) | M(PORT) | M(ACCESS_FLAGS)},
    {IBV_QPS_INIT, IBV_QPS_RTR, VD_T_RC,
     M(STATE) | M(AV) | M(PATH_MTU) | M(DEST_QPN) | M(RQ_PSN) | M(MAX_DEST_RD_ATOMIC) |
         M(MIN_RNR_TIMER),
     M(PKEY_INDEX) | M(ACCESS_FLAGS) | M(ALT_PATH)},
    {IBV_QPS_RTR, IBV_QPS_RTS, VD_T_RC,
     M(STATE) | M(TIMEOUT) | M(RETRY_CNT) | M(RNR_RETRY) | M(SQ_PSN) | M(MAX_QP_RD_ATOMIC),
     M(CUR_STATE) | M(ACCESS_FLAGS) | M(MIN_RNR_TIMER) | M(ALT_PATH) | M(PATH_MIG_STATE)},
    {IBV_QPS_RTS, IBV_QPS_RTS, VD_T_RC, M(STATE),
     M(CUR_STATE) | M(ACCESS_FLAGS) | M(MIN_RNR_TIMER) | M(ALT_PATH) | M(PATH_MIG_STATE)},
    {IBV_QPS_RESET, IBV_QPS_INIT, VD_T_SRD, M(STATE) | M(PKEY_INDEX) | M(PORT) | M(QKEY), 0},
    {IBV_QPS_INIT, IBV_QPS_INIT, VD_T_SRD, M(STATE), M(PKEY_INDEX) | M(PORT) | M(QKEY)},
    {IBV_QPS_INIT, IBV_QPS_RTR, VD_T_SRD, M(STATE), M(PKEY_INDEX) | M(QKEY)},
    {IBV_QPS_RTR, IBV_QPS_RTS, VD_T_SRD, M(STATE) | M(SQ_PSN),
     M(CUR_STATE) | M(QKEY) | M(RNR_RETRY)},
    {IBV_QPS_RTS, IBV_QPS_RTS, VD_T_SRD, M(STATE), M(CUR_STATE) | M(QKEY) | M(RNR_RETRY)},
};

/* 0 when (cur -> to, mask) is a transition the real QP accepts; else EINVAL. */
static int check_transition(const struct vd_qp *qp, int cur, int to, int mask) {
  if (to == IBV_QPS_RESET || to == IBV_QPS_ERR)
    return (mask & ~(M(STATE) | M(CUR_STATE))) ? EINVAL : 0;
  if (cur == IBV_QPS_ERR)
    return EINVAL;
  for (size_t i = 0; i < sizeof(g_trans) / sizeof(g_trans[0]); i++) {
    const struct vd_trans *t = &g_trans[i];
    if (t->from != cur || t->to != to || t->type != qp->type)
      continue;
    const int req = t->req | M(STATE);
    const int m = mask | M(STATE);
    return ((m & req) == req && !(m & ~(req | t->opt))) ? 0 : EINVAL;
  }
  return EINVAL;
}

static int check_values(const struct ibv_qp_attr *a, int mask) {
  if ((mask & M(PORT)) && a->port_num != 1)
    return EINVAL;
  if ((mask & M(PKEY_INDEX)) && a->pkey_index != 0)
    return EINVAL;
  if ((mask & M(PATH_MTU)) && (a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096))
    return EINVAL;
  if ((mask & M(DEST_QPN)) && (a->dest_qp_num == 0 || a->dest_qp_num > 0xFFFFFF))
    return EINVAL;
  if ((mask & M(AV)) && !a->ah_attr.is_global && a->ah_attr.dlid == 0)
    return EINVAL;
  return 0;
}

int ibv_modify_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *attr, int mask) {
  if (!ibqp || !attr) {
    errno = EINVAL;
    return EINVAL;
  }
  struct vd_qp *qp = (struct vd_qp *)ibqp;
  struct vd_ctx *c = qp->ctx;
  vd_lock(&c->lock);
  const int cur = atomic_load(&qp->state);
  const int to = (mask & M(STATE)) ? (int)attr->qp_state : cur;
  int err = check_transition(qp, cur, to, mask);
  if (!err && (mask & M(CUR_STATE)) && (int)attr->cur_qp_state != cur)
    err = EINVAL;
  if (!err)
    err = check_values(attr, mask);
  if (err)
    goto out;
  if (mask & M(ACCESS_FLAGS))
    qp->access_flags = (int)attr->qp_access_flags;
  if (mask & M(QKEY))
    qp->qkey = attr->qkey;
  if (mask & M(DEST_QPN))
    qp->remote_qpn = attr->dest_qp_num;
  if (mask & M(AV)) {
    qp->remote.is_global = attr->ah_attr.is_global ? 1 : 0;
    qp->remote.lid = attr->ah_attr.dlid;
    memcpy(qp->remote.gid, attr->ah_attr.grh.dgid.raw, 16);
    qp->c_valid = 0;
  }
  if (to == IBV_QPS_ERR) {
    vd_qp_to_error(qp);
  } else {
    if (to == IBV_QPS_RESET)
      qp_reset(qp);
    set_state(qp, to);
  }
out:
  vd_unlock(&c->lock);
  if (err)
    errno = err;
  return err;
}
#undef M

int efadv_query_device(struct ibv_context *ibvctx, struct efadv_device_attr *attr, uint32_t inlen) {
  struct vd_ctx *c = (struct vd_ctx *)ibvctx;
  if (!c || !attr || inlen < sizeof(attr->comp_mask))
    return EINVAL;
  if (c->kind != VD_KIND_EFA)
    return EOPNOTSUPP;
  struct efadv_device_attr a;
  memset(&a, 0, sizeof(a));
  a.max_sq_wr = VD_MAX_WR;
  a.max_rq_wr = VD_MAX_WR;
  a.max_sq_sge = VD_MAX_SGE;
  a.max_rq_sge = VD_MAX_SGE;
  a.inline_buf_size = 0;
  a.device_caps = EFADV_DEVICE_ATTR_CAPS_RDMA_READ | EFADV_DEVICE_ATTR_CAPS_RNR_RETRY |
                  EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE;
  a.max_rdma_size = (uint32_t)VD_MAX_MSG;
  memset(attr, 0, inlen);
  memcpy(attr, &a, inlen < sizeof(a) ? inlen : sizeof(a));
  return 0;
}
