/* SRD on the EFA kind: efadv QPs, the ibv_qp_ex builder, reordering, and SRD's errors. */
#include <arpa/inet.h>
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>

#include "vdt.h"

#define QKEY 0x11111111u
#define ALL_OPS                                                                                    \
  (IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND)

struct srd {
  struct vdt_nic a, b;
  struct ibv_qp *qa, *qb;
  struct ibv_qp_ex *xa;
  struct ibv_ah *ah; /* a -> b */
};

/* An SRD QP brought to RTS; REQUIREs success. */
static struct ibv_qp *srd_qp(struct vdt_nic *n, uint64_t ops) {
  struct ibv_qp_init_attr_ex a;
  memset(&a, 0, sizeof(a));
  a.send_cq = n->cq;
  a.recv_cq = n->cq;
  a.qp_type = IBV_QPT_DRIVER;
  a.cap.max_send_wr = 512;
  a.cap.max_recv_wr = 512;
  a.cap.max_send_sge = 2;
  a.cap.max_recv_sge = 1;
  a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  a.pd = n->pd;
  a.send_ops_flags = ops;
  struct efadv_qp_init_attr e;
  memset(&e, 0, sizeof(e));
  e.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
  struct ibv_qp *qp = V.efa_create_qp_ex(n->ctx, &a, &e, sizeof(e));
  TEST_REQUIRE(qp, "efadv_create_qp_ex: %s", strerror(errno));
  struct ibv_qp_attr m;
  memset(&m, 0, sizeof(m));
  m.qp_state = IBV_QPS_INIT;
  m.port_num = 1;
  m.qkey = QKEY;
  TEST_REQUIRE(V.modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) ==
                   0,
               "SRD INIT");
  m.qp_state = IBV_QPS_RTR;
  TEST_REQUIRE(V.modify_qp(qp, &m, IBV_QP_STATE) == 0, "SRD RTR");
  m.qp_state = IBV_QPS_RTS;
  m.sq_psn = 0;
  TEST_REQUIRE(V.modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0, "SRD RTS");
  return qp;
}

static void srd_open(struct srd *s) {
  vdt_open(&s->a, "efa:2", 0, 8192);
  vdt_open(&s->b, "efa:2", 1, 8192);
  s->qa = srd_qp(&s->a, ALL_OPS);
  s->qb = srd_qp(&s->b, ALL_OPS);
  s->xa = V.qp_to_qp_ex(s->qa);
  TEST_REQUIRE(s->xa, "ibv_qp_to_qp_ex");
  struct ibv_ah_attr aa;
  memset(&aa, 0, sizeof(aa));
  aa.is_global = 1;
  aa.grh.dgid = s->b.gid;
  aa.port_num = 1;
  s->ah = V.create_ah(s->a.pd, &aa);
  TEST_REQUIRE(s->ah, "ibv_create_ah");
}

static void srd_close(struct srd *s) {
  TEST_ASSERT(V.destroy_ah(s->ah) == 0, "destroy_ah");
  TEST_ASSERT(V.destroy_qp(s->qa) == 0 && V.destroy_qp(s->qb) == 0, "destroy QPs");
  vdt_close(&s->a);
  vdt_close(&s->b);
}

/* One WR through the builder: a write (imm >= 0: with immediate) or a send (rkey == 0) */
static int srd_post(struct srd *s, struct ibv_qp_ex *x, uint64_t wr_id, uint32_t rkey,
                    uint64_t raddr, int64_t imm, struct ibv_mr *lmr, void *src, uint32_t len,
                    uint32_t qpn, uint32_t qkey) {
  ibv_wr_start(x);
  x->wr_id = wr_id;
  x->wr_flags = IBV_SEND_SIGNALED;
  if (!rkey)
    ibv_wr_send(x);
  else if (imm >= 0)
    ibv_wr_rdma_write_imm(x, rkey, raddr, htonl((uint32_t)imm));
  else
    ibv_wr_rdma_write(x, rkey, raddr);
  ibv_wr_set_sge(x, lmr->lkey, (uintptr_t)src, len);
  ibv_wr_set_ud_addr(x, s->ah, qpn, qkey);
  return ibv_wr_complete(x);
}

static int inversions(const uint32_t *v, int n) {
  int inv = 0;
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++)
      inv += v[i] > v[j];
  return inv;
}

