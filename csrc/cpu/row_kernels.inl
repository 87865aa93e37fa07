// CPU row kernels, written once and compiled once per instruction set (row_ops_*.cpp include this
// file inside their own namespace TPO_ISA_NS after selecting a target with `#pragma GCC target`).
// The inner loops are branch-free over contiguous arrays with `#pragma omp simd`, so the compiler
// vectorizes them, including the inlined exp_f32 from row_math.h.
//
// Requires, before inclusion: <stdint.h>, <string.h>, <math.h>, <algorithm>, "row_math.h",
// "row_ops.h", and TPO_ISA_NS defined. Element types and conversions are row_math.h's Elem<T>.

namespace tpo {
namespace cpu {
namespace TPO_ISA_NS {

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

// max_i z_i of the raw logits (NaNs ignored here, flagged in nan_seen).
template <class T, class A>
A chunk_max(const T* x, int64_t n, int& nan_seen) {
  A m = neg_inf<A>();
#pragma omp simd reduction(max : m) reduction(| : nan_seen)
  for (int64_t i = 0; i < n; ++i) {
    const A z = Elem<T>::load(x[i]);
    m = z > m ? z : m;
    nan_seen |= (z != z);
  }
  return m;
}

// With d = (z - ref) * it: s += sum exp(d), t += sum exp(d) d (when with_t).
template <class T, class A>
void chunk_sums(const T* x, int64_t n, A it, A ref, bool with_t, A& s_acc, A& t_acc) {
  const A ninf = neg_inf<A>();
  A s = 0, t = 0;
  if (with_t) {
#pragma omp simd reduction(+ : s, t)
    for (int64_t i = 0; i < n; ++i) {
      const A d = (Elem<T>::load(x[i]) - ref) * it;
      const A e = acc_exp(d);
      s += e;
      t += e * (d > ninf ? d : A(0));  // e = 0 where d = -inf: 0, not 0 * -inf
    }
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += acc_exp((Elem<T>::load(x[i]) - ref) * it);
  }
  s_acc += s;
  t_acc += t;
}

// The sums of [begin, end) of one chunk, leaving out the label's column (summed separately by
// softmax_finish, so that 1 - p_label never comes from a cancelling difference).
template <class T, class A>
void chunk_sums_without(const T* x, int64_t begin, int64_t end, int64_t skip, A it, A ref,
                        bool with_t, A& s_acc, A& t_acc) {
  if (skip >= begin && skip < end) {
    chunk_sums(x + begin, skip - begin, it, ref, with_t, s_acc, t_acc);
    chunk_sums(x + skip + 1, end - skip - 1, it, ref, with_t, s_acc, t_acc);
  } else {
    chunk_sums(x + begin, end - begin, it, ref, with_t, s_acc, t_acc);
  }
}

template <class T>
RowStats<acc_t<T>> forward_row(const T* row, int64_t vocab, acc_t<T> it, int64_t label,
                               bool with_t) {
  using A = acc_t<T>;
  const A ninf = neg_inf<A>();
  SoftmaxState<A> state = softmax_empty<A>();
  int nan_seen = 0;
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const T* x = row + c0;
    SoftmaxState<A> chunk;
    chunk.m = chunk_max<T, A>(x, n, nan_seen);
    if (!(chunk.m > ninf)) continue;  // all -inf (or NaN, flagged above): contributes nothing
    chunk.s = A(0);
    chunk.t = A(0);
    const T* next = x + n;
    const int64_t next_n = std::min(kChunk, vocab - c0 - n);
    const int64_t step = next_n > 0 ? std::max<int64_t>(1, next_n * kSubChunk / n) : 0;
    for (int64_t i0 = 0, p0 = 0; i0 < n; i0 += kSubChunk, p0 += step) {
      if (p0 < next_n) prefetch_range(next + p0, next + std::min(next_n, p0 + step));
      chunk_sums_without(x, i0, std::min(n, i0 + kSubChunk), label - c0, it, chunk.m, with_t,
                         chunk.s, chunk.t);
    }
    state = softmax_merge(state, chunk, it);
  }
  RowStats<A> r = softmax_finish(state, Elem<T>::load(row[label]), it);
  if (nan_seen) {
    const A nan = A(quiet_nan_f());
    r.row_max = r.log_sum = r.logprob = r.entropy = nan;
  }
  return r;
}

template <class T>
void forward_rows(const RowForwardArgs& a) {
  using A = acc_t<T>;
  const T* base = static_cast<const T*>(a.logits);
  const int64_t* labels = a.labels;
  A* row_max = static_cast<A*>(a.row_max);
  A* log_sum = static_cast<A*>(a.log_sum);
  A* logprob = static_cast<A*>(a.logprob);
  A* entropy = static_cast<A*>(a.entropy);
  const A it = static_cast<A>(a.inv_temperature);
  const int64_t rows = a.rows;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t label = labels[r];
    if (label < 0) {  // skipped row: outputs 0, logits never read
      row_max[r] = log_sum[r] = logprob[r] = A(0);
      if (entropy != nullptr) entropy[r] = A(0);
      continue;
    }
    const RowStats<A> st = forward_row<T>(base + r * a.row_stride, a.vocab, it, label,
                                          entropy != nullptr);
    row_max[r] = st.row_max;
    log_sum[r] = st.log_sum;
    logprob[r] = st.logprob;
    if (entropy != nullptr) entropy[r] = st.entropy;
  }
}

template <class T>
void backward_row(const T* x, T* out, int64_t vocab, acc_t<T> it, int64_t label, acc_t<T> m,
                  acc_t<T> log_sum, acc_t<T> lp, acc_t<T> g, acc_t<T> ge, acc_t<T> ent) {
  using A = acc_t<T>;
  if (g == A(0) && ge == A(0)) {  // zero-signal row: write zeros, never read the logits
    memset(static_cast<void*>(out), 0, static_cast<size_t>(vocab) * sizeof(T));
    return;
  }
  if (ge == A(0)) {
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) {
      const A p = acc_exp(log_prob(Elem<T>::load(x[v]), m, log_sum, it));
      out[v] = Elem<T>::store(grad_element_nolabel(p, g, it));
    }
  } else {
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) {
      const A log_p = log_prob(Elem<T>::load(x[v]), m, log_sum, it);
      const A p = acc_exp(log_p);
      out[v] = Elem<T>::store(grad_element(log_p, p, g, ge, ent, it));
    }
  }
  // The label's entry from the forward's log-prob (never from the overwritten logits).
  if (label >= 0) out[label] = Elem<T>::store(grad_label(lp, g, ge, ent, it));
}

