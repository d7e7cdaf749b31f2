/* Injected failures, two processes on one fabric, link shaping, and one RC stream's rate. */
#include <arpa/inet.h>
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "vdt.h"

static int wait_wc(struct ibv_cq *cq, struct ibv_wc *wc, int ms) {
  memset(wc, 0, sizeof(*wc));
  return vdt_poll(cq, wc, 1, ms) == 1;
}

static void check_wc_error(struct vdt_rc_pair *p, uint64_t *src, struct ibv_mr *ms, uint64_t *dst,
                           struct ibv_mr *md) {
  char spec[96];
  snprintf(spec, sizeof(spec), "wc_error:port=%u:after=2", (unsigned)p->a.port.lid);
  TEST_ASSERT(V.inject(spec) == 0, "inject %s", spec);
  for (int i = 0; i < 4; i++)
    TEST_ASSERT(vdt_write(p->qa, (uint64_t)i, ms, &src[i], 8, (uintptr_t)&dst[i], md->rkey, 0, 0) ==
                    0,
                "post %d", i);
  static const int want[4] = {IBV_WC_SUCCESS, IBV_WC_SUCCESS, IBV_WC_RETRY_EXC_ERR,
                              IBV_WC_WR_FLUSH_ERR};
  for (int i = 0; i < 4; i++) {
    struct ibv_wc wc;
    TEST_ASSERT(wait_wc(p->a.cq, &wc, 3000) && wc.wr_id == (uint64_t)i && (int)wc.status == want[i],
                "wc_error WR %d: %s", i, V.wc_status_str(wc.status));
  }
  TEST_ASSERT(dst[0] == src[0] && dst[1] == src[1] && dst[2] == 0 && dst[3] == 0,
              "the failed WR's data was not delivered");
  TEST_ASSERT(p->qa->state == IBV_QPS_ERR, "wc_error: QP in the error state");
  TEST_ASSERT(V.inject("clear") == 0, "clear");
}

static void check_qp_error(struct vdt_rc_pair *p, uint64_t *src, struct ibv_mr *ms, uint64_t *dst,
                           struct ibv_mr *md) {
  char spec[96];
  snprintf(spec, sizeof(spec), "qp_error:port=%u:after=1", (unsigned)p->a.port.lid);
  TEST_ASSERT(V.inject(spec) == 0, "inject %s", spec);
  struct ibv_wc wc;
  TEST_ASSERT(vdt_write(p->qa, 10, ms, src, 8, (uintptr_t)dst, md->rkey, 0, 0) == 0, "post");
  TEST_ASSERT(wait_wc(p->a.cq, &wc, 3000) && wc.status == IBV_WC_SUCCESS, "qp_error: first WR ok");
  for (int i = 0; i < 2; i++)
    TEST_ASSERT(vdt_write(p->qa, 11 + (uint64_t)i, ms, src, 8, (uintptr_t)dst, md->rkey, 0, 0) == 0,
                "post");
  for (int i = 0; i < 2; i++)
    TEST_ASSERT(wait_wc(p->a.cq, &wc, 3000) && wc.status == IBV_WC_WR_FLUSH_ERR &&
                    wc.wr_id == 11 + (uint64_t)i,
                "qp_error: WR %d flushed (%s)", 11 + i, V.wc_status_str(wc.status));
  TEST_ASSERT(p->qa->state == IBV_QPS_ERR, "qp_error: QP in the error state");
  TEST_ASSERT(V.inject("clear") == 0, "clear");
}

static void check_silent(struct vdt_rc_pair *p, uint64_t *src, struct ibv_mr *ms, uint64_t *dst,
                         struct ibv_mr *md) {
  char spec[96];
  snprintf(spec, sizeof(spec), "silent:port=%u:after=1", (unsigned)p->b.port.lid);
  TEST_ASSERT(V.inject(spec) == 0, "inject %s", spec);
  struct tw_vd_stats s0, s1;
  V.stats(&s0);
  struct ibv_wc wc;
  TEST_ASSERT(vdt_write(p->qa, 20, ms, src, 8, (uintptr_t)dst, md->rkey, 0, 0) == 0, "post");
  TEST_ASSERT(wait_wc(p->a.cq, &wc, 3000) && wc.status == IBV_WC_SUCCESS,
              "silent: first packet ok");
  dst[1] = 0;
  TEST_ASSERT(vdt_write(p->qa, 21, ms, &src[1], 8, (uintptr_t)&dst[1], md->rkey, 0, 0) == 0,
              "post");
  const double t0 = tw_test_now();
  int n = vdt_poll(p->a.cq, &wc, 1, 200);
  TEST_ASSERT(n == 0 && tw_test_now() - t0 >= 0.19, "silent peer: no completion in 200 ms (%d)", n);
  TEST_ASSERT(dst[1] == 0, "silent peer applied nothing");
  V.stats(&s1);
  TEST_ASSERT(s1.dropped > s0.dropped, "dropped packets counted");
  TEST_ASSERT(V.inject("clear") == 0, "clear");
}

