// Per-row arithmetic and element types shared by the CPU (host compiler) and CUDA (nvcc) kernels.
//
// Everything here is a plain inline function usable on both sides: TPO_HD expands to
// `__host__ __device__ __forceinline__` under nvcc and to `inline` for the host compiler, so the
// CPU build (and therefore CPU CI) runs the very arithmetic the CUDA kernels use: the bf16/fp16
// conversions, exp, the online softmax, the gradient element and the candidate gather/scatter.
//
// Math, for one row z[0..V) of raw logits, inverse temperature it and label y:
//   m     = max_v z_v                    (raw, so z - m is exact for nearby logits)
//   d_v   = (z_v - m) * it <= 0           tempered logit minus the tempered max
//   s     = sum_v exp(d_v),  log_sum = log(s)         (lse = m * it + log_sum, never formed)
//   log p_v = d_v - log_sum
//   log p_y = -log1p(r / e_y) when r < e_y, else d_y - log_sum,   e_y = exp(d_y), r = s - e_y
//             (r is summed without the label, so 1 - p_y = r / s keeps its relative accuracy
//             for confident tokens, where s - e_y would cancel)
//   H     = log_sum - t / s,  t = sum_v exp(d_v) d_v <= 0   (two non-negative terms)
//   grad_v = it * (g * (onehot_v - p_v) - ge * p_v * (log p_v + H)),
//            label entry: it * (-g * expm1(log p_y) - ge * p_y * (log p_y + H))
// Forming z - m before scaling and keeping (m, log_sum) apart, rather than one fp32 lse, keeps
// log-probs of logits with a large common offset as accurate as torch.log_softmax.
#pragma once

#include <stdint.h>

#include <math.h>
#include <string.h>

#include "tpo_abi.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define TPO_HD __host__ __device__ __forceinline__
#else
#define TPO_HD inline
#endif

namespace tpo {

// ---------------------------------------------------------------------------------------------
// Bit casts
// ---------------------------------------------------------------------------------------------

TPO_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

TPO_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// (cond ? a : b) on bit patterns through a mask: no branch for the compiler to create, so loops
// using it stay vectorizable even when a or b came from floating-point work.
TPO_HD uint32_t select_bits(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

TPO_HD float neg_inf_f() { return bits_float(0xff800000u); }
TPO_HD float pos_inf_f() { return bits_float(0x7f800000u); }
TPO_HD float quiet_nan_f() { return bits_float(0x7fc00000u); }

template <class A>
TPO_HD A neg_inf() {
  return A(neg_inf_f());  // -inf converts exactly to double
}

// ---------------------------------------------------------------------------------------------
// bf16 / fp16 <-> float (storage is the raw 16-bit pattern). Host versions are pure bit
// manipulation (no F16C / AVX512-BF16 needed, so portable builds stay portable); device versions
// use the hardware conversions, which round the same way (IEEE round-to-nearest-even).
// ---------------------------------------------------------------------------------------------

TPO_HD float bf16_to_float(uint16_t h) {
  // bf16 is the top half of a float32.
  return bits_float(static_cast<uint32_t>(h) << 16);
}

TPO_HD uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const uint32_t u = float_bits(f);
  // Round to nearest even on the 16 dropped bits: add 0x7fff plus the lowest kept bit.
  // A carry out of the mantissa correctly bumps the exponent (up to inf).
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;  // NaN: keep sign/payload, force quiet
  return static_cast<uint16_t>(select_bits((u & 0x7fffffffu) > 0x7f800000u, quiet_nan, rounded));
#endif
}

TPO_HD float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  // Move exponent+mantissa into float position, then multiply by 2^(127-15) to rebias the
  // exponent. The multiply also normalizes half subnormals exactly. Inf/NaN (exponent 31)
  // land at >= 2^16 after scaling and get the float inf/NaN exponent forced in.
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float f = bits_float(magnitude) * bits_float(0x77800000u);  // 0x77800000 = 2^112
  uint32_t u = float_bits(f);
  if (magnitude >= (0x7c00u << 13)) u |= 0x7f800000u;
  return bits_float(u | sign);
#endif
}

