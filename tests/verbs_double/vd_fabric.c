/*
 * The fabric file (vd.h): one MAP_SHARED file per TW_VD_FABRIC path, joined once per process.
 *
 * Layout: header page, port table, QP table, then one region per port slot (ring control block,
 * data ring, ack ring). The file is sparse; a port's ring pages are punched out when it closes
 * (a data ring that some process pinned for CUDA copies excepted).
 * Cross-process exclusion for allocation (ports, QP numbers) is flock on this process's own
 * file descriptor plus a process mutex (flock does not exclude threads sharing one descriptor);
 * the kernel drops a dead process's flock, and a slot whose pid no longer exists is free, so a
 * crashed earlier run leaves nothing that blocks this one.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vd.h"

#define VD_MAGIC 0x7277667664777475ull /* "utwdvfwr" */
#define VD_LAYOUT_VERSION 5u
#define VD_PORTS_OFF 4096ul
#define VD_QTAB_OFF (VD_PORTS_OFF + VD_MAX_PORTS * sizeof(struct vd_fab_port))
#define VD_REGIONS_OFF (2ul << 20)
#define VD_CTRL_BYTES 4096ul
#define VD_REGION_BYTES (VD_CTRL_BYTES + VD_DATA_RING + VD_ACK_RING)
#define VD_FILE_BYTES (VD_REGIONS_OFF + VD_MAX_PORTS * VD_REGION_BYTES)
_Static_assert(VD_QTAB_OFF + VD_QTAB * sizeof(struct vd_fab_qp) <= VD_REGIONS_OFF, "layout");
_Static_assert(sizeof(struct vd_fab_port) == 64 && sizeof(struct vd_fab_qp) == 64, "entries");

static pthread_mutex_t g_fab_mutex = PTHREAD_MUTEX_INITIALIZER;
static char *g_base;
static int g_fd = -1;
static char g_path[4096];

struct vd_fab_hdr *vd_fab(void) {
  return (struct vd_fab_hdr *)g_base;
}

struct vd_fab_port *vd_fab_port(uint32_t slot) {
  return (struct vd_fab_port *)(g_base + VD_PORTS_OFF) + slot;
}

struct vd_fab_qp *vd_fab_qp(uint32_t qpn) {
  return (struct vd_fab_qp *)(g_base + VD_QTAB_OFF) + (qpn & (VD_QTAB - 1));
}

struct vd_ring *vd_port_ring(uint32_t slot, int ack, char **data) {
  char *region = g_base + VD_REGIONS_OFF + (size_t)slot * VD_REGION_BYTES;
  *data = region + VD_CTRL_BYTES + (ack ? VD_DATA_RING : 0);
  return (struct vd_ring *)region + (ack ? 1 : 0);
}

/* Exclusive over processes and threads; the fabric's allocation state only. */
static int fab_lock(void) {
  vd_lock(&g_fab_mutex);
  while (flock(g_fd, LOCK_EX) != 0) {
    if (errno != EINTR) {
      fprintf(stderr, "tw-verbs-double: flock(%s): %s\n", g_path, strerror(errno));
      vd_unlock(&g_fab_mutex);
      return -1;
    }
  }
  return 0;
}

static void fab_unlock(void) {
  if (flock(g_fd, LOCK_UN) != 0)
    fprintf(stderr, "tw-verbs-double: flock(%s, LOCK_UN): %s\n", g_path, strerror(errno));
  vd_unlock(&g_fab_mutex);
}

static void fab_init_header(void) {
  struct vd_fab_hdr *h = vd_fab();
  memset(h, 0, sizeof(*h));
  h->version = VD_LAYOUT_VERSION;
  h->max_ports = VD_MAX_PORTS;
  h->size = VD_FILE_BYTES;
  atomic_store(&h->next_lid, 1);
  atomic_store(&h->next_qpn, 0x100);
  atomic_store(&h->next_key, 0x1000);
  atomic_store(&h->next_guid, 1);
  atomic_store(&h->next_gen, 1);
  /* the magic last: a reader that sees it sees the rest */
  atomic_thread_fence(memory_order_seq_cst);
  h->magic = VD_MAGIC;
}

