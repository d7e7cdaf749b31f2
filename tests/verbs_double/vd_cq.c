/*
 * Completion queues: a bounded ring per CQ, filled by the engine thread of its context (and by
 * flushes under ctx->lock), drained by poll_cq in completion order. A full CQ is an overrun:
 * the completion is lost, the CQ is marked, and the engine puts the QPs that use it in the error
 * state, as hardware does.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vd.h"

struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector) {
  (void)channel;
  (void)comp_vector;
  if (!context || cqe < 1 || cqe > VD_MAX_CQE) {
    errno = EINVAL;
    return NULL;
  }
  struct vd_cq *cq = calloc(1, sizeof(*cq));
  if (!cq) {
    errno = ENOMEM;
    return NULL;
  }
  cq->cap = (uint32_t)cqe;
  cq->ring = calloc(cq->cap, sizeof(*cq->ring));
  if (!cq->ring) {
    free(cq);
    errno = ENOMEM;
    return NULL;
  }
  pthread_mutex_init(&cq->lock, NULL);
  cq->cq.context = context;
  cq->cq.cq_context = cq_context;
  cq->cq.handle = vd_key_alloc();
  cq->cq.cqe = cqe;
  pthread_mutex_init(&cq->cq.mutex, NULL);
  pthread_cond_init(&cq->cq.cond, NULL);
  return &cq->cq;
}

int ibv_destroy_cq(struct ibv_cq *ibcq) {
  if (!ibcq)
    return EINVAL;
  struct vd_cq *cq = (struct vd_cq *)ibcq;
  struct vd_ctx *c = (struct vd_ctx *)ibcq->context;
  vd_lock(&c->lock);
  const int busy = cq->users > 0;
  vd_unlock(&c->lock);
  if (busy)
    return EBUSY;
  pthread_mutex_destroy(&cq->lock);
  free(cq->ring);
  free(cq);
  return 0;
}

int vd_cq_push(struct vd_cq *cq, const struct ibv_wc *wc) {
  int rc = 0, first = 0;
  vd_lock(&cq->lock);
  if (cq->tail - cq->head >= cq->cap) {
    first = !cq->overflowed;
    cq->overflowed = 1;
    rc = -1;
  } else {
    cq->ring[cq->tail % cq->cap] = *wc;
    cq->tail++;
  }
  vd_unlock(&cq->lock);
  if (rc) {
    VD_STAT_ADD(cq_overflows, 1);
    if (first)
      fprintf(stderr,
              "tw-verbs-double: CQ %p overrun (%u entries): completions lost, its QPs "
              "go to the error state\n",
              (void *)cq, cq->cap);
  }
  return rc;
}

int vd_poll_cq(struct ibv_cq *ibcq, int n, struct ibv_wc *wc) {
  struct vd_cq *cq = (struct vd_cq *)ibcq;
  if (n < 0 || (n > 0 && !wc))
    return -EINVAL;
  int got = 0;
  vd_lock(&cq->lock);
  while (got < n && cq->head != cq->tail) {
    wc[got++] = cq->ring[cq->head % cq->cap];
    cq->head++;
  }
  vd_unlock(&cq->lock);
  return got;
}

void vd_emit(struct vd_cq *cq, const struct ibv_wc *wc) {
  if (vd_cq_push(cq, wc) != 0)
    ((struct vd_ctx *)cq->cq.context)->overrun = 1;
}

int vd_cq_overflowed(struct vd_cq *cq) {
  vd_lock(&cq->lock);
  const int o = cq->overflowed;
  vd_unlock(&cq->lock);
  return o;
}