TPO_HD uint16_t float_to_half(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  // All cases are computed and the right one selected by masks (vectorizable, no branches).
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // |f| < 2^-14: half subnormal (or zero). Adding 0.5f puts the value's 2^-24 units into the
  // low mantissa bits of a float whose ulp is exactly 2^-24; the FPU does the RNE rounding.
  const uint32_t subnormal = float_bits(bits_float(a) + 0.5f) - 0x3f000000u;
  // Normal: rebias the exponent by -(127-15) and round the 13 dropped bits to nearest even.
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  uint32_t h = select_bits(a < 0x38800000u, subnormal, normal);
  h = select_bits(a >= 0x477ff000u, 0x7c00u, h);  // >= 65520 rounds to inf
  h = select_bits(a > 0x7f800000u, 0x7e00u | ((a >> 13) & 0x3ffu), h);  // NaN, kept quiet
  return static_cast<uint16_t>(sign | h);
#endif
}

// ---------------------------------------------------------------------------------------------
// Element types. bf16 and fp16 are stored as raw 16-bit patterns (neither the compilers' nor
// CUDA's half types), so one definition serves both compilers. Elem<T> loads an element into its
// accumulation type Acc (double for double, float otherwise: the "compute dtype" of tpo_abi.h)
// and stores an Acc back.
// ---------------------------------------------------------------------------------------------

struct bf16_t {
  uint16_t bits;
};
struct half_t {
  uint16_t bits;
};

template <class T>
struct Elem;
template <>
struct Elem<float> {
  using Acc = float;
  static TPO_HD float load(float x) { return x; }
  static TPO_HD float store(float a) { return a; }
};
template <>
struct Elem<double> {
  using Acc = double;
  static TPO_HD double load(double x) { return x; }
  static TPO_HD double store(double a) { return a; }
};
template <>
struct Elem<bf16_t> {
  using Acc = float;
  static TPO_HD float load(bf16_t x) { return bf16_to_float(x.bits); }
  static TPO_HD bf16_t store(float a) { return bf16_t{float_to_bf16(a)}; }
};
template <>
struct Elem<half_t> {
  using Acc = float;
  static TPO_HD float load(half_t x) { return half_to_float(x.bits); }
  static TPO_HD half_t store(float a) { return half_t{float_to_half(a)}; }
};

template <class T>
using acc_t = typename Elem<T>::Acc;

template <class T>
struct TypeTag {
  using type = T;
};

// Host-side dispatch on a DType code (already checked): returns f(TypeTag<T>()) for the element
// type T of `dtype`.
template <class F>
inline auto visit_dtype(int dtype, F&& f) -> decltype(f(TypeTag<float>())) {
  switch (dtype) {
    case kFloat16:
      return f(TypeTag<half_t>());
    case kBFloat16:
      return f(TypeTag<bf16_t>());
    case kFloat64:
      return f(TypeTag<double>());
    default:
      return f(TypeTag<float>());
  }
}

// ---------------------------------------------------------------------------------------------
// exp
// ---------------------------------------------------------------------------------------------

// exp(x) for float, branch-free so the host compiler can vectorize loops that call it.
// n = round(x / ln2), r = x - n ln2 (Cody-Waite split: ln2_hi has 9 significant bits, so n*ln2_hi
// is exact for |n| <= 128), exp(r) by its degree-7 Taylor polynomial (truncation error
// |r|^8/8! < 6e-9 relative for |r| <= ln2/2), then scaled by 2^n built from the exponent bits.
// Max error about 1.2 ulp (< 1.1e-7 relative) on [-86, 88.7] (tests/test_cpu_extension.py
// checks it).
// Results below exp(-86) (< 5e-38) flush to 0; NaN propagates; -inf -> 0; +inf -> inf.
// Out-of-range x is not clamped before the polynomial; the garbage it produces there is replaced
// by the masks at the end.
TPO_HD float exp_f32(float x) {
  const float lo = -86.0f;
  const float hi = 88.72283f;
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x * 1.44269504088896341f + round_magic;
  const float n = shifted - round_magic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440054690583e-4f;
  float poly = 1.0f / 5040.0f;
  poly = poly * r + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  // In range, the low bits of `shifted` hold n; 2^n is built as 2 * 2^(n-1), which keeps the
  // biased exponent n + 126 in [1, 254] for n in [-124, 128].
  const uint32_t n_bits = float_bits(shifted) - float_bits(round_magic);
  const float scale = bits_float((n_bits + 126u) << 23);
  const float y = (poly + poly) * scale;
  // Underflow -> 0, overflow -> inf, as bit masks rather than ?: so that the compiler cannot
  // turn them into branches (it would then refuse to vectorize). NaN compares false both ways
  // and flows through.
  const uint32_t y_bits = select_bits(x < lo, 0u, float_bits(y));
  return bits_float(select_bits(x > hi, 0x7f800000u, y_bits));
}

