// What both pybind11 bindings (bindings_cpu.cpp, bindings_cuda.cpp) share: reading an extension
// call's keyword arguments into the ABI structs of tpo_abi.h, and checking a filled struct before
// any kernel touches memory through it.
//
// Every extension op takes keyword arguments only, named like the struct fields (addresses are
// Python ints from tensor.data_ptr(); an optional pointer may be left out, None or 0). A missing,
// unknown or ill-typed keyword raises TypeError; a struct that would make a kernel read or write
// out of bounds (null pointers, negative or inconsistent sizes, a bad dtype code) raises
// ValueError. Ids (labels, kept ids) are not checked here: every kernel, CPU and CUDA, guards
// each id where it touches memory (DESIGN.md, "Ids outside the vocabulary"), so that all backends
// give the same results for an id outside [0, vocab) instead of one of them raising.
//
// Host only: included by the two binding translation units, never by kernel code.
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>

#include "tpo_abi.h"

namespace tpo {
namespace binding {

namespace py = pybind11;

// ---------------------------------------------------------------------------------------------
// Keyword arguments
// ---------------------------------------------------------------------------------------------

// The keyword arguments of one call, read by name; finish() rejects names nobody read.
class Kwargs {
 public:
  Kwargs(const py::kwargs& kwargs, const char* op) : kwargs_(kwargs), op_(op) {}

  template <class P>
  P* pointer(const char* name) {
    return reinterpret_cast<P*>(address(name, true));
  }
  template <class P>
  P* optional_pointer(const char* name) {
    return reinterpret_cast<P*>(address(name, false));
  }

  // An optional int keyword: `fallback` when absent or None.
  int64_t optional_integer(const char* name, int64_t fallback) {
    const py::object value = get(name, false);
    if (!value || value.is_none()) return fallback;
    if (!is_int(value)) fail(name, "must be an int");
    return value.cast<int64_t>();
  }

  int64_t integer(const char* name) {
    const py::object value = get(name, true);
    if (!is_int(value)) fail(name, "must be an int");
    return value.cast<int64_t>();
  }

  int small_integer(const char* name) {
    const int64_t value = integer(name);
    if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
      throw std::invalid_argument(std::string(op_) + ": " + name + " = " + std::to_string(value) +
                                  " is out of range");
    }
    return static_cast<int>(value);
  }

  double real(const char* name) {
    const py::object value = get(name, true);
    if (!is_int(value) && !py::isinstance<py::float_>(value)) fail(name, "must be a float");
    return value.cast<double>();
  }

  bool flag(const char* name) {
    const py::object value = get(name, true);
    if (!py::isinstance<py::bool_>(value)) fail(name, "must be a bool");
    return value.cast<bool>();
  }

  void finish() const {
    for (const auto& item : kwargs_) {
      const std::string name = py::str(item.first);
      if (read_.count(name) == 0) {
        throw py::type_error(std::string(op_) + "() got an unexpected keyword argument '" + name +
                             "'");
      }
    }
  }

 private:
  static bool is_int(py::handle value) {
    return py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value);
  }

  [[noreturn]] void fail(const char* name, const char* what) const {
    throw py::type_error(std::string(op_) + "(): " + name + " " + what);
  }

  // The value of `name` (marked as read); a null object when it is absent and not required.
  py::object get(const char* name, bool required) {
    read_.insert(name);
    if (!kwargs_.contains(name)) {
      if (required) {
        throw py::type_error(std::string(op_) + "() missing required keyword argument '" + name +
                             "'");
      }
      return py::object();
    }
    return kwargs_[name];
  }

  uintptr_t address(const char* name, bool required) {
    const py::object value = get(name, required);
    if (!value || value.is_none()) {
      if (required) fail(name, "must be an address (an int), not None");
      return 0;
    }
    if (!is_int(value)) fail(name, "must be an address (an int)");
    const unsigned long long raw = PyLong_AsUnsignedLongLong(value.ptr());
    if (raw == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      fail(name, "must be a non-negative address");
    }
    return static_cast<uintptr_t>(raw);
  }

