// The TPO group op (layer 2 of DESIGN.md) in one launch: one block per group computes the
// sequence log-probs of its members (deterministic segmented sums of token log-probs), the
// standardized scores u, p = softmax(ell), q = softmax(ell_old + u/eta) (or softmax(u/eta)),
// the group loss -sum q log p and the coefficients c = w (p - q).
//
// Matches tpo_kernels.targets.group_targets: ties are detected as max(s) == min(s) (u = 0), the
// std is the population std, and p and q go through the same block_softmax code, so a tied
// on-policy group gets q == p bit for bit and c == 0 exactly. Every reduction has a fixed shape
// and order, so results are bitwise reproducible run to run.
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"
#include "launch.h"

namespace tpo {
namespace cuda {
namespace {

constexpr int kGroupBlock = 256;

template <class A>
struct SoftmaxStats {
  A max;
  A sum;
};

// Max and sum of exp(x - max) over the group's values x[j] (j = member slot), taken from
// `values` indexed by member ids. Each thread owns slots threadIdx.x + k * kGroupBlock.
template <class A>
__device__ SoftmaxStats<A> block_softmax(const A* values, const int64_t* members, int64_t count,
                                         A* scratch) {
  A local_max = neg_inf<A>();
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    const A v = values[members[j]];
    local_max = v > local_max ? v : local_max;
  }
  SoftmaxStats<A> stats;
  stats.max = block_reduce<kGroupBlock>(local_max, MaxOp<A>(), scratch);
  A local_sum = A(0);
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    local_sum += acc_exp(values[members[j]] - stats.max);
  }
  stats.sum = block_reduce<kGroupBlock>(local_sum, SumOp<A>(), scratch);
  return stats;
}

template <class A>
__global__ void __launch_bounds__(kGroupBlock)
    group_targets_kernel(const A* __restrict__ token_logprobs, const int64_t* __restrict__ seq_start,
                         const int64_t* __restrict__ seq_len,
                         const int64_t* __restrict__ group_offsets,
                         const int64_t* __restrict__ group_members, const A* __restrict__ scores,
                         const A* __restrict__ old_seq_logprobs, A eta, bool anchor, A weight,
                         A* ell, A* u, A* p, A* q, A* __restrict__ group_loss, A* coef) {
  __shared__ A scratch[kGroupBlock / 32];
  const int64_t group = blockIdx.x;
  const int64_t begin = group_offsets[group];
  const int64_t count = group_offsets[group + 1] - begin;
  const int64_t* members = group_members + begin;

  // 1. ell[n] = sum of the member's token log-probs (masked tokens hold 0).
  for (int64_t j = 0; j < count; ++j) {
    const int64_t n = members[j];
    const A* tokens = token_logprobs + seq_start[n];
    const int64_t len = seq_len[n];
    A partial = A(0);
    for (int64_t t = threadIdx.x; t < len; t += kGroupBlock) partial += tokens[t];
    const A total = block_reduce<kGroupBlock>(partial, SumOp<A>(), scratch);
    if (threadIdx.x == 0) ell[n] = total;
  }
  __syncthreads();  // ell of every member visible to the whole block

  // 2. u = (s - mean) / std, population std; 0 for the whole group when all scores tie.
  A local_sum = A(0), local_max = neg_inf<A>(), local_min = -neg_inf<A>();
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    const A s = scores[members[j]];
    local_sum += s;
    local_max = s > local_max ? s : local_max;
    local_min = s < local_min ? s : local_min;
  }
  const A n_members = static_cast<A>(count);
  const A mean = block_reduce<kGroupBlock>(local_sum, SumOp<A>(), scratch) / n_members;
  const A s_max = block_reduce<kGroupBlock>(local_max, MaxOp<A>(), scratch);
  const A s_min = block_reduce<kGroupBlock>(local_min, MinOp<A>(), scratch);
  A local_sq = A(0);
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    const A c = scores[members[j]] - mean;
    local_sq += c * c;
  }
  const A std_dev = sqrt(block_reduce<kGroupBlock>(local_sq, SumOp<A>(), scratch) / n_members);
  const bool tied = s_max == s_min;
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    const int64_t n = members[j];
    u[n] = tied ? A(0) : (scores[n] - mean) / std_dev;
    // The softmax input of q, staged in q[] (overwritten by q below).
    const A base = old_seq_logprobs != nullptr ? old_seq_logprobs[n] : ell[n];
    q[n] = anchor ? base + u[n] / eta : u[n] / eta;
  }
  __syncthreads();

  // 3. p and q through the same code: identical inputs give identical outputs.
  const SoftmaxStats<A> ps = block_softmax(ell, members, count, scratch);
  const SoftmaxStats<A> qs = block_softmax(q, members, count, scratch);
  const A log_p_norm = ps.max + acc_log(ps.sum);
  A local_loss = A(0);
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    const int64_t n = members[j];
    const A pn = acc_exp(ell[n] - ps.max) / ps.sum;
    const A qn = acc_exp(q[n] - qs.max) / qs.sum;
    local_loss += qn * (ell[n] - log_p_norm);
    p[n] = pn;
    q[n] = qn;  // same thread read q[n] just above: no race
    coef[n] = (pn - qn) * weight;
  }
  const A loss = block_reduce<kGroupBlock>(local_loss, SumOp<A>(), scratch);
  if (threadIdx.x == 0) group_loss[group] = -loss;
}

