// CPU row ops: picks the widest instruction set this CPU supports (once, at first use) and
// forwards to that copy of the kernels in row_kernels.inl. TPO_CPU_ISA=generic|avx2|avx512
// forces a choice (for tests and benchmarks); an unsupported choice falls back to the best one.
#include "row_ops.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>
#include <limits>
#include <thread>

#include "../row_math.h"
#include "parallel.h"

// Each instruction set's copy of the kernels (row_kernels.inl) lives in a namespace of its own.
#define TPO_DECLARE_ISA(ns)                              \
  namespace tpo {                                        \
  namespace cpu {                                        \
  namespace ns {                                         \
  void row_forward_impl(const RowForwardArgs& args, int64_t begin, int64_t end);   \
  void row_backward_impl(const RowBackwardArgs& args, int64_t begin, int64_t end); \
  void kept_dot_impl(const KeptDotArgs& args, int64_t begin, int64_t end);          \
  }                                                      \
  }                                                      \
  }

TPO_DECLARE_ISA(generic)
#if defined(__x86_64__) && defined(__GNUC__)
#define TPO_X86_DISPATCH 1
TPO_DECLARE_ISA(avx2)
TPO_DECLARE_ISA(avx512)
#endif

namespace tpo {
namespace cpu {

namespace {

enum Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

int best_supported_isa() {
#if defined(TPO_X86_DISPATCH)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kGeneric;
}

int parse_isa(const char* name, int best) {
  if (name == nullptr || *name == '\0') return best;
  int wanted = best;
  if (strcmp(name, "generic") == 0) wanted = kGeneric;
  if (strcmp(name, "avx2") == 0) wanted = kAvx2;
  if (strcmp(name, "avx512") == 0) wanted = kAvx512;
  return wanted <= best ? wanted : best;
}

int g_isa = -1;

int current_isa() {
  if (g_isa < 0) g_isa = parse_isa(getenv("TPO_CPU_ISA"), best_supported_isa());
  return g_isa;
}

}  // namespace

const char* isa_name() {
  static const char* names[] = {"generic", "avx2", "avx512"};
  return names[current_isa()];
}

const char* set_isa(const char* name) {
  g_isa = parse_isa(name, best_supported_isa());
  return isa_name();
}

int max_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

int row_threads(int64_t rows, int64_t vocab, int requested) { return plan_threads(rows, vocab, requested); }

#if defined(TPO_X86_DISPATCH)
#define TPO_DISPATCH(fn, args, begin, end) \
  switch (current_isa()) {                   \
    case kAvx512:                            \
      return avx512::fn(args, begin, end);   \
    case kAvx2:                              \
      return avx2::fn(args, begin, end);     \
    default:                                 \
      return generic::fn(args, begin, end);  \
  }
#else
#define TPO_DISPATCH(fn, args, begin, end) return generic::fn(args, begin, end);
#endif

void row_forward(const RowForwardArgs& args, int num_threads) {
  parallel_rows(args.rows, args.vocab, plan_threads(args.rows, args.vocab, num_threads),
                [&](int64_t begin, int64_t end) { TPO_DISPATCH(row_forward_impl, args, begin, end) });
}

void row_backward(const RowBackwardArgs& args, int num_threads) {
  parallel_rows(args.rows, args.vocab, plan_threads(args.rows, args.vocab, num_threads),
                [&](int64_t begin, int64_t end) { TPO_DISPATCH(row_backward_impl, args, begin, end) });
}

void kept_linear_forward(const KeptDotArgs& args, int num_threads) {
  // The mean pairs per row times H elements per row: threads by the call's work, as a row op.
  const int64_t per_row = args.rows > 0 ? (args.num_pairs / args.rows + 1) * args.hidden_size : 0;
  parallel_rows(args.rows, per_row, plan_threads(args.rows, per_row, num_threads),
                [&](int64_t begin, int64_t end) { TPO_DISPATCH(kept_dot_impl, args, begin, end) });
}

namespace {

template <class A>
void ragged_forward_rows(const RaggedRowArgs& a, int64_t begin, int64_t end) {
  const A* z = static_cast<const A*>(a.kept_logits);
  A* row_max = static_cast<A*>(a.row_max);
  A* log_sum = static_cast<A*>(a.log_sum);
  A* logprob = static_cast<A*>(a.logprob);
  A* entropy = static_cast<A*>(a.entropy);
  const A it = static_cast<A>(a.inv_temperature);
  const A inf = std::numeric_limits<A>::infinity();
  const A nan = std::numeric_limits<A>::quiet_NaN();
  for (int64_t r = begin; r < end; ++r) {
    const int64_t first = a.offsets[r], last = a.offsets[r + 1];
    int64_t slot = a.label_slot[r];
    if (slot == -1) {  // the row does not count: outputs 0, never read
      row_max[r] = log_sum[r] = logprob[r] = A(0);
      if (entropy != nullptr) entropy[r] = A(0);
      continue;
    }
    if (slot < first || slot >= last) slot = -2;  // the label is not in the set (the guard on the slot)
    A m = -inf;
    for (int64_t p = first; p < last; ++p) m = z[p] > m ? z[p] : m;
    const A shift = m == -inf ? A(0) : m;
    A rest = 0, t = 0;
    for (int64_t p = first; p < last; ++p) {
      const A d = (z[p] - shift) * it;
      const A e = std::exp(d);
      if (p != slot) rest += e;  // the label's mass is added apart
      if (e != A(0)) t += e * d;  // 0 log 0 = 0 at -inf (holes)
    }
    const bool has_label = slot >= 0;
    const A d_y = has_label ? (z[slot] - shift) * it : A(0);
    const A e_y = has_label ? std::exp(d_y) : A(0);
    const A total = e_y + rest;
    const A ls = std::log(total);
    // -log1p(rest / e_y) keeps 1 - p of a confident label.
    const A lp = rest < e_y ? -std::log1p(rest / e_y) : d_y - ls;
    const bool empty = m == -inf;
    row_max[r] = m;
    log_sum[r] = ls;
    logprob[r] = has_label && !empty ? lp : nan;
    if (entropy != nullptr) entropy[r] = empty ? nan : ls - t / total;
  }
}

template <class A>
void ragged_backward_rows(const RaggedRowArgs& a, int64_t begin, int64_t end) {
  const A* z = static_cast<const A*>(a.kept_logits);
  const A* row_max = static_cast<const A*>(a.row_max);
  const A* log_sum = static_cast<const A*>(a.log_sum);
  const A* logprob = static_cast<const A*>(a.logprob);
  const A* entropy = static_cast<const A*>(a.entropy);
  const A* grad = static_cast<const A*>(a.grad_logprob);
  const A* grad_entropy = static_cast<const A*>(a.grad_entropy);
  A* out = static_cast<A*>(a.out);
  const A it = static_cast<A>(a.inv_temperature);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t first = a.offsets[r], last = a.offsets[r + 1];
    const int64_t slot = a.label_slot[r];
    const A g = grad[r];
    const A ge = grad_entropy != nullptr ? grad_entropy[r] : A(0);
    if ((g == A(0) && ge == A(0)) || slot == -1) {  // zeros, the row never read
      for (int64_t p = first; p < last; ++p) out[p] = A(0);
      continue;
    }
    const A ent = ge != A(0) ? entropy[r] : A(0);
    const A lp = logprob[r];
    // The label's entry: g (1 - p_y) = -g expm1(log p_y), accurate for confident tokens.
    const A label_term = -g * std::expm1(lp) - ge * std::exp(lp) * (lp + ent);
    for (int64_t p = first; p < last; ++p) {
      if (a.ids[p] < 0) {
        out[p] = A(0);
      } else if (p == slot) {
        out[p] = label_term * it;
      } else {
        const A log_p = (z[p] - row_max[r]) * it - log_sum[r];
        const A prob = std::exp(log_p);
        const A dz = -g * prob - (prob == A(0) ? A(0) : ge * prob * (log_p + ent));
        out[p] = dz * it;
      }
    }
  }
}

}  // namespace

void ragged_rows(const RaggedRowArgs& args, RaggedOp op, int num_threads) {
  // Sequential per row; threads over rows by the call's work (the mean pairs per row).
  const int64_t per_row = args.rows > 0 ? args.num_pairs / args.rows + 1 : 0;
  const int threads = plan_threads(args.rows, per_row, num_threads);
  parallel_rows(args.rows, per_row, threads, [&](int64_t begin, int64_t end) {
    if (args.dtype == kFloat64) {
      op == RaggedOp::kForward ? ragged_forward_rows<double>(args, begin, end)
                               : ragged_backward_rows<double>(args, begin, end);
    } else {
      op == RaggedOp::kForward ? ragged_forward_rows<float>(args, begin, end)
                               : ragged_backward_rows<float>(args, begin, end);
    }
  });
}

}  // namespace cpu
}  // namespace tpo
