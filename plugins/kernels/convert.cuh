// float32 I/O: element-wise conversion between the caller's strided fp32 tensors and the fp16
// copies in the workspace that the fused kernel runs on (round to nearest even; |x| > 65504
// becomes inf, so fp32 inputs must fit fp16's range).
#pragma once

#include "ptx.cuh"

namespace diffx {

constexpr int kConvertThreads = 256;

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const __half* p) { return to_float(*p); }
__device__ __forceinline__ void store_float(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_float(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_float(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// dst[b, r, c] = src[b, r, c] for a [batch, rows, width] tensor with free batch/row strides.
template <typename Src, typename Dst>
__global__ void __launch_bounds__(kConvertThreads) convert_kernel(const Src* src, int64_t src_batch, int64_t src_row,
                                                                  Dst* dst, int64_t dst_batch, int64_t dst_row,
                                                                  int64_t rows, int64_t width, int64_t total) {
  const int64_t i = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
  if (i >= total) return;
  const int64_t c = i % width, r = (i / width) % rows, b = i / (width * rows);
  store_float(dst + b * dst_batch + r * dst_row + c, load_float(src + b * src_batch + r * src_row + c));
}

inline unsigned convert_blocks(int64_t total) { return unsigned((total + kConvertThreads - 1) / kConvertThreads); }

}  // namespace diffx
