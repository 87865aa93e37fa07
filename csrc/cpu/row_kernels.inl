// CPU row kernels, written once and compiled once per instruction set (row_ops_*.cpp include this
// file inside their own namespace TPO_ISA_NS after selecting a target with `#pragma GCC target`).
// The inner loops are branch-free over contiguous arrays with `#pragma omp simd`, so the compiler
// vectorizes them, including the inlined exp2_f32 from row_math.h.
//
// Requires, before inclusion: <stdint.h>, <string.h>, <math.h>, <algorithm>, <limits>, "row_math.h",
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

// max(lowest, max_i z_i) of the raw logits: a finite reference for chunk_sums. NaNs are skipped
// here (NaN > m is false); they reach the sums, which they turn into NaN.
template <class T, class A>
A chunk_max(const T* x, int64_t n) {
  A m = lowest<A>();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    const A z = Elem<T>::load(x[i]);
    m = z > m ? z : m;
  }
  return m;
}

// With d2 = (z - ref) * it2: s += sum 2^d2, t += sum 2^d2 d2 (when with_t).
template <class T, class A>
void chunk_sums(const T* x, int64_t n, A it2, A ref, bool with_t, A& s_acc, A& t_acc) {
  A s = 0, t = 0;
  if (with_t) {
#pragma omp simd reduction(+ : s, t)
    for (int64_t i = 0; i < n; ++i) {
      const A d2 = (Elem<T>::load(x[i]) - ref) * it2;
      const A e = acc_exp2(d2);
      s += e;
      t += e * floor_finite(d2);  // 0, not 0 * -inf, at -inf logits
    }
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += acc_exp2((Elem<T>::load(x[i]) - ref) * it2);
  }
  s_acc += s;
  t_acc += t;
}

// The sums of [begin, end) of one chunk, leaving out the label's column (summed separately by
// softmax_finish, so that 1 - p_label never comes from a cancelling difference).
template <class T, class A>
void chunk_sums_without(const T* x, int64_t begin, int64_t end, int64_t skip, A it2, A ref,
                        bool with_t, A& s_acc, A& t_acc) {
  if (skip >= begin && skip < end) {
    chunk_sums(x + begin, skip - begin, it2, ref, with_t, s_acc, t_acc);
    chunk_sums(x + skip + 1, end - skip - 1, it2, ref, with_t, s_acc, t_acc);
  } else {
    chunk_sums(x + begin, end - begin, it2, ref, with_t, s_acc, t_acc);
  }
}

template <class T>
RowStats<acc_t<T>> forward_row(const T* row, int64_t vocab, acc_t<T> it, acc_t<T> it2,
                               int64_t label, bool with_t) {
  using A = acc_t<T>;
  SoftmaxState<A> state = softmax_empty<A>();
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const T* x = row + c0;
    SoftmaxState<A> chunk;
    chunk.m = chunk_max<T, A>(x, n);
    chunk.s = A(0);
    chunk.t = A(0);
    const T* next = x + n;
    const int64_t next_n = std::min(kChunk, vocab - c0 - n);
    const int64_t step = next_n > 0 ? std::max<int64_t>(1, next_n * kSubChunk / n) : 0;
    for (int64_t i0 = 0, p0 = 0; i0 < n; i0 += kSubChunk, p0 += step) {
      if (p0 < next_n) prefetch_range(next + p0, next + std::min(next_n, p0 + step));
      chunk_sums_without(x, i0, std::min(n, i0 + kSubChunk), label - c0, it2, chunk.m, with_t,
                         chunk.s, chunk.t);
    }
    state = softmax_merge(state, chunk, it2);
  }
  return softmax_finish(state, Elem<T>::load(row[label]), it, it2);
}

// Rows [begin, end) of a call (row_ops.cpp hands the ranges to threads: parallel.h).
template <class T>
void forward_rows(const RowForwardArgs& a, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const T* base = static_cast<const T*>(a.logits);
  const int64_t* labels = a.labels;
  A* row_max = static_cast<A*>(a.row_max);
  A* log_sum = static_cast<A*>(a.log_sum);
  A* logprob = static_cast<A*>(a.logprob);
  A* entropy = static_cast<A*>(a.entropy);
  const A it = static_cast<A>(a.inv_temperature);
  const A it2 = base2_scale<A>(a.inv_temperature);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t label = labels[r];
    if (label < 0) {  // skipped row: outputs 0, logits never read
      row_max[r] = log_sum[r] = logprob[r] = A(0);
      if (entropy != nullptr) entropy[r] = A(0);
      continue;
    }
    if (label >= a.vocab) {  // outside the vocabulary (DESIGN.md, "Ids outside the vocabulary"):
      // NaN outputs, the row never read (the binding does not check ids; this is the guard).
      const A nan = static_cast<A>(quiet_nan_f());
      row_max[r] = log_sum[r] = logprob[r] = nan;
      if (entropy != nullptr) entropy[r] = nan;
      continue;
    }
    const T* row = base + row_offset(batched_row(r, a.rows_per_batch), a.batch_stride, a.row_stride);
    const RowStats<A> st = forward_row<T>(row, a.vocab, it, it2, label, entropy != nullptr);
    row_max[r] = st.row_max;
    log_sum[r] = st.log_sum;
    logprob[r] = st.logprob;
    if (entropy != nullptr) entropy[r] = st.entropy;
  }
}

