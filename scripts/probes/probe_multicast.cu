// Build: nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/device
//        -o probe_multicast scripts/probes/probe_multicast.cu -lcuda
// (here: -L /usr/local/cuda/lib64/stubs; the GPU machine has the driver's libcuda).
//
// Whether a TMA multicast runs slower when its lines miss to DRAM than when they hit L2: the
// question the thirty-sixth session left open. exp/pair-a's decode tiles (CTA pairs sharing the
// weights' box by multicast) took 25.9 us under ncu at M=64 N=4096 K=4096 against 13.6 for
// cuBLAS's nvjet_sm90_tst_64x32_64x16_1x2, which multicasts the small operand (the tokens, in
// L2) and streams its own weights, with the same DRAM bytes and the same bytes into the SMs.
// Here only the loads run (no wgmma): per K block of 64, each CTA's producer thread loads its
// boxes into a ring of stages and one consumer thread frees each stage once it is full.
//
// Modes (W: the weights, 4096 rows x K, streamed from DRAM after an L2 flush; T: 64 token rows
// x K, L2-resident; a box is 64 columns (128 bytes) x 32 or 64 rows):
//   single64  64 CTAs, each W 64 rows + T 64 rows, no cluster (tw_gemm's M=64 tiles today)
//   pairW     64 pairs, each CTA half of the pair's 64 W rows multicast to both + its own 32 T
//             rows (exp/pair-a)
//   pairT     64 pairs, each CTA its own 32 W rows + half of the 64 T rows multicast to both
//             (cuBLAS's 1x2 kernel)
//   dupW      64 pairs, each CTA all 64 of the pair's W rows itself (its peer reads them too) +
//             its own 32 T rows (no multicast)
//   pairW-L2  pairW with W's rows wrapped into a 4 MiB window (its multicast lines hit L2)
// Every CTA receives the same bytes per K block in pairW, pairT and dupW (12 KiB). Every wait is
// bounded (2 s); a stall is counted and reported, and the row says so.
#include "ptx_sm90.cuh"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cuda.h>
#include <cuda_runtime.h>
#include <vector>

using namespace tw;

namespace {

constexpr int kK = 8192, kKBlocks = kK / 64, kWRows = 4096, kTRows = 64;
constexpr uint64_t kWaitNs = 2000000000ull;

struct Maps {
  CUtensorMap w64, w32, t64, t32;
};

enum { kSingle64 = 0, kPairW = 1, kPairT = 2, kDupW = 3 };

template <int MODE> struct Cfg {
  static constexpr int kW = MODE == kPairT ? 4096 : 8192; // W bytes a stage
  static constexpr int kT = MODE == kSingle64 || MODE == kPairT ? 8192 : 4096;
  static constexpr int kCluster = MODE == kSingle64 ? 1 : 2;
  static constexpr bool kMulticast = MODE == kPairW || MODE == kPairT;
  static constexpr int kStages = 196608 / (kW + kT); // 12 or 16, as the GEMM core's rings
  static constexpr int kSmem = kStages * (kW + kT) + 2 * kStages * 8 + 1024;
};

__device__ bool wait_bounded(uint64_t *bar, uint32_t parity, unsigned long long *stuck) {
  if (ptx::mbar_wait_for(bar, parity, kWaitNs))
    return true;
  atomicAdd(stuck, 1ull);
  return false;
}

template <int MODE>
__global__ void __launch_bounds__(128, 1)
    probe(const __grid_constant__ Maps m, int w_rows_window, unsigned long long *stuck) {
  using C = Cfg<MODE>;
  extern __shared__ __align__(1024) uint8_t raw[];
  uint8_t *smem =
      reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  uint8_t *wslot = smem, *tslot = smem + C::kStages * C::kW;
  uint64_t *full = reinterpret_cast<uint64_t *>(tslot + C::kStages * C::kT);
  uint64_t *empty = full + C::kStages;
  const uint32_t rank = C::kCluster == 2 ? ptx::cluster_ctarank() : 0;
  const int cta = blockIdx.x, pair = cta / C::kCluster;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; s++) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], C::kMulticast ? 2 : 1);
    }
    ptx::mbar_init_fence();
  }
  if (C::kCluster == 2)
    ptx::cluster_sync();
  else
    __syncthreads();
  if (threadIdx.x == 0) { // producer
    const int w_pair = (pair * 64) % w_rows_window, w_cta = (cta * 32) % w_rows_window;
    for (int kb = 0; kb < kKBlocks; kb++) {
      const int s = kb % C::kStages, round = kb / C::kStages;
      if (round > 0 && !wait_bounded(&empty[s], (round - 1) & 1, stuck))
        break;
      ptx::mbar_arrive_expect_tx(&full[s], C::kW + C::kT);
      uint8_t *w = wslot + s * C::kW, *t = tslot + s * C::kT;
      const int x = kb * 64;
      if (MODE == kSingle64) {
        ptx::tma_load_2d(w, &m.w64, &full[s], x, (cta * 64) % w_rows_window);
        ptx::tma_load_2d(t, &m.t64, &full[s], x, 0);
      } else if (MODE == kPairW) {
        ptx::tma_load_2d_multicast(w + rank * 4096, &m.w32, &full[s], x, w_pair + rank * 32, 0x3);
        ptx::tma_load_2d(t, &m.t32, &full[s], x, rank * 32);
      } else if (MODE == kPairT) {
        ptx::tma_load_2d(w, &m.w32, &full[s], x, w_cta);
        ptx::tma_load_2d_multicast(t + rank * 4096, &m.t32, &full[s], x, rank * 32, 0x3);
      } else {
        ptx::tma_load_2d(w, &m.w64, &full[s], x, w_pair);
        ptx::tma_load_2d(t, &m.t32, &full[s], x, rank * 32);
      }
    }
  } else if (threadIdx.x == 32) { // consumer: frees each stage once full (both CTAs' if shared)
    for (int kb = 0; kb < kKBlocks; kb++) {
      const int s = kb % C::kStages;
      if (!wait_bounded(&full[s], (kb / C::kStages) & 1, stuck))
        break;
      ptx::mbar_arrive(&empty[s]);
      if (C::kMulticast)
        ptx::mbar_arrive_cluster(&empty[s], rank ^ 1);
    }
  }
  __syncthreads();
  if (C::kCluster == 2)
    ptx::cluster_sync(); // no CTA leaves while its peer may still write into it
}

