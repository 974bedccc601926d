// Parameter checks, workspace layout and argument preparation: host C++ shared by the CUDA
// launcher (diff_attention.cu) and the CPU emulator (emulation/). No CUDA calls here.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernel_args.h"

namespace diffx {

namespace {
thread_local std::string g_last_error;
constexpr size_t kAlign = 256;
size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

int key_maps(const DiffxAttentionParams& p) { return p.variant == 1 ? 2 * p.num_kv_heads : p.num_kv_heads; }
int value_dim(const DiffxAttentionParams& p) { return p.variant == 1 ? 2 * p.head_dim : p.head_dim; }

}  // namespace

WorkspaceLayout workspace_layout(const DiffxAttentionParams& p) {
  WorkspaceLayout w;
  if (kv_dequantised(p)) {
    // The 8-bit cache dequantised into contiguous key/value rows of the query's dtype, then the
    // workspace of the plain call that reads them (dequantised_params).
    const size_t e = element_bytes(p.dtype), B = size_t(p.batch), Skv = size_t(p.kv_len);
    w.key_deq = 0;
    w.value_deq = round_up(B * Skv * key_maps(p) * p.head_dim * e, kAlign);
    w.deq_end = w.value_deq + round_up(B * Skv * p.num_kv_heads * value_dim(p) * e, kAlign);
    DiffxAttentionParams plain = p;
    plain.kv_format = DIFFX_KV_SAME;
    w.total = w.deq_end + workspace_layout(plain).total;
    return w;
  }
  size_t offset = 0;
  if (p.dtype == DIFFX_DTYPE_FLOAT32) {
    const size_t B = size_t(p.batch), Sq = size_t(p.q_len), Skv = size_t(p.kv_len), h = 2;  // fp16 bytes
    const size_t lambda = p.variant == 1 ? 1 : B * Sq * p.num_heads;
    w.query16 = offset;
    offset += round_up(B * Sq * 2 * p.num_heads * p.head_dim * h, kAlign);
    if (p.kv_format == DIFFX_KV_SAME) {  // an 8-bit cache is read as it is
      w.key16 = offset;
      offset += round_up(B * Skv * key_maps(p) * p.head_dim * h, kAlign);
      w.value16 = offset;
      offset += round_up(B * Skv * p.num_kv_heads * value_dim(p) * h, kAlign);
    }
    w.lambda16 = offset;
    offset += round_up(lambda * h, kAlign);
    w.output16 = offset;
    offset += round_up(B * Sq * p.num_heads * value_dim(p) * h, kAlign);
  }
  w.int8_base = offset;
  if (logits_quantised(p)) {
    const size_t maps = size_t(p.batch) * key_maps(p);
    const size_t blocks = (size_t(p.kv_len) + DIFFX_KEY_BLOCK - 1) / DIFFX_KEY_BLOCK;
    w.codes = 0;
    w.scales = round_up(maps * blocks * DIFFX_KEY_BLOCK * p.head_dim, kAlign);
    const size_t chunks = (size_t(p.kv_len) + kKeySumChunk - 1) / kKeySumChunk;
    w.sums = w.scales + round_up(maps * blocks * sizeof(float), kAlign);
    offset += w.sums + (p.smooth_k ? round_up(maps * chunks * p.head_dim * sizeof(float), kAlign) : 0);
  }
  if (p.q_len >= 1 && p.q_len <= DIFFX_DECODE_MAX_QUERY) {
    // Sized for the most partial states any plan can ask for: batch*heads*splits is at most
    // batch*heads*tiles and less than batch*heads + DIFFX_DECODE_TARGET_CTAS (a bound that only
    // grows with the shapes, so a TensorRT plugin can size it at its profile's maximum).
    // Partial states: B*H*splits*q_len rows per map. With h heads packed per CTA the plan
    // has splits <= ceil(TARGET*h / (B*H)) and h*q_len <= 16, so B*H*splits*q_len is below
    // B*H*q_len + TARGET*min(ratio*q_len, 16), and below B*H*q_len*tiles: a bound that only grows
    // with batch, heads, keys and q_len.
    const size_t bh = size_t(p.batch) * p.num_heads, q = size_t(p.q_len);
    const size_t tiles = (size_t(p.kv_len) + DIFFX_KEY_BLOCK - 1) / DIFFX_KEY_BLOCK;
    const size_t ratio = size_t(p.num_heads / std::max(1, p.num_kv_heads));
    const size_t rows = std::min(bh * q * tiles,
                                 bh * q + size_t(DIFFX_DECODE_TARGET_CTAS) * std::min<size_t>(ratio * q, DIFFX_DECODE_MAX_QUERY));
    const size_t states = rows * 2;  // per map
    const size_t int8_end = offset - w.int8_base;
    w.part_o = int8_end;
    w.part_ml = w.part_o + round_up(states * value_dim(p) * sizeof(float), kAlign);
    offset += (w.part_ml - int8_end) + round_up(states * 2 * sizeof(float), kAlign);
  }
  w.total = offset;
  return w;
}

DiffxAttentionParams half_params(const DiffxAttentionParams& p) {
  const WorkspaceLayout w = workspace_layout(p);
  char* base = static_cast<char*>(p.workspace);
  DiffxAttentionParams h = p;
  const int64_t qw = int64_t(2) * p.num_heads * p.head_dim, kw = int64_t(key_maps(p)) * p.head_dim;
  const int64_t vw = int64_t(p.num_kv_heads) * value_dim(p), ow = int64_t(p.num_heads) * value_dim(p);
  h.dtype = DIFFX_DTYPE_FLOAT16;
  h.query = base + w.query16, h.q_row_stride = qw, h.q_batch_stride = qw * p.q_len;
  if (p.kv_format == DIFFX_KV_SAME) {
    h.key = base + w.key16, h.k_row_stride = kw, h.k_batch_stride = kw * p.kv_len;
    h.value = base + w.value16, h.v_row_stride = vw, h.v_batch_stride = vw * p.kv_len;
  }
  h.lambda_full = base + w.lambda16;
  if (p.variant != 1) {
    h.lambda_head_stride = 1, h.lambda_row_stride = p.num_heads, h.lambda_batch_stride = int64_t(p.num_heads) * p.q_len;
  }
  h.output = base + w.output16, h.o_row_stride = ow, h.o_batch_stride = ow * p.q_len;
  h.workspace = base + w.int8_base;
  h.workspace_bytes = w.total - w.int8_base;
  return h;
}

DiffxAttentionParams dequantised_params(const DiffxAttentionParams& p) {
  const WorkspaceLayout w = workspace_layout(p);
  char* base = static_cast<char*>(p.workspace);
  DiffxAttentionParams d = p;
  const int64_t kw = int64_t(key_maps(p)) * p.head_dim, vw = int64_t(p.num_kv_heads) * value_dim(p);
  d.kv_format = DIFFX_KV_SAME;
  d.k_scale = d.v_scale = nullptr;
  d.key = base + w.key_deq, d.k_row_stride = kw, d.k_batch_stride = kw * p.kv_len;
  d.value = base + w.value_deq, d.v_row_stride = vw, d.v_batch_stride = vw * p.kv_len;
  d.workspace = base + w.deq_end;
  d.workspace_bytes = w.total - w.deq_end;
  return d;
}

bool kv_quantised(const DiffxAttentionParams& p) { return p.kv_format != DIFFX_KV_SAME; }
bool kv_dequantised(const DiffxAttentionParams& p) { return kv_quantised(p) && p.q_len > DIFFX_DECODE_MAX_QUERY; }
size_t element_bytes(int dtype) { return dtype == DIFFX_DTYPE_FLOAT32 ? 4 : 2; }

namespace {

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Rows start on 16 bytes: strides in elements are multiples of 8 (2-byte elements) or 16 (8-bit codes).
int check_tensor(const char* name, const void* ptr, int64_t batch_stride, int64_t row_stride, int64_t width,
                 int64_t stride_multiple = 8) {
  if (!ptr) return record_error(DIFFX_ERR_NULL_POINTER, "%s is a null pointer", name);
  if (!aligned(ptr, 16)) return record_error(DIFFX_ERR_MISALIGNED, "%s must start on a 16-byte boundary", name);
  if (row_stride < width || row_stride % stride_multiple)
    return record_error(DIFFX_ERR_MISALIGNED, "%s row stride %lld must be >= its width %lld and a multiple of %lld elements",
                name, (long long)row_stride, (long long)width, (long long)stride_multiple);
  if (batch_stride < 0 || batch_stride % stride_multiple)
    return record_error(DIFFX_ERR_MISALIGNED, "%s batch stride %lld must be >= 0 and a multiple of %lld elements", name,
                (long long)batch_stride, (long long)stride_multiple);
  return DIFFX_OK;
}


// What the workspace holds, for the error message.
std::string workspace_users(const DiffxAttentionParams& p) {
  std::string users;
  auto add = [&](const char* what) { users += users.empty() ? what : std::string(", ") + what; };
  if (p.dtype == DIFFX_DTYPE_FLOAT32) add("float32 I/O");
  if (logits_quantised(p)) add("INT8 logits");
  if (kv_dequantised(p)) add("8-bit KV cache dequantised for a long call");
  if (p.q_len <= DIFFX_DECODE_MAX_QUERY) add("split-KV decode");
  return users;
}

}  // namespace

const char* bad_kernel_path_setting() {
  const char* path = std::getenv("DIFFEXPORT_KERNEL_PATH");
  if (!path || !*path || !std::strcmp(path, "auto") || !std::strcmp(path, "mma") || !std::strcmp(path, "hopper"))
    return nullptr;
  return path;
}

KernelPath kernel_path(const DiffxAttentionParams& p) {
  const char* path = std::getenv("DIFFEXPORT_KERNEL_PATH");
  // An 8-bit cache is read by the split-KV kernel only (longer calls get it dequantised first).
  if (p.q_len <= DIFFX_DECODE_MAX_QUERY && kv_quantised(p)) return KernelPath::kDecode;
  if (path && !std::strcmp(path, "mma")) return KernelPath::kOnePass;
  if (p.q_len <= DIFFX_DECODE_MAX_QUERY) return KernelPath::kDecode;
  // TMA descriptors take no zero strides: a batch broadcast through a zero stride stays on the
  // mma.sync kernel. INT8 logits take the Hopper path too (s8 wgmma; K's codes are the pre-pass's).
  const bool batch_strides = p.batch == 1 || (p.q_batch_stride > 0 && p.k_batch_stride > 0 && p.v_batch_stride > 0);
  if (!batch_strides) return KernelPath::kOnePass;
  // hopper asks for it (the call fails off sm_90); auto takes it where it runs: 1.2-1.9x the
  // mma.sync kernel on an H200, docs/BENCHMARKS.md.
  if (path && !std::strcmp(path, "hopper")) return KernelPath::kHopper;
  return hopper_path_runs_here() ? KernelPath::kHopper : KernelPath::kOnePass;
}

DecodePlan decode_plan(const DiffxAttentionParams& p) {
  DecodePlan plan;
  // GQA: pack the most heads of one kv group whose query tokens fit the 16 rows (a divisor of the
  // group size, so no CTA straddles two groups). INT8 logits quantise Q per head: one head a CTA.
  const int ratio = p.num_heads / p.num_kv_heads;
  if (!logits_quantised(p))
    for (int h = ratio; h >= 1; --h)
      if (ratio % h == 0 && h * p.q_len <= DIFFX_DECODE_MAX_QUERY) {
        plan.heads_per_cta = h;
        break;
      }
  const int64_t bh = int64_t(p.batch) * (p.num_heads / plan.heads_per_cta);
  const int64_t tiles = (int64_t(p.kv_len) + DIFFX_KEY_BLOCK - 1) / DIFFX_KEY_BLOCK;
  int64_t splits = std::min<int64_t>(tiles, std::max<int64_t>(1, (DIFFX_DECODE_TARGET_CTAS + bh - 1) / bh));
  // DIFFX_DECODE_ONE_WAVE: as many splits as one wave of this GPU holds, rounded down (so never more
  // CTAs than the fixed target's splits: the workspace bound stands).
  if (const int64_t wave = std::min<int64_t>(DIFFX_DECODE_TARGET_CTAS, decode_wave_ctas(p.head_dim)); wave > 0)
    splits = std::min<int64_t>(tiles, std::max<int64_t>(1, wave / bh));
  plan.tiles_per_split = int((tiles + splits - 1) / splits);
  // An 8-bit cache is read DIFFX_DECODE_KV_TILES tiles a step: a split of whole steps takes as many
  // steps a CTA as one with a tile less, and no step reads (then masks) the next split's tile. Short
  // caches gain most: at one tile a split, half of every step was masked and twice the CTAs ran.
  if (kv_quantised(p)) plan.tiles_per_split = int(round_up(plan.tiles_per_split, DIFFX_DECODE_KV_TILES));
  plan.splits = int((tiles + plan.tiles_per_split - 1) / plan.tiles_per_split);  // no empty split
  return plan;
}

int check_params(const DiffxAttentionParams* pp, bool with_workspace) {
  if (!pp) return record_error(DIFFX_ERR_NULL_POINTER, "params is a null pointer");
  if (const char* path = bad_kernel_path_setting())
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "DIFFEXPORT_KERNEL_PATH=%s is not auto, mma or hopper", path);
  const DiffxAttentionParams& p = *pp;
  if (p.dtype != DIFFX_DTYPE_FLOAT16 && p.dtype != DIFFX_DTYPE_BFLOAT16 && p.dtype != DIFFX_DTYPE_FLOAT32)
    return record_error(DIFFX_ERR_UNSUPPORTED_DTYPE,
                        "dtype %d is not supported: use float16 (1), bfloat16 (2) or float32 (3)", p.dtype);
  if (p.variant != 1 && p.variant != 2)
    return record_error(DIFFX_ERR_BAD_VARIANT, "variant %d is not 1 (DIFF V1) or 2 (DIFF V2)", p.variant);
  if (p.head_dim != 64 && p.head_dim != 128)
    return record_error(DIFFX_ERR_UNSUPPORTED_HEAD_DIM, "head_dim %d is not supported by the fused kernel: use 64 or 128",
                p.head_dim);
  if (p.batch < 1 || p.batch > 65535) return record_error(DIFFX_ERR_BAD_SIZE, "batch %d must be in 1..65535", p.batch);
  if (p.q_len < 1 || p.q_len > 65535 * DIFFX_QUERY_BLOCK)  // the contract's bound since query blocks were the grid's z
    return record_error(DIFFX_ERR_BAD_SIZE, "q_len %d must be in 1..%d", p.q_len, 65535 * DIFFX_QUERY_BLOCK);
  if (p.kv_len < 1) return record_error(DIFFX_ERR_BAD_SIZE, "kv_len %d must be >= 1", p.kv_len);
  if (p.num_heads < 1 || p.num_heads > 65535)
    return record_error(DIFFX_ERR_BAD_HEADS, "num_heads %d must be in 1..65535", p.num_heads);
  if (p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads)
    return record_error(DIFFX_ERR_BAD_HEADS, "num_kv_heads %d must be >= 1 and divide num_heads %d", p.num_kv_heads,
                p.num_heads);
  if (p.causal != 0 && p.causal != 1) return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "causal %d must be 0 or 1", p.causal);
  if (p.norm != 0 && p.norm != 1) return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "norm %d must be 0 or 1", p.norm);
  if (p.variant == 2 && p.norm)  // as the contract: DIFF V2 has no per-head norm
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "variant 2 (DIFF V2) has no per-head norm: set norm=0");
  if (p.smooth_k != 0 && p.smooth_k != 1)
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "smooth_k %d must be 0 or 1", p.smooth_k);
  if (!std::isfinite(p.scale) || p.scale < 0.f)
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "scale %g must be finite and >= 0 (0 = 1/sqrt(head_dim))", p.scale);
  if (!std::isfinite(p.norm_eps) || !(p.norm_eps > 0.f))
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "norm_eps %g must be finite and > 0", p.norm_eps);
  if (!std::isfinite(p.output_scale))
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "output_scale %g must be finite", p.output_scale);
  if (!(p.logit_bits == 0 || p.logit_bits == 16 || logits_quantised(p)))
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "logit_bits %d must be 0 or 16 (not quantised) or 2..8", p.logit_bits);
  if (logits_quantised(p) && int64_t(p.batch) * key_maps(p) > 65535)
    return record_error(DIFFX_ERR_BAD_SIZE, "batch * key heads %lld exceeds 65535 for the INT8-logits path",
                (long long)p.batch * key_maps(p));
  if (p.kv_format != DIFFX_KV_SAME && p.kv_format != DIFFX_KV_INT8 && p.kv_format != DIFFX_KV_FP8_E4M3)
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "kv_format %d must be 0 (the query's dtype), 1 (int8) or 2 (fp8 e4m3)",
                        p.kv_format);
  if (kv_quantised(p) && logits_quantised(p))
    return record_error(DIFFX_ERR_BAD_ATTRIBUTE, "an 8-bit KV cache (kv_format %d) does not combine with logit_bits %d: "
                        "its per-channel K scales do not factor out of an integer Q.K", p.kv_format, p.logit_bits);
  const int64_t D = p.head_dim, Dv = value_dim(p);
  const int64_t kv_multiple = kv_quantised(p) ? 16 : 8;
  int s;
  if ((s = check_tensor("query", p.query, p.q_batch_stride, p.q_row_stride, 2 * p.num_heads * D))) return s;
  if ((s = check_tensor("key", p.key, p.k_batch_stride, p.k_row_stride, key_maps(p) * D, kv_multiple))) return s;
  if ((s = check_tensor("value", p.value, p.v_batch_stride, p.v_row_stride, p.num_kv_heads * Dv, kv_multiple))) return s;
  if (kv_quantised(p)) {
    if (!p.k_scale || !p.v_scale)
      return record_error(DIFFX_ERR_NULL_POINTER, "an 8-bit KV cache needs k_scale and v_scale (%s is null)",
                          p.k_scale ? "v_scale" : "k_scale");
    if (!aligned(p.k_scale, 4) || !aligned(p.v_scale, 4))
      return record_error(DIFFX_ERR_MISALIGNED, "k_scale and v_scale must be 4-byte aligned (float32)");
  }
  if ((s = check_tensor("output", p.output, p.o_batch_stride, p.o_row_stride, p.num_heads * Dv))) return s;
  if (!p.lambda_full) return record_error(DIFFX_ERR_NULL_POINTER, "lambda_full is a null pointer");
  if (!aligned(p.lambda_full, p.dtype == DIFFX_DTYPE_FLOAT32 ? 4 : 2))
    return record_error(DIFFX_ERR_MISALIGNED, "lambda_full must be aligned to its element size");
  if (p.variant == 2 && (p.lambda_batch_stride < 0 || p.lambda_row_stride < 0 || p.lambda_head_stride < 0))
    return record_error(DIFFX_ERR_BAD_SIZE, "lambda_full strides must be >= 0");
  if (p.variant == 2 && p.dtype == DIFFX_DTYPE_FLOAT32 && p.lambda_head_stride != 1)
    return record_error(DIFFX_ERR_BAD_SIZE, "float32 I/O needs lambda_full with head stride 1");
  if (p.key_mask && !aligned(p.key_mask, 8))
    return record_error(DIFFX_ERR_MISALIGNED, "key_mask must be 8-byte aligned (int64)");
  if (p.key_mask && p.mask_batch_stride != 0 && p.mask_batch_stride < p.kv_len)
    return record_error(DIFFX_ERR_BAD_SIZE, "key_mask batch stride %lld must be 0 or >= kv_len %d",
                        (long long)p.mask_batch_stride, p.kv_len);
  if (!p.norm_weight) return record_error(DIFFX_ERR_NULL_POINTER, "norm_weight is a null pointer");
  if (!aligned(p.norm_weight, 4)) return record_error(DIFFX_ERR_MISALIGNED, "norm_weight must be 4-byte aligned");
  const size_t need = workspace_layout(p).total;
  if (need && with_workspace) {
    if (!p.workspace || p.workspace_bytes < need)
      return record_error(DIFFX_ERR_WORKSPACE_TOO_SMALL,
                          "this call (%s) needs a workspace of %zu bytes (diffx_attention_workspace_size), got %zu%s",
                          workspace_users(p).c_str(), need, p.workspace_bytes, p.workspace ? "" : " (null pointer)");
    if (!aligned(p.workspace, kAlign))
      return record_error(DIFFX_ERR_MISALIGNED, "workspace must start on a %zu-byte boundary", kAlign);
  }
  return DIFFX_OK;
}


