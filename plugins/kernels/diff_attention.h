/* diffexport fused differential-attention kernels: the C ABI.
 *
 * No torch, TensorRT or CUDA types cross this boundary: a plain params struct of pointers,
 * element strides, sizes and scales, and functions returning a DiffxStatus. The TensorRT plugin,
 * the Python binding (ctypes) and the tests all call these same functions.
 *
 * Tensors follow the DiffAttention op contract (diffexport/core/contract.py, docs/OP_SPEC.md):
 *   query  [B, Sq, 2*H*D]   diff-head h owns maps 2h (map 1) and 2h+1 (map 2), each D wide
 *   key    [B, Skv, Kw]     V1: kv-group g owns key maps 2g, 2g+1 (Kw = 2*Hkv*D); V2: one head (Kw = Hkv*D)
 *   value  [B, Skv, Hkv*Dv] Dv = 2D (V1) or D (V2)
 *   lambda V1: one element; V2: [B, Sq, H] (after the sigmoid)         (dtype = query's)
 *   norm_weight [Dv] float32 (all ones where the model has none)
 *   key_mask [B, Skv] int64 or NULL (op version 2: 0 marks padding keys, hidden like future keys)
 *   output [B, Sq, H*Dv]
 * Within a token row the layout is the contract's; batch and token strides are free (in
 * elements), so views of larger buffers need no copy. Rows and heads must start on 16 bytes.
 * Diff-head h reads kv-group h / (H / Hkv). Causal masks align bottom-right: query i sees key j
 * iff j <= i + Skv - Sq; a query row that sees no key at all gets an output of zeros.
 *
 * Three kernels implement it. Calls with q_len <= DIFFX_DECODE_MAX_QUERY (decode steps of a
 * KV-cache decoder) run the split-KV decode kernel: the keys are cut into splits, one CTA per
 * (diff-head, batch element, split), and a second kernel merges the splits' partial softmax
 * states and applies the epilogue. Longer calls run the one-pass kernel (one CTA per 64 query
 * tokens): on an sm_90 GPU, when the library was built with it (diffx_build_info says sm90=1), calls
 * with fp logits and no zero batch stride run the sm_90a TMA + wgmma kernel instead, else the
 * mma.sync one. The environment variable DIFFEXPORT_KERNEL_PATH picks otherwise: auto (the default)
 * chooses as above; mma forces the mma.sync one-pass kernel for every call (comparisons, fallback);
 * hopper asks for the TMA + wgmma kernel for every call it implements, and fails with
 * DIFFX_ERR_NO_KERNEL_FOR_GPU off sm_90 or on a library without it.
 */
#ifndef DIFFEXPORT_DIFF_ATTENTION_H
#define DIFFEXPORT_DIFF_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define DIFFX_API __declspec(dllexport)
#else
#define DIFFX_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever DiffxAttentionParams, a signature below or what a caller must provide changes
   (2: key_mask; 3: a workspace for q_len <= DIFFX_DECODE_MAX_QUERY, the split-KV decode path;
   4: an 8-bit KV cache, kv_format with k_scale and v_scale). */
#define DIFFX_ABI_VERSION 4

#define DIFFX_QUERY_BLOCK 64 /* query tokens per CTA and per Q quantisation scale */
#define DIFFX_KEY_BLOCK 64   /* key tokens per tile and per K quantisation scale */
#define DIFFX_DECODE_MAX_QUERY 16 /* q_len up to this runs the split-KV decode kernel */
/* Split-KV: enough splits that batch * heads * splits reaches this many CTAs (about two waves on
   a 132-SM H100), never more splits than 64-key tiles. A constant, not the GPU's SM count, so
   that the workspace size is a function of the shapes alone (diffx_attention_workspace_size
   touches no device). Only the emulator's sanitizer build (sanitize_cases.cpp) defines another
   value, to reach splits of several tiles with a handful of emulated CTAs. A variant
   (DIFFX_DECODE_ONE_WAVE in kernel_args.h) plans at most one wave of the GPU's SMs, within this bound. */
#ifndef DIFFX_DECODE_TARGET_CTAS
#define DIFFX_DECODE_TARGET_CTAS 256
#endif

typedef enum DiffxDtype {
  DIFFX_DTYPE_FLOAT16 = 1,
  DIFFX_DTYPE_BFLOAT16 = 2,
  DIFFX_DTYPE_FLOAT32 = 3 /* converted to fp16 in the workspace, run on the fp16 kernel, converted back */
} DiffxDtype;

/* How key and value are stored (kv_format). 8-bit codes carry one float32 scale per channel of
   the key and value rows (k_scale [key heads * D], v_scale [Hkv * Dv]): the real key is
   code * k_scale[channel] (plus any per-channel constant, e.g. the mean K-smoothing removed, which
   no softmax sees). */
typedef enum DiffxKvFormat {
  DIFFX_KV_SAME = 0,     /* key and value in the query's dtype */
  DIFFX_KV_INT8 = 1,     /* int8 codes, -127..127 */
  DIFFX_KV_FP8_E4M3 = 2  /* float8 e4m3 (OCP, "fn": no infinities; codes 0x7f/0xff, NaN there, read as +-480) */
} DiffxKvFormat;

