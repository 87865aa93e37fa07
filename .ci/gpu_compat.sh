#!/usr/bin/env bash
# CI's compatibility job: the package on the lent GPU machine's versions, on this CPU.
#
#   1. a venv with exactly bench/gpu_machine_versions.txt (torch 2.11, the CUDA 13 build PyPI has;
#      Triton 3.6; numpy < 2.4; the setuptools 65.5 a new Python 3.11 venv has) plus the test tools,
#      kept in ~/.cache/tpo_kernels/ for the next run as long as that file is unchanged (new: ~10 min
#      and ~3 GB of downloads);
#   2. the package installed there the way gpu_check builds it: that setuptools, no build isolation,
#      CPU extension only (TPO_SKIP_CUDA=1);
#   3. the kernel and semantics test files (COMPAT_TESTS), each in its own pytest process, two at a
#      time, the Triton kernels under Triton 3.6's interpreter;
#   4. the kernel report's Triton part (every Triton kernel compiled by Triton 3.6 for sm_80, sm_90);
#   5. both gpu_check dry runs with that Python.
# Every part runs even when one before it failed; the exit status is non-zero when any failed.
# Environment: GPU_COMPAT_CACHE (where the venv is kept, default ~/.cache/tpo_kernels).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VERSIONS=bench/gpu_machine_versions.txt
TOOLS=(pytest hypothesis pybind11 wheel)  # wheel: setuptools < 70.1 needs it to build a wheel

# Kernels (Triton, CPU extension, the torch backend) and the semantics of every public path, with
# torch.compile, torch.distributed and the read-back counts (both tied to torch's version); the
# longest first, so that two at a time end together.
COMPAT_TESTS=(
  tests/test_tpo_loss.py
  tests/test_precision.py
  tests/test_token_level.py
  tests/test_fused_linear.py
  tests/test_softcap.py
  tests/test_triton_kernels.py
  tests/test_distributed.py
  tests/test_cpu_extension.py
  tests/test_readbacks.py
  tests/test_compile.py
  tests/test_selective_logprobs.py
  tests/test_candidate_kernels.py
  tests/test_fused_linear_tiles.py
  tests/test_aux.py
  tests/test_strided.py
  tests/test_from_logprobs.py
  tests/test_empty_completions.py
  tests/test_mixed_dtype_head.py
  tests/test_reference.py
  tests/test_modules.py
  tests/test_native_build.py
  tests/test_bench.py::test_default_grid_plan_keeps_costly_providers_at_main_shapes
)

START=$(date +%s)
say() { echo "gpu_compat [+$(( $(date +%s) - START ))s]: $*"; }
FAILED=()

# ---------------------------------------------------------------------------- 1. the venv
CACHE="${GPU_COMPAT_CACHE:-$HOME/.cache/tpo_kernels}"
key="$( { cat "$VERSIONS"; echo "${TOOLS[*]}"; python3 --version; } | sha256sum | cut -c1-12)"
VENV="$CACHE/gpu-compat-$key"
VPY="$VENV/bin/python"
if [ -f "$VENV/.complete" ]; then
  say "reusing the venv $VENV"
else
  say "building the venv $VENV (torch's CUDA 13 build: ~3 GB of downloads)"
  rm -rf "$CACHE"/gpu-compat-*  # a venv of older versions, or an interrupted build
  mkdir -p "$CACHE"
  if python3 -m venv "$VENV" && "$VPY" -m pip install -r "$VERSIONS" "${TOOLS[@]}" > "$CACHE/gpu-compat-install.log" 2>&1; then
    touch "$VENV/.complete"
  else
    grep -v "is ignored" "$CACHE/gpu-compat-install.log" | tail -20
    say "FAILED: the venv could not be built"
    exit 1
  fi
fi
"$VPY" -c 'import platform, numpy, setuptools, torch, triton
print(f"gpu_compat: python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
      f"numpy {numpy.__version__}, setuptools {setuptools.__version__}")'

