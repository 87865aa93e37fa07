// CPU row ops: picks the widest instruction set this CPU supports (once, at first use) and
// forwards to that copy of the kernels in row_kernels.inl. TPO_CPU_ISA=generic|avx2|avx512
// forces a choice (for tests and benchmarks); an unsupported choice falls back to the best one.
#include "row_ops.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define TPO_DECLARE_ISA(ns)                                                                    \
  namespace tpo {                                                                              \
  namespace cpu {                                                                              \
  namespace ns {                                                                               \
  void row_forward_impl(const void*, int, int64_t, int64_t, int64_t, const int64_t*, double,   \
                        void*, void*, void*);                                                  \
  void row_backward_impl(const void*, int, int64_t, int64_t, int64_t, const int64_t*,          \
                         const void*, const void*, const void*, const void*, double, void*,    \
                         int64_t);                                                             \
  void candidate_forward_impl(const void*, int, int64_t, int64_t, int64_t, const int64_t*,     \
                              int64_t, double, void*);                                         \
  void candidate_backward_impl(const void*, const int64_t*, int64_t, int64_t, int64_t, double, \
                               void*, int);                                                    \
  }                                                                                            \
  }                                                                                            \
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
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

#if defined(TPO_X86_DISPATCH)
#define TPO_DISPATCH(fn, ...)                                \
  switch (current_isa()) {                                   \
    case kAvx512:                                            \
      return avx512::fn(__VA_ARGS__);                        \
    case kAvx2:                                              \
      return avx2::fn(__VA_ARGS__);                          \
    default:                                                 \
      return generic::fn(__VA_ARGS__);                       \
  }
#else
#define TPO_DISPATCH(fn, ...) return generic::fn(__VA_ARGS__);
#endif

void row_forward(const void* logits, int dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                 const int64_t* labels, double inv_temperature, void* lse, void* target,
                 void* entropy) {
  TPO_DISPATCH(row_forward_impl, logits, dtype, rows, vocab, row_stride, labels, inv_temperature,
               lse, target, entropy)
}

void row_backward(const void* logits, int dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                  const int64_t* labels, const void* lse, const void* grad_logprob,
                  const void* grad_entropy, const void* entropy, double inv_temperature,
                  void* out, int64_t out_row_stride) {
  TPO_DISPATCH(row_backward_impl, logits, dtype, rows, vocab, row_stride, labels, lse,
               grad_logprob, grad_entropy, entropy, inv_temperature, out, out_row_stride)
}

// Gathers and scatters of K values per row: no vectorization to gain, baseline code only.
void candidate_forward(const void* logits, int dtype, int64_t rows, int64_t vocab,
                       int64_t row_stride, const int64_t* candidates, int64_t num_candidates,
                       double inv_temperature, void* cand_logits) {
  generic::candidate_forward_impl(logits, dtype, rows, vocab, row_stride, candidates,
                                  num_candidates, inv_temperature, cand_logits);
}

void candidate_backward(const void* grad_cand, const int64_t* candidates, int64_t rows,
                        int64_t num_candidates, int64_t vocab, double inv_temperature, void* out,
                        int dtype) {
  generic::candidate_backward_impl(grad_cand, candidates, rows, num_candidates, vocab,
                                   inv_temperature, out, dtype);
}

}  // namespace cpu
}  // namespace tpo
