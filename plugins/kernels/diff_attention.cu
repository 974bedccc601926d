// diffx_attention_forward and diffx_build_info: checks (params.cpp), then dispatch to the
// compiled instantiations: the one-pass kernel or, for decode-sized calls, the split-KV kernels
// (kernel_path in params.cpp decides). All math lives in diff_attention_fwd.cuh,
// diff_attention_decode.cuh and quantize_keys.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "convert.cuh"
#include "diff_attention.h"
#include "diff_attention_decode.cuh"
#include "diff_attention_fwd.cuh"
#include "instances.h"
#include "kernel_args.h"
#include "kv_codes.cuh"
#include "quantize_keys.cuh"
#ifdef DIFFX_HAVE_SM90
#include "hopper/diff_attention_sm90.h"
#endif

#ifndef DIFFX_BUILD_ARCHS
#define DIFFX_BUILD_ARCHS "unknown"
#endif

namespace diffx {
#define DIFFX_DECLARE_EXTERN(T, D, DV, Q)                                                   \
  extern template cudaError_t launch_diff_attention<T, D, DV, Q>(const KernelArgs&, cudaStream_t); \
  extern template cudaError_t launch_diff_attention_decode<T, D, DV, Q>(const KernelArgs&, cudaStream_t);
DIFFX_FOR_EACH_FWD_INSTANCE(DIFFX_DECLARE_EXTERN)
#undef DIFFX_DECLARE_EXTERN
#define DIFFX_DECLARE_EXTERN_KV(T, D, DV, KV) \
  extern template cudaError_t launch_diff_attention_decode<T, D, DV, false, KV>(const KernelArgs&, cudaStream_t);
DIFFX_FOR_EACH_KV_DECODE_INSTANCE(DIFFX_DECLARE_EXTERN_KV)
#undef DIFFX_DECLARE_EXTERN_KV
}  // namespace diffx

#ifndef DIFFX_HAVE_SM90
#define DIFFX_HAVE_SM90 0
#endif

namespace {

// An attribute of the current device, asked once per device and cached (-1 when it cannot be
// asked): the kernel choice reads these on every call.
template <cudaDeviceAttr kAttribute>
int current_device_attribute() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0 unknown, else the value + 1
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    return -1;
  }
  int known = cache[device].load(std::memory_order_relaxed);
  if (!known) {
    int value = 0;
    if (cudaDeviceGetAttribute(&value, kAttribute, device) != cudaSuccess) {
      cudaGetLastError();
      return -1;
    }
    known = value + 1;
    cache[device].store(known, std::memory_order_relaxed);
  }
  return known - 1;
}

}  // namespace

bool diffx::hopper_path_runs_here() {
  return DIFFX_HAVE_SM90 && current_device_attribute<cudaDevAttrComputeCapabilityMajor>() == 9 &&
         current_device_attribute<cudaDevAttrComputeCapabilityMinor>() == 0;
}

int diffx::decode_wave_ctas(int head_dim) {
  if (!DIFFX_DECODE_ONE_WAVE) return 0;
  const int sms = std::max(0, current_device_attribute<cudaDevAttrMultiProcessorCount>());
  return sms * (head_dim == 64 ? DIFFX_DECODE_D64_MIN_BLOCKS : 1);
}

// Whether the decode kernel's two K/V stages fit at head dim 128 (0 when unknown).
int diffx::device_smem_optin() {
  return std::max(0, current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>());
}

bool diffx::device_launches_dependents_early() {
  return current_device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9;
}

