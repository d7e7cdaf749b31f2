/*
 * The efa backend (net.h): SRD queue pairs through efadv, for AWS EFA.
 *
 * SRD is reliable but unordered and connectionless: one queue pair per NIC reaches every peer
 * through an address handle, and a write may land after one posted later. So no flag write
 * follows the data: a command with a flag goes as one RDMA write with immediate data (the flag's
 * index and its value's low bits, EFA_IMM), and the receiving rank's backend raises its flag word
 * (host memory mapped for its kernels) to the value on the receive completion, which the NIC
 * reports only once the data is placed. A command's write is never split (a flag must follow
 * all of its data): it must fit the device's max_rdma_size. Every work request is signaled, as EFA
 * requires. A rank with several EFA NICs (a p5 node has two per GPU) spreads its commands over them
 * by flag index; the peer's NIC of the same index % its count receives.
 */
#ifdef TW_HAVE_VERBS_H
#include <arpa/inet.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/efadv.h>

#include "core/status.h"
#include "transport/net_impl.h"

#define EFA_SQ_DEPTH 512
#define EFA_RQ_DEPTH 1024
#define EFA_CQE (TW_NET_RECORDS + EFA_RQ_DEPTH * 2 + 64)
#define EFA_QKEY 0x7477u    /* "tw" */
#define EFA_RECV_ID (~0ull) /* wr_id of receive requests */
/* Immediate data: the flag's index above the value's low EFA_VALUE_BITS bits; the receiver
 * rebuilds the value from its flag word, which it is at most 2^16 behind. */
#define EFA_VALUE_BITS 17
#define EFA_VALUE_MASK ((1u << EFA_VALUE_BITS) - 1)
_Static_assert(TW_NET_FLAGS <= (1 << (32 - EFA_VALUE_BITS)), "flag index in the immediate");

typedef struct efa_nic_info {
  uint32_t qpn;
  union ibv_gid gid;
} efa_nic_info_t;

typedef struct efa_info {
  uint32_t nnics;
  efa_nic_info_t nic[TW_NET_MAX_NICS];
} efa_info_t;

typedef struct efa_net {
  tw_net_base_t b; /* first: the backend is a tw_net_t */
  struct ibv_qp *qp[TW_NET_MAX_NICS];
  struct ibv_qp_ex *qpx[TW_NET_MAX_NICS];
  int outstanding[TW_NET_MAX_NICS];
  uint32_t max_rdma_size;
  efa_info_t peer[TW_MAX_WORLD];
  struct ibv_ah *ah[TW_MAX_WORLD][TW_NET_MAX_NICS]; /* from NIC i to the peer's NIC i % theirs */
  uint32_t next_nic;
} efa_net_t;

/* An EFA device that can RDMA-write over SRD; *arg counts those that cannot. */
static int keep_efa(struct ibv_device *dev, void *arg) {
  const tw_verbs_t *v;
  if (tw_verbs_load(&v) != TW_SUCCESS || !v->efadv_query_device)
    return 0;
  struct ibv_context *ctx = v->open_device(dev);
  if (!ctx)
    return 0;
  struct efadv_device_attr attr;
  memset(&attr, 0, sizeof(attr));
  const int efa = v->efadv_query_device(ctx, &attr, sizeof(attr)) == 0;
  v->close_device(ctx);
  if (efa && !(attr.device_caps & EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE)) {
    (*(int *)arg)++;
    return 0;
  }
  return efa;
}

static void efa_close(tw_net_t *base) {
  efa_net_t *n = (efa_net_t *)base;
  if (!n)
    return;
  for (int p = 0; p < TW_MAX_WORLD; p++)
    for (int i = 0; i < TW_NET_MAX_NICS; i++)
      if (n->ah[p][i])
        n->b.v->destroy_ah(n->ah[p][i]);
  for (int i = 0; i < TW_NET_MAX_NICS; i++)
    if (n->qp[i])
      n->b.v->destroy_qp(n->qp[i]);
  tw_net_base_close(&n->b);
  free(n);
}

