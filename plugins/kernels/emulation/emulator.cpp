// The kernels of ../ run on the CPU through cuda_emulation.h: diffx_emulated_attention_forward
// takes the same params as diffx_attention_forward, with HOST pointers. For tests only (slow).
#include <barrier>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../convert.cuh"
#include "../diff_attention_decode.cuh"
#include "../diff_attention_fwd.cuh"
#include "../kernel_args.h"
#include "../kv_codes.cuh"
#include "../quantize_keys.cuh"

#if defined(_WIN32)
#define DIFFX_EMU_API __declspec(dllexport)
#else
#define DIFFX_EMU_API __attribute__((visibility("default")))
#endif

namespace {

// The grid's blocks one after another (x fastest, then y, then z), each from fresh shared memory
// and barriers, each thread starting with no cp.async in flight.
template <typename Body>
void run_grid(unsigned gx, unsigned gy, unsigned gz, int threads, size_t smem_bytes, Body body) {
  const uint64_t blocks = uint64_t(gx) * gy * gz;
  const auto block_idx = [&](uint64_t i) {
    return diffx_emu::Dim3{unsigned(i % gx), unsigned(i / gx % gy), unsigned(i / (uint64_t(gx) * gy))};
  };
#if DIFFX_EMU_FIBERS
  // A fiber per CUDA thread, on this thread (fibers.h).
  diffx_emu::Fibers fibers(threads);
  std::vector<diffx_emu::ThreadContext> contexts(threads);
  std::vector<void*> users(threads);
  for (int t = 0; t < threads; ++t) users[t] = &contexts[t];
  auto run_thread = [&](int) { body(); };
  for (uint64_t i = 0; i < blocks; ++i) {
    diffx_emu::Block block(threads, smem_bytes);
    for (int t = 0; t < threads; ++t) {
      contexts[t].thread_idx = {unsigned(t), 0, 0};
      contexts[t].block_idx = block_idx(i);
      contexts[t].block = &block;
      contexts[t].pending_copies.clear();
      contexts[t].group_ends.clear();
    }
    fibers.run(users.data(), run_thread, /*descending=*/i % 2 == 1);  // one block ahead-first, the next behind-first
  }
#else
  // One std::thread per CUDA thread, kept for the whole launch, meeting at `phase` between blocks
  // while this thread sets up the next block. (A new std::thread per CUDA thread per block spent
  // more time in thread creation than in the kernels.)
  std::unique_ptr<diffx_emu::Block> block;
  std::barrier<> phase(threads + 1);  // the CUDA threads and this one
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      diffx_emu::ThreadContext& c = diffx_emu::ctx();
      for (uint64_t i = 0; i < blocks; ++i) {
        phase.arrive_and_wait();  // block i is set up
        c.pending_copies.clear();
        c.group_ends.clear();
        c.thread_idx = {unsigned(t), 0, 0};
        c.block_idx = block_idx(i);
        c.block = block.get();
        body();
        phase.arrive_and_wait();  // every thread is done with block i
      }
    });
  }
  for (uint64_t i = 0; i < blocks; ++i) {
    block = std::make_unique<diffx_emu::Block>(threads, smem_bytes);
    phase.arrive_and_wait();
    phase.arrive_and_wait();
  }
  for (auto& th : pool) th.join();
#endif
}

template <typename T, int D, int DV, bool INT8, int KV, int STAGES, int KT, bool PM>
void run_decode_pipeline(const diffx::KernelArgs& args) {
  unsigned dims[3];
  diffx::decode_grid(args, dims);
  run_grid(dims[0], dims[1], dims[2], diffx::kThreads,
           diffx::DecodeTileConfig<T, D, DV, INT8, STAGES, KV, KT>::kSmemBytes,
           [&] { diffx::diff_attention_decode_kernel<T, D, DV, INT8, STAGES, KV, KT, PM>(args); });
  run_grid(args.p.num_heads, args.p.batch, args.p.q_len, diffx::kMergeThreads, diffx::kMergeSmemBytes,
           [&] { diffx::diff_attention_decode_merge_kernel<T, DV>(args); });
}

// Every pipeline the GPU build picks between (with_decode_pipeline), as a GPU whose blocks opt in to
// DIFFX_EMULATOR_SMEM_OPTIN bytes would pick: by default sm_90's 227 KB (an 8-bit cache two tiles a
// step); 101376, sm_86/sm_89's 99 KB (one tile a step at head dim 64, the fewest stages at 128); 0,
// the fewest stages (one; two for 8-bit codes), which every GPU launches.
template <typename T, int D, int DV, bool INT8, int KV>
void run_decode(const diffx::KernelArgs& args) {
  const auto smem_optin = [] {
    const char* optin = std::getenv("DIFFX_EMULATOR_SMEM_OPTIN");
    return optin ? std::atoi(optin) : 227 * 1024;
  };
  diffx::with_decode_pipeline<T, D, DV, INT8, KV>(smem_optin, args.plan.heads_per_cta * args.p.q_len, [&](auto pipe) {
    using Pipe = decltype(pipe);
    run_decode_pipeline<T, D, DV, INT8, KV, Pipe::kStages, Pipe::kKeyTiles, Pipe::kPackedMaps>(args);
  });
}

