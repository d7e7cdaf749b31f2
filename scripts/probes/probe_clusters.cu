// Build: nvcc -gencode=arch=compute_90a,code=sm_90a -o probe_clusters probe_clusters.cu (group
// s28 of scripts/gpu-experiments.sh runs it from $TW_BUILD_DIR).
// Max co-resident clusters of a 384-thread CTA with ~200 KB of dynamic shared memory (the
// GEMM core's decode kernels), for cluster sizes 1..16: how many clusters of 8 fit at once.
#include <cstdio>
#include <cuda_runtime.h>
__global__ void __launch_bounds__(384, 1) dummy(int *p) {
  extern __shared__ int s[];
  if (p)
    p[threadIdx.x] = s[threadIdx.x];
}
int main() {
  int smems[] = {100 * 1024, 150 * 1024, 200 * 1024, 227 * 1024};
  cudaFuncSetAttribute(dummy, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  cudaFuncSetAttribute(dummy, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  for (int si = 0; si < 4; si++)
    for (int c = 1; c <= 16; c *= 2) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = c;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.gridDim = dim3(c * 64);
      cfg.blockDim = dim3(384);
      cfg.dynamicSmemBytes = smems[si];
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int n = -1;
      cudaError_t e = cudaOccupancyMaxActiveClusters(&n, dummy, &cfg);
      printf("smem %3d KiB cluster %2d: max active clusters %3d (%3d CTAs) %s\n", smems[si] / 1024,
             c, n, n * c, e == cudaSuccess ? "" : cudaGetErrorString(e));
    }
  return 0;
}
