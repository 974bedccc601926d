// The fused differential-attention forward kernel (one pass, two online softmaxes).
//
// One CTA = one block of 64 query tokens of one diff-head of one batch element, 8 warps:
// warps 0-3 run map 1 (softmax(Q1 K1^T) V), warps 4-7 run map 2 (softmax(Q2 K2^T) V), 16 query
// rows per warp. Both halves walk the same key tiles, so every K/V tile is read from global
// memory once per CTA and V is shared by both maps; each half keeps its own running max, sum
// and fp32 P.V accumulator (the two softmaxes cannot share them). The epilogue combines
// O1/l1 - lambda * O2/l2 through shared memory, applies the per-head RMSNorm, the weight and the
// output scale, and writes the output once. Tensor cores: mma.sync m16n8k16 (fp16/bf16) for
// Q.K^T and P.V, m16n8k32 s8 for the INT8-logits variant (Q quantised here per 64-token block,
// K pre-quantised per 64-token tile by quantize_keys.cuh). Schedule as in FlashAttention-2:
// the V tile loads while Q.K^T runs, the next K tile loads while P.V runs.
#pragma once

#include <math.h>

#include "diff_attention.h"
#include "kernel_args.h"
#include "key_flags.cuh"
#include "ptx.cuh"

namespace diffx {

constexpr int kBlockM = DIFFX_QUERY_BLOCK;
constexpr int kBlockN = DIFFX_KEY_BLOCK;
constexpr int kWarpsPerMap = 4;
constexpr int kThreads = 2 * kWarpsPerMap * 32;
constexpr float kLog2e = 1.4426950408889634f;
// The smallest per-block shared memory among the mma.sync targets: sm_86 and sm_89 (RTX 30xx/40xx,
// A10, L4) allow 99 KB, static shared memory included; sm_80, sm_87 and sm_90 allow 163-227 KB.
// The kernels' static shared memory stays under kStaticSmemBudget (tests/test_kernel_build.py reads
// it from the binary), so a dynamic size within kDynamicSmemLimit launches on every target.
constexpr int kStaticSmemBudget = 2048;
constexpr int kDynamicSmemLimit = 99 * 1024 - kStaticSmemBudget;

template <typename T, int D, int DV, bool INT8>
struct TileConfig {
  static constexpr bool kV1 = (DV == 2 * D);  // V1: two key maps and V of 2D; V2: one shared K/V of D
  static constexpr int kKeyTiles = kV1 ? 2 : 1;
  static constexpr int kQTileBytes = kBlockM * D * int(sizeof(T));   // one map, fp16/bf16
  static constexpr int kQ8TileBytes = INT8 ? kBlockM * D : 0;         // one map, int8 codes
  static constexpr int kKTileBytes = kBlockN * D * (INT8 ? 1 : int(sizeof(T)));
  static constexpr int kVTileBytes = kBlockN * DV * int(sizeof(T));
  static constexpr int kMainBytes = 2 * kQTileBytes + 2 * kQ8TileBytes + kKeyTiles * kKTileBytes + kVTileBytes;
  // Floats per row of the epilogue scratch. Rows are written and read as float2 by a warp's 8 row
  // groups x 4 column pairs; a stride of 8 (mod 32) words puts each half-warp's 16 float2 in 16
  // distinct bank pairs (DV + 4 gave 4-way conflicts, seen in Nsight Compute on H100).
  static constexpr int kScratchStride = DV + 8;
  static constexpr int kScratchBytes = kBlockM * kScratchStride * int(sizeof(float));
  static constexpr int kSmemBytes = kMainBytes > kScratchBytes ? kMainBytes : kScratchBytes;
  static_assert(kSmemBytes <= kDynamicSmemLimit, "the one-pass tiles would not launch on sm_86/sm_89");
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(DV == D || DV == 2 * D, "V of D (V2) or 2D (V1)");
};

// Copies a ROWS x ROW_BYTES tile (global row r at gmem + r*row_stride_bytes) into a swizzled
// shared tile; rows >= valid_rows are zero-filled and never read from global memory.
// Each thread owns one 16-byte column chunk and every kRowStep-th row: a fixed trip count, and
// since kRowStep is a multiple of 8 the swizzle (row & 7) is the same for all of a thread's rows,
// so the shared offset is one base plus a constant step (no per-chunk division or swizzle).
template <int ROWS, int ROW_BYTES>
__device__ __forceinline__ void load_tile_async(char* smem, const char* gmem, int64_t row_stride_bytes,
                                                int valid_rows, int tid) {
  constexpr int kChunks = ROW_BYTES / 16;
  static_assert(kThreads % kChunks == 0, "a thread keeps one chunk column");
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kRowStep % 8 == 0 && ROWS % kRowStep == 0, "fixed trip count, one swizzle per thread");
  const int row0 = tid / kChunks, chunk = tid % kChunks;
  char* dst = smem + swizzled_chunk<kChunks>(row0, chunk) * 16;
  const char* src = gmem + row0 * row_stride_bytes + chunk * 16;
#pragma unroll
  for (int i = 0; i < ROWS / kRowStep; ++i) {
    const bool valid = row0 + i * kRowStep < valid_rows;
    cp_async_16(dst + i * kRowStep * ROW_BYTES, valid ? src + i * kRowStep * row_stride_bytes : gmem, valid);
  }
}

