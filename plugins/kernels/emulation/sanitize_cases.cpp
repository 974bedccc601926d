// The emulated kernels under the host's sanitizers: the CPU counterpart of running
// tests/kernel_cases.py under compute-sanitizer. Built with -fsanitize=thread, every CUDA thread is
// a std::thread, so a shared-memory access that no __syncthreads/__syncwarp orders against another
// thread's write is a reported data race (racecheck's question); built with
// -fsanitize=address,undefined, every global buffer is allocated at its exact size, so a read or
// write past a tensor, the workspace or the mask is reported (memcheck's question), as is undefined
// integer or shift arithmetic. tests/test_kernel_sanitized.py builds and runs it.
//
//   sanitize_cases CASE...   CASE = variant,heads,kv_heads,head_dim,causal,batch,q_len,kv_len,bits,dtype,masked[,kv]
//                            dtype 1 fp16, 2 bf16, 3 fp32 (converted inside); masked 1: row 0's first half of
//                            keys are padding (op version 2); kv 1 or 2: an 8-bit KV cache of int8 or
//                            e4m3 codes (DiffxKvFormat) with per-channel scales
// Exit status 0 when every case ran and wrote finite outputs; 1 with a line saying which did not.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "../diff_attention.h"
#include "cuda_emulation.h"  // the emulator's own fp16/bf16 conversions

extern "C" int diffx_emulated_attention_forward(const DiffxAttentionParams* params);

namespace {

float element(const void* data, int dtype, size_t i) {
  if (dtype == DIFFX_DTYPE_FLOAT32) return static_cast<const float*>(data)[i];
  const uint16_t bits = static_cast<const uint16_t*>(data)[i];
  return dtype == DIFFX_DTYPE_FLOAT16 ? diffx_emu::half_to_float(bits) : diffx_emu::bf16_to_float(bits);
}

// A tensor of exactly `count` elements of `dtype` on the heap: one byte past it is an
// AddressSanitizer report.
struct Buffer {
  std::vector<unsigned char> bytes;
  Buffer(size_t count, int dtype) : bytes(count * (dtype == DIFFX_DTYPE_FLOAT32 ? 4 : 2)) {}
  void fill(std::mt19937& rng, int dtype, float mean, float spread) {
    std::normal_distribution<float> normal(mean, spread);
    const size_t n = bytes.size() / (dtype == DIFFX_DTYPE_FLOAT32 ? 4 : 2);
    for (size_t i = 0; i < n; ++i) set(i, dtype, normal(rng));
  }
  void set(size_t i, int dtype, float value) {
    if (dtype == DIFFX_DTYPE_FLOAT32) {
      std::memcpy(bytes.data() + 4 * i, &value, 4);
    } else {
      const uint16_t bits =
          dtype == DIFFX_DTYPE_FLOAT16 ? diffx_emu::float_to_half(value) : diffx_emu::float_to_bf16(value);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    }
  }
};

struct Case {
  int variant, heads, kv_heads, head_dim, causal, batch, q_len, kv_len, bits, dtype, masked, kv = 0;
};

bool parse(const char* text, Case& c) {
  const int fields = std::sscanf(text, "%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d", &c.variant, &c.heads, &c.kv_heads,
                                 &c.head_dim, &c.causal, &c.batch, &c.q_len, &c.kv_len, &c.bits, &c.dtype, &c.masked,
                                 &c.kv);
  return fields == 11 || fields == 12;
}

// An 8-bit cache's codes, exactly `count` bytes: int8 in -127..127, or e4m3 codes other than the NaN ones.
std::vector<unsigned char> random_codes(size_t count, int kv, std::mt19937& rng) {
  std::vector<unsigned char> codes(count);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& code : codes) {
    do code = static_cast<unsigned char>(byte(rng));
    while (kv == DIFFX_KV_INT8 ? code == 0x80 : (code & 0x7f) == 0x7f);
  }
  return codes;
}

