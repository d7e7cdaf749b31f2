/*
 * Tests of the verbs test double (README.md beside this file): devices and queries, RC writes
 * (sizes, SGEs, inline, iova and dmabuf MRs, ordering, immediates, sends, RNR, errors, the QP
 * state machine, CQ overrun), SRD on the EFA kind (reordering observed, errors), injected
 * failures, two processes, link shaping, and one RC stream's throughput.
 *
 *   test_verbs_double <path of the double's .so>
 *
 * The library is loaded by path with dlopen and every entry point comes from dlsym, as the
 * backends do. Runs on a fresh fabric file it removes at the end.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "vdt.h"

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "FATAL: test_verbs_double still running after its bound: a hang\n";
  if (write(2, msg, sizeof(msg) - 1) < 0) {
  }
  _exit(1);
}

static void check_device_list(void) {
  TEST_REQUIRE(setenv("TW_VD_NICS", "mlx5:2,efa:1", 1) == 0, "setenv");
  int n = -1;
  struct ibv_device **list = V.get_device_list(&n);
  TEST_REQUIRE(list, "ibv_get_device_list: %s", strerror(errno));
  TEST_ASSERT(n == 3, "3 devices, got %d", n);
  if (n == 3) {
    TEST_ASSERT(strcmp(V.get_device_name(list[0]), "mlx5_0") == 0, "%s", list[0]->name);
    TEST_ASSERT(strcmp(V.get_device_name(list[1]), "mlx5_1") == 0, "%s", list[1]->name);
    TEST_ASSERT(strcmp(V.get_device_name(list[2]), "rdmap0s0") == 0, "%s", list[2]->name);
    TEST_ASSERT(list[0]->node_type == IBV_NODE_CA && list[0]->transport_type == IBV_TRANSPORT_IB,
                "mlx5 types");
    TEST_ASSERT(list[2]->node_type == IBV_NODE_UNSPECIFIED &&
                    list[2]->transport_type == IBV_TRANSPORT_UNSPECIFIED,
                "efa types");
    TEST_ASSERT(list[3] == NULL, "NULL-terminated");
    TEST_ASSERT(list[0]->ibdev_path[0] == '\0', "ibdev_path empty");
  }
  V.free_device_list(list);
  TEST_REQUIRE(setenv("TW_VD_NICS", "bogus:1", 1) == 0, "setenv");
  errno = 0;
  list = V.get_device_list(&n);
  TEST_ASSERT(list == NULL && errno == EINVAL, "bad TW_VD_NICS refused (errno %d)", errno);
  TEST_REQUIRE(unsetenv("TW_VD_NICS") == 0, "unsetenv");
  list = V.get_device_list(&n);
  TEST_ASSERT(list && n == 2 && strcmp(list[1]->name, "mlx5_1") == 0, "default mlx5:2 (%d)", n);
  if (list)
    V.free_device_list(list);
}

static void check_queries(struct vdt_nic *m, struct vdt_nic *m2, struct vdt_nic *e) {
  struct ibv_device_attr da;
  TEST_ASSERT(V.query_device(m->ctx, &da) == 0, "query_device");
  TEST_ASSERT(strcmp(da.fw_ver, "tw-verbs-double") == 0, "fw_ver %s", da.fw_ver);
  TEST_ASSERT(da.max_qp_wr == 8192 && da.max_sge == 16 && da.max_cqe == (1 << 20) &&
                  da.max_qp == 4096 && da.phys_port_cnt == 1 && da.atomic_cap == IBV_ATOMIC_NONE &&
                  da.max_mr_size > 0,
              "device attributes");
  TEST_ASSERT(m->port.state == IBV_PORT_ACTIVE && m->port.active_mtu == IBV_MTU_4096 &&
                  m->port.link_layer == IBV_LINK_LAYER_ETHERNET,
              "mlx5 port");
  TEST_ASSERT(e->port.link_layer == IBV_LINK_LAYER_UNSPECIFIED, "efa link layer");
  TEST_ASSERT(m->port.lid && m2->port.lid && e->port.lid && m->port.lid != m2->port.lid &&
                  m->port.lid != e->port.lid,
              "distinct LIDs %u %u %u", m->port.lid, m2->port.lid, e->port.lid);
  TEST_ASSERT(memcmp(&m->gid, &m2->gid, 16) != 0 && m->gid.raw[0] == 0xfe, "distinct GIDs");
  struct ibv_port_attr pa;
  TEST_ASSERT(V.query_port(m->ctx, 2, &pa) != 0, "port 2 does not exist");
  union ibv_gid g;
  TEST_ASSERT(V.query_gid(m->ctx, 1, 1, &g) != 0, "gid index 1 does not exist");
  TEST_ASSERT(m->ctx->abi_compat != __VERBS_ABI_IS_EXTENDED, "not an extended context");
  TEST_ASSERT(m->ctx->ops.post_send && m->ctx->ops.post_recv && m->ctx->ops.poll_cq, "ops");
}

static void check_efa_queries(struct vdt_nic *m, struct vdt_nic *e) {
  struct efadv_device_attr ea;
  TEST_ASSERT(V.efa_query_device(m->ctx, &ea, sizeof(ea)) == EOPNOTSUPP, "efadv on mlx5");
  memset(&ea, 0, sizeof(ea));
  TEST_ASSERT(V.efa_query_device(e->ctx, &ea, sizeof(ea)) == 0, "efadv_query_device");
  TEST_ASSERT((ea.device_caps & (1u << 3)) && (ea.device_caps & EFADV_DEVICE_ATTR_CAPS_RNR_RETRY) &&
                  (ea.device_caps & EFADV_DEVICE_ATTR_CAPS_RDMA_READ),
              "caps 0x%x", ea.device_caps);
  TEST_ASSERT(ea.max_rdma_size == (1u << 30) && ea.max_sq_wr > 0 && ea.max_rq_wr > 0 &&
                  ea.max_sq_sge > 0,
              "efa limits");
  /* inlen covers only the first fields: nothing beyond is written */
  memset(&ea, 0xAB, sizeof(ea));
  TEST_ASSERT(V.efa_query_device(e->ctx, &ea, 16) == 0, "short inlen");
  TEST_ASSERT(ea.max_sq_wr == 8192 && ea.max_sq_sge == 0xABAB, "only inlen bytes filled");
  struct ibv_qp *qp = vdt_rc_qp(e, 4, 4, 1, 0, 0);
  TEST_ASSERT(qp == NULL && errno == EOPNOTSUPP, "no RC QP on EFA (errno %d)", errno);
  struct ibv_qp_init_attr_ex ax;
  memset(&ax, 0, sizeof(ax));
  ax.send_cq = m->cq;
  ax.recv_cq = m->cq;
  ax.qp_type = IBV_QPT_DRIVER;
  ax.comp_mask = IBV_QP_INIT_ATTR_PD;
  ax.pd = m->pd;
  struct efadv_qp_init_attr ex = {.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD};
  qp = V.efa_create_qp_ex(m->ctx, &ax, &ex, sizeof(ex));
  TEST_ASSERT(qp == NULL && errno == EOPNOTSUPP, "no SRD QP on mlx5 (errno %d)", errno);
}

