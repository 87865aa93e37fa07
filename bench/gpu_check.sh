#!/usr/bin/env bash
# GPU check in two stages for a machine with a CUDA GPU and no network (bench/README.md,
# "Checking an offline GPU machine"). Each stage finishes in under 5 minutes on an H200 and writes
# its own summary.
#
#   bash bench/gpu_check.sh --stage 1 OUT_DIR   build; GPU-relevant tests (-rfE); logits path with
#                                               the copy-bandwidth calibration and kernel-only times
#   bash bench/gpu_check.sh --stage 2 OUT_DIR   no rebuild (reuses stage 1's in-place build): fused
#                                               linear and token level (uniform and Zipf candidates),
#                                               then the rest of the test suite while time is left
#   bash bench/gpu_check.sh --dry-run --stage N OUT_DIR
#                                               print the plan and each step's time budget; run
#                                               nothing (works without a GPU; CI runs it)
#
# Files: OUT_DIR/stage<N>/summary.txt (timeline, verdicts, failed tests), env.txt, and per step
# a log; the benchmark tables in OUT_DIR/stage<N>/<preset>/results.{json,md}.
# Versions: bench/gpu_machine_versions.txt lists the GPU machine's (torch, Triton, numpy,
# setuptools) that CI's compatibility job tests; the env step prints what it finds beside them.
# Every step runs under its own time limit (timeout; pytest gets SIGINT first, so it still prints
# its -rfE summary), cut further so that the stage ends by its deadline.
#
# Environment: PYTHON (default python3); GPU_CHECK_BUDGET (seconds per stage, default 285, at
# most 295); GPU_CHECK_SKIP_BUILD=1 (stage 1: reuse a build in place); GPU_CHECK_GPU_TESTS (the
# pytest -k expression of the GPU-relevant tests, default "gpu or triton or cuda"); GPU_CHECK_TESTS
# (test paths, default tests); TPO_CUDA_ARCHS (default: the GPU's own arch, decided once for the
# stage, so the build and the tests that check it agree). Wheels in .whl/ at the repository root
# are installed into /tmp/site first (no network needed).
set -u
usage() { echo "usage: bash bench/gpu_check.sh [--dry-run] --stage 1|2 OUT_DIR" >&2; exit 2; }
STAGE="" DRY=0 OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) [ $# -ge 2 ] || usage; STAGE="$2"; shift 2 ;;
    --stage=*) STAGE="${1#--stage=}"; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    -*) usage ;;
    *) [ -z "$OUT" ] || usage; OUT="$1"; shift ;;
  esac
done
[ "$STAGE" = 1 ] || [ "$STAGE" = 2 ] || usage
[ -n "$OUT" ] || usage

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-285}"
[ "$BUDGET" -le 295 ] || BUDGET=295  # each stage must end within 5 minutes
GPU_TESTS="${GPU_CHECK_GPU_TESTS:-gpu or triton or cuda}"
TESTS="${GPU_CHECK_TESTS:-tests}"
S="$OUT/stage$STAGE"
BENCH="$PY -m tpo_kernels.bench --reduced --no-plots"
XDIST=""
VERSIONS="$REPO/bench/gpu_machine_versions.txt"
# Test files that need no GPU (the harness and tooling tests; CI runs them): neither stage runs
# them, although stage 1's -k expression matches their names.
CPU_ONLY_TESTS="--ignore=tests/test_bench.py --ignore=tests/test_kernel_report.py --ignore=tests/test_gpu_check.py"

# ---------------------------------------------------------------------------- the steps
# name | seconds | what (for the plan) | command (run by bash -c; "rest": all the time left)
STEPS=()
step() { STEPS+=("$1|$2|$3|$4"); }

step env 10 "nvidia-smi, nvcc, Python/torch/Triton versions, carried wheels -> env.txt" \
  "write_env"
if [ "$STAGE" = 1 ]; then
  step build 90 "python setup.py build_ext --inplace -j N, CUDA code for this GPU's arch only -> build.log" \
    "do_build"
  step status 20 "the tpo_kernels used (location, version, commit), tpo-kernels status, demo -> status.txt" \
    "do_status"
  step gpu-tests 55 "pytest -rfE -k '$GPU_TESTS' $TESTS (Triton/CUDA kernels and gpu-marked tests; no CPU-only tooling tests) -> gpu-tests.log" \
    "do_tests gpu-tests.log -k \"\$GPU_TESTS\" $CPU_ONLY_TESTS"
  step bench-logits 110 "$BENCH --preset logits-speedup-gpu (copy calibration, kernel-only times, clocks) -> bench-logits.log" \
    "do_bench bench-logits.log logits-speedup-gpu"
