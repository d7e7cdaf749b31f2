/* RC immediates, sends, receiver-not-ready, errors and flushes, the QP state machine, CQ overrun */
#include <arpa/inet.h>
#include <errno.h>
#include <string.h>

#include "vdt.h"

static int poll_one(struct ibv_cq *cq, struct ibv_wc *wc, int ms) {
  return vdt_poll(cq, wc, 1, ms) == 1;
}

static void check_imm(struct vdt_rc_pair *p, uint8_t *src, struct ibv_mr *ms, uint8_t *dst,
                      struct ibv_mr *md) {
  enum { N = 40 };
  TEST_ASSERT(vdt_post_recvs(p->qb, N + 1, 1000) == 0, "post recvs");
  uint32_t len[N + 1];
  size_t off[N + 1], o = 0;
  for (int i = 0; i <= N; i++) {
    len[i] = i == N ? 0 : (i == 7 ? (600u << 10) : (uint32_t)(i * 1000 + 1));
    off[i] = o;
    o += len[i];
    memset(src + off[i], 0x30 + i, len[i]);
    TEST_ASSERT(vdt_write(p->qa, (uint64_t)i, ms, src + off[i], len[i], (uintptr_t)(dst + off[i]),
                          md->rkey, 1, htonl(0xABC00000u + (uint32_t)i)) == 0,
                "post write_imm %d", i);
  }
  for (int i = 0; i <= N; i++) {
    struct ibv_wc wc;
    if (!poll_one(p->b.cq, &wc, 5000)) {
      TEST_ASSERT(0, "receive completion %d missing", i);
      break;
    }
    TEST_ASSERT(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM &&
                    (wc.wc_flags & IBV_WC_WITH_IMM),
                "recv %d: status %d opcode %d flags 0x%x", i, wc.status, wc.opcode, wc.wc_flags);
    TEST_ASSERT(wc.imm_data == htonl(0xABC00000u + (uint32_t)i),
                "recv %d: imm 0x%x (RC keeps order)", i, ntohl(wc.imm_data));
    TEST_ASSERT(wc.byte_len == len[i] && wc.wr_id == 1000u + (uint64_t)i,
                "recv %d: byte_len %u id %lu", i, wc.byte_len, (unsigned long)wc.wr_id);
    TEST_ASSERT(wc.qp_num == p->qb->qp_num && wc.src_qp == p->qa->qp_num, "recv %d: qp %u src %u",
                i, wc.qp_num, wc.src_qp);
    TEST_ASSERT(memcmp(dst + off[i], src + off[i], len[i]) == 0,
                "recv %d: data there at completion", i);
  }
  struct ibv_wc wc[N + 1];
  TEST_ASSERT(vdt_poll(p->a.cq, wc, N + 1, 5000) == N + 1, "send completions");
}