// Runs one case; returns an empty string or what went wrong.
std::string run(const Case& c, std::mt19937& rng) {
  const bool v1 = c.variant == 1;
  const int64_t dv = v1 ? 2 * c.head_dim : c.head_dim;
  const int64_t q_width = 2LL * c.heads * c.head_dim;
  const int64_t k_width = (v1 ? 2LL : 1LL) * c.kv_heads * c.head_dim;
  const int64_t v_width = c.kv_heads * dv;
  const int64_t o_width = c.heads * dv;
  Buffer q(size_t(c.batch) * c.q_len * q_width, c.dtype), k(size_t(c.batch) * c.kv_len * k_width, c.dtype),
      v(size_t(c.batch) * c.kv_len * v_width, c.dtype), out(size_t(c.batch) * c.q_len * o_width, c.dtype);
  std::vector<unsigned char> k_codes, v_codes;
  std::vector<float> k_scale(k_width, 0.02f), v_scale(v_width, 0.01f);
  if (c.kv) {  // the codes replace key and value
    k_codes = random_codes(size_t(c.batch) * c.kv_len * k_width, c.kv, rng);
    v_codes = random_codes(size_t(c.batch) * c.kv_len * v_width, c.kv, rng);
  }
  q.fill(rng, c.dtype, 0.f, 1.f);
  k.fill(rng, c.dtype, 0.3f, 1.f);  // an offset per key: what K-smoothing removes
  v.fill(rng, c.dtype, 0.f, 1.f);
  Buffer lambda(v1 ? 1 : size_t(c.batch) * c.q_len * c.heads, c.dtype);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  for (size_t i = 0; i < lambda.bytes.size() / (c.dtype == DIFFX_DTYPE_FLOAT32 ? 4 : 2); ++i)
    lambda.set(i, c.dtype, v1 ? 0.4f : unit(rng));
  std::vector<float> weight(dv, 1.f);
  std::vector<int64_t> mask;
  if (c.masked) {
    mask.assign(size_t(c.batch) * c.kv_len, 1);
    for (int j = 0; j < c.kv_len / 2; ++j) mask[j] = 0;
  }
  const float nan = std::nanf("");
  for (size_t i = 0; i < size_t(c.batch) * c.q_len * o_width; ++i) out.set(i, c.dtype, nan);

  DiffxAttentionParams p{};
  p.query = q.bytes.data(), p.q_batch_stride = c.q_len * q_width, p.q_row_stride = q_width;
  p.key = k.bytes.data(), p.k_batch_stride = c.kv_len * k_width, p.k_row_stride = k_width;
  p.value = v.bytes.data(), p.v_batch_stride = c.kv_len * v_width, p.v_row_stride = v_width;
  p.lambda_full = lambda.bytes.data();
  if (!v1) p.lambda_batch_stride = int64_t(c.q_len) * c.heads, p.lambda_row_stride = c.heads, p.lambda_head_stride = 1;
  p.norm_weight = weight.data();
  p.output = out.bytes.data(), p.o_batch_stride = c.q_len * o_width, p.o_row_stride = o_width;
  if (c.masked) p.key_mask = mask.data(), p.mask_batch_stride = c.kv_len;
  p.dtype = c.dtype, p.variant = c.variant, p.batch = c.batch, p.q_len = c.q_len, p.kv_len = c.kv_len;
  p.num_heads = c.heads, p.num_kv_heads = c.kv_heads, p.head_dim = c.head_dim, p.causal = c.causal;
  p.norm = v1 ? 1 : 0, p.norm_eps = 1e-5f, p.output_scale = 0.8f, p.logit_bits = c.bits, p.smooth_k = 1;
  if (c.kv) {
    p.kv_format = c.kv, p.key = k_codes.data(), p.value = v_codes.data();
    p.k_scale = k_scale.data(), p.v_scale = v_scale.data();
  }

  const size_t workspace_bytes = diffx_attention_workspace_size(&p);
  void* workspace = nullptr;
  if (workspace_bytes) {  // exactly the size the library asked for, on the alignment it requires
    workspace = ::operator new(workspace_bytes, std::align_val_t(256));
    std::memset(workspace, 0xFF, workspace_bytes);  // NaN bytes: a partial state never written cannot pass
    p.workspace = workspace, p.workspace_bytes = workspace_bytes;
  }
  const int status = diffx_emulated_attention_forward(&p);
  if (workspace) ::operator delete(workspace, std::align_val_t(256));
  if (status != DIFFX_OK) return std::string("status ") + std::to_string(status) + ": " + diffx_last_error();
  for (size_t i = 0; i < size_t(c.batch) * c.q_len * o_width; ++i)
    if (!std::isfinite(element(out.bytes.data(), c.dtype, i)))
      return "output element " + std::to_string(i) + " is not finite (never written, or NaN)";
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s variant,heads,kv_heads,head_dim,causal,batch,q_len,kv_len,bits,dtype,masked[,kv] ...\n",
                 argv[0]);
    return 2;
  }
  std::mt19937 rng(1234);
  for (int i = 1; i < argc; ++i) {
    Case c;
    if (!parse(argv[i], c)) {
      std::fprintf(stderr, "bad case %s\n", argv[i]);
      return 2;
    }
    const std::string problem = run(c, rng);
    if (!problem.empty()) {
      std::printf("case %s FAILED: %s\n", argv[i], problem.c_str());
      return 1;
    }
    std::printf("case %s ok\n", argv[i]);
    std::fflush(stdout);
  }
  return 0;
}
