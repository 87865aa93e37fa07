// The TPO group op (layer 2) in one launch: one block per group computes the sequence log-probs
// of its members (deterministic segmented sums of token log-probs), the standardized scores u,
// p = softmax(ell + lw), q = softmax((ell_old + lw) + u/eta) (or softmax(lw + u/eta)) and the
// group loss -sum q log p (GroupArgs in tpo_abi.h; lw = 0 without seq_log_weights; a member with
// lw = -inf is out of u, p and q: 0 there, and a group with no other member has loss 0).
//
// Matches tpo_kernels.group_op.group_targets: ties are detected as max(s) == min(s) (u = 0), the
// std is the population std of x = (s/2 - min/2) / spread (exact differences of nearby scores, no
// overflow or underflow), a near tie (std(s) = 2 spread std(x) <= score_eps) keeps the undivided
// s - mean = 2 spread (x - mean(x)), p and q go through the same block_softmax code, so a tied on-policy
// group gets q == p bit for bit (its gradient p - q is exactly 0), and loss terms with q == 0
// count 0. Token log-probs are read in their dtype (T); every sum and all the group math run in
// double, into double outputs (fp32 sums over long completions are off by 1e-3 in p). Every
// reduction has a fixed shape and order, so results are bitwise reproducible run to run.
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