static void check_send(struct vdt_rc_pair *p, uint8_t *src, struct ibv_mr *ms, uint8_t *dst,
                       struct ibv_mr *md) {
  memset(dst, 0, 8192);
  for (int i = 0; i < 3000; i++)
    src[i] = (uint8_t)(i * 7);
  struct ibv_sge rs[2] = {{.addr = (uintptr_t)dst, .length = 100, .lkey = md->lkey},
                          {.addr = (uintptr_t)(dst + 1000), .length = 5000, .lkey = md->lkey}};
  struct ibv_recv_wr rw = {.wr_id = 77, .sg_list = rs, .num_sge = 2}, *rbad = NULL;
  TEST_ASSERT(ibv_post_recv(p->qb, &rw, &rbad) == 0, "post recv with 2 SGEs");
  struct ibv_sge ss = {.addr = (uintptr_t)src, .length = 3000, .lkey = ms->lkey};
  struct ibv_send_wr sw, *sbad = NULL;
  memset(&sw, 0, sizeof(sw));
  sw.wr_id = 78;
  sw.sg_list = &ss;
  sw.num_sge = 1;
  sw.opcode = IBV_WR_SEND;
  sw.send_flags = IBV_SEND_SIGNALED;
  TEST_ASSERT(ibv_post_send(p->qa, &sw, &sbad) == 0, "post send");
  struct ibv_wc wc;
  TEST_ASSERT(poll_one(p->b.cq, &wc, 5000) && wc.status == IBV_WC_SUCCESS &&
                  wc.opcode == IBV_WC_RECV && wc.byte_len == 3000 && wc.wr_id == 77 &&
                  !(wc.wc_flags & IBV_WC_WITH_IMM),
              "send's receive completion");
  TEST_ASSERT(memcmp(dst, src, 100) == 0 && memcmp(dst + 1000, src + 100, 2900) == 0,
              "send scattered over the receive's SGEs");
  TEST_ASSERT(poll_one(p->a.cq, &wc, 5000) && wc.status == IBV_WC_SUCCESS &&
                  wc.opcode == IBV_WC_SEND,
              "send completion");
  /* a send longer than the receive: length error at the receiver, both QPs in error */
  rs[0].length = 100;
  rw.num_sge = 1;
  TEST_ASSERT(ibv_post_recv(p->qb, &rw, &rbad) == 0, "post small recv");
  ss.length = 200;
  TEST_ASSERT(ibv_post_send(p->qa, &sw, &sbad) == 0, "post long send");
  TEST_ASSERT(poll_one(p->b.cq, &wc, 5000) && wc.status == IBV_WC_LOC_LEN_ERR, "receiver: %s",
              V.wc_status_str(wc.status));
  TEST_ASSERT(poll_one(p->a.cq, &wc, 5000) && wc.status == IBV_WC_REM_INV_REQ_ERR, "sender: %s",
              V.wc_status_str(wc.status));
}

void vdt_test_rc_imm_send(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 128, 1);
  const size_t cap = 2u << 20;
  uint8_t *src = malloc(cap), *dst = calloc(1, cap);
  TEST_REQUIRE(src && dst, "malloc");
  struct ibv_mr *ms = vdt_reg(&p.a, src, cap), *md = vdt_reg(&p.b, dst, cap);
  check_imm(&p, src, ms, dst, md);
  check_send(&p, src, ms, dst, md);
  V.dereg_mr(ms);
  V.dereg_mr(md);
  free(src);
  free(dst);
  vdt_rc_pair_close(&p);
}

/* A peer QP not yet receiving is waited for (the requester retransmits), up to TW_VD_RNR_MS */
static void check_peer_not_ready(struct vdt_rc_pair *p, uint64_t *word, struct ibv_mr *ms) {
  uint64_t dst = 0;
  struct ibv_mr *md = vdt_reg(&p->b, &dst, 8);
  struct ibv_qp *qa = vdt_rc_qp(&p->a, 4, 4, 1, 0, 0), *qb = vdt_rc_qp(&p->b, 4, 4, 1, 0, 0);
  TEST_REQUIRE(qa && qb && vdt_rc_connect(qa, &p->b, qb->qp_num, 0) == 0, "QPs");
  struct ibv_wc wc;
  TEST_ASSERT(vdt_write(qa, 61, ms, word, 8, (uintptr_t)&dst, md->rkey, 0, 0) == 0, "post");
  TEST_ASSERT(vdt_poll(p->a.cq, &wc, 1, 40) == 0, "no completion while the peer is in RESET");
  TEST_ASSERT(vdt_rc_connect(qb, &p->a, qa->qp_num, 0) == 0, "peer to RTS");
  TEST_ASSERT(poll_one(p->a.cq, &wc, 2000) && wc.status == IBV_WC_SUCCESS && wc.wr_id == 61,
              "delivered once the peer receives: %s", V.wc_status_str(wc.status));
  TEST_ASSERT(dst == *word, "data placed");
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
  TEST_ASSERT(V.modify_qp(qb, &a, IBV_QP_STATE) == 0, "peer to ERR");
  TEST_ASSERT(vdt_write(qa, 62, ms, word, 8, (uintptr_t)&dst, md->rkey, 0, 0) == 0, "post");
  TEST_ASSERT(poll_one(p->a.cq, &wc, 3000) && wc.status == IBV_WC_RETRY_EXC_ERR && wc.wr_id == 62,
              "a peer that never receives: %s", V.wc_status_str(wc.status));
  V.destroy_qp(qa);
  V.destroy_qp(qb);
  V.dereg_mr(md);
}

