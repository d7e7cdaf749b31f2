/*
 * The verbs double with CUDA device memory (skipped, 77, without a GPU): RC writes between
 * device, pageable host and pinned host memory, a dmabuf-registered device buffer, a write with
 * immediate into device memory, and "data write, then flag write" into device memory watched by
 * a kernel that runs on the legacy default stream the whole time (the double's copies use
 * non-blocking streams; a legacy-stream copy would wait on that kernel forever), through ports
 * whose inboxes are first pinned while the kernel runs. Prints the device-memory rates of one RC
 * stream.
 *
 *   test_verbs_double_gpu <path of the double's .so>
 */
#include <cuda_runtime.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "vdt.h"

static const int kAcc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

static int write_wait(struct vdt_rc_pair *p, struct ibv_mr *lmr, const void *src, uint32_t len,
                      uint64_t raddr, uint32_t rkey) {
  if (vdt_write(p->qa, 1, lmr, (void *)src, len, raddr, rkey, 0, 0) != 0)
    return -1;
  struct ibv_wc wc;
  if (vdt_poll(p->a.cq, &wc, 1, 10000) != 1)
    return -2;
  return wc.status;
}

/* Device to device, host to device, device to host, pinned host; checked byte for byte. */
static void check_copies(struct vdt_rc_pair *p) {
  const size_t cap = 4u << 20;
  uint8_t *h = (uint8_t *)malloc(cap), *back = (uint8_t *)malloc(cap), *pinned = NULL;
  void *dsrc = NULL, *ddst = NULL;
  TEST_REQUIRE(h && back, "malloc");
  TEST_CUDA_OK(cudaMalloc(&dsrc, cap));
  TEST_CUDA_OK(cudaMalloc(&ddst, cap));
  TEST_CUDA_OK(cudaHostAlloc((void **)&pinned, cap, cudaHostAllocDefault));
  for (size_t i = 0; i < cap; i++)
    h[i] = (uint8_t)(i * 31 + 7);
  TEST_CUDA_OK(cudaMemcpy(dsrc, h, cap, cudaMemcpyHostToDevice));
  struct ibv_mr *ms = V.reg_mr(p->a.pd, dsrc, cap, kAcc), *md = V.reg_mr(p->b.pd, ddst, cap, kAcc);
  struct ibv_mr *mh = V.reg_mr(p->a.pd, h, cap, kAcc), *mhb = V.reg_mr(p->b.pd, back, cap, kAcc);
  struct ibv_mr *mp = V.reg_mr(p->b.pd, pinned, cap, kAcc);
  TEST_REQUIRE(ms && md && mh && mhb && mp, "reg_mr");
  static const uint32_t sizes[] = {1, 4096, 262145, (3u << 20) + 777};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    const uint32_t n = sizes[i];
    TEST_CUDA_OK(cudaMemset(ddst, 0, cap));
    int st = write_wait(p, ms, (char *)dsrc + 3, n, (uintptr_t)ddst + 5, md->rkey);
    TEST_ASSERT(st == IBV_WC_SUCCESS, "D->D %u: %d", n, st);
    TEST_CUDA_OK(cudaMemcpy(back, ddst, cap, cudaMemcpyDeviceToHost));
    TEST_ASSERT(memcmp(back + 5, h + 3, n) == 0 && back[4] == 0 && back[5 + n] == 0, "D->D %u data",
                n);
    TEST_CUDA_OK(cudaMemset(ddst, 0, cap));
    st = write_wait(p, mh, h + 1, n, (uintptr_t)ddst, md->rkey);
    TEST_CUDA_OK(cudaMemcpy(back, ddst, cap, cudaMemcpyDeviceToHost));
    TEST_ASSERT(st == IBV_WC_SUCCESS && memcmp(back, h + 1, n) == 0, "H->D %u", n);
    memset(back, 0, cap);
    st = write_wait(p, ms, dsrc, n, (uintptr_t)back, mhb->rkey);
    TEST_ASSERT(st == IBV_WC_SUCCESS && memcmp(back, h, n) == 0, "D->H %u", n);
    memset(pinned, 0, cap);
    st = write_wait(p, ms, dsrc, n, (uintptr_t)pinned, mp->rkey);
    TEST_ASSERT(st == IBV_WC_SUCCESS && memcmp(pinned, h, n) == 0, "D->pinned host %u", n);
  }
  /* a dmabuf MR over device memory: its iova is the device address */
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  TEST_REQUIRE(fd >= 0, "open");
  struct ibv_mr *mb = V.reg_dmabuf_mr(p->b.pd, 0, cap, (uintptr_t)ddst, fd, kAcc);
  TEST_REQUIRE(mb, "reg_dmabuf_mr");
  TEST_CUDA_OK(cudaMemset(ddst, 0, cap));
  int st = write_wait(p, ms, dsrc, 1u << 20, (uintptr_t)ddst + 64, mb->rkey);
  TEST_CUDA_OK(cudaMemcpy(back, ddst, cap, cudaMemcpyDeviceToHost));
  TEST_ASSERT(st == IBV_WC_SUCCESS && memcmp(back + 64, h, 1u << 20) == 0, "dmabuf D->D");
  close(fd);
  /* a write with immediate into device memory: the data is there at the receive completion */
  TEST_CUDA_OK(cudaMemset(ddst, 0, cap));
  TEST_ASSERT(vdt_post_recvs(p->qb, 1, 5) == 0, "post recv");
  TEST_ASSERT(vdt_write(p->qa, 2, ms, dsrc, 2u << 20, (uintptr_t)ddst, md->rkey, 1, htonl(42)) == 0,
              "post imm");
  struct ibv_wc wc;
  TEST_ASSERT(vdt_poll(p->b.cq, &wc, 1, 10000) == 1 && wc.status == IBV_WC_SUCCESS &&
                  wc.imm_data == htonl(42) && wc.byte_len == (2u << 20),
              "recv completion");
  TEST_CUDA_OK(cudaMemcpy(back, ddst, 2u << 20, cudaMemcpyDeviceToHost));
  TEST_ASSERT(memcmp(back, h, 2u << 20) == 0, "imm data in device memory");
  TEST_ASSERT(vdt_poll(p->a.cq, &wc, 1, 10000) == 1 && wc.status == IBV_WC_SUCCESS,
              "send completion");
  V.dereg_mr(ms);
  V.dereg_mr(md);
  V.dereg_mr(mh);
  V.dereg_mr(mhb);
  V.dereg_mr(mp);
  V.dereg_mr(mb);
  cudaFree(dsrc);
  cudaFree(ddst);
  cudaFreeHost(pinned);
  free(h);
  free(back);
}

