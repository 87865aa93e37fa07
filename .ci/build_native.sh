#!/usr/bin/env bash
# Compile check of the native code, used by CI (no GPU needed):
#   1. every csrc/cuda/*.cu compiles with nvcc for sm_80 and sm_90, nvcc warnings as errors;
#   2. the objects link with the pybind11 bindings against the static CUDA runtime, and the
#      resulting module imports (no undefined symbols);
#   3. if the package was installed with the CUDA extension, its .so carries sm_80 and sm_90 code.
# Exits non-zero on any failure. Without nvcc it exits 0 with a message, unless
# TPO_REQUIRE_CUDA=1 (then a missing nvcc is a failure too).
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
  echo "build_native: nvcc not found; skipping the CUDA compile check"
  if [ "${TPO_REQUIRE_CUDA:-0}" != "0" ]; then exit 1; fi
  exit 0
fi
PYTHON="${PYTHON:-python3}"
CUDA_TOP="$("$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)"
CUDA_TOP="$(cd "${CUDA_TOP:-$(dirname "$(readlink -f "$NVCC")")/..}" && pwd)"
CUDA_LIB=""
for sub in lib64 lib targets/x86_64-linux/lib targets/sbsa-linux/lib; do
  if [ -f "$CUDA_TOP/$sub/libcudart_static.a" ]; then CUDA_LIB="$CUDA_TOP/$sub"; break; fi
done
if [ -z "$CUDA_LIB" ]; then echo "build_native: libcudart_static.a not found under $CUDA_TOP"; exit 1; fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "build_native: $("$NVCC" --version | tail -n1) (toolkit $CUDA_TOP)"

objects=()
for src in csrc/cuda/*.cu; do
  obj="$work/$(basename "$src" .cu).o"
  echo "build_native: nvcc $src (sm_80, sm_90)"
  "$NVCC" -c "$src" -o "$obj" -O3 -std=c++17 -Icsrc --expt-relaxed-constexpr -lineinfo \
    -Xcompiler -fPIC -Xcompiler -fvisibility=hidden -Werror all-warnings \
    -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90
  objects+=("$obj")
done

suffix="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
pybind_includes="$("$PYTHON" -m pybind11 --includes)"
mkdir -p "$work/pkg/tpo_kernels"
echo "build_native: linking the bindings"
# shellcheck disable=SC2086
${CXX:-c++} -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -Wall -Werror $pybind_includes -Icsrc \
  csrc/bindings_cuda.cpp "${objects[@]}" -L"$CUDA_LIB" -lcudart_static -ldl -lpthread -lrt \
  -o "$work/pkg/tpo_kernels/_C_cuda$suffix"
PYTHONPATH="$work/pkg" "$PYTHON" -c "
import importlib.util, sys
spec = importlib.util.spec_from_file_location('tpo_kernels._C_cuda', '$work/pkg/tpo_kernels/_C_cuda$suffix')
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
print('build_native: import ok; devices visible:', mod.device_count(), mod.device_error() or '')
"

installed="$("$PYTHON" -c 'import glob, os, tpo_kernels; print(" ".join(glob.glob(os.path.join(os.path.dirname(tpo_kernels.__file__), "_C_cuda*.so"))))' 2>/dev/null || true)"
if [ -n "$installed" ]; then
  CUOBJDUMP="$(dirname "$(readlink -f "$NVCC")")/cuobjdump"
  [ -x "$CUOBJDUMP" ] || CUOBJDUMP="$CUDA_TOP/bin/cuobjdump"
  if [ -x "$CUOBJDUMP" ]; then
    elves="$("$CUOBJDUMP" --list-elf $installed)"
    for arch in sm_80 sm_90; do
      if ! grep -q "$arch" <<<"$elves"; then echo "build_native: installed $installed lacks $arch code"; exit 1; fi
    done
    echo "build_native: installed extension carries sm_80 and sm_90 code"
  else
    echo "build_native: cuobjdump not found; not inspecting the installed $installed"
  fi
elif [ "${TPO_REQUIRE_CUDA:-0}" != "0" ]; then
  echo "build_native: TPO_REQUIRE_CUDA=1 but the installed package has no _C_cuda extension"
  exit 1
fi
echo "build_native: OK"
