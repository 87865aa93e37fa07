// CPU row kernels, written once and compiled once per instruction set (row_ops_*.cpp include this
// file inside their own namespace TPO_ISA_NS after selecting a target with `#pragma GCC target`).
// The inner loops are branch-free over contiguous arrays with `#pragma omp simd`, so the compiler
// vectorizes them, including the inlined exp_f32 from row_math.h.
//
// Requires, before inclusion: <stdint.h>, <string.h>, <math.h>, <algorithm>, "row_math.h",
// "row_ops.h", and TPO_ISA_NS defined.

namespace tpo {
namespace cpu {
namespace TPO_ISA_NS {

// Storage types for the 16-bit formats (raw bit patterns).
struct bf16_t {
  uint16_t bits;
};
struct half_t {
  uint16_t bits;
};

inline float load(float x) { return x; }
inline double load(double x) { return x; }
inline float load(bf16_t x) { return bf16_to_float(x.bits); }
inline float load(half_t x) { return half_to_float(x.bits); }

template <class T>
struct Store;
template <>
struct Store<float> {
  static float from(float a) { return a; }
};
template <>
struct Store<double> {
  static double from(double a) { return a; }
};
template <>
struct Store<bf16_t> {
  static bf16_t from(float a) { return bf16_t{float_to_bf16(a)}; }
};
template <>
struct Store<half_t> {
  static half_t from(float a) { return half_t{float_to_half(a)}; }
};

template <class T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

// Forward: rows are processed in L1-sized chunks, one pass for the chunk max and a second (from
// L1) for the exp sums; chunk summaries merge through the online-softmax state, so memory sees
// one read per row. While a chunk's exps are computed, the next chunk is prefetched, which
// overlaps the memory stream with the arithmetic.
constexpr int64_t kChunk = 4096;
constexpr int64_t kSubChunk = 256;

template <class T>
inline void prefetch_range(const T* begin, const T* end) {
  const char* p = reinterpret_cast<const char*>(begin);
  const char* e = reinterpret_cast<const char*>(end);
  for (; p < e; p += 64) __builtin_prefetch(p, 0, 3);
}

// max_i z_i (NaNs ignored here, flagged in nan_seen).
template <class T, class A>
A chunk_max(const T* x, int64_t n, A it, int& nan_seen) {
  A m = neg_inf<A>();
#pragma omp simd reduction(max : m) reduction(| : nan_seen)
  for (int64_t i = 0; i < n; ++i) {
    const A z = load(x[i]) * it;
    m = z > m ? z : m;
    nan_seen |= (z != z);
  }
  return m;
}

// s += sum exp(z - ref), t += sum exp(z - ref)(z - ref) (when with_t).
template <class T, class A>
void chunk_sums(const T* x, int64_t n, A it, A ref, bool with_t, A& s_acc, A& t_acc) {
  const A ninf = neg_inf<A>();
  A s = 0, t = 0;
  if (with_t) {
#pragma omp simd reduction(+ : s, t)
    for (int64_t i = 0; i < n; ++i) {
      const A d = load(x[i]) * it - ref;
      const A e = acc_exp(d);
      s += e;
      t += e * (d > ninf ? d : A(0));  // e = 0 where d = -inf: 0, not 0 * -inf
    }
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += acc_exp(load(x[i]) * it - ref);
  }
  s_acc += s;
  t_acc += t;
}

template <class T>
void forward_row(const T* row, int64_t vocab, typename AccOf<T>::type it, int64_t label,
                 typename AccOf<T>::type* lse, typename AccOf<T>::type* target,
                 typename AccOf<T>::type* entropy) {
  using A = typename AccOf<T>::type;
  const A ninf = neg_inf<A>();
  const bool with_t = entropy != nullptr;
  SoftmaxState<A> state = softmax_empty<A>();
  int nan_seen = 0;
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const T* x = row + c0;
    SoftmaxState<A> chunk;
    chunk.m = chunk_max(x, n, it, nan_seen);
    if (!(chunk.m > ninf)) continue;  // all -inf (or NaN, flagged above): contributes nothing
    chunk.s = A(0);
    chunk.t = A(0);
    const T* next = x + n;
    const int64_t next_n = std::min(kChunk, vocab - c0 - n);
    const int64_t step = next_n > 0 ? std::max<int64_t>(1, next_n * kSubChunk / n) : 0;
    for (int64_t i0 = 0, p0 = 0; i0 < n; i0 += kSubChunk, p0 += step) {
      if (p0 < next_n) prefetch_range(next + p0, next + std::min(next_n, p0 + step));
      chunk_sums(x + i0, std::min(kSubChunk, n - i0), it, chunk.m, with_t, chunk.s, chunk.t);
    }
    state = softmax_merge(state, chunk);
  }
  const A nan = A(quiet_nan_f());
  *lse = nan_seen ? nan : softmax_lse(state);
  *target = load(row[label]) * it;
  if (entropy != nullptr) *entropy = nan_seen ? nan : softmax_entropy(state);
}

template <class T>
void forward_rows(const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                  const int64_t* labels, double inv_temperature, void* lse_out, void* target_out,
                  void* entropy_out) {
  using A = typename AccOf<T>::type;
  const T* base = static_cast<const T*>(logits);
  A* lse = static_cast<A*>(lse_out);
  A* target = static_cast<A*>(target_out);
  A* entropy = static_cast<A*>(entropy_out);
  const A it = static_cast<A>(inv_temperature);
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t label = labels[r];
    if (label < 0) {  // skipped row: outputs 0, logits never read
      lse[r] = A(0);
      target[r] = A(0);
      if (entropy != nullptr) entropy[r] = A(0);
      continue;
    }
    forward_row<T>(base + r * row_stride, vocab, it, label, lse + r, target + r,
                   entropy != nullptr ? entropy + r : nullptr);
  }
}

template <class T>
void backward_row(const T* x, T* out, int64_t vocab, typename AccOf<T>::type it, int64_t label,
                  typename AccOf<T>::type lse, typename AccOf<T>::type g,
                  typename AccOf<T>::type ge, typename AccOf<T>::type ent) {
  using A = typename AccOf<T>::type;
  if (g == A(0) && ge == A(0)) {  // zero-signal row: write zeros, never read the logits
    memset(static_cast<void*>(out), 0, static_cast<size_t>(vocab) * sizeof(T));
    return;
  }
  // Read the label's logit before the loop, which may overwrite it (in-place backward).
  const A label_log_p = label >= 0 ? load(x[label]) * it - lse : A(0);
  if (ge == A(0)) {
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) {
      const A p = acc_exp(load(x[v]) * it - lse);
      out[v] = Store<T>::from(grad_element_nolabel(p, g, it));
    }
  } else {
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) {
      const A log_p = load(x[v]) * it - lse;
      const A p = acc_exp(log_p);
      out[v] = Store<T>::from(grad_element(log_p, p, g, ge, ent, false, it));
    }
  }
  if (label >= 0) {
    const A p = acc_exp(label_log_p);
    out[label] = Store<T>::from(grad_element(label_log_p, p, g, ge, ent, true, it));
  }
}