/* Waits for each round's flag, then checks that round's data (all of it) is there. */
__global__ void watch(const volatile unsigned long long *flag,
                      const volatile unsigned long long *data, size_t words, int rounds,
                      unsigned long long *bad, volatile unsigned long long *progress) {
  for (int r = 1; r <= rounds; r++) {
    if (threadIdx.x == 0)
      while (*flag < (unsigned long long)r) {
      }
    __syncthreads();
    for (size_t i = threadIdx.x; i < words; i += blockDim.x)
      if (data[i] != (unsigned long long)r)
        atomicAdd(bad, 1ull);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      *progress = (unsigned long long)r;
    }
  }
}

static void check_flag_order(struct vdt_rc_pair *p) {
  enum { ROUNDS = 40 };
  const size_t bytes = 1u << 20, words = bytes / 8;
  unsigned long long *ddata = NULL, *dflag = NULL, *dbad = NULL, *dsrc = NULL;
  TEST_CUDA_OK(cudaMalloc(&ddata, bytes + 64));
  dflag = ddata + words;
  TEST_CUDA_OK(cudaMalloc(&dbad, 8));
  TEST_CUDA_OK(cudaMalloc(&dsrc, (size_t)ROUNDS * bytes));
  TEST_CUDA_OK(cudaMemset(ddata, 0, bytes + 64));
  TEST_CUDA_OK(cudaMemset(dbad, 0, 8));
  unsigned long long *hsrc = (unsigned long long *)malloc((size_t)ROUNDS * bytes), *flags;
  TEST_REQUIRE(hsrc, "malloc");
  for (size_t r = 0; r < ROUNDS; r++)
    for (size_t i = 0; i < words; i++)
      hsrc[r * words + i] = r + 1;
  TEST_CUDA_OK(cudaMemcpy(dsrc, hsrc, (size_t)ROUNDS * bytes, cudaMemcpyHostToDevice));
  volatile unsigned long long *progress = NULL;
  TEST_CUDA_OK(cudaHostAlloc((void **)&progress, 64, cudaHostAllocMapped));
  *progress = 0;
  unsigned long long *dprogress = NULL;
  TEST_CUDA_OK(cudaHostGetDevicePointer((void **)&dprogress, (void *)progress, 0));
  flags = (unsigned long long *)calloc(ROUNDS + 1, 8);
  struct ibv_mr *mh = V.reg_mr(p->a.pd, hsrc, (size_t)ROUNDS * bytes, kAcc);
  struct ibv_mr *mds = V.reg_mr(p->a.pd, dsrc, (size_t)ROUNDS * bytes, kAcc);
  struct ibv_mr *mf = V.reg_mr(p->a.pd, flags, (ROUNDS + 1) * 8, kAcc);
  struct ibv_mr *md = V.reg_mr(p->b.pd, ddata, bytes + 64, kAcc);
  TEST_REQUIRE(mh && mds && mf && md, "reg_mr");
  watch<<<1, 256>>>(dflag, ddata, words, ROUNDS, dbad, (unsigned long long *)dprogress);
  TEST_CUDA_OK(cudaGetLastError());
  int ok = 1;
  for (int r = 1; r <= ROUNDS && ok; r++) {
    const double end = tw_test_now() + 10;
    while (*progress != (unsigned long long)(r - 1) && tw_test_now() < end) {
    }
    if (*progress != (unsigned long long)(r - 1)) {
      TEST_ASSERT(0, "kernel stuck before round %d (progress %llu)", r, *progress);
      ok = 0;
      break;
    }
    flags[r] = (unsigned long long)r;
    /* even rounds from pageable host memory, odd ones from device memory */
    struct ibv_mr *src_mr = r % 2 ? mds : mh;
    char *src = r % 2 ? (char *)dsrc : (char *)hsrc;
    ok &= vdt_write(p->qa, 1, src_mr, src + (size_t)(r - 1) * bytes, bytes, (uintptr_t)ddata,
                    md->rkey, 0, 0) == 0;
    ok &= vdt_write(p->qa, 2, mf, &flags[r], 8, (uintptr_t)dflag, md->rkey, 0, 0) == 0;
    struct ibv_wc wc[2];
    ok &= vdt_poll(p->a.cq, wc, 2, 10000) == 2 && wc[0].status == IBV_WC_SUCCESS &&
          wc[1].status == IBV_WC_SUCCESS;
    TEST_ASSERT(ok, "round %d: writes while the kernel runs", r);
  }
  const double end = tw_test_now() + 10;
  while (cudaStreamQuery(0) == cudaErrorNotReady && tw_test_now() < end)
    vdt_sleep_us(1000);
  TEST_REQUIRE(cudaStreamQuery(0) == cudaSuccess, "the watching kernel did not finish");
  unsigned long long bad = 0;
  TEST_CUDA_OK(cudaMemcpy(&bad, dbad, 8, cudaMemcpyDeviceToHost));
  TEST_ASSERT(ok && bad == 0, "%llu words of a round's data missing when its flag was seen", bad);
  V.dereg_mr(mh);
  V.dereg_mr(mds);
  V.dereg_mr(mf);
  V.dereg_mr(md);
  cudaFree(ddata);
  cudaFree(dbad);
  cudaFree(dsrc);
  cudaFreeHost((void *)progress);
  free(hsrc);
  free(flags);
}

