/* The NVLink transport (transport.h): ranks of one host share cuMem allocations by POSIX file
 * descriptor; every GPU of this process may access every rank's memory it maps. */
#include "transport/transport.h"

#include <stdlib.h>
#include <unistd.h>

#include "core/status.h"
#include "runtime/bootstrap.h"
#include "runtime/driver.h"

/* Exports this rank's handle to the processes of the ranks of this host and imports theirs
 * (nothing to do when every rank lives in this process). */
static tw_status_t nvlink_import(tw_group_t *g, int rank, tw_alloc_t *a) {
  const tw_driver_api_t *cu;
  tw_status_t st;
  int *fds = NULL;
  int my_fd = -1;
  if (!g->bs)
    return TW_SUCCESS;
  TW_CHECK(tw_driver(&cu));
  fds = malloc(sizeof(int) * (size_t)g->world);
  uint8_t to[TW_MAX_WORLD] = {0};
  if (!fds)
    TW_FAIL(TW_ERR_SYSTEM, "out of host memory");
  for (int r = 0; r < g->world; r++) {
    fds[r] = -1;
    to[r] = g->mappable[r] && r != rank;
  }
  TW_CHECK(tw_cu_check(cu->cuMemExportToShareableHandle(
                           &my_fd, a->handle[rank], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                       "cuMemExportToShareableHandle"));
  TW_CHECK(tw_bootstrap_exchange_fds(g->bs, my_fd, to, to, a->seq, fds));
  for (int r = 0; r < g->world; r++) {
    if (fds[r] < 0)
      continue;
    st = tw_cu_check(cu->cuMemImportFromShareableHandle(&a->handle[r], (void *)(uintptr_t)fds[r],
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                     "cuMemImportFromShareableHandle");
    close(fds[r]);
    fds[r] = -1;
    if (st != TW_SUCCESS) {
      tw_error_prefix("importing rank %d's allocation #%llu", r, (unsigned long long)a->seq);
      goto fail;
    }
  }
  st = TW_SUCCESS;
fail:
  if (my_fd >= 0)
    close(my_fd);
  if (fds) {
    for (int r = 0; r < g->world; r++)
      if (fds[r] >= 0)
        close(fds[r]);
    free(fds);
  }
  return st;
}

/* Maps every handle held at its rank's slot; grants every local device access. */
static tw_status_t nvlink_map(tw_group_t *g, tw_alloc_t *a) {
  const tw_driver_api_t *cu;
  tw_status_t st;
  TW_CHECK(tw_driver(&cu));
  CUmemAccessDesc access[TW_MAX_WORLD];
  int naccess = 0;
  for (int r = 0; r < g->world; r++) {
    if (!g->local[r])
      continue;
    int dup = 0;
    for (int i = 0; i < naccess; i++)
      dup |= access[i].location.id == g->device_of[r];
    if (dup)
      continue;
    access[naccess].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[naccess].location.id = g->device_of[r];
    access[naccess].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    naccess++;
  }
  for (int r = 0; r < g->world; r++) {
    if (!a->handle[r])
      continue;
    CUdeviceptr va = (CUdeviceptr)(uintptr_t)tw_group_slot(g, r, a->offset);
    TW_CHECK(tw_cu_check(cu->cuMemMap(va, a->size, 0, a->handle[r], 0), "cuMemMap"));
    a->mapped[r] = 1;
    st = tw_cu_check(cu->cuMemSetAccess(va, a->size, access, (size_t)naccess), "cuMemSetAccess");
    if (st != TW_SUCCESS) {
      tw_error_prefix("granting this process's GPUs access to rank %d's memory (no peer access "
                      "between the GPUs?)",
                      r);
      goto fail;
    }
  }
  return TW_SUCCESS;
fail:
  return st;
}

static void nvlink_unmap(tw_group_t *g, tw_alloc_t *a) {
  const tw_driver_api_t *cu;
  if (tw_driver(&cu) != TW_SUCCESS)
    return;
  for (int r = 0; r < g->world; r++) {
    if (a->mapped[r])
      cu->cuMemUnmap((CUdeviceptr)(uintptr_t)tw_group_slot(g, r, a->offset), a->size);
    a->mapped[r] = 0;
  }
}

const tw_transport_t tw_transport_nvlink = {"nvlink", nvlink_import, nvlink_map, nvlink_unmap};
