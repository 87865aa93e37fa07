// Per-row arithmetic and element types shared by the CPU (host compiler) and CUDA (nvcc) kernels.
//
// Everything here is a plain inline function usable on both sides: TPO_HD expands to
// `__host__ __device__ __forceinline__` under nvcc and to `inline` for the host compiler, so the
// CPU build (and therefore CPU CI) runs the very arithmetic the CUDA kernels use: the bf16/fp16
// conversions, exp2, the online softmax, and the gradient element.
//
// Math, for one row z[0..V) of raw logits, inverse temperature it and label y:
//   m     = max_v z_v                    (raw, so z - m is exact for nearby logits)
//   d_v   = (z_v - m) * it <= 0           tempered logit minus the tempered max
//   s     = sum_v exp(d_v),  log_sum = log(s)         (lse = m * it + log_sum, never formed)
//           (the vocabulary loops form exp(d_v) as exp2((z_v - m) it2), it2 = it log2(e))
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

// Row r = b * T + t of a row op's batched view (tpo_abi.h), split once per row (the backward
// places its input and output rows from the one split: a 64-bit division is a called routine on
// a GPU).
struct BatchedRow {
  int64_t batch;  // b
  int64_t t;      // the row within its batch entry
};
TPO_HD BatchedRow batched_row(int64_t r, int64_t rows_per_batch) {
  const int64_t b = r / rows_per_batch;
  return BatchedRow{b, r - b * rows_per_batch};
}
// Offset (elements) of the row: b * batch_stride + t * row_stride. For a plain matrix
// (T = rows, batch_stride = 0) it is r * row_stride.
TPO_HD int64_t row_offset(BatchedRow at, int64_t batch_stride, int64_t row_stride) {
  return at.batch * batch_stride + at.t * row_stride;
}

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
// exp2 / exp / log
// ---------------------------------------------------------------------------------------------

// The vocabulary-sized loops work in base 2: with it2 = it * log2(e) (the "base-2 inverse
// temperature", rounded once on the host from the float64 temperature), exp((z - m) it) =
// exp2((z - m) it2), so each element costs one subtract, one multiply and one exp2, and on the
// device that exp2 is a single MUFU.EX2 instruction.
constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

template <class A>
TPO_HD A lowest();  // the most negative finite value
template <>
TPO_HD float lowest<float>() {
  return bits_float(0xff7fffffu);
}
template <>
TPO_HD double lowest<double>() {
  return -1.7976931348623157e308;
}

// x, or lowest() where x is -inf or NaN: max(x, lowest) without a branch. Multiplying a
// possibly -inf exponent by its exp2 (which is 0 there) then gives 0, not 0 * -inf = NaN.
TPO_HD float floor_finite(float x) {
#if defined(__CUDA_ARCH__)
  return fmaxf(x, lowest<float>());  // one FMNMX; fmaxf(NaN, y) = y
#else
  return x > lowest<float>() ? x : lowest<float>();  // vectorizes to a max
#endif
}
TPO_HD double floor_finite(double x) { return x > lowest<double>() ? x : lowest<double>(); }

// 2^x for float on the host, branch-free so that the host compiler can vectorize loops that call
// it. n = round(x) (the 1.5 * 2^23 trick), r = x - n in [-1/2, 1/2] (exact), 2^r = exp(r ln2)
// by its degree-7 Taylor polynomial in r (coefficients ln2^k / k!; truncation < 6e-9 relative),
// scaled by 2^n built from the exponent bits as 2 * 2^(n-1), valid for n in [-125, 128].
// Max error about 1 ulp (< 1.5e-7 relative) on [-125, 128] (tests/test_cpu_extension.py checks
// it). Below -125 the result flushes to 0 (results < 2^-125, far below anything the row sums
// resolve); NaN propagates; -inf -> 0; +inf and x >= 128 -> inf. Out-of-range x is not clamped
// before the polynomial; the masks at the end replace what it produces there.
TPO_HD float exp2_f32(float x) {
  const float lo = -125.0f;
  const float hi = 128.0f;
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x + round_magic;
  const float n = shifted - round_magic;
  const float r = x - n;
  float poly = 1.5252733804059840e-5f;  // ln2^7 / 7!
  poly = poly * r + 1.5403530393381609e-4f;  // ln2^6 / 6!
  poly = poly * r + 1.3333558146428443e-3f;  // ln2^5 / 5!
  poly = poly * r + 9.6181291076284772e-3f;  // ln2^4 / 4!
  poly = poly * r + 5.5504108664821580e-2f;  // ln2^3 / 3!
  poly = poly * r + 2.4022650695910071e-1f;  // ln2^2 / 2!
  poly = poly * r + 6.9314718055994531e-1f;  // ln2
  poly = poly * r + 1.0f;
  const uint32_t n_bits = float_bits(shifted) - float_bits(round_magic);
  const float scale = bits_float((n_bits + 126u) << 23);
  const float y = (poly + poly) * scale;
  // Underflow -> 0, overflow -> inf, as bit masks rather than ?: so that the compiler cannot
  // turn them into branches (it would then refuse to vectorize). NaN compares false both ways
  // and flows through.
  const uint32_t y_bits = select_bits(x < lo, 0u, float_bits(y));
  return bits_float(select_bits(x >= hi, 0x7f800000u, y_bits));
}

