#!/usr/bin/env bash
# One-shot GPU check for a machine with a CUDA GPU and no network (bench/README.md, "Checking an
# offline GPU machine").
#
#   bash bench/gpu_check.sh OUT_DIR
#
# 1. builds the C++/CUDA extensions in place (setup.py build_ext --inplace),
# 2. prints `tpo-kernels status` and runs the demo on the GPU,
# 3. runs the GPU tests (pytest -m gpu, then the rest of the suite on the GPU; TRITON_INTERPRET
#    unset),
# 4. runs the GPU presets (logits-speedup-gpu, fused-linear-gpu, token-level-speedup-gpu) with
#    reduced repetitions through `python -m tpo_kernels.bench` (= `tpo-kernels bench`),
# and writes at most 8 files under OUT_DIR: summary.txt env.txt build.log tests.log bench.log
# status.txt results.json results.md. Budgeted to finish in under 8 minutes on an H200.
# The package used is this checkout's (built in place, first on PYTHONPATH); the results name its
# commit when tpo_kernels/_build_info.py (written by any setup.py build, git-ignored) was carried
# along, else 'unknown'.
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET (seconds, default 450),
# GPU_CHECK_SKIP_BUILD=1 (reuse a build already in place), GPU_CHECK_TESTS (test paths, default tests).
#
# Wheels for packages the machine lacks (e.g. liger-kernel, cut-cross-entropy) can be put in
# .whl/ at the repository root: they are installed into /tmp/site first (no network needed).
set -u
OUT="${1:?usage: bash bench/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
START=$(date +%s)
TOTAL_BUDGET="${GPU_CHECK_BUDGET:-450}"  # seconds; the hard limit asked for is 480
elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[gpu_check +$(elapsed)s] $*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

# carried wheels (optional)
if ls .whl/*.whl >/dev/null 2>&1; then
  log "installing carried wheels from .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUT/build.log" 2>&1 && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || log "wheel install failed (see build.log)"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
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
for name in ("matplotlib", "hypothesis", "pybind11", "liger_kernel", "cut_cross_entropy"):
    try:
        m = __import__(name); print(name, getattr(m, "__version__", "?"))
    except Exception as e:
        print(name, "missing:", type(e).__name__)
EOF
} > "$OUT/env.txt" 2>&1
log "env: $(grep -E '^(torch|device:)' "$OUT/env.txt" | tr '\n' ' ')"

# 1. build the extensions in place (CUDA targets: only this GPU's arch, to keep nvcc short)
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  log "build skipped (GPU_CHECK_SKIP_BUILD=1)"
elif [ -f setup.py ]; then
  ARCH="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")' 2>/dev/null || echo 90)"
  export TPO_CUDA_ARCHS="${TPO_CUDA_ARCHS:-$ARCH}"
  log "building extensions (setup.py build_ext --inplace, arch sm_$ARCH)"
  timeout 200 "$PY" setup.py build_ext --inplace >> "$OUT/build.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    log "build ok"
  else
    log "build FAILED (rc $rc$([ $rc = 124 ] && echo ', time limit'); see build.log); continuing with what imports"
  fi
else
  log "no setup.py: nothing to build" | tee -a "$OUT/build.log"
fi

# 2. status and demo (and which tpo_kernels that is: location, version, commit)
{ "$PY" -c 'from tpo_kernels.bench.machine import package_info; print("tpo_kernels:", package_info())'
  "$PY" -m tpo_kernels status; echo; timeout 60 "$PY" -m tpo_kernels demo; } > "$OUT/status.txt" 2>&1
log "status: $(tr '\n' ' ' < "$OUT/status.txt" | cut -c1-400)"

# 3. GPU tests: the ones marked gpu, then the rest of the suite, which runs the Triton and CUDA
#    kernels on the GPU when one is present (the harness's own CPU test is left out)
TESTS="${GPU_CHECK_TESTS:-tests}"
REMAIN=$(( TOTAL_BUDGET - $(elapsed) ))
TEST_BUDGET=$(( REMAIN - 200 < 150 ? REMAIN - 200 : 150 ))
if [ "$TEST_BUDGET" -gt 30 ]; then
  XDIST=""
  "$PY" -c "import xdist" 2>/dev/null && XDIST="-n 8"
  log "GPU tests: pytest -m gpu, then the suite ${XDIST:+($XDIST) }(limit ${TEST_BUDGET}s in all)"
  T0=$(date +%s)
  timeout "$TEST_BUDGET" "$PY" -m pytest -q -m gpu -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
  log "pytest -m gpu rc=$?: $(tail -1 "$OUT/tests.log")"
  LEFT=$(( TEST_BUDGET - ($(date +%s) - T0) ))
  if [ "$LEFT" -gt 20 ]; then
    echo "===== full suite on the GPU (not gpu-marked; tests/test_bench.py excluded) =====" >> "$OUT/tests.log"
    timeout "$LEFT" "$PY" -m pytest -q -p no:cacheprovider $XDIST -m "not gpu" --ignore=tests/test_bench.py $TESTS >> "$OUT/tests.log" 2>&1
    rc=$?
    log "suite rc=$rc$([ $rc = 124 ] && echo ' (time limit)'): $(tail -1 "$OUT/tests.log")"
  fi
else
  log "GPU tests skipped: no time left"
fi

# 4. reduced benchmark table: the GPU presets
BENCH_BUDGET=$(( TOTAL_BUDGET - $(elapsed) - 30 ))
if [ "$BENCH_BUDGET" -gt 30 ]; then
  log "benchmarks: presets logits-speedup-gpu, fused-linear-gpu, token-level-speedup-gpu, reduced (budget ${BENCH_BUDGET}s)"
  timeout $(( BENCH_BUDGET + 25 )) "$PY" -m tpo_kernels.bench --preset logits-speedup-gpu,fused-linear-gpu,token-level-speedup-gpu --reduced --no-plots \
    --budget $(( BENCH_BUDGET - 60 > 20 ? BENCH_BUDGET - 60 : 20 )) --out "$OUT" > "$OUT/bench.log" 2>&1
  log "benchmarks rc=$?"
  sed -n '/^Targets:/,/^$/p' "$OUT/bench.log" >> "$OUT/summary.txt"
else
  log "benchmarks skipped: no time left"
fi
log "done in $(elapsed)s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
