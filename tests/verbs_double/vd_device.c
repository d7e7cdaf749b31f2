/*
 * Devices and contexts: TW_VD_NICS's device list, ibv_open_device (one NIC instance: a port on
 * the fabric with its own engine thread), the query calls, PDs, AHs and the small helpers.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "vd.h"

#define VD_MAX_DEVICES 64

static pthread_mutex_t g_dev_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vd_device *g_devices[VD_MAX_DEVICES];
static int g_ndevices;

uint64_t vd_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t vd_rand(uint64_t *s) {
  /* xorshift64*: cheap, seeded, reproducible */
  uint64_t x = *s ? *s : 0x9E3779B97F4A7C15ull;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1Dull;
}

void vd_lock(pthread_mutex_t *m) {
  int e = pthread_mutex_lock(m);
  if (e) {
    fprintf(stderr, "tw-verbs-double: pthread_mutex_lock: %s\n", strerror(e));
    abort();
  }
}

void vd_unlock(pthread_mutex_t *m) {
  int e = pthread_mutex_unlock(m);
  if (e) {
    fprintf(stderr, "tw-verbs-double: pthread_mutex_unlock: %s\n", strerror(e));
    abort();
  }
}

/* The registry keeps each (kind, index) device for the life of the process: contexts point at
 * them, and real libibverbs keeps opened devices valid after ibv_free_device_list too. */
static struct vd_device *device_get(int kind, int kind_index, int list_index) {
  for (int i = 0; i < g_ndevices; i++)
    if (g_devices[i]->kind == kind && g_devices[i]->kind_index == kind_index) {
      g_devices[i]->index = list_index;
      return g_devices[i];
    }
  if (g_ndevices == VD_MAX_DEVICES)
    return NULL;
  struct vd_device *d = calloc(1, sizeof(*d));
  if (!d)
    return NULL;
  d->kind = kind;
  d->kind_index = kind_index;
  d->index = list_index;
  if (kind == VD_KIND_MLX5) {
    d->dev.node_type = IBV_NODE_CA;
    d->dev.transport_type = IBV_TRANSPORT_IB;
    snprintf(d->dev.name, sizeof(d->dev.name), "mlx5_%d", kind_index);
  } else {
    d->dev.node_type = IBV_NODE_UNSPECIFIED;
    d->dev.transport_type = IBV_TRANSPORT_UNSPECIFIED;
    snprintf(d->dev.name, sizeof(d->dev.name), "rdmap%ds0", kind_index);
  }
  snprintf(d->dev.dev_name, sizeof(d->dev.dev_name), "uverbs%d",
           kind_index + (kind == VD_KIND_EFA ? 1000 : 0));
  d->dev.dev_path[0] = '\0';
  d->dev.ibdev_path[0] = '\0';
  g_devices[g_ndevices++] = d;
  return d;
}

/* TW_VD_NICS: "mlx5:N" / "efa:N" groups, comma-separated. Fills list[] (NULL-terminated). */
static int parse_nics(const char *spec, struct ibv_device **list, int max) {
  int n = 0, nmlx = 0, nefa = 0;
  const char *s = spec;
  while (*s) {
    int kind;
    if (strncmp(s, "mlx5:", 5) == 0) {
      kind = VD_KIND_MLX5;
      s += 5;
    } else if (strncmp(s, "efa:", 4) == 0) {
      kind = VD_KIND_EFA;
      s += 4;
    } else {
      return -1;
    }
    char *end;
    long count = strtol(s, &end, 10);
    if (end == s || count < 0 || count > 32 || (*end && *end != ','))
      return -1;
    for (long i = 0; i < count; i++) {
      if (n == max)
        return -1;
      struct vd_device *d = device_get(kind, kind == VD_KIND_MLX5 ? nmlx++ : nefa++, n);
      if (!d)
        return -1;
      list[n++] = &d->dev;
    }
    s = *end ? end + 1 : end;
  }
  list[n] = NULL;
  return n;
}

