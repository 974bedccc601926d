#!/usr/bin/env bash
# The GPU verification campaign (issue 16): build the kernel library for the GPU in hand, record
# the machine, run the GPU tests, the sanitizers, the benchmark and one Nsight Compute profile.
#
#   tools/gpu_campaign.sh [--out DIR] [--budget SECONDS] PART...
#       PART: env build variants test sanitize bench decode profile all (PART+PART runs two parts at once)
#
# Before the first part that launches kernels, the Hopper path (auto's choice on sm_90) is probed in a child process
# (probe_hopper); a path that hangs or faults is then left out of the tests and the bench, reported.
# Made for the lent GPU machine (15 minutes of device time a session, start-up included): each
# step has its own time limit, and --budget SECONDS (or CAMPAIGN_BUDGET) ends the whole call by
# then: each group of parts must end early enough to leave every later group its reserve
# (RESERVE below), each step's limit is clipped to that, and a part left with no time is reported
# SKIPPED and counted as failed, so one hang cannot take the later parts' results with it.
# Everything lands in at most 8 files under DIR
# (campaign.log, build.log, pytest.log, sanitizer.log, bench.md, bench.json, decode.json, profile.txt;
# the Nsight Compute reports stay in /tmp, their details and selected metrics go into profile.txt)
# (default $OUT when set, else ./campaign-out); it ends by printing tools/campaign_report.py's
# verdicts. tools/README.md gives the one call and its budget. Runs from the repository root with
# the python3 that holds torch (no install: PYTHONPATH=.). Exit status: the number of parts that
# failed or were skipped.
set -u
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-campaign-out}"
BUDGET="${CAMPAIGN_BUDGET:-}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out|--budget)
      [[ $# -ge 2 ]] || { echo "error: $1 needs a value" >&2; exit 2; }
      if [[ "$1" == --out ]]; then OUT_DIR="$2"; else BUDGET="$2"; fi
      shift 2 ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || { echo "usage: $0 [--out DIR] [--budget SECONDS] env|build|variants|test|sanitize|bench|decode|profile|all ..." >&2; exit 2; }
[[ -z "$BUDGET" || "$BUDGET" =~ ^[0-9]+$ ]] || { echo "error: --budget takes whole seconds, not '$BUDGET'" >&2; exit 2; }
[[ "${CAMPAIGN_TEST_WORKERS:-8}" =~ ^[1-9][0-9]?$ ]] ||
  { echo "error: CAMPAIGN_TEST_WORKERS takes a number of pytest workers from 1 to 99, not '$CAMPAIGN_TEST_WORKERS'" >&2; exit 2; }
for launch in ${PROFILE_PARTS:-}; do
  [[ " fused decode decode-kv8 hopper hopper-int8 variants compare " == *" $launch "* ]] ||
    { echo "error: PROFILE_PARTS takes fused, decode, decode-kv8, hopper, hopper-int8, variants and compare, not '$launch'" >&2
      exit 2; }
done
[[ "${PROFILE_DECODE_COMPARE:-fastest}" == fastest || "$PROFILE_DECODE_COMPARE" =~ ^([A-Za-z0-9_.-]+=[A-Za-z0-9_./+-]+[[:space:]]*)+$ ]] ||
  { echo "error: PROFILE_DECODE_COMPARE takes fastest or name=path pairs, not '$PROFILE_DECODE_COMPARE'" >&2; exit 2; }
mkdir -p "$OUT_DIR"
# What a carried archive may unpack to (CAMPAIGN_UNPACK_LIMIT_MB, default 1024 MiB: a library is
# about 80 MB, the CUTLASS headers 26 MB): the stream is cut one byte past it and refused, so a
# corrupt or hostile carry cannot fill the disk (64 GiB) before the parts run.
[[ "${CAMPAIGN_UNPACK_LIMIT_MB:-1024}" =~ ^[1-9][0-9]{0,5}$ ]] ||
  { echo "error: CAMPAIGN_UNPACK_LIMIT_MB takes whole MiB from 1 to 999999, not '$CAMPAIGN_UNPACK_LIMIT_MB'" >&2; exit 2; }
UNPACK_LIMIT=$(( ${CAMPAIGN_UNPACK_LIMIT_MB:-1024} * 1024 * 1024 ))
# unxz_capped PACKED FILE: PACKED's xz stream into FILE (a new file); 0 when whole and within the
# limit, 1 when it is no xz, 3 when it unpacks to more than the limit.
unxz_capped() {
  xz -dc -- "$1" 2> /dev/null | head -c $((UNPACK_LIMIT + 1)) > "$2"
  local status=("${PIPESTATUS[@]}")
  (( $(stat -c %s -- "$2") > UNPACK_LIMIT )) && return 3
  [[ ${status[0]} == 0 && ${status[1]} == 0 ]]
}
# The CUTLASS headers travel packed (tools/prepare_gpu_campaign.sh: 26 MB of headers are about 1 MB
# of xz, and `run` carries 64 MiB): unpacked here once, before any part builds, through a scratch
# folder so that no half-unpacked tree is ever build-cutlass/include.
if [[ -z "${CAMPAIGN_CUTLASS_DIR:-}" && ! -f build-cutlass/include/cute/tensor.hpp && -f build-carry/cutlass-include.tar.xz ]]; then
  unpack=$(mktemp -d "$PWD/build-cutlass.XXXXXX")
  unxz_capped build-carry/cutlass-include.tar.xz "$unpack/headers.tar"; status=$?
  if [[ $status == 0 ]] && tar -xf "$unpack/headers.tar" -C "$unpack" 2> /dev/null && rm -f "$unpack/headers.tar" &&
     [[ -f "$unpack/include/cute/tensor.hpp" ]]; then
    rm -rf build-cutlass && mv "$unpack" build-cutlass
  elif [[ $status == 3 ]]; then
    rm -rf "$unpack"
    echo "error: build-carry/cutlass-include.tar.xz unpacks to more than ${CAMPAIGN_UNPACK_LIMIT_MB:-1024} MiB (CAMPAIGN_UNPACK_LIMIT_MB)" >&2; exit 2
  else
    rm -rf "$unpack"; echo "error: build-carry/cutlass-include.tar.xz holds no CUTLASS headers (include/cute/tensor.hpp)" >&2; exit 2
  fi
fi
# The carried kernel libraries travel packed as well (a library is about ten times its xz): each
# build-NAME/libdiffexport_kernels.so.xz and build-variants/NAME/libdiffexport_kernels.so.xz
# (prepare_gpu_campaign.sh's variants, one carried path for all of them) becomes the library beside
# it, whole or not at all; none is unpacked through a link, the file's or a folder's.
# (CAMPAIGN_UNPACK_LIBRARIES=0 leaves them packed: the CPU tests' stand-in runs of this script.)
for packed in $([[ "${CAMPAIGN_UNPACK_LIBRARIES:-1}" == 0 ]] ||
                echo build-*/libdiffexport_kernels.so.xz build-variants/*/libdiffexport_kernels.so.xz); do
  # (no folder of its path a link: the one beside it, ${packed%/*}, and the top one, ${packed%%/*})
  [[ -f "$packed" && ! -L "$packed" && ! -L "${packed%/*}" && ! -L "${packed%%/*}" && ! -e "${packed%.xz}" &&
     ! -L "${packed%.xz}" ]] || continue
  partial=$(mktemp "${packed%.xz}.XXXXXX")  # a new file: nothing already there is written through
  unxz_capped "$packed" "$partial"; status=$?
  if [[ $status == 0 ]]; then
    mv "$partial" "${packed%.xz}"
  elif [[ $status == 3 ]]; then
    rm -f "$partial"
    echo "error: $packed unpacks to more than ${CAMPAIGN_UNPACK_LIMIT_MB:-1024} MiB (CAMPAIGN_UNPACK_LIMIT_MB)" >&2; exit 2
  else
    rm -f "$partial"; echo "error: $packed is not a packed kernel library (xz)" >&2; exit 2
  fi
done
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
BUILD_DIR="${CAMPAIGN_BUILD_DIR:-build-gpu}"
BUILD_DIR=$(realpath -m -s "$BUILD_DIR")  # absolute: the paths below are handed to other programs
ARCH="${CAMPAIGN_ARCH:-90a-real}"
# The library the suite, the sanitizers and the benches take as "this build": the build's own, or one
# the call names (e.g. a carried build-variants/NAME library, a candidate default: its options then
# run the GPU suite and the sanitizers); absolute, as the tests' child processes run elsewhere.
export DIFFEXPORT_KERNEL_LIB=$(realpath -m -s "${DIFFEXPORT_KERNEL_LIB:-$BUILD_DIR/plugins/kernels/libdiffexport_kernels.so}")
export DIFFEXPORT_REQUIRE_KERNELS=1   # a missing library fails the GPU tests instead of skipping them
failed=0

# Seconds a part needs to say something useful; under --budget, the earlier groups leave this much
# to each later group. Each must exceed its steps' kill grace + 5 s (pytest 20, benches 15, build, ncu and
# sanitizers 10), else its steps are left no time. CAMPAIGN_RESERVE="part=seconds ..." overrides
# (tests/test_gpu_campaign_budget.py).
# Seconds a probe may take: its launches take ~6 s on an H200 with start-up, and a hang (the
# cluster variant's, 2026-11-28) costs the whole limit, out of the parts after it.
PROBE_LIMIT=30
declare -A RESERVE=([env]=10 [build]=60 [variants]=0 [test]=150 [sanitize]=60 [bench]=90 [decode]=60 [profile]=60)
for spec in ${CAMPAIGN_RESERVE:-}; do RESERVE[${spec%%=*}]="${spec#*=}"; done
GROUP_END=""   # SECONDS by which the running group must end (set per group under --budget)

note() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT_DIR/campaign.log"; }

# limit CAP [GRACE]: the time limit of one step: CAP, clipped so that the step and GRACE seconds
# after it (a killed program's clean-up) end with the group. Fails when under 5 s would be left.
limit() {
  local cap=$1 grace=${2:-0}
  if [[ -n "$GROUP_END" ]]; then
    local left=$((GROUP_END - SECONDS - grace))
    (( left < cap )) && cap=$left
  fi
  echo "$cap"
  (( cap >= 5 ))
}

# timed CAP GRACE LABEL COMMAND...: COMMAND under its limit; SIGINT first, so pytest and the benches
# still print what they have (pytest its failures so far), then KILL after GRACE seconds.
timed() {
  local cap=$1 grace=$2 label=$3 t rc
  shift 3
  t=$(limit "$cap" "$grace") || { echo "$label: SKIPPED, no time left in the budget" >&2; return 124; }
  timeout -s INT -k "$grace" "$t" "$@"
  rc=$?
  (( rc == 124 || rc == 137 )) && echo "$label: stopped at its time limit of ${t} s" >&2
  return $rc
}

part_env() {
  {
    date -u; uname -srm
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu,persistence_mode \
      --format=csv
    nvidia-smi -q -d CLOCK,PERFORMANCE | sed -n '1,60p'
    nvcc --version | tail -2
    "$PY" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} cuda {torch.version.cuda} cudnn {torch.backends.cudnn.version()}")
print(f"device {p.name} sm_{p.major}{p.minor} SMs {p.multi_processor_count} "
      f"L2 {p.L2_cache_size >> 20} MiB memory {p.total_memory >> 30} GiB")
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except ImportError:
    print("flash_attn not installed (baselines use torch SDPA)")
EOF
  } 2>&1 | tee -a "$OUT_DIR/campaign.log"
}

# The Hopper path needs CUTLASS headers; the GPU machine has no network, so they are carried
# (tools/README.md): CAMPAIGN_CUTLASS_DIR, default build-cutlass/include when present (unpacked above
# from build-carry/cutlass-include.tar.xz when carried packed).
cutlass_dir() {
  if [[ -n "${CAMPAIGN_CUTLASS_DIR:-}" ]]; then echo "$CAMPAIGN_CUTLASS_DIR"
  elif [[ -f build-cutlass/include/cute/tensor.hpp ]]; then echo "$PWD/build-cutlass/include"; fi
}

part_build() {
  local start=$SECONDS
  local cutlass
  cutlass=$(cutlass_dir)
  # The TensorRT plugin and its harness (tests/plugin_harness) need TensorRT's public headers, carried
  # like CUTLASS's (tools/prepare_gpu_campaign.sh): CAMPAIGN_TRT_DIR, default build-trt/include.
  local trt="${CAMPAIGN_TRT_DIR:-}"
  [[ -z "$trt" && -f build-trt/include/NvInferRuntime.h ]] && trt="$PWD/build-trt/include"
  {
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
      -DDIFFEXPORT_BUILD_PLUGIN=$([[ -n "$trt" ]] && echo ON || echo OFF) ${trt:+-DTensorRT_INCLUDE_DIR="$trt"} \
      -DDIFFEXPORT_BUILD_EMULATOR=OFF ${cutlass:+-DCUTLASS_INCLUDE_DIR="$cutlass"} &&
      timed 300 10 build cmake --build "$BUILD_DIR" --parallel
  } > "$OUT_DIR/build.log" 2>&1 || { tail -30 "$OUT_DIR/build.log"; return 1; }
  grep "diffexport:" "$OUT_DIR/build.log" | tee -a "$OUT_DIR/campaign.log"
  echo "build: $((SECONDS - start)) s for $ARCH" | tee -a "$OUT_DIR/build.log"
  # Registers, shared memory and stack frames per kernel (spills show as a non-zero STACK).
  cuobjdump --dump-resource-usage "$DIFFEXPORT_KERNEL_LIB" 2>&1 | grep -E "Function|REG" >> "$OUT_DIR/build.log"
  "$PY" -c "from diffexport.kernel import kernels; print(kernels.build_info())" | tee -a "$OUT_DIR/build.log"
}

# CAMPAIGN_VARIANTS="name:nvcc flags ..." builds more libraries (e.g. "slack8:-DDIFFX_SM90_RESCALE_SLACK=8";
# commas separate a variant's flags: "both:-DDIFFX_SM90_CLUSTER_M=2,-DDIFFX_SM90_KEY_BLOCK=128"),
# and the bench times each beside this checkout's build, with any CAMPAIGN_COMPARE="name=path"
# (e.g. a carried build of the previous commit). The suite runs on one library (DIFFEXPORT_KERNEL_LIB), so each
# variant's Hopper paths are probed against the float32 reference first (diffexport/kernel/kernel_probe.py,
# a child process each); a variant that fails its probe is left out of the bench, reported.
# (Parts run in subshells: a dropped variant is a file in its build folder, probe-failed.)
# variant_flags "name:-DA=1,-DB=2": the variant's nvcc flags, space-separated (commas separate them in the spec).
variant_flags() { local flags="${1#*:}"; echo "${flags//,/ }"; }

part_variants() {
  local spec name flags cutlass dir probe verdict rc=0
  cutlass=$(cutlass_dir)
  for spec in ${CAMPAIGN_VARIANTS:-}; do
    name="${spec%%:*}"; flags=$(variant_flags "$spec"); dir="$BUILD_DIR-$name"
    mkdir -p "$dir" && rm -f "$dir/probe-failed"
    # With the same CUTLASS headers as the main build, so that a variant has its Hopper path too.
    if ! { cmake -S . -B "$dir" -G Ninja -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DDIFFEXPORT_BUILD_PLUGIN=OFF \
        -DDIFFEXPORT_BUILD_EMULATOR=OFF ${cutlass:+-DCUTLASS_INCLUDE_DIR="$cutlass"} -DCMAKE_CUDA_FLAGS="$flags" >> "$OUT_DIR/build.log" 2>&1 &&
        timed 300 10 "variant $name build" cmake --build "$dir" --parallel >> "$OUT_DIR/build.log" 2>&1; }; then
      note "variant $name ($flags): build FAILED"; echo "build failed" > "$dir/probe-failed"; rc=1; continue
    fi
    echo "variant $name ($flags) built" | tee -a "$OUT_DIR/build.log"
    for probe in hopper hopper-int8; do
      verdict=$(DIFFEXPORT_KERNEL_LIB="$dir/plugins/kernels/libdiffexport_kernels.so" \
        timed "$PROBE_LIMIT" 5 "variant $name $probe probe" "$PY" -m diffexport.kernel.kernel_probe "$probe" 2>&1 | tail -1)
      note "variant $name, $probe probe: ${verdict:-failed: the probe printed nothing}"
      if [[ "$verdict" != ok* && "$verdict" != *"needs an sm_90 GPU"* ]]; then  # (not an sm_90 GPU: nothing to probe)
        echo "$probe: $verdict" > "$dir/probe-failed"; rc=1; break
      fi
    done
  done
  return $rc
}

# A variant whose every flag is -DDIFFX_SM90_* changes the Hopper path only: the bench times it there
# alone (--hopper-variants: no mma.sync columns, left out of decode), the rest as whole builds.
# `compare_args decode`: CAMPAIGN_DECODE_COMPARE="name=path ..." too, builds that differ from this one
# in the decode kernels only (their prefill would time this build's code again).
compare_args() {
  local spec dir flag only list=(${CAMPAIGN_COMPARE:-}) hopper=()
  [[ "${1:-}" == decode ]] && list+=(${CAMPAIGN_DECODE_COMPARE:-})
  for spec in ${CAMPAIGN_VARIANTS:-}; do
    dir="$BUILD_DIR-${spec%%:*}"
    [[ -f "$dir/probe-failed" ]] && continue
    only=1
    for flag in $(variant_flags "$spec"); do [[ "$flag" == -DDIFFX_SM90_* ]] || only=0; done
    if (( only )); then hopper+=("${spec%%:*}=$dir/plugins/kernels/libdiffexport_kernels.so")
    else list+=("${spec%%:*}=$dir/plugins/kernels/libdiffexport_kernels.so"); fi
  done
  [[ ${#list[@]} -gt 0 ]] && echo -n "--compare ${list[*]} "
  [[ ${#hopper[@]} -gt 0 ]] && echo -n "--hopper-variants ${hopper[*]}"
  echo
}

part_test() {
  # First what users run on their GPU: every kernel path against the torch reference, each in a child process.
  timed 120 10 "kernels --check" "$PY" -m diffexport kernels --check > "$OUT_DIR/pytest.log" 2>&1
  local check_rc=$?
  grep -E "^(check|result|error|kernels --check)" "$OUT_DIR/pytest.log"
  # The GPU suites, sanitizers excluded (their own part); -n spreads the CPU-side float64 oracles.
  # 369 cases took about 200 s on an H200 (2026-11-26) with 8 or 14 workers: single tests of 35-47 s
  # (the 70k-key decode oracles, quant-sweep, the CUDA training run) set the floor.
  # -v puts each result in the log as it comes, so a run stopped at its limit still says what passed.
  # CAMPAIGN_TEST_FILTER (a pytest -k expression) narrows them for a short rerun.
  # The plugin harness cases (tests/test_plugin_harness.py) run where build-trt/include was carried
  # (part build then builds the plugin and the harness); else they are skipped, and reported so.
  local require_harness=""
  [[ -f "$BUILD_DIR/tests/plugin_harness/diffexport_plugin_harness" ]] && require_harness=1
  DIFFEXPORT_PLUGIN_HARNESS="$BUILD_DIR/tests/plugin_harness/diffexport_plugin_harness" \
    DIFFEXPORT_PLUGIN_LIB="$BUILD_DIR/plugins/tensorrt/libdiffexport_plugins.so" \
    DIFFEXPORT_REQUIRE_PLUGIN_HARNESS="$require_harness" \
    timed "${TEST_TIMEOUT:-420}" 20 pytest "$PY" -m pytest -p no:cacheprovider -v -rfEs --durations=15 -m "gpu or plugin_harness" \
    -n "${CAMPAIGN_TEST_WORKERS:-8}" \
    tests/test_plugin_harness.py tests/test_kernel_gpu.py tests/test_reference_gpu.py tests/test_export_gpu.py \
    tests/test_kernel_abi.py -k "not compute_sanitizer${CAMPAIGN_TEST_FILTER:+ and ($CAMPAIGN_TEST_FILTER)}" >> "$OUT_DIR/pytest.log" 2>&1
  local rc=$?
  tail -25 "$OUT_DIR/pytest.log"
  return $((rc != 0 || check_rc != 0))
}

part_sanitize() {
  # tests/kernel_cases.py: short, odd, GQA, decode, INT8 and key-mask launches. Only our kernels
  # are instrumented (kns=diffx): torch's own kernels would make the run ten times longer.
  # The runs go at once, racecheck (the slowest: 86 s alone on an H100, 2026-11-26) once per kernel
  # path: one after another they needed more than the group's time (2026-11-26, H200: racecheck
  # stopped at its 130 s in the mma cases, synccheck cut by the group's end; 2026-11-28, H200: the
  # mma racecheck again stopped, at 132 s, so kernel_cases.py's mma run now leaves auto the long
  # decode-sized calls, which there were the one-pass kernel walking 5000 keys in 8 CTAs). Each
  # writes its own log (in a temporary folder), appended to sanitizer.log in this order once all have ended.
  local runs=(memcheck initcheck racecheck:auto racecheck:mma synccheck) run tool path rc=0 i status
  local logs pids=()
  logs=$(mktemp -d "${TMPDIR:-/tmp}/campaign-sanitizer.XXXXXX")
  for run in "${runs[@]}"; do
    tool=${run%%:*}; path=${run#"$tool"}; path=${path#:}
    timed "$([[ $tool == racecheck ]] && echo 200 || echo 120)" 10 "$tool${path:+ ($path)}" \
      compute-sanitizer --tool "$tool" --kernel-name kns=diffx --error-exitcode 99 \
      "$PY" tests/kernel_cases.py $path > "$logs/$tool-$path.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!runs[@]}"; do
    run=${runs[$i]}; tool=${run%%:*}; path=${run#"$tool"}; path=${path#:}
    wait "${pids[$i]}"
    status=$?
    (( status == 0 )) || { rc=1; echo "$tool${path:+ ($path)} FAILED"; }
    { echo "--- $tool${path:+ ($path)}"; cat "$logs/$tool-$path.log"; echo "$tool${path:+ ($path)}: exit status $status"; } \
      >> "$OUT_DIR/sanitizer.log"
    grep -E "SUMMARY" "$logs/$tool-$path.log" | tail -1
  done
  rm -rf "$logs"
  return $rc
}

part_bench() {
  timed "${BENCH_TIMEOUT:-300}" 15 bench "$PY" tools/bench_attention.py --json "$OUT_DIR/bench.json" ${BENCH_ARGS:-} $(compare_args) \
    > "$OUT_DIR/bench.md" 2>> "$OUT_DIR/campaign.log"
  local rc=$?
  rm -f "$OUT_DIR"/*.partial   # a rewrite the time limit cut off; bench.json holds the cases before it
  cat "$OUT_DIR/bench.md"
  # The Hopper path's fixed cost per CTA (what a persistent scheduler could overlap), each build with
  # the path; about 20 s. Only on an sm_90 GPU whose library passed the Hopper probe.
  if [[ "${DIFFEXPORT_PROBE_HOPPER:-}" == ok* ]]; then
    { echo; echo "--- the Hopper path's fixed cost per CTA"
      timed "${CTA_COST_TIMEOUT:-90}" 15 "CTA cost" "$PY" tools/bench_attention.py --cta-cost \
        --json "$OUT_DIR/cta_cost.json" $(compare_args) 2>> "$OUT_DIR/campaign.log"; } | tee -a "$OUT_DIR/bench.md"
    (( PIPESTATUS[0] == 0 )) || rc=1
    rm -f "$OUT_DIR"/*.partial
  fi
  return $rc
}

part_decode() {
  # The split-KV decode kernels vs the one-pass kernel and the compositions, in GB/s (table appended to bench.md).
  # Other builds (CAMPAIGN_COMPARE, CAMPAIGN_DECODE_COMPARE, CAMPAIGN_VARIANTS) time the same split-KV calls beside this one.
  timed "${DECODE_TIMEOUT:-300}" 15 decode "$PY" tools/bench_attention.py --decode --json "$OUT_DIR/decode.json" \
    ${DECODE_ARGS:-} $(compare_args decode) > "$OUT_DIR/decode.md" 2>> "$OUT_DIR/campaign.log"
  local rc=$?
  rm -f "$OUT_DIR"/*.partial
  { echo; echo "--- decode"; cat "$OUT_DIR/decode.md"; } >> "$OUT_DIR/bench.md"
  cat "$OUT_DIR/decode.md"
  rm -f "$OUT_DIR/decode.md"
  return $rc
}

# stall_sites REPORT KERNEL TITLE LIBRARY: the launch's warp-state samples per SASS instruction (ncu's
# source page, condensed by tools/ncu_stall_sites.py) and per source line (the library's line
# information) as the section "where the warps wait, TITLE": which instructions and statements a
# kernel's time goes to and why, where the raw page has only the kernel's sums.
stall_sites() {
  local report=$1 kernel=$2 title=$3 library=$4
  if timed 40 5 "stall sites ($title)" ncu --import "$report" --page source --csv --print-source sass \
      > "$report.source.csv" 2>> "$OUT_DIR/campaign.log"; then
    timed 60 5 "source lines ($title)" "$PY" tools/ncu_stall_sites.py "$report.source.csv" --kernel "$kernel" \
      --title "$title" --library "$library" --arch "sm_${ARCH%%-*}" >> "$OUT_DIR/profile.txt" 2>&1
  else
    printf -- '--- where the warps wait, %s\nthe source page export FAILED\n' "$title" >> "$OUT_DIR/profile.txt"
  fi
  rm -f "$report.source.csv"
}

# profile_decode WHAT NAME [BENCH ARGS...]: one split-KV decode call at 32k keys under Nsight Compute,
# its two kernels' details as the sections "split-KV decode [merge] kernel<WHAT>, Sq=1, 32768 keys".
profile_decode() {
  local what=$1 name=$2
  shift 2
  if timed 120 10 "profile ($name)" ncu --clock-control none --set full --kernel-name regex:diff_attention_decode \
      --launch-skip 6 --launch-count 2 -f -o "/tmp/profile-$name" "$PY" tools/bench_attention.py --profile-decode 32768 \
      "$@" > /dev/null 2>&1; then
    ncu --import "/tmp/profile-$name.ncu-rep" --page details 2>&1 |
      awk -v what="$what" '/Context/ && /diff_attention_decode_merge_kernel/ { print "--- split-KV decode merge kernel" what ", Sq=1, 32768 keys" }
           /Context/ && /diff_attention_decode_kernel/ { print "--- split-KV decode kernel" what ", Sq=1, 32768 keys" } { print }' |
      grep -E "^---|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Registers Per|Achieved Occupancy|Theoretical Occ|Waves Per SM|Grid Size|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued" \
      >> "$OUT_DIR/profile.txt"
    # The split kernel's stall reasons, issue activity and pipes (not the merge's): what limits it.
    { echo "--- selected raw metrics, split-KV decode kernel$what"
      ncu --import "/tmp/profile-$name.ncu-rep" --page raw 2>&1 |
        awk '/Context/ { keep = /diff_attention_decode_kernel/ } keep' | grep -E "$PROFILE_METRICS"; } >> "$OUT_DIR/profile.txt"
    stall_sites "/tmp/profile-$name.ncu-rep" diff_attention_decode_kernel "split-KV decode kernel$what, Sq=1, 32768 keys" \
      "$DIFFEXPORT_KERNEL_LIB"
  else
    echo "--- split-KV decode profile$what FAILED" >> "$OUT_DIR/profile.txt"
  fi
}

profiling() { [[ " $PROFILE_PARTS " == *" $1 "* ]]; }

# The carried decode builds whose int8 launch the profile takes beside this build's:
# PROFILE_DECODE_COMPARE ("name=path ..."; unset: every CAMPAIGN_DECODE_COMPARE build), or
# "fastest": the one whose int8 cache calls this call's decode part timed fastest with cosine >= 0.999
# (campaign_report.py --fastest-kv8), so that one call times every build and profiles the best.
profiled_decode_builds() {
  local chosen="${PROFILE_DECODE_COMPARE-${CAMPAIGN_DECODE_COMPARE:-}}" report name spec
  [[ "$chosen" == fastest ]] || { echo "$chosen"; return; }
  report=$(timeout 30 "$PY" tools/campaign_report.py --fastest-kv8 "$OUT_DIR" 2>&1)
  if [[ $? != 0 ]]; then note "profile: campaign_report.py --fastest-kv8 FAILED: ${report##*$'\n'}" >&2; return; fi
  note "profile: $(grep -m1 '^fastest int8 cache build: ' <<< "$report")" >&2
  name=$(grep -v '^fastest int8 cache build: ' <<< "$report")
  [[ -z "$name" ]] && return
  for spec in ${CAMPAIGN_DECODE_COMPARE:-}; do [[ "${spec%%=*}" == "$name" ]] && { echo "$spec"; return; }; done
  note "profile: $name is no CAMPAIGN_DECODE_COMPARE build: not profiled" >&2
}

part_profile() {
  : > "$OUT_DIR/profile.txt"
  # One launch of the mma.sync kernel at N=4096 (bf16, d=128, non-causal), the clocks left as they
  # are (auto would take the Hopper path on sm_90, profiled below).
  if profiling fused; then
    DIFFEXPORT_KERNEL_PATH=mma timed 150 10 "profile (fused)" ncu --clock-control none --set full --kernel-name regex:diff_attention_fwd --launch-skip 3 \
      --launch-count 1 -f -o /tmp/profile "$PY" tools/bench_attention.py --profile 4096 \
      > "$OUT_DIR/profile.txt" 2>&1 || { tail -20 "$OUT_DIR/profile.txt"; return 1; }
    ncu --import /tmp/profile.ncu-rep --page details >> "$OUT_DIR/profile.txt" 2>&1
    # What limits it: tensor-pipe activity, issue slots, stall reasons, shared-memory conflicts.
    { echo "--- selected raw metrics"; ncu --import /tmp/profile.ncu-rep --page raw 2>&1 | grep -E "$PROFILE_METRICS"; } \
      >> "$OUT_DIR/profile.txt"
    stall_sites /tmp/profile.ncu-rep diff_attention_fwd "fused kernel, N=4096" "$DIFFEXPORT_KERNEL_LIB"
  fi
  # One split-KV decode call (bf16, d=128, Sq=1, 32k keys), both of its kernels (the split kernel,
  # then the merge): how close to DRAM bandwidth, and how much of the call each kernel takes; then
  # the same call on an int8 KV cache (issue 62 item 2: the codes read, converted in registers).
  # decode-kv8 alone: the int8 launches without the bf16 one (a short call's ~30 s for another launch).
  if profiling decode || profiling decode-kv8; then
    profiling decode && profile_decode "" decode
    profile_decode " on an int8 KV cache" decode-kv8 --profile-kv-cache int8
    local spec
    for spec in $(profiled_decode_builds); do  # the same int8 launch from decode-only builds: what their change did
      DIFFEXPORT_KERNEL_LIB="${spec#*=}" profile_decode " on an int8 KV cache, build ${spec%%=*}" "decode-kv8-${spec%%=*}" \
        --profile-kv-cache int8
    done
  fi
  # The same prefill launch on the Hopper path, where it passed its probe: what limits the wgmma kernel.
  if profiling hopper && [[ "${DIFFEXPORT_PROBE_HOPPER:-}" == ok* ]]; then
    if DIFFEXPORT_KERNEL_PATH=hopper timed 150 10 "profile (Hopper)" ncu --clock-control none --set full --kernel-name regex:diff_attention_sm90 \
        --launch-skip 3 --launch-count 1 -f -o /tmp/profile-hopper "$PY" tools/bench_attention.py $HOPPER_PROFILE_ARGS > /dev/null 2>&1; then
      { echo "--- Hopper path (TMA + wgmma), the same launch"; echo "launch: bench_attention.py $HOPPER_PROFILE_ARGS"; ncu --import /tmp/profile-hopper.ncu-rep --page details 2>&1 |
          grep -E "$PROFILE_DETAILS"
        echo "--- selected raw metrics, Hopper path"; ncu --import /tmp/profile-hopper.ncu-rep --page raw 2>&1 |
          grep -E "$PROFILE_METRICS"; } >> "$OUT_DIR/profile.txt"
      stall_sites /tmp/profile-hopper.ncu-rep diff_attention_sm90 "Hopper path (TMA + wgmma), the same launch" \
        "$DIFFEXPORT_KERNEL_LIB"
    else
      echo "--- Hopper path profile FAILED" >> "$OUT_DIR/profile.txt"
    fi
  fi
  # Its INT8 logits (s8 wgmma for Q.K^T), the same launch: what the INT8 recipe changes in the kernel.
  if profiling hopper-int8 && [[ "${DIFFEXPORT_PROBE_HOPPER_INT8:-}" == ok* ]]; then
    if DIFFEXPORT_KERNEL_PATH=hopper timed 150 10 "profile (Hopper INT8)" ncu --clock-control none --set full \
        --kernel-name regex:diff_attention_sm90 --launch-skip 3 --launch-count 1 -f -o /tmp/profile-hopper-int8 \
        "$PY" tools/bench_attention.py $HOPPER_PROFILE_ARGS --profile-logit-bits 8 > /dev/null 2>&1; then
      { echo "--- Hopper path INT8 logits, the same launch"; ncu --import /tmp/profile-hopper-int8.ncu-rep --page details 2>&1 |
          grep -E "$PROFILE_DETAILS"
        echo "--- selected raw metrics, Hopper path INT8"; ncu --import /tmp/profile-hopper-int8.ncu-rep --page raw 2>&1 |
          grep -E "$PROFILE_METRICS"; } >> "$OUT_DIR/profile.txt"
      stall_sites /tmp/profile-hopper-int8.ncu-rep diff_attention_sm90 "Hopper path INT8 logits, the same launch" \
        "$DIFFEXPORT_KERNEL_LIB"
    else
      echo "--- Hopper path INT8 profile FAILED" >> "$OUT_DIR/profile.txt"
    fi
  fi
  local spec name path
  # Each variant that passed its probes, on the Hopper launch: what its change did to the limits.
  if profiling variants && [[ "${DIFFEXPORT_PROBE_HOPPER:-}" == ok* ]]; then
    for spec in ${CAMPAIGN_VARIANTS:-}; do
      name="${spec%%:*}"; path="$BUILD_DIR-$name/plugins/kernels/libdiffexport_kernels.so"
      [[ -f "$BUILD_DIR-$name/probe-failed" ]] && continue  # (a failed build writes it too)
      DIFFEXPORT_KERNEL_PATH=hopper timed 150 10 "profile (Hopper, $name)" ncu --clock-control none --set full \
        --kernel-name regex:diff_attention_sm90 --launch-skip 3 --launch-count 1 -f -o "/tmp/profile-hopper-$name" \
        "$PY" tools/bench_attention.py $HOPPER_PROFILE_ARGS --profile-lib "$path" > /dev/null 2>&1 ||
        { echo "--- Hopper path profile of variant $name FAILED" >> "$OUT_DIR/profile.txt"; continue; }
      { echo "--- Hopper path, variant $name"; ncu --import "/tmp/profile-hopper-$name.ncu-rep" --page details 2>&1 |
          grep -E "$PROFILE_DETAILS"
        ncu --import "/tmp/profile-hopper-$name.ncu-rep" --page raw 2>&1 | grep -E "$PROFILE_METRICS"; } >> "$OUT_DIR/profile.txt"
      stall_sites "/tmp/profile-hopper-$name.ncu-rep" diff_attention_sm90 "Hopper path, variant $name" "$path"
    done
  fi
  for spec in $(profiling compare && echo "${CAMPAIGN_COMPARE:-}"); do  # the same launch from each carried build, metrics only
    name="${spec%%=*}"; path="${spec#*=}"
    DIFFEXPORT_KERNEL_PATH=mma timed 120 10 "profile ($name)" ncu --clock-control none --set full --kernel-name regex:diff_attention_fwd \
      --launch-skip 3 --launch-count 1 -f -o "/tmp/profile-$name" "$PY" tools/bench_attention.py --profile 4096 \
      --profile-lib "$path" > /dev/null 2>&1 || { echo "--- profile of build $name FAILED" >> "$OUT_DIR/profile.txt"; continue; }
    { echo "--- selected raw metrics, build $name"; ncu --import "/tmp/profile-$name.ncu-rep" --page raw 2>&1 |
        grep -E "$PROFILE_METRICS"; } >> "$OUT_DIR/profile.txt"
  done
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Executed Ipc A|Warp Cycles Per Issued" \
    "$OUT_DIR/profile.txt" | head -20
}

probe_hopper() {
  # Once per call, after the build: a few Hopper-path launches in a child process (diffexport/kernel/kernel_probe.py),
  # fp logits (hopper) and INT8 logits (hopper-int8). The verdicts, exported, tell the tests, kernel_cases.py
  # and the bench whether to launch that path at all: a hang or fault in their own process would cost every
  # result after it. Probed here, not under a sanitizer: kernel_cases.py's own probe would run there, torch
  # reference included (2026-11-26: initcheck spent its 80 s on the probe's torch copies).
  [[ ! -f "$DIFFEXPORT_KERNEL_LIB" ]] && return 0
  local name var out verdict
  for name in hopper hopper-int8; do
    var="DIFFEXPORT_PROBE_$(echo "$name" | tr 'a-z-' 'A-Z_')"
    [[ -n "${!var:-}" ]] && continue
    out=$(timed "$PROBE_LIMIT" 5 "$name probe" "$PY" -m diffexport.kernel.kernel_probe "$name" 2>&1)
    echo "$out" >> "$OUT_DIR/campaign.log"
    verdict=$(echo "$out" | tail -1)
    export "$var=${verdict:-failed: the probe printed nothing}"
    note "$([[ $name == hopper ]] && echo "Hopper path" || echo "Hopper INT8") probe: ${!var}"
  done
}

run_part() {
  note "part $1"
  if "part_$1"; then note "part $1 ok"; else note "part $1 FAILED"; return 1; fi
}

# PART1+PART2 runs both at once (e.g. test+sanitize: neither is timed); anything timed runs alone.
# The Hopper launches' shape (bench_attention.py's profile options): by default the mma.sync kernel's
# launch; e.g. "--profile 16384 --profile-head-dim 64" for the case furthest from its target.
HOPPER_PROFILE_ARGS="${HOPPER_PROFILE_ARGS:---profile 4096}"
# Which launches the profile part takes, in this order (a short call names only what it needs).
PROFILE_PARTS="${PROFILE_PARTS:-fused decode hopper hopper-int8 variants compare}"
# The lines of a Hopper launch's details page kept in profile.txt (campaign_report.py reads them).
PROFILE_DETAILS="Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L2 Hit Rate|Registers Per|Achieved Occupancy|Theoretical Occ|Executed Ipc A|Dynamic Shared"
PROFILE_METRICS="gpu__time_duration.sum|pipe_tensor|issue_stalled_[a-z_]+_per_issue_active|issue_active.avg.pct|bank_conflicts_pipe_lsu_mem_shared_op_(ld|st).sum |registers_per_thread|warps_active.avg.pct|inst_executed_pipe_[a-z_]+.avg.pct|smsp__inst_executed.sum |lts__t_bytes.sum.per_second|lts__t_sector_hit_rate.pct |dram__bytes_read.sum.per_second"

parts=("$@")
[[ " ${parts[*]} " == *" all "* ]] && parts=(env build variants test+sanitize bench decode profile)
for group in "${parts[@]}"; do  # every name checked before anything runs
  IFS=+ read -r -a members <<< "$group"
  for part in "${members[@]}"; do
    declare -F "part_$part" > /dev/null || { echo "unknown part: $part" >&2; exit 2; }
  done
done

# The reserve of a group: the most any of its parts needs (they run at once).
group_reserve() {
  local part most=0
  IFS=+ read -r -a members <<< "$1"
  for part in "${members[@]}"; do (( ${RESERVE[$part]:-0} > most )) && most=${RESERVE[$part]:-0}; done
  echo "$most"
}

[[ -n "$BUDGET" ]] && note "budget: $BUDGET s for ${parts[*]}"
[[ "$DIFFEXPORT_KERNEL_LIB" == "$BUILD_DIR/plugins/kernels/libdiffexport_kernels.so" ]] ||
  note "kernel library: $DIFFEXPORT_KERNEL_LIB (DIFFEXPORT_KERNEL_LIB), not this build's"
for i in "${!parts[@]}"; do
  group="${parts[$i]}"
  IFS=+ read -r -a members <<< "$group"
  if [[ -n "$BUDGET" ]]; then
    # This group ends early enough to leave each later group its reserve, and gets at least its
    # own reserve when an earlier group ran long, never past the budget.
    later=0
    for next in "${parts[@]:i+1}"; do later=$((later + $(group_reserve "$next"))); done
    GROUP_END=$((BUDGET - later))
    own=$(group_reserve "$group")
    (( GROUP_END < SECONDS + own )) && GROUP_END=$((SECONDS + own))
    (( GROUP_END > BUDGET )) && GROUP_END=$BUDGET
    if (( BUDGET - SECONDS < 5 )); then
      for part in "${members[@]}"; do note "part $part SKIPPED: the budget of $BUDGET s is spent"; done
      failed=$((failed + ${#members[@]}))
      continue
    fi
  fi
  [[ "+$group+" =~ \+(test|sanitize|bench|decode|profile)\+ ]] && probe_hopper
  pids=()
  for part in "${members[@]}"; do
    run_part "$part" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
done
note "done: $failed part(s) failed${BUDGET:+ in $SECONDS s of a $BUDGET s budget}"
# The verdicts against issue 16's targets, read from the files above (no GPU; the end of stdout is
# what a run call's reply shows first).
timeout 30 "$PY" tools/campaign_report.py "$OUT_DIR" || echo "campaign_report.py failed: read the files"
timeout 30 "$PY" tools/campaign_report.py --targets "$OUT_DIR" || echo "campaign_report.py --targets failed: read the files"
exit "$failed"