// 2^x in the accumulation type. float on the device: ex2.approx.ftz.f32, one MUFU.EX2, max
// relative error 2^-22 (PTX ISA), results below 2^-126 flushed to 0; on the host exp2_f32
// (about 1 ulp). double: the accurate exp2 of libm / CUDA.
TPO_HD float acc_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2_f32(x);
#endif
}
TPO_HD double acc_exp2(double x) { return exp2(x); }

// Natural exp / log in the accumulation type, for the per-row (not per-element) steps: the
// accurate library versions of each side.
TPO_HD float acc_exp(float x) { return expf(x); }
TPO_HD double acc_exp(double x) { return exp(x); }
TPO_HD float acc_log(float x) { return logf(x); }
TPO_HD double acc_log(double x) { return log(x); }
TPO_HD float acc_log1p(float x) { return log1pf(x); }
TPO_HD double acc_log1p(double x) { return log1p(x); }
TPO_HD float acc_expm1(float x) { return expm1f(x); }
TPO_HD double acc_expm1(double x) { return expm1(x); }

// it2 = it * log2(e) in the accumulation type, rounded once from the float64 inverse temperature
// (host side; every kernel of a call gets the same value).
template <class A>
inline A base2_scale(double inv_temperature) {
  return static_cast<A>(inv_temperature * kLog2e);
}

// ---------------------------------------------------------------------------------------------
// Online softmax state
// ---------------------------------------------------------------------------------------------

// Summary of a set of raw logits z at base-2 inverse temperature it2: m = max(lowest, max z)
// (a finite reference, so that z - m is -inf, never NaN, for z = -inf), d2 = (z - m) it2,
// s = sum 2^d2 = sum exp((z - m) it), t = sum 2^d2 d2 (base-2 units: the natural sum is ln2 t).
// The empty set is m = lowest, s = t = 0. Elements equal to -inf contribute nothing. NaN is not
// flagged: max ignores it, but 2^(NaN - m) = NaN makes s (and t) NaN, and every rescale, merge
// and finish below keeps a NaN s NaN, so the row's log_sum, logprob and entropy come out NaN.
// A +inf element does the same through inf - inf.
template <class A>
struct SoftmaxState {
  A m;
  A s;
  A t;
};

template <class A>
TPO_HD SoftmaxState<A> softmax_empty() {
  SoftmaxState<A> st;
  st.m = lowest<A>();
  st.s = A(0);
  st.t = A(0);
  return st;
}

// Re-express a state relative to a new max m_new >= st.m, with delta = (m - m_new) it2 <= 0:
// sum 2^(d2 + delta) = c s,   sum 2^(...)(...) = c (t + delta s),   c = 2^delta.
template <class A>
TPO_HD void softmax_rescale(SoftmaxState<A>& st, A m_new, A it2) {
  if (st.m == m_new) return;
  if (st.s == A(0)) {  // no mass yet: nothing to rescale (and delta may be -inf)
    st.m = m_new;
    return;
  }
  const A delta = (st.m - m_new) * it2;
  const A c = acc_exp2(delta);
  st.t = c * (st.t + delta * st.s);
  st.s = c * st.s;
  st.m = m_new;
}