/* Opens (creating if needed) and maps the fabric file; the caller holds g_fab_mutex. */
static int fab_open_locked(void) {
  int err = 0, locked = 0;
  const char *env = getenv("TW_VD_FABRIC");
  if (env && *env)
    snprintf(g_path, sizeof(g_path), "%s", env);
  else
    snprintf(g_path, sizeof(g_path), "/tmp/tw-vd-fabric-%u", (unsigned)getuid());
  g_fd = open(g_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (g_fd < 0) {
    err = errno;
    fprintf(stderr, "tw-verbs-double: open(%s): %s\n", g_path, strerror(err));
    goto fail;
  }
  while (flock(g_fd, LOCK_EX) != 0) {
    if (errno != EINTR) {
      err = errno;
      fprintf(stderr, "tw-verbs-double: flock(%s): %s\n", g_path, strerror(err));
      goto fail;
    }
  }
  locked = 1;
  struct stat st;
  if (fstat(g_fd, &st) != 0) {
    err = errno;
    goto fail;
  }
  int fresh = (uint64_t)st.st_size != VD_FILE_BYTES;
  if (!fresh) {
    struct vd_fab_hdr h;
    if (pread(g_fd, &h, sizeof(h), 0) != (ssize_t)sizeof(h)) {
      err = errno ? errno : EIO;
      goto fail;
    }
    fresh = h.magic != VD_MAGIC || h.version != VD_LAYOUT_VERSION || h.size != VD_FILE_BYTES;
  }
  if (fresh && (ftruncate(g_fd, 0) != 0 || ftruncate(g_fd, (off_t)VD_FILE_BYTES) != 0)) {
    err = errno;
    fprintf(stderr, "tw-verbs-double: ftruncate(%s): %s\n", g_path, strerror(err));
    goto fail;
  }
  void *m = mmap(NULL, VD_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, g_fd, 0);
  if (m == MAP_FAILED) {
    err = errno;
    fprintf(stderr, "tw-verbs-double: mmap(%s): %s\n", g_path, strerror(err));
    goto fail;
  }
  g_base = m;
  if (fresh)
    fab_init_header();
  if (flock(g_fd, LOCK_UN) != 0)
    fprintf(stderr, "tw-verbs-double: flock(%s, LOCK_UN): %s\n", g_path, strerror(errno));
  return 0;
fail:
  if (g_fd >= 0) {
    if (locked && flock(g_fd, LOCK_UN) != 0)
      fprintf(stderr, "tw-verbs-double: flock(LOCK_UN): %s\n", strerror(errno));
    close(g_fd);
  }
  g_fd = -1;
  return err ? err : EIO;
}

int vd_fabric_join(void) {
  int err = 0;
  vd_lock(&g_fab_mutex);
  if (!g_base)
    err = fab_open_locked();
  vd_unlock(&g_fab_mutex);
  return err;
}

/* A forked child shares the parent's mapping (MAP_SHARED, still the same fabric) but needs its
 * own open file description, or its flock would be the parent's. */
void vd_fabric_after_fork(void) {
  pthread_mutex_init(&g_fab_mutex, NULL);
  if (g_fd < 0)
    return;
  int fd = open(g_path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    fprintf(stderr, "tw-verbs-double: reopen(%s) after fork: %s\n", g_path, strerror(errno));
    return;
  }
  close(g_fd);
  g_fd = fd;
}

static int pid_alive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

int vd_port_live(uint32_t slot, uint64_t gen) {
  if (slot >= VD_MAX_PORTS)
    return 0;
  struct vd_fab_port *p = vd_fab_port(slot);
  return atomic_load_explicit(&p->state, memory_order_acquire) == 1 &&
         atomic_load_explicit(&p->gen, memory_order_relaxed) == gen;
}

static int lid_in_use(uint32_t lid) {
  for (uint32_t i = 0; i < VD_MAX_PORTS; i++) {
    struct vd_fab_port *p = vd_fab_port(i);
    if (atomic_load(&p->state) == 1 && p->lid == lid)
      return 1;
  }
  return 0;
}

/* Discards a ring's old pages (best effort: a filesystem without hole punching keeps them). */
static void punch(char *addr, size_t len) {
  if (madvise(addr, len, MADV_REMOVE) != 0 && errno != EINVAL && errno != EOPNOTSUPP &&
      errno != ENOSYS)
    fprintf(stderr, "tw-verbs-double: madvise(MADV_REMOVE): %s\n", strerror(errno));
}

int vd_port_alloc(struct vd_ctx *c) {
  if (fab_lock() != 0)
    return EIO;
  int err = ENOSPC;
  struct vd_fab_hdr *h = vd_fab();
  for (uint32_t i = 0; i < VD_MAX_PORTS; i++) {
    struct vd_fab_port *p = vd_fab_port(i);
    if (atomic_load(&p->state) == 1 && pid_alive(p->pid))
      continue;
    atomic_store(&p->state, 0);
    uint64_t gen = atomic_fetch_add(&h->next_gen, 1);
    uint32_t lid = 0;
    for (int tries = 0; tries < 0xC000 && !lid; tries++) {
      uint32_t cand = atomic_fetch_add(&h->next_lid, 1) % 0xBFFF + 1; /* unicast 1..0xBFFF */
      if (!lid_in_use(cand))
        lid = cand;
    }
    if (!lid)
      break;
    uint64_t guid = 0x0002c90300000000ull | atomic_fetch_add(&h->next_guid, 1);
    c->slot = i;
    c->gen = gen;
    c->lid = (uint16_t)lid;
    c->guid = guid;
    memset(c->gid, 0, sizeof(c->gid));
    c->gid[0] = 0xfe;
    c->gid[1] = 0x80;
    for (int b = 0; b < 8; b++)
      c->gid[8 + b] = (uint8_t)(guid >> (56 - 8 * b));
    c->data_ring = vd_port_ring(i, 0, &c->data_base);
    c->ack_ring = vd_port_ring(i, 1, &c->ack_base);
    /* positions start at gen << 48: a stale record of an earlier incarnation never carries a
     * stamp this one expects */
    uint64_t base = gen << 48;
    c->data_ring->size = VD_DATA_RING;
    c->ack_ring->size = VD_ACK_RING;
    atomic_store(&c->data_ring->head, base);
    atomic_store(&c->data_ring->tail, base);
    atomic_store(&c->ack_ring->head, base);
    atomic_store(&c->ack_ring->tail, base);
    c->rx_scan = base;
    p->pid = (int32_t)getpid();
    p->lid = lid;
    p->kind = (uint32_t)c->kind;
    memcpy(p->gid, c->gid, 16);
    atomic_store(&p->gen, gen);
    atomic_store_explicit(&p->state, 1, memory_order_release);
    err = 0;
    break;
  }
  fab_unlock();
  if (err == ENOSPC)
    fprintf(stderr, "tw-verbs-double: no free port on the fabric (%d in use)\n", VD_MAX_PORTS);
  return err;
}

void vd_port_free(struct vd_ctx *c) {
  if (fab_lock() != 0)
    return;
  struct vd_fab_port *p = vd_fab_port(c->slot);
  if (atomic_load(&p->gen) == c->gen && p->pid == (int32_t)getpid()) {
    atomic_store(&p->state, 0);
    /* pinned pages must stay the file's pages: a punched page would be replaced by a fresh one
     * while a CUDA registration keeps using the old */
    if (!atomic_load(&p->pinned))
      punch(c->data_base, VD_DATA_RING);
    punch(c->ack_base, VD_ACK_RING);
  }
  fab_unlock();
}

void vd_port_mark_pinned(uint32_t slot) {
  if (fab_lock() != 0)
    return;
  atomic_store(&vd_fab_port(slot)->pinned, 1);
  fab_unlock();
}

static int gid_eq(const uint8_t *a, const uint8_t *b) { return memcmp(a, b, 16) == 0; }

int vd_port_find(const struct vd_addr *a, uint32_t *slot, uint64_t *gen) {
  for (uint32_t i = 0; i < VD_MAX_PORTS; i++) {
    struct vd_fab_port *p = vd_fab_port(i);
    if (atomic_load_explicit(&p->state, memory_order_acquire) != 1)
      continue;
    if (a->is_global ? gid_eq(p->gid, a->gid) : p->lid == a->lid) {
      *slot = i;
      *gen = atomic_load(&p->gen);
      return 0;
    }
  }
  return -1;
}

uint32_t vd_qpn_alloc(struct vd_ctx *c, uint32_t local_idx, int type) {
  if (fab_lock() != 0)
    return 0;
  uint32_t got = 0;
  struct vd_fab_hdr *h = vd_fab();
  for (uint32_t tries = 0; tries < VD_QTAB && !got; tries++) {
    uint32_t qpn = atomic_fetch_add(&h->next_qpn, 1) & 0xFFFFFF;
    if (qpn < 0x100)
      continue;
    struct vd_fab_qp *e = vd_fab_qp(qpn);
    uint32_t old = atomic_load(&e->qpn);
    if (old && vd_port_live(e->port, atomic_load(&e->port_gen)))
      continue;
    e->port = c->slot;
    atomic_store(&e->port_gen, c->gen);
    atomic_store(&e->credits, 0);
    e->local_idx = local_idx;
    e->type = (uint32_t)type;
    atomic_store(&e->state, IBV_QPS_RESET);
    atomic_store_explicit(&e->qpn, qpn, memory_order_release);
    got = qpn;
  }
  fab_unlock();
  return got;
}

void vd_qpn_free(uint32_t qpn) {
  struct vd_fab_qp *e = vd_fab_qp(qpn);
  uint32_t want = qpn;
  atomic_compare_exchange_strong(&e->qpn, &want, 0);
}

uint32_t vd_key_alloc(void) {
  uint32_t k;
  do
    k = atomic_fetch_add(&vd_fab()->next_key, 0x101);
  while (k == 0);
  return k;
}

/* ---- rings */

struct vd_pkt *vd_ring_reserve(struct vd_ring *r, char *data, uint32_t len, uint64_t *pos) {
  const uint64_t size = r->size;
  uint64_t t = atomic_load_explicit(&r->tail, memory_order_relaxed);
  uint64_t pad;
  for (;;) {
    const uint64_t off = t % size;
    pad = off + len > size ? size - off : 0;
    const uint64_t h = atomic_load_explicit(&r->head, memory_order_acquire);
    if (t + pad + len - h > size)
      return NULL;
    if (atomic_compare_exchange_weak_explicit(&r->tail, &t, t + pad + len, memory_order_acq_rel,
                                              memory_order_relaxed))
      break;
  }
  if (pad) {
    struct vd_pkt *p = (struct vd_pkt *)(data + t % size);
    p->kind = VD_REC_PAD;
    p->rec_len = (uint32_t)pad;
    vd_ring_publish(p, t);
    t += pad;
  }
  *pos = t;
  return (struct vd_pkt *)(data + t % size);
}

void vd_ring_publish(struct vd_pkt *p, uint64_t pos) {
  /* a full fence, not just release: the payload copy may have used non-temporal stores */
  atomic_thread_fence(memory_order_seq_cst);
  atomic_store_explicit(&p->stamp, pos + 1, memory_order_release);
}

struct vd_pkt *vd_ring_peek(struct vd_ring *r, char *data, uint64_t pos) {
  struct vd_pkt *p = (struct vd_pkt *)(data + pos % r->size);
  if (atomic_load_explicit(&p->stamp, memory_order_acquire) != pos + 1)
    return NULL;
  return p;
}
