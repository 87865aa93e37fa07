#!/usr/bin/env bash
# Compile check of the native code, used by CI (no GPU needed):
#   1. every csrc/cuda/*.cu compiles with nvcc for the TPO_CUDA_ARCHS architectures (default
#      80;90), with the flags setup.py uses and nvcc warnings as errors;
#   2. the objects link with the pybind11 bindings against the static CUDA runtime, and the
#      resulting module imports (no undefined symbols);
#   3. cuobjdump confirms that module carries code for every architecture, and so does the
#      package's installed _C_cuda extension when there is one.
# nvcc, the toolkit, the flags and cuobjdump come from csrc/cuda_toolkit.py, the discovery
# setup.py uses. Exits non-zero on any failure, a missing cuobjdump included. Without nvcc it
# exits 0 with a message, unless TPO_REQUIRE_CUDA=1 (then a missing nvcc is a failure too).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
CUOBJDUMP_SET="${CUOBJDUMP:-}"
discovered="$("$PYTHON" csrc/cuda_toolkit.py --shell)"
eval "$discovered"
if [ -z "$NVCC" ]; then
  echo "build_native: nvcc not found; skipping the CUDA compile check"
  if [ "${TPO_REQUIRE_CUDA:-0}" != "0" ]; then exit 1; fi
  exit 0
fi
if [ -z "$CUDA_LIB" ]; then echo "build_native: libcudart_static.a not found under $CUDA_ROOT"; exit 1; fi
if [ -z "$CUOBJDUMP" ]; then
  if [ -n "${CUOBJDUMP_SET:-}" ]; then
    echo "build_native: CUOBJDUMP=$CUOBJDUMP_SET is not an executable file"
  else
    echo "build_native: cuobjdump not found (looked next to $NVCC, in $CUDA_ROOT/bin, on PATH, in"
    echo "  the nvidia/*/bin folders of Python's CUDA wheels and in Triton's bundled tools)."
    echo "  Install it (e.g. pip install nvidia-cuda-cuobjdump) or point CUOBJDUMP at it."
  fi
  exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "build_native: $("$NVCC" --version | tail -n1) (toolkit $CUDA_ROOT), archs ${CUDA_ARCHS[*]}"
echo "build_native: cuobjdump $CUOBJDUMP"

objects=()
pids=()
for src in csrc/cuda/*.cu; do
  obj="$work/$(basename "$src" .cu).o"
  echo "build_native: nvcc $src"
  "$NVCC" -c "$src" -o "$obj" "${NVCC_FLAGS[@]}" -Werror all-warnings &
  pids+=("$!")
  objects+=("$obj")
done
for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed compile fails the script

suffix="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
pybind_includes="$("$PYTHON" -m pybind11 --includes)"
module="$work/pkg/tpo_kernels/_C_cuda$suffix"
mkdir -p "$work/pkg/tpo_kernels"
echo "build_native: linking the bindings"
# shellcheck disable=SC2086
${CXX:-c++} -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -Wall -Wextra -Werror $pybind_includes \
  -Icsrc csrc/bindings_cuda.cpp "${objects[@]}" -L"$CUDA_LIB" "${CUDA_LINK_LIBS[@]}" -o "$module"
"$PYTHON" -c "
import importlib.util
spec = importlib.util.spec_from_file_location('tpo_kernels._C_cuda', '$module')
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
print('build_native: import ok; devices visible:', mod.device_count(), mod.device_error() or '')
"

# Every configured architecture must have its cubin in the module.
check_archs() {
  local elves names=""
  elves="$("$CUOBJDUMP" --list-elf "$1")"
  for arch in "${CUDA_ARCHS[@]}"; do
    if ! grep -q "sm_${arch}\.cubin" <<<"$elves"; then
      echo "build_native: $1 lacks sm_${arch} code; cuobjdump lists:"
      echo "$elves"
      exit 1
    fi
    names+=" sm_${arch}"
  done
  echo "build_native: $(basename "$1") carries code for${names}"
}
check_archs "$module"

# The installed package, located without importing it (its __init__ may need torch).
installed="$("$PYTHON" -c '
import glob, importlib.util, os
spec = importlib.util.find_spec("tpo_kernels")
for folder in (spec.submodule_search_locations or []) if spec else []:
    print(" ".join(glob.glob(os.path.join(folder, "_C_cuda*.so"))))
')"
if [ -n "${installed// /}" ]; then
  for so in $installed; do check_archs "$so"; done
elif [ "${TPO_REQUIRE_CUDA:-0}" != "0" ]; then
  echo "build_native: TPO_REQUIRE_CUDA=1 but the installed package has no _C_cuda extension"
  exit 1
fi
echo "build_native: OK"