static double rate(struct vdt_rc_pair *p, struct ibv_mr *ms, char *src, struct ibv_mr *md,
                   char *dst, uint32_t total) {
  const uint32_t chunk = 1u << 20;
  double best = 0;
  for (int round = 0; round < 3; round++) {
    const double t0 = tw_test_now();
    uint32_t posted = 0, done = 0;
    int ok = 1;
    while (done < total / chunk && ok) {
      while (posted < total / chunk && posted - done < 16) {
        ok &= vdt_write(p->qa, posted, ms, src + (size_t)posted * chunk, chunk,
                        (uintptr_t)(dst + (size_t)posted * chunk), md->rkey, 0, 0) == 0;
        posted++;
      }
      struct ibv_wc wc;
      const int k = vdt_poll(p->a.cq, &wc, 1, 10000);
      ok &= k == 1 && wc.status == IBV_WC_SUCCESS;
      done += (uint32_t)k;
    }
    TEST_ASSERT(ok, "rate round %d", round);
    const double gbs = total / (tw_test_now() - t0) / 1e9;
    best = gbs > best ? gbs : best;
  }
  return best;
}

static void report_rates(struct vdt_rc_pair *p) {
  const uint32_t total = 64u << 20;
  char *d1 = NULL, *d2 = NULL, *h = (char *)malloc(total);
  TEST_REQUIRE(h, "malloc");
  memset(h, 1, total);
  TEST_CUDA_OK(cudaMalloc((void **)&d1, total));
  TEST_CUDA_OK(cudaMalloc((void **)&d2, total));
  struct ibv_mr *m1 = V.reg_mr(p->a.pd, d1, total, kAcc), *m2 = V.reg_mr(p->b.pd, d2, total, kAcc);
  struct ibv_mr *mh = V.reg_mr(p->a.pd, h, total, kAcc);
  TEST_REQUIRE(m1 && m2 && mh, "reg_mr");
  printf("  device memory, one RC stream, 64 MiB in 1 MiB writes: D->D %.2f GB/s, H->D %.2f GB/s\n",
         rate(p, m1, d1, m2, d2, total), rate(p, mh, h, m2, d2, total));
  V.dereg_mr(m1);
  V.dereg_mr(m2);
  V.dereg_mr(mh);
  cudaFree(d1);
  cudaFree(d2);
  free(h);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s <libtw_verbs_double.so>\n", argv[0]);
    return 1;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("no GPU: skipped\n");
    return 77;
  }
  TEST_CUDA_OK(cudaSetDevice(0));
  char fabric[256];
  snprintf(fabric, sizeof(fabric), "%s/tw-vd-gpu-test-%d",
           access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (int)getpid());
  TEST_REQUIRE(setenv("TW_VD_FABRIC", fabric, 1) == 0, "setenv");
  unsetenv("TW_VD_LINK");
  unsetenv("TW_VD_FAIL");
  if (vdt_load(argv[1]) != 0)
    return 1;
  struct vdt_rc_pair p, q;
  vdt_rc_pair_open(&p, 64, 1);
  check_copies(&p);
  /* a second pair, on ports no device copy went through yet: their first copies (and the
   * pinning of their inboxes) happen while the watching kernel runs */
  vdt_rc_pair_open(&q, 64, 0);
  check_flag_order(&q);
  vdt_rc_pair_close(&q);
  report_rates(&p);
  vdt_rc_pair_close(&p);
  unlink(fabric);
  return tw_test_finish();
}