  const py::kwargs& kwargs_;
  const char* op_;
  std::set<std::string> read_;
};

// ---------------------------------------------------------------------------------------------
// Filling the structs (one place per struct; the keyword names are the field names)
// ---------------------------------------------------------------------------------------------

inline RowForwardArgs row_forward_args(Kwargs& in) {
  RowForwardArgs a{};
  a.dtype = in.small_integer("dtype");
  a.rows = in.integer("rows");
  a.vocab = in.integer("vocab");
  a.row_stride = in.integer("row_stride");
  a.rows_per_batch = in.optional_integer("rows_per_batch", a.rows);
  a.batch_stride = in.optional_integer("batch_stride", 0);
  a.logits = in.pointer<const void>("logits");
  a.labels = in.pointer<const int64_t>("labels");
  a.inv_temperature = in.real("inv_temperature");
  a.row_max = in.pointer<void>("row_max");
  a.log_sum = in.pointer<void>("log_sum");
  a.logprob = in.pointer<void>("logprob");
  a.entropy = in.optional_pointer<void>("entropy");
  return a;
}

inline RowBackwardArgs row_backward_args(Kwargs& in) {
  RowBackwardArgs a{};
  a.dtype = in.small_integer("dtype");
  a.rows = in.integer("rows");
  a.vocab = in.integer("vocab");
  a.row_stride = in.integer("row_stride");
  a.rows_per_batch = in.optional_integer("rows_per_batch", a.rows);
  a.batch_stride = in.optional_integer("batch_stride", 0);
  a.logits = in.pointer<const void>("logits");
  a.labels = in.pointer<const int64_t>("labels");
  a.row_max = in.pointer<const void>("row_max");
  a.log_sum = in.pointer<const void>("log_sum");
  a.logprob = in.pointer<const void>("logprob");
  a.grad_logprob = in.pointer<const void>("grad_logprob");
  a.grad_entropy = in.optional_pointer<const void>("grad_entropy");
  a.entropy = in.optional_pointer<const void>("entropy");
  a.inv_temperature = in.real("inv_temperature");
  a.out = in.pointer<void>("out");
  a.out_row_stride = in.integer("out_row_stride");
  a.out_batch_stride = in.optional_integer("out_batch_stride", 0);
  return a;
}

inline KeptDotArgs kept_dot_args(Kwargs& in) {
  KeptDotArgs a{};
  a.dtype = in.small_integer("dtype");
  a.rows = in.integer("rows");
  a.hidden_size = in.integer("hidden_size");
  a.vocab = in.integer("vocab");
  a.hidden = in.pointer<const void>("hidden");
  a.hidden_row_stride = in.integer("hidden_row_stride");
  a.weight = in.pointer<const void>("weight");
  a.weight_row_stride = in.integer("weight_row_stride");
  a.bias = in.optional_pointer<const void>("bias");
  a.ids = in.pointer<const int64_t>("ids");
  a.offsets = in.pointer<const int64_t>("offsets");
  a.num_pairs = in.integer("num_pairs");
  a.out = in.pointer<void>("out");
  return a;
}

inline KeptIndexArgs kept_index_args(Kwargs& in, KeptIndexOp op) {
  KeptIndexArgs a{};
  a.dtype = in.small_integer("dtype");
  a.rows = in.integer("rows");
  a.vocab = in.integer("vocab");
  a.row_stride = in.integer("row_stride");
  a.rows_per_batch = in.optional_integer("rows_per_batch", a.rows);
  a.batch_stride = in.optional_integer("batch_stride", 0);
  a.ids = in.pointer<const int64_t>("ids");
  a.offsets = in.pointer<const int64_t>("offsets");
  a.num_pairs = in.integer("num_pairs");
  if (op == KeptIndexOp::kGather) {
    a.logits = in.pointer<const void>("logits");
    a.kept_logits = in.pointer<void>("kept_logits");
  } else {
    a.grad = in.pointer<const void>("grad");
    a.out = in.pointer<void>("out");
  }
  return a;
}