void vdt_test_devices(void) {
  check_device_list();
  struct vdt_nic m, m2, e;
  vdt_open(&m, "mlx5:2,efa:1", 0, 16);
  vdt_open(&m2, "mlx5:2,efa:1", 0, 16); /* the same device again: another port */
  vdt_open(&e, "mlx5:2,efa:1", 2, 16);
  check_queries(&m, &m2, &e);
  check_efa_queries(&m, &e);
  TEST_ASSERT(strcmp(V.wc_status_str(IBV_WC_SUCCESS), "success") == 0, "wc_status_str");
  TEST_ASSERT(strlen(V.wc_status_str(IBV_WC_REM_ACCESS_ERR)) > 0, "wc_status_str");
  TEST_ASSERT(V.fork_init() == 0, "ibv_fork_init");
  vdt_close(&m);
  vdt_close(&m2);
  vdt_close(&e);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s <libtw_verbs_double.so>\n", argv[0]);
    return 1;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGALRM, on_alarm);
  alarm(100);
  char fabric[256];
  snprintf(fabric, sizeof(fabric), "%s/tw-vd-test-%d",
           access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (int)getpid());
  TEST_REQUIRE(setenv("TW_VD_FABRIC", fabric, 1) == 0 && setenv("TW_VD_RNR_MS", "300", 1) == 0,
               "setenv");
  unsetenv("TW_VD_LINK");
  unsetenv("TW_VD_FAIL");
  unsetenv("TW_VD_SEED");
  if (vdt_load(argv[1]) != 0)
    return 1;
  static const struct {
    const char *name;
    void (*fn)(void);
  } tests[] = {
      {"two_process", vdt_test_two_process}, /* first: fork with no engine threads running */
      {"devices", vdt_test_devices},
      {"rc_writes", vdt_test_rc_writes},
      {"rc_sges_inline", vdt_test_rc_sges_inline},
      {"rc_limits", vdt_test_rc_limits},
      {"rc_mr_kinds", vdt_test_rc_mr_kinds},
      {"rc_ordering", vdt_test_rc_ordering},
      {"rc_imm_send", vdt_test_rc_imm_send},
      {"rc_rnr", vdt_test_rc_rnr},
      {"rc_errors", vdt_test_rc_errors},
      {"rc_state_machine", vdt_test_rc_state_machine},
      {"cq_overflow", vdt_test_cq_overflow},
      {"srd", vdt_test_srd},
      {"srd_errors", vdt_test_srd_errors},
      {"inject", vdt_test_inject},
      {"shaping", vdt_test_shaping},
      {"throughput", vdt_test_throughput},
  };
  for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++) {
    const int failed_before = tw_test_failed;
    const double t0 = tw_test_now();
    tests[i].fn();
    printf("%-18s %s (%.2f s)\n", tests[i].name, tw_test_failed == failed_before ? "ok" : "FAILED",
           tw_test_now() - t0);
  }
  if (unlink(fabric) != 0)
    fprintf(stderr, "unlink(%s): %s\n", fabric, strerror(errno));
  return tw_test_finish();
}
