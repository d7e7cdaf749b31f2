/*
 * Thin inline-PTX wrappers for the Hopper (sm_90a) features the device cores use:
 * mbarrier, TMA (cp.async.bulk.tensor) loads / stores / reduce-adds, wgmma,
 * setmaxnreg, named barriers, proxy fences and acquire/release flag accesses.
 *
 * Every wrapper is one instruction (or a fixed short sequence) and says nothing about
 * policy; the GEMM contract in gemm_sm90.cuh says who calls what and when.
 * Shared-memory operands are 32-bit shared-window addresses (smem_u32()).
 */
#pragma once

#include <cuda.h>
#include <stdint.h>

namespace tw {
namespace ptx {

__device__ __forceinline__ uint32_t smem_u32(const void *ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
// v, hidden from the compiler's rematerialization: a loop holds it in a register instead of
// recomputing it from its inputs each iteration.
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}
__device__ __forceinline__ void st_shared_s32(uint32_t addr, int32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_f4(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
}

// ---- mbarrier -------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}

// Makes barrier initialisation visible to the async proxy (TMA) and the cluster.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The producer's per-stage operations (this one, mbar_try_wait / mbar_wait_for, tma_load_2d)
// also take 32-bit shared-window addresses: a loop that computes its addresses once then runs
// no cvta a stage (gemm_cta_loop's producer, detail::StageAt).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
  mbar_arrive_expect_tx(smem_u32(bar), bytes);
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// An arrival where `pred` holds, predicated rather than branched around: code between two
// wgmma waits stays one basic block (ptxas hoists a wait to the head of a block that joins
// branches, which would end the overlap of the math with the wgmma in flight).
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %1, 0;\n\t"
               "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n\t}" ::"r"(bar),
               "r"((uint32_t)pred)
               : "memory");
}

__device__ __forceinline__ uint64_t globaltimer_ns();

// One try_wait on the phase with the given parity (the hardware suspends the thread for a
// while before it reports the phase incomplete). kClusterAcquire: acquire at cluster scope,
// so what other CTAs of the cluster wrote before their release.cluster arrivals is visible
// (their shared memory included); else the default (CTA scope).
template <bool kClusterAcquire = false>
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  if constexpr (kClusterAcquire)
    asm volatile("{\n.reg .pred p;\n"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  else
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  return done != 0;
}
template <bool kClusterAcquire = false>
__device__ __forceinline__ bool mbar_try_wait(uint64_t *bar, uint32_t parity) {
  return mbar_try_wait<kClusterAcquire>(smem_u32(bar), parity);
}

// Spins until the phase with the given parity has completed (true) or timeout_ns have passed
// (false: the caller reports it). The clock is read only once the first try has failed.
template <bool kClusterAcquire = false>
__device__ __forceinline__ bool mbar_wait_for(uint32_t bar, uint32_t parity, uint64_t timeout_ns) {
  if (mbar_try_wait<kClusterAcquire>(bar, parity))
    return true;
  const uint64_t t0 = globaltimer_ns();
  for (;;) {
    if (mbar_try_wait<kClusterAcquire>(bar, parity))
      return true;
    if (globaltimer_ns() - t0 > timeout_ns)
      return false;
  }
}
template <bool kClusterAcquire = false>
__device__ __forceinline__ bool mbar_wait_for(uint64_t *bar, uint32_t parity, uint64_t timeout_ns) {
  return mbar_wait_for<kClusterAcquire>(smem_u32(bar), parity, timeout_ns);
}

// ---- clusters ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// All threads of all CTAs of the cluster (not .aligned: callers may be diverged).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n"
               "barrier.cluster.wait.acquire;" ::
                   : "memory");
}

// Arrives on the barrier at the same shared-memory offset in CTA `cta` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t *bar, uint32_t cta) {
  asm volatile("{\n"
               ".reg .b32 remote;\n"
               "mapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
               "}" ::"r"(smem_u32(bar)),
               "r"(cta)
               : "memory");
}

// The address of the same shared-memory location (a shared::cta address) in CTA `cta` of the
// cluster, as a shared::cluster address.
__device__ __forceinline__ uint32_t mapa_shared(uint32_t addr, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(cta));
  return remote;
}

