// CUDA row ops (layer 1): row forward / backward (the kept-set ops, token-level candidates among
// them, are kept_kernels.cu's).
// One block per row for the vocab-sized passes (rows of a batched [B, T, V] view too: one launch,
// row r = b * T + t at b * batch_stride + t * row_stride): 16-byte loads where the row is aligned (scalar
// head/tail otherwise), several packs in flight per thread, per-thread online softmax in base 2
// in the accumulation type (fp32; fp64 for fp64 logits), warp-shuffle + shared-memory merge. The
// per-element arithmetic is the shared row_math.h, the same code the CPU extension runs.
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"
#include "launch.h"

namespace tpo {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Row forward
// ---------------------------------------------------------------------------------------------

// Packs each thread loads before it uses the first: 64 bytes in flight per thread (32 for fp64,
// whose software exp2 needs the registers).
template <class T>
constexpr int packs_in_flight() {
  return sizeof(acc_t<T>) == 8 ? 2 : 4;
}
// Blocks per SM the row kernels are compiled for: 1024 resident threads (at most 64 registers
// each), so that an SM keeps 1024 x 64 bytes of loads in flight; fp64 (not bound by memory, and
// spilling at 64 registers) gets no such bound.
template <class T, int kBlock>
constexpr int min_blocks_per_sm() {
  return sizeof(acc_t<T>) == 8 ? 1 : 1024 / kBlock;
}

// Adds the packs j, j + kBlock, ... (kCount of them, loaded before the first is used) to the
// thread's state: their max first (one compare per group; the rescale is rare once the running
// max settles), then per element d2 = (z - m) it2, s += 2^d2, and with kEntropy t += 2^d2 d2.
// The label, if it is in the group, is left out (its mass is added apart by softmax_finish).
// NaN is not tested for: it reaches s through 2^(NaN - m).
template <class T, int kBlock, bool kEntropy, int kCount>
__device__ __forceinline__ void add_packs(const uint4* __restrict__ packs, int64_t j,
                                          uint64_t label_offset, int label_lane, acc_t<T> it2,
                                          SoftmaxState<acc_t<T>>& st) {
  using A = acc_t<T>;
  constexpr int N = Pack<T>::kSize;
  Pack<T> pk[kCount];
#pragma unroll
  for (int u = 0; u < kCount; ++u) pk[u].raw = __ldg(packs + j + u * kBlock);  // read-only
  const A group_max = packs_max(pk);
  if (group_max > st.m) softmax_rescale(st, group_max, it2);
  // label_offset = (this thread's pack holding the label, or -1) - j: the label is in this group
  // iff it is below the group's span (one compare in the loop's own index type). The label's
  // element becomes -inf (2^-inf = 0), by unrolled selects so that pk stays in registers.
  if (label_offset < static_cast<uint64_t>(kCount) * kBlock) {
    const int u_label = static_cast<int>(label_offset / kBlock);
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (u == u_label && k == label_lane) pk[u].v[k] = Elem<T>::store(neg_inf<A>());
      }
    }
  }
  A s = A(0);
  A t = A(0);
#pragma unroll
  for (int u = 0; u < kCount; ++u) {
    A z[N];
    unpack(pk[u], z);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A d2 = (z[k] - st.m) * it2;
      const A e = acc_exp2(d2);
      s += e;
      if (kEntropy) t += e * floor_finite(d2);
    }
  }
  st.s += s;
  if (kEntropy) st.t += t;
}