template <class T>
void backward_row(const T* x, T* out, int64_t vocab, int64_t label, const GradRow<acc_t<T>>& c,
                  bool with_entropy, acc_t<T> label_grad) {
  using A = acc_t<T>;
  if (with_entropy) {
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) {
      const A log2_p = log2_prob(Elem<T>::load(x[v]), c);
      out[v] = Elem<T>::store(grad_element(log2_p, acc_exp2(log2_p), c));
    }
  } else {
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) {
      const A p = acc_exp2(log2_prob(Elem<T>::load(x[v]), c));
      out[v] = Elem<T>::store(grad_element_nolabel(p, c));
    }
  }
  // The label's entry from the forward's log-prob (never from the overwritten logits).
  if (label >= 0) out[label] = Elem<T>::store(label_grad);
}

template <class T>
void backward_rows(const RowBackwardArgs& a, int64_t begin, int64_t end) {
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
  const A it2 = base2_scale<A>(a.inv_temperature);
  for (int64_t r = begin; r < end; ++r) {
    const BatchedRow at = batched_row(r, a.rows_per_batch);
    T* o = out + row_offset(at, a.out_batch_stride, a.out_row_stride);
    const A g_r = g[r];
    const A ge_r = ge != nullptr ? ge[r] : A(0);
    if (g_r == A(0) && ge_r == A(0)) {  // zero-signal row: write zeros, never read the logits
      memset(static_cast<void*>(o), 0, static_cast<size_t>(a.vocab) * sizeof(T));
      continue;
    }
    const A ent_r = (ge_r != A(0) && ent != nullptr) ? ent[r] : A(0);
    // -1: no one-hot term, for a negative label and for one outside [0, vocab) (never
    // dereferenced: the binding does not check ids, this is the guard).
    const int64_t label = (a.labels[r] >= 0 && a.labels[r] < a.vocab) ? a.labels[r] : -1;
    const A label_grad = label >= 0 ? grad_label(logprob[r], g_r, ge_r, ent_r, it) : A(0);
    const T* x = base + row_offset(at, a.batch_stride, a.row_stride);
    backward_row<T>(x, o, a.vocab, label,
                    grad_row(row_max[r], log_sum[r], g_r, ge_r, ent_r, it, it2), ge_r != A(0),
                    label_grad);
  }
}

// hidden . weight row in the compute dtype, in an order fixed by n alone: 16 lane sums (lane j
// takes the elements i = j mod 16, the vector loop and the tail alike), then a fixed pairwise
// tree. No `omp simd reduction`, whose order could follow the pointers' alignment.
template <class T>
acc_t<T> dot_row(const T* x, const T* w, int64_t n) {
  using A = acc_t<T>;
  constexpr int kLanes = 16;
  A lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] += Elem<T>::load(x[i + j]) * Elem<T>::load(w[i + j]);
  }
  for (int j = 0; i + j < n; ++j) lane[j] += Elem<T>::load(x[i + j]) * Elem<T>::load(w[i + j]);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  }
  return lane[0];
}

template <class T>
void kept_dot_rows(const KeptDotArgs& a, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const T* hidden = static_cast<const T*>(a.hidden);
  const T* weight = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  A* out = static_cast<A*>(a.out);
  for (int64_t r = begin; r < end; ++r) {
    const T* h = hidden + r * a.hidden_row_stride;
    for (int64_t p = a.offsets[r]; p < a.offsets[r + 1]; ++p) {
      const int64_t id = a.ids[p];
      if (id < 0) {  // a hole: no entry
        out[p] = -std::numeric_limits<A>::infinity();
      } else if (id >= a.vocab) {  // outside the vocabulary: NaN, never read
        out[p] = static_cast<A>(quiet_nan_f());
      } else {
        A dot = dot_row<T>(h, weight + id * a.weight_row_stride, a.hidden_size);
        if (bias != nullptr) dot += Elem<T>::load(bias[id]);
        out[p] = dot;
      }
    }
  }
}

// Entry points with runtime dtype dispatch, one set per ISA (declared in row_ops.cpp).
void row_forward_impl(const RowForwardArgs& args, int64_t begin, int64_t end) {
  visit_dtype(args.dtype, [&](auto tag) { forward_rows<typename decltype(tag)::type>(args, begin, end); });
}

void row_backward_impl(const RowBackwardArgs& args, int64_t begin, int64_t end) {
  visit_dtype(args.dtype, [&](auto tag) { backward_rows<typename decltype(tag)::type>(args, begin, end); });
}

void kept_dot_impl(const KeptDotArgs& args, int64_t begin, int64_t end) {
  visit_dtype(args.dtype, [&](auto tag) { kept_dot_rows<typename decltype(tag)::type>(args, begin, end); });
}

}  // namespace TPO_ISA_NS
}  // namespace cpu
}  // namespace tpo