static void check_env_and_selectors(struct vdt_rc_pair *p, uint64_t *src, struct ibv_mr *ms,
                                    uint64_t *dst, struct ibv_mr *md) {
  TEST_ASSERT(V.inject("bogus:port=*") == -1, "bad kind");
  TEST_ASSERT(V.inject("wc_error:after=1") == -1, "no selector");
  TEST_ASSERT(V.inject("wc_error:port=*:after=x") == -1, "bad count");
  /* TW_VD_FAIL applies to instances opened afterwards */
  TEST_REQUIRE(setenv("TW_VD_FAIL", "wc_error:port=*:after=0", 1) == 0, "setenv");
  struct vdt_nic c;
  vdt_open(&c, "mlx5:2", 0, 64);
  TEST_REQUIRE(unsetenv("TW_VD_FAIL") == 0, "unsetenv");
  struct ibv_qp *qc = vdt_rc_qp(&c, 8, 8, 1, 0, 0), *qb = vdt_rc_qp(&p->b, 8, 8, 1, 0, 0);
  TEST_REQUIRE(qc && qb && vdt_rc_connect(qc, &p->b, qb->qp_num, 0) == 0 &&
                   vdt_rc_connect(qb, &c, qc->qp_num, 0) == 0,
               "QPs");
  struct ibv_mr *mc = vdt_reg(&c, src, 64);
  struct ibv_wc wc;
  TEST_ASSERT(vdt_write(qc, 30, mc, src, 8, (uintptr_t)dst, md->rkey, 0, 0) == 0, "post");
  TEST_ASSERT(wait_wc(c.cq, &wc, 3000) && wc.status == IBV_WC_RETRY_EXC_ERR, "TW_VD_FAIL: %s",
              V.wc_status_str(wc.status));
  V.destroy_qp(qc);
  V.destroy_qp(qb);
  V.dereg_mr(mc);
  vdt_close(&c);
  TEST_REQUIRE(setenv("TW_VD_FAIL", "nonsense", 1) == 0, "setenv");
  int count = 0;
  TEST_REQUIRE(setenv("TW_VD_NICS", "mlx5:1", 1) == 0, "setenv");
  struct ibv_device **list = V.get_device_list(&count);
  TEST_REQUIRE(list && count == 1, "list");
  errno = 0;
  struct ibv_context *bad = V.open_device(list[0]);
  TEST_ASSERT(bad == NULL && errno == EINVAL, "a bad TW_VD_FAIL fails ibv_open_device");
  V.free_device_list(list);
  TEST_REQUIRE(unsetenv("TW_VD_FAIL") == 0, "unsetenv");
  /* dev=<name> reaches instances open now */
  vdt_rc_pair_renew(p, 16);
  TEST_ASSERT(V.inject("wc_error:dev=mlx5_0:after=0") == 0, "inject by device name");
  TEST_ASSERT(vdt_write(p->qa, 31, ms, src, 8, (uintptr_t)dst, md->rkey, 0, 0) == 0, "post");
  TEST_ASSERT(wait_wc(p->a.cq, &wc, 3000) && wc.status == IBV_WC_RETRY_EXC_ERR, "dev=: %s",
              V.wc_status_str(wc.status));
  TEST_ASSERT(V.inject("clear") == 0, "clear");
}

