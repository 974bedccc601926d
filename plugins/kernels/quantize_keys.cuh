// INT8-logits pre-pass: K-smoothing mean (chunked sums, then their total) and per-tile K quantisation, exactly as
// diffexport/core/quantization.py defines them (scheme "qk"). Q is quantised inside the attention
// kernel (one query block per CTA); K is quantised once here because every query block reads it.
#pragma once

#include "diff_attention_fwd.cuh"

namespace diffx {

constexpr int kQuantThreads = 256;

// Eight adjacent channels of one key row: one 16-byte load (the contract aligns K's start and
// strides to 8 elements). Scalar 2-byte loads kept too few bytes in flight: on an H200 on
// 2026-11-26 the pre-pass took about 0.3 ms for 134 MB of keys, 4x its memory bound.
template <typename T>
struct alignas(16) KeyVector {
  T x[8];
};
struct alignas(8) CodeVector {
  int8_t x[8];
};

// sums[bm, c, d] = sum of K[b, t, km*D + d] over the tokens t of chunk c (kKeySumChunk tokens),
// fp32, one CTA per (chunk, bm): every SM takes part, where one CTA per map walking all kv_len
// keys left most of the GPU idle. Each thread adds eight channels of every kLanes-th token.
// Deterministic: fixed per-thread token strides and a fixed reduction order (the quantisation
// kernel adds the chunks in order).
template <typename T, int D>
__global__ void __launch_bounds__(kQuantThreads) key_sum_kernel(const KernelArgs args, float* sums) {
  constexpr int kVectors = D / 8, kLanes = kQuantThreads / kVectors, kWarps = kQuantThreads / 32;
  static_assert(32 % kVectors == 0, "a warp holds whole token lanes");
  DIFFX_SHARED_ARRAY(float, total, D);  // static shared memory stays under kStaticSmemBudget
  const DiffxAttentionParams& p = args.p;
  const int chunk = blockIdx.x, bm = blockIdx.y, b = bm / args.key_maps, km = bm % args.key_maps;
  const int d0 = (threadIdx.x % kVectors) * 8, lane = threadIdx.x / kVectors;
  const int t_end = min(p.kv_len, (chunk + 1) * kKeySumChunk);
  const T* columns = static_cast<const T*>(p.key) + b * p.k_batch_stride + km * D + d0;
  float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int t = chunk * kKeySumChunk + lane; t < t_end; t += kLanes) {
    const KeyVector<T> k = *reinterpret_cast<const KeyVector<T>*>(columns + int64_t(t) * p.k_row_stride);
    for (int j = 0; j < 8; ++j) sum[j] += to_float(k.x[j]);
  }
  // The token lanes of a warp meet by shuffles, then the warps add their sums in warp order.
  for (int o = kVectors; o < 32; o <<= 1)
    for (int j = 0; j < 8; ++j) sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], o);
  const int warp = threadIdx.x / 32;
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w && threadIdx.x % 32 < kVectors)
      for (int j = 0; j < 8; ++j) total[d0 + j] = (w == 0 ? 0.f : total[d0 + j]) + sum[j];
    __syncthreads();
  }
  if (threadIdx.x < D) sums[(int64_t(bm) * args.n_key_chunks + chunk) * D + threadIdx.x] = total[threadIdx.x];
}

// One CTA per (64-token block, b*key_maps + km): absmax of (K - mean) over the block, codes on
// the +-qmax grid (round half to even, clamp), scale = absmax/qmax. Rows past kv_len get code 0.
// Each thread holds kPerThread vectors of eight channels in registers between the two passes.
template <typename T, int D>
__global__ void __launch_bounds__(kQuantThreads) key_quantise_kernel(const KernelArgs args) {
  constexpr int kVectorsPerRow = D / 8, kPerThread = kBlockN * kVectorsPerRow / kQuantThreads;
  static_assert(kBlockN * kVectorsPerRow % kQuantThreads == 0, "whole vectors per thread");
  DIFFX_SHARED_ARRAY(float, reduce, kQuantThreads / 32);
  DIFFX_SHARED_ARRAY(float, mean_s, D);
  const DiffxAttentionParams& p = args.p;
  const int blk = blockIdx.x, bm = blockIdx.y, b = bm / args.key_maps, km = bm % args.key_maps;
  const int t0 = blk * kBlockN;
  const T* base = static_cast<const T*>(p.key) + b * p.k_batch_stride + km * D;
  if (threadIdx.x < D) {
    float mean = 0.f;
    if (args.k_sums) {  // the chunks' sums added in chunk order: the same mean in every CTA
      const float* sums = args.k_sums + int64_t(bm) * args.n_key_chunks * D + threadIdx.x;
      float total = 0.f;
      for (int c = 0; c < args.n_key_chunks; ++c) total += sums[int64_t(c) * D];
      mean = total / float(p.kv_len);
    }
    mean_s[threadIdx.x] = mean;
  }
  __syncthreads();
  // Vector v of this thread: row (v * kQuantThreads + tid) / kVectorsPerRow, so a warp reads
  // whole rows; rows past kv_len are not read and hold zeros.
  float x[kPerThread][8];
  float amax = 0.f;
  for (int v = 0; v < kPerThread; ++v) {
    const int e = v * kQuantThreads + int(threadIdx.x), row = e / kVectorsPerRow, d0 = (e % kVectorsPerRow) * 8;
    if (t0 + row < p.kv_len) {
      const KeyVector<T> k = *reinterpret_cast<const KeyVector<T>*>(base + int64_t(t0 + row) * p.k_row_stride + d0);
      for (int j = 0; j < 8; ++j) {
        x[v][j] = to_float(k.x[j]) - mean_s[d0 + j];
        amax = fmaxf(amax, fabsf(x[v][j]));
      }
    } else {
      for (int j = 0; j < 8; ++j) x[v][j] = 0.f;
    }
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) reduce[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.f;
  for (int w = 0; w < kQuantThreads / 32; ++w) amax = fmaxf(amax, reduce[w]);
  if (!(amax > 0.f)) amax = 1.f;
  const float inv = float(args.qmax) / amax;
  int8_t* codes = const_cast<int8_t*>(args.k_codes) + (int64_t(bm) * args.kv_pad + t0) * D;
  for (int v = 0; v < kPerThread; ++v) {
    const int e = v * kQuantThreads + int(threadIdx.x);
    CodeVector c;
    for (int j = 0; j < 8; ++j)  // rows past kv_len: x is 0, so the code is 0
      c.x[j] = static_cast<int8_t>(max(-args.qmax, min(args.qmax, __float2int_rn(x[v][j] * inv))));
    *reinterpret_cast<CodeVector*>(codes + int64_t(e) * 8) = c;
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
