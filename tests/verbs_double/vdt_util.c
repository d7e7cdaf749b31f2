/* The verbs double's test harness (vdt.h). */
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <time.h>

#include "vdt.h"

struct vdt_api V;

#define SYM(field, name)                                                                           \
  do {                                                                                             \
    *(void **)&V.field = dlsym(h, name);                                                           \
    if (!V.field) {                                                                                \
      fprintf(stderr, "dlsym(%s): %s\n", name, dlerror());                                         \
      return -1;                                                                                   \
    }                                                                                              \
  } while (0)

int vdt_load(const char *path) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen(%s): %s\n", path, dlerror());
    return -1;
  }
  SYM(get_device_list, "ibv_get_device_list");
  SYM(free_device_list, "ibv_free_device_list");
  SYM(get_device_name, "ibv_get_device_name");
  SYM(open_device, "ibv_open_device");
  SYM(close_device, "ibv_close_device");
  SYM(query_device, "ibv_query_device");
  SYM(query_port, "ibv_query_port");
  SYM(query_gid, "ibv_query_gid");
  SYM(alloc_pd, "ibv_alloc_pd");
  SYM(dealloc_pd, "ibv_dealloc_pd");
  SYM(reg_mr, "ibv_reg_mr");
  SYM(reg_mr_iova, "ibv_reg_mr_iova");
  SYM(reg_dmabuf_mr, "ibv_reg_dmabuf_mr");
  SYM(dereg_mr, "ibv_dereg_mr");
  SYM(create_cq, "ibv_create_cq");
  SYM(destroy_cq, "ibv_destroy_cq");
  SYM(create_qp, "ibv_create_qp");
  SYM(modify_qp, "ibv_modify_qp");
  SYM(destroy_qp, "ibv_destroy_qp");
  SYM(create_ah, "ibv_create_ah");
  SYM(destroy_ah, "ibv_destroy_ah");
  SYM(qp_to_qp_ex, "ibv_qp_to_qp_ex");
  SYM(wc_status_str, "ibv_wc_status_str");
  SYM(fork_init, "ibv_fork_init");
  SYM(efa_query_device, "efadv_query_device");
  SYM(efa_create_qp_ex, "efadv_create_qp_ex");
  SYM(inject, "tw_vd_inject");
  SYM(stats, "tw_vd_stats");
  return 0;
}

void vdt_sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

void vdt_open(struct vdt_nic *n, const char *nics, int index, int cqe) {
  memset(n, 0, sizeof(*n));
  TEST_REQUIRE(setenv("TW_VD_NICS", nics, 1) == 0, "setenv");
  int count = 0;
  struct ibv_device **list = V.get_device_list(&count);
  TEST_REQUIRE(list && index < count, "device %d of %s (%d listed)", index, nics, count);
  n->ctx = V.open_device(list[index]);
  V.free_device_list(list);
  TEST_REQUIRE(n->ctx, "ibv_open_device: %s", strerror(errno));
  n->pd = V.alloc_pd(n->ctx);
  n->cq = V.create_cq(n->ctx, cqe, NULL, NULL, 0);
  TEST_REQUIRE(n->pd && n->cq, "pd / cq");
  TEST_REQUIRE(V.query_port(n->ctx, 1, &n->port) == 0, "query_port");
  TEST_REQUIRE(V.query_gid(n->ctx, 1, 0, &n->gid) == 0, "query_gid");
}

void vdt_close(struct vdt_nic *n) {
  if (!n->ctx)
    return;
  TEST_ASSERT(V.destroy_cq(n->cq) == 0, "destroy_cq");
  TEST_ASSERT(V.dealloc_pd(n->pd) == 0, "dealloc_pd");
  TEST_ASSERT(V.close_device(n->ctx) == 0, "close_device");
  memset(n, 0, sizeof(*n));
}