inline RaggedRowArgs ragged_row_args(Kwargs& in, RaggedOp op) {
  RaggedRowArgs a{};
  a.dtype = in.small_integer("dtype");
  a.rows = in.integer("rows");
  a.num_pairs = in.integer("num_pairs");
  a.kept_logits = in.pointer<const void>("kept_logits");
  a.ids = in.pointer<const int64_t>("ids");
  a.offsets = in.pointer<const int64_t>("offsets");
  a.label_slot = in.pointer<const int64_t>("label_slot");
  a.inv_temperature = in.real("inv_temperature");
  a.row_max = in.pointer<void>("row_max");
  a.log_sum = in.pointer<void>("log_sum");
  a.logprob = in.pointer<void>("logprob");
  a.entropy = in.optional_pointer<void>("entropy");
  if (op == RaggedOp::kBackward) {
    a.grad_logprob = in.pointer<const void>("grad_logprob");
    a.grad_entropy = in.optional_pointer<const void>("grad_entropy");
    a.out = in.pointer<void>("out");
  }
  return a;
}

inline GroupArgs group_args(Kwargs& in) {
  GroupArgs a{};
  a.dtype = in.small_integer("dtype");
  a.num_groups = in.integer("num_groups");
  a.token_logprobs = in.pointer<const void>("token_logprobs");
  a.seq_start = in.pointer<const int64_t>("seq_start");
  a.seq_len = in.pointer<const int64_t>("seq_len");
  a.group_offsets = in.pointer<const int64_t>("group_offsets");
  a.group_members = in.pointer<const int64_t>("group_members");
  a.scores = in.pointer<const double>("scores");
  a.old_seq_logprobs = in.optional_pointer<const double>("old_seq_logprobs");
  a.seq_log_weights = in.optional_pointer<const double>("seq_log_weights");
  a.eta = in.real("eta");
  a.score_eps = in.real("score_eps");
  a.anchor = in.flag("anchor");
  a.seq_logprobs = in.pointer<double>("seq_logprobs");
  a.u = in.pointer<double>("u");
  a.p = in.pointer<double>("p");
  a.q = in.pointer<double>("q");
  a.group_loss = in.pointer<double>("group_loss");
  return a;
}

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

inline void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

inline void check_pointer(const void* pointer, const char* name) {
  check(pointer != nullptr, std::string(name) + " is a null pointer");
}

inline void check_dtype(int dtype) {
  check(dtype >= kFloat32 && dtype <= kFloat64,
        "dtype code must be 0 (float32), 1 (float16), 2 (bfloat16) or 3 (float64), got " +
            std::to_string(dtype));
}

inline void check_matrix(int64_t rows, int64_t vocab, int64_t row_stride) {
  check(rows >= 0, "rows must be >= 0, got " + std::to_string(rows));
  check(vocab >= 1, "vocab must be >= 1, got " + std::to_string(vocab));
  check(row_stride >= vocab, "row_stride (" + std::to_string(row_stride) + ") must be >= vocab (" +
                                 std::to_string(vocab) + ")");
}

// The batch layout of a row op (tpo_abi.h): T >= 1 dividing rows, a non-negative batch stride.
inline void check_batches(int64_t rows, int64_t rows_per_batch, int64_t batch_stride,
                          const char* batch_stride_name) {
  if (rows == 0) return;
  check(rows_per_batch >= 1 && rows % rows_per_batch == 0,
        "rows_per_batch (" + std::to_string(rows_per_batch) + ") must be >= 1 and divide rows (" +
            std::to_string(rows) + ")");
  check(batch_stride >= 0, std::string(batch_stride_name) + " must be >= 0, got " +
                               std::to_string(batch_stride));
}

