// CUDA row ops (layer 1 of DESIGN.md): row forward / backward and the token-level candidate
// gather / scatter. One block per row for the vocab-sized passes: 16-byte loads where the row is
// aligned (scalar head/tail otherwise), per-thread online softmax in the accumulation type
// (fp32; fp64 for fp64 logits), warp-shuffle + shared-memory merge. The per-element arithmetic
// is the shared row_math.h, the same code the CPU extension runs.
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"
#include "launch.h"

namespace tpo {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Row forward
// ---------------------------------------------------------------------------------------------

// kEntropy: also accumulate t = sum e^(x-m)(x-m) (skipped when no entropy is requested).
template <class T, int kBlock, bool kEntropy>
__global__ void __launch_bounds__(kBlock)
    row_forward_kernel(const T* __restrict__ logits, int64_t vocab, int64_t row_stride,
                       const int64_t* __restrict__ labels, typename ElemOps<T>::acc it,
                       typename ElemOps<T>::acc* __restrict__ lse,
                       typename ElemOps<T>::acc* __restrict__ target,
                       typename ElemOps<T>::acc* __restrict__ entropy) {
  using A = typename ElemOps<T>::acc;
  constexpr int N = Pack<T>::kSize;
  __shared__ SoftmaxState<A> scratch[kBlock / 32];
  const int64_t row = blockIdx.x;
  const int64_t label = labels[row];
  if (label < 0 || label >= vocab) {  // skipped row (0) / invalid label (NaN): never read
    if (threadIdx.x == 0) {
      const A value = label < 0 ? A(0) : A(quiet_nan_f());
      lse[row] = value;
      target[row] = value;
      if (entropy != nullptr) entropy[row] = value;
    }
    return;
  }
  const T* x = logits + row * row_stride;
  const A ninf = neg_inf<A>();
  SoftmaxState<A> st = softmax_empty<A>();
  int nan_seen = 0;

  const int64_t head = aligned_head<T>(x, vocab);
  const int64_t num_packs = (vocab - head) / N;
  for (int64_t i = threadIdx.x; i < head; i += kBlock) {
    const A z = to_acc(x[i]) * it;
    nan_seen |= (z != z);
    softmax_add(st, z);
  }
  const uint4* packs = reinterpret_cast<const uint4*>(x + head);
  for (int64_t j = threadIdx.x; j < num_packs; j += kBlock) {
    Pack<T> pk;
    pk.raw = __ldg(packs + j);  // read-only for the whole kernel: non-coherent path is fine
    A z[N];
    A pack_max = ninf;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      z[k] = to_acc(pk.v[k]) * it;
      pack_max = z[k] > pack_max ? z[k] : pack_max;
      nan_seen |= (z[k] != z[k]);
    }
    // One rescale per pack (rare once the running max settles), then N exps against it.
    if (pack_max > st.m) softmax_rescale(st, pack_max);
    if (!(st.m > ninf)) continue;  // everything so far is -inf
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A d = z[k] - st.m;
      const A e = acc_exp(d);
      st.s += e;
      if (kEntropy) st.t += e * (d > ninf ? d : A(0));  // e = 0 where d = -inf
    }
  }
  for (int64_t i = head + num_packs * N + threadIdx.x; i < vocab; i += kBlock) {
    const A z = to_acc(x[i]) * it;
    nan_seen |= (z != z);
    softmax_add(st, z);
  }

  st = block_merge_states<kBlock>(st, scratch);
  nan_seen = __syncthreads_or(nan_seen);
  if (threadIdx.x == 0) {
    const A nan = A(quiet_nan_f());
    lse[row] = nan_seen ? nan : softmax_lse(st);
    target[row] = to_acc(x[label]) * it;
    if (kEntropy) entropy[row] = nan_seen ? nan : softmax_entropy(st);
  }
}

// ---------------------------------------------------------------------------------------------
// Row backward
// ---------------------------------------------------------------------------------------------

