// The Hopper (sm_90a) prefill path of the kernel library (diff_attention_sm90.cuh): built only when
// CMake finds CUTLASS and sm_90a is among the architectures (DIFFX_HAVE_SM90 is then defined).
#pragma once

#include <cuda_runtime.h>

#include "../kernel_args.h"

namespace diffx {

// fp16/bf16 (T: __half or __nv_bfloat16), fp or INT8 logits (args.k_codes: the key pre-pass has
// run), on an sm_90 device only (the dispatcher checks). Declared only: CMake generates one
// translation unit per DIFFX_FOR_EACH_FWD_INSTANCE entry that instantiates it, so the CuTe
// kernels compile in parallel (one translation unit of 16 took ~50 s alone on a 16-core machine).
template <typename T, int D, int DV, bool INT8>
cudaError_t launch_diff_attention_sm90(const KernelArgs& args, cudaStream_t stream);

}  // namespace diffx