inline void check_inv_temperature(double inv_temperature) {
  check(std::isfinite(inv_temperature) && inv_temperature > 0.0,
        "inv_temperature must be finite and > 0");
}

inline void check_args(const RowForwardArgs& a) {
  check_dtype(a.dtype);
  check_matrix(a.rows, a.vocab, a.row_stride);
  check_batches(a.rows, a.rows_per_batch, a.batch_stride, "batch_stride");
  check_inv_temperature(a.inv_temperature);
  if (a.rows == 0) return;
  check_pointer(a.logits, "logits");
  check_pointer(a.labels, "labels");
  check_pointer(a.row_max, "row_max");
  check_pointer(a.log_sum, "log_sum");
  check_pointer(a.logprob, "logprob");
}

inline void check_args(const RowBackwardArgs& a) {
  check_dtype(a.dtype);
  check_matrix(a.rows, a.vocab, a.row_stride);
  check_batches(a.rows, a.rows_per_batch, a.batch_stride, "batch_stride");
  check_batches(a.rows, a.rows_per_batch, a.out_batch_stride, "out_batch_stride");
  check_inv_temperature(a.inv_temperature);
  check(a.out_row_stride >= a.vocab, "out_row_stride (" + std::to_string(a.out_row_stride) +
                                         ") must be >= vocab (" + std::to_string(a.vocab) + ")");
  if (a.rows == 0) return;
  check_pointer(a.logits, "logits");
  check_pointer(a.labels, "labels");
  check_pointer(a.row_max, "row_max");
  check_pointer(a.log_sum, "log_sum");
  check_pointer(a.logprob, "logprob");
  check_pointer(a.grad_logprob, "grad_logprob");
  check_pointer(a.out, "out");
  check(a.grad_entropy == nullptr || a.entropy != nullptr, "grad_entropy needs entropy");
  check(a.out != a.logits || (a.out_row_stride == a.row_stride &&
                              (a.rows_per_batch == a.rows || a.out_batch_stride == a.batch_stride)),
        "in-place backward needs out_row_stride == row_stride and out_batch_stride == batch_stride");
}

// Where a CSR's offsets live. kHost (the CPU binding): they bound every pair the kernels read and
// write, so they are checked value by value. kDevice (the CUDA binding): the host cannot read them;
// only the pointer is checked, and the kernels clamp each row's range to [0, num_pairs) (tpo_abi.h,
// KeptDotArgs). Ids are checked by neither: the kernels guard each one.
enum class OffsetsIn : int { kHost = 0, kDevice = 1 };

// Offsets in host memory are checked value by value, in device memory the pointer only (OffsetsIn;
// label slots are guarded by the kernels).
inline void check_offsets(const int64_t* offsets, int64_t rows, int64_t num_pairs, OffsetsIn where) {
  check_pointer(offsets, "offsets");
  if (where == OffsetsIn::kDevice) return;
  check(offsets[0] == 0, "offsets[0] must be 0, got " + std::to_string(offsets[0]));
  for (int64_t r = 0; r < rows; ++r) {
    check(offsets[r + 1] >= offsets[r], "offsets must not decrease (row " + std::to_string(r) + ")");
  }
  check(offsets[rows] == num_pairs, "offsets[rows] (" + std::to_string(offsets[rows]) +
                                        ") must be num_pairs (" + std::to_string(num_pairs) + ")");
}