// Key tile nb of kv-group g (V1: K1 and K2, V2: the shared K; INT8: the pre-quantised codes) and
// value tile nb into their shared tiles; rows past kv_len are zero-filled. Shared by the one-pass
// and the split-KV decode kernels.
template <typename T, int D, int DV, bool INT8>
__device__ __forceinline__ void load_key_tiles(char* sK, const KernelArgs& args, int b, int g, int nb, int tid) {
  using Cfg = TileConfig<T, D, DV, INT8>;
  const DiffxAttentionParams& p = args.p;
  const int n_start = nb * kBlockN;
#pragma unroll
  for (int m = 0; m < Cfg::kKeyTiles; ++m) {
    const int km = Cfg::kV1 ? 2 * g + m : g;  // key head in the key tensor
    if constexpr (INT8) {
      const int8_t* src = args.k_codes + ((int64_t(b) * args.key_maps + km) * args.kv_pad + n_start) * D;
      load_tile_async<kBlockN, D>(sK + m * Cfg::kKTileBytes, reinterpret_cast<const char*>(src), D, kBlockN, tid);
    } else {
      const T* src = static_cast<const T*>(p.key) + b * p.k_batch_stride + int64_t(n_start) * p.k_row_stride + km * D;
      load_tile_async<kBlockN, D * sizeof(T)>(sK + m * Cfg::kKTileBytes, reinterpret_cast<const char*>(src),
                                              p.k_row_stride * int64_t(sizeof(T)), p.kv_len - n_start, tid);
    }
  }
}

template <typename T, int DV>
__device__ __forceinline__ void load_value_tile(char* sV, const KernelArgs& args, int b, int g, int nb, int tid) {
  const DiffxAttentionParams& p = args.p;
  const int n_start = nb * kBlockN;
  const T* src = static_cast<const T*>(p.value) + b * p.v_batch_stride + int64_t(n_start) * p.v_row_stride + g * DV;
  load_tile_async<kBlockN, DV * sizeof(T)>(sV, reinterpret_cast<const char*>(src), p.v_row_stride * int64_t(sizeof(T)),
                                           p.kv_len - n_start, tid);
}

