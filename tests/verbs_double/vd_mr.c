/*
 * Memory regions. An MR records (iova, local address, length, access, key) in its context's
 * hash; lkey == rkey, unique on the fabric and never 0. Addresses in WRs are iova-based, local
 * SGEs as well as remote addresses (the local address is base + (addr - iova)); ibv_reg_mr has
 * iova == addr, and a dmabuf MR's iova is the buffer's virtual address, used as its local
 * address (the fd is only checked). Each MR is classified once as host or CUDA device memory.
 * TW_VD_NO_GPU_MR=1 makes the NIC one that cannot register device memory (no dma-buf, no peer
 * memory): such a registration fails with EFAULT, as the real one does.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "vd.h"

static struct ibv_mr *mr_create(struct ibv_pd *pd, char *base, size_t length, uint64_t iova,
                                int access) {
  const int known = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                    IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_OPTIONAL_RANGE;
  if (!pd || !length || (uint64_t)length > VD_MAX_MSG << 10 || (access & ~known) ||
      /* as the real one: remote write needs local write */
      ((access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE)) ||
      iova + length < iova) {
    errno = EINVAL;
    return NULL;
  }
  struct vd_ctx *c = (struct vd_ctx *)pd->context;
  const int dev = vd_cuda_classify(base);
  const char *no_gpu = getenv("TW_VD_NO_GPU_MR");
  if (dev >= 0 && no_gpu && atoi(no_gpu) == 1) {
    errno = EFAULT;
    return NULL;
  }
  struct vd_mr *m = calloc(1, sizeof(*m));
  if (!m) {
    errno = ENOMEM;
    return NULL;
  }
  m->iova = iova;
  m->base = base;
  m->length = length;
  m->access = access;
  m->dev = dev;
  m->mr.context = pd->context;
  m->mr.pd = pd;
  m->mr.addr = base;
  m->mr.length = length;
  const uint32_t key = vd_key_alloc();
  m->mr.handle = key;
  m->mr.lkey = key;
  m->mr.rkey = key;
  vd_lock(&c->mr_lock);
  struct vd_mr **head = &c->mr_hash[key & c->mr_mask];
  m->next = *head;
  *head = m;
  vd_unlock(&c->mr_lock);
  return &m->mr;
}

#undef ibv_reg_mr
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access) {
  return mr_create(pd, addr, length, (uint64_t)(uintptr_t)addr, access);
}

#undef ibv_reg_mr_iova
struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                               int access) {
  return mr_create(pd, addr, length, iova, access);
}

struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                                unsigned int access) {
  return mr_create(pd, addr, length, iova, (int)access);
}

struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova,
                                 int fd, int access) {
  (void)offset;
  if (fd < 0) {
    errno = EINVAL;
    return NULL;
  }
  return mr_create(pd, (char *)(uintptr_t)iova, length, iova, access);
}

int ibv_dereg_mr(struct ibv_mr *mr) {
  if (!mr)
    return EINVAL;
  struct vd_mr *m = (struct vd_mr *)mr;
  struct vd_ctx *c = (struct vd_ctx *)mr->context;
  int found = 0;
  vd_lock(&c->mr_lock);
  for (struct vd_mr **p = &c->mr_hash[mr->lkey & c->mr_mask]; *p; p = &(*p)->next)
    if (*p == m) {
      *p = m->next;
      found = 1;
      break;
    }
  vd_unlock(&c->mr_lock);
  if (!found)
    return EINVAL;
  free(m);
  return 0;
}

int vd_mr_find(struct vd_ctx *c, uint32_t key, struct vd_mr_view *out) {
  int rc = -1;
  vd_lock(&c->mr_lock);
  for (struct vd_mr *m = c->mr_hash[key & c->mr_mask]; m; m = m->next)
    if (m->mr.lkey == key) {
      out->pd = m->mr.pd;
      out->iova = m->iova;
      out->base = m->base;
      out->length = m->length;
      out->access = m->access;
      out->dev = m->dev;
      rc = 0;
      break;
    }
  vd_unlock(&c->mr_lock);
  return rc;
}

char *vd_mr_translate(const struct vd_mr_view *m, uint64_t addr, uint64_t len) {
  if (addr < m->iova || len > m->length || addr - m->iova > m->length - len)
    return NULL;
  return m->base + (addr - m->iova);
}