static tw_status_t efa_open(const tw_net_config_t *cfg, tw_net_t **out) {
  tw_status_t st;
  efa_net_t *n = NULL;
  const tw_verbs_t *v;
  TW_CHECK(tw_verbs_load(&v));
  if (!v->efadv_query_device || !v->efadv_create_qp_ex || !v->qp_to_qp_ex)
    TW_FAIL(TW_ERR_NOT_SUPPORTED,
            "the efa backend needs libefa (efadv; TW_EFADV_LIB) and "
            "ibv_qp_to_qp_ex from rdma-core 46 or later (found %s, rdma-core %s)",
            v->path, tw_verbs_version(v));
  if (!cfg->host_flags)
    TW_FAIL(TW_ERR_INTERNAL, "the efa backend needs host flag words");
  n = calloc(1, sizeof(*n));
  if (!n)
    TW_FAIL(TW_ERR_SYSTEM, "out of host memory");
  tw_net_base_init(&n->b, &tw_net_efa, v, cfg);
  int ndev = 0, no_write = 0;
  TW_CHECK(tw_net_base_open_nics(&n->b, keep_efa, &no_write, EFA_CQE, &ndev));
  if (n->b.nnics == 0)
    TW_FAIL(TW_ERR_NOT_SUPPORTED, "no usable EFA device among %d RDMA devices%s (rdma-core %s)",
            ndev,
            no_write ? ": they cannot RDMA-write over SRD (needs rdma-core 46 or later and "
                       "an EFA that supports RDMA write)"
                     : "",
            tw_verbs_version(v));
  n->max_rdma_size = ~0u;
  for (int i = 0; i < n->b.nnics; i++) {
    struct efadv_device_attr attr;
    memset(&attr, 0, sizeof(attr));
    if (v->efadv_query_device(n->b.nic[i].ctx, &attr, sizeof(attr)) == 0 && attr.max_rdma_size &&
        attr.max_rdma_size < n->max_rdma_size)
      n->max_rdma_size = attr.max_rdma_size;
  }
  *out = &n->b.net;
  return TW_SUCCESS;
fail:
  if (n)
    efa_close(&n->b.net);
  return st;
}

static size_t efa_info_bytes(const tw_net_t *base) {
  (void)base;
  return sizeof(efa_info_t);
}

static tw_status_t post_recvs(efa_net_t *n, int i, int count) {
  for (int k = 0; k < count; k++) {
    struct ibv_recv_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = EFA_RECV_ID;
    const int rc = ibv_post_recv(n->qp[i], &wr, &bad);
    if (rc)
      return tw_fail(TW_ERR_SYSTEM, "ibv_post_recv(%s): %s", n->b.nic[i].name, strerror(rc));
  }
  return TW_SUCCESS;
}

