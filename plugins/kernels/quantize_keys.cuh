// INT8-logits pre-pass: K-smoothing mean (chunked sums, then their total) and per-tile K quantisation, exactly as
// diffexport/quantization.py defines them (scheme "qk"). Q is quantised inside the attention
// kernel (one query block per CTA); K is quantised once here because every query block reads it.
#pragma once

#include "diff_attention_fwd.cuh"

namespace diffx {

constexpr int kQuantThreads = 256;

// sums[bm, c, d] = sum of K[b, t, km*D + d] over the tokens t of chunk c (kKeySumChunk tokens),
// fp32, one CTA per (chunk, bm): every SM takes part, where one CTA per map walking all kv_len
// keys left most of the GPU idle. Deterministic: fixed per-thread token strides and a fixed
// reduction order (the quantisation kernel adds the chunks in order).
template <typename T, int D>
__global__ void __launch_bounds__(kQuantThreads) key_sum_kernel(const KernelArgs args, float* sums) {
  constexpr int kLanes = kQuantThreads / D;
  DIFFX_SHARED_ARRAY(float, partial, kQuantThreads);
  const DiffxAttentionParams& p = args.p;
  const int chunk = blockIdx.x, bm = blockIdx.y, b = bm / args.key_maps, km = bm % args.key_maps;
  const int d = threadIdx.x % D, lane = threadIdx.x / D;
  const int t_end = min(p.kv_len, (chunk + 1) * kKeySumChunk);
  const T* column = static_cast<const T*>(p.key) + b * p.k_batch_stride + km * D + d;
  float sum = 0.f;
  for (int t = chunk * kKeySumChunk + lane; t < t_end; t += kLanes) sum += to_float(column[int64_t(t) * p.k_row_stride]);
  partial[threadIdx.x] = sum;
  __syncthreads();
  if (lane == 0) {
    float total = 0.f;
    for (int l = 0; l < kLanes; ++l) total += partial[l * D + d];
    sums[(int64_t(bm) * args.n_key_chunks + chunk) * D + d] = total;
  }
}

// One CTA per (64-token block, b*key_maps + km): absmax of (K - mean) over the block, codes on
// the +-qmax grid (round half to even, clamp), scale = absmax/qmax. Rows past kv_len get code 0.
template <typename T, int D>
__global__ void __launch_bounds__(kQuantThreads) key_quantise_kernel(const KernelArgs args) {
  DIFFX_SHARED_ARRAY(float, reduce, kQuantThreads / 32);
  DIFFX_SHARED_ARRAY(float, mean_s, D);
  const DiffxAttentionParams& p = args.p;
  const int blk = blockIdx.x, bm = blockIdx.y, b = bm / args.key_maps, km = bm % args.key_maps;
  const int t0 = blk * kBlockN;
  const T* base = static_cast<const T*>(p.key) + b * p.k_batch_stride + km * D;
  const float* mean = nullptr;
  if (args.k_sums) {  // the chunks' sums added in chunk order: the same mean in every CTA
    if (threadIdx.x < D) {
      const float* sums = args.k_sums + int64_t(bm) * args.n_key_chunks * D + threadIdx.x;
      float total = 0.f;
      for (int c = 0; c < args.n_key_chunks; ++c) total += sums[int64_t(c) * D];
      mean_s[threadIdx.x] = total / float(p.kv_len);
    }
    __syncthreads();
    mean = mean_s;
  }
  auto smoothed = [&](int i) {
    const int t = t0 + i / D, d = i % D;
    return to_float(base[int64_t(t) * p.k_row_stride + d]) - (mean ? mean[d] : 0.f);
  };
  float amax = 0.f;
  for (int i = threadIdx.x; i < kBlockN * D; i += kQuantThreads)
    if (t0 + i / D < p.kv_len) amax = fmaxf(amax, fabsf(smoothed(i)));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) reduce[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.f;
  for (int w = 0; w < kQuantThreads / 32; ++w) amax = fmaxf(amax, reduce[w]);
  if (!(amax > 0.f)) amax = 1.f;
  const float inv = float(args.qmax) / amax;
  int8_t* codes = const_cast<int8_t*>(args.k_codes) + (int64_t(bm) * args.kv_pad + t0) * D;
  for (int i = threadIdx.x; i < kBlockN * D; i += kQuantThreads) {
    int code = 0;
    if (t0 + i / D < p.kv_len) code = max(-args.qmax, min(args.qmax, __float2int_rn(smoothed(i) * inv)));
    codes[i] = static_cast<int8_t>(code);
  }
  if (threadIdx.x == 0) const_cast<float*>(args.k_scales)[int64_t(bm) * args.n_kv_blocks + blk] = amax / float(args.qmax);
}

#ifndef DIFFX_EMULATE
template <typename T, int D>
cudaError_t launch_key_quantisation(const KernelArgs& args, cudaStream_t stream) {
  const int maps = args.p.batch * args.key_maps;
  if (args.k_sums) {
    key_sum_kernel<T, D><<<dim3(args.n_key_chunks, maps), kQuantThreads, 0, stream>>>(args, const_cast<float*>(args.k_sums));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  key_quantise_kernel<T, D><<<dim3(args.n_kv_blocks, maps), kQuantThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

#endif  // DIFFX_EMULATE

}  // namespace diffx
