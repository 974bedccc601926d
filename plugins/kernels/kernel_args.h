// Host-side preparation shared by the CUDA launcher and the CPU emulator: the parameter checks,
// the workspace layout and the kernel's resolved arguments. Plain C++ (no CUDA headers).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "diff_attention.h"

namespace diffx {

// K-smoothing sums keys in chunks of this many tokens, one CTA each (then a fixed-order total).
// Only the emulator's sanitizer build defines another value, so that a few hundred emulated keys
// make several chunks (any positive size is correct: each chunk's lanes stride through it).
#ifndef DIFFX_KEY_SUM_CHUNK
#define DIFFX_KEY_SUM_CHUNK 1024
#endif
constexpr int kKeySumChunk = DIFFX_KEY_SUM_CHUNK;
// Warps per softmax map in a decode CTA: each takes 16 keys of every 64-key tile and keeps its own
// partial state; the CTA merges them into one part per map and split before it writes.
constexpr int kDecodeWarpsPerMap = 4;

// 64-key tiles the 8-bit-cache decode kernel takes a step (1 or 2), where the GPU's shared memory
// holds DIFFX_DECODE_KV_STAGES stages of them (else 1). Two: a warp takes 16 keys of each tile, 32
// a step, so what a step costs whatever its keys (the wait and barrier, the softmax's row
// reductions and vote, the Q fragments, the loop) is paid once per 128 keys. On the H200 of
// 2026-11-28 the 8-bit kernel took about as many cycles a tile as the bf16 one on half the bytes,
// at head dim 64 (two CTAs an SM, half the work a warp) as at 128 (one): a per-step cost, not the
// work per key, set its pace.
#ifndef DIFFX_DECODE_KV_TILES
#define DIFFX_DECODE_KV_TILES 2
#endif
static_assert(DIFFX_DECODE_KV_TILES == 1 || DIFFX_DECODE_KV_TILES == 2, "one or two 64-key tiles a step");
// decode_plan gives such a cache whole steps a split.

// CTAs per SM the compiler must leave registers for in the decode kernels at head dim 64 (2: at most
// 128 registers a thread, no spills at sm_90; head dim 128 takes 1). 2 by default; the GPU campaign
// times 1 as a variant (-DDIFFX_DECODE_D64_MIN_BLOCKS=1). Here since decode_wave_ctas reads it too.
#ifndef DIFFX_DECODE_D64_MIN_BLOCKS
#define DIFFX_DECODE_D64_MIN_BLOCKS 2
#endif

// 1: decode_plan sizes a call's splits to one wave of the GPU it runs on (decode_wave_ctas): at most
// the CTAs its SMs hold at once, and never more than DIFFX_DECODE_TARGET_CTAS, so the workspace
// bound holds. What it tests: with the fixed target, head dim 128 (one CTA an SM) runs 256 CTAs in
// two waves on 132 SMs. Every CTA has as many keys, so the SMs end their first CTAs together; the
// second ones then start from an empty pipeline, fold Q and merge their warps' states again, with
// no copy of the SMs in flight while they start. One wave pays that once, for as many keys an SM. 0
// (default until a GPU has timed it): the fixed target, a plan that is the shapes' alone. Read by
// the nvcc-compiled decode_wave_ctas (the campaign's variant flags reach nvcc only).
#ifndef DIFFX_DECODE_ONE_WAVE
#define DIFFX_DECODE_ONE_WAVE 0
#endif

// Which kernel runs a call (DIFFX_DECODE_MAX_QUERY, DIFFEXPORT_KERNEL_PATH in diff_attention.h).
enum class KernelPath { kOnePass, kDecode, kHopper };

// The split-KV decode kernel's work: each CTA takes `heads_per_cta` diff-heads of one kv group
// (GQA heads packed into the 16 query rows, so their shared K/V tiles are read once) and one key
// split of `tiles_per_split` 64-key tiles (the last split may have fewer, none is empty).
struct DecodePlan {
  int splits = 0, tiles_per_split = 0, heads_per_cta = 1;
};

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
  // split-KV decode (path kDecode): each split's partial softmax state over its keys (the CTA's
  // warps already merged), merged by the second kernel. Part index = split.
  KernelPath path;
  DecodePlan plan;
  int decode_parts;       // partial states per (batch, diff-head, map): plan.splits
  float* part_o;          // [B, H, 2 maps, parts, q_len, Dv] unnormalised P.V sums (fp32)
  float* part_ml;         // [B, H, 2 maps, parts, q_len, 2]: running max (raw logit units), sum
};

