#!/usr/bin/env bash
# Prepares, on the CPU machine, what the GPU campaign carries to the lent GPU machine (which has
# no network): the CUTLASS headers of the Hopper path, a build of an earlier commit to time
# against and, when TRT_INCLUDE_DIR names a folder of TensorRT's public headers (fetched from the
# NVIDIA/TensorRT repository, never committed), those headers, for the plugin and its harness
# (tests/plugin_harness). They go into ignored folders of this checkout; then the one `run` call of
# tools/README.md takes them with carry=["build-cutlass", "build-before", "build-trt"].
#
#   [TRT_INCLUDE_DIR=DIR] tools/prepare_gpu_campaign.sh [BEFORE_COMMIT]     default b8abdb8 (the build measured on 2026-11-23)
#
# Builds only the kernel library, for 90a-real (about 2 minutes on 2 cores), in a temporary git
# worktree that is removed afterwards. Exit status 0 when both folders are ready and together fit
# the 64 MiB that `run` carries.
set -euo pipefail
cd "$(dirname "$0")/.."

BEFORE="${1:-b8abdb8}"
ARCH="${CAMPAIGN_ARCH:-90a-real}"
CARRY_LIMIT_MB=64

git rev-parse --verify --quiet "$BEFORE^{commit}" > /dev/null || { echo "error: $BEFORE is not a commit here" >&2; exit 2; }
command -v nvcc > /dev/null || { echo "error: nvcc not found: the kernel library needs the CUDA compiler" >&2; exit 2; }

# 1. CUTLASS headers from the pinned wheel (pip install -e ".[kernels]").
cutlass_src=$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))' 2>/dev/null) ||
  { echo "error: nvidia-cutlass is not installed: pip install -e \".[kernels]\"" >&2; exit 2; }
[[ -f "$cutlass_src/cute/tensor.hpp" ]] || { echo "error: $cutlass_src holds no cute/tensor.hpp" >&2; exit 2; }
rm -rf build-cutlass && mkdir -p build-cutlass
cp -r "$cutlass_src" build-cutlass/include
echo "build-cutlass/include   CUTLASS headers from $cutlass_src"

# 2. The earlier commit's kernel library, built in a throw-away worktree.
worktree=$(mktemp -d "${TMPDIR:-/tmp}/diffexport-before.XXXXXX")
trap 'git worktree remove --force "$worktree" > /dev/null 2>&1 || rm -rf "$worktree"' EXIT
git worktree add --detach --quiet "$worktree" "$BEFORE"
start=$SECONDS
cmake -S "$worktree" -B "$worktree/build" -G Ninja -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DDIFFEXPORT_BUILD_PLUGIN=OFF -DDIFFEXPORT_BUILD_EMULATOR=OFF -DCUTLASS_INCLUDE_DIR="$PWD/build-cutlass/include" \
  > "$worktree/build.log" 2>&1 && cmake --build "$worktree/build" --parallel >> "$worktree/build.log" 2>&1 ||
  { tail -30 "$worktree/build.log"; echo "error: the build of $BEFORE failed" >&2; exit 1; }
rm -rf build-before && mkdir -p build-before
cp "$worktree/build/plugins/kernels/libdiffexport_kernels.so" build-before/
echo "$BEFORE $(git rev-parse "$BEFORE") $ARCH" > build-before/COMMIT
echo "build-before            libdiffexport_kernels.so of $BEFORE for $ARCH ($((SECONDS - start)) s)"

# 3. TensorRT's headers, when given.
carry='"build-cutlass", "build-before"'
rm -rf build-trt
if [[ -n "${TRT_INCLUDE_DIR:-}" ]]; then
  [[ -f "$TRT_INCLUDE_DIR/NvInferRuntime.h" && -f "$TRT_INCLUDE_DIR/NvInferVersion.h" ]] ||
    { echo "error: TRT_INCLUDE_DIR=$TRT_INCLUDE_DIR holds no NvInferRuntime.h and NvInferVersion.h" >&2; exit 2; }
  mkdir -p build-trt && cp -r "$TRT_INCLUDE_DIR" build-trt/include
  carry="$carry, \"build-trt\""
  echo "build-trt/include       TensorRT headers from $TRT_INCLUDE_DIR"
fi

# 4. What `run` will carry.
total_mb=$(du -sm build-cutlass build-before build-trt 2>/dev/null | awk '{s += $1} END {print s}')
echo "carried                 ${total_mb} MiB of at most ${CARRY_LIMIT_MB}"
(( total_mb <= CARRY_LIMIT_MB )) || { echo "error: more than the ${CARRY_LIMIT_MB} MiB that run carries" >&2; exit 1; }
cat <<EOF
next, one run call with carry=[$carry] and timeout_s=570, then give_back (tools/README.md):
  CAMPAIGN_TEST_WORKERS=14 CAMPAIGN_COMPARE="before=build-before/libdiffexport_kernels.so" tools/gpu_campaign.sh --out \$OUT --budget 540 all
EOF
