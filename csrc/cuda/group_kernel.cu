// The TPO group op (layer 2) in one launch: one block per group computes the sequence log-probs
// of its members (deterministic segmented sums of token log-probs), the standardized scores u,
// p = softmax(ell), q = softmax(ell_old + u/eta) (or softmax(u/eta)) and the group loss
// -sum q log p (GroupArgs in tpo_abi.h).
//
// Matches tpo_kernels.group_op.group_targets: ties are detected as max(s) == min(s) (u = 0), the
// std is the population std, and p and q go through the same block_softmax code, so a tied
// on-policy group gets q == p bit for bit (its gradient p - q is exactly 0). Every reduction has
// a fixed shape and order, so results are bitwise reproducible run to run.
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
                         const A* __restrict__ old_seq_logprobs, A eta, bool anchor, A* ell,
                         A* u, A* p, A* q, A* __restrict__ group_loss) {
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
  }
  const A loss = block_reduce<kGroupBlock>(local_loss, SumOp<A>(), scratch);
  if (threadIdx.x == 0) group_loss[group] = -loss;
}

template <class A>
void launch_group_targets(const GroupArgs& a, cudaStream_t stream) {
  for_grid_chunks(a.num_groups, [&](int64_t start, int64_t count) {
    group_targets_kernel<A><<<static_cast<unsigned>(count), kGroupBlock, 0, stream>>>(
        static_cast<const A*>(a.token_logprobs), a.seq_start, a.seq_len, a.group_offsets + start,
        a.group_members, static_cast<const A*>(a.scores),
        static_cast<const A*>(a.old_seq_logprobs), static_cast<A>(a.eta), a.anchor,
        static_cast<A*>(a.seq_logprobs), static_cast<A*>(a.u), static_cast<A*>(a.p),
        static_cast<A*>(a.q), static_cast<A*>(a.group_loss) + start);
  });
}

}  // namespace

const char* group_targets(const GroupArgs& args, const Launch& launch) {
  if (args.num_groups == 0) return nullptr;
  DeviceGuard guard(launch.device);
  if (guard.status() != cudaSuccess) return cudaGetErrorString(guard.status());
  if (args.dtype == kFloat64) {
    launch_group_targets<double>(args, as_stream(launch));
  } else {
    launch_group_targets<float>(args, as_stream(launch));
  }
  return launch_status();
}

}  // namespace cuda
}  // namespace tpo