// Arrives on a barrier of another CTA of the cluster (a mapa_shared address), releasing this
// thread's earlier memory operations (and those ordered before them) at cluster scope.
__device__ __forceinline__ void mbar_arrive_release_cluster(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote_bar)
               : "memory");
}

// 16 bytes of another CTA's shared memory (a mapa_shared address).
__device__ __forceinline__ float4 ld_shared_cluster_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// ---- TMA --------------------------------------------------------------------------------

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A hint: bring the 2D box at (c0, c1) of map into L2 (no shared memory, no barrier).
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap *map, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}

// 2D tile load global -> shared, completing `bytes` on bar; c0 is the inner (contiguous)
// coordinate.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                            int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int32_t c0, int32_t c1) {
  tma_load_2d(smem_u32(dst), map, smem_u32(bar), c0, c1);
}

// The same box delivered to the same shared-memory offset (and barrier offset) in every CTA
// of `cta_mask` in the cluster; each destination barrier sees the box's bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void *dst, const CUtensorMap *map,
                                                      uint64_t *bar, int32_t c0, int32_t c1,
                                                      uint16_t cta_mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1),
               "h"(cta_mask)
               : "memory");
}

// 4D tile load global -> shared (the attention operands [batch, seq, heads, head_dim] with
// c0 the head-dim column, c1 the head, c2 the sequence row, c3 the batch).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                            int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// 2D tile store shared -> global (out-of-bounds parts of the box are dropped).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, const void *src, int32_t c0,
                                             int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}

// 2D tile reduce-add shared -> global (element type from the map: f32, bf16, ...).
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap *map, const void *src,
                                                  int32_t c0, int32_t c1) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, "
               "%3}], [%1];" ::"l"(reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}

// Bulk reduce-add shared -> global of `bytes` bytes of fp32 (16-byte aligned, a multiple of 16),
// element by element, in the bulk group of the thread that commits next.
__device__ __forceinline__ void bulk_reduce_add_f32(float *dst, uint32_t src, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
      "r"(src), "r"(bytes)
      : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until the shared-memory sources of all but N committed bulk groups have been read.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until all but N committed bulk groups have completed (writes performed in global memory).
template <int N> __device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// ---- fences, barriers, flags -------------------------------------------------------------

// Generic-proxy writes to shared memory -> visible to TMA / wgmma reads that follow a barrier.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Global data observed through the generic proxy (a flag acquire) -> TMA reads that follow.
__device__ __forceinline__ void fence_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Counts this warp's threads into named barrier `id` (of `threads` in all) without waiting.
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t *ptr) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *ptr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(uint32_t *ptr, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_sys_add(uint32_t *ptr, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- register reallocation ----------------------------------------------------------------

template <uint32_t R> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <uint32_t R> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

// ---- wgmma ----------------------------------------------------------------------------------

// Shared-memory matrix descriptor for a K-major tile stored with 128-byte swizzle as TMA writes
// it: rows of 128 bytes (64 bf16), 8-row groups 1024 bytes apart; the tile base 1024-aligned.
// Advancing along K by 16 elements inside the 128-byte row adds 32 bytes to the start address.
// Its two words: lo = start address >> 4 (14 bits) | leading byte offset (16 B, unused for
// swizzled K-major); hi = stride byte offset (8 rows x 128 B) | 128-byte swizzle, a constant for
// every such tile. Advancing a stage or a 16-element K step adds to lo alone (the start address
// stays below 2^18, so no carry reaches the LBO field): the consumers' 32-bit adds
// (wgmma_desc_from_lo).
constexpr uint32_t kDescHiSw128 = (1024 >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t wgmma_desc_lo_sw128(uint32_t smem_addr) {
  return ((smem_addr & 0x3FFFF) >> 4) | (16 >> 4) << 16;
}
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void *smem) {
  return wgmma_desc_lo_sw128(smem_u32(smem)) | (uint64_t(kDescHiSw128) << 32);
}
__device__ __forceinline__ uint64_t wgmma_desc_from_lo(uint32_t lo) {
  uint64_t d;
  asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "n"(kDescHiSw128));
  return d;
}

// Programmatic dependent launch: a kernel launched after this one with
// cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled once every CTA of this
// grid has issued launch_dependents (or ended); griddep_wait makes the executing thread wait
// until the grids it depends on have completed and their memory is visible (at once where it
// was launched without the attribute).
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator accesses across wgmma fences.
__device__ __forceinline__ void reg_fence(float &r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(uint32_t &r) { asm volatile("" : "+r"(r)::"memory"); }

// The wide wgmma wrappers' accumulator operands in pieces of 32 (the asm template's %N and
// the "+f" outputs, each piece after the first with its leading comma), so that m64n128k16,
// m64n192k16 and m64n256k16 share them.
#define TW_WGMMA_R0                                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "     \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define TW_WGMMA_O0                                                                                \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),     \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),   \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),   \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define TW_WGMMA_R1                                                                                \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "   \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define TW_WGMMA_O1                                                                                \
  , "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),     \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]),   \
      "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]),   \
      "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),   \
      "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define TW_WGMMA_R2                                                                                \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "   \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define TW_WGMMA_O2                                                                                \
  , "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),     \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),   \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),   \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),   \
      "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define TW_WGMMA_R3                                                                                \
  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define TW_WGMMA_O3                                                                                \
  , "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]),  \
      "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]),          \
      "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]),          \
      "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),          \
      "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]),          \
      "+f"(d[127])

