/*
 * SwiGLU, the step between an MoE expert's gate/up GEMM and its down GEMM (tw_swiglu's contract
 * in tilewire.h): one function both tw_swiglu and tw_moe_ffn run, so their act is the same bits.
 */
#ifndef TW_OPS_MOE_SWIGLU_CUH
#define TW_OPS_MOE_SWIGLU_CUH

#include <cuda_bf16.h>
#include <stdint.h>

namespace tw {
namespace moe {

/* bf16 bits to fp32 and back (round to nearest even, as __float2bfloat16_rn). */
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t *>(&v);
}
/* silu(g) * u in fp32; expf (not __expf) so that the bits do not depend on fast-math flags. */
__device__ __forceinline__ float swiglu1(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* Eight outputs: act = swiglu(g, u) of eight gate and eight up values (16-byte vectors). */
__device__ __forceinline__ uint4 swiglu8(uint4 g, uint4 u) {
  return make_uint4(
      pack_bf16x2(swiglu1(bf16_lo(g.x), bf16_lo(u.x)), swiglu1(bf16_hi(g.x), bf16_hi(u.x))),
      pack_bf16x2(swiglu1(bf16_lo(g.y), bf16_lo(u.y)), swiglu1(bf16_hi(g.y), bf16_hi(u.y))),
      pack_bf16x2(swiglu1(bf16_lo(g.z), bf16_lo(u.z)), swiglu1(bf16_hi(g.z), bf16_hi(u.z))),
      pack_bf16x2(swiglu1(bf16_lo(g.w), bf16_lo(u.w)), swiglu1(bf16_hi(g.w), bf16_hi(u.w))));
}

/* act's rows [row0, row1) from h's, by the threads of a CTA (blockDim.x of them). h is read
 * through L2 (ld.global.cg): in tw_moe_ffn other SMs stored it. */
__device__ __forceinline__ void swiglu_rows(const uint16_t *h, uint16_t *act, int64_t row0,
                                            int64_t row1, int64_t inter) {
  const int64_t vecs = inter / 8, n = (row1 - row0) * vecs;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t r = row0 + i / vecs, v = i % vecs;
    const uint4 *hr = reinterpret_cast<const uint4 *>(h + r * 2 * inter);
    const uint4 g = __ldcg(hr + v), u = __ldcg(hr + vecs + v);
    reinterpret_cast<uint4 *>(act + r * inter)[v] = swiglu8(g, u);
  }
}

} // namespace moe
} // namespace tw
#endif