template <class T>
void backward_rows(const RowBackwardArgs& a) {
  using A = acc_t<T>;
  const T* base = static_cast<const T*>(a.logits);
  T* out = static_cast<T*>(a.out);
  const A* row_max = static_cast<const A*>(a.row_max);
  const A* log_sum = static_cast<const A*>(a.log_sum);
  const A* logprob = static_cast<const A*>(a.logprob);
  const A* g = static_cast<const A*>(a.grad_logprob);
  const A* ge = static_cast<const A*>(a.grad_entropy);
  const A* ent = static_cast<const A*>(a.entropy);
  const A it = static_cast<A>(a.inv_temperature);
  const int64_t rows = a.rows;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t r = 0; r < rows; ++r) {
    const A ge_r = ge != nullptr ? ge[r] : A(0);
    const A ent_r = (ge_r != A(0) && ent != nullptr) ? ent[r] : A(0);
    const int64_t label = a.labels[r];
    backward_row<T>(base + r * a.row_stride, out + r * a.out_row_stride, a.vocab, it, label,
                    row_max[r], log_sum[r], label >= 0 ? logprob[r] : A(0), g[r], ge_r, ent_r);
  }
}

// Entry points with runtime dtype dispatch, one set per ISA (declared in row_ops.cpp).
void row_forward_impl(const RowForwardArgs& args) {
  visit_dtype(args.dtype, [&](auto tag) { forward_rows<typename decltype(tag)::type>(args); });
}

void row_backward_impl(const RowBackwardArgs& args) {
  visit_dtype(args.dtype, [&](auto tag) { backward_rows<typename decltype(tag)::type>(args); });
}

}  // namespace TPO_ISA_NS
}  // namespace cpu
}  // namespace tpo
