/* RC data movement: write sizes, SGE lists, inline, queue limits, MR kinds, ordering. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "vdt.h"

static void fill(uint8_t *p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (uint8_t)(x >> 16);
  }
}

/* One signaled write, waited for; returns its completion status (or -1: none in 5 s). */
static int write_wait(struct vdt_rc_pair *p, struct ibv_mr *lmr, void *src, uint32_t len,
                      uint64_t raddr, uint32_t rkey, uint64_t wr_id) {
  int rc = vdt_write(p->qa, wr_id, lmr, src, len, raddr, rkey, 0, 0);
  if (rc) {
    fprintf(stderr, "post_send: %s\n", strerror(rc));
    return -1;
  }
  struct ibv_wc wc;
  if (vdt_poll(p->a.cq, &wc, 1, 5000) != 1)
    return -1;
  if (wc.wr_id != wr_id || (wc.status == IBV_WC_SUCCESS && wc.opcode != IBV_WC_RDMA_WRITE))
    return -2;
  return wc.status;
}

void vdt_test_rc_writes(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 64, 1);
  const size_t cap = (4u << 20);
  uint8_t *src = malloc(cap), *dst = calloc(1, cap + 64);
  TEST_REQUIRE(src && dst, "malloc");
  fill(src, cap, 7);
  struct ibv_mr *ms = vdt_reg(&p.a, src, cap), *md = vdt_reg(&p.b, dst, cap + 64);
  static const uint32_t sizes[] = {
      1, 7, 8, 4096, 65536, 262144, 262145, 3u << 20, (3u << 20) + 777};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    const uint32_t n = sizes[i];
    memset(dst, 0, cap + 64);
    int st = write_wait(&p, ms, src + 5, n, (uintptr_t)(dst + 13), md->rkey, 100 + i);
    TEST_ASSERT(st == IBV_WC_SUCCESS, "write %u: status %d", n, st);
    TEST_ASSERT(memcmp(dst + 13, src + 5, n) == 0, "write %u: data differs", n);
    TEST_ASSERT(dst[12] == 0 && dst[13 + n] == 0, "write %u: bytes outside the range touched", n);
  }
  /* the other direction, on the same connection */
  memset(src, 0, 8192);
  fill(dst, 8192, 9);
  TEST_ASSERT(vdt_write(p.qb, 7, md, dst, 8192, (uintptr_t)src, ms->rkey, 0, 0) == 0, "post b->a");
  struct ibv_wc wc;
  TEST_ASSERT(vdt_poll(p.b.cq, &wc, 1, 5000) == 1 && wc.status == IBV_WC_SUCCESS,
              "b->a completion");
  TEST_ASSERT(memcmp(src, dst, 8192) == 0, "b->a data");
  V.dereg_mr(ms);
  V.dereg_mr(md);
  free(src);
  free(dst);
  vdt_rc_pair_close(&p);
}

static void check_multi_sge(struct vdt_rc_pair *p) {
  static const uint32_t lens[4] = {100, 4096, 70000, 300000};
  uint8_t *bufs[4];
  struct ibv_mr *mrs[4];
  struct ibv_sge sge[4];
  size_t total = 0;
  for (int i = 0; i < 4; i++) {
    bufs[i] = malloc(lens[i]);
    TEST_REQUIRE(bufs[i], "malloc");
    fill(bufs[i], lens[i], 20 + (uint32_t)i);
    mrs[i] = vdt_reg(&p->a, bufs[i], lens[i]);
    sge[i] = (struct ibv_sge){.addr = (uintptr_t)bufs[i], .length = lens[i], .lkey = mrs[i]->lkey};
    total += lens[i];
  }
  uint8_t *dst = calloc(1, total);
  TEST_REQUIRE(dst, "calloc");
  struct ibv_mr *md = vdt_reg(&p->b, dst, total);
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = 55;
  wr.sg_list = sge;
  wr.num_sge = 4;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = (uintptr_t)dst;
  wr.wr.rdma.rkey = md->rkey;
  TEST_ASSERT(ibv_post_send(p->qa, &wr, &bad) == 0, "post 4 SGEs");
  struct ibv_wc wc;
  TEST_ASSERT(vdt_poll(p->a.cq, &wc, 1, 5000) == 1 && wc.status == IBV_WC_SUCCESS && wc.wr_id == 55,
              "4-SGE completion");
  size_t off = 0;
  for (int i = 0; i < 4; i++) {
    TEST_ASSERT(memcmp(dst + off, bufs[i], lens[i]) == 0, "SGE %d's bytes", i);
    off += lens[i];
    V.dereg_mr(mrs[i]);
    free(bufs[i]);
  }
  V.dereg_mr(md);
  free(dst);
}