else
  step check-build 10 "stage 1's build is here: tpo-kernels status (cuda backend available?) -> status.txt" \
    "do_status quick"
  step bench-fused 100 "$BENCH --preset fused-linear-gpu (vs four cuBLAS matmuls, extra memory) -> bench-fused.log" \
    "do_bench bench-fused.log fused-linear-gpu"
  step bench-token 70 "$BENCH --preset token-level-speedup-gpu (uniform and Zipf candidates) -> bench-token.log" \
    "do_bench bench-token.log token-level-speedup-gpu"
  step rest-tests rest "pytest -rfE -k 'not ($GPU_TESTS)' $TESTS (the rest of the suite, while time is left) -> rest-tests.log" \
    "do_tests rest-tests.log -k \"not (\$GPU_TESTS)\" $CPU_ONLY_TESTS"
fi

fixed_total() {
  local total=0 entry b
  for entry in "${STEPS[@]}"; do
    b="$(cut -d'|' -f2 <<<"$entry")"
    [ "$b" = rest ] || total=$(( total + b ))
  done
  echo "$total"
}

if [ "$DRY" = 1 ]; then
  FIXED="$(fixed_total)"
  echo "gpu_check stage $STAGE plan (dry run: nothing is run); stage budget ${BUDGET}s, limit 300 s"
  printf '  %-13s %8s  %s\n' step budget what
  for entry in "${STEPS[@]}"; do
    IFS='|' read -r name budget what _ <<<"$entry"
    if [ "$budget" = rest ]; then
      printf '  %-13s %7ss  %s\n' "$name" "$(( BUDGET - FIXED ))" "$what [the time left]"
    else
      printf '  %-13s %7ss  %s\n' "$name" "$budget" "$what"
    fi
  done
  printf '  %-13s %7ss\n' total "$BUDGET"
  echo "  versions CI's compatibility job tests ($(basename "$VERSIONS")): $(grep -v -e '^#' -e '^$' "$VERSIONS" | tr '\n' ' ')"
  echo "  writes $S/: summary.txt and the files named above; benchmark tables under $S/<preset>/"
  [ "$FIXED" -le "$BUDGET" ] || { echo "gpu_check: the fixed budgets (${FIXED}s) exceed the stage budget (${BUDGET}s)"; exit 1; }
  # the presets this stage runs must exist in the package here
  PRESETS="$(for entry in "${STEPS[@]}"; do grep -o 'do_bench [^ ]* [^ "]*' <<<"$entry" | awk '{print $3}'; done | tr '\n' ' ')"
  if [ -n "${PRESETS// /}" ]; then
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" - $PRESETS <<'EOF' || exit 1
import sys
from tpo_kernels.bench.presets import PRESETS
missing = [p for p in sys.argv[1:] if p not in PRESETS]
if missing:
    sys.exit(f"gpu_check: unknown bench presets {missing}")
print("  presets found: " + ", ".join(f"{p} ({PRESETS[p].device})" for p in sys.argv[1:]))
EOF
  fi
  exit 0
fi

# ---------------------------------------------------------------------------- running
mkdir -p "$S"
S="$(cd "$S" && pwd)"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PY S REPO GPU_TESTS TESTS STAGE
START=$(date +%s)
DEADLINE=$(( START + BUDGET ))
: > "$S/summary.txt"
log() { echo "[gpu_check stage $STAGE +$(( $(date +%s) - START ))s] $*" | tee -a "$S/summary.txt"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$S/wheels.log" 2>&1 && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || log "wheel install failed (see wheels.log)"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 8"
export XDIST
# Decided once: the build compiles for it, and test_native_build.py checks the build against it.
if [ -z "${TPO_CUDA_ARCHS:-}" ]; then
  TPO_CUDA_ARCHS="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")' 2>/dev/null || echo 90)"
fi
export TPO_CUDA_ARCHS VERSIONS

write_env() {
  { date -u
    nvidia-smi 2>&1 | head -20
    nvcc --version 2>&1 | tail -2
    "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton: not importable", e)
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
for name in ("setuptools", "pybind11", "matplotlib", "hypothesis", "xdist", "liger_kernel", "cut_cross_entropy"):
    try:
        m = __import__(name); print(name, getattr(m, "__version__", "?"))
    except Exception as e:
        print(name, "missing:", type(e).__name__)
EOF
    "$PY" - "$VERSIONS" <<'EOF'
import importlib.metadata as md, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
for line in open(sys.argv[1]):
    if line.strip() and not line.startswith("#"):
        want = Requirement(line.split("#")[0].strip())
        try:
            found = md.version(want.name)
        except md.PackageNotFoundError:
            found = "missing"
        same = found != "missing" and want.specifier.contains(found, prereleases=True)
        print(f"version {want.name} {found}: {'as' if same else 'NOT as'} in CI's compatibility job ({want})")
EOF
  } > "$S/env.txt" 2>&1
  grep -E '^(python|triton|setuptools|pybind11|device:)' "$S/env.txt" | tr '\n' ' '
  echo "TPO_CUDA_ARCHS=$TPO_CUDA_ARCHS"
  grep -E '^version .*: NOT as' "$S/env.txt"
  return 0
}