void vdt_test_inject(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 16, 0);
  uint64_t src[8] = {11, 22, 33, 44, 55, 66, 77, 88}, dst[8] = {0};
  struct ibv_mr *ms = vdt_reg(&p.a, src, sizeof(src)), *md = vdt_reg(&p.b, dst, sizeof(dst));
  check_wc_error(&p, src, ms, dst, md);
  vdt_rc_pair_renew(&p, 16);
  check_qp_error(&p, src, ms, dst, md);
  vdt_rc_pair_renew(&p, 16);
  check_silent(&p, src, ms, dst, md);
  check_env_and_selectors(&p, src, ms, dst, md);
  V.dereg_mr(ms);
  V.dereg_mr(md);
  vdt_rc_pair_close(&p);
}

/* ---- two processes: each writes into the other's own malloc'd memory */

struct peer_info {
  uint16_t lid;
  uint32_t qpn, rkey;
  uint64_t addr;
};

#define TP_BYTES (1u << 20)

static int xfer(int fd, void *buf, size_t n, int out) {
  char *p = buf;
  while (n) {
    ssize_t k = out ? write(fd, p, n) : read(fd, p, n);
    if (k <= 0) {
      if (k < 0 && errno == EINTR)
        continue;
      return -1;
    }
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

/* One side: writes `mine` into the peer's buffer, expects `theirs` in its own. 0 or a step. */
static int tp_side(int rfd, int wfd, int dev, uint8_t mine, uint8_t theirs) {
  struct vdt_nic n;
  vdt_open(&n, "mlx5:2", dev, 64);
  uint8_t *buf = calloc(1, TP_BYTES), *src = malloc(TP_BYTES);
  if (!buf || !src)
    return 1;
  memset(src, mine, TP_BYTES);
  struct ibv_mr *mb = vdt_reg(&n, buf, TP_BYTES), *ms = vdt_reg(&n, src, TP_BYTES);
  struct ibv_qp *qp = vdt_rc_qp(&n, 8, 8, 1, 0, 0);
  if (!qp)
    return 2;
  struct peer_info me = {n.port.lid, qp->qp_num, mb->rkey, (uintptr_t)buf}, peer;
  if (xfer(wfd, &me, sizeof(me), 1) || xfer(rfd, &peer, sizeof(peer), 0))
    return 3;
  struct vdt_nic pn = {.port = {.lid = peer.lid}};
  if (vdt_rc_connect(qp, &pn, peer.qpn, 0) != 0 || vdt_post_recvs(qp, 1, 1) != 0)
    return 4;
  char ready = 'r';
  if (xfer(wfd, &ready, 1, 1) || xfer(rfd, &ready, 1, 0)) /* both QPs in RTS */
    return 5;
  if (vdt_write(qp, 9, ms, src, TP_BYTES, peer.addr, peer.rkey, 1, htonl(mine)) != 0)
    return 6;
  struct ibv_wc wc[2];
  int got_send = 0, got_recv = 0;
  const double end = tw_test_now() + 10;
  while ((!got_send || !got_recv) && tw_test_now() < end) {
    if (vdt_poll(n.cq, wc, 1, 100) != 1)
      continue;
    if (wc[0].status != IBV_WC_SUCCESS)
      return 7;
    if (wc[0].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      if (wc[0].imm_data != htonl(theirs) || wc[0].byte_len != TP_BYTES)
        return 8;
      for (size_t i = 0; i < TP_BYTES; i++)
        if (buf[i] != theirs)
          return 9;
      got_recv = 1;
    } else {
      got_send = 1;
    }
  }
  if (!got_send || !got_recv)
    return 10;
  /* the peer's completion means our write landed; stay until it has checked */
  if (xfer(wfd, &ready, 1, 1) || xfer(rfd, &ready, 1, 0))
    return 11;
  V.destroy_qp(qp);
  V.dereg_mr(mb);
  V.dereg_mr(ms);
  vdt_close(&n);
  free(buf);
  free(src);
  return 0;
}

void vdt_test_two_process(void) {
  int p2c[2], c2p[2];
  TEST_REQUIRE(pipe(p2c) == 0 && pipe(c2p) == 0, "pipe");
  fflush(NULL);
  pid_t pid = fork();
  TEST_REQUIRE(pid >= 0, "fork");
  if (pid == 0) {
    close(p2c[1]);
    close(c2p[0]);
    alarm(20);
    _exit(tp_side(p2c[0], c2p[1], 1, 0xC1, 0xA7));
  }
  close(p2c[0]);
  close(c2p[1]);
  const int rc = tp_side(c2p[0], p2c[1], 0, 0xA7, 0xC1);
  TEST_ASSERT(rc == 0, "parent side failed at step %d", rc);
  close(c2p[0]);
  close(p2c[1]);
  int status = 0;
  const double end = tw_test_now() + 15;
  pid_t w;
  while ((w = waitpid(pid, &status, WNOHANG)) == 0 && tw_test_now() < end)
    vdt_sleep_us(5000);
  if (w == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    TEST_ASSERT(0, "child still running after 15 s: killed");
  } else {
    TEST_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child side failed (status 0x%x)",
                status);
  }
}

void vdt_test_shaping(void) {
  TEST_REQUIRE(setenv("TW_VD_LINK", "gbps=8,lat_us=2", 1) == 0, "setenv");
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 16, 0);
  TEST_REQUIRE(unsetenv("TW_VD_LINK") == 0, "unsetenv");
  const uint32_t n = 16u << 20;
  uint8_t *src = malloc(n), *dst = calloc(1, n);
  TEST_REQUIRE(src && dst, "malloc");
  memset(src, 0x3C, n);
  struct ibv_mr *ms = vdt_reg(&p.a, src, n), *md = vdt_reg(&p.b, dst, n);
  const double t0 = tw_test_now();
  TEST_ASSERT(vdt_write(p.qa, 1, ms, src, n, (uintptr_t)dst, md->rkey, 0, 0) == 0, "post 16 MiB");
  struct ibv_wc wc;
  TEST_ASSERT(wait_wc(p.a.cq, &wc, 10000) && wc.status == IBV_WC_SUCCESS, "16 MiB done");
  const double dt = tw_test_now() - t0, model = (double)n * 8 / 8e9;
  printf("  shaping: 16 MiB at gbps=8 took %.2f ms (model %.2f ms)\n", dt * 1e3, model * 1e3);
  TEST_ASSERT(dt >= 0.8 * model, "shaped write too fast: %.2f ms < 0.8 x %.2f ms", dt * 1e3,
              model * 1e3);
  TEST_ASSERT(dt < 2.0, "shaped write too slow: %.2f ms", dt * 1e3);
  TEST_ASSERT(memcmp(src, dst, n) == 0, "shaped data");
  V.dereg_mr(ms);
  V.dereg_mr(md);
  free(src);
  free(dst);
  vdt_rc_pair_close(&p);
}

