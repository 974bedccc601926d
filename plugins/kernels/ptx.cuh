// Thin wrappers over the PTX instructions the kernels use (sm_80 and newer): asynchronous
// global->shared copies, ldmatrix, and the fp16/bf16/int8 tensor-core MMAs.
// DIFFX_EMULATE swaps all of them (and the CUDA built-ins the kernels use) for the CPU emulation
// in emulation/cuda_emulation.h, so the very same kernel source also runs, slowly, on a CPU.
#pragma once

#include <stdint.h>

#ifdef DIFFX_EMULATE
#include "emulation/cuda_emulation.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define DIFFX_DYNAMIC_SHARED(name) extern __shared__ __align__(128) char name[]
#define DIFFX_SHARED_ARRAY(type, name, count) __shared__ type name[count]

namespace diffx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination (rows past the end of a tensor).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
// 8-byte async copy (through L1: .cg takes 16 bytes only), zero-filling as above: one int64 key-mask
// flag, whose row need not be 16-byte aligned.
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight (the newest ones).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Barrier `id` (1-15; 0 is __syncthreads') of THREADS threads, whole warps: they meet, and their
// writes to shared memory before it are seen after it (bar.sync).
template <int THREADS>
__device__ __forceinline__ void named_barrier_sync(int id) {
  static_assert(THREADS % 32 == 0, "whole warps");
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// D = A*B + D, m16n8k16, fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// D = A*B + D, m16n8k32 int8 x int8 -> int32 (exact).
__device__ __forceinline__ void mma_16832_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
// 2^x on the special-function unit (MUFU.EX2) without exp2f's subnormal handling: the
// arguments here are logits minus their running max (<= 0), results below 2^-126 flush to 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (griddepcontrol, sm_90 and later; no-ops before, where no launch
// asks for it). A grid that lets its stream's next grid launch early: every CTA says so as it starts,
// and once all have, that grid's CTAs may take the SMs this one frees. The next grid waits for the
// whole of this one, its memory included, before it reads what this one wrote.
__device__ __forceinline__ void launch_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace diffx
#endif  // DIFFX_EMULATE

namespace diffx {

// Shared-memory tiles are rows of 16-byte chunks. The chunk index is XOR-swizzled so that the
// 8 row addresses of one ldmatrix (same logical chunk, 8 consecutive rows) hit distinct banks.
template <int CHUNKS_PER_ROW>
__device__ __forceinline__ int swizzled_chunk(int row, int chunk) {
  static_assert(CHUNKS_PER_ROW == 4 || CHUNKS_PER_ROW % 8 == 0, "tile rows must be 64 bytes or a multiple of 128");
  if constexpr (CHUNKS_PER_ROW == 4) {
    return row * 4 + (chunk ^ ((row >> 1) & 3));  // two rows share one 128-byte line
  } else {
    return row * CHUNKS_PER_ROW + (chunk ^ (row & 7));
  }
}

}  // namespace diffx
