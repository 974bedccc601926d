// Host-side preparation shared by the CUDA launcher and the CPU emulator: the parameter checks,
// the workspace layout and the kernel's resolved arguments. Plain C++ (no CUDA headers).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "diff_attention.h"

namespace diffx {

// K-smoothing sums keys in chunks of this many tokens, one CTA each (then a fixed-order total).
constexpr int kKeySumChunk = 1024;

// Launch arguments resolved on the host from DiffxAttentionParams.
struct KernelArgs {
  DiffxAttentionParams p;
  float scale;            // effective logit scale
  int key_maps;           // key heads in the key tensor: 2*Hkv (V1) or Hkv (V2)
  int kv_pad;             // kv_len rounded up to the key tile (rows of the quantised K)
  int n_kv_blocks;        // kv_pad / key tile
  int qmax;               // 2^(logit_bits-1) - 1 for the INT8 variant
  const int8_t* k_codes;  // [B*key_maps, kv_pad, D] (workspace), null unless INT8
  const float* k_scales;  // [B*key_maps, n_kv_blocks]
  const float* k_sums;    // [B*key_maps, key chunks, D] partial K sums, or null (no K-smoothing)
  int n_key_chunks;       // kv_len in chunks of kKeySumChunk tokens (the sums' middle dimension)
};

struct WorkspaceLayout {
  // float32 I/O: fp16 copies of the inputs and the output (byte offsets; all 0 otherwise)
  size_t query16 = 0, key16 = 0, value16 = 0, lambda16 = 0, output16 = 0;
  size_t int8_base = 0;  // where the INT8 part starts; the offsets below are relative to it
  size_t codes = 0, scales = 0, sums = 0;
  size_t total = 0;      // bytes of the whole workspace
};

bool logits_quantised(const DiffxAttentionParams& p);
WorkspaceLayout workspace_layout(const DiffxAttentionParams& p);
int check_params(const DiffxAttentionParams* p);  // DIFFX_OK or a status, with the detail recorded
KernelArgs make_kernel_args(const DiffxAttentionParams& p);  // p must have passed check_params; fp16/bf16 only
// float32 I/O: the fp16 problem the kernel runs, on contiguous copies in the workspace.
DiffxAttentionParams half_params(const DiffxAttentionParams& p);
int record_error(int status, const char* fmt, ...);  // sets diffx_last_error(), returns status
void clear_error();

}  // namespace diffx