template <class T>
void backward_rows(const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                   const int64_t* labels, const void* lse_in, const void* g_in, const void* ge_in,
                   const void* ent_in, double inv_temperature, void* out_ptr,
                   int64_t out_row_stride) {
  using A = typename AccOf<T>::type;
  const T* base = static_cast<const T*>(logits);
  T* out = static_cast<T*>(out_ptr);
  const A* lse = static_cast<const A*>(lse_in);
  const A* g = static_cast<const A*>(g_in);
  const A* ge = static_cast<const A*>(ge_in);
  const A* ent = static_cast<const A*>(ent_in);
  const A it = static_cast<A>(inv_temperature);
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t r = 0; r < rows; ++r) {
    const A ge_r = ge != nullptr ? ge[r] : A(0);
    const A ent_r = (ge_r != A(0) && ent != nullptr) ? ent[r] : A(0);
    backward_row<T>(base + r * row_stride, out + r * out_row_stride, vocab, it, labels[r], lse[r],
                    g[r], ge_r, ent_r);
  }
}

template <class T>
void candidate_forward_rows(const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                            const int64_t* candidates, int64_t k, double inv_temperature,
                            void* out_ptr) {
  using A = typename AccOf<T>::type;
  (void)vocab;
  const T* base = static_cast<const T*>(logits);
  A* out = static_cast<A*>(out_ptr);
  const A it = static_cast<A>(inv_temperature);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = base + r * row_stride;
    for (int64_t j = 0; j < k; ++j) out[r * k + j] = load(row[candidates[r * k + j]]) * it;
  }
}