namespace {

int cuda_failure(cudaError_t err, const char* what) {
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    cudaGetLastError();
    return diffx::record_error(DIFFX_ERR_NO_KERNEL_FOR_GPU,
                               "no kernel compiled for this GPU (sm_%d%d); library built for %s: rebuild with "
                               "-DCMAKE_CUDA_ARCHITECTURES=%d%d",
                               major, minor, DIFFX_BUILD_ARCHS, major, minor);
  }
  return diffx::record_error(DIFFX_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

template <typename T, int D, int DV, bool INT8>
cudaError_t dispatch_path(const diffx::KernelArgs& args, cudaStream_t stream) {
#if DIFFX_HAVE_SM90
  if (args.path == diffx::KernelPath::kHopper) return diffx::launch_diff_attention_sm90<T, D, DV, INT8>(args, stream);
#endif
  return args.path == diffx::KernelPath::kDecode ? diffx::launch_diff_attention_decode<T, D, DV, INT8>(args, stream)
                                                 : diffx::launch_diff_attention<T, D, DV, INT8>(args, stream);
}

template <typename T, int D>
cudaError_t dispatch_head_dim(const diffx::KernelArgs& args, cudaStream_t stream) {
  const bool v1 = args.p.variant == 1;
  // An 8-bit cache reaches here on the decode path only (longer calls were dequantised).
  if (args.p.kv_format == DIFFX_KV_INT8)
    return v1 ? diffx::launch_diff_attention_decode<T, D, 2 * D, false, diffx::kKvInt8>(args, stream)
              : diffx::launch_diff_attention_decode<T, D, D, false, diffx::kKvInt8>(args, stream);
  if (args.p.kv_format == DIFFX_KV_FP8_E4M3)
    return v1 ? diffx::launch_diff_attention_decode<T, D, 2 * D, false, diffx::kKvFp8>(args, stream)
              : diffx::launch_diff_attention_decode<T, D, D, false, diffx::kKvFp8>(args, stream);
  if (args.k_codes) {
    const cudaError_t err = diffx::launch_key_quantisation<T, D>(args, stream);
    if (err != cudaSuccess) return err;
    return v1 ? dispatch_path<T, D, 2 * D, true>(args, stream) : dispatch_path<T, D, D, true>(args, stream);
  }
  return v1 ? dispatch_path<T, D, 2 * D, false>(args, stream) : dispatch_path<T, D, D, false>(args, stream);
}

template <typename T>
cudaError_t dispatch_dtype(const diffx::KernelArgs& args, cudaStream_t stream) {
  return args.p.head_dim == 64 ? dispatch_head_dim<T, 64>(args, stream) : dispatch_head_dim<T, 128>(args, stream);
}

template <typename Src, typename Dst>
cudaError_t convert(const Src* src, int64_t src_batch, int64_t src_row, Dst* dst, int64_t dst_batch, int64_t dst_row,
                    int64_t batch, int64_t rows, int64_t width, cudaStream_t stream) {
  const int64_t total = batch * rows * width;
  diffx::convert_kernel<Src, Dst><<<diffx::convert_blocks(total), diffx::kConvertThreads, 0, stream>>>(
      src, src_batch, src_row, dst, dst_batch, dst_row, rows, width, total);
  return cudaGetLastError();
}

// float32 I/O: fp32 -> fp16 copies, the fp16 kernel, fp16 -> fp32 output.
cudaError_t forward_float32(const DiffxAttentionParams& p, cudaStream_t stream) {
  const DiffxAttentionParams h = diffx::half_params(p);
  const int64_t B = p.batch, Sq = p.q_len, Skv = p.kv_len;
  const int64_t qw = h.q_row_stride, kw = h.k_row_stride, vw = h.v_row_stride, ow = h.o_row_stride;
  cudaError_t err;
  if ((err = convert(static_cast<const float*>(p.query), p.q_batch_stride, p.q_row_stride, (__half*)h.query,
                     h.q_batch_stride, qw, B, Sq, qw, stream)) != cudaSuccess) return err;
  if (p.kv_format == DIFFX_KV_SAME) {  // an 8-bit cache is read as it is
    if ((err = convert(static_cast<const float*>(p.key), p.k_batch_stride, p.k_row_stride, (__half*)h.key,
                       h.k_batch_stride, kw, B, Skv, kw, stream)) != cudaSuccess) return err;
    if ((err = convert(static_cast<const float*>(p.value), p.v_batch_stride, p.v_row_stride, (__half*)h.value,
                       h.v_batch_stride, vw, B, Skv, vw, stream)) != cudaSuccess) return err;
  }
  err = p.variant == 1 ? convert(static_cast<const float*>(p.lambda_full), 0, 0, (__half*)h.lambda_full, 0, 0, 1, 1, 1, stream)
                       : convert(static_cast<const float*>(p.lambda_full), p.lambda_batch_stride, p.lambda_row_stride,
                                 (__half*)h.lambda_full, h.lambda_batch_stride, h.lambda_row_stride, B, Sq,
                                 p.num_heads, stream);
  if (err != cudaSuccess) return err;
  if ((err = dispatch_dtype<__half>(diffx::make_kernel_args(h), stream)) != cudaSuccess) return err;
  return convert(static_cast<const __half*>(h.output), h.o_batch_stride, ow, static_cast<float*>(p.output),
                 p.o_batch_stride, p.o_row_stride, B, Sq, ow, stream);
}

template <typename Dst, int FMT>
cudaError_t dequantise(const void* src, int64_t src_batch, int64_t src_row, const float* scale, void* dst,
                       int64_t batch, int64_t rows, int64_t width, cudaStream_t stream) {
  const int64_t total = batch * rows * width;
  diffx::dequantise_kernel<Dst, FMT><<<diffx::convert_blocks(total), diffx::kConvertThreads, 0, stream>>>(
      static_cast<const uint8_t*>(src), src_batch, src_row, scale, static_cast<Dst*>(dst), rows, width, total);
  return cudaGetLastError();
}

// An 8-bit cache met by a longer call: key and value dequantised into d's workspace copies.
template <typename Dst, int FMT>
cudaError_t dequantise_cache(const DiffxAttentionParams& p, const DiffxAttentionParams& d, cudaStream_t stream) {
  const cudaError_t err = dequantise<Dst, FMT>(p.key, p.k_batch_stride, p.k_row_stride, p.k_scale, const_cast<void*>(d.key),
                                               p.batch, p.kv_len, d.k_row_stride, stream);
  if (err != cudaSuccess) return err;
  return dequantise<Dst, FMT>(p.value, p.v_batch_stride, p.v_row_stride, p.v_scale, const_cast<void*>(d.value), p.batch,
                              p.kv_len, d.v_row_stride, stream);
}

template <typename Dst>
cudaError_t dequantise_cache(const DiffxAttentionParams& p, const DiffxAttentionParams& d, cudaStream_t stream) {
  return p.kv_format == DIFFX_KV_INT8 ? dequantise_cache<Dst, diffx::kKvInt8>(p, d, stream)
                                      : dequantise_cache<Dst, diffx::kKvFp8>(p, d, stream);
}

cudaError_t run(const DiffxAttentionParams& p, cudaStream_t stream) {
  if (diffx::kv_dequantised(p)) {
    const DiffxAttentionParams d = diffx::dequantised_params(p);
    cudaError_t err = p.dtype == DIFFX_DTYPE_FLOAT16    ? dequantise_cache<__half>(p, d, stream)
                      : p.dtype == DIFFX_DTYPE_BFLOAT16 ? dequantise_cache<__nv_bfloat16>(p, d, stream)
                                                        : dequantise_cache<float>(p, d, stream);
    return err != cudaSuccess ? err : run(d, stream);
  }
  switch (p.dtype) {
    case DIFFX_DTYPE_FLOAT16: return dispatch_dtype<__half>(diffx::make_kernel_args(p), stream);
    case DIFFX_DTYPE_BFLOAT16: return dispatch_dtype<__nv_bfloat16>(diffx::make_kernel_args(p), stream);
    default: return forward_float32(p, stream);
  }
}

}  // namespace

extern "C" {

DIFFX_API const char* diffx_build_info(void) {
  static const std::string info = std::string("archs=") + DIFFX_BUILD_ARCHS + " cuda=" +
                                  std::to_string(CUDART_VERSION / 1000) + "." +
                                  std::to_string(CUDART_VERSION % 1000 / 10) + " abi=" +
                                  std::to_string(DIFFX_ABI_VERSION) + " sm90=" + std::to_string(DIFFX_HAVE_SM90);
  return info.c_str();
}

DIFFX_API int diffx_attention_forward(const DiffxAttentionParams* params, void* cuda_stream) {
  diffx::clear_error();
  const int status = diffx::check_params(params);
  if (status != DIFFX_OK) return status;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cuda_failure(err, "no usable CUDA device");
  const cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  if (diffx::kernel_path(*params) == diffx::KernelPath::kHopper) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (!DIFFX_HAVE_SM90 || major != 9 || minor != 0)
      return diffx::record_error(DIFFX_ERR_NO_KERNEL_FOR_GPU,
                                 "DIFFEXPORT_KERNEL_PATH=hopper needs an sm_90 GPU (this one is sm_%d%d) and a library "
                                 "built with the Hopper path (this one: %s); unset it for the mma.sync kernel",
                                 major, minor, DIFFX_HAVE_SM90 ? "yes" : "no, build with sm_90a and CUTLASS");
  }
  err = run(*params, stream);
  if (err != cudaSuccess) return cuda_failure(err, "kernel launch failed");
  return DIFFX_OK;
}

}  // extern "C"
