// Every compiled forward instantiation: (element type, head dim D, value dim DV, INT8 logits).
// CMake generates one translation unit per entry (instantiations/*.cu); the dispatcher declares
// them extern so that it never instantiates a kernel itself.
#pragma once

#define DIFFX_FOR_EACH_FWD_INSTANCE(X) \
  X(__half, 64, 128, false)            \
  X(__half, 64, 64, false)             \
  X(__half, 128, 256, false)           \
  X(__half, 128, 128, false)           \
  X(__half, 64, 128, true)             \
  X(__half, 64, 64, true)              \
  X(__half, 128, 256, true)            \
  X(__half, 128, 128, true)            \
  X(__nv_bfloat16, 64, 128, false)     \
  X(__nv_bfloat16, 64, 64, false)      \
  X(__nv_bfloat16, 128, 256, false)    \
  X(__nv_bfloat16, 128, 128, false)    \
  X(__nv_bfloat16, 64, 128, true)      \
  X(__nv_bfloat16, 64, 64, true)       \
  X(__nv_bfloat16, 128, 256, true)     \
  X(__nv_bfloat16, 128, 128, true)

// Every compiled 8-bit-cache decode instantiation: (element type, D, DV, DiffxKvFormat), fp logits.
#define DIFFX_FOR_EACH_KV_DECODE_INSTANCE(X) \
  X(__half, 64, 128, 1)                      \
  X(__half, 64, 64, 1)                       \
  X(__half, 128, 256, 1)                     \
  X(__half, 128, 128, 1)                     \
  X(__half, 64, 128, 2)                      \
  X(__half, 64, 64, 2)                       \
  X(__half, 128, 256, 2)                     \
  X(__half, 128, 128, 2)                     \
  X(__nv_bfloat16, 64, 128, 1)               \
  X(__nv_bfloat16, 64, 64, 1)                \
  X(__nv_bfloat16, 128, 256, 1)              \
  X(__nv_bfloat16, 128, 128, 1)              \
  X(__nv_bfloat16, 64, 128, 2)               \
  X(__nv_bfloat16, 64, 64, 2)                \
  X(__nv_bfloat16, 128, 256, 2)              \
  X(__nv_bfloat16, 128, 128, 2)