bool logits_quantised(const DiffxAttentionParams& p) { return p.logit_bits >= 2 && p.logit_bits <= 8; }

int record_error(int status, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  g_last_error = buf;
  return status;
}

void clear_error() { g_last_error.clear(); }

KernelArgs make_kernel_args(const DiffxAttentionParams& p) {
  KernelArgs args{};
  args.p = p;
  args.scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(p.head_dim));
  args.key_maps = key_maps(p);
  args.n_kv_blocks = (p.kv_len + DIFFX_KEY_BLOCK - 1) / DIFFX_KEY_BLOCK;
  args.kv_pad = args.n_kv_blocks * DIFFX_KEY_BLOCK;
  if (logits_quantised(p)) {
    const WorkspaceLayout w = workspace_layout(p);
    char* base = static_cast<char*>(p.workspace) + w.int8_base;
    args.qmax = (1 << (p.logit_bits - 1)) - 1;
    args.k_codes = reinterpret_cast<const int8_t*>(base + w.codes);
    args.k_scales = reinterpret_cast<const float*>(base + w.scales);
    args.k_sums = p.smooth_k ? reinterpret_cast<const float*>(base + w.sums) : nullptr;
    args.n_key_chunks = (p.kv_len + kKeySumChunk - 1) / kKeySumChunk;
  }
  args.path = kernel_path(p);
  if (args.path == KernelPath::kDecode) {
    const WorkspaceLayout w = workspace_layout(p);
    char* base = static_cast<char*>(p.workspace) + w.int8_base;
    args.plan = decode_plan(p);
    args.decode_parts = args.plan.splits;
    args.part_o = reinterpret_cast<float*>(base + w.part_o);
    args.part_ml = reinterpret_cast<float*>(base + w.part_ml);
  }
  return args;
}

}  // namespace diffx