// kEntropy: also accumulate t = sum 2^d2 d2 (skipped when no entropy is requested). Every column
// but the label's is summed into the per-thread state (reference m = max(lowest, max z), d2 =
// (z - m) it2); softmax_finish adds the label's own mass, so 1 - p_label never comes from a
// cancelling difference.
template <class T, int kBlock, bool kEntropy>
__global__ void __launch_bounds__(kBlock, (min_blocks_per_sm<T, kBlock>()))
    row_forward_kernel(const T* __restrict__ logits, int64_t vocab, int64_t row_stride,
                       int64_t rows_per_batch, int64_t batch_stride, int64_t first_row,
                       const int64_t* __restrict__ labels, acc_t<T> it, acc_t<T> it2,
                       acc_t<T>* __restrict__ row_max, acc_t<T>* __restrict__ log_sum,
                       acc_t<T>* __restrict__ logprob, acc_t<T>* __restrict__ entropy) {
  using A = acc_t<T>;
  constexpr int N = Pack<T>::kSize;
  constexpr int U = packs_in_flight<T>();
  __shared__ SoftmaxState<A> scratch[kBlock / 32];
  // Row r = b * T + t of the batched view (tpo_abi.h); one launch covers every batch entry.
  const int64_t row = first_row + blockIdx.x;
  const int64_t label = labels[row];
  if (label < 0 || label >= vocab) {  // skipped row (0) / invalid label (NaN): never read
    if (threadIdx.x == 0) {
      const A value = label < 0 ? A(0) : A(quiet_nan_f());
      row_max[row] = value;
      log_sum[row] = value;
      logprob[row] = value;
      if (entropy != nullptr) entropy[row] = value;
    }
    return;
  }
  const T* x = logits + row_offset(batched_row(row, rows_per_batch), batch_stride, row_stride);
  // The label's logit is loaded first, by the thread that finishes the row: its latency overlaps
  // the row's stream instead of adding a dependent load after the block merge.
  const A z_label = threadIdx.x == 0 ? Elem<T>::load(x[label]) : A(0);
  SoftmaxState<A> st = softmax_empty<A>();

  const int64_t head = aligned_head<T>(x, vocab);
  const int64_t num_packs = (vocab - head) / N;
  for (int64_t i = threadIdx.x; i < head; i += kBlock) {
    if (i != label) softmax_add(st, Elem<T>::load(x[i]), it2);
  }
  // The label's pack if this thread reads it (packs j = threadIdx.x mod kBlock), else -1.
  const int64_t label_index = label - head;
  const bool label_in_packs = label_index >= 0 && label_index < num_packs * N;
  const int64_t label_pack =
      label_in_packs && (label_index / N) % kBlock == threadIdx.x ? label_index / N : -1;
  const int label_lane = static_cast<int>(label_index % N);
  const uint4* packs = reinterpret_cast<const uint4*>(x + head);
  int64_t j = threadIdx.x;
  // label_pack - j, carried through the loops (a value the compiler cannot recompute cheaply in
  // the loop, so that it stays one register pair).
  uint64_t label_offset = static_cast<uint64_t>(label_pack - j);
  for (; j + (U - 1) * kBlock < num_packs; j += U * kBlock, label_offset -= U * kBlock) {
    add_packs<T, kBlock, kEntropy, U>(packs, j, label_offset, label_lane, it2, st);
  }
  for (; j < num_packs; j += kBlock, label_offset -= kBlock) {
    add_packs<T, kBlock, kEntropy, 1>(packs, j, label_offset, label_lane, it2, st);
  }
  for (int64_t i = head + num_packs * N + threadIdx.x; i < vocab; i += kBlock) {
    if (i != label) softmax_add(st, Elem<T>::load(x[i]), it2);
  }

  st = block_merge_states<kBlock>(st, scratch, it2);
  if (threadIdx.x == 0) {
    const RowStats<A> r = softmax_finish(st, z_label, it, it2);
    row_max[row] = r.row_max;
    log_sum[row] = r.log_sum;
    logprob[row] = r.logprob;
    if (kEntropy) entropy[row] = r.entropy;
  }
}

// ---------------------------------------------------------------------------------------------
// Row backward
// ---------------------------------------------------------------------------------------------

// One element of the gradient (not the label's: that one is written apart); kEntropy = false is
// the ge == 0 specialization (TPO's case).
template <class A, bool kEntropy>
__device__ __forceinline__ A backward_element(A z, const GradRow<A>& c) {
  const A log2_p = log2_prob(z, c);
  const A p = acc_exp2(log2_p);
  return kEntropy ? grad_element(log2_p, p, c) : grad_element_nolabel(p, c);
}