void check(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "probe_multicast: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}

void encode(CUtensorMap *map, void *base, uint64_t rows, uint32_t box_rows) {
  const cuuint64_t dims[2] = {(cuuint64_t)kK, rows};
  const cuuint64_t strides[1] = {(cuuint64_t)kK * 2};
  const cuuint32_t box[2] = {64, box_rows}, elem[2] = {1, 1};
  const CUresult r =
      cuTensorMapEncodeTiled(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box,
                             elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "probe_multicast: cuTensorMapEncodeTiled: %d\n", (int)r);
    exit(1);
  }
}

template <int MODE>
void row(const char *name, const Maps &maps, int window, void *flush, size_t flush_bytes,
         unsigned long long *stuck) {
  using C = Cfg<MODE>;
  auto k = probe<MODE>;
  check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem), "smem");
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C::kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(C::kCluster == 1 ? 64 : 128);
  cfg.blockDim = dim3(128);
  cfg.dynamicSmemBytes = C::kSmem;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  check(cudaMemset(stuck, 0, sizeof(*stuck)), "memset");
  std::vector<float> us;
  for (int rep = 0; rep < 12; rep++) {
    check(cudaMemsetAsync(flush, rep, flush_bytes), "flush"); // W out of L2
    check(cudaEventRecord(a), "record");
    check(cudaLaunchKernelEx(&cfg, k, maps, window, stuck), "launch");
    check(cudaEventRecord(b), "record");
    check(cudaEventSynchronize(b), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "elapsed");
    if (rep >= 2)
      us.push_back(ms * 1000.f);
  }
  unsigned long long st = 0;
  check(cudaMemcpy(&st, stuck, sizeof(st), cudaMemcpyDeviceToHost), "stuck");
  std::sort(us.begin(), us.end());
  const float med = us[us.size() / 2];
  const double into_sms = (double)cfg.gridDim.x * kKBlocks * (C::kW + C::kT);
  printf("%-9s %3d CTAs, %2d stages of %2d KiB: %7.2f us (p10 %.2f, p90 %.2f), %6.2f TB/s into "
         "the SMs, %5.2f TB/s of W%s\n",
         name, cfg.gridDim.x, C::kStages, (C::kW + C::kT) / 1024, med, us[us.size() / 10],
         us[us.size() * 9 / 10], into_sms / (med * 1e-6) / 1e12,
         (double)kWRows * kK * 2 / (med * 1e-6) / 1e12,
         st ? "  STALLED (bounded waits gave up)" : "");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

} // namespace

int main() {
  void *w, *t, *flush;
  unsigned long long *stuck;
  const size_t flush_bytes = (size_t)256 << 20;
  check(cudaMalloc(&w, (size_t)kWRows * kK * 2), "malloc W");
  check(cudaMalloc(&t, (size_t)kTRows * kK * 2), "malloc T");
  check(cudaMalloc(&flush, flush_bytes), "malloc flush");
  check(cudaMalloc(&stuck, sizeof(*stuck)), "malloc stuck");
  check(cudaMemset(w, 0x3c, (size_t)kWRows * kK * 2), "memset W");
  check(cudaMemset(t, 0x3c, (size_t)kTRows * kK * 2), "memset T");
  Maps maps;
  encode(&maps.w64, w, kWRows, 64);
  encode(&maps.w32, w, kWRows, 32);
  encode(&maps.t64, t, kTRows, 64);
  encode(&maps.t32, t, kTRows, 32);
  printf("K=%d (%d blocks of 64), W %d rows (%d MiB, flushed from L2 before each run), T %d "
         "rows; median of 10 runs\n",
         kK, kKBlocks, kWRows, kWRows * kK * 2 >> 20, kTRows);
  for (int round = 0; round < 2; round++) {
    row<kSingle64>("single64", maps, kWRows, flush, flush_bytes, stuck);
    row<kPairW>("pairW", maps, kWRows, flush, flush_bytes, stuck);
    row<kPairT>("pairT", maps, kWRows, flush, flush_bytes, stuck);
    row<kDupW>("dupW", maps, kWRows, flush, flush_bytes, stuck);
    row<kPairW>("pairW-L2", maps, 256, flush, flush_bytes, stuck); // 4 MiB of W rows, in L2
  }
  return 0;
}