extern "C" {

DIFFX_API int diffx_abi_version(void) { return DIFFX_ABI_VERSION; }

DIFFX_API size_t diffx_params_size(void) { return sizeof(DiffxAttentionParams); }

DIFFX_API const char* diffx_status_string(int status) {
  switch (status) {
    case DIFFX_OK: return "ok";
    case DIFFX_ERR_NULL_POINTER: return "a required pointer is null";
    case DIFFX_ERR_UNSUPPORTED_DTYPE: return "unsupported dtype (float16, bfloat16 or float32)";
    case DIFFX_ERR_UNSUPPORTED_HEAD_DIM: return "unsupported head dim (64 or 128)";
    case DIFFX_ERR_BAD_VARIANT: return "variant must be 1 or 2";
    case DIFFX_ERR_BAD_SIZE: return "a size is out of range";
    case DIFFX_ERR_BAD_HEADS: return "bad head counts";
    case DIFFX_ERR_BAD_ATTRIBUTE: return "an attribute is out of range";
    case DIFFX_ERR_MISALIGNED: return "a pointer or stride is misaligned";
    case DIFFX_ERR_WORKSPACE_TOO_SMALL: return "workspace missing or too small";
    case DIFFX_ERR_NO_KERNEL_FOR_GPU: return "no kernel compiled for this GPU architecture";
    case DIFFX_ERR_CUDA: return "CUDA error";
    default: return "unknown status";
  }
}

DIFFX_API const char* diffx_last_error(void) { return diffx::g_last_error.c_str(); }

DIFFX_API int diffx_attention_check(const DiffxAttentionParams* params) {
  diffx::clear_error();
  return diffx::check_params(params);
}

DIFFX_API int diffx_attention_plan(const DiffxAttentionParams* params, int* path, int* splits) {
  diffx::clear_error();
  const int status = diffx::check_params(params, /*with_workspace=*/false);  // asked before allocating it
  if (status != DIFFX_OK) return status;
  const diffx::KernelPath chosen = diffx::kernel_path(*params);
  const bool decode = chosen == diffx::KernelPath::kDecode;
  if (path) *path = decode ? 2 : chosen == diffx::KernelPath::kHopper ? 3 : 1;
  if (splits) *splits = decode ? diffx::decode_plan(*params).splits : 1;
  return DIFFX_OK;
}

DIFFX_API size_t diffx_attention_workspace_size(const DiffxAttentionParams* params) {
  return params ? diffx::workspace_layout(*params).total : 0;
}

}  // extern "C"
