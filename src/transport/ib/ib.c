/*
 * The ib backend (net.h): libibverbs RC queue pairs to the rank's rail peers, for ConnectX
 * NICs over RoCE or InfiniBand.
 *
 * Each peer gets TW_NET_QPS queue pairs, spread over this rank's NICs. A command becomes the
 * data write (unsignaled when a flag follows) and, for a flag, an 8-byte inline write of the
 * flag's value into the peer's flag word, chained in one post on the queue pair the flag's
 * index maps to: RC executes a queue pair's requests in order, so the value lands after the
 * data, and one flag's values land in the order they were posted. The last request is signaled;
 * its completion ends the command.
 */
#ifdef TW_HAVE_VERBS_H
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/status.h"
#include "transport/net_impl.h"

#define IB_DEPTH 512              /* work requests per queue pair */
#define IB_MAX_WRITE (1ull << 30) /* bytes per work request */
#define IB_CQE (TW_NET_RECORDS + 64)

typedef struct ib_qp {
  struct ibv_qp *qp;
  int nic;        /* this rank's NIC it lives on */
  int remote_nic; /* the peer's NIC its other end lives on */
  int outstanding;
} ib_qp_t;

/* What rank r tells rank p about the queue pair r made for p, per index. */
typedef struct ib_qp_info {
  uint32_t qpn;
  uint16_t lid;
  uint8_t nic;
  uint8_t link_ethernet;
  union ibv_gid gid;
} ib_qp_info_t;

typedef struct ib_net {
  tw_net_base_t b; /* first: the backend is a tw_net_t */
  int qps;
  ib_qp_t qp[TW_MAX_WORLD][TW_NET_MAX_QPS];
  uint32_t next_qp[TW_MAX_WORLD];
} ib_net_t;

static int keep_rc(struct ibv_device *dev, void *arg) {
  const tw_verbs_t *v = (const tw_verbs_t *)arg;
  if (!v->efadv_query_device)
    return 1;
  /* an EFA device has no RC queue pairs */
  struct ibv_context *ctx = v->open_device(dev);
  if (!ctx)
    return 0;
  uint64_t attr[8] = {0};
  const int efa = v->efadv_query_device(ctx, (struct efadv_device_attr *)attr, sizeof(attr)) == 0;
  v->close_device(ctx);
  return !efa;
}

static void ib_close(tw_net_t *base) {
  ib_net_t *n = (ib_net_t *)base;
  if (!n)
    return;
  for (int p = 0; p < TW_MAX_WORLD; p++)
    for (int q = 0; q < TW_NET_MAX_QPS; q++)
      if (n->qp[p][q].qp)
        n->b.v->destroy_qp(n->qp[p][q].qp);
  tw_net_base_close(&n->b);
  free(n);
}

static tw_status_t ib_open(const tw_net_config_t *cfg, tw_net_t **out) {
  tw_status_t st;
  ib_net_t *n = NULL;
  const tw_verbs_t *v;
  TW_CHECK(tw_verbs_load(&v));
  if (cfg->world > TW_MAX_WORLD || cfg->qps < 1 || cfg->qps > TW_NET_MAX_QPS)
    TW_FAIL(TW_ERR_INVALID_ARGUMENT, "TW_NET_QPS: %d; expected 1..%d", cfg->qps, TW_NET_MAX_QPS);
  n = calloc(1, sizeof(*n));
  if (!n)
    TW_FAIL(TW_ERR_SYSTEM, "out of host memory");
  tw_net_base_init(&n->b, &tw_net_ib, v, cfg);
  n->qps = cfg->qps;
  int ndev = 0;
  TW_CHECK(tw_net_base_open_nics(&n->b, keep_rc, (void *)v, IB_CQE, &ndev));
  if (ndev == 0)
    TW_FAIL(TW_ERR_NOT_SUPPORTED,
            "no RDMA device found (%s, rdma-core %s); ranks on other nodes need one", v->path,
            tw_verbs_version(v));
  if (n->b.nnics == 0)
    TW_FAIL(TW_ERR_NOT_SUPPORTED, "none of the %d RDMA devices can serve the ib backend%s%s", ndev,
            cfg->devices && *cfg->devices ? " among TW_NET_DEVICES=" : "",
            cfg->devices && *cfg->devices ? cfg->devices : " (RC queue pairs)");
  *out = &n->b.net;
  return TW_SUCCESS;
fail:
  if (n)
    ib_close(&n->b.net);
  return st;
}