static void check_inline(struct vdt_rc_pair *p, uint8_t *dst, struct ibv_mr *md) {
  uint8_t data[65];
  fill(data, sizeof(data), 3);
  uint8_t want[64];
  memcpy(want, data, 64);
  struct ibv_sge sge = {.addr = (uintptr_t)data, .length = 64, .lkey = 0};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = 66;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  wr.wr.rdma.remote_addr = (uintptr_t)dst;
  wr.wr.rdma.rkey = md->rkey;
  TEST_ASSERT(ibv_post_send(p->qa, &wr, &bad) == 0, "post inline");
  memset(data, 0, sizeof(data)); /* inline: the bytes were taken when posted */
  struct ibv_wc wc;
  TEST_ASSERT(vdt_poll(p->a.cq, &wc, 1, 5000) == 1 && wc.status == IBV_WC_SUCCESS, "inline done");
  TEST_ASSERT(memcmp(dst, want, 64) == 0, "inline bytes are those at post time");
  sge.length = 65; /* beyond max_inline_data (64) */
  bad = NULL;
  TEST_ASSERT(ibv_post_send(p->qa, &wr, &bad) == EINVAL && bad == &wr, "inline too long refused");
}

static void check_signaling(struct vdt_rc_pair *p, uint8_t *dst, struct ibv_mr *md) {
  uint64_t word = 0x1122334455667788ull;
  struct ibv_mr *mw = vdt_reg(&p->a, &word, sizeof(word));
  for (int i = 0; i < 3; i++) { /* unsignaled */
    struct ibv_sge sge = {.addr = (uintptr_t)&word, .length = 8, .lkey = mw->lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = 200 + (uint64_t)i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = (uintptr_t)(dst + 8 * i);
    wr.wr.rdma.rkey = md->rkey;
    TEST_ASSERT(ibv_post_send(p->qa, &wr, &bad) == 0, "unsignaled post");
  }
  TEST_ASSERT(vdt_write(p->qa, 203, mw, &word, 8, (uintptr_t)(dst + 24), md->rkey, 0, 0) == 0,
              "post");
  struct ibv_wc wc[4];
  int n = vdt_poll(p->a.cq, wc, 4, 300);
  TEST_ASSERT(n == 1 && wc[0].wr_id == 203, "only the signaled WR completes (%d)", n);
  TEST_ASSERT(memcmp(dst + 16, &word, 8) == 0, "unsignaled writes landed");
  /* sq_sig_all: every WR completes */
  struct ibv_qp *qa = vdt_rc_qp(&p->a, 8, 8, 1, 0, 1), *qb = vdt_rc_qp(&p->b, 8, 8, 1, 0, 0);
  TEST_REQUIRE(qa && qb, "QPs");
  TEST_REQUIRE(vdt_rc_connect(qa, &p->b, qb->qp_num, 0) == 0 &&
                   vdt_rc_connect(qb, &p->a, qa->qp_num, 0) == 0,
               "connect");
  struct ibv_sge sge = {.addr = (uintptr_t)&word, .length = 8, .lkey = mw->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = 300;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.wr.rdma.remote_addr = (uintptr_t)dst;
  wr.wr.rdma.rkey = md->rkey;
  TEST_ASSERT(ibv_post_send(qa, &wr, &bad) == 0, "post on sq_sig_all QP");
  TEST_ASSERT(vdt_poll(p->a.cq, wc, 1, 5000) == 1 && wc[0].wr_id == 300, "sq_sig_all completes");
  V.destroy_qp(qa);
  V.destroy_qp(qb);
  V.dereg_mr(mw);
}

void vdt_test_rc_sges_inline(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 64, 0);
  check_multi_sge(&p);
  uint8_t *dst = calloc(1, 4096);
  TEST_REQUIRE(dst, "calloc");
  struct ibv_mr *md = vdt_reg(&p.b, dst, 4096);
  check_inline(&p, dst, md);
  check_signaling(&p, dst, md);
  V.dereg_mr(md);
  free(dst);
  vdt_rc_pair_close(&p);
}

void vdt_test_rc_limits(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 4, 0);
  uint64_t word = 1, *dst = calloc(64, 8);
  TEST_REQUIRE(dst, "calloc");
  struct ibv_mr *ms = vdt_reg(&p.a, &word, 8), *md = vdt_reg(&p.b, dst, 64 * 8);
  struct ibv_sge sge = {.addr = (uintptr_t)&word, .length = 8, .lkey = ms->lkey};
  struct ibv_send_wr wrs[5], *bad = NULL;
  memset(wrs, 0, sizeof(wrs));
  for (int i = 0; i < 5; i++) {
    wrs[i].wr_id = (uint64_t)i;
    wrs[i].sg_list = &sge;
    wrs[i].num_sge = 1;
    wrs[i].opcode = IBV_WR_RDMA_WRITE;
    wrs[i].send_flags = IBV_SEND_SIGNALED;
    wrs[i].wr.rdma.remote_addr = (uintptr_t)(dst + i);
    wrs[i].wr.rdma.rkey = md->rkey;
    wrs[i].next = i < 4 ? &wrs[i + 1] : NULL;
  }
  TEST_ASSERT(ibv_post_send(p.qa, wrs, &bad) == ENOMEM && bad == &wrs[4],
              "5 WRs on max_send_wr 4: ENOMEM at the 5th");
  struct ibv_wc wc[8];
  int n = vdt_poll(p.a.cq, wc, 4, 5000);
  TEST_ASSERT(n == 4, "the first 4 complete (%d)", n);
  for (int i = 0; i < n; i++)
    TEST_ASSERT(wc[i].wr_id == (uint64_t)i && wc[i].status == IBV_WC_SUCCESS, "in order, success");
  wrs[0].next = NULL;
  wrs[0].num_sge = 5; /* beyond max_send_sge (4) */
  TEST_ASSERT(ibv_post_send(p.qa, wrs, &bad) == EINVAL, "too many SGEs refused");
  wrs[0].num_sge = 1;
  struct ibv_qp *q = vdt_rc_qp(&p.a, 4, 4, 1, 100, 0); /* RESET */
  TEST_REQUIRE(q, "QP");
  TEST_ASSERT(ibv_post_send(q, wrs, &bad) == EINVAL && bad == wrs, "post in RESET refused");
  V.destroy_qp(q);
  errno = 0;
  TEST_ASSERT(vdt_rc_qp(&p.a, 8193, 4, 1, 0, 0) == NULL && errno == EINVAL, "max_send_wr > 8192");
  TEST_ASSERT(vdt_rc_qp(&p.a, 4, 4, 17, 0, 0) == NULL, "max_sge > 16");
  TEST_ASSERT(vdt_rc_qp(&p.a, 4, 4, 1, 257, 0) == NULL, "max_inline_data > 256");
  struct ibv_qp_init_attr a;
  memset(&a, 0, sizeof(a));
  a.send_cq = a.recv_cq = p.a.cq;
  a.qp_type = IBV_QPT_RC;
  a.cap = (struct ibv_qp_cap){.max_send_wr = 10,
                              .max_recv_wr = 3,
                              .max_send_sge = 2,
                              .max_recv_sge = 1,
                              .max_inline_data = 100};
  q = V.create_qp(p.a.pd, &a);
  TEST_ASSERT(q && a.cap.max_send_wr >= 10 && a.cap.max_inline_data >= 100 &&
                  a.cap.max_send_sge >= 2,
              "granted caps returned");
  TEST_ASSERT(q && V.qp_to_qp_ex(q) != NULL, "an RC QP has a qp_ex too");
  if (q)
    V.destroy_qp(q);
  a.qp_type = IBV_QPT_UD;
  TEST_ASSERT(V.create_qp(p.a.pd, &a) == NULL && errno == EOPNOTSUPP, "UD is not emulated");
  V.dereg_mr(ms);
  V.dereg_mr(md);
  free(dst);
  vdt_rc_pair_close(&p);
}

