/*
 * rdma-core, loaded at run time: the ibv_* and efadv_* entry points the inter-node backends
 * call, resolved from libibverbs.so.1 and libefa.so.1 (or the libraries TW_IBVERBS_LIB and
 * TW_EFADV_LIB name: the tests point both at the verbs test double). libtilewire links
 * neither, so it loads and works inside a node on a host without rdma-core.
 *
 * Only exported functions are resolved here. verbs.h's static inline ones (ibv_post_send,
 * ibv_post_recv, ibv_poll_cq, ibv_wr_*) dispatch through the function pointers of the objects
 * the library returns and are called directly; the inline wrappers that call an exported symbol
 * (ibv_query_port, ibv_reg_mr) must not be, or libtilewire would link libibverbs: their tables
 * entries below are called instead.
 */
#ifndef TW_TRANSPORT_VERBS_VERBS_H
#define TW_TRANSPORT_VERBS_VERBS_H

#include <infiniband/verbs.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* rdma-core 46's name (44's efadv.h lacks it): the device can RDMA-write over SRD. */
#ifndef EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE
#define EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE (1 << 3)
#endif

struct efadv_device_attr;
struct efadv_qp_init_attr;

typedef struct tw_verbs {
  struct ibv_device **(*get_device_list)(int *num_devices);
  void (*free_device_list)(struct ibv_device **list);
  const char *(*get_device_name)(struct ibv_device *device);
  struct ibv_context *(*open_device)(struct ibv_device *device);
  int (*close_device)(struct ibv_context *context);
  int (*query_device)(struct ibv_context *context, struct ibv_device_attr *attr);
  /* the exported symbol, which fills struct ibv_port_attr's leading (compat) fields */
  int (*query_port)(struct ibv_context *context, uint8_t port, struct ibv_port_attr *attr);
  int (*query_gid)(struct ibv_context *context, uint8_t port, int index, union ibv_gid *gid);
  struct ibv_pd *(*alloc_pd)(struct ibv_context *context);
  int (*dealloc_pd)(struct ibv_pd *pd);
  struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t length, int access);
  struct ibv_mr *(*reg_mr_iova)(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                                int access); /* NULL: rdma-core older than 21 */
  struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova,
                                  int fd, int access); /* NULL: older than 34 */
  int (*dereg_mr)(struct ibv_mr *mr);
  struct ibv_cq *(*create_cq)(struct ibv_context *context, int cqe, void *cq_context,
                              struct ibv_comp_channel *channel, int comp_vector);
  int (*destroy_cq)(struct ibv_cq *cq);
  struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
  int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
  int (*destroy_qp)(struct ibv_qp *qp);
  struct ibv_ah *(*create_ah)(struct ibv_pd *pd, struct ibv_ah_attr *attr);
  int (*destroy_ah)(struct ibv_ah *ah);
  struct ibv_qp_ex *(*qp_to_qp_ex)(struct ibv_qp *qp); /* NULL: older than 26 */
  const char *(*wc_status_str)(enum ibv_wc_status status);
  /* libefa; NULL where it is absent (then no EFA device is usable) */
  int (*efadv_query_device)(struct ibv_context *context, struct efadv_device_attr *attr,
                            uint32_t inlen);
  struct ibv_qp *(*efadv_create_qp_ex)(struct ibv_context *context,
                                       struct ibv_qp_init_attr_ex *attr,
                                       struct efadv_qp_init_attr *efa_attr, uint32_t inlen);
  /* what was loaded, for tw-info and messages: the file, and rdma-core's version read from its
   * name (libibverbs.so.1.14.44.0: 44.0), "" when the name does not carry one */
  char path[256];
  char version[32];
} tw_verbs_t;

/* The table, loaded on first use (thread-safe); TW_ERR_NOT_SUPPORTED with a message naming the
 * library and what to install when libibverbs cannot be loaded or lacks an entry point. */
tw_status_t tw_verbs_load(const tw_verbs_t **out);

#ifdef __cplusplus
}
#endif
#endif