// Quantises this map's Q tile (ROWS tokens, fp16/bf16, swizzled) to int8 codes exactly as
// diffexport/core/quantization.py does: one absmax over the block's tokens x D channels (padding
// rows are zeros), inv = qmax/absmax, code = clamp(rint(x*inv)), scale = absmax/qmax.
// All 256 threads call it (it synchronises); each half of the CTA handles its own map.
// ROWS = 64 (one-pass kernel) or 16 (decode: every query token of the call is in the first block).
template <typename T, int D, int ROWS = kBlockM>
__device__ float quantise_q_tile(const char* q_tile, char* q8_tile, int qmax, float* reduce, int tid, int map) {
  constexpr int kChunks = D / 8;     // 16-byte chunks of 8 elements per fp row
  constexpr int kChunks8 = D / 16;   // 16-byte chunks per int8 row
  const int t = tid % (kWarpsPerMap * 32);
  float amax = 0.f;
  for (int c = t; c < ROWS * kChunks; c += kWarpsPerMap * 32) {
    const T* e = reinterpret_cast<const T*>(q_tile + swizzled_chunk<kChunks>(c / kChunks, c % kChunks) * 16);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(to_float(e[i])));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((tid & 31) == 0) reduce[tid >> 5] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < kWarpsPerMap; ++w) amax = fmaxf(amax, reduce[map * kWarpsPerMap + w]);
  if (!(amax > 0.f)) amax = 1.f;  // all-zero block: codes are 0 whatever the scale
  const float inv = float(qmax) / amax;
  for (int c = t; c < ROWS * kChunks; c += kWarpsPerMap * 32) {
    const int row = c / kChunks, chunk = c % kChunks;
    const T* e = reinterpret_cast<const T*>(q_tile + swizzled_chunk<kChunks>(row, chunk) * 16);
    uint32_t packed[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int code = max(-qmax, min(qmax, __float2int_rn(to_float(e[i]) * inv)));
      packed[i / 4] |= (uint32_t(code) & 0xffu) << (8 * (i % 4));
    }
    *reinterpret_cast<uint2*>(q8_tile + swizzled_chunk<kChunks8>(row, chunk / 2) * 16 + (chunk % 2) * 8) =
        make_uint2(packed[0], packed[1]);
  }
  __syncthreads();
  return amax / float(qmax);
}

// One key tile's online softmax update of a warp's state for its rows gq and gq + 8: the row
// maxima over the tile (raw logit units, reduced over the quad), the scores turned into
// probabilities in place, p = 2^(s*c - max*c) with c the logit scale in log2 units folded into one
// FFMA before ex2, the running sums rescaled and extended, and the P.V accumulator rescaled.
// A max that did not grow rescales by exactly 1, and once the maxima settle most tiles leave every
// row's max in place, so the accumulator rescale (the bulk of the loop's FP32 work) is skipped when
// the whole warp agrees; a row with nothing visible yet stays at 0. Shared by the one-pass and the
// split-KV decode kernels (S_TILES n-tiles of 8 keys, O_TILES n-tiles of 8 output channels).
template <int S_TILES, int O_TILES>
__device__ __forceinline__ void online_softmax_step(float (&s)[S_TILES][4], float (&acc_o)[O_TILES][4],
                                                    float (&row_max)[2], float (&row_sum)[2], float scale_log2) {
  float alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int i = 0; i < S_TILES; ++i) mx = fmaxf(mx, fmaxf(s[i][2 * r], s[i][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    alpha[r] = mx == row_max[r] ? 1.f : fast_exp2((row_max[r] - mx) * scale_log2);
    const float neg_max = (mx == -INFINITY) ? 0.f : -mx * scale_log2;
    row_max[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < S_TILES; ++i) {
      s[i][2 * r] = fast_exp2(fmaf(s[i][2 * r], scale_log2, neg_max));
      s[i][2 * r + 1] = fast_exp2(fmaf(s[i][2 * r + 1], scale_log2, neg_max));
      sum += s[i][2 * r] + s[i][2 * r + 1];
    }
    row_sum[r] = row_sum[r] * alpha[r] + sum;
  }
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int i = 0; i < O_TILES; ++i) {
      acc_o[i][0] *= alpha[0];
      acc_o[i][1] *= alpha[0];
      acc_o[i][2] *= alpha[1];
      acc_o[i][3] *= alpha[1];
    }
  }
}

// Head dim 64 could run two CTAs per SM (at most 128 registers a thread, under half the shared
// memory), hiding one CTA's barriers and epilogue behind the other's matrix work. Under that cap
// ptxas spills (V1 fp: 208-byte stack frame for sm_90a), so the default stays at one CTA until a
// GPU run times both: build with -DDIFFX_D64_MIN_BLOCKS=2 (tools/gpu_campaign.sh variants).
// Head dim 128 needs its registers (a 16 x 2D fp32 accumulator a warp) and stays at one.
#ifndef DIFFX_D64_MIN_BLOCKS
#define DIFFX_D64_MIN_BLOCKS 1
#endif
template <int D>
constexpr int kMinBlocksPerSM = D == 64 ? DIFFX_D64_MIN_BLOCKS : 1;