// One element of the gradient; kEntropy = false is the ge == 0 specialization (TPO's case).
template <class A, bool kEntropy>
__device__ __forceinline__ A backward_element(A z, int64_t idx, int64_t label, A lse, A g, A ge,
                                              A ent, A it) {
  const A log_p = z * it - lse;
  const A p = acc_exp(log_p);
  if (kEntropy) return grad_element(log_p, p, g, ge, ent, idx == label, it);
  A grad = -g * p;
  if (idx == label) grad += g;
  return grad * it;
}

template <class T, int kBlock, bool kEntropy>
__device__ __forceinline__ void backward_row(const T* x, T* o, int64_t vocab, int64_t head,
                                             int64_t num_packs, int64_t label, typename ElemOps<T>::acc lse,
                                             typename ElemOps<T>::acc g, typename ElemOps<T>::acc ge,
                                             typename ElemOps<T>::acc ent, typename ElemOps<T>::acc it) {
  using A = typename ElemOps<T>::acc;
  constexpr int N = Pack<T>::kSize;
  for (int64_t i = threadIdx.x; i < head; i += kBlock) {
    o[i] = ElemOps<T>::from_acc(
        backward_element<A, kEntropy>(to_acc(x[i]), i, label, lse, g, ge, ent, it));
  }
  // Plain (coherent) loads: out may alias the logits (in-place backward). Each pack is read and
  // then written by the same thread, so aliasing is safe.
  const uint4* in_packs = reinterpret_cast<const uint4*>(x + head);
  uint4* out_packs = reinterpret_cast<uint4*>(o + head);
  for (int64_t j = threadIdx.x; j < num_packs; j += kBlock) {
    Pack<T> pk;
    pk.raw = in_packs[j];
    const int64_t base = head + j * N;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      pk.v[k] = ElemOps<T>::from_acc(
          backward_element<A, kEntropy>(to_acc(pk.v[k]), base + k, label, lse, g, ge, ent, it));
    }
    out_packs[j] = pk.raw;
  }
  for (int64_t i = head + num_packs * N + threadIdx.x; i < vocab; i += kBlock) {
    o[i] = ElemOps<T>::from_acc(
        backward_element<A, kEntropy>(to_acc(x[i]), i, label, lse, g, ge, ent, it));
  }
}

template <class T, int kBlock>
__global__ void __launch_bounds__(kBlock)
    row_backward_kernel(const T* logits, T* out, int64_t vocab, int64_t row_stride,
                        int64_t out_row_stride, const int64_t* __restrict__ labels,
                        const typename ElemOps<T>::acc* __restrict__ lse,
                        const typename ElemOps<T>::acc* __restrict__ grad_logprob,
                        const typename ElemOps<T>::acc* __restrict__ grad_entropy,
                        const typename ElemOps<T>::acc* __restrict__ entropy,
                        typename ElemOps<T>::acc it) {
  using A = typename ElemOps<T>::acc;
  constexpr int N = Pack<T>::kSize;
  const int64_t row = blockIdx.x;
  const A g = grad_logprob[row];
  const A ge = grad_entropy != nullptr ? grad_entropy[row] : A(0);
  T* o = out + row * out_row_stride;
  int64_t head = aligned_head<T>(o, vocab);
  int64_t num_packs = (vocab - head) / N;

  if (g == A(0) && ge == A(0)) {  // zero-signal row: write zeros, never read the logits
    const T zero = ElemOps<T>::from_acc(A(0));
    for (int64_t i = threadIdx.x; i < head; i += kBlock) o[i] = zero;
    uint4* out_packs = reinterpret_cast<uint4*>(o + head);
    for (int64_t j = threadIdx.x; j < num_packs; j += kBlock) out_packs[j] = make_uint4(0, 0, 0, 0);
    for (int64_t i = head + num_packs * N + threadIdx.x; i < vocab; i += kBlock) o[i] = zero;
    return;
  }

  const T* x = logits + row * row_stride;
  const uintptr_t misalign = (reinterpret_cast<uintptr_t>(x) ^ reinterpret_cast<uintptr_t>(o)) & 15u;
  if (misalign != 0) {  // input and output rows not co-aligned: scalar path for this row
    head = vocab;
    num_packs = 0;
  }
  const int64_t label = labels[row];
  const A l = lse[row];
  if (ge != A(0)) {
    const A ent = entropy[row];
    backward_row<T, kBlock, true>(x, o, vocab, head, num_packs, label, l, g, ge, ent, it);
  } else {
    backward_row<T, kBlock, false>(x, o, vocab, head, num_packs, label, l, g, A(0), A(0), it);
  }
}

