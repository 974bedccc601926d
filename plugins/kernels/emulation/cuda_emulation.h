// A CPU emulation of the CUDA built-ins and PTX wrappers the kernels use, so the unchanged kernel
// source runs on a CPU (a block's CUDA threads as fibers, fibers.h; in the sanitizer builds an OS
// thread each). It exists to test the kernels' index
// arithmetic, tiling, masking, online softmax and epilogue where no GPU is available; it says
// nothing about speed. Warp collectives (shfl, ldmatrix, mma) follow the PTX ISA's documented
// fragment layouts: each lane publishes its operands, the warp synchronises, each lane computes
// its own results from everybody's operands.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "fibers.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
struct uint2 {
  uint32_t x, y;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

using std::max;
using std::min;

namespace diffx_emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// The barriers of a block and of a warp. By default the block's threads are fibers (fibers.h) and a
// barrier switches between them. The sanitizer builds run an OS thread per CUDA thread: under
// ThreadSanitizer a mutex and condition variable (TSan does not see every happens-before edge of
// libstdc++ 12's tree barrier, std::barrier, so with copies written at their issue it reported a
// read one barrier before another thread's write as a race, which this barrier, around the same
// kernel code, does not); under AddressSanitizer std::barrier, about 11x faster at 256 threads.
#if defined(__SANITIZE_THREAD__)  // GCC's -fsanitize=thread
#define DIFFX_EMU_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)  // clang's
#define DIFFX_EMU_THREAD_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define DIFFX_EMU_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DIFFX_EMU_ADDRESS_SANITIZER 1
#endif
#endif
#ifndef DIFFX_EMU_FIBERS
#if defined(DIFFX_EMU_THREAD_SANITIZER) || defined(DIFFX_EMU_ADDRESS_SANITIZER)
#define DIFFX_EMU_FIBERS 0
#else
#define DIFFX_EMU_FIBERS 1
#endif
#endif
#if DIFFX_EMU_FIBERS
using Barrier = FiberBarrier;
#elif defined(DIFFX_EMU_THREAD_SANITIZER)
class Barrier {
 public:
  explicit Barrier(int threads) : threads_(threads) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t phase = phase_;
    if (++arrived_ == threads_) {
      arrived_ = 0;
      ++phase_;
      all_arrived_.notify_all();
      return;
    }
    all_arrived_.wait(lock, [&] { return phase_ != phase; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  const int threads_;
  int arrived_ = 0;
  uint64_t phase_ = 0;
};
#else
using Barrier = std::barrier<>;
#endif

struct Warp {
  Barrier sync{32};
  uint32_t words[32][12];
  const char* addr[32];
};

struct AlignedFree {
  void operator()(char* p) const { ::operator delete[](p, std::align_val_t(128)); }
};

struct Block {
  // Dynamic shared memory of exactly the launch's size (128-byte aligned, as the kernels assume):
  // under AddressSanitizer one byte past it is a report, as memcheck reports it on a GPU.
  explicit Block(int threads, size_t smem_bytes)
      : sync(threads), dynamic_smem(static_cast<char*>(::operator new[](std::max<size_t>(smem_bytes, 1),
                                                                         std::align_val_t(128)))) {
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back(new Warp());
  }
  Barrier sync;
  std::unique_ptr<char[], AlignedFree> dynamic_smem;
  std::map<std::string, std::vector<char>> statics;
  std::mutex statics_mutex;
  std::vector<std::unique_ptr<Warp>> warps;
  char* smem() { return dynamic_smem.get(); }
  // bar.sync `id`, `threads` (id 0 is __syncthreads'): made at its first use, for that use's count.
  Barrier& named_barrier(int id, int threads) {
    std::lock_guard<std::mutex> lock(named_mutex);
    std::unique_ptr<Barrier>& barrier = named[id];
    if (!barrier) barrier = std::make_unique<Barrier>(threads);
    return *barrier;
  }
  std::unique_ptr<Barrier> named[16];
  std::mutex named_mutex;
};

// cp.async in flight (diffx::cp_async_16 / cp_async_8 below): where it lands, from where (or zeros),
// how many bytes.
struct PendingCopy {
  void* smem;
  const void* gmem;
  bool valid;
  int bytes;
};

// What a CUDA thread has of its own: its indices, its block, its copies in flight.
struct ThreadContext {
  Dim3 thread_idx, block_idx;
  Block* block = nullptr;
  std::vector<PendingCopy> pending_copies;
  std::vector<size_t> group_ends;  // pending_copies' size at each commit
};
#if DIFFX_EMU_FIBERS
inline ThreadContext& ctx() { return *static_cast<ThreadContext*>(t_fiber->user); }  // the running fiber's
#else
inline thread_local ThreadContext t_thread_ctx;
inline ThreadContext& ctx() { return t_thread_ctx; }
#endif

inline int lane() { return int(ctx().thread_idx.x) & 31; }
inline Warp& warp() { return *ctx().block->warps[ctx().thread_idx.x >> 5]; }

template <typename T>
T* block_static(const char* name, size_t count) {
  Block& b = *ctx().block;
  std::lock_guard<std::mutex> lock(b.statics_mutex);
  std::vector<char>& storage = b.statics[name];
  if (storage.empty()) storage.resize(count * sizeof(T) + 16);
  return reinterpret_cast<T*>(storage.data());
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float half_to_float(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return float(h);
}
inline uint16_t float_to_half(float f) {  // round to nearest even (IEEE conversion)
  _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
inline float bf16_to_float(uint16_t bits) { return bits_to_float(uint32_t(bits) << 16); }
inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u = float_to_bits(f);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

}  // namespace diffx_emu

#define threadIdx (diffx_emu::ctx().thread_idx)
#define blockIdx (diffx_emu::ctx().block_idx)
#define DIFFX_DYNAMIC_SHARED(name) char* name = diffx_emu::ctx().block->smem()
#define DIFFX_SHARED_ARRAY(type, name, count) type* name = diffx_emu::block_static<type>(#name, (count))

inline void __syncthreads() { diffx_emu::ctx().block->sync.arrive_and_wait(); }
// The lanes of a warp meet, and what each wrote to memory before is seen by all (every lane takes part here).
inline void __syncwarp(unsigned = 0xffffffffu) { diffx_emu::warp().sync.arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  diffx_emu::Warp& w = diffx_emu::warp();
  const int l = diffx_emu::lane();
  std::memcpy(&w.words[l][0], &value, 4);
  w.sync.arrive_and_wait();
  T other;
  std::memcpy(&other, &w.words[l ^ lane_mask][0], 4);
  w.sync.arrive_and_wait();
  return other;
}

// Warp vote: bit i of the result, in every lane, is lane i's predicate (all 32 lanes take part here).
inline unsigned __ballot_sync(unsigned, bool predicate) {
  diffx_emu::Warp& w = diffx_emu::warp();
  const int l = diffx_emu::lane();
  w.words[l][0] = predicate ? 1u : 0u;
  w.sync.arrive_and_wait();
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i) bits |= (w.words[i][0] != 0u ? 1u : 0u) << i;
  w.sync.arrive_and_wait();
  return bits;
}

// Warp vote: true in every lane when the predicate holds in any lane.
inline bool __any_sync(unsigned mask, bool predicate) { return __ballot_sync(mask, predicate) != 0u; }

inline int __float2int_rn(float x) { return int(std::nearbyint(x)); }  // default rounding: half to even
inline float __int2float_rn(int x) { return float(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

namespace diffx {

// cp.async lands at some time between the issue and the thread's cp.async.wait_all.
// g_copies_land (DIFFX_EMULATOR_COPIES_LAND, read at each launch by emulator.cpp) picks the moment
// the emulator writes it:
// 0 (default): the latest, the wait. The copy is queued and done there, so shared memory read before
//   its wait (or by another thread not ordered after that wait by a barrier) holds stale bytes, which
//   the numerics tests see and ThreadSanitizer reports as a race (sanitize_cases.cpp).
// 1: the earliest, the issue. A stage refilled while a read still wants its old bytes then gives
//   wrong numbers, even where a barrier orders that read after the issue.
// 2: both (the ThreadSanitizer runs): a copy into a tile that another thread may still be reading
//   (no barrier orders that read before the issue) is a reported race too, whenever the hardware
//   lands it.
inline int g_copies_land = 0;  // set before a launch's threads start
using diffx_emu::PendingCopy;

inline void cp_async_write(const PendingCopy& c) {
  if (c.valid) {
    std::memcpy(c.smem, c.gmem, size_t(c.bytes));
  } else {
    std::memset(c.smem, 0, size_t(c.bytes));
  }
}
inline void cp_async_bytes(void* smem, const void* gmem, bool valid, int bytes) {
  if (g_copies_land != 0) cp_async_write({smem, gmem, valid, bytes});
  diffx_emu::ctx().pending_copies.push_back({smem, gmem, valid, bytes});
}
inline void cp_async_16(void* smem, const void* gmem, bool valid) { cp_async_bytes(smem, gmem, valid, 16); }
inline void cp_async_8(void* smem, const void* gmem, bool valid) { cp_async_bytes(smem, gmem, valid, 8); }
inline void cp_async_commit() {
  diffx_emu::ThreadContext& c = diffx_emu::ctx();
  c.group_ends.push_back(c.pending_copies.size());
}

// bar.sync id, THREADS: the THREADS threads (whole warps) that name barrier `id` (1-15) meet.
template <int THREADS>
inline void named_barrier_sync(int id) {
  diffx_emu::ctx().block->named_barrier(id, THREADS).arrive_and_wait();
}
// Lands the first `count` pending copies (the oldest), in issue order.
inline void cp_async_land(size_t count) {
  std::vector<PendingCopy>& pending = diffx_emu::ctx().pending_copies;
  if (g_copies_land != 1)
    for (size_t i = 0; i < count; ++i) cp_async_write(pending[i]);
  pending.erase(pending.begin(), pending.begin() + long(count));
}
inline void cp_async_wait_all() {
  cp_async_land(diffx_emu::ctx().pending_copies.size());
  diffx_emu::ctx().group_ends.clear();
}
// The latest moment again: the N newest committed groups (and uncommitted copies) stay pending.
template <int N>
inline void cp_async_wait_group() {
  std::vector<size_t>& group_ends = diffx_emu::ctx().group_ends;
  if (group_ends.size() <= size_t(N)) return;
  const size_t done_groups = group_ends.size() - size_t(N);
  const size_t landed = group_ends[done_groups - 1];
  cp_async_land(landed);
  group_ends.erase(group_ends.begin(), group_ends.begin() + long(done_groups));
  for (size_t& end : group_ends) end -= landed;
}

inline uint32_t load_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint32_t load_u16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ldmatrix .x4: lane l supplies the address of row (l % 8) of matrix l / 8; register i of lane l
// receives row l/4 of matrix i, 16-bit columns 2*(l%4) and 2*(l%4)+1.
inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  diffx_emu::Warp& w = diffx_emu::warp();
  const int l = diffx_emu::lane();
  w.addr[l] = static_cast<const char*>(smem);
  w.sync.arrive_and_wait();
  for (int i = 0; i < 4; ++i) r[i] = load_u32(w.addr[8 * i + l / 4] + (l % 4) * 4);
  w.sync.arrive_and_wait();
}
// .trans: register i of lane l receives column l/4 of matrix i, rows 2*(l%4) (low half) and 2*(l%4)+1.
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  diffx_emu::Warp& w = diffx_emu::warp();
  const int l = diffx_emu::lane();
  w.addr[l] = static_cast<const char*>(smem);
  w.sync.arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = load_u16(w.addr[8 * i + 2 * (l % 4)] + (l / 4) * 2);
    const uint32_t hi = load_u16(w.addr[8 * i + 2 * (l % 4) + 1] + (l / 4) * 2);
    r[i] = lo | (hi << 16);
  }
  w.sync.arrive_and_wait();
}

inline float elem16(uint32_t word, int half, __half) { return diffx_emu::half_to_float(uint16_t(word >> (16 * half))); }
inline float elem16(uint32_t word, int half, __nv_bfloat16) {
  return diffx_emu::bf16_to_float(uint16_t(word >> (16 * half)));
}

// mma m16n8k16 row.col, fp32 accumulate. Fragments (g = lane/4, t = lane%4):
// A: a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
// B: b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g];  C/D: c0,c1 = C[g][2t..], c2,c3 = C[g+8][2t..]
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, T tag) {
  diffx_emu::Warp& w = diffx_emu::warp();
  const int l = diffx_emu::lane();
  for (int i = 0; i < 4; ++i) w.words[l][i] = a[i];
  w.words[l][4] = b0;
  w.words[l][5] = b1;
  w.sync.arrive_and_wait();
  float A[16][16], B[16][8];
  for (int src = 0; src < 32; ++src) {
    const int g = src / 4, t = src % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = elem16(w.words[src][0], h, tag);
      A[g + 8][2 * t + h] = elem16(w.words[src][1], h, tag);
      A[g][2 * t + 8 + h] = elem16(w.words[src][2], h, tag);
      A[g + 8][2 * t + 8 + h] = elem16(w.words[src][3], h, tag);
      B[2 * t + h][g] = elem16(w.words[src][4], h, tag);
      B[2 * t + 8 + h][g] = elem16(w.words[src][5], h, tag);
    }
  }
  w.sync.arrive_and_wait();
  const int g = l / 4, t = l % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    d[e] = acc;
  }
}

