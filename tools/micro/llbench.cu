/* tw-llbench: what one layout of the low-latency words costs over NVLink, against another and
 * against plain stores with a flag a CTA.
 *
 * Two kernels ping-pong a payload between GPU 0 and GPU 1 (both on GPU 0, two streams, where
 * there is one GPU): each CTA of the starter stores its items into the other GPU's buffer, the
 * other's same CTA waits for every one of them, checks the data, and sends its own back; R
 * rounds in one launch, the starter's block 0 stamps the time. One item is 16 data bytes.
 * Layouts:
 *   ll32   the area's layout up to the thirty-first session: item i's two words {d0, f, d1, f}
 *          at i * 32 and i * 32 + 16 (one store instruction of a warp writes every other 16
 *          bytes of its lines);
 *   line   the library's layout since (tw_ll_item_off, signal.cuh): 8 items' first words in one
 *          128-byte line, their second words in the next;
 *   simple the 16 data bytes at i * 16 with plain stores, then a CTA barrier, one release of a
 *          flag a CTA at system scope, and the reader's acquire of it (NCCL's "simple" idea).
 * Thread t of a CTA takes consecutive items (jump 0), or (jump 1) runs of 8 lanes a row: a CTA
 * takes 8 columns of every row of 8 x ctas items, as the swap-AB epilogue's 8 threads of a
 * 128-byte box row do (a tile of 64 bf16 columns at m 64 n 8192 with 128 CTAs). Prints us a round
 * trip (two one-way transfers) and GB/s of payload one way, and counts wrong data and waits given
 * up (exit 1 if any). Not a test: run it by hand (`tw-llbench [ctas] [items_per_thread] [rounds]
 * [jump]`). Thirty-first session, 2 H200s (docs/PERF.md): 512 KiB a way, jump 1, one way 2.16 /
 * 1.51 / 3.81 us (ll32 / line / simple); 2 MiB 8.5 / 5.6 / 8.5; 4 KiB on one CTA 1.04 / 1.02 /
 * 2.11. */
#include "device/signal.cuh"
#include "micro.h"
#include <cstdint>

enum { kLL32 = 0, kLine = 1, kSimple = 2 };
static const char *kNames[] = {"ll32", "line", "simple"};

__device__ __forceinline__ uint4 value(uint32_t round, uint64_t item) {
  const uint32_t i = (uint32_t)item;
  return make_uint4(round * 7u + i, i ^ round, ~i, round + 3u * i);
}

/* word w of item i: side by side (ll32), or the library's layout (line, tw_ll_item_off) */
template <int L>
__device__ __forceinline__ uint4 *word(uint8_t *base, uint64_t i, uint64_t items, int w) {
  if (L == kLL32)
    return reinterpret_cast<uint4 *>(base + i * 32 + w * 16);
  return reinterpret_cast<uint4 *>(base + tw_ll_item_off(i, items, w));
}

struct Args {
  uint8_t *mine, *peer;          /* written by the other side / by this one */
  uint32_t *my_flag, *peer_flag; /* simple: a flag a CTA */
  uint64_t items;                /* in all */
  int rounds, ipt, jump, starter;
  uint64_t timeout_ns;
  int *err;         /* mismatches */
  int *timeouts;    /* waits given up */
  uint64_t *stamps; /* block 0: start, end */
};

__device__ __forceinline__ uint64_t item_of(const Args &a, int k) {
  const uint64_t per_cta = (uint64_t)blockDim.x * a.ipt;
  const int t = k * blockDim.x + threadIdx.x; /* 0 .. per_cta */
  if (a.jump == 0)
    return blockIdx.x * per_cta + t;
  /* a matrix of per_cta / 8 rows of 8 * gridDim.x items; this CTA's 8 columns of each row */
  return (uint64_t)(t / 8) * (8ull * gridDim.x) + blockIdx.x * 8ull + (uint64_t)(t % 8);
}

template <int L> __device__ void send(const Args &a, uint32_t round) {
  const uint32_t f = round + 1;
  for (int k = 0; k < a.ipt; k++) {
    const uint64_t i = item_of(a, k);
    const uint4 d = value(round, i);
    if (L == kSimple) {
      __stcg(reinterpret_cast<uint4 *>(a.peer + i * 16), d);
    } else {
      tw_ll_store(word<L>(a.peer, i, a.items, 0), d.x, d.y, f);
      tw_ll_store(word<L>(a.peer, i, a.items, 1), d.z, d.w, f);
    }
  }
  if (L == kSimple) {
    __syncthreads();
    if (threadIdx.x == 0)
      asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(a.peer_flag + blockIdx.x), "r"(f)
                   : "memory");
  }
}

template <int L> __device__ bool recv(const Args &a, uint32_t round) {
  const uint32_t f = round + 1;
  const uint64_t t0 = tw_globaltimer();
  if (L == kSimple) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
      uint32_t v;
      s_ok = 1;
      for (;;) {
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];"
                     : "=r"(v)
                     : "l"(a.my_flag + blockIdx.x)
                     : "memory");
        if (v == f)
          break;
        if (tw_globaltimer() - t0 > a.timeout_ns) {
          atomicAdd(a.timeouts, 1);
          s_ok = 0;
          break;
        }
      }
    }
    __syncthreads();
    const int ok = s_ok;
    __syncthreads();
    if (!ok)
      return false;
  }
  int bad = 0;
  for (int k = 0; k < a.ipt; k++) {
    const uint64_t i = item_of(a, k);
    const uint4 e = value(round, i);
    uint4 d;
    if (L == kSimple) {
      d = tw_ll_load(reinterpret_cast<const uint4 *>(a.mine + i * 16));
    } else {
      uint4 w0, w1;
      for (;;) {
        w0 = tw_ll_load(word<L>(a.mine, i, a.items, 0));
        w1 = tw_ll_load(word<L>(a.mine, i, a.items, 1));
        if (w0.y == f && w0.w == f && w1.y == f && w1.w == f)
          break;
        if (tw_globaltimer() - t0 > a.timeout_ns) {
          atomicAdd(a.timeouts, 1);
          return false;
        }
      }
      d = make_uint4(w0.x, w0.z, w1.x, w1.z);
    }
    bad += d.x != e.x || d.y != e.y || d.z != e.z || d.w != e.w;
  }
  if (bad)
    atomicAdd(a.err, bad);
  return true;
}