/* 200 writes with immediate, 10 per builder batch: all land, in some other order */
static void check_imm_reordering(struct srd *s, uint8_t *src, struct ibv_mr *ms, uint8_t *dst,
                                 struct ibv_mr *md) {
  enum { N = 200, SZ = 4096 };
  TEST_ASSERT(vdt_post_recvs(s->qb, N, 0) == 0, "post recvs");
  for (int i = 0; i < N; i++)
    memset(src + (size_t)i * SZ, i & 0xff, SZ);
  memset(dst, 0xEE, (size_t)N * SZ);
  int posted = 0;
  for (int b = 0; b < N / 10; b++) {
    ibv_wr_start(s->xa);
    for (int i = b * 10; i < b * 10 + 10; i++) {
      s->xa->wr_id = (uint64_t)i;
      s->xa->wr_flags = IBV_SEND_SIGNALED;
      ibv_wr_rdma_write_imm(s->xa, md->rkey, (uintptr_t)(dst + (size_t)i * SZ), htonl((uint32_t)i));
      ibv_wr_set_sge(s->xa, ms->lkey, (uintptr_t)(src + (size_t)i * SZ), SZ);
      ibv_wr_set_ud_addr(s->xa, s->ah, s->qb->qp_num, QKEY);
    }
    posted += ibv_wr_complete(s->xa) == 0 ? 10 : 0;
  }
  TEST_ASSERT(posted == N, "posted %d", posted);
  uint32_t order[N];
  int seen[N] = {0}, got = 0, data_ok = 1;
  const double end = tw_test_now() + 10;
  while (got < N && tw_test_now() < end) {
    struct ibv_wc wc;
    if (ibv_poll_cq(s->b.cq, 1, &wc) != 1)
      continue;
    const uint32_t i = ntohl(wc.imm_data);
    TEST_ASSERT(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && i < N &&
                    wc.byte_len == SZ && wc.src_qp == s->qa->qp_num,
                "SRD recv completion");
    if (i >= N)
      break;
    seen[i]++;
    order[got++] = i;
    for (int k = 0; k < SZ; k++)
      data_ok &= dst[(size_t)i * SZ + (size_t)k] == (uint8_t)(i & 0xff);
  }
  int once = 1;
  for (int i = 0; i < N; i++)
    once &= seen[i] == 1;
  TEST_ASSERT(got == N && once, "every WR arrived once (%d)", got);
  TEST_ASSERT(data_ok, "each WR's data there at its completion");
  const int inv = inversions(order, got);
  TEST_ASSERT(inv > 0, "SRD delivery reordered (%d inversions)", inv);
  uint32_t sorder[N];
  int sgot = 0;
  while (sgot < N && tw_test_now() < end) {
    struct ibv_wc wc;
    if (ibv_poll_cq(s->a.cq, 1, &wc) != 1)
      continue;
    TEST_ASSERT(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE && wc.wr_id < N,
                "SRD send completion");
    sorder[sgot++] = (uint32_t)wc.wr_id;
  }
  TEST_ASSERT(sgot == N, "all send completions (%d)", sgot);
  printf("  srd: %d receive and %d send completion inversions over %d WRs\n", inv,
         inversions(sorder, sgot), N);
}

/* A flag written by a later WR can land before the data of an earlier one: observed in the
 * receive completions' order (both are writes with immediate; a message's completion comes when
 * all of it has landed), and, when the test thread is quick enough, in memory. */
