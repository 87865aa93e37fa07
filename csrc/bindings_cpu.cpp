// pybind11 module tpo_kernels._C_cpu: the CPU row ops over raw data pointers (Python ints from
// tensor.data_ptr()), so the extension needs no torch headers and no torch C++ ABI.
//
// Everything that could make the kernels touch memory they should not (null pointers, negative
// or inconsistent sizes, label / candidate ids >= vocab) is re-checked here before any write.
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "cpu/row_ops.h"
#include "row_math.h"

namespace py = pybind11;

namespace {

using tpo::cpu::kFloat64;

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

void check_common(int dtype, int64_t rows, int64_t vocab, int64_t row_stride, double inv_t) {
  check(dtype >= tpo::cpu::kFloat32 && dtype <= kFloat64,
        "dtype code must be 0 (float32), 1 (float16), 2 (bfloat16) or 3 (float64), got " +
            std::to_string(dtype));
  check(rows >= 0, "rows must be >= 0, got " + std::to_string(rows));
  check(vocab >= 1, "vocab must be >= 1, got " + std::to_string(vocab));
  check(row_stride >= vocab, "row_stride (" + std::to_string(row_stride) + ") must be >= vocab (" +
                                 std::to_string(vocab) + ")");
  check(std::isfinite(inv_t) && inv_t > 0.0, "inv_temperature must be finite and > 0");
}

void check_ptr(uintptr_t ptr, const char* name) {
  check(ptr != 0, std::string(name) + " is a null pointer");
}

template <class P>
const P* as_ptr(uintptr_t p) {
  return reinterpret_cast<const P*>(p);
}

// Every id must be < vocab (negative ids mean "skip / no one-hot term" for labels).
void check_ids(const int64_t* ids, int64_t count, int64_t vocab, bool allow_negative,
               const char* name) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = ids[i];
    if (id >= vocab || (!allow_negative && id < 0)) {
      throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) + "] = " +
                                  std::to_string(id) + " is outside [0, " + std::to_string(vocab) +
                                  ")");
    }
  }
}

void row_forward(uintptr_t logits, int dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                 uintptr_t labels, double inv_t, uintptr_t lse, uintptr_t target,
                 uintptr_t entropy) {
  check_common(dtype, rows, vocab, row_stride, inv_t);
  if (rows == 0) return;
  check_ptr(logits, "logits");
  check_ptr(labels, "labels");
  check_ptr(lse, "lse");
  check_ptr(target, "target");
  check_ids(as_ptr<int64_t>(labels), rows, vocab, true, "labels");
  py::gil_scoped_release release;
  tpo::cpu::row_forward(as_ptr<void>(logits), dtype, rows, vocab, row_stride,
                        as_ptr<int64_t>(labels), inv_t, reinterpret_cast<void*>(lse),
                        reinterpret_cast<void*>(target), reinterpret_cast<void*>(entropy));
}

void row_backward(uintptr_t logits, int dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                  uintptr_t labels, uintptr_t lse, uintptr_t grad_logprob, uintptr_t grad_entropy,
                  uintptr_t entropy, double inv_t, uintptr_t out, int64_t out_row_stride) {
  check_common(dtype, rows, vocab, row_stride, inv_t);
  check(out_row_stride >= vocab, "out_row_stride must be >= vocab");
  if (rows == 0) return;
  check_ptr(logits, "logits");
  check_ptr(labels, "labels");
  check_ptr(lse, "lse");
  check_ptr(grad_logprob, "grad_logprob");
  check_ptr(out, "out");
  check(grad_entropy == 0 || entropy != 0, "grad_entropy needs entropy");
  check(out != logits || out_row_stride == row_stride,
        "in-place backward needs out_row_stride == row_stride");
  check_ids(as_ptr<int64_t>(labels), rows, vocab, true, "labels");
  py::gil_scoped_release release;
  tpo::cpu::row_backward(as_ptr<void>(logits), dtype, rows, vocab, row_stride,
                         as_ptr<int64_t>(labels), as_ptr<void>(lse), as_ptr<void>(grad_logprob),
                         as_ptr<void>(grad_entropy), as_ptr<void>(entropy), inv_t,
                         reinterpret_cast<void*>(out), out_row_stride);
}

void candidate_forward(uintptr_t logits, int dtype, int64_t rows, int64_t vocab,
                       int64_t row_stride, uintptr_t candidates, int64_t k, double inv_t,
                       uintptr_t out) {
  check_common(dtype, rows, vocab, row_stride, inv_t);
  check(k >= 0, "number of candidates must be >= 0");
  if (rows == 0 || k == 0) return;
  check_ptr(logits, "logits");
  check_ptr(candidates, "candidates");
  check_ptr(out, "cand_logits");
  check_ids(as_ptr<int64_t>(candidates), rows * k, vocab, false, "candidates");
  py::gil_scoped_release release;
  tpo::cpu::candidate_forward(as_ptr<void>(logits), dtype, rows, vocab, row_stride,
                              as_ptr<int64_t>(candidates), k, inv_t, reinterpret_cast<void*>(out));
}