do_build() {
  if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then echo "skipped (GPU_CHECK_SKIP_BUILD=1)"; return 0; fi
  echo "sm_$TPO_CUDA_ARCHS"
  "$PY" setup.py build_ext --inplace -j "$(nproc 2>/dev/null || echo 8)" > "$S/build.log" 2>&1
}

do_status() {
  { "$PY" -c 'from tpo_kernels.bench.machine import package_info; print("tpo_kernels:", package_info())'
    "$PY" -m tpo_kernels status
    if [ "${1:-}" != quick ]; then echo; "$PY" -m tpo_kernels demo; fi
  } > "$S/status.txt" 2>&1
  local rc=$?
  if ls tpo_kernels/_C_cuda*.so >/dev/null 2>&1; then echo "CUDA extension in place"
  elif [ "$STAGE" = 1 ]; then echo "NO CUDA EXTENSION in place (see build.log)"
  else echo "NO CUDA EXTENSION in place (stage 2 reuses stage 1's build: same machine, or carry tpo_kernels/_C_*.so)"; fi
  return $rc
}

do_tests() {  # LOG, then pytest arguments
  local logf="$1"; shift
  # shellcheck disable=SC2086  # XDIST and TESTS are word lists
  "$PY" -m pytest -q -rfE -p no:cacheprovider $XDIST "$@" $TESTS > "$S/$logf" 2>&1
  local rc=$?
  tail -1 "$S/$logf"
  return $rc
}

do_bench() {  # LOG PRESET; the bench stops starting measurements 35 s before the step's limit
  local logf="$1" preset="$2" budget=$(( STEP_LIMIT - 35 ))
  [ "$budget" -ge 15 ] || budget=15
  $BENCH --preset "$preset" --budget "$budget" --out "$S/$preset" > "$S/$logf" 2>&1
  local rc=$?
  sed -n '/^Targets:/,/^$/p' "$S/$logf"
  return $rc
}
export -f write_env do_build do_status do_tests do_bench

log "start; budget ${BUDGET}s; repository $REPO; output $S"
FIXED="$(fixed_total)"
for entry in "${STEPS[@]}"; do
  IFS='|' read -r name budget what cmd <<<"$entry"
  now=$(date +%s)
  left=$(( DEADLINE - now - 5 ))  # 5 s for the summary
  if [ "$budget" = rest ]; then limit=$left; else limit=$(( budget < left ? budget : left )); fi
  if [ "$limit" -lt 10 ]; then
    log "$name: skipped, no time left"
    continue
  fi
  log "$name (limit ${limit}s): $what"
  export STEP_LIMIT=$limit BENCH
  out="$(timeout -s INT -k 15 "$limit" bash -c "$cmd" 2>&1)"
  rc=$?
  note=""
  [ $rc = 124 ] && note=" (time limit)"
  [ $rc = 137 ] && note=" (killed after the time limit)"
  log "$name: rc=$rc$note"
  [ -z "$out" ] || sed 's/^/    /' <<<"$out" | head -60 | tee -a "$S/summary.txt"
  if [ "$name" = gpu-tests ] || [ "$name" = rest-tests ]; then
    grep -E '^(FAILED|ERROR) ' "$S/$name.log" | head -40 | sed 's/^/    /' | tee -a "$S/summary.txt"
  fi
  preset="$(grep -o 'do_bench [^ ]* [^ "]*' <<<"$cmd" | awk '{print $3}')"
  if [ -n "$preset" ] && [ -f "$S/$preset/results.json" ] && [ ! -f "$S/$preset/results.md" ]; then
    # stopped by its time limit: tables and verdicts from what it measured (results.json is
    # written after every measurement)
    left=$(( DEADLINE - $(date +%s) - 3 ))
    if [ "$left" -ge 10 ]; then
      timeout -k 5 "$left" $BENCH --report "$S/$preset" > "$S/$preset/report.log" 2>&1
      log "$name: tables rebuilt from the partial results (rc=$?)"
      sed -n '/^Targets:/,/^$/p' "$S/$preset/report.log" | sed 's/^/    /' | tee -a "$S/summary.txt"
    fi
  fi
done
log "done in $(( $(date +%s) - START ))s; files in $S: $(ls "$S" | tr '\n' ' ')"
