// pybind11 module tpo_kernels._C_cpu: the CPU row ops over raw data pointers (Python ints from
// tensor.data_ptr()), so the extension needs no torch headers and no torch C++ ABI.
//
// Each op reads its keyword arguments into its ABI struct (tpo_abi.h) and checks it
// (binding_args.h: null pointers, sizes, dtype code) before the kernels touch anything. Ids
// (labels, kept ids) are guarded by the kernels themselves, as on the CUDA backend: a label
// >= vocab gives NaN, a kept id outside [0, vocab) -inf (a hole) or NaN (DESIGN.md, "Ids outside
// the vocabulary"). Every op also takes an optional
// num_threads (the cpu backend passes torch.get_num_threads(); csrc/cpu/parallel.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "binding_args.h"
#include "cpu/parallel.h"
#include "cpu/row_ops.h"
#include "row_math.h"

namespace py = pybind11;

namespace {

using tpo::binding::Kwargs;

// The thread budget of one call: num_threads when given, else the number of hardware threads.
int num_threads(const py::kwargs& kwargs, Kwargs& in, const char* op) {
  if (!kwargs.contains("num_threads")) return tpo::cpu::max_threads();
  const int threads = in.small_integer("num_threads");
  if (threads < 1) {
    throw std::invalid_argument(std::string(op) + ": num_threads must be >= 1, got " +
                                std::to_string(threads));
  }
  return threads;
}

void row_forward(const py::kwargs& kwargs) {
  Kwargs in(kwargs, "row_forward");
  const tpo::RowForwardArgs args = tpo::binding::row_forward_args(in);
  const int threads = num_threads(kwargs, in, "row_forward");
  in.finish();
  tpo::binding::check_args(args);
  py::gil_scoped_release release;
  tpo::cpu::row_forward(args, threads);
}

void row_backward(const py::kwargs& kwargs) {
  Kwargs in(kwargs, "row_backward");
  const tpo::RowBackwardArgs args = tpo::binding::row_backward_args(in);
  const int threads = num_threads(kwargs, in, "row_backward");
  in.finish();
  tpo::binding::check_args(args);
  py::gil_scoped_release release;
  tpo::cpu::row_backward(args, threads);
}

void kept_linear_forward(const py::kwargs& kwargs) {
  Kwargs in(kwargs, "kept_linear_forward");
  const tpo::KeptDotArgs args = tpo::binding::kept_dot_args(in);
  const int threads = num_threads(kwargs, in, "kept_linear_forward");
  in.finish();
  tpo::binding::check_args(args);
  py::gil_scoped_release release;
  tpo::cpu::kept_linear_forward(args, threads);
}

void ragged_row(const py::kwargs& kwargs, tpo::RaggedOp op, const char* name) {
  Kwargs in(kwargs, name);
  const tpo::RaggedRowArgs args = tpo::binding::ragged_row_args(in, op);
  const int threads = num_threads(kwargs, in, name);
  in.finish();
  tpo::binding::check_args(args, op);
  py::gil_scoped_release release;
  tpo::cpu::ragged_rows(args, op, threads);
}

void ragged_row_forward(const py::kwargs& kwargs) { ragged_row(kwargs, tpo::RaggedOp::kForward, "ragged_row_forward"); }

void ragged_row_backward(const py::kwargs& kwargs) {
  ragged_row(kwargs, tpo::RaggedOp::kBackward, "ragged_row_backward");
}

// Element-wise access to the shared row_math.h helpers, so tests can check the arithmetic the
// CUDA kernels share (exp, bf16/fp16 conversions) exhaustively on the CPU.
void math_elementwise(const std::string& op, uintptr_t in, uintptr_t out, int64_t count) {
  tpo::binding::check(count >= 0, "count must be >= 0");
  if (count == 0) return;
  tpo::binding::check_pointer(reinterpret_cast<const void*>(in), "in");
  tpo::binding::check_pointer(reinterpret_cast<const void*>(out), "out");
  if (op == "exp2_f32") {
    const float* x = reinterpret_cast<const float*>(in);
    float* y = reinterpret_cast<float*>(out);
    for (int64_t i = 0; i < count; ++i) y[i] = tpo::exp2_f32(x[i]);
  } else if (op == "float_to_bf16" || op == "float_to_half") {
    const float* x = reinterpret_cast<const float*>(in);
    uint16_t* y = reinterpret_cast<uint16_t*>(out);
    const bool bf16 = op == "float_to_bf16";
    for (int64_t i = 0; i < count; ++i) {
      y[i] = bf16 ? tpo::float_to_bf16(x[i]) : tpo::float_to_half(x[i]);
    }
  } else if (op == "bf16_to_float" || op == "half_to_float") {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(in);
    float* y = reinterpret_cast<float*>(out);
    const bool bf16 = op == "bf16_to_float";
    for (int64_t i = 0; i < count; ++i) {
      y[i] = bf16 ? tpo::bf16_to_float(x[i]) : tpo::half_to_float(x[i]);
    }
  } else {
    throw std::invalid_argument("unknown op " + op);
  }
}

// set_isa with the name checked: a typo ('AVX2', 'sse9') raises instead of silently selecting
// the best supported instruction set.
const char* set_isa(const std::string& name) {
  if (name != "" && name != "generic" && name != "avx2" && name != "avx512") {
    throw std::invalid_argument("set_isa: name must be 'generic', 'avx2', 'avx512' or '' (the best supported), got '" +
                                name + "'");
  }
  return tpo::cpu::set_isa(name.c_str());
}

int row_threads(int64_t rows, int64_t vocab, int num_threads) {
  tpo::binding::check(rows >= 0 && vocab >= 0, "row_threads: rows and vocab must be >= 0");
  tpo::binding::check(num_threads >= 1, "row_threads: num_threads must be >= 1");
  return tpo::cpu::row_threads(rows, vocab, num_threads);
}

}  // namespace