template <class T>
void candidate_backward_rows(const void* grad_in, const int64_t* candidates, int64_t rows,
                             int64_t k, int64_t vocab, double inv_temperature, void* out_ptr) {
  using A = typename AccOf<T>::type;
  const A* grad = static_cast<const A*>(grad_in);
  T* out = static_cast<T*>(out_ptr);
  const A it = static_cast<A>(inv_temperature);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* row = out + r * vocab;
    memset(static_cast<void*>(row), 0, static_cast<size_t>(vocab) * sizeof(T));
    const int64_t* cand = candidates + r * k;
    const A* gr = grad + r * k;
    for (int64_t j = 0; j < k; ++j) {
      bool seen = false;  // handled with an earlier duplicate
      for (int64_t i = 0; i < j; ++i) seen = seen || cand[i] == cand[j];
      if (seen) continue;
      // Sum every occurrence of this candidate in ascending k order, starting from 0 as a
      // column-by-column scatter_add would.
      A acc = A(0);
      for (int64_t i = j; i < k; ++i) {
        if (cand[i] == cand[j]) acc += gr[i] * it;
      }
      row[cand[j]] = Store<T>::from(acc);
    }
  }
}

// Entry points with runtime dtype dispatch, one set per ISA (declared in row_ops.cpp).
void row_forward_impl(const void* logits, int dtype, int64_t rows, int64_t vocab,
                             int64_t row_stride, const int64_t* labels, double it, void* lse,
                             void* target, void* entropy) {
  switch (dtype) {
    case kFloat32:
      return forward_rows<float>(logits, rows, vocab, row_stride, labels, it, lse, target, entropy);
    case kFloat16:
      return forward_rows<half_t>(logits, rows, vocab, row_stride, labels, it, lse, target, entropy);
    case kBFloat16:
      return forward_rows<bf16_t>(logits, rows, vocab, row_stride, labels, it, lse, target, entropy);
    default:
      return forward_rows<double>(logits, rows, vocab, row_stride, labels, it, lse, target, entropy);
  }
}

void row_backward_impl(const void* logits, int dtype, int64_t rows, int64_t vocab,
                              int64_t row_stride, const int64_t* labels, const void* lse,
                              const void* g, const void* ge, const void* ent, double it, void* out,
                              int64_t out_row_stride) {
  switch (dtype) {
    case kFloat32:
      return backward_rows<float>(logits, rows, vocab, row_stride, labels, lse, g, ge, ent, it, out,
                                  out_row_stride);
    case kFloat16:
      return backward_rows<half_t>(logits, rows, vocab, row_stride, labels, lse, g, ge, ent, it,
                                   out, out_row_stride);
    case kBFloat16:
      return backward_rows<bf16_t>(logits, rows, vocab, row_stride, labels, lse, g, ge, ent, it,
                                   out, out_row_stride);
    default:
      return backward_rows<double>(logits, rows, vocab, row_stride, labels, lse, g, ge, ent, it,
                                   out, out_row_stride);
  }
}

void candidate_forward_impl(const void* logits, int dtype, int64_t rows, int64_t vocab,
                            int64_t row_stride, const int64_t* candidates, int64_t k, double it,
                            void* out) {
  switch (dtype) {
    case kFloat32:
      return candidate_forward_rows<float>(logits, rows, vocab, row_stride, candidates, k, it, out);
    case kFloat16:
      return candidate_forward_rows<half_t>(logits, rows, vocab, row_stride, candidates, k, it, out);
    case kBFloat16:
      return candidate_forward_rows<bf16_t>(logits, rows, vocab, row_stride, candidates, k, it, out);
    default:
      return candidate_forward_rows<double>(logits, rows, vocab, row_stride, candidates, k, it, out);
  }
}

void candidate_backward_impl(const void* grad, const int64_t* candidates, int64_t rows, int64_t k,
                             int64_t vocab, double it, void* out, int dtype) {
  switch (dtype) {
    case kFloat32:
      return candidate_backward_rows<float>(grad, candidates, rows, k, vocab, it, out);
    case kFloat16:
      return candidate_backward_rows<half_t>(grad, candidates, rows, k, vocab, it, out);
    case kBFloat16:
      return candidate_backward_rows<bf16_t>(grad, candidates, rows, k, vocab, it, out);
    default:
      return candidate_backward_rows<double>(grad, candidates, rows, k, vocab, it, out);
  }
}

}  // namespace TPO_ISA_NS
}  // namespace cpu
}  // namespace tpo