# ---------------------------------------------------------------------------- 2. the package
if TPO_SKIP_CUDA=1 "$VPY" -m pip install --no-build-isolation --no-deps -e . > "$CACHE/gpu-compat-package.log" 2>&1; then
  say "installed tpo_kernels (editable, CPU extension built by setuptools $("$VPY" -c 'import setuptools; print(setuptools.__version__)'))"
else
  grep -v "is ignored" "$CACHE/gpu-compat-package.log" | tail -30
  say "FAILED: the package does not install with these versions"
  exit 1
fi
export PYTHONPATH="$REPO"  # subprocess-based tests import this checkout
unset TRITON_INTERPRET     # tests/conftest.py sets it (no GPU); the kernel report must not have it

# ---------------------------------------------------------------------------- 3. the tests
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
run_test_file() {  # TARGET: its own pytest process; writes LOGS/<name>.{log,result}
  local name="${1//[\/:]/_}" t0 rc
  t0=$(date +%s)
  "$VPY" -m pytest -q -p no:cacheprovider -rfE "$1" > "$LOGS/$name.log" 2>&1
  rc=$?
  echo "$rc|$(( $(date +%s) - t0 ))|$(tail -1 "$LOGS/$name.log")" > "$LOGS/$name.result"
}
export -f run_test_file
export VPY LOGS
say "running ${#COMPAT_TESTS[@]} test files, two at a time"
printf '%s\n' "${COMPAT_TESTS[@]}" | xargs -P 2 -I{} bash -c 'run_test_file "$1"' _ {}
declare -A total=([passed]=0 [failed]=0 [skipped]=0 [error]=0 [deselected]=0)
for target in "${COMPAT_TESTS[@]}"; do
  name="${target//[\/:]/_}"
  IFS='|' read -r rc secs last < "$LOGS/$name.result"
  printf '  %-80s %4ss  %s\n' "$target" "$secs" "$last"
  for word in passed failed skipped error deselected; do
    n="$(grep -oE "[0-9]+ ${word}" <<<"$last" | cut -d' ' -f1)"
    total[$word]=$(( total[$word] + ${n:-0} ))
  done
  if [ "$rc" != 0 ]; then
    grep -E '^(FAILED|ERROR) ' "$LOGS/$name.log" | head -20 | sed 's/^/    /'
    FAILED+=("$target")
  fi
done
say "tests: ${total[passed]} passed, ${total[failed]} failed, ${total[error]} errors, ${total[skipped]} skipped"

# ---------------------------------------------------------------------------- 4. the kernel report
say "kernel report (Triton part) under these versions"
"$VPY" -m bench.kernel_report --triton-only > "$LOGS/kernel_report.log" 2>&1
rc=$?
# the report's first two lines (its progress lines, "kernel_report: [N s] ...", left out) and its verdict
{ grep -v '^kernel_report: \[' "$LOGS/kernel_report.log" | head -2
  sed -n '/kernel specializations checked/,$p' "$LOGS/kernel_report.log"; } | sed 's/^/  /'
[ "$rc" = 0 ] || { tail -5 "$LOGS/kernel_report.log"; FAILED+=("kernel report (exit $rc)"); }

# ---------------------------------------------------------------------------- 5. gpu_check dry runs
for stage in 1 2; do
  if PYTHON="$VPY" bash bench/gpu_check.sh --dry-run --stage "$stage" "$LOGS/gpu_check" > "$LOGS/dry$stage.log" 2>&1; then
    say "gpu_check --dry-run --stage $stage: $(grep -E 'presets found' "$LOGS/dry$stage.log")"
  else
    cat "$LOGS/dry$stage.log"
    FAILED+=("gpu_check --dry-run --stage $stage")
  fi
done

if [ "${#FAILED[@]}" != 0 ]; then
  say "FAILED: ${FAILED[*]}"
  exit 1
fi
say "OK in $(( $(date +%s) - START ))s"
