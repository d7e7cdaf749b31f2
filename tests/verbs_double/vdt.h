/*
 * The verbs double's test harness. The test loads the double by path and resolves every entry
 * point with dlsym, as a backend does; the inline verbs (ibv_post_send, ibv_post_recv,
 * ibv_poll_cq, ibv_wr_*) dispatch through the ops the double fills in, so the test uses those
 * directly. Every wait is bounded.
 */
#ifndef VDT_H
#define VDT_H

#include <infiniband/efadv.h>
#include <infiniband/verbs.h>

#include "tw_test.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tw_vd.h"

#ifdef __cplusplus
extern "C" {
#endif

struct vdt_api {
  struct ibv_device **(*get_device_list)(int *);
  void (*free_device_list)(struct ibv_device **);
  const char *(*get_device_name)(struct ibv_device *);
  struct ibv_context *(*open_device)(struct ibv_device *);
  int (*close_device)(struct ibv_context *);
  int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
  int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
  int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
  struct ibv_pd *(*alloc_pd)(struct ibv_context *);
  int (*dealloc_pd)(struct ibv_pd *);
  struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
  struct ibv_mr *(*reg_mr_iova)(struct ibv_pd *, void *, size_t, uint64_t, int);
  struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int);
  int (*dereg_mr)(struct ibv_mr *);
  struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
  int (*destroy_cq)(struct ibv_cq *);
  struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
  int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
  int (*destroy_qp)(struct ibv_qp *);
  struct ibv_ah *(*create_ah)(struct ibv_pd *, struct ibv_ah_attr *);
  int (*destroy_ah)(struct ibv_ah *);
  struct ibv_qp_ex *(*qp_to_qp_ex)(struct ibv_qp *);
  const char *(*wc_status_str)(enum ibv_wc_status);
  int (*fork_init)(void);
  int (*efa_query_device)(struct ibv_context *, struct efadv_device_attr *, uint32_t);
  struct ibv_qp *(*efa_create_qp_ex)(struct ibv_context *, struct ibv_qp_init_attr_ex *,
                                     struct efadv_qp_init_attr *, uint32_t);
  tw_vd_inject_fn inject;
  tw_vd_stats_fn stats;
};
extern struct vdt_api V;

/* Loads the double and resolves the entry points; 0 or -1 (message printed). */
int vdt_load(const char *path);

void vdt_sleep_us(long us);

/* One opened NIC instance with a PD and one CQ for everything */
struct vdt_nic {
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_cq *cq;
  struct ibv_port_attr port;
  union ibv_gid gid;
};

/* Opens device `index` of the list TW_VD_NICS=nics gives; TEST_REQUIREs success. cqe: CQ size. */
void vdt_open(struct vdt_nic *n, const char *nics, int index, int cqe);
void vdt_close(struct vdt_nic *n);

struct ibv_mr *vdt_reg(struct vdt_nic *n, void *buf, size_t len);

/* An RC QP (all caps in one place); NULL on failure (errno set). */
struct ibv_qp *vdt_rc_qp(struct vdt_nic *n, uint32_t max_send_wr, uint32_t max_recv_wr,
                         uint32_t max_sge, uint32_t max_inline, int sig_all);
/* RESET -> INIT -> RTR -> RTS towards (peer, peer_qpn); addressed by GID when by_gid.
 * 0 or the failing ibv_modify_qp's errno. */
int vdt_rc_connect(struct ibv_qp *qp, const struct vdt_nic *peer, uint32_t peer_qpn, int by_gid);
/* Two NICs (devices 0 and 1 of "mlx5:2") and a connected RC QP pair a -> b */
struct vdt_rc_pair {
  struct vdt_nic a, b;
  struct ibv_qp *qa, *qb;
};
void vdt_rc_pair_open(struct vdt_rc_pair *p, uint32_t max_wr, int by_gid);
/* Replaces the pair's QPs by fresh connected ones (addressed by LID); drains both CQs */
void vdt_rc_pair_renew(struct vdt_rc_pair *p, uint32_t max_wr);
void vdt_rc_pair_close(struct vdt_rc_pair *p);

/* Polls cq until `want` completions arrived or timeout_ms passed; returns how many. */
int vdt_poll(struct ibv_cq *cq, struct ibv_wc *wc, int want, int timeout_ms);
/* Posts one RDMA write (IBV_WR_RDMA_WRITE or _WITH_IMM), signaled; returns ibv_post_send's rc */
int vdt_write(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mr *lmr, void *src, uint32_t len,
              uint64_t raddr, uint32_t rkey, int with_imm, uint32_t imm);
/* Posts `n` receive WRs without SGEs, ids first_id.. */
int vdt_post_recvs(struct ibv_qp *qp, int n, uint64_t first_id);

/* The test groups (vdt_rc.c, vdt_rc2.c, vdt_srd.c, vdt_fail.c) */
void vdt_test_devices(void);
void vdt_test_rc_writes(void);
void vdt_test_rc_sges_inline(void);
void vdt_test_rc_limits(void);
void vdt_test_rc_mr_kinds(void);
void vdt_test_rc_ordering(void);
void vdt_test_rc_imm_send(void);
void vdt_test_rc_rnr(void);
void vdt_test_rc_errors(void);
void vdt_test_rc_state_machine(void);
void vdt_test_cq_overflow(void);
void vdt_test_srd(void);
void vdt_test_srd_errors(void);
void vdt_test_inject(void);
void vdt_test_two_process(void);
void vdt_test_shaping(void);
void vdt_test_throughput(void);

#ifdef __cplusplus
}
#endif

#endif