// mma m16n8k32 s8: a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][4t+16..], a3 = A[g+8][4t+16..];
// b0 = B[4t..4t+3][g], b1 = B[4t+16..4t+19][g]; int32 C/D as above.
inline void mma_16832_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  diffx_emu::Warp& w = diffx_emu::warp();
  const int l = diffx_emu::lane();
  for (int i = 0; i < 4; ++i) w.words[l][i] = a[i];
  w.words[l][4] = b0;
  w.words[l][5] = b1;
  w.sync.arrive_and_wait();
  int A[16][32], B[32][8];
  auto byte = [](uint32_t word, int i) { return int(int8_t(uint8_t(word >> (8 * i)))); };
  for (int src = 0; src < 32; ++src) {
    const int g = src / 4, t = src % 4;
    for (int i = 0; i < 4; ++i) {
      A[g][4 * t + i] = byte(w.words[src][0], i);
      A[g + 8][4 * t + i] = byte(w.words[src][1], i);
      A[g][4 * t + 16 + i] = byte(w.words[src][2], i);
      A[g + 8][4 * t + 16 + i] = byte(w.words[src][3], i);
      B[4 * t + i][g] = byte(w.words[src][4], i);
      B[4 * t + 16 + i][g] = byte(w.words[src][5], i);
    }
  }
  w.sync.arrive_and_wait();
  const int g = l / 4, t = l % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
    int acc = d[e];
    for (int k = 0; k < 32; ++k) acc += A[row][k] * B[k][col];
    d[e] = acc;
  }
}

inline uint32_t pack2(float lo, float hi, __half) {
  return uint32_t(diffx_emu::float_to_half(lo)) | (uint32_t(diffx_emu::float_to_half(hi)) << 16);
}
inline uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  return uint32_t(diffx_emu::float_to_bf16(lo)) | (uint32_t(diffx_emu::float_to_bf16(hi)) << 16);
}
// The emulator runs a launch's grids one after the other: every dependent grid starts after its
// prior grid has finished.
inline void launch_dependent_grids() {}
inline void wait_for_prior_grids() {}
// ex2.approx.ftz: the GPU's result is within 2 ulp of 2^x and flushes subnormals; exact 2^x here.
inline float fast_exp2(float x) {
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}
inline float to_float(__half x) { return diffx_emu::half_to_float(x.bits); }
inline __half __float2half_rn(float v) { return __half{diffx_emu::float_to_half(v)}; }
inline float to_float(__nv_bfloat16 x) { return diffx_emu::bf16_to_float(x.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return __nv_bfloat16{diffx_emu::float_to_bf16(v)}; }

}  // namespace diffx
