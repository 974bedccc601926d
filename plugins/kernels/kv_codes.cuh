// An 8-bit KV cache (DiffxKvFormat): its 1-byte codes turned into fp16/bf16 tensor-core operands in
// registers, and the dequantisation pass that longer calls run before the plain kernels.
//
// In the split-KV decode kernel the code tiles stay in shared memory as they were loaded (half the
// bytes of an fp16 tile) and ldmatrix reads them as if they were b16 elements: each 32-bit register
// then holds four codes, which code_pair turns into two fp16 pairs. The pairs are exactly
// code x kv_code_unit (int8: the code; e4m3: the value, or 2^-8 of it before sm_89) plus, for int8 codes, the
// constant kInt8CodeBias, so the per-channel scales never enter the loop: K's fold into Q once per
// CTA, V's onto the output in the merge.
#pragma once

#include "convert.cuh"
#include "diff_attention.h"
#include "ptx.cuh"

namespace diffx {

constexpr int kKvInt8 = DIFFX_KV_INT8;
constexpr int kKvFp8 = DIFFX_KV_FP8_E4M3;

#ifdef DIFFX_EMULATE
inline float fp16_bits_to_float(uint32_t h) { return diffx_emu::half_to_float(uint16_t(h)); }
// Two fp16 subtractions on packed pairs (the GPU's HSUB2); exact for the integers used here.
inline uint32_t hsub2_bits(uint32_t a, uint32_t b) {
  return pack2(fp16_bits_to_float(a & 0xffffu) - fp16_bits_to_float(b & 0xffffu),
               fp16_bits_to_float(a >> 16) - fp16_bits_to_float(b >> 16), __half());
}
// PRMT: byte i of the result is byte (selector >> 4i) & 7 of {a, b} (0-3 from a, 4-7 from b).
inline uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  const uint64_t bytes = uint64_t(a) | (uint64_t(b) << 32);
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= uint32_t((bytes >> (8 * ((selector >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return out;
}
#else
__device__ __forceinline__ float fp16_bits_to_float(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }
__device__ __forceinline__ uint32_t hsub2_bits(uint32_t a, uint32_t b) {
  __half2 d = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&d);
}
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  return __byte_perm(a, b, selector);
}
#endif

// 1: e4m3 codes become fp16 by the hardware conversion, cvt.rn.f16x2.e4m3x2 (sm_89 and later: one
// instruction a pair, from a 16-bit half of a register), at their own value (kv_code_unit 1).
// 0: by shifting their bits into an fp16 (every GPU: 3-4 integer instructions a pair), at 2^-8 of
// their value. The emulator runs the first unless built with -DDIFFX_KV_FP8_CVT=0
// (tests/test_kernel_emulated.py builds it both ways).
#ifndef DIFFX_KV_FP8_CVT
#if defined(DIFFX_EMULATE) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890)
#define DIFFX_KV_FP8_CVT 1
#else
#define DIFFX_KV_FP8_CVT 0
#endif
#endif

// What one code is worth in the converted fp16 tile, divided out of the scales (k_scale into Q,
// v_scale onto the output): 1, or 2^-8 for e4m3 codes whose bits are shifted into an fp16.
__device__ __forceinline__ constexpr float kv_code_unit(int format) {
  return format == kKvFp8 && !DIFFX_KV_FP8_CVT ? 1.f / 256.f : 1.f;
}

// e4m3 bits shifted into an fp16 (sign to bit 15, exponent and mantissa to bits 7-13): fp16's
// exponent bias is 8 above e4m3's and both have subnormals, so this is the code's value x 2^-8 for
// every code, exactly (0x7f/0xff, NaN in e4m3, read as +-480 x 2^-8: a cache writer never stores them).
__device__ __forceinline__ uint32_t e4m3_to_fp16_bits(uint32_t code) {
  return ((code & 0x80u) << 8) | ((code & 0x7fu) << 7);
}

// The two e4m3 codes of 16-bit half HALF of `word` (the low byte first) as a packed fp16 pair at
// their own value: cvt.rn.f16x2.e4m3x2 (its NaN codes 0x7f/0xff give NaN; a cache writer never
// stores them). The emulator: each code's value, exact in fp16.
template <int HALF>
__device__ __forceinline__ uint32_t e4m3x2_to_fp16x2(uint32_t word) {
#ifdef DIFFX_EMULATE
  const uint32_t lo = (word >> (16 * HALF)) & 0xffu, hi = (word >> (16 * HALF + 8)) & 0xffu;
  return pack2(fp16_bits_to_float(e4m3_to_fp16_bits(lo)) * 256.f, fp16_bits_to_float(e4m3_to_fp16_bits(hi)) * 256.f,
               __half());
#elif DIFFX_KV_FP8_CVT
  uint32_t out;
  if constexpr (HALF == 0)
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(out) : "r"(word));
  else
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(out) : "r"(word));
  return out;
#else
  return word;  // (not called: the bit shifts serve GPUs before sm_89)
#endif
}

// 1 (default): int8 codes become the fp16 value code + kInt8CodeBias, without the subtraction
// (one HSUB2 a pair, 96 of the ~576 instructions a warp issues per tile of the V1 d = 128 kernel
// on sm_90a, where the fp8 cache's costlier conversions already measured 1.2x slower than int8's:
// the loop is bound by its instructions). The bias adds 1152 * sum(q) to each logit of a query
// row, the same for every key, which the softmax does not see; P.V gains 1152 * sum(P), which the
// decode kernel accumulates by one more mma (P against ones) and subtracts once. 0: the exact code.
#ifndef DIFFX_DECODE_KV_BIAS
#define DIFFX_DECODE_KV_BIAS 1
#endif
constexpr float kInt8CodeBias = 1152.f;  // 1024 (fp16 0x6400) + 128 (the sign bit flipped)

// Codes I and J (bytes of `word`) as a packed fp16 pair, I in the low half: code x kv_code_unit
// (+ kInt8CodeBias for int8 codes under DIFFX_DECODE_KV_BIAS), exact. A few integer ops a pair
// (PRMT places the bytes); the decode kernel runs its 8-bit-cache mmas on fp16 whatever the model's dtype.
template <int FMT, int I, int J>
__device__ __forceinline__ uint32_t code_pair(uint32_t word) {
  if constexpr (FMT == kKvInt8) {
    // 0x64 above each biased byte (code + 128) is the fp16 1024 + 128 + code; one HSUB2 of 1152
    // (0x6480) would leave the code.
    const uint32_t biased = byte_perm(word ^ 0x80808080u, 0x64646464u, I | (4 << 4) | (J << 8) | (5 << 12));
    return DIFFX_DECODE_KV_BIAS ? biased : hsub2_bits(biased, 0x64806480u);
  } else {
    static_assert(FMT == kKvFp8, "int8 or e4m3 codes");
#if DIFFX_KV_FP8_CVT
    // The pairs the kernel asks for: (0, 1) and (2, 3) lie in one half of the word already; (0, 2)
    // and (1, 3) share one PRMT (bytes 0, 2 | 1, 3), which the compiler computes once a word.
    static_assert((I == 0 && J == 1) || (I == 2 && J == 3) || (I == 0 && J == 2) || (I == 1 && J == 3),
                  "pairs (0, 1), (2, 3), (0, 2) and (1, 3)");
    if constexpr (J == I + 1) return e4m3x2_to_fp16x2<I / 2>(word);
    else return e4m3x2_to_fp16x2<I>(byte_perm(word, 0u, 0x3120));
#else
    // Code I to bits 8-15 and J to bits 24-31, then each shifted into its fp16 (e4m3_to_fp16_bits).
    const uint32_t placed = byte_perm(word, 0u, 4 | (I << 4) | (4 << 8) | (J << 12));
    return (placed & 0x80008000u) | ((placed & 0x7f007f00u) >> 1);
#endif
  }
}

// One code's real value before its channel scale (the reference's dequantisation: int8 code, or the e4m3 value).
template <int FMT>
__device__ __forceinline__ float code_value(uint8_t code) {
  if constexpr (FMT == kKvInt8) {
    return float(int8_t(code));
  } else {
    return fp16_bits_to_float(e4m3_to_fp16_bits(code)) * 256.f;
  }
}

// A call longer than DIFFX_DECODE_MAX_QUERY on an 8-bit cache: dst[b, r, c] = value(src[b, r, c]) *
// scale[c] into a contiguous [batch, rows, width] tensor of the query's dtype (params.cpp's
// dequantised_params), which the plain kernels then read.
template <typename Dst, int FMT>
__global__ void __launch_bounds__(kConvertThreads) dequantise_kernel(const uint8_t* src, int64_t src_batch,
                                                                     int64_t src_row, const float* scale, Dst* dst,
                                                                     int64_t rows, int64_t width, int64_t total) {
  const int64_t i = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
  if (i >= total) return;
  const int64_t c = i % width, r = (i / width) % rows, b = i / (width * rows);
  store_float(dst + i, code_value<FMT>(src[b * src_batch + r * src_row + c]) * scale[c]);
}

}  // namespace diffx