struct WorkspaceLayout {
  // float32 I/O: fp16 copies of the inputs and the output (byte offsets; all 0 otherwise)
  size_t query16 = 0, key16 = 0, value16 = 0, lambda16 = 0, output16 = 0;
  size_t int8_base = 0;  // where the INT8 part starts; the offsets below are relative to it
  size_t codes = 0, scales = 0, sums = 0;
  size_t part_o = 0, part_ml = 0;  // decode partials (q_len <= DIFFX_DECODE_MAX_QUERY), after the INT8 part
  // An 8-bit KV cache with q_len > DIFFX_DECODE_MAX_QUERY: its dequantised key and value first,
  // then (from deq_end) the workspace of the plain call on them; the offsets above are then 0.
  size_t key_deq = 0, value_deq = 0, deq_end = 0;
  size_t total = 0;      // bytes of the whole workspace
};

bool logits_quantised(const DiffxAttentionParams& p);
bool kv_quantised(const DiffxAttentionParams& p);    // an 8-bit KV cache (kv_format != DIFFX_KV_SAME)
bool kv_dequantised(const DiffxAttentionParams& p);  // ... met by a call longer than DIFFX_DECODE_MAX_QUERY
size_t element_bytes(int dtype);                     // bytes of a DiffxDtype element
// An 8-bit cache met by a longer call: the plain call on its dequantised copies in the workspace.
DiffxAttentionParams dequantised_params(const DiffxAttentionParams& p);
// The decode kernel's plan for p (deterministic: shapes and DIFFX_DECODE_TARGET_CTAS only; with
// DIFFX_DECODE_ONE_WAVE, decode_wave_ctas too).
DecodePlan decode_plan(const DiffxAttentionParams& p);
// The kernel that runs p: kDecode for q_len <= DIFFX_DECODE_MAX_QUERY unless DIFFEXPORT_KERNEL_PATH=mma;
// kHopper for longer calls (fp or INT8 logits, batch strides) when DIFFEXPORT_KERNEL_PATH=hopper, or
// under auto where hopper_path_runs_here(); else kOnePass.
KernelPath kernel_path(const DiffxAttentionParams& p);
// Whether this library has the Hopper path and the current device is an sm_90 GPU. Defined by each
// library that links params.cpp: the CUDA one asks the device (once per device), the CPU emulator says no.
bool hopper_path_runs_here();
// DIFFX_DECODE_ONE_WAVE=1: the decode kernel's CTAs that one wave of the current device holds at head
// dim head_dim (its SMs x the CTAs an SM the kernel is built for); 0 when the flag is off or the SM
// count unknown (the CPU emulator unless DIFFX_EMULATED_SM_COUNT is set): the fixed target stands.
int decode_wave_ctas(int head_dim);
// Shared memory a block of this GPU may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), 0 if
// unknown: whether the decode kernel's two K/V stages fit at head dim 128.
int device_smem_optin();
// Whether the current device runs programmatic dependent launches (sm_90 and later).
bool device_launches_dependents_early();
// DIFFEXPORT_KERNEL_PATH's value when it is not one this library knows, else null.
const char* bad_kernel_path_setting();
WorkspaceLayout workspace_layout(const DiffxAttentionParams& p);
// DIFFX_OK or a status, with the detail recorded; with_workspace = false skips the workspace check.
int check_params(const DiffxAttentionParams* p, bool with_workspace = true);
KernelArgs make_kernel_args(const DiffxAttentionParams& p);  // p must have passed check_params; fp16/bf16 only
// float32 I/O: the fp16 problem the kernel runs, on contiguous copies in the workspace.
DiffxAttentionParams half_params(const DiffxAttentionParams& p);
int record_error(int status, const char* fmt, ...);  // sets diffx_last_error(), returns status
void clear_error();

}  // namespace diffx
