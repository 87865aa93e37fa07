// CUDA kept-set ops (sampling-mask replay, layer 1): the gather of each row's kept logits, the
// scatter of their gradient, the ragged row forward / backward over the gathered rows, and the
// fused head's kept dot products. The contract is tpo_abi.h's (KeptIndexArgs, RaggedRowArgs,
// KeptDotArgs); the per-element and per-row arithmetic is row_math.h's, as in row_kernels.cu.
//
// Work split: one warp per row (4 rows per 128-thread block) for the gather, the ragged row ops and
// the dot products; one block per row for the scatter, which zero-fills the row's vocabulary first.
// Every sum has an order fixed by the row's own pairs (the row ops: lane l takes the pairs first + l
// + 32 k, then a fixed xor-shuffle tree; the scatter: a row's duplicates in ascending pair order)
// or by the hidden size (the dot products), so a row's results do not depend on the other rows of
// the call, and nothing uses float atomics: deterministic run to run.
//
// Bounds: the CSR lives in device memory, where the binding cannot check it. Each kernel clamps a
// row's range [offsets[r], offsets[r + 1]) into [0, num_pairs) (pair_range), reads a logit or weight
// row only for an id in [0, vocab) (a hole gives -inf, an id >= vocab NaN / no write), and uses a
// label slot only inside its row's range (one outside is the "label not in the set" case).
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"
#include "launch.h"