// Combine two states (order-independent up to rounding). A state without mass (s == 0) adds
// nothing; its max does not matter (softmax_finish restores the label's).
template <class A>
TPO_HD SoftmaxState<A> softmax_merge(SoftmaxState<A> a, SoftmaxState<A> b, A it2) {
  if (b.s == A(0)) return a;
  if (a.s == A(0)) return b;
  const A m = a.m > b.m ? a.m : b.m;
  softmax_rescale(a, m, it2);
  softmax_rescale(b, m, it2);
  a.s += b.s;
  a.t += b.t;
  return a;
}

// Add one raw logit z (z <= st.m is the fast path: one exp2, no rescale).
template <class A>
TPO_HD void softmax_add(SoftmaxState<A>& st, A z, A it2) {
  if (z > st.m) softmax_rescale(st, z, it2);
  const A d2 = (z - st.m) * it2;
  const A e = acc_exp2(d2);
  st.s += e;
  st.t += e * floor_finite(d2);
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
// have seen the label's value in its max) and the label's raw logit, at inverse temperature it
// (the label's terms use the natural base: they are computed once per row). A row whose logits
// are all -inf has row_max = -inf and NaN log_sum / logprob / entropy (no distribution); a row
// with a NaN or +inf logit has all four NaN.
template <class A>
TPO_HD RowStats<A> softmax_finish(SoftmaxState<A> st, A z_label, A it, A it2) {
  if (z_label > st.m) softmax_rescale(st, z_label, it2);
  const A d = (z_label - st.m) * it;
  const A e = acc_exp(d);  // 0 for a -inf label
  const A s = st.s + e;
  RowStats<A> r;
  r.row_max = s > A(0) ? st.m : (s == A(0) ? neg_inf<A>() : A(quiet_nan_f()));
  r.log_sum = s > A(0) ? acc_log(s) : A(quiet_nan_f());
  // st.s is the rest of the mass, summed without the label: log(e / (e + rest)).
  r.logprob = st.s < e ? -acc_log1p(st.s / e) : d - r.log_sum;
  const A t = A(kLn2) * st.t + e * floor_finite(d);  // natural units
  r.entropy = r.log_sum - t / s;
  return r;
}

// ---------------------------------------------------------------------------------------------
// Backward element
// ---------------------------------------------------------------------------------------------

// The per-row constants of the backward, so that an element costs a subtract, an FMA, an exp2
// and one or two multiplies:
//   log2 p_v = (z_v - m) it2 - ls2,   ls2 = log_sum log2(e)
//   grad_v   = it (-g p - ge p (log p + H)) = p (a + b log2 p),
//              a = -it (g + ge H),  b = -it ge ln2          (b = 0 without the entropy term)
template <class A>
struct GradRow {
  A m;
  A ls2;
  A it2;
  A a;
  A b;
};

// The constants from the forward's row statistics (computed in double on the host or once per
// row on the device: ls2 keeps the digits of log_sum).
template <class A>
TPO_HD GradRow<A> grad_row(A row_max, A log_sum, A g, A ge, A entropy, A it, A it2) {
  GradRow<A> c;
  c.m = row_max;
  c.ls2 = A(static_cast<double>(log_sum) * kLog2e);
  c.it2 = it2;
  c.a = -it * (g + ge * entropy);
  c.b = -it * ge * A(kLn2);
  return c;
}

template <class A>
TPO_HD A log2_prob(A z, const GradRow<A>& c) {
  return (z - c.m) * c.it2 - c.ls2;
}

// d out / d z_v for a non-label element from log2 p and p = 2^(log2 p) (supplied by the caller,
// so that it can use a vector exp2). The p log p term is 0 where p == 0 (its limit): log2 p is
// floored at -256, below every log2 p whose p is not 0 in float, so -inf logits give 0 * finite
// rather than 0 * inf = NaN (a NaN logit still gives NaN through p).
template <class A>
TPO_HD A grad_element(A log2_p, A p, const GradRow<A>& c) {
  const A floored = log2_p > A(-256) ? log2_p : A(-256);
  return p * (c.a + c.b * floored);
}

// The same without the entropy term (b == 0), the common TPO case.
template <class A>
TPO_HD A grad_element_nolabel(A p, const GradRow<A>& c) {
  return p * c.a;
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

}  // namespace tpo