void vdt_test_rc_mr_kinds(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 16, 0);
  const int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  uint8_t *src = malloc(8192), *dst = calloc(1, 8192), *dst2 = calloc(1, 8192);
  TEST_REQUIRE(src && dst && dst2, "malloc");
  fill(src, 8192, 11);
  /* iova-based MRs, local and remote: addresses in WRs are iova + offset */
  struct ibv_mr *ms = V.reg_mr_iova(p.a.pd, src, 8192, 0x20000000ull, acc);
  struct ibv_mr *md = V.reg_mr_iova(p.b.pd, dst, 8192, 0x10000000ull, acc);
  TEST_REQUIRE(ms && md, "reg_mr_iova");
  struct ibv_sge sge = {.addr = 0x20000000ull + 10, .length = 1000, .lkey = ms->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = 0x10000000ull + 100;
  wr.wr.rdma.rkey = md->rkey;
  TEST_ASSERT(ibv_post_send(p.qa, &wr, &bad) == 0, "post iova write");
  struct ibv_wc wc;
  TEST_ASSERT(vdt_poll(p.a.cq, &wc, 1, 5000) == 1 && wc.status == IBV_WC_SUCCESS,
              "iova write done");
  TEST_ASSERT(memcmp(dst + 100, src + 10, 1000) == 0, "iova translation, both ends");
  /* dmabuf: the buffer's virtual address is the iova */
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  TEST_REQUIRE(fd >= 0, "open");
  struct ibv_mr *mb = V.reg_dmabuf_mr(p.b.pd, 0, 8192, (uintptr_t)dst2, fd, acc);
  TEST_REQUIRE(mb, "reg_dmabuf_mr: %s", strerror(errno));
  TEST_ASSERT(V.reg_dmabuf_mr(p.b.pd, 0, 8192, (uintptr_t)dst2, -1, acc) == NULL, "fd -1 refused");
  struct ibv_mr *ml = vdt_reg(&p.a, src, 8192);
  int st = vdt_write(p.qa, 2, ml, src, 4096, (uintptr_t)dst2 + 8, mb->rkey, 0, 0);
  TEST_ASSERT(st == 0 && vdt_poll(p.a.cq, &wc, 1, 5000) == 1 && wc.status == IBV_WC_SUCCESS,
              "dmabuf write done");
  TEST_ASSERT(memcmp(dst2 + 8, src, 4096) == 0, "dmabuf MR data");
  close(fd);
  TEST_ASSERT(ms->lkey && md->lkey && mb->lkey && ml->lkey && ms->lkey != md->lkey &&
                  md->lkey != mb->lkey && mb->lkey != ml->lkey && ms->lkey != ml->lkey,
              "keys unique and nonzero");
  TEST_ASSERT(V.reg_mr(p.a.pd, src, 0, acc) == NULL, "length 0 refused");
  TEST_ASSERT(V.reg_mr(p.a.pd, src, 64, IBV_ACCESS_REMOTE_WRITE) == NULL,
              "remote write needs local");
  /* a deregistered MR's rkey is dead */
  const uint32_t old = md->rkey;
  TEST_ASSERT(V.dereg_mr(md) == 0, "dereg");
  st = vdt_write(p.qa, 3, ml, src, 64, 0x10000000ull, old, 0, 0);
  TEST_ASSERT(st == 0 && vdt_poll(p.a.cq, &wc, 1, 5000) == 1 && wc.status == IBV_WC_REM_ACCESS_ERR,
              "write to a deregistered MR: %s", V.wc_status_str(wc.status));
  V.dereg_mr(ms);
  V.dereg_mr(mb);
  V.dereg_mr(ml);
  free(src);
  free(dst);
  free(dst2);
  vdt_rc_pair_close(&p);
}