struct ibv_mr *vdt_reg(struct vdt_nic *n, void *buf, size_t len) {
  struct ibv_mr *mr = V.reg_mr(
      n->pd, buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  TEST_REQUIRE(mr, "ibv_reg_mr(%zu): %s", len, strerror(errno));
  return mr;
}

struct ibv_qp *vdt_rc_qp(struct vdt_nic *n, uint32_t max_send_wr, uint32_t max_recv_wr,
                         uint32_t max_sge, uint32_t max_inline, int sig_all) {
  struct ibv_qp_init_attr a;
  memset(&a, 0, sizeof(a));
  a.send_cq = n->cq;
  a.recv_cq = n->cq;
  a.qp_type = IBV_QPT_RC;
  a.sq_sig_all = sig_all;
  a.cap.max_send_wr = max_send_wr;
  a.cap.max_recv_wr = max_recv_wr;
  a.cap.max_send_sge = max_sge;
  a.cap.max_recv_sge = max_sge;
  a.cap.max_inline_data = max_inline;
  return V.create_qp(n->pd, &a);
}

int vdt_rc_connect(struct ibv_qp *qp, const struct vdt_nic *peer, uint32_t peer_qpn, int by_gid) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  int rc =
      V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc)
    return rc;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = peer_qpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = 1;
  if (by_gid) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = peer->gid;
    a.ah_attr.grh.hop_limit = 1;
  } else {
    a.ah_attr.dlid = peer->port.lid;
  }
  rc = V.modify_qp(qp, &a,
                   IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc)
    return rc;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  return V.modify_qp(qp, &a,
                     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                         IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

void vdt_rc_pair_open(struct vdt_rc_pair *p, uint32_t max_wr, int by_gid) {
  vdt_open(&p->a, "mlx5:2", 0, 8192);
  vdt_open(&p->b, "mlx5:2", 1, 8192);
  p->qa = vdt_rc_qp(&p->a, max_wr, max_wr, 4, 64, 0);
  p->qb = vdt_rc_qp(&p->b, max_wr, max_wr, 4, 64, 0);
  TEST_REQUIRE(p->qa && p->qb, "create RC QPs: %s", strerror(errno));
  int rc = vdt_rc_connect(p->qa, &p->b, p->qb->qp_num, by_gid);
  TEST_REQUIRE(rc == 0, "connect a: %s", strerror(rc));
  rc = vdt_rc_connect(p->qb, &p->a, p->qa->qp_num, by_gid);
  TEST_REQUIRE(rc == 0, "connect b: %s", strerror(rc));
}

void vdt_rc_pair_renew(struct vdt_rc_pair *p, uint32_t max_wr) {
  TEST_ASSERT(V.destroy_qp(p->qa) == 0 && V.destroy_qp(p->qb) == 0, "destroy QPs");
  p->qa = vdt_rc_qp(&p->a, max_wr, max_wr, 4, 64, 0);
  p->qb = vdt_rc_qp(&p->b, max_wr, max_wr, 4, 64, 0);
  TEST_REQUIRE(p->qa && p->qb, "create RC QPs: %s", strerror(errno));
  TEST_REQUIRE(vdt_rc_connect(p->qa, &p->b, p->qb->qp_num, 0) == 0, "connect a");
  TEST_REQUIRE(vdt_rc_connect(p->qb, &p->a, p->qa->qp_num, 0) == 0, "connect b");
  struct ibv_wc wc[64];
  while (ibv_poll_cq(p->a.cq, 64, wc) > 0 || ibv_poll_cq(p->b.cq, 64, wc) > 0) {
  }
}

void vdt_rc_pair_close(struct vdt_rc_pair *p) {
  TEST_ASSERT(V.destroy_qp(p->qa) == 0, "destroy qa");
  TEST_ASSERT(V.destroy_qp(p->qb) == 0, "destroy qb");
  vdt_close(&p->a);
  vdt_close(&p->b);
}

int vdt_poll(struct ibv_cq *cq, struct ibv_wc *wc, int want, int timeout_ms) {
  int got = 0;
  const double end = tw_test_now() + timeout_ms * 1e-3;
  while (got < want) {
    int n = ibv_poll_cq(cq, want - got, wc + got);
    if (n < 0) {
      fprintf(stderr, "ibv_poll_cq: %d\n", n);
      break;
    }
    got += n;
    if (got < want) {
      if (tw_test_now() > end)
        break;
      if (!n)
        vdt_sleep_us(20);
    }
  }
  return got;
}

int vdt_write(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mr *lmr, void *src, uint32_t len,
              uint64_t raddr, uint32_t rkey, int with_imm, uint32_t imm) {
  struct ibv_sge sge = {.addr = (uintptr_t)src, .length = len, .lkey = lmr ? lmr->lkey : 0};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = len ? 1 : 0;
  wr.opcode = with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = imm;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return ibv_post_send(qp, &wr, &bad);
}

int vdt_post_recvs(struct ibv_qp *qp, int n, uint64_t first_id) {
  for (int i = 0; i < n; i++) {
    struct ibv_recv_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = first_id + (uint64_t)i;
    int rc = ibv_post_recv(qp, &wr, &bad);
    if (rc)
      return rc;
  }
  return 0;
}
