// Shared device helpers of the CUDA kernels: 16-byte packs, block reductions, launch plumbing
// (device guard, stream, error strings). Element types and per-element math are row_math.h's.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../row_math.h"
#include "launch.h"

namespace tpo {
namespace cuda {

// 16 bytes of T: one vectorized (128-bit) load or store.
template <class T>
struct Pack {
  static constexpr int kSize = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[kSize];
  };
};

// Packed max of 16-bit pairs over n packs (max.bf16x2 / max.f16x2 return the other operand for a
// NaN), as a float.
template <class Pair, class T, int kCount>
__device__ __forceinline__ float packed_max16(const Pack<T> (&pk)[kCount]) {
  Pair m = *reinterpret_cast<const Pair*>(&pk[0].raw.x);
#pragma unroll
  for (int u = 0; u < kCount; ++u) {
    const uint32_t w[4] = {pk[u].raw.x, pk[u].raw.y, pk[u].raw.z, pk[u].raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) m = __hmax2(m, *reinterpret_cast<const Pair*>(&w[i]));
  }
  return fmaxf(static_cast<float>(m.x), static_cast<float>(m.y));
}

// Max over n packs in the accumulation type, NaNs ignored (fmax(NaN, y) = y); one packed max per
// two elements for the 16-bit types.
template <class T, int kCount>
__device__ __forceinline__ acc_t<T> packs_max(const Pack<T> (&pk)[kCount]) {
  if constexpr (std::is_same<T, bf16_t>::value) {
    return packed_max16<__nv_bfloat162>(pk);
  } else if constexpr (std::is_same<T, half_t>::value) {
    return packed_max16<__half2>(pk);
  } else {
    acc_t<T> m = pk[0].v[0];
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
#pragma unroll
      for (int k = 0; k < Pack<T>::kSize; ++k) m = fmax(m, pk[u].v[k]);
    }
    return m;
  }
}

// A pack's elements in the accumulation type. bf16 works on 32-bit words, one instruction per
// element: the low element is w << 16, the high one w & 0xffff0000.
template <class T>
__device__ __forceinline__ void unpack(const Pack<T>& pk, acc_t<T> (&z)[Pack<T>::kSize]) {
  if constexpr (std::is_same<T, bf16_t>::value) {
    const uint32_t w[4] = {pk.raw.x, pk.raw.y, pk.raw.z, pk.raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      z[2 * i] = __uint_as_float(w[i] << 16);
      z[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < Pack<T>::kSize; ++k) z[k] = Elem<T>::load(pk.v[k]);
  }
}

// The value, as nvcc must keep it whole: without it nvcc re-derives a row's offset from its parts
// (b * batch_stride + t * row_stride) at each use and keeps the parts live across the row's loop,
// which made the 64-register bf16/fp16 row backward spill on sm_80 (and fp64 take 88 registers).
// On an offset, not on the pointer: a pointer through asm loses its global address space (generic
// LD/ST instead of LDG/STG).
__device__ __forceinline__ int64_t opaque(int64_t value) {
  asm("" : "+l"(value));
  return value;
}

// Number of leading elements before the first 16-byte-aligned element of a row at address p
// (at most `count`).
template <class T>
__device__ __forceinline__ int64_t aligned_head(const void* p, int64_t count) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  const int64_t head = static_cast<int64_t>(((16u - (addr & 15u)) & 15u) / sizeof(T));
  return head < count ? head : count;
}

// ---------------------------------------------------------------------------------------------
// Block reductions (fixed shapes and orders: deterministic for a given launch configuration).
// `scratch` must hold kWarps values; every thread gets the result.
// ---------------------------------------------------------------------------------------------

template <class A>
struct SumOp {
  __device__ A operator()(A a, A b) const { return a + b; }
};
template <class A>
struct MaxOp {
  __device__ A operator()(A a, A b) const { return a > b ? a : b; }
};
template <class A>
struct MinOp {
  __device__ A operator()(A a, A b) const { return a < b ? a : b; }
};

template <class A, class Op>
__device__ __forceinline__ A warp_reduce(A value, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

template <int kBlock, class A, class Op>
__device__ A block_reduce(A value, Op op, A* scratch) {
  constexpr int kWarps = kBlock / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  value = warp_reduce(value, op);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) value = op(value, scratch[w]);
  return value;
}

template <class A>
__device__ __forceinline__ SoftmaxState<A> shfl_state(const SoftmaxState<A>& st, int offset) {
  SoftmaxState<A> other;
  other.m = __shfl_xor_sync(0xffffffffu, st.m, offset);
  other.s = __shfl_xor_sync(0xffffffffu, st.s, offset);
  other.t = __shfl_xor_sync(0xffffffffu, st.t, offset);
  return other;
}

// Merge every thread's online-softmax state (base-2 inverse temperature it2); the result is
// valid in all threads.
template <int kBlock, class A>
__device__ SoftmaxState<A> block_merge_states(SoftmaxState<A> st, SoftmaxState<A>* scratch, A it2) {
  constexpr int kWarps = kBlock / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    st = softmax_merge(st, shfl_state(st, offset), it2);
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = st;
  __syncthreads();
  st = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) st = softmax_merge(st, scratch[w], it2);
  return st;
}

// ---------------------------------------------------------------------------------------------
// Launch plumbing
// ---------------------------------------------------------------------------------------------

// Makes `device` current for the scope (restoring the previous one), since this extension has
// its own (static) CUDA runtime whose current device need not follow torch's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : previous_(-1) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) {
      status_ = cudaSetDevice(device);
    } else {
      previous_ = -1;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_;
  cudaError_t status_ = cudaSuccess;
};

inline cudaStream_t as_stream(const Launch& launch) {
  return static_cast<cudaStream_t>(launch.stream);
}

inline const char* launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// The most blocks one launch may have in grid dimension x (2^31 - 1).
constexpr int64_t kMaxGridX = 2147483647;

// Grids cover rows (or groups) in dimension x; more than kMaxGridX of them are split into
// launches over offsets: f(start, count) for [start, start + count).
template <class F>
void for_grid_chunks(int64_t total, F&& f) {
  for (int64_t start = 0; start < total; start += kMaxGridX) {
    f(start, total - start < kMaxGridX ? total - start : kMaxGridX);
  }
}

}  // namespace cuda
}  // namespace tpo
