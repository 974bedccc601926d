// diffx_attention_forward and diffx_build_info: checks (params.cpp), then dispatch to the
// compiled instantiations. All math lives in diff_attention_fwd.cuh and quantize_keys.cuh.
#include <cuda_runtime.h>

#include <string>

#include "diff_attention.h"
#include "diff_attention_fwd.cuh"
#include "instances.h"
#include "kernel_args.h"
#include "quantize_keys.cuh"

#ifndef DIFFX_BUILD_ARCHS
#define DIFFX_BUILD_ARCHS "unknown"
#endif

namespace diffx {
#define DIFFX_DECLARE_EXTERN(T, D, DV, Q) \
  extern template cudaError_t launch_diff_attention<T, D, DV, Q>(const KernelArgs&, cudaStream_t);
DIFFX_FOR_EACH_FWD_INSTANCE(DIFFX_DECLARE_EXTERN)
#undef DIFFX_DECLARE_EXTERN
}  // namespace diffx

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

template <typename T, int D>
cudaError_t dispatch_head_dim(const diffx::KernelArgs& args, cudaStream_t stream) {
  const bool v1 = args.p.variant == 1;
  if (args.k_codes) {
    const cudaError_t err = diffx::launch_key_quantisation<T, D>(args, stream);
    if (err != cudaSuccess) return err;
    return v1 ? diffx::launch_diff_attention<T, D, 2 * D, true>(args, stream)
              : diffx::launch_diff_attention<T, D, D, true>(args, stream);
  }
  return v1 ? diffx::launch_diff_attention<T, D, 2 * D, false>(args, stream)
            : diffx::launch_diff_attention<T, D, D, false>(args, stream);
}

template <typename T>
cudaError_t dispatch_dtype(const diffx::KernelArgs& args, cudaStream_t stream) {
  return args.p.head_dim == 64 ? dispatch_head_dim<T, 64>(args, stream) : dispatch_head_dim<T, 128>(args, stream);
}

}  // namespace

extern "C" {

DIFFX_API const char* diffx_build_info(void) {
  static const std::string info = std::string("archs=") + DIFFX_BUILD_ARCHS + " cuda=" +
                                  std::to_string(CUDART_VERSION / 1000) + "." +
                                  std::to_string(CUDART_VERSION % 1000 / 10) + " abi=" +
                                  std::to_string(DIFFX_ABI_VERSION);
  return info.c_str();
}

DIFFX_API int diffx_attention_forward(const DiffxAttentionParams* params, void* cuda_stream) {
  diffx::clear_error();
  const int status = diffx::check_params(params);
  if (status != DIFFX_OK) return status;
  const diffx::KernelArgs args = diffx::make_kernel_args(*params);
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cuda_failure(err, "no usable CUDA device");
  const cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  err = params->dtype == DIFFX_DTYPE_FLOAT16 ? dispatch_dtype<__half>(args, stream)
                                             : dispatch_dtype<__nv_bfloat16>(args, stream);
  if (err != cudaSuccess) return cuda_failure(err, "kernel launch failed");
  return DIFFX_OK;
}

}  // extern "C"