static tw_status_t efa_local_info(tw_net_t *base, void *info) {
  efa_net_t *n = (efa_net_t *)base;
  efa_info_t *out = (efa_info_t *)info;
  memset(out, 0, sizeof(*out));
  out->nnics = (uint32_t)n->b.nnics;
  for (int i = 0; i < n->b.nnics; i++) {
    tw_nic_t *nic = &n->b.nic[i];
    struct ibv_qp_init_attr_ex attr;
    memset(&attr, 0, sizeof(attr));
    attr.qp_type = IBV_QPT_DRIVER;
    attr.send_cq = nic->cq;
    attr.recv_cq = nic->cq;
    attr.pd = nic->pd;
    attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    attr.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
    attr.cap.max_send_wr = EFA_SQ_DEPTH;
    attr.cap.max_recv_wr = EFA_RQ_DEPTH;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    struct efadv_qp_init_attr efa;
    memset(&efa, 0, sizeof(efa));
    efa.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
    n->qp[i] = n->b.v->efadv_create_qp_ex(nic->ctx, &attr, &efa, sizeof(efa));
    if (!n->qp[i])
      return tw_fail(TW_ERR_SYSTEM, "efadv_create_qp_ex(SRD, %s): %s", nic->name, strerror(errno));
    n->qpx[i] = n->b.v->qp_to_qp_ex(n->qp[i]);
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = 1;
    a.qkey = EFA_QKEY;
    int bad = n->b.v->modify_qp(n->qp[i], &a,
                                IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    bad = bad || n->b.v->modify_qp(n->qp[i], &a, IBV_QP_STATE);
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    bad = bad || n->b.v->modify_qp(n->qp[i], &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
    if (bad || !n->qpx[i])
      return tw_fail(TW_ERR_SYSTEM, "bringing up the SRD queue pair of %s: %s", nic->name,
                     strerror(errno));
    tw_status_t st = post_recvs(n, i, EFA_RQ_DEPTH);
    if (st != TW_SUCCESS)
      return st;
    out->nic[i].qpn = n->qp[i]->qp_num;
    out->nic[i].gid = nic->gid;
  }
  return TW_SUCCESS;
}

static tw_status_t efa_connect(tw_net_t *base, const void *infos) {
  efa_net_t *n = (efa_net_t *)base;
  for (int p = 0; p < n->b.cfg.world; p++) {
    if (!tw_net_is_rail_peer(&n->b.cfg, p))
      continue;
    n->peer[p] = ((const efa_info_t *)infos)[p];
    if (n->peer[p].nnics == 0 || n->peer[p].nnics > TW_NET_MAX_NICS)
      return tw_fail(TW_ERR_INTERNAL, "rank %d reported %u EFA NICs", p, n->peer[p].nnics);
    for (int i = 0; i < n->b.nnics; i++) {
      struct ibv_ah_attr a;
      memset(&a, 0, sizeof(a));
      a.is_global = 1;
      a.port_num = 1;
      a.grh.dgid = n->peer[p].nic[(uint32_t)i % n->peer[p].nnics].gid;
      n->ah[p][i] = n->b.v->create_ah(n->b.nic[i].pd, &a);
      if (!n->ah[p][i])
        return tw_fail(TW_ERR_SYSTEM, "ibv_create_ah(%s) to rank %d: %s", n->b.nic[i].name, p,
                       strerror(errno));
    }
  }
  return TW_SUCCESS;
}

static int efa_post(tw_net_t *base, const tw_fifo_cmd_t *c, uint64_t token, tw_net_done_t *done) {
  efa_net_t *n = (efa_net_t *)base;
  char why[160];
  tw_net_window_t *lw, *rw;
  const int checked = tw_net_base_check(&n->b, c, token, done, &lw, &rw);
  if (checked != 0)
    return checked < 0 ? -1 : 0;
  const int has_flag = c->flag_off != 0;
  if (c->bytes > n->max_rdma_size) {
    snprintf(why, sizeof(why), "a write of %llu bytes exceeds the EFA device's max_rdma_size %u",
             (unsigned long long)c->bytes, n->max_rdma_size);
    return tw_net_refuse(done, c, token, why);
  }
  const int i = has_flag ? (int)((c->flag_off - 1) % (uint64_t)n->b.nnics)
                         : (int)(n->next_nic % (uint32_t)n->b.nnics);
  if (n->outstanding[i] >= EFA_SQ_DEPTH || n->b.nfree == 0)
    return 0;
  if (!has_flag)
    n->next_nic++;
  const efa_info_t *peer = &n->peer[c->peer];
  const uint32_t their = (uint32_t)i % peer->nnics;
  uint32_t ri;
  tw_net_rec_take(&n->b, c, token, i, 1, &ri);
  struct ibv_qp_ex *qpx = n->qpx[i];
  ibv_wr_start(qpx);
  qpx->wr_id = ri;
  qpx->wr_flags = IBV_SEND_SIGNALED;
  /* a flag-only command writes 0 bytes at heap offset 0 (the control block), a valid address */
  const tw_net_window_t *tw = rw ? rw : tw_net_window_find(n->b.win, n->b.nwin, 0, 0);
  uint64_t raddr = 0;
  uint32_t rkey = 0;
  if (tw) {
    raddr = tw->keys[c->peer].base + (c->remote_off - tw->heap_off);
    rkey = tw->keys[c->peer].rkey[their];
  }
  if (has_flag)
    ibv_wr_rdma_write_imm(qpx, rkey, raddr,
                          htonl((uint32_t)(c->flag_off - 1) << EFA_VALUE_BITS |
                                ((uint32_t)c->flag_value & EFA_VALUE_MASK)));
  else
    ibv_wr_rdma_write(qpx, rkey, raddr);
  ibv_wr_set_ud_addr(qpx, n->ah[c->peer][i], peer->nic[their].qpn, EFA_QKEY);
  if (c->bytes)
    ibv_wr_set_sge(qpx, lw->mr[i]->lkey,
                   (uint64_t)(uintptr_t)(lw->addr + (c->local_off - lw->heap_off)),
                   (uint32_t)c->bytes);
  else
    ibv_wr_set_sge_list(qpx, 0, NULL);
  const int rc = ibv_wr_complete(qpx);
  if (rc == ENOMEM) {
    n->b.free_rec[n->b.nfree++] = ri;
    return 0;
  }
  if (rc != 0) {
    n->b.free_rec[n->b.nfree++] = ri;
    snprintf(why, sizeof(why), "posting an SRD write to rank %d (%s): %s", c->peer,
             n->b.nic[i].name, strerror(rc));
    return tw_net_refuse(done, c, token, why);
  }
  n->outstanding[i]++;
  return 1;
}

/* A receive completion: a peer's write with immediate data landed; its flag takes the value
 * (this thread alone writes the flag words). */
static int on_recv(efa_net_t *n, int i, const struct ibv_wc *wc, tw_net_done_t *d) {
  const uint32_t imm = ntohl(wc->imm_data);
  const uint32_t idx = imm >> EFA_VALUE_BITS;
  if (idx < TW_NET_FLAGS) {
    _Atomic uint64_t *flag = (_Atomic uint64_t *)&n->b.cfg.host_flags[idx];
    const uint64_t old = atomic_load_explicit(flag, memory_order_relaxed);
    const uint64_t ahead = ((imm & EFA_VALUE_MASK) - (uint32_t)old) & EFA_VALUE_MASK;
    if (ahead != 0 && ahead < (EFA_VALUE_MASK + 1) / 2) /* else an older value, overtaken */
      atomic_store_explicit(flag, old + ahead, memory_order_release);
  }
  if (post_recvs(n, i, 1) == TW_SUCCESS && idx < TW_NET_FLAGS)
    return 0;
  char what[160];
  snprintf(what, sizeof(what),
           idx < TW_NET_FLAGS ? "cannot repost a receive on %s"
                              : "a write with a bad flag index on %s",
           n->b.nic[i].name);
  tw_net_fail_done(&n->b, d, 0, -1, what);
  return 1;
}

static int efa_poll(tw_net_t *base, tw_net_done_t *out, int max) {
  efa_net_t *n = (efa_net_t *)base;
  int count = 0;
  for (int i = 0; i < n->b.nnics && count < max; i++) {
    struct ibv_wc wc[32];
    const int want = max - count < 32 ? max - count : 32;
    const int got = ibv_poll_cq(n->b.nic[i].cq, want, wc);
    for (int j = 0; j < got; j++) {
      tw_net_done_t *d = &out[count];
      if (wc[j].wr_id == EFA_RECV_ID) {
        if (wc[j].status == IBV_WC_SUCCESS) {
          count += on_recv(n, i, &wc[j], d);
          continue;
        }
        char what[160];
        snprintf(what, sizeof(what), "a receive on %s failed: %s", n->b.nic[i].name,
                 n->b.v->wc_status_str(wc[j].status));
        tw_net_fail_done(&n->b, d, 0, -1, what);
        count++;
        continue;
      }
      if (wc[j].wr_id >= TW_NET_RECORDS)
        continue;
      tw_net_rec_t *rec = &n->b.rec[wc[j].wr_id];
      d->token = rec->token;
      d->peer = rec->peer;
      count++;
      n->outstanding[rec->qp]--;
      if (wc[j].status == IBV_WC_SUCCESS) {
        d->status = TW_SUCCESS;
        d->what[0] = 0;
        if (!n->b.failed)
          n->b.free_rec[n->b.nfree++] = (uint32_t)wc[j].wr_id;
        continue;
      }
      n->b.failed = 1;
      d->status = TW_ERR_NETWORK;
      snprintf(d->what, sizeof(d->what), "SRD write to rank %d failed on %s: %s (vendor error %#x)",
               rec->peer, n->b.nic[i].name, n->b.v->wc_status_str(wc[j].status), wc[j].vendor_err);
    }
  }
  return count;
}

static void efa_describe(const tw_net_t *base, char *buf, size_t len) {
  const efa_net_t *n = (const efa_net_t *)base;
  int used = snprintf(buf, len, "efa (SRD):");
  for (int i = 0; i < n->b.nnics && used > 0 && (size_t)used < len; i++)
    used += snprintf(buf + used, len - (size_t)used, " %s", n->b.nic[i].name);
  if (used > 0 && (size_t)used < len)
    snprintf(buf + used, len - (size_t)used, "; rdma-core %s", tw_verbs_version(n->b.v));
}

const tw_net_ops_t tw_net_efa = {
    "efa",       efa_open,        efa_info_bytes,         efa_local_info,
    efa_connect, tw_net_base_reg, tw_net_base_set_remote, tw_net_base_dereg,
    efa_post,    efa_poll,        efa_describe,           efa_close};
#endif