template <typename T, int D, int DV, bool INT8>
void run_attention(const diffx::KernelArgs& args) {
  unsigned dims[3];
  if (args.path == diffx::KernelPath::kDecode) {
    if (args.p.kv_format == DIFFX_KV_INT8) return run_decode<T, D, DV, false, diffx::kKvInt8>(args);
    if (args.p.kv_format == DIFFX_KV_FP8_E4M3) return run_decode<T, D, DV, false, diffx::kKvFp8>(args);
    return run_decode<T, D, DV, INT8, 0>(args);
  }
  using Cfg = diffx::TileConfig<T, D, DV, INT8>;
  diffx::attention_grid(args.p, dims);
  run_grid(dims[0], dims[1], dims[2], diffx::kThreads, Cfg::kSmemBytes,
           [&] { diffx::diff_attention_fwd_kernel<T, D, DV, INT8>(args); });
}

template <typename T, int D>
void run_head_dim(const diffx::KernelArgs& args) {
  const bool v1 = args.p.variant == 1;
  if (args.k_codes) {
    const unsigned maps = args.p.batch * args.key_maps;
    if (args.k_sums)
      run_grid(args.n_key_chunks, maps, 1, diffx::kQuantThreads, 0,
               [&] { diffx::key_sum_kernel<T, D>(args, const_cast<float*>(args.k_sums)); });
    // key_quantise_kernel reads blockIdx.x (tile) and blockIdx.y (map)
    run_grid(args.n_kv_blocks, maps, 1, diffx::kQuantThreads, 0, [&] { diffx::key_quantise_kernel<T, D>(args); });
    v1 ? run_attention<T, D, 2 * D, true>(args) : run_attention<T, D, D, true>(args);
  } else {
    v1 ? run_attention<T, D, 2 * D, false>(args) : run_attention<T, D, D, false>(args);
  }
}

template <typename T>
void run_dtype(const diffx::KernelArgs& args) {
  args.p.head_dim == 64 ? run_head_dim<T, 64>(args) : run_head_dim<T, 128>(args);
}

template <typename Src, typename Dst>
void convert(const void* src, int64_t src_batch, int64_t src_row, const void* dst, int64_t dst_batch, int64_t dst_row,
             int64_t batch, int64_t rows, int64_t width) {
  const int64_t total = batch * rows * width;
  run_grid(diffx::convert_blocks(total), 1, 1, diffx::kConvertThreads, 0, [&] {
    diffx::convert_kernel<Src, Dst>(static_cast<const Src*>(src), src_batch, src_row,
                                    static_cast<Dst*>(const_cast<void*>(dst)), dst_batch, dst_row, rows, width, total);
  });
}

void run_float32(const DiffxAttentionParams& p) {
  const DiffxAttentionParams h = diffx::half_params(p);
  const int64_t B = p.batch, Sq = p.q_len, Skv = p.kv_len;
  convert<float, __half>(p.query, p.q_batch_stride, p.q_row_stride, h.query, h.q_batch_stride, h.q_row_stride, B, Sq,
                         h.q_row_stride);
  if (p.kv_format == DIFFX_KV_SAME) {  // an 8-bit cache is read as it is
    convert<float, __half>(p.key, p.k_batch_stride, p.k_row_stride, h.key, h.k_batch_stride, h.k_row_stride, B, Skv,
                           h.k_row_stride);
    convert<float, __half>(p.value, p.v_batch_stride, p.v_row_stride, h.value, h.v_batch_stride, h.v_row_stride, B,
                           Skv, h.v_row_stride);
  }
  if (p.variant == 1) {
    convert<float, __half>(p.lambda_full, 0, 0, h.lambda_full, 0, 0, 1, 1, 1);
  } else {
    convert<float, __half>(p.lambda_full, p.lambda_batch_stride, p.lambda_row_stride, h.lambda_full,
                           h.lambda_batch_stride, h.lambda_row_stride, B, Sq, p.num_heads);
  }
  run_dtype<__half>(diffx::make_kernel_args(h));
  convert<__half, float>(h.output, h.o_batch_stride, h.o_row_stride, p.output, p.o_batch_stride, p.o_row_stride, B, Sq,
                         h.o_row_stride);
}

