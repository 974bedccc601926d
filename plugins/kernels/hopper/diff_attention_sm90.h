// The Hopper (sm_90a) prefill path of the kernel library (diff_attention_sm90.cu): built only when
// CMake finds CUTLASS and sm_90a is among the architectures (DIFFX_HAVE_SM90 is then defined).
#pragma once

#include <cuda_runtime.h>

#include "../kernel_args.h"

namespace diffx {

// fp16/bf16, fp or INT8 logits (args.k_codes: the key pre-pass has run), on an sm_90 device only
// (the dispatcher checks).
cudaError_t launch_diff_attention_sm90(const KernelArgs& args, cudaStream_t stream);

}  // namespace diffx