inline void check_args(const KeptDotArgs& a, OffsetsIn where = OffsetsIn::kHost) {
  check_dtype(a.dtype);
  check(a.rows >= 0, "rows must be >= 0, got " + std::to_string(a.rows));
  check(a.num_pairs >= 0, "num_pairs must be >= 0, got " + std::to_string(a.num_pairs));
  check(a.hidden_size >= 0, "hidden_size must be >= 0, got " + std::to_string(a.hidden_size));
  check(a.vocab >= 1, "vocab must be >= 1, got " + std::to_string(a.vocab));
  check(a.weight_row_stride >= a.hidden_size, "weight_row_stride must be >= hidden_size");
  check(a.hidden_row_stride >= a.hidden_size, "hidden_row_stride must be >= hidden_size");
  check_offsets(a.offsets, a.rows, a.num_pairs, where);
  if (a.num_pairs == 0) return;
  check_pointer(a.hidden, "hidden");
  check_pointer(a.weight, "weight");
  check_pointer(a.ids, "ids");
  check_pointer(a.out, "out");
}

inline void check_args(const RaggedRowArgs& a, RaggedOp op, OffsetsIn where = OffsetsIn::kHost) {
  check(a.dtype == kFloat32 || a.dtype == kFloat64,
        "ragged row ops take dtype code 0 (float32) or 3 (float64), got " + std::to_string(a.dtype));
  check(a.rows >= 0 && a.num_pairs >= 0, "rows and num_pairs must be >= 0");
  check_inv_temperature(a.inv_temperature);
  check_offsets(a.offsets, a.rows, a.num_pairs, where);
  if (a.rows == 0) return;
  check_pointer(a.label_slot, "label_slot");
  check_pointer(a.row_max, "row_max");
  check_pointer(a.log_sum, "log_sum");
  check_pointer(a.logprob, "logprob");
  if (op == RaggedOp::kBackward) {
    check_pointer(a.grad_logprob, "grad_logprob");
    check(a.grad_entropy == nullptr || a.entropy != nullptr, "grad_entropy needs entropy");
  }
  if (a.num_pairs == 0) return;
  check_pointer(a.kept_logits, "kept_logits");
  check_pointer(a.ids, "ids");
  if (op == RaggedOp::kBackward) check_pointer(a.out, "out");
}

// The CUDA binding's (offsets in device memory: the pointer is checked, the kernels clamp the ranges).
inline void check_args(const KeptIndexArgs& a, KeptIndexOp op) {
  check_dtype(a.dtype);
  check_matrix(a.rows, a.vocab, a.row_stride);
  check_batches(a.rows, a.rows_per_batch, a.batch_stride, "batch_stride");
  check(a.num_pairs >= 0, "num_pairs must be >= 0, got " + std::to_string(a.num_pairs));
  if (a.rows == 0) return;
  check_offsets(a.offsets, a.rows, a.num_pairs, OffsetsIn::kDevice);
  if (op == KeptIndexOp::kScatter) check_pointer(a.out, "out");  // zero-filled even without pairs
  if (a.num_pairs == 0) return;
  check_pointer(a.ids, "ids");
  if (op == KeptIndexOp::kGather) {
    check_pointer(a.logits, "logits");
    check_pointer(a.kept_logits, "kept_logits");
  } else {
    check_pointer(a.grad, "grad");
  }
}

inline void check_args(const GroupArgs& a) {
  check(a.dtype == kFloat32 || a.dtype == kFloat64,
        "group op dtype code must be 0 (float32) or 3 (float64), got " + std::to_string(a.dtype));
  check(a.num_groups >= 0, "num_groups must be >= 0, got " + std::to_string(a.num_groups));
  check(std::isfinite(a.eta) && a.eta > 0.0, "eta must be finite and > 0");
  check(std::isfinite(a.score_eps) && a.score_eps >= 0.0, "score_eps must be finite and >= 0");
  if (a.num_groups == 0) return;
  check_pointer(a.token_logprobs, "token_logprobs");
  check_pointer(a.seq_start, "seq_start");
  check_pointer(a.seq_len, "seq_len");
  check_pointer(a.group_offsets, "group_offsets");
  check_pointer(a.group_members, "group_members");
  check_pointer(a.scores, "scores");
  check_pointer(a.seq_logprobs, "seq_logprobs");
  check_pointer(a.u, "u");
  check_pointer(a.p, "p");
  check_pointer(a.q, "q");
  check_pointer(a.group_loss, "group_loss");
}

