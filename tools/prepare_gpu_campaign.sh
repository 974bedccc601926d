#!/usr/bin/env bash
# Prepares, on the CPU machine, what the GPU campaign carries to the lent GPU machine (which has
# no network): the CUTLASS headers of the Hopper path, a build of an earlier commit to time
# against and, when TRT_INCLUDE_DIR names a folder of TensorRT's public headers (fetched from the
# NVIDIA/TensorRT repository, never committed), those headers, for the plugin and its harness
# (tests/plugin_harness). They go into ignored folders of this checkout; then the one `run` call of
# tools/README.md takes them with carry=["build-carry", "build-before", "build-variants", "build-trt"]
# (the CUTLASS headers packed into build-carry/cutlass-include.tar.xz and each library into
# build-before/ or build-variants/NAME/libdiffexport_kernels.so.xz, which gpu_campaign.sh unpacks).
#
#   [TRT_INCLUDE_DIR=DIR] [PREPARE_VARIANTS="name:flags ..."] tools/prepare_gpu_campaign.sh [BEFORE_COMMIT]
#                                                          default b8abdb8 (the build measured on 2026-11-23)
#
# Builds only the kernel library, for 90a-real (about 2 minutes on 2 cores), in a temporary git
# worktree that is removed afterwards. PREPARE_VARIANTS builds HEAD again with each variant's nvcc
# flags (commas separate a variant's flags, as in CAMPAIGN_VARIANTS) into build-variants/NAME/, a
# whole library the campaign times beside this one through CAMPAIGN_COMPARE, so that the GPU machine
# spends no time building it. The variants share one folder because `run` carries at most 8 paths
# (64 MiB in all, about 1.5 MiB a packed library): any number of them is one path, and a folder of
# build-variants/ that PREPARE_VARIANTS does not name is removed, so that what is carried is what
# was asked for. A folder whose library was built from the same kernel inputs (the
# commit's plugins/ but its *.md files, and CMakeLists.txt, the architecture and flags, nvcc's version, the CUTLASS
# headers: its INPUTS file) is kept as it is (PREPARE_REBUILD=1 builds every one again). Exit status
# 0 when every folder is ready and together they fit the 64 MiB that `run` carries.
set -euo pipefail
cd "$(dirname "$0")/.."

BEFORE="${1:-b8abdb8}"
ARCH="${CAMPAIGN_ARCH:-90a-real}"
CARRY_LIMIT_MB=64

git rev-parse --verify --quiet "$BEFORE^{commit}" > /dev/null || { echo "error: $BEFORE is not a commit here" >&2; exit 2; }
names=" "
for spec in ${PREPARE_VARIANTS:-}; do  # every spec checked before anything is written
  [[ "$spec" =~ ^[A-Za-z0-9_-]+:. ]] || { echo "error: PREPARE_VARIANTS takes name:flags, not '$spec'" >&2; exit 2; }
  [[ "$names" != *" ${spec%%:*} "* ]] || { echo "error: PREPARE_VARIANTS names '${spec%%:*}' twice" >&2; exit 2; }
  names+="${spec%%:*} "
done
command -v nvcc > /dev/null || { echo "error: nvcc not found: the kernel library needs the CUDA compiler" >&2; exit 2; }

# 1. CUTLASS headers from the pinned wheel (pip install -e ".[kernels]").
cutlass_src=$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))' 2>/dev/null) ||
  { echo "error: nvidia-cutlass is not installed: pip install -e \".[kernels]\"" >&2; exit 2; }
[[ -f "$cutlass_src/cute/tensor.hpp" ]] || { echo "error: $cutlass_src holds no cute/tensor.hpp" >&2; exit 2; }
rm -rf build-cutlass && mkdir -p build-cutlass
cp -r "$cutlass_src" build-cutlass/include
echo "build-cutlass/include   CUTLASS headers from $cutlass_src"

