// 2^x computed on the FMA and integer pipes instead of the special-function unit (MUFU.EX2), for
// the share of a softmax tile's exponentials that DIFFX_SM90_EXP2_FMA_EVERY moves there
// (FlashAttention-4's trick: MUFU retires 16 exponentials a clock per SM, the FMA pipe 128 FFMAs).
// Plain C++ on the host, so that tests/test_kernel_build.py checks it against exp2 on the CPU.
//
// x = j + f with j = round(x) (the 1.5 * 2^23 shift: j lands in the low mantissa bits) and f in
// [-0.5, 0.5]; 2^f from a degree-4 polynomial fitted for the least largest relative error on that
// interval (2.6e-6, against fp16's 4.9e-4 half-ulp: the P it feeds is stored as fp16 or bf16); 2^j
// built in the exponent bits and multiplied in. As with ex2.approx.ftz, -inf and every x below
// -126.5 give 0 (ex2.approx.ftz: below -126; between, a subnormal here), and NaN stays NaN (through
// the multiply). Valid for x <= 127; hopper/exp2_fma_check.cpp measures it.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DIFFX_EXP2_FMA_FN __host__ __device__ __forceinline__
#else
#define DIFFX_EXP2_FMA_FN inline
#include <cmath>
#endif

namespace diffx {

DIFFX_EXP2_FMA_FN int32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(x);
#else
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

DIFFX_EXP2_FMA_FN float bits_float(int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

DIFFX_EXP2_FMA_FN float fused(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

DIFFX_EXP2_FMA_FN float fma_exp2(float x) {
  constexpr float kShift = 12582912.f;  // 1.5 * 2^23
  // Below -127 the scale 2^j would leave the exponent field; (NaN fails the comparison and stays.)
  x = x < -127.f ? -127.f : x;
  const float shifted = x + kShift;  // round to nearest: j in the low mantissa bits
  const float f = x - (shifted - kShift);
  float p = fused(0.009570079855620861f, f, 0.05591783672571182f);
  p = fused(p, f, 0.240247443318367f);
  p = fused(p, f, 0.6931217908859253f);
  p = fused(p, f, 0.9999992847442627f);
  // (j + 127) << 23 is 2^j for j >= -126 and +0 for j = -127: the low 9 bits of shifted's bits are
  // j's two's complement, and the shift drops the rest.
  const float scale = bits_float(static_cast<int32_t>(static_cast<uint32_t>(float_bits(shifted) + 127) << 23));
  return p * scale;
}

}  // namespace diffx

#undef DIFFX_EXP2_FMA_FN
