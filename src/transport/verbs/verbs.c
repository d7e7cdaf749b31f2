/* rdma-core at run time (verbs.h). */
#ifdef TW_HAVE_VERBS_H
#include "transport/verbs/verbs.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/env.h"
#include "core/status.h"

static pthread_once_t verbs_once = PTHREAD_ONCE_INIT;
static tw_verbs_t verbs;
static tw_status_t verbs_status = TW_ERR_NOT_SUPPORTED;
static char verbs_why[512];

/* rdma-core's version from the file the library resolved to: libibverbs.so.1.14.44.0 names
 * provider ABI 1.14 of rdma-core 44.0. */
static void read_version(void *lib) {
  struct link_map *map = NULL;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &map) != 0 || !map || !map->l_name)
    return;
  char *real = realpath(map->l_name, NULL);
  const char *name = real ? real : map->l_name;
  snprintf(verbs.path, sizeof(verbs.path), "%s", name);
  const char *so = strstr(name, ".so.");
  int a, b, c, d;
  if (so && sscanf(so, ".so.%d.%d.%d.%d", &a, &b, &c, &d) == 4)
    snprintf(verbs.version, sizeof(verbs.version), "%d.%d", c, d);
  free(real);
}

#define RESOLVE(lib, field, name, required)                                                        \
  do {                                                                                             \
    *(void **)&verbs.field = dlsym(lib, name);                                                     \
    if ((required) && !verbs.field) {                                                              \
      snprintf(verbs_why, sizeof(verbs_why), "%s has no %s (rdma-core too old?)", verbs.path,      \
               name);                                                                              \
      return;                                                                                      \
    }                                                                                              \
  } while (0)

static void load(void) {
  const char *path = tw_env_str(TW_IBVERBS_LIB_ID);
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(verbs_why, sizeof(verbs_why),
             "cannot load %s (%s): install rdma-core (libibverbs1) or point TW_IBVERBS_LIB at "
             "libibverbs",
             path, dlerror());
    return;
  }
  snprintf(verbs.path, sizeof(verbs.path), "%s", path);
  read_version(lib);
  RESOLVE(lib, get_device_list, "ibv_get_device_list", 1);
  RESOLVE(lib, free_device_list, "ibv_free_device_list", 1);
  RESOLVE(lib, get_device_name, "ibv_get_device_name", 1);
  RESOLVE(lib, open_device, "ibv_open_device", 1);
  RESOLVE(lib, close_device, "ibv_close_device", 1);
  RESOLVE(lib, query_device, "ibv_query_device", 1);
  RESOLVE(lib, query_port, "ibv_query_port", 1);
  RESOLVE(lib, query_gid, "ibv_query_gid", 1);
  RESOLVE(lib, alloc_pd, "ibv_alloc_pd", 1);
  RESOLVE(lib, dealloc_pd, "ibv_dealloc_pd", 1);
  RESOLVE(lib, reg_mr, "ibv_reg_mr", 1);
  RESOLVE(lib, reg_mr_iova, "ibv_reg_mr_iova", 0);
  RESOLVE(lib, reg_dmabuf_mr, "ibv_reg_dmabuf_mr", 0);
  RESOLVE(lib, dereg_mr, "ibv_dereg_mr", 1);
  RESOLVE(lib, create_cq, "ibv_create_cq", 1);
  RESOLVE(lib, destroy_cq, "ibv_destroy_cq", 1);
  RESOLVE(lib, create_qp, "ibv_create_qp", 1);
  RESOLVE(lib, modify_qp, "ibv_modify_qp", 1);
  RESOLVE(lib, destroy_qp, "ibv_destroy_qp", 1);
  RESOLVE(lib, create_ah, "ibv_create_ah", 1);
  RESOLVE(lib, destroy_ah, "ibv_destroy_ah", 1);
  RESOLVE(lib, qp_to_qp_ex, "ibv_qp_to_qp_ex", 0);
  RESOLVE(lib, wc_status_str, "ibv_wc_status_str", 1);
  /* libefa is optional: without it no device is taken for EFA. A libibverbs that carries efadv
   * itself (the tests' double) is used for both: a system libefa would reach into contexts of
   * another library's making. */
  const char *efa_path = tw_env_str(TW_EFADV_LIB_ID);
  void *efa = strcmp(efa_path, path) == 0 || dlsym(lib, "efadv_query_device")
                  ? lib
                  : dlopen(efa_path, RTLD_NOW | RTLD_LOCAL);
  if (efa) {
    RESOLVE(efa, efadv_query_device, "efadv_query_device", 0);
    RESOLVE(efa, efadv_create_qp_ex, "efadv_create_qp_ex", 0);
  }
  verbs_status = TW_SUCCESS;
}

tw_status_t tw_verbs_load(const tw_verbs_t **out) {
  pthread_once(&verbs_once, load);
  if (verbs_status != TW_SUCCESS)
    return tw_fail(verbs_status, "%s", verbs_why);
  *out = &verbs;
  return TW_SUCCESS;
}
#endif