struct ibv_device **ibv_get_device_list(int *num_devices) {
  const char *env = getenv("TW_VD_NICS");
  const char *spec = env && *env ? env : "mlx5:2";
  struct ibv_device **list = calloc(VD_MAX_DEVICES + 1, sizeof(*list));
  if (!list) {
    errno = ENOMEM;
    return NULL;
  }
  vd_lock(&g_dev_lock);
  int n = parse_nics(spec, list, VD_MAX_DEVICES);
  vd_unlock(&g_dev_lock);
  if (n < 0) {
    fprintf(stderr,
            "tw-verbs-double: TW_VD_NICS=\"%s\": expected mlx5:N / efa:N groups, "
            "comma-separated, at most %d devices\n",
            spec, VD_MAX_DEVICES);
    free(list);
    errno = EINVAL;
    return NULL;
  }
  if (num_devices)
    *num_devices = n;
  return list;
}

void ibv_free_device_list(struct ibv_device **list) { free(list); }

const char *ibv_get_device_name(struct ibv_device *device) { return device ? device->name : NULL; }

__be64 ibv_get_device_guid(struct ibv_device *device) {
  (void)device;
  return 0;
}

int ibv_fork_init(void) { return 0; }

/* TW_VD_LINK: "gbps=G,lat_us=L" (either may be left out); empty: unshaped. */
static int parse_link(const char *spec, double *ns_per_byte, uint64_t *lat_ns) {
  *ns_per_byte = 0;
  *lat_ns = 0;
  const char *s = spec;
  while (s && *s) {
    char *end;
    if (strncmp(s, "gbps=", 5) == 0) {
      double g = strtod(s + 5, &end);
      if (end == s + 5 || g <= 0)
        return -1;
      *ns_per_byte = 8.0 / g;
    } else if (strncmp(s, "lat_us=", 7) == 0) {
      double l = strtod(s + 7, &end);
      if (end == s + 7 || l < 0)
        return -1;
      *lat_ns = (uint64_t)(l * 1000.0);
    } else {
      return -1;
    }
    if (*end && *end != ',')
      return -1;
    s = *end ? end + 1 : end;
  }
  return 0;
}

static int ctx_knobs(struct vd_ctx *c) {
  const char *link = getenv("TW_VD_LINK");
  if (parse_link(link, &c->ns_per_byte, &c->lat_ns) != 0) {
    fprintf(stderr, "tw-verbs-double: TW_VD_LINK=\"%s\": expected gbps=G,lat_us=L\n", link);
    return EINVAL;
  }
  const char *rnr = getenv("TW_VD_RNR_MS");
  long ms = rnr && *rnr ? strtol(rnr, NULL, 10) : VD_DEFAULT_RNR_MS;
  c->rnr_ns = (uint64_t)(ms > 0 ? ms : 0) * 1000000ull;
  const char *seed = getenv("TW_VD_SEED");
  uint64_t s = seed && *seed ? strtoull(seed, NULL, 0) : 0x7477766400000001ull;
  /* each instance its own stream: the seed mixed with the LID, not with time or pids */
  c->rng = s ^ ((uint64_t)c->lid * 0x9E3779B97F4A7C15ull);
  vd_rand(&c->rng);
  return 0;
}

static int vd_req_notify_cq(struct ibv_cq *cq, int solicited_only) {
  (void)cq;
  (void)solicited_only;
  return EOPNOTSUPP; /* no completion channels: the proxy polls */
}

/* A forked child has only the forking thread: locks another thread held at the fork are
 * re-created, and the parent's contexts are not the child's. */
static void after_fork_child(void) {
  pthread_mutex_init(&g_dev_lock, NULL);
  vd_fabric_after_fork();
  vd_inject_after_fork();
}

static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) {
  int e = pthread_atfork(NULL, NULL, after_fork_child);
  if (e)
    fprintf(stderr, "tw-verbs-double: pthread_atfork: %s\n", strerror(e));
}