// D[64x256] (+)= A[64x16] * B[256x16]^T, bf16 in, fp32 accumulate; A and B from shared memory.
// scale_d == 0 overwrites D (first k step of a tile).
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" TW_WGMMA_R0 TW_WGMMA_R1
                   TW_WGMMA_R2 TW_WGMMA_R3 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
               : TW_WGMMA_O0 TW_WGMMA_O1 TW_WGMMA_O2 TW_WGMMA_O3
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64x192] (+)= A[64x16] * B[192x16]^T (the ping-pong loop's 128 x 192 tiles); as
// wgmma_m64n256k16_bf16 with 96 accumulators.
__device__ __forceinline__ void wgmma_m64n192k16_bf16(float (&d)[96], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {" TW_WGMMA_R0 TW_WGMMA_R1 TW_WGMMA_R2
      "}, %96, %97, p, 1, 1, 0, 0;\n}\n"
      : TW_WGMMA_O0 TW_WGMMA_O1 TW_WGMMA_O2
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64x128] (+)= A[64x16] * B[128x16]^T; as wgmma_m64n256k16_bf16 with 64 accumulators.
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TW_WGMMA_R0 TW_WGMMA_R1
               "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : TW_WGMMA_O0 TW_WGMMA_O1
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64x16] (+)= A[64x16] * B[16x16]^T (swap-AB decode tiles: B is the product's few rows); as
// wgmma_m64n256k16_bf16 with 8 accumulators.
__device__ __forceinline__ void wgmma_m64n16k16_bf16(float (&d)[8], uint64_t desc_a,
                                                     uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7"
               "}, %8, %9, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                 "+f"(d[7])
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64x8] (+)= A[64x16] * B[8x16]^T (swap-AB's 64-row tiles at m <= 16: each consumer
// warpgroup takes 8 of the product's rows); as wgmma_m64n256k16_bf16 with 4 accumulators.
__device__ __forceinline__ void wgmma_m64n8k16_bf16(float (&d)[4], uint64_t desc_a, uint64_t desc_b,
                                                    int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
               "%0, %1, %2, %3"
               "}, %4, %5, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64x32] (+)= A[64x16] * B[32x16]^T (swap-AB's 64-row tiles at m <= 64: 32 of the product's
// rows per consumer warpgroup); as wgmma_m64n256k16_bf16 with 16 accumulators.
__device__ __forceinline__ void wgmma_m64n32k16_bf16(float (&d)[16], uint64_t desc_a,
                                                     uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
               "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
                 "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64x64] (+)= A[64x16] * B[64x16]^T (swap-AB decode tiles: B is the product's few rows); as
// wgmma_m64n256k16_bf16 with 32 accumulators.
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float (&d)[32], uint64_t desc_a,
                                                     uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
               "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
                 "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
                 "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
                 "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
                 "+f"(d[31])
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// Descriptor (low word) of an MN-major operand stored with 128-byte swizzle as TMA writes it
// in boxes 64 elements wide along MN: a K row of the box is 128 bytes (64 MN elements), 8 K rows
// a 1024-byte swizzle atom (the stride byte offset, kDescHiSw128's), and the next 64 MN
// elements lie lbo bytes on (the next box; the leading byte offset). A 16-row K step adds
// 16 x 128 bytes to the start address.
__device__ __forceinline__ uint32_t wgmma_desc_lo_sw128_mn(uint32_t smem_addr, uint32_t lbo) {
  return ((smem_addr & 0x3FFFF) >> 4) | ((lbo >> 4) & 0x3FFF) << 16;
}

// D[64xN] (+)= A[64x16] * B[16xN], A from registers (4 x .b32 per thread: bf16 pairs, the
// m64nNk16 A fragment layout), B an MN-major shared-memory operand (imm-trans-b 1; its
// descriptor from wgmma_desc_lo_sw128_mn). N = 64 or 128 (32 or 64 accumulators).
__device__ __forceinline__ void wgmma_m64n128k16_rs_bf16_tb(float (&d)[64], const uint32_t (&a)[4],
                                                            uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TW_WGMMA_R0 TW_WGMMA_R1
               "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
               : TW_WGMMA_O0 TW_WGMMA_O1
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_m64n64k16_rs_bf16_tb(float (&d)[32], const uint32_t (&a)[4],
                                                           uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" TW_WGMMA_R0
               "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
               : TW_WGMMA_O0
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}
template <int N>
__device__ __forceinline__ void wgmma_rs_bf16_tb(float (&d)[N / 2], const uint32_t (&a)[4],
                                                 uint64_t desc_b, int scale_d) {
  static_assert(N == 64 || N == 128, "m64n64k16 or m64n128k16");
  if constexpr (N == 128)
    wgmma_m64n128k16_rs_bf16_tb(d, a, desc_b, scale_d);
  else
    wgmma_m64n64k16_rs_bf16_tb(d, a, desc_b, scale_d);
}

// D[64x64] (+)= A[64x16] * B[16x64], both MN-major shared-memory operands (imm-trans-a 1,
// imm-trans-b 1; descriptors from wgmma_desc_lo_sw128_mn): A stored as its transpose (K rows
// of 64 M elements), B as K rows of 64 N elements; a 16-row K step adds 16 x 128 bytes to
// each.
__device__ __forceinline__ void wgmma_m64n64k16_bf16_tt(float (&d)[32], uint64_t desc_a,
                                                        uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" TW_WGMMA_R0
               "}, %32, %33, p, 1, 1, 1, 1;\n}\n"
               : TW_WGMMA_O0
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// 2^x, the hardware approximation (ex2.approx.ftz: 2^-inf is +0).
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// wgmma m64nNk16 for the tile widths the GEMM core compiles (N = 8, 16, 32 or 64: the swap-AB
// tiles of decode shapes; 128 or 256; 192 the ping-pong loop's).
template <int N>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                           int scale_d) {
  static_assert(N == 8 || N == 16 || N == 32 || N == 64 || N == 128 || N == 192 || N == 256,
                "m64n8k16, m64n16k16, m64n32k16, m64n64k16, m64n128k16, m64n192k16 or m64n256k16");
  if constexpr (N == 8)
    wgmma_m64n8k16_bf16(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 32)
    wgmma_m64n32k16_bf16(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 256)
    wgmma_m64n256k16_bf16(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 128)
    wgmma_m64n128k16_bf16(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 192)
    wgmma_m64n192k16_bf16(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 64)
    wgmma_m64n64k16_bf16(d, desc_a, desc_b, scale_d);
  else
    wgmma_m64n16k16_bf16(d, desc_a, desc_b, scale_d);
}

} // namespace ptx
} // namespace tw