static void check_flag_overtakes(struct srd *s, uint8_t *src, struct ibv_mr *ms, uint8_t *dst,
                                 struct ibv_mr *md) {
  enum { DATA = 1 << 20, TRIALS = 40, PKT_WORDS = (256 << 10) / 8 };
  volatile uint64_t *flag = (volatile uint64_t *)(dst + DATA);
  uint64_t *fsrc = (uint64_t *)(src + DATA);
  int first_flag = 0, seen_in_memory = 0;
  for (uint64_t t = 1; t <= TRIALS; t++) {
    for (size_t k = 0; k < DATA / 8; k++)
      ((uint64_t *)src)[k] = t;
    *fsrc = t;
    TEST_ASSERT(vdt_post_recvs(s->qb, 2, 0) == 0, "post recvs");
    TEST_ASSERT(
        srd_post(s, s->xa, 1, md->rkey, (uintptr_t)dst, 0, ms, src, DATA, s->qb->qp_num, QKEY) == 0,
        "post data");
    TEST_ASSERT(
        srd_post(s, s->xa, 2, md->rkey, (uintptr_t)flag, 1, ms, fsrc, 8, s->qb->qp_num, QKEY) == 0,
        "post flag");
    const double end = tw_test_now() + 2;
    while (atomic_load_explicit((_Atomic uint64_t *)flag, memory_order_acquire) != t &&
           tw_test_now() < end)
      ;
    const volatile uint64_t *d = (const volatile uint64_t *)dst;
    int complete = d[DATA / 8 - 1] == t;
    for (int k = 0; k < 4; k++)
      complete &= d[(size_t)k * PKT_WORDS] == t;
    seen_in_memory += !complete;
    struct ibv_wc wc[2];
    TEST_ASSERT(vdt_poll(s->b.cq, wc, 2, 3000) == 2, "trial %lu receive completions",
                (unsigned long)t);
    first_flag += ntohl(wc[0].imm_data) == 1;
    TEST_ASSERT(vdt_poll(s->a.cq, wc, 2, 3000) == 2, "trial %lu send completions",
                (unsigned long)t);
  }
  TEST_ASSERT(first_flag > 0, "a later flag write never landed before the data (%d trials)",
              TRIALS);
  printf("  srd: the flag landed before the data in %d of %d trials (seen in memory in %d)\n",
         first_flag, TRIALS, seen_in_memory);
}

void vdt_test_srd(void) {
  struct srd s;
  srd_open(&s);
  TEST_ASSERT(s.qa->qp_type == IBV_QPT_DRIVER && s.qa->state == IBV_QPS_RTS,
              "SRD QP type and state");
  const size_t cap = 2u << 20;
  uint8_t *src = malloc(cap), *dst = calloc(1, cap);
  TEST_REQUIRE(src && dst, "malloc");
  struct ibv_mr *ms = vdt_reg(&s.a, src, cap), *md = vdt_reg(&s.b, dst, cap);
  struct tw_vd_stats st0, st1;
  V.stats(&st0);
  check_imm_reordering(&s, src, ms, dst, md);
  check_flag_overtakes(&s, src, ms, dst, md);
  /* a multi-packet write with immediate: its completion waits for every packet */
  for (size_t k = 0; k < (1u << 20); k++)
    src[k] = (uint8_t)(k * 13);
  memset(dst, 0, 1u << 20);
  TEST_ASSERT(vdt_post_recvs(s.qb, 1, 7000) == 0, "post recv");
  TEST_ASSERT(srd_post(&s, s.xa, 9, md->rkey, (uintptr_t)dst, 77, ms, src, 1u << 20, s.qb->qp_num,
                       QKEY) == 0,
              "post 1 MiB");
  struct ibv_wc wc;
  TEST_ASSERT(vdt_poll(s.b.cq, &wc, 1, 5000) == 1 && wc.status == IBV_WC_SUCCESS &&
                  wc.byte_len == (1u << 20) && wc.imm_data == htonl(77),
              "1 MiB recv completion");
  TEST_ASSERT(memcmp(dst, src, 1u << 20) == 0, "1 MiB landed before its completion");
  TEST_ASSERT(vdt_poll(s.a.cq, &wc, 1, 5000) == 1 && wc.status == IBV_WC_SUCCESS, "1 MiB sent");
  V.stats(&st1);
  TEST_ASSERT(st1.reordered > st0.reordered, "stats count reordered packets");
  V.dereg_mr(ms);
  V.dereg_mr(md);
  free(src);
  free(dst);
  srd_close(&s);
}

static void expect(struct ibv_cq *cq, int status, uint64_t wr_id, const char *what) {
  struct ibv_wc wc;
  memset(&wc, 0, sizeof(wc));
  int n = vdt_poll(cq, &wc, 1, 3000);
  TEST_ASSERT(n == 1 && (int)wc.status == status && wc.wr_id == wr_id, "%s: got %s (wr %lu)", what,
              n ? V.wc_status_str(wc.status) : "nothing", (unsigned long)wc.wr_id);
}