template <class T>
__global__ void __launch_bounds__(kGroupBlock)
    group_targets_kernel(const T* __restrict__ token_logprobs, const int64_t* __restrict__ seq_start,
                         const int64_t* __restrict__ seq_len,
                         const int64_t* __restrict__ group_offsets,
                         const int64_t* __restrict__ group_members,
                         const double* __restrict__ scores,
                         const double* __restrict__ old_seq_logprobs,
                         const double* __restrict__ log_weights, double eta,
                         double score_eps, bool anchor,
                         double* ell, double* u, double* p, double* q,
                         double* __restrict__ group_loss) {
  using A = double;
  __shared__ A scratch[kGroupBlock / 32];
  const int64_t group = blockIdx.x;
  const int64_t begin = group_offsets[group];
  const int64_t count = group_offsets[group + 1] - begin;
  const int64_t* members = group_members + begin;
  // A member with w = 0 (lw = -inf) takes no part in u, p or q.
  auto weighted = [&](int64_t n) { return log_weights == nullptr || log_weights[n] > neg_inf<A>(); };

  // 1. ell[n] = sum of the member's token log-probs (masked tokens hold 0), in double.
  for (int64_t j = 0; j < count; ++j) {
    const int64_t n = members[j];
    const T* tokens = token_logprobs + seq_start[n];
    const int64_t len = seq_len[n];
    A partial = A(0);
    for (int64_t t = threadIdx.x; t < len; t += kGroupBlock) partial += static_cast<A>(tokens[t]);
    const A total = block_reduce<kGroupBlock>(partial, SumOp<A>(), scratch);
    if (threadIdx.x == 0) ell[n] = total;
  }
  __syncthreads();  // ell of every member visible to the whole block

  // 2. u = (x - mean) / std of x = (s/2 - min/2) / spread, population std; 0 for the whole group
  //    when all scores tie; 2 spread (x - mean) = s - mean when std(s) <= score_eps (never for 0).
  A local_max = neg_inf<A>(), local_min = -neg_inf<A>(), local_count = A(0);
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    if (!weighted(members[j])) continue;
    const A s = scores[members[j]];
    local_max = s > local_max ? s : local_max;
    local_min = s < local_min ? s : local_min;
    local_count += A(1);
  }
  const A s_max = block_reduce<kGroupBlock>(local_max, MaxOp<A>(), scratch);
  const A s_min = block_reduce<kGroupBlock>(local_min, MinOp<A>(), scratch);
  const bool tied = s_max == s_min;
  const A half_min = tied ? A(0) : s_min * A(0.5);
  A local_spread = A(0);
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    if (!weighted(members[j])) continue;
    const A d = scores[members[j]] * A(0.5) - half_min;
    local_spread = d > local_spread ? d : local_spread;
  }
  const A spread = block_reduce<kGroupBlock>(local_spread, MaxOp<A>(), scratch);
  const bool flat = tied || spread == A(0);
  const A scale = flat ? A(1) : spread;
  A local_sum = A(0);
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    if (weighted(members[j])) local_sum += (scores[members[j]] * A(0.5) - half_min) / scale;
  }
  const A n_members = block_reduce<kGroupBlock>(local_count, SumOp<A>(), scratch);
  const A mean = block_reduce<kGroupBlock>(local_sum, SumOp<A>(), scratch) / n_members;
  A local_sq = A(0);
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    if (!weighted(members[j])) continue;
    const A c = (scores[members[j]] * A(0.5) - half_min) / scale - mean;
    local_sq += c * c;
  }
  const A std_dev = sqrt(block_reduce<kGroupBlock>(local_sq, SumOp<A>(), scratch) / n_members);
  const bool near_tie = std_dev <= (score_eps * A(0.5)) / scale;
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    const int64_t n = members[j];
    const A c = (scores[n] * A(0.5) - half_min) / scale - mean;
    const bool in_w = weighted(n);
    u[n] = flat || !in_w ? A(0) : near_tie ? c * (scale * A(2)) : c / std_dev;
    // The softmax inputs of p and q, staged in p[] and q[] (overwritten below); lw enters both
    // by one same add, so a tied on-policy group keeps q == p bit for bit.
    A base = anchor ? (old_seq_logprobs != nullptr ? old_seq_logprobs[n] : ell[n]) : A(0);
    A policy = ell[n];
    if (log_weights != nullptr) {
      policy = policy + log_weights[n];
      base = base + log_weights[n];
    }
    p[n] = in_w ? policy : neg_inf<A>();
    q[n] = in_w ? (anchor || log_weights != nullptr ? base + u[n] / eta : u[n] / eta) : neg_inf<A>();
  }
  __syncthreads();

  // 3. p and q through the same code: identical inputs give identical outputs.
  const SoftmaxStats<A> ps = block_softmax(p, members, count, scratch);
  const SoftmaxStats<A> qs = block_softmax(q, members, count, scratch);
  const A log_p_norm = ps.max + acc_log(ps.sum);
  A local_loss = A(0);
  for (int64_t j = threadIdx.x; j < count; j += kGroupBlock) {
    const int64_t n = members[j];
    const bool in_w = weighted(n);  // a group with no weighted member: p = q = 0, loss 0
    const A pn = in_w ? acc_exp(p[n] - ps.max) / ps.sum : A(0);
    const A qn = in_w ? acc_exp(q[n] - qs.max) / qs.sum : A(0);
    if (qn > A(0)) local_loss += qn * (p[n] - log_p_norm);  // q == 0: 0, not 0 * -inf
    p[n] = pn;
    q[n] = qn;  // same thread read q[n] just above: no race
  }
  const A loss = block_reduce<kGroupBlock>(local_loss, SumOp<A>(), scratch);
  if (threadIdx.x == 0) group_loss[group] = -loss;
}

template <class T>
void launch_group_targets(const GroupArgs& a, cudaStream_t stream) {
  for_grid_chunks(a.num_groups, [&](int64_t start, int64_t count) {
    group_targets_kernel<T><<<static_cast<unsigned>(count), kGroupBlock, 0, stream>>>(
        static_cast<const T*>(a.token_logprobs), a.seq_start, a.seq_len, a.group_offsets + start,
        a.group_members, a.scores, a.old_seq_logprobs, a.seq_log_weights, a.eta, a.score_eps, a.anchor,
        a.seq_logprobs, a.u, a.p,
        a.q, a.group_loss + start);
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