void vdt_test_rc_rnr(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 16, 0);
  uint64_t word = 5, *dst = calloc(8, 8);
  TEST_REQUIRE(dst, "calloc");
  struct ibv_mr *ms = vdt_reg(&p.a, &word, 8), *md = vdt_reg(&p.b, dst, 64);
  struct ibv_wc wc;
  /* a receive posted a little late: the write with immediate waits for it, then lands */
  TEST_ASSERT(vdt_write(p.qa, 1, ms, &word, 8, (uintptr_t)dst, md->rkey, 1, htonl(9)) == 0, "post");
  vdt_sleep_us(40000);
  TEST_ASSERT(dst[0] == 0, "not placed before a receive is posted");
  TEST_ASSERT(vdt_post_recvs(p.qb, 1, 50) == 0, "late recv");
  TEST_ASSERT(poll_one(p.b.cq, &wc, 2000) && wc.status == IBV_WC_SUCCESS && wc.wr_id == 50 &&
                  wc.imm_data == htonl(9),
              "late receive completes");
  TEST_ASSERT(poll_one(p.a.cq, &wc, 2000) && wc.status == IBV_WC_SUCCESS, "sender completes");
  TEST_ASSERT(dst[0] == 5, "data placed");
  /* none at all: RNR retries exhausted after TW_VD_RNR_MS (300 ms here) */
  const double t0 = tw_test_now();
  TEST_ASSERT(vdt_write(p.qa, 2, ms, &word, 8, (uintptr_t)dst, md->rkey, 1, 0) == 0, "post");
  TEST_ASSERT(vdt_write(p.qa, 3, ms, &word, 8, (uintptr_t)dst, md->rkey, 0, 0) == 0, "post");
  TEST_ASSERT(poll_one(p.a.cq, &wc, 3000) && wc.status == IBV_WC_RNR_RETRY_EXC_ERR && wc.wr_id == 2,
              "RNR: %s", V.wc_status_str(wc.status));
  const double dt = tw_test_now() - t0;
  TEST_ASSERT(dt >= 0.25 && dt < 3.0, "RNR after %.3f s (TW_VD_RNR_MS=300)", dt);
  TEST_ASSERT(poll_one(p.a.cq, &wc, 2000) && wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id == 3,
              "the next WR flushes: %s", V.wc_status_str(wc.status));
  TEST_ASSERT(p.qa->state == IBV_QPS_ERR, "QP in the error state (%d)", p.qa->state);
  check_peer_not_ready(&p, &word, ms);
  V.dereg_mr(ms);
  V.dereg_mr(md);
  free(dst);
  vdt_rc_pair_close(&p);
}

static void expect_error(struct vdt_rc_pair *p, int status, const char *what) {
  struct ibv_wc wc;
  TEST_ASSERT(poll_one(p->a.cq, &wc, 3000) && (int)wc.status == status, "%s: got %s", what,
              V.wc_status_str(wc.status));
}