void vdt_test_srd_errors(void) {
  struct srd s;
  srd_open(&s);
  uint8_t *src = calloc(1, 8192), *dst = calloc(1, 8192);
  TEST_REQUIRE(src && dst, "calloc");
  struct ibv_mr *ms = vdt_reg(&s.a, src, 8192), *md = vdt_reg(&s.b, dst, 8192);
  const uint32_t qpn = s.qb->qp_num;
  TEST_ASSERT(srd_post(&s, s.xa, 1, md->rkey, (uintptr_t)dst, -1, ms, src, 64, qpn, QKEY + 1) == 0,
              "post");
  expect(s.a.cq, IBV_WC_REM_INV_RD_REQ_ERR, 1, "wrong qkey");
  TEST_ASSERT(
      srd_post(&s, s.xa, 2, md->rkey + 0x3337, (uintptr_t)dst, -1, ms, src, 64, qpn, QKEY) == 0,
      "post");
  expect(s.a.cq, IBV_WC_REM_ACCESS_ERR, 2, "bad rkey");
  TEST_ASSERT(srd_post(&s, s.xa, 3, md->rkey, (uintptr_t)dst, -1, ms, src, 64, qpn ^ 0x800, QKEY) ==
                  0,
              "post");
  expect(s.a.cq, IBV_WC_REM_INV_RD_REQ_ERR, 3, "no such QP");
  TEST_ASSERT(s.qa->state == IBV_QPS_RTS, "SRD QP still usable after errors");
  TEST_ASSERT(srd_post(&s, s.xa, 4, md->rkey, (uintptr_t)dst, 5, ms, src, 64, qpn, QKEY) == 0,
              "post");
  expect(s.a.cq, IBV_WC_RNR_RETRY_EXC_ERR, 4, "no receive posted");
  /* a send into a posted receive */
  struct ibv_sge rs = {.addr = (uintptr_t)dst, .length = 4096, .lkey = md->lkey};
  struct ibv_recv_wr rw = {.wr_id = 40, .sg_list = &rs, .num_sge = 1}, *rbad;
  TEST_ASSERT(ibv_post_recv(s.qb, &rw, &rbad) == 0, "post recv");
  memset(src, 0x5A, 100);
  TEST_ASSERT(srd_post(&s, s.xa, 5, 0, 0, -1, ms, src, 100, qpn, QKEY) == 0, "post send");
  expect(s.a.cq, IBV_WC_SUCCESS, 5, "send");
  struct ibv_wc wc;
  TEST_ASSERT(vdt_poll(s.b.cq, &wc, 1, 3000) == 1 && wc.opcode == IBV_WC_RECV &&
                  wc.byte_len == 100 && wc.wr_id == 40 && dst[99] == 0x5A,
              "send's receive completion");
  /* builder errors: nothing is posted */
  struct ibv_qp *qw = srd_qp(&s.a, IBV_QP_EX_WITH_RDMA_WRITE);
  struct ibv_qp_ex *xw = V.qp_to_qp_ex(qw);
  TEST_ASSERT(srd_post(&s, xw, 6, 0, 0, -1, ms, src, 8, qpn, QKEY) == EOPNOTSUPP,
              "send not in send_ops_flags");
  ibv_wr_start(xw);
  xw->wr_id = 7;
  xw->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_rdma_write(xw, md->rkey, (uintptr_t)dst);
  ibv_wr_set_sge(xw, ms->lkey, (uintptr_t)src, 8);
  TEST_ASSERT(ibv_wr_complete(xw) == EINVAL, "no wr_set_ud_addr");
  ibv_wr_start(xw);
  ibv_wr_rdma_write(xw, md->rkey, (uintptr_t)dst);
  ibv_wr_abort(xw);
  TEST_ASSERT(vdt_poll(s.a.cq, &wc, 1, 50) == 0, "nothing posted by failed or aborted batches");
  struct ibv_send_wr sw, *sbad = NULL;
  memset(&sw, 0, sizeof(sw));
  TEST_ASSERT(ibv_post_send(s.qa, &sw, &sbad) == EOPNOTSUPP,
              "SRD sends use the qp_ex builder only");
  TEST_ASSERT(V.destroy_qp(qw) == 0, "destroy");
  V.dereg_mr(ms);
  V.dereg_mr(md);
  free(src);
  free(dst);
  srd_close(&s);
}