void vdt_test_throughput(void) {
  struct vdt_rc_pair p;
  vdt_rc_pair_open(&p, 64, 0);
  const uint32_t total = 64u << 20, chunk = 1u << 20;
  uint8_t *src = malloc(total), *dst = calloc(1, total);
  TEST_REQUIRE(src && dst, "malloc");
  for (uint32_t i = 0; i < total; i += 4096)
    memset(src + i, (int)(i >> 12), 4096);
  struct ibv_mr *ms = vdt_reg(&p.a, src, total), *md = vdt_reg(&p.b, dst, total);
  double best = 0;
  for (int round = 0; round < 3; round++) {
    const double t0 = tw_test_now();
    uint32_t posted = 0, done = 0;
    int ok = 1;
    while (done < total / chunk && ok) {
      while (posted < total / chunk && posted - done < 16) {
        ok &= vdt_write(p.qa, posted, ms, src + (size_t)posted * chunk, chunk,
                        (uintptr_t)(dst + (size_t)posted * chunk), md->rkey, 0, 0) == 0;
        posted++;
      }
      struct ibv_wc wc[16];
      int k = vdt_poll(p.a.cq, wc, 1, 5000);
      ok &= k == 1 && wc[0].status == IBV_WC_SUCCESS;
      done += (uint32_t)k;
    }
    TEST_ASSERT(ok, "throughput round %d", round);
    const double gbs = total / (tw_test_now() - t0) / 1e9;
    best = gbs > best ? gbs : best;
  }
  TEST_ASSERT(memcmp(src, dst, total) == 0, "throughput data");
  printf("  throughput: one RC stream, 64 MiB in 1 MiB writes, 16 in flight: %.2f GB/s\n", best);
  V.dereg_mr(ms);
  V.dereg_mr(md);
  free(src);
  free(dst);
  vdt_rc_pair_close(&p);
}