// Grid: x = query block counted from the last one, y = diff-head, z = batch element. CTAs start
// in x, y, z order, so the CTAs resident at one time are the query blocks of one or two heads and
// share their K/V in L2 (with the head first, they were blocks of every head and each read its
// head's K/V from DRAM again). Within a head the last query blocks (under a causal mask, the ones
// that see the most keys) start first and the short ones fill the tail.
inline void attention_grid(const DiffxAttentionParams& p, unsigned (&dims)[3]) {
  dims[0] = unsigned((p.q_len + kBlockM - 1) / kBlockM);
  dims[1] = unsigned(p.num_heads);
  dims[2] = unsigned(p.batch);
}

template <typename T, int D, int DV, bool INT8>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM<D>) diff_attention_fwd_kernel(const KernelArgs args) {
  using Cfg = TileConfig<T, D, DV, INT8>;
  constexpr int kSTiles = kBlockN / 8;  // n-tiles of the 16 x 64 score tile of a warp
  constexpr int kOTiles = DV / 8;       // n-tiles of the 16 x DV output accumulator of a warp
  DIFFX_DYNAMIC_SHARED(smem);
  DIFFX_SHARED_ARRAY(float, reduce, 2 * kWarpsPerMap);

  const DiffxAttentionParams& p = args.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int map = warp / kWarpsPerMap;             // 0: map 1, 1: map 2 (warp-uniform)
  const int wrow = (warp % kWarpsPerMap) * 16;     // this warp's first row in the query block
  const int gq = lane >> 2, tq = lane & 3;         // mma fragment coordinates (row group, column pair)
  const int m_blocks = (p.q_len + kBlockM - 1) / kBlockM;
  const int m_start = (m_blocks - 1 - int(blockIdx.x)) * kBlockM, h = blockIdx.y, b = blockIdx.z;
  const int g = h / (p.num_heads / p.num_kv_heads);
  const int q_rows = min(kBlockM, p.q_len - m_start);
  const int64_t esz = sizeof(T);

  char* sQ = smem;                                   // [2][BM][D] T
  char* sQ8 = sQ + 2 * Cfg::kQTileBytes;             // [2][BM][D] int8 (INT8 only)
  char* sK = sQ8 + 2 * Cfg::kQ8TileBytes;            // [kKeyTiles][BN][D] T or int8
  char* sV = sK + Cfg::kKeyTiles * Cfg::kKTileBytes; // [BN][DV] T

  // Key tiles this query block needs (causal: up to its last row's last visible key).
  const int n_total = (p.kv_len + kBlockN - 1) / kBlockN;
  int n_end = n_total;
  if (p.causal) {
    const int last_key = m_start + q_rows - 1 + p.kv_len - p.q_len;
    n_end = last_key < 0 ? 0 : min(n_total, last_key / kBlockN + 1);
  }

  const T* q_block = static_cast<const T*>(p.query) + b * p.q_batch_stride + int64_t(m_start) * p.q_row_stride;
  for (int m = 0; m < 2; ++m) {
    load_tile_async<kBlockM, D * sizeof(T)>(sQ + m * Cfg::kQTileBytes,
                                            reinterpret_cast<const char*>(q_block + (2 * h + m) * D),
                                            p.q_row_stride * esz, q_rows, tid);
  }
  auto load_k = [&](int nb) { load_key_tiles<T, D, DV, INT8>(sK, args, b, g, nb, tid); };
  auto load_v = [&](int nb) { load_value_tile<T, DV>(sV, args, b, g, nb, tid); };

  if (n_end > 0) load_k(0);
  cp_async_commit();

  float q_scale = 1.f;
  if constexpr (INT8) {
    cp_async_wait_all();
    __syncthreads();
    q_scale = quantise_q_tile<T, D>(sQ + map * Cfg::kQTileBytes, sQ8 + map * Cfg::kQ8TileBytes, args.qmax, reduce,
                                    tid, map);
  }
  // Logits stay in raw units (the running max too); the logit scale, in log2 units, is folded
  // into the one FFMA before ex2: p = 2^(s*c - max*c).
  const float scale_log2 = args.scale * kLog2e;
  const int key_head = Cfg::kV1 ? 2 * g + map : g;

  float acc_o[kOTiles][4];
#pragma unroll
  for (int i = 0; i < kOTiles; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // per-thread partial sums; the quad is reduced in the epilogue

  // Padding keys (key_mask) and the last key each of this lane's rows (wrow + gq, + 8) sees under
  // the causal mask: bottom-right, query m sees up to kv_len - q_len + m.
  const int64_t* mask_row = p.key_mask ? p.key_mask + b * p.mask_batch_stride : nullptr;
  int last_key[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) last_key[r] = m_start + wrow + gq + 8 * r + p.kv_len - p.q_len;

  for (int nb = 0; nb < n_end; ++nb) {
    const int n_start = nb * kBlockN;
    // This tile's key flags, loaded before its Q.K (key_flags: a lane the tile's keys lane and lane + 32).
    const KeyFlags<kBlockN> flags = key_flags<kBlockN>(mask_row, p.kv_len, lane, [&](int j) { return n_start + j; });
    cp_async_wait_all();  // K(nb) (and Q) landed
    __syncthreads();      // ... for every thread, and everyone finished P.V of the previous V tile
    load_v(nb);
    cp_async_commit();

    // S = Q K^T for this warp's 16 rows and the tile's 64 keys, in log2 units.
    float s[kSTiles][4];
#pragma unroll
    for (int i = 0; i < kSTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    if constexpr (INT8) {
      constexpr int kChunks8 = D / 16;
      const char* q_tile = sQ8 + map * Cfg::kQ8TileBytes;
      const char* k_tile = sK + (Cfg::kV1 ? map : 0) * Cfg::kKTileBytes;
      int si[kSTiles][4];
#pragma unroll
      for (int i = 0; i < kSTiles; ++i) si[i][0] = si[i][1] = si[i][2] = si[i][3] = 0;
#pragma unroll
      for (int ks = 0; ks < D / 32; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, q_tile + swizzled_chunk<kChunks8>(wrow + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                         ks * 2 + (lane >> 4)) * 16);
#pragma unroll
        for (int np = 0; np < kSTiles / 2; ++np) {
          const int mi = lane >> 3;
          uint32_t bf[4];
          ldmatrix_x4(bf, k_tile + swizzled_chunk<kChunks8>(np * 16 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1)) * 16);
          mma_16832_s8(si[2 * np], a, bf[0], bf[1]);
          mma_16832_s8(si[2 * np + 1], a, bf[2], bf[3]);
        }
      }
      // Dequantise as the reference does: fp32(integer sum) * (scale_q * scale_k); the logit
      // scale comes with the softmax's FFMA.
      const float qk_scale = q_scale * args.k_scales[(int64_t(b) * args.key_maps + key_head) * args.n_kv_blocks + nb];
#pragma unroll
      for (int i = 0; i < kSTiles; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] = __int2float_rn(si[i][e]) * qk_scale;
    } else {
      constexpr int kChunks = D / 8;
      const char* q_tile = sQ + map * Cfg::kQTileBytes;
      const char* k_tile = sK + (Cfg::kV1 ? map : 0) * Cfg::kKTileBytes;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, q_tile + swizzled_chunk<kChunks>(wrow + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                        ks * 2 + (lane >> 4)) * 16);
#pragma unroll
        for (int np = 0; np < kSTiles / 2; ++np) {
          const int mi = lane >> 3;
          uint32_t bf[4];
          ldmatrix_x4(bf, k_tile + swizzled_chunk<kChunks>(np * 16 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1)) * 16);
          mma_16816(s[2 * np], a, bf[0], bf[1], T());
          mma_16816(s[2 * np + 1], a, bf[2], bf[3], T());
        }
      }
    }

    // Mask keys past the end, for causal keys after the bottom-right diagonal, and padding keys.
    const bool edge = n_start + kBlockN > p.kv_len;
    const bool diagonal = p.causal && n_start + kBlockN - 1 > m_start + p.kv_len - p.q_len;
    const uint64_t present = mask_row || edge ? present_keys(flags) : KeyFlags<kBlockN>::kAll;
    if (diagonal || present != KeyFlags<kBlockN>::kAll) {
      const uint64_t mine = present >> (tq * 2);  // bit c: this lane's key i * 8 + c, as below
#pragma unroll
      for (int i = 0; i < kSTiles; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = i * 8 + (e & 1);  // the key's place in the tile, less tq * 2
          const bool visible = ((mine >> c) & 1) && (!p.causal || n_start + c + tq * 2 <= last_key[e >> 1]);
          if (!visible) s[i][e] = -INFINITY;
        }
    }

    cp_async_wait_all();  // V(nb) landed
    __syncthreads();      // ... for every thread, and everyone finished reading K(nb)
    if (nb + 1 < n_end) {
      load_k(nb + 1);
      cp_async_commit();
    }

    online_softmax_step(s, acc_o, row_max, row_sum, scale_log2);

    // O += P V: the score fragment becomes the A operand directly (FlashAttention-2 layout trick).
    constexpr int kVChunks = DV / 8;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack2(s[2 * kk][0], s[2 * kk][1], T());
      a[1] = pack2(s[2 * kk][2], s[2 * kk][3], T());
      a[2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T());
      a[3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T());