struct ibv_context *ibv_open_device(struct ibv_device *device) {
  struct vd_device *d = (struct vd_device *)device;
  struct vd_ctx *c = NULL;
  int err = 0, have_port = 0;
  if (!d) {
    err = EINVAL;
    goto fail;
  }
  pthread_once(&g_atfork_once, install_atfork);
  err = vd_fabric_join();
  if (err)
    goto fail;
  c = calloc(1, sizeof(*c));
  if (!c) {
    err = ENOMEM;
    goto fail;
  }
  c->dev = d;
  c->kind = d->kind;
  c->mr_mask = 1023;
  c->mr_hash = calloc(c->mr_mask + 1, sizeof(*c->mr_hash));
  if (!c->mr_hash) {
    err = ENOMEM;
    goto fail;
  }
  pthread_mutex_init(&c->lock, NULL);
  pthread_mutex_init(&c->mr_lock, NULL);
  pthread_mutex_init(&c->rule_lock, NULL);
  err = vd_port_alloc(c);
  if (err)
    goto fail;
  have_port = 1;
  err = ctx_knobs(c);
  if (!err)
    err = vd_rules_for_new_port(c);
  if (err)
    goto fail;
  c->ctx.device = device;
  c->ctx.ops.poll_cq = vd_poll_cq;
  c->ctx.ops.req_notify_cq = vd_req_notify_cq;
  c->ctx.ops.post_send = vd_post_send;
  c->ctx.ops.post_recv = vd_post_recv;
  c->ctx.cmd_fd = -1;
  c->ctx.async_fd = -1;
  c->ctx.num_comp_vectors = 1;
  pthread_mutex_init(&c->ctx.mutex, NULL);
  /* not __VERBS_ABI_IS_EXTENDED: verbs_get_ctx() is NULL, the inline verbs fall back to the
   * exported entry points and the ops above */
  c->ctx.abi_compat = NULL;
  err = vd_engine_start(c);
  if (err)
    goto fail;
  vd_register_ctx(c);
  return &c->ctx;
fail:
  if (c) {
    if (have_port)
      vd_port_free(c);
    free(c->mr_hash);
    free(c);
  }
  errno = err ? err : EINVAL;
  return NULL;
}

int ibv_close_device(struct ibv_context *context) {
  struct vd_ctx *c = (struct vd_ctx *)context;
  if (!c)
    return EINVAL;
  vd_unregister_ctx(c);
  vd_engine_stop(c);
  for (uint32_t i = 0; i < c->nqp_hi; i++)
    if (c->qps[i]) /* QPs the caller left behind: off the fabric at least */
      vd_qpn_free(c->qps[i]->qpx.qp_base.qp_num);
  vd_port_free(c);
  vd_cuda_engine_free(c);
  free(c->backlog);
  free(c->mr_hash);
  free(c);
  return 0;
}

int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *a) {
  struct vd_ctx *c = (struct vd_ctx *)context;
  if (!c || !a)
    return EINVAL;
  memset(a, 0, sizeof(*a));
  snprintf(a->fw_ver, sizeof(a->fw_ver), "tw-verbs-double");
  a->node_guid = htobe64(c->guid);
  a->sys_image_guid = htobe64(c->guid);
  a->max_mr_size = VD_MAX_MSG << 10;
  a->page_size_cap = 4096;
  a->vendor_id = c->kind == VD_KIND_MLX5 ? 0x02c9 : 0x1d0f;
  a->vendor_part_id = c->kind == VD_KIND_MLX5 ? 4129 : 0xefa1;
  a->max_qp = VD_MAX_QP;
  a->max_qp_wr = VD_MAX_WR;
  a->max_sge = VD_MAX_SGE;
  a->max_sge_rd = VD_MAX_SGE;
  a->max_cq = VD_MAX_QP;
  a->max_cqe = VD_MAX_CQE;
  a->max_mr = 1 << 16;
  a->max_pd = 1 << 12;
  a->max_qp_rd_atom = 16;
  a->max_qp_init_rd_atom = 16;
  a->max_res_rd_atom = 16 * VD_MAX_QP;
  a->atomic_cap = IBV_ATOMIC_NONE;
  a->max_ah = 1 << 16;
  a->max_pkeys = 1;
  a->local_ca_ack_delay = 16;
  a->phys_port_cnt = 1;
  return 0;
}

/* The exported symbol takes the compat struct in the header; callers pass (and libibverbs'
 * inline wrapper passes) a struct ibv_port_attr, whose layout is what is filled. */
#undef ibv_query_port
int ibv_query_port(struct ibv_context *context, uint8_t port_num,
                   struct _compat_ibv_port_attr *compat) {
  struct vd_ctx *c = (struct vd_ctx *)context;
  struct ibv_port_attr *a = (struct ibv_port_attr *)compat;
  if (!c || !a || port_num != 1)
    return EINVAL;
  memset(a, 0, sizeof(*a));
  a->state = IBV_PORT_ACTIVE;
  a->max_mtu = IBV_MTU_4096;
  a->active_mtu = IBV_MTU_4096;
  a->gid_tbl_len = 1;
  a->max_msg_sz = (uint32_t)VD_MAX_MSG;
  a->pkey_tbl_len = 1;
  a->lid = c->lid;
  a->max_vl_num = 1;
  a->active_width = 2;   /* 4x */
  a->active_speed = 128; /* NDR */
  a->phys_state = 5;     /* link up */
  a->link_layer = c->kind == VD_KIND_MLX5 ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_UNSPECIFIED;
  return 0;
}