// ---------------------------------------------------------------------------------------------
// Candidate gather / scatter (token-level TPO)
// ---------------------------------------------------------------------------------------------

template <class T>
__global__ void candidate_forward_kernel(const T* __restrict__ logits, int64_t rows,
                                         int64_t vocab, int64_t row_stride,
                                         const int64_t* __restrict__ candidates, int64_t k,
                                         typename ElemOps<T>::acc it,
                                         typename ElemOps<T>::acc* __restrict__ out) {
  using A = typename ElemOps<T>::acc;
  const int64_t total = rows * k;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / k;
    const int64_t c = candidates[idx];
    out[idx] = (c >= 0 && c < vocab) ? to_acc(logits[row * row_stride + c]) * it
                                     : A(quiet_nan_f());
  }
}

// One thread per row walks its K candidates in ascending order, so duplicates are summed in a
// fixed order (deterministic) with no atomics: each distinct candidate is written once, with
// the sum of all its occurrences starting from 0 (as a column-by-column scatter_add would).
template <class T>
__global__ void candidate_backward_kernel(const typename ElemOps<T>::acc* __restrict__ grad,
                                          const int64_t* __restrict__ candidates, int64_t rows,
                                          int64_t k, int64_t vocab, typename ElemOps<T>::acc it,
                                          T* __restrict__ out) {
  using A = typename ElemOps<T>::acc;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t* cand = candidates + row * k;
    const A* gr = grad + row * k;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t c = cand[j];
      if (c < 0 || c >= vocab) continue;
      bool seen = false;
      for (int64_t i = 0; i < j; ++i) seen = seen || cand[i] == c;
      if (seen) continue;
      A acc = A(0);
      for (int64_t i = j; i < k; ++i) {
        if (cand[i] == c) acc += gr[i] * it;
      }
      out[row * vocab + c] = ElemOps<T>::from_acc(acc);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

// Threads per row block: enough packs per thread to hide latency, never idle warps on tiny rows.
template <class T>
int row_block_size(int64_t vocab) {
  const int64_t packs = vocab / Pack<T>::kSize;
  if (packs <= 1024) return 128;
  if (packs <= 8192) return 256;
  return 512;
}

template <class T, int kBlock>
void launch_forward_rows(const T* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                         const int64_t* labels, typename ElemOps<T>::acc it,
                         typename ElemOps<T>::acc* lse, typename ElemOps<T>::acc* target,
                         typename ElemOps<T>::acc* entropy, cudaStream_t stream) {
  for (int64_t start = 0; start < rows; start += kMaxGridX) {
    const int64_t count = rows - start < kMaxGridX ? rows - start : kMaxGridX;
    if (entropy != nullptr) {
      row_forward_kernel<T, kBlock, true><<<static_cast<unsigned>(count), kBlock, 0, stream>>>(
          logits + start * row_stride, vocab, row_stride, labels + start, it, lse + start,
          target + start, entropy + start);
    } else {
      row_forward_kernel<T, kBlock, false><<<static_cast<unsigned>(count), kBlock, 0, stream>>>(
          logits + start * row_stride, vocab, row_stride, labels + start, it, lse + start,
          target + start, nullptr);
    }
  }
}

template <class T>
const char* forward_typed(const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                          const int64_t* labels, double inv_t, void* lse, void* target,
                          void* entropy, cudaStream_t stream) {
  using A = typename ElemOps<T>::acc;
  const T* x = static_cast<const T*>(logits);
  A* l = static_cast<A*>(lse);
  A* t = static_cast<A*>(target);
  A* e = static_cast<A*>(entropy);
  const A it = static_cast<A>(inv_t);
  switch (row_block_size<T>(vocab)) {
    case 128:
      launch_forward_rows<T, 128>(x, rows, vocab, row_stride, labels, it, l, t, e, stream);
      break;
    case 256:
      launch_forward_rows<T, 256>(x, rows, vocab, row_stride, labels, it, l, t, e, stream);
      break;
    default:
      launch_forward_rows<T, 512>(x, rows, vocab, row_stride, labels, it, l, t, e, stream);
  }
  return launch_status();
}

template <class T, int kBlock>
void launch_backward_rows(const T* logits, T* out, int64_t rows, int64_t vocab,
                          int64_t row_stride, int64_t out_row_stride, const int64_t* labels,
                          const typename ElemOps<T>::acc* lse, const typename ElemOps<T>::acc* g,
                          const typename ElemOps<T>::acc* ge,
                          const typename ElemOps<T>::acc* ent, typename ElemOps<T>::acc it,
                          cudaStream_t stream) {
  for (int64_t start = 0; start < rows; start += kMaxGridX) {
    const int64_t count = rows - start < kMaxGridX ? rows - start : kMaxGridX;
    row_backward_kernel<T, kBlock><<<static_cast<unsigned>(count), kBlock, 0, stream>>>(
        logits + start * row_stride, out + start * out_row_stride, vocab, row_stride,
        out_row_stride, labels + start, lse + start, g + start,
        ge != nullptr ? ge + start : nullptr, ent != nullptr ? ent + start : nullptr, it);
  }
}

template <class T>
const char* backward_typed(const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                           const int64_t* labels, const void* lse, const void* g, const void* ge,
                           const void* ent, double inv_t, void* out, int64_t out_row_stride,
                           cudaStream_t stream) {
  using A = typename ElemOps<T>::acc;
  const T* x = static_cast<const T*>(logits);
  T* o = static_cast<T*>(out);
  const A* l = static_cast<const A*>(lse);
  const A* gp = static_cast<const A*>(g);
  const A* gep = static_cast<const A*>(ge);
  const A* ep = static_cast<const A*>(ent);
  const A it = static_cast<A>(inv_t);
  switch (row_block_size<T>(vocab)) {
    case 128:
      launch_backward_rows<T, 128>(x, o, rows, vocab, row_stride, out_row_stride, labels, l, gp,
                                   gep, ep, it, stream);
      break;
    case 256:
      launch_backward_rows<T, 256>(x, o, rows, vocab, row_stride, out_row_stride, labels, l, gp,
                                   gep, ep, it, stream);
      break;
    default:
      launch_backward_rows<T, 512>(x, o, rows, vocab, row_stride, out_row_stride, labels, l, gp,
                                   gep, ep, it, stream);
  }
  return launch_status();
}

unsigned elementwise_grid(int64_t work, int block) {
  const int64_t blocks = (work + block - 1) / block;
  const int64_t cap = 65535LL * 64;  // grid-stride loops cover the rest
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

template <class T>
const char* candidate_forward_typed(const void* logits, int64_t rows, int64_t vocab,
                                    int64_t row_stride, const int64_t* candidates, int64_t k,
                                    double inv_t, void* out, cudaStream_t stream) {
  using A = typename ElemOps<T>::acc;
  constexpr int kBlock = 256;
  candidate_forward_kernel<T><<<elementwise_grid(rows * k, kBlock), kBlock, 0, stream>>>(
      static_cast<const T*>(logits), rows, vocab, row_stride, candidates, k,
      static_cast<A>(inv_t), static_cast<A*>(out));
  return launch_status();
}

template <class T>
const char* candidate_backward_typed(const void* grad, const int64_t* candidates, int64_t rows,
                                     int64_t k, int64_t vocab, double inv_t, void* out,
                                     cudaStream_t stream) {
  using A = typename ElemOps<T>::acc;
  constexpr int kBlock = 128;
  cudaError_t err = cudaMemsetAsync(out, 0, static_cast<size_t>(rows) * vocab * sizeof(T), stream);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (k == 0) return nullptr;
  candidate_backward_kernel<T><<<elementwise_grid(rows, kBlock), kBlock, 0, stream>>>(
      static_cast<const A*>(grad), candidates, rows, k, vocab, static_cast<A>(inv_t),
      static_cast<T*>(out));
  return launch_status();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host entry points (launch.h)
// ---------------------------------------------------------------------------------------------

#define TPO_DISPATCH_DTYPE(dtype, fn, ...)        \
  switch (dtype) {                                \
    case 0:                                       \
      return fn<float>(__VA_ARGS__);              \
    case 1:                                       \
      return fn<half_s>(__VA_ARGS__);             \
    case 2:                                       \
      return fn<bf16_s>(__VA_ARGS__);             \
    case 3:                                       \
      return fn<double>(__VA_ARGS__);             \
    default:                                      \
      return "unsupported dtype code";            \
  }

#define TPO_GUARD_DEVICE(device)                                    \
  DeviceGuard guard(device);                                        \
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());

const char* row_forward(const void* logits, int dtype, int64_t rows, int64_t vocab,
                        int64_t row_stride, const int64_t* labels, double inv_temperature,
                        void* lse, void* target, void* entropy, int device, void* stream) {
  if (rows == 0) return nullptr;
  TPO_GUARD_DEVICE(device)
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  TPO_DISPATCH_DTYPE(dtype, forward_typed, logits, rows, vocab, row_stride, labels,
                     inv_temperature, lse, target, entropy, s)
}

const char* row_backward(const void* logits, int dtype, int64_t rows, int64_t vocab,
                         int64_t row_stride, const int64_t* labels, const void* lse,
                         const void* grad_logprob, const void* grad_entropy, const void* entropy,
                         double inv_temperature, void* out, int64_t out_row_stride, int device,
                         void* stream) {
  if (rows == 0) return nullptr;
  TPO_GUARD_DEVICE(device)
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  TPO_DISPATCH_DTYPE(dtype, backward_typed, logits, rows, vocab, row_stride, labels, lse,
                     grad_logprob, grad_entropy, entropy, inv_temperature, out, out_row_stride, s)
}

const char* candidate_forward(const void* logits, int dtype, int64_t rows, int64_t vocab,
                              int64_t row_stride, const int64_t* candidates, int64_t k,
                              double inv_temperature, void* cand_logits, int device,
                              void* stream) {
  if (rows == 0 || k == 0) return nullptr;
  TPO_GUARD_DEVICE(device)
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  TPO_DISPATCH_DTYPE(dtype, candidate_forward_typed, logits, rows, vocab, row_stride, candidates,
                     k, inv_temperature, cand_logits, s)
}

const char* candidate_backward(const void* grad_cand, const int64_t* candidates, int64_t rows,
                               int64_t k, int64_t vocab, double inv_temperature, void* out,
                               int dtype, int device, void* stream) {
  if (rows == 0) return nullptr;
  TPO_GUARD_DEVICE(device)
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  TPO_DISPATCH_DTYPE(dtype, candidate_backward_typed, grad_cand, candidates, rows, k, vocab,
                     inv_temperature, out, s)
}

int device_count(const char** error) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
    if (error != nullptr) *error = cudaGetErrorString(err);
    return -1;
  }
  return count;
}

}  // namespace cuda
}  // namespace tpo
