// Which keys of a tile a warp may attend to, as bits: read by the one-pass kernel, the split-KV
// decode kernels and the Hopper path, whose masked blocks test these bits per score element.
#pragma once

#include <stdint.h>

#include <type_traits>

#include "ptx.cuh"

namespace diffx {

// Key j of a tile (key_of(j), j < KEYS) is present when it lies before `end` and key_mask (null:
// none) holds a nonzero flag there. key_flags is a lane's load of the flags of keys lane,
// lane + 32, ..., issued right after the tile's Q.K so that its latency hides behind the tensor
// work; present_keys turns them into bit j with one ballot per 32 keys. Every KV-cache decoder
// passes key_mask (op version 2), so each tile of a deployed prefill and each step of its decode is
// a masked one: loading one int64 flag per score element instead cost a dependent LDG.E.64 each
// (sm_90a: 16 a warp's decode step, 32 a tile of the one-pass kernel, 64 a thread's 128-key tile
// on the Hopper path). A tile whose keys are all present skips its masked block unless the causal
// diagonal crosses it.
template <int KEYS>
struct KeyFlags {
  static_assert(KEYS == 16 || KEYS == 32 || KEYS == 64 || KEYS == 128, "a warp's 16, 32, 64 or 128 keys");
  static constexpr int kLoads = (KEYS + 31) / 32;
  // bit j: key j present
  using Bits = std::conditional_t<(KEYS > 64), unsigned __int128, std::conditional_t<(KEYS > 32), uint64_t, uint32_t>>;
  static constexpr Bits kAll = ~Bits(0) >> (8 * sizeof(Bits) - KEYS);
  int64_t flag[kLoads];
};
template <int KEYS, typename KeyOf>
__device__ __forceinline__ KeyFlags<KEYS> key_flags(const int64_t* mask_row, int end, int lane, KeyOf key_of) {
  KeyFlags<KEYS> f;
#pragma unroll
  for (int h = 0; h < KeyFlags<KEYS>::kLoads; ++h) {
    const int j = 32 * h + lane, key = key_of(j);
    const bool in_range = (KEYS >= 32 || j < KEYS) && key < end;
    f.flag[h] = !in_range ? 0 : mask_row ? mask_row[key] : 1;
  }
  return f;
}
template <int KEYS>
__device__ __forceinline__ typename KeyFlags<KEYS>::Bits present_keys(const KeyFlags<KEYS>& f) {
  using Bits = typename KeyFlags<KEYS>::Bits;
  Bits bits = 0;
#pragma unroll
  for (int h = 0; h < KeyFlags<KEYS>::kLoads; ++h)
    bits |= Bits(__ballot_sync(0xffffffffu, f.flag[h] != 0)) << (32 * h);
  return bits & KeyFlags<KEYS>::kAll;
}

}  // namespace diffx