void vdt_test_rc_errors(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 16, 0);
  uint8_t *src = calloc(1, 4096), *dst = calloc(1, 4096);
  TEST_REQUIRE(src && dst, "calloc");
  struct ibv_mr *ms = vdt_reg(&p.a, src, 4096), *md = vdt_reg(&p.b, dst, 4096);
  struct ibv_mr *mro = V.reg_mr(p.b.pd, dst, 4096, IBV_ACCESS_LOCAL_WRITE);
  TEST_REQUIRE(mro, "reg_mr local only");
  /* bad rkey: remote access error, then the QP is in error and later WRs flush */
  TEST_ASSERT(vdt_write(p.qa, 1, ms, src, 64, (uintptr_t)dst, md->rkey + 0x5557, 0, 0) == 0,
              "post");
  expect_error(&p, IBV_WC_REM_ACCESS_ERR, "bad rkey");
  TEST_ASSERT(vdt_write(p.qa, 2, ms, src, 64, (uintptr_t)dst, md->rkey, 0, 0) == 0,
              "post in the error state is accepted");
  expect_error(&p, IBV_WC_WR_FLUSH_ERR, "after the error");
  TEST_ASSERT(p.qa->state == IBV_QPS_ERR, "sender QP in error");
  vdt_rc_pair_renew(&p, 16);
  TEST_ASSERT(vdt_write(p.qa, 3, ms, src, 64, (uintptr_t)(dst + 4090), md->rkey, 0, 0) == 0,
              "post");
  expect_error(&p, IBV_WC_REM_ACCESS_ERR, "out of the MR's range");
  vdt_rc_pair_renew(&p, 16);
  TEST_ASSERT(vdt_write(p.qa, 4, ms, src, 64, (uintptr_t)dst, mro->rkey, 0, 0) == 0, "post");
  expect_error(&p, IBV_WC_REM_ACCESS_ERR, "MR without remote write");
  vdt_rc_pair_renew(&p, 16);
  struct ibv_sge sge = {.addr = (uintptr_t)src, .length = 64, .lkey = ms->lkey + 0x777};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = 5;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = (uintptr_t)dst;
  wr.wr.rdma.rkey = md->rkey;
  TEST_ASSERT(ibv_post_send(p.qa, &wr, &bad) == 0, "post with a bad lkey");
  expect_error(&p, IBV_WC_LOC_PROT_ERR, "bad lkey");
  TEST_ASSERT(dst[0] == 0, "nothing written");
  /* modify to the error state: posted receives flush, and so does what is posted after */
  vdt_rc_pair_renew(&p, 16);
  TEST_ASSERT(vdt_post_recvs(p.qb, 3, 900) == 0, "post recvs");
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
  TEST_ASSERT(V.modify_qp(p.qb, &a, IBV_QP_STATE) == 0, "modify to ERR");
  struct ibv_wc wc[4];
  int n = vdt_poll(p.b.cq, wc, 3, 2000);
  TEST_ASSERT(n == 3, "3 receive flushes (%d)", n);
  for (int i = 0; i < n; i++)
    TEST_ASSERT(wc[i].status == IBV_WC_WR_FLUSH_ERR && wc[i].wr_id == 900u + (uint64_t)i &&
                    wc[i].opcode == IBV_WC_RECV,
                "receive flush %d", i);
  TEST_ASSERT(vdt_post_recvs(p.qb, 1, 950) == 0, "post recv in ERR");
  TEST_ASSERT(vdt_write(p.qb, 951, md, dst, 8, (uintptr_t)src, ms->rkey, 0, 0) == 0, "post in ERR");
  n = vdt_poll(p.b.cq, wc, 2, 2000);
  TEST_ASSERT(n == 2 && wc[0].status == IBV_WC_WR_FLUSH_ERR && wc[1].status == IBV_WC_WR_FLUSH_ERR,
              "posted in ERR: flushed (%d)", n);
  V.dereg_mr(ms);
  V.dereg_mr(md);
  V.dereg_mr(mro);
  free(src);
  free(dst);
  vdt_rc_pair_close(&p);
}