template <int L> __global__ void pingpong(Args a) {
  if (blockIdx.x == 0 && threadIdx.x == 0)
    a.stamps[0] = tw_globaltimer();
  for (int r = 0; r < a.rounds; r++) {
    if (a.starter) {
      send<L>(a, (uint32_t)r);
      if (!recv<L>(a, (uint32_t)r))
        break;
    } else {
      if (!recv<L>(a, (uint32_t)r))
        break;
      send<L>(a, (uint32_t)r);
    }
  }
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0)
    a.stamps[1] = tw_globaltimer();
}

int main(int argc, char **argv) {
  const int ctas = argc > 1 ? atoi(argv[1]) : 128;
  const int ipt = argc > 2 ? atoi(argv[2]) : 1;
  const int rounds = argc > 3 ? atoi(argv[3]) : 500;
  const int jump = argc > 4 ? atoi(argv[4]) : 1;
  const int threads = 256;
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  const int d1 = ndev > 1 ? 1 : 0;
  const uint64_t items = (uint64_t)ctas * threads * ipt;
  const size_t bytes = items * 32 + 4096;
  uint8_t *buf[2];
  uint32_t *flags[2];
  int *cnt[2];
  uint64_t *stamps[2];
  for (int s = 0; s < 2; s++) {
    CK(cudaSetDevice(s ? d1 : 0));
    if (d1 == 1) {
      const int other = 1 - s;
      cudaError_t e = cudaDeviceEnablePeerAccess(other, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
        printf("peer access: %s\n", cudaGetErrorString(e));
        return 1;
      }
      (void)cudaGetLastError();
    }
    CK(cudaMalloc(&buf[s], bytes));
    CK(cudaMalloc(&flags[s], ctas * sizeof(uint32_t)));
    CK(cudaMalloc(&cnt[s], 2 * sizeof(int)));
    CK(cudaMalloc(&stamps[s], 2 * sizeof(uint64_t)));
  }
  cudaStream_t st[2];
  for (int s = 0; s < 2; s++) {
    CK(cudaSetDevice(s ? d1 : 0));
    CK(cudaStreamCreateWithFlags(&st[s], cudaStreamNonBlocking));
  }
  printf("llbench: %d GPU(s), %d CTAs x %d threads x %d items (%.0f KiB payload one way), %d "
         "rounds, jump %d\n",
         d1 + 1, ctas, threads, ipt, items * 16 / 1024.0, rounds, jump);
  int failed = 0;
  for (int rep = 0; rep < 3; rep++)
    for (int L = 0; L < 3; L++) {
      for (int s = 0; s < 2; s++) {
        CK(cudaSetDevice(s ? d1 : 0));
        CK(cudaMemset(buf[s], 0, bytes));
        CK(cudaMemset(flags[s], 0, ctas * sizeof(uint32_t)));
        CK(cudaMemset(cnt[s], 0, 2 * sizeof(int)));
        CK(cudaDeviceSynchronize());
      }
      for (int s = 1; s >= 0; s--) { /* the waiting side first */
        CK(cudaSetDevice(s ? d1 : 0));
        Args a;
        a.mine = buf[s], a.peer = buf[1 - s];
        a.my_flag = flags[s], a.peer_flag = flags[1 - s];
        a.items = items, a.rounds = rounds, a.ipt = ipt, a.jump = jump, a.starter = s == 0;
        a.timeout_ns = 2000000000ull;
        a.err = cnt[s], a.timeouts = cnt[s] + 1, a.stamps = stamps[s];
        if (L == kLL32)
          pingpong<kLL32><<<ctas, threads, 0, st[s]>>>(a);
        else if (L == kLine)
          pingpong<kLine><<<ctas, threads, 0, st[s]>>>(a);
        else
          pingpong<kSimple><<<ctas, threads, 0, st[s]>>>(a);
        CK(cudaGetLastError());
      }
      int c[2][2];
      uint64_t t[2];
      for (int s = 0; s < 2; s++) {
        CK(cudaSetDevice(s ? d1 : 0));
        CK(cudaStreamSynchronize(st[s]));
        CK(cudaMemcpy(c[s], cnt[s], sizeof(c[s]), cudaMemcpyDeviceToHost));
      }
      CK(cudaSetDevice(0));
      CK(cudaMemcpy(t, stamps[0], sizeof(t), cudaMemcpyDeviceToHost));
      const double us = (double)(t[1] - t[0]) / 1e3 / rounds;
      const int bad = c[0][0] + c[1][0], to = c[0][1] + c[1][1];
      failed |= bad != 0 || to != 0;
      printf("%-7s round trip %8.2f us  one way %7.2f us  %7.1f GB/s  mismatches %d  timeouts %d\n",
             kNames[L], us, us / 2, (double)items * 16 / (us / 2 * 1e3), bad, to);
    }
  return failed;
}