template <class A>
const char* group_typed(const void* token_logprobs, const int64_t* seq_start,
                        const int64_t* seq_len, const int64_t* group_offsets,
                        const int64_t* group_members, int64_t num_groups, const void* scores,
                        const void* old, double eta, bool anchor, double weight, void* ell,
                        void* u, void* p, void* q, void* group_loss, void* coef,
                        cudaStream_t stream) {
  for (int64_t start = 0; start < num_groups; start += kMaxGridX) {
    const int64_t count = num_groups - start < kMaxGridX ? num_groups - start : kMaxGridX;
    group_targets_kernel<A><<<static_cast<unsigned>(count), kGroupBlock, 0, stream>>>(
        static_cast<const A*>(token_logprobs), seq_start, seq_len, group_offsets + start,
        group_members, static_cast<const A*>(scores), static_cast<const A*>(old),
        static_cast<A>(eta), anchor, static_cast<A>(weight), static_cast<A*>(ell),
        static_cast<A*>(u), static_cast<A*>(p), static_cast<A*>(q),
        static_cast<A*>(group_loss) + start, static_cast<A*>(coef));
  }
  return launch_status();
}

}  // namespace

const char* group_targets(int value_dtype, const void* token_logprobs, const int64_t* seq_start,
                          const int64_t* seq_len, const int64_t* group_offsets,
                          const int64_t* group_members, int64_t num_groups, const void* scores,
                          const void* old_seq_logprobs, double eta, bool anchor, double weight,
                          void* seq_logprobs, void* u, void* p, void* q, void* group_loss,
                          void* coef, int device, void* stream) {
  if (num_groups == 0) return nullptr;
  DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (value_dtype == 0) {
    return group_typed<float>(token_logprobs, seq_start, seq_len, group_offsets, group_members,
                              num_groups, scores, old_seq_logprobs, eta, anchor, weight,
                              seq_logprobs, u, p, q, group_loss, coef, s);
  }
  if (value_dtype == 3) {
    return group_typed<double>(token_logprobs, seq_start, seq_len, group_offsets, group_members,
                               num_groups, scores, old_seq_logprobs, eta, anchor, weight,
                               seq_logprobs, u, p, q, group_loss, coef, s);
  }
  return "group_targets: value dtype must be float32 (0) or float64 (3)";
}

}  // namespace cuda
}  // namespace tpo