// ---------------------------------------------------------------------------------------------
// Docstrings of the ops both extensions define
// ---------------------------------------------------------------------------------------------

constexpr const char* kRowForwardDoc =
    "row_forward(*, dtype, rows, vocab, row_stride, rows_per_batch=rows, batch_stride=0, logits, "
    "labels, inv_temperature, row_max, log_sum, logprob, entropy=0): row r = b * rows_per_batch + t "
    "starts at b * batch_stride + t * row_stride; row_max[r] = max logits[r], log_sum[r] = log sum exp((logits[r] "
    "- row_max[r]) * it), logprob[r] = log softmax(logits[r] * it)[labels[r]] and optionally the "
    "entropy; rows with labels[r] < 0 get 0 and are not read (csrc/tpo_abi.h).";
constexpr const char* kRowBackwardDoc =
    "row_backward(*, dtype, rows, vocab, row_stride, rows_per_batch=rows, batch_stride=0, logits, "
    "labels, row_max, log_sum, logprob, grad_logprob, grad_entropy=0, entropy=0, inv_temperature, "
    "out, out_row_stride, out_batch_stride=0): rows laid out as in row_forward; out[r, v] = it * "
    "(g (onehot - p) - ge p (log p + H)); out may be logits (in place); rows with g == ge == 0 "
    "are zero-filled without reading logits (csrc/tpo_abi.h).";
constexpr const char* kRaggedRowForwardDoc =
    "ragged_row_forward(*, dtype, rows, num_pairs, kept_logits, ids, offsets, label_slot, inv_temperature, "
    "row_max, log_sum, logprob, entropy=0): the row forward over row r = kept_logits[offsets[r]:offsets[r + 1]] "
    "with its label at pair label_slot[r] (-1: not counted, 0 outputs; -2: not in the set, NaN logprob).";
constexpr const char* kRaggedRowBackwardDoc =
    "ragged_row_backward(*, dtype, rows, num_pairs, kept_logits, ids, offsets, label_slot, inv_temperature, "
    "row_max, log_sum, logprob, entropy=0, grad_logprob, grad_entropy=0, out): out[p] = it (g (1[p = slot] - p) "
    "- ge p (log p + H)) on each row's pairs; 0 on holes, rows not counted and rows with g == ge == 0.";
constexpr const char* kKeptGatherDoc =
    "kept_gather(*, dtype, rows, vocab, row_stride, rows_per_batch=rows, batch_stride=0, ids, offsets, "
    "num_pairs, logits, kept_logits): kept_logits[p] = logits[r, ids[p]] (raw, compute dtype) for the pairs p "
    "of row r, offsets[r] <= p < offsets[r + 1], rows laid out as in row_forward; a negative id gives -inf, "
    "an id >= vocab NaN (csrc/tpo_abi.h).";
constexpr const char* kKeptScatterDoc =
    "kept_scatter(*, dtype, rows, vocab, row_stride, rows_per_batch=rows, batch_stride=0, ids, offsets, "
    "num_pairs, grad, out): out = 0 except out[r, c] = the sum of grad[p] over row r's pairs with ids[p] == c, "
    "in ascending p (deterministic, no atomics); negative ids and ids >= vocab are not written.";
constexpr const char* kKeptLinearForwardDoc =
    "kept_linear_forward(*, dtype, rows, hidden_size, vocab, hidden, hidden_row_stride, weight, "
    "weight_row_stride, bias=0, ids, offsets, num_pairs, out): out[p] = hidden[r] . weight[ids[p]] "
    "(+ bias[ids[p]]) for the pairs p of row r, offsets[r] <= p < offsets[r + 1]; a negative id "
    "gives -inf, an id >= vocab NaN (csrc/tpo_abi.h).";

}  // namespace binding
}  // namespace tpo