template <typename Dst, int FMT>
void dequantise(const void* src, int64_t src_batch, int64_t src_row, const float* scale, const void* dst, int64_t batch,
                int64_t rows, int64_t width) {
  const int64_t total = batch * rows * width;
  run_grid(diffx::convert_blocks(total), 1, 1, diffx::kConvertThreads, 0, [&] {
    diffx::dequantise_kernel<Dst, FMT>(static_cast<const uint8_t*>(src), src_batch, src_row, scale,
                                       static_cast<Dst*>(const_cast<void*>(dst)), rows, width, total);
  });
}

template <typename Dst, int FMT>
void dequantise_cache(const DiffxAttentionParams& p, const DiffxAttentionParams& d) {
  dequantise<Dst, FMT>(p.key, p.k_batch_stride, p.k_row_stride, p.k_scale, d.key, p.batch, p.kv_len, d.k_row_stride);
  dequantise<Dst, FMT>(p.value, p.v_batch_stride, p.v_row_stride, p.v_scale, d.value, p.batch, p.kv_len, d.v_row_stride);
}

template <typename Dst>
void dequantise_cache(const DiffxAttentionParams& p, const DiffxAttentionParams& d) {
  p.kv_format == DIFFX_KV_INT8 ? dequantise_cache<Dst, diffx::kKvInt8>(p, d) : dequantise_cache<Dst, diffx::kKvFp8>(p, d);
}

// DIFFX_EMULATE_FP16_ONLY (the sanitizer builds of tests/test_kernel_sanitized.py): no bf16
// instantiations, which halves the compile. bf16 and fp16 are both 2-byte elements through the
// same index arithmetic and barriers, so the sanitizers lose no access pattern; the bf16 kernels
// stay in the plain emulator's tests and in compute-sanitizer's GPU runs.
void run(const DiffxAttentionParams& p) {
  if (diffx::kv_dequantised(p)) {  // as the CUDA launcher: dequantised into the workspace, then the plain call
    const DiffxAttentionParams d = diffx::dequantised_params(p);
    if (p.dtype == DIFFX_DTYPE_FLOAT16) dequantise_cache<__half>(p, d);
#ifndef DIFFX_EMULATE_FP16_ONLY
    else if (p.dtype == DIFFX_DTYPE_BFLOAT16) dequantise_cache<__nv_bfloat16>(p, d);
#endif
    else dequantise_cache<float>(p, d);
    return run(d);
  }
  switch (p.dtype) {
    case DIFFX_DTYPE_FLOAT16: run_dtype<__half>(diffx::make_kernel_args(p)); break;
#ifndef DIFFX_EMULATE_FP16_ONLY
    case DIFFX_DTYPE_BFLOAT16: run_dtype<__nv_bfloat16>(diffx::make_kernel_args(p)); break;
#endif
    default: run_float32(p); break;
  }
}

}  // namespace

bool diffx::hopper_path_runs_here() { return false; }  // wgmma and TMA have no CPU emulation

// DIFFX_DECODE_ONE_WAVE's SM count: unknown (the fixed split target) unless a build sets one to test
// that plan (tests/test_kernel_emulated.py).
#ifndef DIFFX_EMULATED_SM_COUNT
#define DIFFX_EMULATED_SM_COUNT 0
#endif
int diffx::decode_wave_ctas(int head_dim) {
  return DIFFX_DECODE_ONE_WAVE ? DIFFX_EMULATED_SM_COUNT * (head_dim == 64 ? DIFFX_DECODE_D64_MIN_BLOCKS : 1) : 0;
}

extern "C" DIFFX_EMU_API int diffx_emulated_attention_forward(const DiffxAttentionParams* params) {
  diffx::clear_error();
  const int status = diffx::check_params(params);
  if (status != DIFFX_OK) return status;
#ifdef DIFFX_EMULATE_FP16_ONLY
  if (params->dtype == DIFFX_DTYPE_BFLOAT16)
    return diffx::record_error(DIFFX_ERR_UNSUPPORTED_DTYPE, "this emulator build has no bf16 (DIFFX_EMULATE_FP16_ONLY)");
#endif
  if (diffx::kernel_path(*params) == diffx::KernelPath::kHopper)  // wgmma and TMA have no CPU emulation
    return diffx::record_error(DIFFX_ERR_NO_KERNEL_FOR_GPU, "the CPU emulator has no Hopper path: unset DIFFEXPORT_KERNEL_PATH");
  const char* land = std::getenv("DIFFX_EMULATOR_COPIES_LAND");  // cuda_emulation.h: where a cp.async writes
  if (land && std::strcmp(land, "0") != 0 && std::strcmp(land, "1") != 0 && std::strcmp(land, "2") != 0)
    return diffx::record_error(DIFFX_ERR_BAD_ATTRIBUTE, "DIFFX_EMULATOR_COPIES_LAND is not 0 (at the wait), 1 (at the issue) or 2 (both)");
  diffx::g_copies_land = land ? land[0] - '0' : 0;
  run(*params);
  return DIFFX_OK;
}