static size_t ib_info_bytes(const tw_net_t *base) {
  const ib_net_t *n = (const ib_net_t *)base;
  return sizeof(ib_qp_info_t) * (size_t)n->b.cfg.world * TW_NET_MAX_QPS;
}

static tw_status_t ib_local_info(tw_net_t *base, void *info) {
  ib_net_t *n = (ib_net_t *)base;
  ib_qp_info_t *out = (ib_qp_info_t *)info;
  memset(info, 0, ib_info_bytes(base));
  for (int p = 0; p < n->b.cfg.world; p++) {
    if (!tw_net_is_rail_peer(&n->b.cfg, p))
      continue;
    for (int q = 0; q < n->qps; q++) {
      ib_qp_t *qp = &n->qp[p][q];
      qp->nic = q % n->b.nnics;
      tw_nic_t *nic = &n->b.nic[qp->nic];
      struct ibv_qp_init_attr attr;
      memset(&attr, 0, sizeof(attr));
      attr.send_cq = nic->cq;
      attr.recv_cq = nic->cq;
      attr.qp_type = IBV_QPT_RC;
      attr.cap.max_send_wr = IB_DEPTH;
      attr.cap.max_recv_wr = 1;
      attr.cap.max_send_sge = 1;
      attr.cap.max_recv_sge = 1;
      attr.cap.max_inline_data = 16;
      qp->qp = n->b.v->create_qp(nic->pd, &attr);
      if (!qp->qp)
        return tw_fail(TW_ERR_SYSTEM, "ibv_create_qp(RC, %s) for rank %d: %s", nic->name, p,
                       strerror(errno));
      struct ibv_qp_attr a;
      memset(&a, 0, sizeof(a));
      a.qp_state = IBV_QPS_INIT;
      a.pkey_index = 0;
      a.port_num = 1;
      a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
      if (n->b.v->modify_qp(qp->qp, &a,
                            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return tw_fail(TW_ERR_SYSTEM, "ibv_modify_qp(INIT, %s) for rank %d: %s", nic->name, p,
                       strerror(errno));
      ib_qp_info_t *e = &out[(size_t)p * TW_NET_MAX_QPS + (size_t)q];
      e->qpn = qp->qp->qp_num;
      e->lid = nic->port.lid;
      e->nic = (uint8_t)qp->nic;
      e->link_ethernet = nic->port.link_layer == IBV_LINK_LAYER_ETHERNET;
      e->gid = nic->gid;
    }
  }
  return TW_SUCCESS;
}

static tw_status_t ib_connect(tw_net_t *base, const void *infos) {
  ib_net_t *n = (ib_net_t *)base;
  const size_t per_rank = ib_info_bytes(base);
  for (int p = 0; p < n->b.cfg.world; p++) {
    if (!tw_net_is_rail_peer(&n->b.cfg, p))
      continue;
    const ib_qp_info_t *theirs = (const ib_qp_info_t *)((const char *)infos + per_rank * (size_t)p);
    for (int q = 0; q < n->qps; q++) {
      const ib_qp_info_t *r = &theirs[(size_t)n->b.cfg.rank * TW_NET_MAX_QPS + (size_t)q];
      ib_qp_t *qp = &n->qp[p][q];
      tw_nic_t *nic = &n->b.nic[qp->nic];
      if (r->qpn == 0)
        return tw_fail(TW_ERR_INTERNAL, "rank %d made no queue pair %d for rank %d", p, q,
                       n->b.cfg.rank);
      qp->remote_nic = r->nic;
      struct ibv_qp_attr a;
      memset(&a, 0, sizeof(a));
      a.qp_state = IBV_QPS_RTR;
      a.path_mtu = nic->port.active_mtu;
      a.dest_qp_num = r->qpn;
      a.rq_psn = 0;
      a.max_dest_rd_atomic = 1;
      a.min_rnr_timer = 12;
      a.ah_attr.port_num = 1;
      if (r->link_ethernet) { /* RoCE: routed by GID */
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = r->gid;
        a.ah_attr.grh.sgid_index = (uint8_t)nic->gid_index;
        a.ah_attr.grh.hop_limit = 255;
      } else {
        a.ah_attr.dlid = r->lid;
      }
      if (n->b.v->modify_qp(qp->qp, &a,
                            IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return tw_fail(TW_ERR_SYSTEM, "ibv_modify_qp(RTR, %s) to rank %d's QP %u: %s", nic->name, p,
                       r->qpn, strerror(errno));
      memset(&a, 0, sizeof(a));
      a.qp_state = IBV_QPS_RTS;
      a.timeout = 14;
      a.retry_cnt = 7;
      a.rnr_retry = 7;
      a.sq_psn = 0;
      a.max_rd_atomic = 1;
      if (n->b.v->modify_qp(qp->qp, &a,
                            IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        return tw_fail(TW_ERR_SYSTEM, "ibv_modify_qp(RTS, %s) to rank %d: %s", nic->name, p,
                       strerror(errno));
    }
  }
  return TW_SUCCESS;
}

/* The peer's address of heap offset off in window w (which holds it) and its key on the NIC. */
static uint64_t remote_addr(const tw_net_window_t *w, int peer, uint64_t off) {
  return w->keys[peer].base + (off - w->heap_off);
}

static int ib_post(tw_net_t *base, const tw_fifo_cmd_t *c, uint64_t token, tw_net_done_t *done) {
  ib_net_t *n = (ib_net_t *)base;
  char why[160];
  tw_net_window_t *lw, *rw, *fw = NULL;
  const int checked = tw_net_base_check(&n->b, c, token, done, &lw, &rw);
  if (checked != 0)
    return checked < 0 ? -1 : 0;
  const int has_flag = c->flag_off != 0;
  const int pieces = (int)((c->bytes + IB_MAX_WRITE - 1) / IB_MAX_WRITE);
  const int need = pieces + has_flag;
  if (pieces > 4)
    return tw_net_refuse(done, c, token, "command of more than 4 GiB");
  if (has_flag) {
    fw = tw_net_window_find(n->b.win, n->b.nwin, n->b.cfg.flags_off + 8 * (c->flag_off - 1), 8);
    if (!fw)
      return tw_net_refuse(done, c, token, "the flag words are not registered");
  }
  const int q = has_flag ? (int)((c->flag_off - 1) % (uint64_t)n->qps)
                         : (int)(n->next_qp[c->peer] % (uint32_t)n->qps);
  ib_qp_t *qp = &n->qp[c->peer][q];
  if (qp->outstanding + need > IB_DEPTH || n->b.nfree == 0)
    return 0;
  if (!has_flag)
    n->next_qp[c->peer]++;
  uint32_t ri;
  tw_net_rec_take(&n->b, c, token, q, need, &ri);
  struct ibv_send_wr wr[6];
  struct ibv_sge sge[6];
  uint64_t value = c->flag_value;
  memset(wr, 0, sizeof(wr));
  int k = 0;
  for (; k < pieces; k++) {
    const uint64_t off = (uint64_t)k * IB_MAX_WRITE;
    const uint64_t len = c->bytes - off < IB_MAX_WRITE ? c->bytes - off : IB_MAX_WRITE;
    sge[k].addr = (uint64_t)(uintptr_t)(lw->addr + (c->local_off - lw->heap_off) + off);
    sge[k].length = (uint32_t)len;
    sge[k].lkey = lw->mr[qp->nic]->lkey;
    wr[k].wr_id = ri;
    wr[k].sg_list = &sge[k];
    wr[k].num_sge = 1;
    wr[k].opcode = IBV_WR_RDMA_WRITE;
    wr[k].wr.rdma.remote_addr = remote_addr(rw, c->peer, c->remote_off) + off;
    wr[k].wr.rdma.rkey = rw->keys[c->peer].rkey[qp->remote_nic];
    wr[k].next = &wr[k + 1];
  }
  if (has_flag) {
    const uint64_t off = n->b.cfg.flags_off + 8 * (c->flag_off - 1);
    sge[k].addr = (uint64_t)(uintptr_t)&value;
    sge[k].length = 8;
    sge[k].lkey = 0;
    wr[k].wr_id = ri;
    wr[k].sg_list = &sge[k];
    wr[k].num_sge = 1;
    wr[k].opcode = IBV_WR_RDMA_WRITE;
    wr[k].send_flags = IBV_SEND_INLINE;
    wr[k].wr.rdma.remote_addr = remote_addr(fw, c->peer, off);
    wr[k].wr.rdma.rkey = fw->keys[c->peer].rkey[qp->remote_nic];
    k++;
  }
  wr[k - 1].next = NULL;
  wr[k - 1].send_flags |= IBV_SEND_SIGNALED;
  struct ibv_send_wr *bad = NULL;
  const int rc = ibv_post_send(qp->qp, wr, &bad);
  if (rc == ENOMEM) { /* the send queue is fuller than counted: try again later */
    n->b.free_rec[n->b.nfree++] = ri;
    return 0;
  }
  if (rc != 0) {
    n->b.free_rec[n->b.nfree++] = ri;
    snprintf(why, sizeof(why), "ibv_post_send to rank %d (%s, QP %u): %s", c->peer,
             n->b.nic[qp->nic].name, qp->qp->qp_num, strerror(rc));
    return tw_net_refuse(done, c, token, why);
  }
  qp->outstanding += need;
  return 1;
}

static int ib_poll(tw_net_t *base, tw_net_done_t *out, int max) {
  ib_net_t *n = (ib_net_t *)base;
  int count = 0;
  for (int i = 0; i < n->b.nnics && count < max; i++) {
    struct ibv_wc wc[32];
    const int want = max - count < 32 ? max - count : 32;
    const int got = ibv_poll_cq(n->b.nic[i].cq, want, wc);
    if (got < 0) {
      char what[160];
      snprintf(what, sizeof(what), "ibv_poll_cq(%s) failed", n->b.nic[i].name);
      tw_net_fail_done(&n->b, &out[count], 0, -1, what);
      return count + 1;
    }
    for (int j = 0; j < got; j++) {
      if (wc[j].wr_id >= TW_NET_RECORDS)
        continue;
      tw_net_rec_t *rec = &n->b.rec[wc[j].wr_id];
      tw_net_done_t *d = &out[count++];
      d->token = rec->token;
      d->peer = rec->peer;
      if (wc[j].status == IBV_WC_SUCCESS) {
        d->status = TW_SUCCESS;
        d->what[0] = 0;
        n->qp[rec->peer][rec->qp].outstanding -= rec->nwr;
        if (!n->b.failed)
          n->b.free_rec[n->b.nfree++] = (uint32_t)wc[j].wr_id;
        continue;
      }
      /* an error completion: the queue pair is in the error state; the comm is done */
      n->b.failed = 1;
      d->status = TW_ERR_NETWORK;
      snprintf(d->what, sizeof(d->what),
               "RDMA write to rank %d failed on %s (QP %u): %s (vendor error %#x)", rec->peer,
               n->b.nic[i].name, wc[j].qp_num, n->b.v->wc_status_str(wc[j].status),
               wc[j].vendor_err);
    }
  }
  return count;
}

static void ib_describe(const tw_net_t *base, char *buf, size_t len) {
  const ib_net_t *n = (const ib_net_t *)base;
  int used = snprintf(buf, len, "ib (RC, %d QPs per peer):", n->qps);
  for (int i = 0; i < n->b.nnics && used > 0 && (size_t)used < len; i++)
    used += snprintf(buf + used, len - (size_t)used, " %s (%s, MTU %d)", n->b.nic[i].name,
                     n->b.nic[i].port.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand",
                     128 << n->b.nic[i].port.active_mtu);
  if (used > 0 && (size_t)used < len)
    snprintf(buf + used, len - (size_t)used, "; rdma-core %s", tw_verbs_version(n->b.v));
}

const tw_net_ops_t tw_net_ib = {"ib",
                                ib_open,
                                ib_info_bytes,
                                ib_local_info,
                                ib_connect,
                                tw_net_base_reg,
                                tw_net_base_set_remote,
                                tw_net_base_dereg,
                                ib_post,
                                ib_poll,
                                ib_describe,
                                ib_close};
#endif