PYBIND11_MODULE(_C_cpu, m) {
  m.doc() =
      "TPO CPU row ops over raw pointers, keyword arguments only (the fields of the structs in "
      "csrc/tpo_abi.h). dtype codes: 0 float32, 1 float16, 2 bfloat16, 3 float64; per-row "
      "values use float64 for float64 logits, float32 otherwise. Every op also takes an optional "
      "num_threads (>= 1; default: the hardware threads): the most threads it runs on.";
  m.def("row_forward", &row_forward, tpo::binding::kRowForwardDoc);
  m.def("row_backward", &row_backward, tpo::binding::kRowBackwardDoc);
  m.def("kept_linear_forward", &kept_linear_forward, tpo::binding::kKeptLinearForwardDoc);
  m.def("ragged_row_forward", &ragged_row_forward, tpo::binding::kRaggedRowForwardDoc);
  m.def("ragged_row_backward", &ragged_row_backward, tpo::binding::kRaggedRowBackwardDoc);
  m.def("math_elementwise", &math_elementwise, py::arg("op"), py::arg("in"), py::arg("out"),
        py::arg("count"),
        "Apply a row_math.h helper element-wise (testing aid): exp2_f32 (f32 -> f32), "
        "float_to_bf16 / float_to_half (f32 -> 16-bit pattern), bf16_to_float / half_to_float.");
  m.def("max_threads", &tpo::cpu::max_threads,
        "Hardware threads: the thread budget of a call that passes no num_threads (the cpu "
        "backend always passes torch.get_num_threads()).");
  m.def("row_threads", &row_threads, py::arg("rows"), py::arg("vocab"), py::arg("num_threads"),
        "Threads a row op over rows x vocab elements runs on with a budget of num_threads: one "
        "per 32768 elements (ATen's grain) at most; 1 (the calling thread alone) for a small call.");
  m.def("last_threads", &tpo::cpu::last_threads,
        "Threads the calling thread's last row op ran on (1: on the caller alone).");
  m.def("pool_thread_ids", &tpo::cpu::pool_thread_ids,
        "Linux thread ids of the row ops' helper threads (they wait passively, on a condition "
        "variable, between calls; 0 for one not started yet). Empty until a call runs on more "
        "than one thread.");
  m.def("isa", &tpo::cpu::isa_name, "Instruction set of the row kernels in use.");
  m.def("set_isa", &set_isa, py::arg("name"),
        "Force 'generic', 'avx2' or 'avx512' (falls back to the best supported when the CPU lacks "
        "it; '' selects the best supported); returns the one in use. Any other name raises "
        "ValueError.");
}