#pragma unroll
      for (int np = 0; np < kOTiles / 2; ++np) {
        const int mi = lane >> 3;
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, sV + swizzled_chunk<kVChunks>(kk * 16 + (mi & 1) * 8 + (lane & 7), np * 2 + (mi >> 1)) * 16);
        mma_16816(acc_o[2 * np], a, bf[0], bf[1], T());
        mma_16816(acc_o[2 * np + 1], a, bf[2], bf[3], T());
      }
    }
  }

  // Epilogue: out = norm(O1/l1 - lambda * O2/l2) * weight * output_scale, written once.
  float inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv_l[r] = l > 0.f ? 1.f / l : 0.f;  // no visible key: output 0, never NaN
  }
  cp_async_wait_all();
  __syncthreads();  // all tiles consumed: the shared memory becomes the map-2 scratch
  float* scratch = reinterpret_cast<float*>(smem);
  if (map == 1) {
#pragma unroll
    for (int i = 0; i < kOTiles; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = wrow + gq + r * 8, col = i * 8 + tq * 2;
        *reinterpret_cast<float2*>(scratch + row * Cfg::kScratchStride + col) =
            make_float2(acc_o[i][2 * r] * inv_l[r], acc_o[i][2 * r + 1] * inv_l[r]);
      }
  }
  __syncthreads();
  if (map == 0) {
    const T* lambda = static_cast<const T*>(p.lambda_full);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wrow + gq + r * 8;
      const int qi = m_start + row;
      float lam = 0.f;
      if constexpr (Cfg::kV1) {
        lam = to_float(lambda[0]);  // one lambda per layer
      } else if (qi < p.q_len) {    // V2: one lambda per token and diff-head
        lam = to_float(lambda[b * p.lambda_batch_stride + int64_t(qi) * p.lambda_row_stride + h * p.lambda_head_stride]);
      }
      float sumsq = 0.f;
#pragma unroll
      for (int i = 0; i < kOTiles; ++i) {
        const float2 o2 = *reinterpret_cast<const float2*>(scratch + row * Cfg::kScratchStride + i * 8 + tq * 2);
        const float o0 = acc_o[i][2 * r] * inv_l[r] - lam * o2.x;
        const float o1 = acc_o[i][2 * r + 1] * inv_l[r] - lam * o2.y;
        acc_o[i][2 * r] = o0;
        acc_o[i][2 * r + 1] = o1;
        sumsq += o0 * o0 + o1 * o1;
      }
      sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 1);
      sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 2);
      const float rms = p.norm ? rsqrtf(sumsq / float(DV) + p.norm_eps) : 1.f;
      if (qi < p.q_len) {
        T* out = static_cast<T*>(p.output) + b * p.o_batch_stride + int64_t(qi) * p.o_row_stride + h * DV;
#pragma unroll
        for (int i = 0; i < kOTiles; ++i) {
          const int col = i * 8 + tq * 2;
          const float y0 = acc_o[i][2 * r] * rms * p.norm_weight[col] * p.output_scale;
          const float y1 = acc_o[i][2 * r + 1] * rms * p.norm_weight[col + 1] * p.output_scale;
          *reinterpret_cast<uint32_t*>(out + col) = pack2(y0, y1, T());
        }
      }
    }
  }
}

#ifndef DIFFX_EMULATE
template <typename T, int D, int DV, bool INT8>
cudaError_t launch_diff_attention(const KernelArgs& args, cudaStream_t stream) {
  using Cfg = TileConfig<T, D, DV, INT8>;
  const auto kernel = diff_attention_fwd_kernel<T, D, DV, INT8>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  unsigned dims[3];
  attention_grid(args.p, dims);
  kernel<<<dim3(dims[0], dims[1], dims[2]), kThreads, Cfg::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

#endif  // DIFFX_EMULATE

}  // namespace diffx