namespace tpo {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kWarpBlock = 32 * kWarpsPerBlock;  // threads of a warp-per-row block
constexpr int kScatterBlock = 128;               // threads of a scatter block (one row)

// Row r's pairs [first, last), clamped into [0, num_pairs) (the offsets are unchecked device memory).
struct PairRange {
  int64_t first;
  int64_t last;
};

__device__ __forceinline__ PairRange pair_range(const int64_t* __restrict__ offsets, int64_t row,
                                                int64_t num_pairs) {
  int64_t first = offsets[row];
  int64_t last = offsets[row + 1];
  first = first < 0 ? 0 : (first > num_pairs ? num_pairs : first);
  last = last < first ? first : (last > num_pairs ? num_pairs : last);
  return PairRange{first, last};
}

// Warp-per-row kernels: warp w of block b takes row first_row + kWarpsPerBlock b + w, one row per
// warp (a grid-stride loop over rows kept its state live across fp64's library calls, which spilled
// on sm_80). Every lane of a warp works on the same row, so its shuffles always see all 32 lanes.
__device__ __forceinline__ int64_t warp_row(int64_t first_row) {
  return first_row + static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
}

__device__ __forceinline__ float fused_multiply_add(float a, float b, float c) {
  return __fmaf_rn(a, b, c);
}
__device__ __forceinline__ double fused_multiply_add(double a, double b, double c) {
  return __fma_rn(a, b, c);
}

// Chunk j (Pack<T>::kSize elements from a 16-byte-aligned row) in the accumulation type: one
// 128-bit load; fp64 as a double2, whose halves nvcc keeps in registers (through the Pack union it
// spilled them).
template <class T>
__device__ __forceinline__ void load_chunk(const T* row, int64_t j, acc_t<T> (&z)[Pack<T>::kSize]) {
  if constexpr (std::is_same<T, double>::value) {
    const double2 pair = __ldg(reinterpret_cast<const double2*>(row) + j);
    z[0] = pair.x;
    z[1] = pair.y;
  } else {
    Pack<T> pk;
    pk.raw = __ldg(reinterpret_cast<const uint4*>(row) + j);
    unpack(pk, z);
  }
}

// ---------------------------------------------------------------------------------------------
// Gather / scatter
// ---------------------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kWarpBlock)
    kept_gather_kernel(const T* __restrict__ logits, int64_t rows, int64_t vocab, int64_t row_stride,
                       int64_t rows_per_batch, int64_t batch_stride, const int64_t* __restrict__ ids,
                       const int64_t* __restrict__ offsets, int64_t num_pairs, int64_t first_row,
                       acc_t<T>* __restrict__ kept_logits) {
  using A = acc_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = warp_row(first_row);
  if (row >= rows) return;
  const PairRange pr = pair_range(offsets, row, num_pairs);
  const T* x = logits + row_offset(batched_row(row, rows_per_batch), batch_stride, row_stride);
  for (int64_t p = pr.first + lane; p < pr.last; p += 32) {
    const int64_t id = ids[p];
    kept_logits[p] = id < 0 ? neg_inf<A>() : (id >= vocab ? A(quiet_nan_f()) : Elem<T>::load(x[id]));
  }
}

// One block per row: the row's vocabulary is zero-filled (16-byte stores where aligned), then each
// pair whose id is the first occurrence of that id in the row writes the sum of the row's pairs
// with that id, in ascending pair order from 0 (duplicates are found by scanning the row: n steps
// per pair, n^2 / 128 per block for a row of n pairs; the loads are broadcasts, the row's ids
// stay in L1).
template <class T>
__global__ void __launch_bounds__(kScatterBlock)
    kept_scatter_kernel(const acc_t<T>* __restrict__ grad, const int64_t* __restrict__ ids,
                        const int64_t* __restrict__ offsets, int64_t num_pairs, int64_t vocab,
                        int64_t row_stride, int64_t rows_per_batch, int64_t batch_stride,
                        int64_t first_row, T* __restrict__ out) {
  using A = acc_t<T>;
  constexpr int N = Pack<T>::kSize;
  const int64_t row = first_row + blockIdx.x;
  T* o = out + opaque(row_offset(batched_row(row, rows_per_batch), batch_stride, row_stride));
  const int64_t head = aligned_head<T>(o, vocab);
  const int64_t num_packs = (vocab - head) / N;
  const T zero = Elem<T>::store(A(0));
  for (int64_t i = threadIdx.x; i < head; i += kScatterBlock) o[i] = zero;
  uint4* packs = reinterpret_cast<uint4*>(o + head);
  for (int64_t j = threadIdx.x; j < num_packs; j += kScatterBlock) packs[j] = make_uint4(0, 0, 0, 0);
  for (int64_t i = head + num_packs * N + threadIdx.x; i < vocab; i += kScatterBlock) o[i] = zero;
  __syncthreads();  // the row's zeros are written before any of its values

  const PairRange pr = pair_range(offsets, row, num_pairs);
  for (int64_t p = pr.first + threadIdx.x; p < pr.last; p += kScatterBlock) {
    const int64_t id = ids[p];
    if (id < 0 || id >= vocab) continue;  // a hole or an id outside the vocabulary: no write
    bool first = true;
    for (int64_t q = pr.first; q < p; ++q) {
      if (ids[q] == id) {
        first = false;
        break;
      }
    }
    if (!first) continue;  // an earlier pair of the row writes this id
    A sum = A(0);
    for (int64_t q = p; q < pr.last; ++q) {
      if (ids[q] == id) sum += grad[q];
    }
    o[id] = Elem<T>::store(sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Ragged row forward / backward (the row ops of row_math.h over a row's kept logits)
// ---------------------------------------------------------------------------------------------

// Per row: m = max over the pairs (NaN ignored, as the CPU's), then with d2 = (z - m) it2 the sums
// rest = sum 2^d2 and t2 = sum 2^d2 d2 over every pair but the label's (whose mass is added apart,
// in the natural base, as softmax_finish does), so that 1 - p of a confident label keeps its
// relative accuracy. The finish is the CPU extension's (row_ops.cpp), element for element.
template <class A>
__global__ void __launch_bounds__(kWarpBlock)
    ragged_forward_kernel(const A* __restrict__ z, const int64_t* __restrict__ offsets,
                          const int64_t* __restrict__ label_slot, int64_t rows, int64_t num_pairs,
                          int64_t first_row, A it, A it2, A* __restrict__ row_max, A* __restrict__ log_sum,
                          A* __restrict__ logprob, A* __restrict__ entropy) {
  const int lane = threadIdx.x & 31;
  const int64_t row = warp_row(first_row);
  if (row >= rows) return;
  int64_t slot = label_slot[row];
  if (slot == -1) {  // the row does not count: outputs 0, never read
    if (lane == 0) {
      row_max[row] = log_sum[row] = logprob[row] = A(0);
      if (entropy != nullptr) entropy[row] = A(0);
    }
    return;
  }
  const PairRange pr = pair_range(offsets, row, num_pairs);
  if (slot < pr.first || slot >= pr.last) slot = -2;  // the label is not in the set
  A m = neg_inf<A>();
  for (int64_t p = pr.first + lane; p < pr.last; p += 32) m = fmax(m, z[p]);
  m = warp_reduce(m, MaxOp<A>());  // no lane holds NaN (fmax dropped it)
  const bool empty = m == neg_inf<A>();  // only holes / -inf logits: no distribution
  const A shift = empty ? A(0) : m;
  A rest = A(0);
  A t2 = A(0);
  for (int64_t p = pr.first + lane; p < pr.last; p += 32) {
    const A d2 = (z[p] - shift) * it2;
    const A e = acc_exp2(d2);
    if (p != slot) {
      rest += e;
      t2 += e * floor_finite(d2);  // 0 log 0 = 0 at -inf (holes)
    }
  }
  rest = warp_reduce(rest, SumOp<A>());
  t2 = warp_reduce(t2, SumOp<A>());
  if (lane == 0) {
    const bool has_label = slot >= 0;
    const A d_y = has_label ? (z[slot] - shift) * it : A(0);
    const A e_y = has_label ? acc_exp(d_y) : A(0);
    const A total = e_y + rest;
    const A ls = acc_log(total);
    // -log1p(rest / e_y) keeps 1 - p of a confident label.
    const A lp = rest < e_y ? -acc_log1p(rest / e_y) : d_y - ls;
    const A nan = A(quiet_nan_f());
    row_max[row] = m;
    log_sum[row] = ls;
    logprob[row] = has_label && !empty ? lp : nan;
    if (entropy != nullptr) {
      const A t = A(kLn2) * t2 + e_y * floor_finite(d_y);  // natural units
      entropy[row] = empty ? nan : ls - t / total;
    }
  }
}

// out[p] = it (g (1[p = slot] - p_p) - ge p_p (log p_p + H)) over the row's pairs: grad_row /
// grad_element for the others, grad_label (from the forward's log-prob) for the label's; 0 on holes,
// rows that do not count and rows with g == ge == 0 (never read).
template <class A>
__global__ void __launch_bounds__(kWarpBlock)
    ragged_backward_kernel(const A* __restrict__ z, const int64_t* __restrict__ ids,
                           const int64_t* __restrict__ offsets, const int64_t* __restrict__ label_slot,
                           int64_t rows, int64_t num_pairs, int64_t first_row, A it, A it2,
                           const A* __restrict__ row_max,
                           const A* __restrict__ log_sum, const A* __restrict__ logprob,
                           const A* __restrict__ entropy, const A* __restrict__ grad_logprob,
                           const A* __restrict__ grad_entropy, A* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t row = warp_row(first_row);
  if (row >= rows) return;
  const PairRange pr = pair_range(offsets, row, num_pairs);
  const int64_t slot = label_slot[row];
  const A g = grad_logprob[row];
  const A ge = grad_entropy != nullptr ? grad_entropy[row] : A(0);
  if ((g == A(0) && ge == A(0)) || slot == -1) {
    for (int64_t p = pr.first + lane; p < pr.last; p += 32) out[p] = A(0);
    return;
  }
  const A ent = ge != A(0) ? entropy[row] : A(0);
  const GradRow<A> c = grad_row(row_max[row], log_sum[row], g, ge, ent, it, it2);
  // The label's entry: g (1 - p_y) = -g expm1(log p_y), accurate for confident tokens.
  const A label_grad = grad_label(logprob[row], g, ge, ent, it);
  for (int64_t p = pr.first + lane; p < pr.last; p += 32) {
    A value = A(0);
    if (ids[p] >= 0) {
      if (p == slot) {
        value = label_grad;
      } else {
        const A log2_p = log2_prob(z[p], c);
        value = grad_element(log2_p, acc_exp2(log2_p), c);
      }
    }
    out[p] = value;
  }
}

// ---------------------------------------------------------------------------------------------
// Kept dot products (the fused head)
// ---------------------------------------------------------------------------------------------

// One warp per row, its pairs one after another. A pair's dot product sums the hidden dimension in
// chunks of Pack<T>::kSize elements: lane l takes chunks l, l + 32, ... (FMAs in element order), the
// lane of chunk H / kSize adds the partial last chunk, then a fixed xor-shuffle tree: an order fixed
// by hidden_size (and the dtype) alone. Rows whose hidden and weight rows are both 16-byte aligned
// load whole chunks (LDG.128), others the same elements one by one: the same sums either way.
template <class T>
__global__ void __launch_bounds__(kWarpBlock)
    kept_dot_kernel(const T* __restrict__ hidden, int64_t hidden_row_stride, const T* __restrict__ weight,
                    int64_t weight_row_stride, const T* __restrict__ bias, const int64_t* __restrict__ ids,
                    const int64_t* __restrict__ offsets, int64_t rows, int64_t num_pairs,
                    int64_t first_row, int64_t hidden_size, int64_t vocab, acc_t<T>* __restrict__ out) {
  using A = acc_t<T>;
  constexpr int N = Pack<T>::kSize;
  const int lane = threadIdx.x & 31;
  const int64_t chunks = hidden_size / N;  // whole chunks
  const bool tail_lane = lane == static_cast<int>(chunks % 32);
  const int64_t row = warp_row(first_row);
  if (row >= rows) return;
  const PairRange pr = pair_range(offsets, row, num_pairs);
  const T* h = hidden + opaque(row * hidden_row_stride);
  for (int64_t p = pr.first; p < pr.last; ++p) {
    const int64_t id = ids[p];
    if (id < 0 || id >= vocab) {  // a hole: -inf; outside the vocabulary: NaN, never read
      if (lane == 0) out[p] = id < 0 ? neg_inf<A>() : A(quiet_nan_f());
      continue;
    }
    const T* w = weight + opaque(id * weight_row_stride);
    A acc = A(0);
    if (((reinterpret_cast<uintptr_t>(h) | reinterpret_cast<uintptr_t>(w)) & 15u) == 0) {
      for (int64_t j = lane; j < chunks; j += 32) {
        A hz[N], wz[N];
        load_chunk(h, j, hz);
        load_chunk(w, j, wz);
#pragma unroll
        for (int k = 0; k < N; ++k) acc = fused_multiply_add(hz[k], wz[k], acc);
      }
    } else {
      for (int64_t j = lane; j < chunks; j += 32) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          acc = fused_multiply_add(Elem<T>::load(h[j * N + k]), Elem<T>::load(w[j * N + k]), acc);
        }
      }
    }
    if (tail_lane) {
      for (int64_t i = chunks * N; i < hidden_size; ++i) {
        acc = fused_multiply_add(Elem<T>::load(h[i]), Elem<T>::load(w[i]), acc);
      }
    }
    acc = warp_reduce(acc, SumOp<A>());
    if (lane == 0) out[p] = bias != nullptr ? acc + Elem<T>::load(bias[id]) : acc;
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

// Warp-per-row launches: ceil(rows / kWarpsPerBlock) blocks, split into launches of at most
// kMaxGridX blocks; f(grid, first_row) launches one of them.
template <class F>
void for_warp_row_grids(int64_t rows, F&& f) {
  for_grid_chunks((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, [&](int64_t start, int64_t count) {
    f(static_cast<unsigned>(count), start * kWarpsPerBlock);
  });
}

template <class A>
void launch_ragged(const RaggedRowArgs& a, RaggedOp op, cudaStream_t stream) {
  const A* z = static_cast<const A*>(a.kept_logits);
  const A it = static_cast<A>(a.inv_temperature);
  const A it2 = base2_scale<A>(a.inv_temperature);
  for_warp_row_grids(a.rows, [&](unsigned grid, int64_t first_row) {
    if (op == RaggedOp::kForward) {
      ragged_forward_kernel<A><<<grid, kWarpBlock, 0, stream>>>(
          z, a.offsets, a.label_slot, a.rows, a.num_pairs, first_row, it, it2, static_cast<A*>(a.row_max),
          static_cast<A*>(a.log_sum), static_cast<A*>(a.logprob), static_cast<A*>(a.entropy));
    } else {
      ragged_backward_kernel<A><<<grid, kWarpBlock, 0, stream>>>(
          z, a.ids, a.offsets, a.label_slot, a.rows, a.num_pairs, first_row, it, it2,
          static_cast<const A*>(a.row_max), static_cast<const A*>(a.log_sum), static_cast<const A*>(a.logprob),
          static_cast<const A*>(a.entropy), static_cast<const A*>(a.grad_logprob),
          static_cast<const A*>(a.grad_entropy), static_cast<A*>(a.out));
    }
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host entry points (launch.h)
// ---------------------------------------------------------------------------------------------

const char* kept_gather(const KeptIndexArgs& args, const Launch& launch) {
  if (args.rows == 0 || args.num_pairs == 0) return nullptr;
  DeviceGuard guard(launch.device);
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());
  visit_dtype(args.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_warp_row_grids(args.rows, [&](unsigned grid, int64_t first_row) {
      kept_gather_kernel<T><<<grid, kWarpBlock, 0, as_stream(launch)>>>(
          static_cast<const T*>(args.logits), args.rows, args.vocab, args.row_stride, args.rows_per_batch,
          args.batch_stride, args.ids, args.offsets, args.num_pairs, first_row,
          static_cast<acc_t<T>*>(args.kept_logits));
    });
  });
  return launch_status();
}

const char* kept_scatter(const KeptIndexArgs& args, const Launch& launch) {
  if (args.rows == 0) return nullptr;
  DeviceGuard guard(launch.device);
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());
  visit_dtype(args.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_grid_chunks(args.rows, [&](int64_t start, int64_t count) {
      kept_scatter_kernel<T><<<static_cast<unsigned>(count), kScatterBlock, 0, as_stream(launch)>>>(
          static_cast<const acc_t<T>*>(args.grad), args.ids, args.offsets, args.num_pairs, args.vocab,
          args.row_stride, args.rows_per_batch, args.batch_stride, start, static_cast<T*>(args.out));
    });
  });
  return launch_status();
}

const char* kept_linear_forward(const KeptDotArgs& args, const Launch& launch) {
  if (args.rows == 0 || args.num_pairs == 0) return nullptr;
  DeviceGuard guard(launch.device);
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());
  visit_dtype(args.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_warp_row_grids(args.rows, [&](unsigned grid, int64_t first_row) {
      kept_dot_kernel<T><<<grid, kWarpBlock, 0, as_stream(launch)>>>(
          static_cast<const T*>(args.hidden), args.hidden_row_stride, static_cast<const T*>(args.weight),
          args.weight_row_stride, static_cast<const T*>(args.bias), args.ids, args.offsets, args.rows,
          args.num_pairs, first_row, args.hidden_size, args.vocab, static_cast<acc_t<T>*>(args.out));
    });
  });
  return launch_status();
}

const char* ragged_rows(const RaggedRowArgs& args, RaggedOp op, const Launch& launch) {
  // The forward writes every row's outputs, with or without pairs; the backward writes pairs only.
  if (args.rows == 0 || (op == RaggedOp::kBackward && args.num_pairs == 0)) return nullptr;
  DeviceGuard guard(launch.device);
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());
  if (args.dtype == kFloat64) {
    launch_ragged<double>(args, op, as_stream(launch));
  } else {
    launch_ragged<float>(args, op, as_stream(launch));
  }
  return launch_status();
}

}  // namespace cuda
}  // namespace tpo