typedef enum DiffxStatus {
  DIFFX_OK = 0,
  DIFFX_ERR_NULL_POINTER = 1,
  DIFFX_ERR_UNSUPPORTED_DTYPE = 2,
  DIFFX_ERR_UNSUPPORTED_HEAD_DIM = 3,
  DIFFX_ERR_BAD_VARIANT = 4,
  DIFFX_ERR_BAD_SIZE = 5,
  DIFFX_ERR_BAD_HEADS = 6,
  DIFFX_ERR_BAD_ATTRIBUTE = 7,
  DIFFX_ERR_MISALIGNED = 8,
  DIFFX_ERR_WORKSPACE_TOO_SMALL = 9,
  DIFFX_ERR_NO_KERNEL_FOR_GPU = 10,
  DIFFX_ERR_CUDA = 11
} DiffxStatus;

typedef struct DiffxAttentionParams {
  /* tensors (device pointers) and their strides in elements */
  const void* query;
  int64_t q_batch_stride, q_row_stride;
  const void* key;
  int64_t k_batch_stride, k_row_stride;
  const void* value;
  int64_t v_batch_stride, v_row_stride;
  const void* lambda_full; /* dtype of query; V1 reads element 0, V2 [B, Sq, H] with the strides below
                              (float32 I/O needs lambda_head_stride 1) */
  int64_t lambda_batch_stride, lambda_row_stride, lambda_head_stride;
  const float* norm_weight; /* [Dv] */
  void* output;
  int64_t o_batch_stride, o_row_stride;
  /* op version 2: key padding mask [B, Skv] int64 (1 = key present, 0 = padding: left-padded
     batches of a KV-cache decoder); NULL = every key present. Stride in elements, 0 = one row for all. */
  const int64_t* key_mask;
  int64_t mask_batch_stride;

  /* sizes and attributes (contract names) */
  int32_t dtype;   /* DiffxDtype */
  int32_t variant; /* 1: DIFF V1, 2: DIFF V2 */
  int32_t batch, q_len, kv_len;
  int32_t num_heads, num_kv_heads, head_dim; /* head_dim: 64 or 128 */
  int32_t causal; /* 0 or 1 */
  int32_t norm;   /* 1: per-head RMSNorm over Dv (V1 only) */
  float scale;    /* logit scale; 0 means 1/sqrt(head_dim) */
  float norm_eps;
  float output_scale;

  /* low-bit attention logits (diffexport/core/quantization.py, scheme "qk", is the definition):
   * 0 or 16 = logits from fp16/bf16 Q and K; 2..8 = Q and K quantised per 64-token block with
   * absmax scales onto the grid +-(2^(bits-1)-1), S computed with INT8 tensor cores. */
  int32_t logit_bits;
  int32_t smooth_k; /* 1: subtract K's per-(batch, kv head) mean over all keys before quantising */

  void* workspace; /* device memory, diffx_attention_workspace_size() bytes; NULL when that is 0 */
  size_t workspace_bytes;

  /* ABI 4, after every earlier field (an older library reads the same prefix). An 8-bit KV cache
   * (DiffxKvFormat; 0 = key and value in the query's dtype): key and value then hold 1-byte codes
   * (strides still in elements, i.e. bytes; rows on 16 bytes) and k_scale / v_scale their
   * per-channel float32 scales (diffexport/core/kv_cache_codes.py is the definition). Decode-sized calls (q_len <= DIFFX_DECODE_MAX_QUERY)
   * read the codes in the split-KV kernel (K's scale folded into Q, V's onto the output), whatever
   * DIFFEXPORT_KERNEL_PATH says; longer calls dequantise them into the workspace first. Not combined
   * with logit_bits 2..8 (per-channel K scales do not factor out of an integer Q.K). */
  int32_t kv_format;
  const float* k_scale; /* [key heads * D]: the key row's channels (V1: 2*Hkv*D, V2: Hkv*D) */
  const float* v_scale; /* [Hkv * Dv] */
} DiffxAttentionParams;

DIFFX_API int diffx_abi_version(void);

/* sizeof(DiffxAttentionParams): lets bindings (ctypes) check that their struct mirrors this one. */
DIFFX_API size_t diffx_params_size(void);

/* "archs=80-real;... cuda=13.0 abi=4 sm90=1": what this library was compiled for (sm90=1: with the Hopper path). */
DIFFX_API const char* diffx_build_info(void);

/* A one-line description of a status code. */
DIFFX_API const char* diffx_status_string(int status);

/* The detail of the last failure in this thread (which field, which value, which CUDA error). */
DIFFX_API const char* diffx_last_error(void);

/* Validates params without touching the GPU (no CUDA call). DIFFX_OK or the first problem. */
DIFFX_API int diffx_attention_check(const DiffxAttentionParams* params);

/* Device workspace the launch needs: 0 unless logit_bits is 2..8, dtype is float32, q_len <=
   DIFFX_DECODE_MAX_QUERY (the decode kernel's partial results, whatever DIFFEXPORT_KERNEL_PATH says)
   or an 8-bit KV cache meets a longer call (its keys and values dequantised into the query's dtype).
   Non-decreasing in batch, heads and kv_len. Does not read pointers. */
DIFFX_API size_t diffx_attention_workspace_size(const DiffxAttentionParams* params);

/* Which kernel a call runs (validated like diffx_attention_check except the workspace, no CUDA call): *path = 1 for the
   one-pass kernel, 2 for the split-KV decode kernels, 3 for the Hopper kernel, and *splits = key splits per
   (batch, diff-head) (1 unless split-KV). Either pointer may be NULL. */
DIFFX_API int diffx_attention_plan(const DiffxAttentionParams* params, int* path, int* splits);

/* Checks params, then enqueues the kernels on `cuda_stream` (a cudaStream_t; NULL = default). */
DIFFX_API int diffx_attention_forward(const DiffxAttentionParams* params, void* cuda_stream);

#ifdef __cplusplus
}
#endif

#endif /* DIFFEXPORT_DIFF_ATTENTION_H */