// exp / log in the accumulation type: float -> the accurate-library-grade versions of each side,
// double -> the libm / CUDA double versions.
TPO_HD float acc_exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return exp_f32(x);
#endif
}
TPO_HD double acc_exp(double x) { return exp(x); }
TPO_HD float acc_log(float x) { return logf(x); }
TPO_HD double acc_log(double x) { return log(x); }
TPO_HD float acc_log1p(float x) { return log1pf(x); }
TPO_HD double acc_log1p(double x) { return log1p(x); }
TPO_HD float acc_expm1(float x) { return expm1f(x); }
TPO_HD double acc_expm1(double x) { return expm1(x); }

// ---------------------------------------------------------------------------------------------
// Online softmax state
// ---------------------------------------------------------------------------------------------

// Summary of a set of raw logits z at inverse temperature it: m = max z, s = sum exp((z - m) it),
// t = sum exp((z - m) it) (z - m) it. The empty set is m = -inf, s = t = 0. Elements equal to
// -inf contribute nothing; NaN is handled by the callers.
template <class A>
struct SoftmaxState {
  A m;
  A s;
  A t;
};

template <class A>
TPO_HD SoftmaxState<A> softmax_empty() {
  SoftmaxState<A> st;
  st.m = neg_inf<A>();
  st.s = A(0);
  st.t = A(0);
  return st;
}

// Re-express a state relative to a new max m_new >= st.m, with delta = (m - m_new) it <= 0:
// sum e^(d - delta') = c s,   sum e^(...)(...) = c (t + delta s),   c = e^delta.
template <class A>
TPO_HD void softmax_rescale(SoftmaxState<A>& st, A m_new, A it) {
  if (st.m == m_new) return;
  if (st.s == A(0)) {  // empty (m = -inf): nothing to rescale, and -inf - m_new would poison t
    st.m = m_new;
    return;
  }
  const A delta = (st.m - m_new) * it;
  const A c = acc_exp(delta);
  st.t = c * (st.t + delta * st.s);
  st.s = c * st.s;
  st.m = m_new;
}

// Combine two states (order-independent up to rounding). A state without mass (s == 0) adds
// nothing; its max does not matter (softmax_finish restores the label's).
template <class A>
TPO_HD SoftmaxState<A> softmax_merge(SoftmaxState<A> a, SoftmaxState<A> b, A it) {
  if (b.s == A(0)) return a;
  if (a.s == A(0)) return b;
  const A m = a.m > b.m ? a.m : b.m;
  softmax_rescale(a, m, it);
  softmax_rescale(b, m, it);
  a.s += b.s;
  a.t += b.t;
  return a;
}

// Add one raw logit z (z <= st.m is the fast path: one exp, no rescale).
template <class A>
TPO_HD void softmax_add(SoftmaxState<A>& st, A z, A it) {
  if (z > st.m) softmax_rescale(st, z, it);
  if (!(z > neg_inf<A>())) return;  // -inf contributes exp(-inf) = 0 (NaN handled by callers)
  const A d = (z - st.m) * it;
  const A e = acc_exp(d);
  st.s += e;
  st.t += e * d;
}

// What the row forward returns for one row (see the math at the top).
template <class A>
struct RowStats {
  A row_max;
  A log_sum;
  A logprob;
  A entropy;
};