/* ---- ordering: data writes each followed by a flag write; the flag never runs ahead */

#define ORD_SLOTS 8
#define ORD_DATA (320u << 10) /* two packets */
#define ORD_N 300

struct ord {
  struct vdt_rc_pair *p;
  uint8_t *src;
  struct ibv_mr *ms;
  uint64_t *srcflags;
  uint8_t *dst;
  struct ibv_mr *md;
  _Atomic int failed;
};

static void *ord_sender(void *arg) {
  struct ord *o = arg;
  int inflight = 0;
  for (uint64_t i = 1; i <= ORD_N && !o->failed; i++) {
    const uint64_t slot = i % ORD_SLOTS;
    uint64_t *d = (uint64_t *)(o->src + slot * ORD_DATA);
    for (size_t k = 0; k < ORD_DATA / 8; k += 512)
      d[k] = i; /* words 0, 512, 1024, ... */
    d[ORD_DATA / 8 - 1] = i;
    o->srcflags[i % 64] = i;
    struct ibv_sge s1 = {.addr = (uintptr_t)d, .length = ORD_DATA, .lkey = o->ms->lkey};
    struct ibv_sge s2 = {.addr = (uintptr_t)&o->srcflags[i % 64], .length = 8, .lkey = 0};
    struct ibv_send_wr w[2], *bad = NULL;
    memset(w, 0, sizeof(w));
    w[0] = (struct ibv_send_wr){
        .wr_id = 2 * i, .next = &w[1], .sg_list = &s1, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE};
    w[0].wr.rdma.remote_addr = (uintptr_t)(o->dst + slot * ORD_DATA);
    w[0].wr.rdma.rkey = o->md->rkey;
    w[1] = (struct ibv_send_wr){.wr_id = 2 * i + 1,
                                .sg_list = &s2,
                                .num_sge = 1,
                                .opcode = IBV_WR_RDMA_WRITE,
                                .send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE};
    w[1].wr.rdma.remote_addr = (uintptr_t)(o->dst + ORD_SLOTS * ORD_DATA);
    w[1].wr.rdma.rkey = o->md->rkey;
    if (ibv_post_send(o->p->qa, w, &bad) != 0) {
      fprintf(stderr, "ordering: post %lu failed\n", (unsigned long)i);
      o->failed = 1;
      break;
    }
    inflight++;
    /* at most ORD_SLOTS / 2 pairs in flight: a slot is rewritten only well after its flag */
    struct ibv_wc wc[8];
    while (inflight >= ORD_SLOTS / 2 || (i == ORD_N && inflight)) {
      int n = vdt_poll(o->p->a.cq, wc, 1, 5000);
      if (n != 1 || wc[0].status != IBV_WC_SUCCESS) {
        fprintf(stderr, "ordering: completion missing or failed\n");
        o->failed = 1;
        break;
      }
      inflight--;
    }
  }
  return NULL;
}