# 2. The earlier commit's kernel library, and HEAD's variants, each built in a throw-away worktree.
worktrees=()
trap 'for w in "${worktrees[@]}"; do git worktree remove --force "$w" > /dev/null 2>&1 || rm -rf "$w"; done' EXIT
# still_current FOLDER PACKED DIGEST: FOLDER holds a whole xz file PACKED made from inputs of DIGEST
# (its INPUTS file), none of them a link, and PREPARE_REBUILD is not 1.
still_current() {
  local folder=$1 packed=$1/$2
  [[ "${PREPARE_REBUILD:-0}" != 1 && -d "$folder" && ! -L "$folder" && -f "$folder/INPUTS" && ! -L "$folder/INPUTS" &&
     -f "$packed" && ! -L "$packed" && "$(head -c 100 "$folder/INPUTS")" == "$3" ]] && xz -t "$packed" 2> /dev/null
}
# kernel_inputs COMMIT "NVCC FLAGS": a digest of what decides the library a build makes.
# (plugins/ file by file but for its Markdown and the CPU emulator, which the library does not
# compile: an edit of a README beside the kernels, or of the emulation, keeps the builds)
kernel_inputs() {
  { git ls-tree -r "$1" -- plugins CMakeLists.txt | awk '!/\.md$/ && !/\tplugins\/kernels\/emulation\//'
    echo "$ARCH $2"; nvcc --version
    cat "$cutlass_src/cutlass/version.h"; } | sha256sum | cut -d' ' -f1
}
# build_library COMMIT FOLDER "NVCC FLAGS": the library of COMMIT, for ARCH, into FOLDER/ (with a
# COMMIT file, and an INPUTS file with kernel_inputs' digest), unless FOLDER already holds a whole
# library made from the same inputs (a folder or file that is a link is never taken as one).
build_library() {
  local commit=$1 folder=$2 flags=$3 worktree start=$SECONDS inputs
  inputs=$(kernel_inputs "$commit" "$flags")
  if still_current "$folder" libdiffexport_kernels.so.xz "$inputs"; then
    printf '%-23s %s\n' "$folder" "kept: built from the same kernel inputs ($(head -c 200 "$folder/COMMIT" 2> /dev/null | awk '{print $1, substr($2, 1, 7); exit}'))"
    return
  fi
  worktree=$(mktemp -d "${TMPDIR:-/tmp}/diffexport-${folder//\//-}.XXXXXX")
  worktrees+=("$worktree")
  git worktree add --detach --quiet "$worktree" "$commit"
  cmake -S "$worktree" -B "$worktree/build" -G Ninja -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    -DDIFFEXPORT_BUILD_PLUGIN=OFF -DDIFFEXPORT_BUILD_EMULATOR=OFF -DCUTLASS_INCLUDE_DIR="$PWD/build-cutlass/include" \
    ${flags:+-DCMAKE_CUDA_FLAGS="$flags"} > "$worktree/build.log" 2>&1 &&
    cmake --build "$worktree/build" --parallel >> "$worktree/build.log" 2>&1 ||
    { tail -30 "$worktree/build.log"; echo "error: the build of $commit${flags:+ ($flags)} failed" >&2; exit 1; }
  rm -rf "$folder" && mkdir -p "$folder"
  # Packed: about a tenth of the library's size, so that more builds fit what `run` carries
  # (gpu_campaign.sh unpacks it before its first part; xz -dk here gives the library back).
  xz -T0 -6 -c "$worktree/build/plugins/kernels/libdiffexport_kernels.so" > "$folder/libdiffexport_kernels.so.xz"
  echo "$commit $(git rev-parse "$commit") $ARCH${flags:+ $flags}" > "$folder/COMMIT"
  echo "$inputs" > "$folder/INPUTS"
  printf '%-23s %s\n' "$folder" "libdiffexport_kernels.so.xz of $commit${flags:+ ($flags)} for $ARCH ($((SECONDS - start)) s)"
}
build_library "$BEFORE" build-before ""
# The headers carried packed: 26 MB of files are about 1 MB of xz (gpu_campaign.sh unpacks them);
# packed again only when they differ from those packed last (build-carry/INPUTS: their digest).
headers=$(cd build-cutlass && find include -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
if still_current build-carry cutlass-include.tar.xz "$headers"; then
  echo "build-carry             kept: the same CUTLASS headers"
else
  rm -rf build-carry && mkdir -p build-carry
  tar -C build-cutlass -cJf build-carry/cutlass-include.tar.xz include
  echo "$headers" > build-carry/INPUTS
fi
carry='"build-carry", "build-before"'
variants=""
folders=(build-carry build-before)
# build-variants/ holds the variants PREPARE_VARIANTS names and nothing else (a link there is
# replaced by a folder, its target left alone).
[[ ! -L build-variants ]] || rm -f build-variants
if [[ "$names" != " " ]]; then  # (a PREPARE_VARIANTS of blanks names none)
  mkdir -p build-variants
  for folder in build-variants/* build-variants/.[!.]*; do
    [[ -e "$folder" || -L "$folder" ]] || continue
    name="${folder#build-variants/}"
    if [[ "$names" != *" $name "* ]]; then why="not a variant of PREPARE_VARIANTS"
    elif [[ -d "$folder" && ! -L "$folder" ]]; then continue
    else why="not a folder of its own (built again)"; fi
    rm -rf "$folder"; printf '%-23s %s\n' "$folder" "removed: $why"
  done
  carry="$carry, \"build-variants\""
  folders+=(build-variants)
else
  rm -rf build-variants
fi
for spec in ${PREPARE_VARIANTS:-}; do
  name="${spec%%:*}"; flags="${spec#*:}"
  build_library HEAD "build-variants/$name" "${flags//,/ }"
  variants="${variants:+$variants }$name=build-variants/$name/libdiffexport_kernels.so"
done

# 3. TensorRT's headers, when given.
rm -rf build-trt
if [[ -n "${TRT_INCLUDE_DIR:-}" ]]; then
  [[ -f "$TRT_INCLUDE_DIR/NvInferRuntime.h" && -f "$TRT_INCLUDE_DIR/NvInferVersion.h" ]] ||
    { echo "error: TRT_INCLUDE_DIR=$TRT_INCLUDE_DIR holds no NvInferRuntime.h and NvInferVersion.h" >&2; exit 2; }
  mkdir -p build-trt && cp -r "$TRT_INCLUDE_DIR" build-trt/include
  carry="$carry, \"build-trt\""
  folders+=(build-trt)
  echo "build-trt/include       TensorRT headers from $TRT_INCLUDE_DIR"
fi

# 4. What `run` will carry.
total_mb=$(du -sm --apparent-size "${folders[@]}" | awk '{s += $1} END {print s}')
echo "carried                 ${total_mb} MiB of at most ${CARRY_LIMIT_MB}"
(( total_mb <= CARRY_LIMIT_MB )) || { echo "error: more than the ${CARRY_LIMIT_MB} MiB that run carries" >&2; exit 1; }
cat <<EOF
next, run calls with carry=[$carry], then give_back: tools/README.md's "The next session"
gives them (the timings and the profile first, the suite and the sanitizers second); in general:
  CAMPAIGN_COMPARE="before=build-before/libdiffexport_kernels.so" tools/gpu_campaign.sh --out \$OUT --budget 560 env build+variants bench decode profile
  CAMPAIGN_TEST_WORKERS=14 tools/gpu_campaign.sh --out \$OUT --budget 230 test+sanitize
EOF
[[ -z "$variants" ]] || echo "with HEAD's variants in CAMPAIGN_DECODE_COMPARE (decode kernels only) or CAMPAIGN_COMPARE: $variants"