int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid) {
  struct vd_ctx *c = (struct vd_ctx *)context;
  if (!c || !gid || port_num != 1 || index != 0) {
    errno = EINVAL;
    return -1;
  }
  memcpy(gid->raw, c->gid, 16);
  return 0;
}

struct ibv_pd *ibv_alloc_pd(struct ibv_context *context) {
  if (!context) {
    errno = EINVAL;
    return NULL;
  }
  struct vd_pd *pd = calloc(1, sizeof(*pd));
  if (!pd) {
    errno = ENOMEM;
    return NULL;
  }
  pd->pd.context = context;
  pd->pd.handle = vd_key_alloc();
  return &pd->pd;
}

int ibv_dealloc_pd(struct ibv_pd *pd) {
  if (!pd)
    return EINVAL;
  free(pd);
  return 0;
}

struct ibv_ah *ibv_create_ah(struct ibv_pd *pd, struct ibv_ah_attr *attr) {
  if (!pd || !attr || (!attr->is_global && attr->dlid == 0)) {
    errno = EINVAL;
    return NULL;
  }
  struct vd_ah *ah = calloc(1, sizeof(*ah));
  if (!ah) {
    errno = ENOMEM;
    return NULL;
  }
  ah->ah.context = pd->context;
  ah->ah.pd = pd;
  ah->ah.handle = vd_key_alloc();
  ah->addr.is_global = attr->is_global ? 1 : 0;
  ah->addr.lid = attr->dlid;
  memcpy(ah->addr.gid, attr->grh.dgid.raw, 16);
  return &ah->ah;
}

int ibv_destroy_ah(struct ibv_ah *ah) {
  if (!ah)
    return EINVAL;
  free(ah);
  return 0;
}

const char *ibv_wc_status_str(enum ibv_wc_status status) {
  static const char *const names[] = {
      [IBV_WC_SUCCESS] = "success",
      [IBV_WC_LOC_LEN_ERR] = "local length error",
      [IBV_WC_LOC_QP_OP_ERR] = "local QP operation error",
      [IBV_WC_LOC_EEC_OP_ERR] = "local EE context operation error",
      [IBV_WC_LOC_PROT_ERR] = "local protection error",
      [IBV_WC_WR_FLUSH_ERR] = "Work Request Flushed Error",
      [IBV_WC_MW_BIND_ERR] = "memory management operation error",
      [IBV_WC_BAD_RESP_ERR] = "bad response error",
      [IBV_WC_LOC_ACCESS_ERR] = "local access error",
      [IBV_WC_REM_INV_REQ_ERR] = "remote invalid request error",
      [IBV_WC_REM_ACCESS_ERR] = "remote access error",
      [IBV_WC_REM_OP_ERR] = "remote operation error",
      [IBV_WC_RETRY_EXC_ERR] = "transport retry counter exceeded",
      [IBV_WC_RNR_RETRY_EXC_ERR] = "RNR retry counter exceeded",
      [IBV_WC_LOC_RDD_VIOL_ERR] = "local RDD violation error",
      [IBV_WC_REM_INV_RD_REQ_ERR] = "remote invalid RD request",
      [IBV_WC_REM_ABORT_ERR] = "aborted error",
      [IBV_WC_INV_EECN_ERR] = "invalid EE context number",
      [IBV_WC_INV_EEC_STATE_ERR] = "invalid EE context state",
      [IBV_WC_FATAL_ERR] = "fatal error",
      [IBV_WC_RESP_TIMEOUT_ERR] = "response timeout error",
      [IBV_WC_GENERAL_ERR] = "general error",
      [IBV_WC_TM_ERR] = "TM error",
      [IBV_WC_TM_RNDV_INCOMPLETE] = "TM software rendezvous",
  };
  if ((unsigned)status < sizeof(names) / sizeof(names[0]) && names[status])
    return names[status];
  return "unknown";
}
