// Shared device helpers of the CUDA kernels: element types, 16-byte packs, block reductions,
// launch plumbing (device guard, error strings).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../row_math.h"

namespace tpo {
namespace cuda {

// ---------------------------------------------------------------------------------------------
// Element types: raw 16-bit storage for bf16/fp16; loads give the accumulation type.
// ---------------------------------------------------------------------------------------------

struct bf16_s {
  uint16_t bits;
};
struct half_s {
  uint16_t bits;
};

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(bf16_s x) { return bf16_to_float(x.bits); }
__device__ __forceinline__ float to_acc(half_s x) { return half_to_float(x.bits); }

template <class T>
struct ElemOps;
template <>
struct ElemOps<float> {
  using acc = float;
  __device__ static float from_acc(float a) { return a; }
};
template <>
struct ElemOps<double> {
  using acc = double;
  __device__ static double from_acc(double a) { return a; }
};
template <>
struct ElemOps<bf16_s> {
  using acc = float;
  __device__ static bf16_s from_acc(float a) { return bf16_s{float_to_bf16(a)}; }
};
template <>
struct ElemOps<half_s> {
  using acc = float;
  __device__ static half_s from_acc(float a) { return half_s{float_to_half(a)}; }
};

// 16 bytes of T: one vectorized (128-bit) load or store.
template <class T>
struct Pack {
  static constexpr int kSize = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[kSize];
  };
};

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

// Merge every thread's online-softmax state; the result is valid in all threads.
template <int kBlock, class A>
__device__ SoftmaxState<A> block_merge_states(SoftmaxState<A> st, SoftmaxState<A>* scratch) {
  constexpr int kWarps = kBlock / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) st = softmax_merge(st, shfl_state(st, offset));
  __syncthreads();
  if (lane == 0) scratch[warp] = st;
  __syncthreads();
  st = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) st = softmax_merge(st, scratch[w]);
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

inline const char* launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Grids cover rows in dimension x, at most 2^31 - 1 blocks per launch; larger row counts are
// split into several launches over row offsets.
constexpr int64_t kMaxGridX = 2147483647;

}  // namespace cuda
}  // namespace tpo