void vdt_test_rc_ordering(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 64, 0);
  struct ord o = {.p = &p};
  o.src = malloc(ORD_SLOTS * ORD_DATA);
  o.srcflags = calloc(64, 8);
  o.dst = calloc(1, ORD_SLOTS * ORD_DATA + 64);
  TEST_REQUIRE(o.src && o.dst && o.srcflags, "malloc");
  o.ms = vdt_reg(&p.a, o.src, ORD_SLOTS * ORD_DATA);
  o.md = vdt_reg(&p.b, o.dst, ORD_SLOTS * ORD_DATA + 64);
  volatile uint64_t *flag = (volatile uint64_t *)(o.dst + ORD_SLOTS * ORD_DATA);
  pthread_t t;
  TEST_REQUIRE(pthread_create(&t, NULL, ord_sender, &o) == 0, "pthread_create");
  uint64_t last = 0, seen = 0, bad = 0;
  const double end = tw_test_now() + 20;
  while (last < ORD_N && !o.failed && tw_test_now() < end) {
    const uint64_t v = atomic_load_explicit((_Atomic uint64_t *)flag, memory_order_acquire);
    if (v == last) {
      sched_yield();
      continue;
    }
    TEST_ASSERT(v > last, "flag went back: %lu after %lu", (unsigned long)v, (unsigned long)last);
    last = v;
    seen++;
    /* the data of flag v has landed: its slot holds v or a later value of the same slot */
    const uint64_t *d = (const uint64_t *)(o.dst + (v % ORD_SLOTS) * ORD_DATA);
    const uint64_t first = d[0], lastw = d[ORD_DATA / 8 - 1], mid = d[ORD_DATA / 16];
    if (first < v || lastw < v || mid < v || first % ORD_SLOTS != v % ORD_SLOTS)
      bad++;
  }
  pthread_join(t, NULL);
  TEST_ASSERT(!o.failed, "sender failed");
  TEST_ASSERT(last == ORD_N, "final flag %lu", (unsigned long)last);
  TEST_ASSERT(bad == 0, "%lu of %lu flag values seen before their data", (unsigned long)bad,
              (unsigned long)seen);
  TEST_ASSERT(seen > 10, "the receiver saw only %lu flag values", (unsigned long)seen);
  V.dereg_mr(o.ms);
  V.dereg_mr(o.md);
  free(o.src);
  free(o.srcflags);
  free(o.dst);
  vdt_rc_pair_close(&p);
}