// The row's statistics from the state of every element except the label's (`st` may or may not
// have seen the label's value in its max) and the label's raw logit. A row whose logits are all
// -inf has row_max = -inf and NaN log_sum / logprob / entropy (no distribution).
template <class A>
TPO_HD RowStats<A> softmax_finish(SoftmaxState<A> st, A z_label, A it) {
  if (z_label > st.m) softmax_rescale(st, z_label, it);
  const A d = (z_label - st.m) * it;
  const A e = acc_exp(d);  // 0 for a -inf label
  const A s = st.s + e;
  RowStats<A> r;
  r.row_max = st.m;
  r.log_sum = s > A(0) ? acc_log(s) : A(quiet_nan_f());
  // st.s is the rest of the mass, summed without the label: log(e / (e + rest)).
  r.logprob = st.s < e ? -acc_log1p(st.s / e) : d - r.log_sum;
  const A t = st.t + (e > A(0) ? e * d : A(0));  // 0, not 0 * -inf, for a -inf label
  r.entropy = r.log_sum - t / s;
  return r;
}

// ---------------------------------------------------------------------------------------------
// Backward element
// ---------------------------------------------------------------------------------------------

// log p_v = (z_v - m) it - log_sum for a raw logit z_v and the forward's row statistics.
template <class A>
TPO_HD A log_prob(A z, A row_max, A log_sum, A it) {
  return (z - row_max) * it - log_sum;
}

// d out / d z_v for a non-label element: it * (-g p - ge p (log p + H)), with log_p and
// p = exp(log_p) supplied by the caller (so it can use a vector exp). The p log p term is taken
// as 0 where p == 0 (its limit), so -inf logits give 0 rather than 0 * -inf = NaN.
template <class A>
TPO_HD A grad_element(A log_p, A p, A g, A ge, A entropy, A inv_t) {
  // Where p == 0 use -H for log p so the factor is exactly 0; selecting an operand rather than
  // a result keeps the arithmetic unconditional and the loop branch-free (vectorizable).
  const A safe_log_p = p > A(0) ? log_p : -entropy;
  return (-g * p - ge * p * (safe_log_p + entropy)) * inv_t;
}

// The same without the entropy term (ge == 0), the common TPO case.
template <class A>
TPO_HD A grad_element_nolabel(A p, A g, A inv_t) {
  return (-g * p) * inv_t;
}

// The label's entry from the forward's log-prob lp: g (1 - p) = -g expm1(lp), which keeps its
// relative accuracy for confident tokens (1 - exp(lp) rounds to 0 in fp32 below 1 - p ~ 6e-8
// and loses digits well before).
template <class A>
TPO_HD A grad_label(A lp, A g, A ge, A entropy, A inv_t) {
  const A p = acc_exp(lp);
  const A safe_lp = p > A(0) ? lp : -entropy;
  return (-g * acc_expm1(lp) - ge * p * (safe_lp + entropy)) * inv_t;
}

// ---------------------------------------------------------------------------------------------
// Candidate gather / scatter (token-level TPO)
// ---------------------------------------------------------------------------------------------

// logits[c] * it for one candidate id of a row; an id outside [0, vocab) is not dereferenced
// and gives NaN.
template <class T>
TPO_HD acc_t<T> gather_candidate(const T* row, int64_t c, int64_t vocab, acc_t<T> it) {
  return (c >= 0 && c < vocab) ? Elem<T>::load(row[c]) * it : acc_t<T>(quiet_nan_f());
}

// Scatter of one row's K candidate gradients into `row` (already zero): each distinct id c gets
// the sum of grad[k] * it over the k with cand[k] == c, in ascending k starting from 0, as a
// column-by-column scatter_add would; it is written once, so the result is deterministic with
// no atomics. Ids outside [0, vocab) are ignored.
template <class T>
TPO_HD void scatter_candidates(const acc_t<T>* grad, const int64_t* cand, int64_t k,
                               int64_t vocab, acc_t<T> it, T* row) {
  using A = acc_t<T>;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t c = cand[j];
    if (c < 0 || c >= vocab) continue;
    bool seen = false;  // already written with an earlier occurrence
    for (int64_t i = 0; i < j; ++i) seen = seen || cand[i] == c;
    if (seen) continue;
    A acc = A(0);
    for (int64_t i = j; i < k; ++i) {
      if (cand[i] == c) acc += grad[i] * it;
    }
    row[c] = Elem<T>::store(acc);
  }
}

}  // namespace tpo