template <class T, int kBlock, bool kEntropy>
__device__ __forceinline__ void backward_row(const T* x, T* o, int64_t vocab, int64_t head,
                                             int64_t num_packs, const GradRow<acc_t<T>>& c) {
  using A = acc_t<T>;
  constexpr int N = Pack<T>::kSize;
  constexpr int U = packs_in_flight<T>();
  for (int64_t i = threadIdx.x; i < head; i += kBlock) {
    o[i] = Elem<T>::store(backward_element<A, kEntropy>(Elem<T>::load(x[i]), c));
  }
  // Plain (coherent) loads: out may alias the logits (in-place backward). Each pack is read and
  // then written by the same thread, so aliasing is safe. U packs are loaded before the first
  // is used.
  const uint4* in_packs = reinterpret_cast<const uint4*>(x + head);
  uint4* out_packs = reinterpret_cast<uint4*>(o + head);
  int64_t j = threadIdx.x;
  for (; j + (U - 1) * kBlock < num_packs; j += U * kBlock) {
    Pack<T> pk[U];
#pragma unroll
    for (int u = 0; u < U; ++u) pk[u].raw = in_packs[j + u * kBlock];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      A z[N];
      unpack(pk[u], z);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        pk[u].v[k] = Elem<T>::store(backward_element<A, kEntropy>(z[k], c));
      }
      out_packs[j + u * kBlock] = pk[u].raw;
    }
  }
  for (; j < num_packs; j += kBlock) {
    Pack<T> pk;
    pk.raw = in_packs[j];
    A z[N];
    unpack(pk, z);
#pragma unroll
    for (int k = 0; k < N; ++k) pk.v[k] = Elem<T>::store(backward_element<A, kEntropy>(z[k], c));
    out_packs[j] = pk.raw;
  }
  for (int64_t i = head + num_packs * N + threadIdx.x; i < vocab; i += kBlock) {
    o[i] = Elem<T>::store(backward_element<A, kEntropy>(Elem<T>::load(x[i]), c));
  }
}

