/*
 * The sm90 GEMM core's hooks, as a fused op uses them (src/gemm/gemm_sm90.cuh): a kernel of
 * the core instantiated with a wait hook (each tile waits for its rows' ready flags) and a
 * signalling epilogue (fp32 reduce-add into a staging buffer, then a per-tile counter), run
 * twice through one dynamic tile queue with no reset between; against the fp32 reference.
 * tw_gemm itself: test_gemm.cu.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdio.h>
#include <string.h>

#include "gemm/gemm_sm90.cuh"
#include "ref/ref_gemm.h"
#include "tw_test.h"

static cudaStream_t stream;
static uint64_t seed;

static __global__ void scale_kernel(float *x, float s, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] *= s;
}

// What the hooked GEMM reads and writes: A [m, k], B [n, k], the fp32 reference and staging.
typedef struct buffers {
  __nv_bfloat16 *a, *b;
  float *ref, *staging;
} buffers_t;

// (a) Before a tile's loads: wait until the row chunks it reads are marked ready (flag >= target).
struct WaitRowsReady : tw::gemm::NoWait {
  struct Params {
    const uint64_t *rows_ready; // one flag per chunk of rows_per_flag rows
    int32_t rows_per_flag;
    int32_t m;
    uint64_t target;
    uint32_t *timed_out;
  };
  __device__ static void before_tile(const Params &p, int32_t mb, int32_t) {
    const int32_t first = mb * tw::gemm::kBlockM / p.rows_per_flag;
    const int32_t last = (min((mb + 1) * tw::gemm::kBlockM, p.m) - 1) / p.rows_per_flag;
    for (int32_t f = first; f <= last; f++) {
      const uint64_t start = tw::ptx::globaltimer_ns();
      for (;;) {
        uint64_t v;
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p.rows_ready + f));
        if (v >= p.target)
          break;
        if (tw::ptx::globaltimer_ns() - start > 2000000000ull) { // bounded: 2 s, then give up
          atomicExch(p.timed_out, 1u);
          break;
        }
        __nanosleep(64);
      }
    }
    tw::ptx::fence_async_global(); // the TMA loads that follow see what the flags published
  }
};

// (b) After a tile: reduce-add (fp32) into a staging buffer, then count the tile as done.
struct EpiReduceThenSignal {
  using Out = float;
  static constexpr bool kSignal = true;
  struct Params {
    CUtensorMap c_map; // fp32 staging, box {32, 64}, 128B swizzle
    uint32_t *tile_done;
    int32_t n_blocks;
  };
  __device__ static void prefetch(const Params &p) { tw::ptx::tma_prefetch_map(&p.c_map); }
  __device__ static void issue_box(const Params &p, const void *box, int32_t col, int32_t row) {
    tw::ptx::tma_reduce_add_2d(&p.c_map, box, col, row);
  }
  __device__ static int signal_thread(const Params &) { return 0; }
  __device__ static void signal(const Params &p, int32_t mb, int32_t nb) {
    tw::ptx::red_release_gpu_add(p.tile_done + mb * p.n_blocks + nb, 1u);
  }
};

using HookParams = tw::gemm::GemmParams<EpiReduceThenSignal, WaitRowsReady>;

static void encode(CUtensorMap *map, CUtensorMapDataType dt, int es, const void *ptr, uint64_t cols,
                   uint64_t rows, uint32_t box_cols, uint32_t box_rows) {
  // The library's driver table is internal: resolve the entry point here, as it does.
  typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void *fn = NULL;
  cudaDriverEntryPointQueryResult found;
  TEST_CUDA_OK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                cudaEnableDefault, &found));
  TEST_REQUIRE(fn && found == cudaDriverEntryPointSuccess, "cuTensorMapEncodeTiled not found");
  cuuint64_t dims[2] = {cols, rows}, strides[1] = {cols * es};
  cuuint32_t box[2] = {box_cols, box_rows}, estr[2] = {1, 1};
  CUresult r =
      ((encode_fn)fn)(map, dt, 2, (void *)ptr, dims, strides, box, estr,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TEST_REQUIRE(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled: %d", (int)r);
}

// Two calls of a hooked GEMM through one queue (no reset between): staging holds 2 * A * B^T,
// every tile was signalled twice, no wait timed out.
static void check_hooks(const buffers_t *buf) {
  const int64_t m = 1000, n = 520, k = 264;
  namespace g = tw::gemm;
  tw_test_fill_bf16(buf->a, (size_t)(m * k), seed++, stream);
  tw_test_fill_bf16(buf->b, (size_t)(n * k), seed++, stream);
  TEST_TW_OK(tw_ref_gemm_fp32(buf->a, buf->b, buf->ref, m, n, k, k, k, n, stream));
  HookParams p;
  memset(&p, 0, sizeof(p));
  encode(&p.a_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buf->a, k, m, g::kBlockK, g::kBlockM);
  encode(&p.b_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buf->b, k, n, g::kBlockK, g::kBlockN);
  float *staging = buf->staging;
  encode(&p.epi.c_map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, staging, n, m, 32, g::kBoxRows);
  const int32_t mbs = (int32_t)((m + 127) / 128), nbs = (int32_t)((n + 255) / 256);
  const int rows_per_flag = 200, flags = (int)((m + rows_per_flag - 1) / rows_per_flag);
  uint64_t *rows_ready;
  uint32_t *tile_done, *timed_out;
  g::TileQueue *queue;
  TEST_CUDA_OK(cudaMalloc(&rows_ready, flags * sizeof(uint64_t)));
  TEST_CUDA_OK(cudaMalloc(&tile_done, mbs * nbs * sizeof(uint32_t)));
  TEST_CUDA_OK(cudaMalloc(&timed_out, sizeof(uint32_t)));
  TEST_CUDA_OK(cudaMalloc(&queue, sizeof(*queue)));
  uint64_t ready[8];
  for (int f = 0; f < flags; f++)
    ready[f] = 3; // epoch 3 published
  TEST_CUDA_OK(cudaMemcpy(rows_ready, ready, flags * sizeof(uint64_t), cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemset(tile_done, 0, mbs * nbs * sizeof(uint32_t)));
  TEST_CUDA_OK(cudaMemset(timed_out, 0, sizeof(uint32_t)));
  TEST_CUDA_OK(cudaMemset(queue, 0, sizeof(*queue)));
  TEST_CUDA_OK(cudaMemset(staging, 0, m * n * sizeof(float)));
  p.wait = {rows_ready, rows_per_flag, (int32_t)m, 3, timed_out};
  p.epi.tile_done = tile_done;
  p.epi.n_blocks = nbs;
  p.order = {mbs, nbs, mbs * nbs, g::kOrderRotated, 4, mbs / 2};
  p.queue = queue;
  p.participants = 5; // fewer CTAs than tiles: each claims several
  p.k_blocks = (int32_t)((k + 63) / 64);
  auto kernel = g::gemm_sm90_kernel<4, 16384, EpiReduceThenSignal, WaitRowsReady, true>;
  const int smem = g::SmemLayout<4, 16384>::kDynamicBytes;
  TEST_CUDA_OK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int call = 0; call < 2; call++)
    kernel<<<5, g::kThreads, smem, stream>>>(p);
  TEST_CUDA_OK(cudaGetLastError());
  TEST_CUDA_OK(cudaStreamSynchronize(stream));
  scale_kernel<<<256, 256, 0, stream>>>(buf->ref, 2.f, (size_t)(m * n));
  size_t bad = 0;
  const double err = tw_test_rel_err_fp32(staging, buf->ref, (size_t)(m * n), &bad);
  TEST_ASSERT(err < 1e-3 && bad == 0, "hooked GEMM (reduce-add x2): rel err %.3g, %zu NaN", err,
              bad);
  uint32_t done[64], host_timed_out = 1;
  TEST_CUDA_OK(cudaMemcpy(done, tile_done, mbs * nbs * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(&host_timed_out, timed_out, sizeof(uint32_t), cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int t = 0; t < mbs * nbs; t++)
    wrong += done[t] != 2;
  TEST_ASSERT(wrong == 0, "%d tiles not signalled exactly twice", wrong);
  TEST_ASSERT(host_timed_out == 0, "a row wait timed out");
  g::TileQueue q;
  TEST_CUDA_OK(cudaMemcpy(&q, queue, sizeof(q), cudaMemcpyDeviceToHost));
  TEST_ASSERT(q.next == 0 && q.finished == 0, "queue not reset: next %u finished %u", q.next,
              q.finished);
  printf("hooks (wait, reduce-add + signal, queue): rel err %.2e\n", err);
  cudaFree(rows_ready);
  cudaFree(tile_done);
  cudaFree(timed_out);
  cudaFree(queue);
}

int main(void) {
  tw_test_require_hopper();
  seed = tw_test_seed();
  TEST_CUDA_OK(cudaStreamCreate(&stream)); // blocking: the helpers run on the legacy stream
  buffers_t buf;
  const size_t elems = (size_t)1024 * 1024; // >= check_hooks' m x n, m x k and n x k
  TEST_CUDA_OK(cudaMalloc(&buf.a, elems * 2));
  TEST_CUDA_OK(cudaMalloc(&buf.b, elems * 2));
  TEST_CUDA_OK(cudaMalloc(&buf.staging, elems * 4));
  TEST_CUDA_OK(cudaMalloc(&buf.ref, elems * 4));
  check_hooks(&buf);
  TEST_CUDA_OK(cudaDeviceSynchronize());
  TEST_ASSERT(cudaGetLastError() == cudaSuccess, "no sticky CUDA error");
  cudaFree(buf.a);
  cudaFree(buf.b);
  cudaFree(buf.staging);
  cudaFree(buf.ref);
  cudaStreamDestroy(stream);
  return tw_test_finish();
}