void candidate_backward(uintptr_t grad, uintptr_t candidates, int64_t rows, int64_t k,
                        int64_t vocab, double inv_t, uintptr_t out, int dtype) {
  check_common(dtype, rows, vocab, vocab, inv_t);
  check(k >= 0, "number of candidates must be >= 0");
  if (rows == 0) return;
  check_ptr(out, "out");
  if (k > 0) {
    check_ptr(grad, "grad_cand");
    check_ptr(candidates, "candidates");
    check_ids(as_ptr<int64_t>(candidates), rows * k, vocab, false, "candidates");
  }
  py::gil_scoped_release release;
  tpo::cpu::candidate_backward(as_ptr<void>(grad), as_ptr<int64_t>(candidates), rows, k, vocab,
                               inv_t, reinterpret_cast<void*>(out), dtype);
}

// Element-wise access to the shared row_math.h helpers, so tests can check the arithmetic the
// CUDA kernels share (exp, bf16/fp16 conversions) exhaustively on the CPU.
void math_elementwise(const std::string& op, uintptr_t in, uintptr_t out, int64_t count) {
  check(count >= 0, "count must be >= 0");
  if (count == 0) return;
  check_ptr(in, "in");
  check_ptr(out, "out");
  if (op == "exp_f32") {
    const float* x = as_ptr<float>(in);
    float* y = reinterpret_cast<float*>(out);
    for (int64_t i = 0; i < count; ++i) y[i] = tpo::exp_f32(x[i]);
  } else if (op == "float_to_bf16" || op == "float_to_half") {
    const float* x = as_ptr<float>(in);
    uint16_t* y = reinterpret_cast<uint16_t*>(out);
    const bool bf16 = op == "float_to_bf16";
    for (int64_t i = 0; i < count; ++i) y[i] = bf16 ? tpo::float_to_bf16(x[i]) : tpo::float_to_half(x[i]);
  } else if (op == "bf16_to_float" || op == "half_to_float") {
    const uint16_t* x = as_ptr<uint16_t>(in);
    float* y = reinterpret_cast<float*>(out);
    const bool bf16 = op == "bf16_to_float";
    for (int64_t i = 0; i < count; ++i) y[i] = bf16 ? tpo::bf16_to_float(x[i]) : tpo::half_to_float(x[i]);
  } else {
    throw std::invalid_argument("unknown op " + op);
  }
}

}  // namespace

PYBIND11_MODULE(_C_cpu, m) {
  m.doc() =
      "TPO CPU row ops over raw pointers. dtype codes: 0 float32, 1 float16, 2 bfloat16, "
      "3 float64; per-row outputs and gradients use float64 for float64 logits, float32 "
      "otherwise. Pass 0 for an absent optional pointer.";
  m.def("row_forward", &row_forward, py::arg("logits"), py::arg("dtype"), py::arg("rows"),
        py::arg("vocab"), py::arg("row_stride"), py::arg("labels"), py::arg("inv_temperature"),
        py::arg("lse"), py::arg("target"), py::arg("entropy"),
        "lse[r] = logsumexp(logits[r] * it), target[r] = logits[r, labels[r]] * it, optional "
        "entropy; rows with labels[r] < 0 get 0 and are not read.");
  m.def("row_backward", &row_backward, py::arg("logits"), py::arg("dtype"), py::arg("rows"),
        py::arg("vocab"), py::arg("row_stride"), py::arg("labels"), py::arg("lse"),
        py::arg("grad_logprob"), py::arg("grad_entropy"), py::arg("entropy"),
        py::arg("inv_temperature"), py::arg("out"), py::arg("out_row_stride"),
        "out[r, v] = it * (g (onehot - p) - ge p (log p + H)); out may be logits (in place); "
        "rows with g == ge == 0 are zero-filled without reading logits.");
  m.def("candidate_forward", &candidate_forward, py::arg("logits"), py::arg("dtype"),
        py::arg("rows"), py::arg("vocab"), py::arg("row_stride"), py::arg("candidates"),
        py::arg("num_candidates"), py::arg("inv_temperature"), py::arg("out"));
  m.def("candidate_backward", &candidate_backward, py::arg("grad_cand"), py::arg("candidates"),
        py::arg("rows"), py::arg("num_candidates"), py::arg("vocab"), py::arg("inv_temperature"),
        py::arg("out"), py::arg("dtype"));
  m.def("math_elementwise", &math_elementwise, py::arg("op"), py::arg("in"), py::arg("out"),
        py::arg("count"),
        "Apply a row_math.h helper element-wise (testing aid): exp_f32 (f32 -> f32), "
        "float_to_bf16 / float_to_half (f32 -> 16-bit pattern), bf16_to_float / half_to_float.");
  m.def("max_threads", &tpo::cpu::max_threads, "OpenMP threads used by the row ops.");
  m.def("isa", &tpo::cpu::isa_name, "Instruction set of the row kernels in use.");
  m.def("set_isa", &tpo::cpu::set_isa, py::arg("name"),
        "Force 'generic', 'avx2' or 'avx512' (falls back to the best supported); returns the "
        "one in use.");
}
