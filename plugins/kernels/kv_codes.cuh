// An 8-bit KV cache (DiffxKvFormat): its 1-byte codes turned into fp16/bf16 tensor-core operands in
// registers, and the dequantisation pass that longer calls run before the plain kernels.
//
// In the split-KV decode kernel the code tiles stay in shared memory as they were loaded (half the
// bytes of an fp16 tile) and ldmatrix reads them as if they were b16 elements: each 32-bit register
// then holds four codes, which code_pair turns into two fp16 pairs. The pairs are exactly
// code x kv_code_unit (int8: the code; e4m3: the value x 2^-8, see below), so the per-channel
// scales never enter the loop: K's fold into Q once per CTA, V's onto the output in the merge.
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

// e4m3 bits shifted into an fp16 (sign to bit 15, exponent and mantissa to bits 7-13): fp16's
// exponent bias is 8 above e4m3's and both have subnormals, so this is the code's value x 2^-8 for
// every code, exactly (0x7f/0xff, NaN in e4m3, read as +-480 x 2^-8: a cache writer never stores them).
__device__ __forceinline__ uint32_t e4m3_to_fp16_bits(uint32_t code) {
  return ((code & 0x80u) << 8) | ((code & 0x7fu) << 7);
}

// Codes I and J (bytes of `word`) as a packed fp16 pair, I in the low half: code x kv_code_unit,
// exact. A few integer ops a pair (PRMT places the bytes), so the loop stays at the memory bound;
// the decode kernel runs its 8-bit-cache mmas on fp16 whatever the model's dtype.
template <int FMT, int I, int J>
__device__ __forceinline__ uint32_t code_pair(uint32_t word) {
  if constexpr (FMT == kKvInt8) {
    // 0x64 above each biased byte (code + 128) is the fp16 1024 + 128 + code; one HSUB2 of 1152
    // (0x6480) leaves the code.
    return hsub2_bits(byte_perm(word ^ 0x80808080u, 0x64646464u, I | (4 << 4) | (J << 8) | (5 << 12)), 0x64806480u);
  } else {
    static_assert(FMT == kKvFp8, "int8 or e4m3 codes");
    // Code I to bits 8-15 and J to bits 24-31, then each shifted into its fp16 (e4m3_to_fp16_bits).
    const uint32_t placed = byte_perm(word, 0u, 4 | (I << 4) | (4 << 8) | (J << 12));
    return (placed & 0x80008000u) | ((placed & 0x7f007f00u) >> 1);
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