template <class T, int kBlock>
__global__ void __launch_bounds__(kBlock, (min_blocks_per_sm<T, kBlock>()))
    row_backward_kernel(const T* logits, T* out, int64_t vocab, int64_t row_stride,
                        int64_t out_row_stride, int64_t rows_per_batch, int64_t batch_stride,
                        int64_t out_batch_stride, int64_t first_row,
                        const int64_t* __restrict__ labels,
                        const acc_t<T>* __restrict__ row_max, const acc_t<T>* __restrict__ log_sum,
                        const acc_t<T>* __restrict__ logprob,
                        const acc_t<T>* __restrict__ grad_logprob,
                        const acc_t<T>* __restrict__ grad_entropy,
                        const acc_t<T>* __restrict__ entropy, acc_t<T> it, acc_t<T> it2) {
  using A = acc_t<T>;
  constexpr int N = Pack<T>::kSize;
  const int64_t row = first_row + blockIdx.x;  // r = b * T + t of the batched view (tpo_abi.h)
  const A g = grad_logprob[row];
  const A ge = grad_entropy != nullptr ? grad_entropy[row] : A(0);
  const BatchedRow at = batched_row(row, rows_per_batch);
  T* o = out + opaque(row_offset(at, out_batch_stride, out_row_stride));
  const T* x = logits + opaque(row_offset(at, batch_stride, row_stride));
  int64_t head = aligned_head<T>(o, vocab);
  int64_t num_packs = (vocab - head) / N;

  if (g == A(0) && ge == A(0)) {  // zero-signal row: write zeros, never read the logits
    const T zero = Elem<T>::store(A(0));
    for (int64_t i = threadIdx.x; i < head; i += kBlock) o[i] = zero;
    uint4* out_packs = reinterpret_cast<uint4*>(o + head);
    for (int64_t j = threadIdx.x; j < num_packs; j += kBlock) out_packs[j] = make_uint4(0, 0, 0, 0);
    for (int64_t i = head + num_packs * N + threadIdx.x; i < vocab; i += kBlock) o[i] = zero;
    return;
  }

  const uintptr_t misalign = (reinterpret_cast<uintptr_t>(x) ^ reinterpret_cast<uintptr_t>(o)) & 15u;
  if (misalign != 0) {  // input and output rows not co-aligned: scalar path for this row
    head = vocab;
    num_packs = 0;
  }
  const int64_t label = labels[row];
  const A ent = ge != A(0) ? entropy[row] : A(0);
  const GradRow<A> c = grad_row(row_max[row], log_sum[row], g, ge, ent, it, it2);
  // The label's entry, from the forward's log-prob (never from the logits, which the loop below
  // may overwrite), computed before the loop so that only it and the label stay live across it.
  const bool label_in_row = label >= 0 && label < vocab;  // (one >= vocab is never dereferenced)
  const A label_grad = label_in_row ? grad_label(logprob[row], g, ge, ent, it) : A(0);
  if (ge != A(0)) {
    backward_row<T, kBlock, true>(x, o, vocab, head, num_packs, c);
  } else {
    backward_row<T, kBlock, false>(x, o, vocab, head, num_packs, c);
  }
  // After the barrier, so that it replaces the loop's value.
  if (label_in_row) {
    __syncthreads();
    if (threadIdx.x == 0) o[label] = Elem<T>::store(label_grad);
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

// Threads per row block: enough packs per thread to hide latency, never idle warps on tiny rows.
// Calls f(std::integral_constant<int, kBlock>()).
template <class T, class F>
void with_row_block(int64_t vocab, F&& f) {
  const int64_t packs = vocab / Pack<T>::kSize;
  if (packs <= 1024) return f(std::integral_constant<int, 128>());
  if (packs <= 8192) return f(std::integral_constant<int, 256>());
  return f(std::integral_constant<int, 512>());
}

template <class T>
void launch_row_forward(const RowForwardArgs& a, cudaStream_t stream) {
  using A = acc_t<T>;
  const T* logits = static_cast<const T*>(a.logits);
  A* row_max = static_cast<A*>(a.row_max);
  A* log_sum = static_cast<A*>(a.log_sum);
  A* logprob = static_cast<A*>(a.logprob);
  A* entropy = static_cast<A*>(a.entropy);
  const A it = static_cast<A>(a.inv_temperature);
  const A it2 = base2_scale<A>(a.inv_temperature);
  with_row_block<T>(a.vocab, [&](auto block) {
    constexpr int kBlock = decltype(block)::value;
    for_grid_chunks(a.rows, [&](int64_t start, int64_t count) {
      const unsigned grid = static_cast<unsigned>(count);
      // The base pointers stay whole: blocks index rows from `start` (batched views have no
      // per-chunk base).
      if (entropy != nullptr) {
        row_forward_kernel<T, kBlock, true><<<grid, kBlock, 0, stream>>>(
            logits, a.vocab, a.row_stride, a.rows_per_batch, a.batch_stride, start, a.labels, it,
            it2, row_max, log_sum, logprob, entropy);
      } else {
        row_forward_kernel<T, kBlock, false><<<grid, kBlock, 0, stream>>>(
            logits, a.vocab, a.row_stride, a.rows_per_batch, a.batch_stride, start, a.labels, it,
            it2, row_max, log_sum, logprob, nullptr);
      }
    });
  });
}

template <class T>
void launch_row_backward(const RowBackwardArgs& a, cudaStream_t stream) {
  using A = acc_t<T>;
  const T* logits = static_cast<const T*>(a.logits);
  T* out = static_cast<T*>(a.out);
  const A* row_max = static_cast<const A*>(a.row_max);
  const A* log_sum = static_cast<const A*>(a.log_sum);
  const A* logprob = static_cast<const A*>(a.logprob);
  const A* g = static_cast<const A*>(a.grad_logprob);
  const A* ge = static_cast<const A*>(a.grad_entropy);
  const A* ent = static_cast<const A*>(a.entropy);
  const A it = static_cast<A>(a.inv_temperature);
  const A it2 = base2_scale<A>(a.inv_temperature);
  with_row_block<T>(a.vocab, [&](auto block) {
    constexpr int kBlock = decltype(block)::value;
    for_grid_chunks(a.rows, [&](int64_t start, int64_t count) {
      row_backward_kernel<T, kBlock><<<static_cast<unsigned>(count), kBlock, 0, stream>>>(
          logits, out, a.vocab, a.row_stride, a.out_row_stride, a.rows_per_batch, a.batch_stride,
          a.out_batch_stride, start, a.labels, row_max, log_sum, logprob, g, ge, ent, it, it2);
    });
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host entry points (launch.h)
// ---------------------------------------------------------------------------------------------

const char* row_forward(const RowForwardArgs& args, const Launch& launch) {
  if (args.rows == 0) return nullptr;
  DeviceGuard guard(launch.device);
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());
  visit_dtype(args.dtype, [&](auto tag) {
    launch_row_forward<typename decltype(tag)::type>(args, as_stream(launch));
  });
  return launch_status();
}

const char* row_backward(const RowBackwardArgs& args, const Launch& launch) {
  if (args.rows == 0) return nullptr;
  DeviceGuard guard(launch.device);
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());
  visit_dtype(args.dtype, [&](auto tag) {
    launch_row_backward<typename decltype(tag)::type>(args, as_stream(launch));
  });
  return launch_status();
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