void vdt_test_rc_state_machine(void) {
  struct vdt_nic n;
  vdt_open(&n, "mlx5:2", 0, 16);
  struct ibv_qp *qp = vdt_rc_qp(&n, 4, 4, 1, 0, 0);
  TEST_REQUIRE(qp, "QP");
  TEST_ASSERT(qp->state == IBV_QPS_RESET, "created in RESET");
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  TEST_ASSERT(V.modify_qp(qp, &a, IBV_QP_STATE) == EINVAL, "RESET -> RTR refused");
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  TEST_ASSERT(V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT) == EINVAL,
              "INIT without access flags");
  a.port_num = 2;
  const int init = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  TEST_ASSERT(V.modify_qp(qp, &a, init) == EINVAL, "port 2");
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
  TEST_ASSERT(V.modify_qp(qp, &a, init) == 0 && qp->state == IBV_QPS_INIT, "INIT");
  a.qp_state = IBV_QPS_RTS;
  TEST_ASSERT(V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN) == EINVAL, "INIT -> RTS refused");
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = 0x123;
  a.ah_attr.dlid = n.port.lid;
  int rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
            IBV_QP_MIN_RNR_TIMER;
  TEST_ASSERT(V.modify_qp(qp, &a, rtr) == EINVAL, "RTR without dest QPN");
  rtr |= IBV_QP_DEST_QPN;
  TEST_ASSERT(V.modify_qp(qp, &a, rtr | IBV_QP_SQ_PSN) == EINVAL, "RTR with an RTS attribute");
  TEST_ASSERT(V.modify_qp(qp, &a, rtr) == 0 && qp->state == IBV_QPS_RTR, "RTR");
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTS;
  int rts =
      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  TEST_ASSERT(V.modify_qp(qp, &a, rts) == EINVAL, "RTS without sq_psn");
  TEST_ASSERT(V.modify_qp(qp, &a, rts | IBV_QP_SQ_PSN) == 0 && qp->state == IBV_QPS_RTS, "RTS");
  a.qp_state = IBV_QPS_ERR;
  TEST_ASSERT(V.modify_qp(qp, &a, IBV_QP_STATE) == 0 && qp->state == IBV_QPS_ERR, "ERR");
  a.qp_state = IBV_QPS_RTS;
  TEST_ASSERT(V.modify_qp(qp, &a, IBV_QP_STATE) == EINVAL, "ERR -> RTS refused");
  a.qp_state = IBV_QPS_RESET;
  TEST_ASSERT(V.modify_qp(qp, &a, IBV_QP_STATE) == 0 && qp->state == IBV_QPS_RESET, "RESET");
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  TEST_ASSERT(V.modify_qp(qp, &a, init) == 0, "INIT again after RESET");
  TEST_ASSERT(V.destroy_qp(qp) == 0, "destroy");
  vdt_close(&n);
}

void vdt_test_cq_overflow(void) {
  struct vdt_rc_pair p;
  vdt_open(&p.a, "mlx5:2", 0, 4);
  vdt_open(&p.b, "mlx5:2", 1, 4);
  p.qa = vdt_rc_qp(&p.a, 16, 16, 1, 0, 1);
  p.qb = vdt_rc_qp(&p.b, 16, 16, 1, 0, 0);
  TEST_REQUIRE(p.qa && p.qb, "QPs");
  TEST_REQUIRE(vdt_rc_connect(p.qa, &p.b, p.qb->qp_num, 0) == 0 &&
                   vdt_rc_connect(p.qb, &p.a, p.qa->qp_num, 0) == 0,
               "connect");
  uint64_t word = 1, dst[8];
  struct ibv_mr *ms = vdt_reg(&p.a, &word, 8), *md = vdt_reg(&p.b, dst, sizeof(dst));
  struct tw_vd_stats s0, s1;
  V.stats(&s0);
  fprintf(stderr, "(a CQ overrun message is expected next)\n");
  for (int i = 0; i < 8; i++)
    TEST_ASSERT(vdt_write(p.qa, (uint64_t)i, ms, &word, 8, (uintptr_t)&dst[i], md->rkey, 0, 0) == 0,
                "post %d", i);
  const double end = tw_test_now() + 3;
  while (p.qa->state != IBV_QPS_ERR && tw_test_now() < end)
    vdt_sleep_us(1000);
  TEST_ASSERT(p.qa->state == IBV_QPS_ERR, "overrun puts the QP in the error state");
  V.stats(&s1);
  TEST_ASSERT(s1.cq_overflows > s0.cq_overflows, "overflow counted");
  struct ibv_wc wc[8];
  TEST_ASSERT(ibv_poll_cq(p.a.cq, 8, wc) <= 4, "at most the CQ's 4 entries");
  V.dereg_mr(ms);
  V.dereg_mr(md);
  vdt_rc_pair_close(&p);
}
