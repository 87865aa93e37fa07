// pybind11 module tpo_kernels._C_cuda: the CUDA kernels over raw device pointers (Python ints
// from tensor.data_ptr()), the device index and the caller's stream handle
// (torch.cuda.current_stream().cuda_stream). No torch headers, no torch C++ ABI.
//
// Host-side checks reject null pointers, negative or inconsistent sizes and bad dtype codes
// before anything is launched. Ids (labels, candidates) live on the device and are not
// inspected here; the kernels never dereference an out-of-range id (see launch.h).
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/launch.h"

namespace py = pybind11;

namespace {

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

void check_ptr(uintptr_t ptr, const char* name) {
  check(ptr != 0, std::string(name) + " is a null pointer");
}

void check_dtype(int dtype) {
  check(dtype >= 0 && dtype <= 3,
        "dtype code must be 0 (float32), 1 (float16), 2 (bfloat16) or 3 (float64), got " +
            std::to_string(dtype));
}

void check_rows(int64_t rows, int64_t vocab, int64_t row_stride, double inv_t) {
  check(rows >= 0, "rows must be >= 0, got " + std::to_string(rows));
  check(vocab >= 1, "vocab must be >= 1, got " + std::to_string(vocab));
  check(row_stride >= vocab, "row_stride (" + std::to_string(row_stride) +
                                 ") must be >= vocab (" + std::to_string(vocab) + ")");
  check(std::isfinite(inv_t) && inv_t > 0.0, "inv_temperature must be finite and > 0");
}

void check_device(int device) { check(device >= 0, "device index must be >= 0"); }

void raise_if(const char* error, const char* what) {
  if (error != nullptr) throw std::runtime_error(std::string(what) + ": CUDA error: " + error);
}

template <class P>
P* ptr(uintptr_t p) {
  return reinterpret_cast<P*>(p);
}

void row_forward(uintptr_t logits, int dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                 uintptr_t labels, double inv_t, uintptr_t lse, uintptr_t target,
                 uintptr_t entropy, int device, uintptr_t stream) {
  check_dtype(dtype);
  check_rows(rows, vocab, row_stride, inv_t);
  check_device(device);
  if (rows == 0) return;
  check_ptr(logits, "logits");
  check_ptr(labels, "labels");
  check_ptr(lse, "lse");
  check_ptr(target, "target");
  py::gil_scoped_release release;
  raise_if(tpo::cuda::row_forward(ptr<const void>(logits), dtype, rows, vocab, row_stride,
                                  ptr<const int64_t>(labels), inv_t, ptr<void>(lse),
                                  ptr<void>(target), ptr<void>(entropy), device,
                                  ptr<void>(stream)),
           "row_forward");
}

void row_backward(uintptr_t logits, int dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                  uintptr_t labels, uintptr_t lse, uintptr_t grad_logprob, uintptr_t grad_entropy,
                  uintptr_t entropy, double inv_t, uintptr_t out, int64_t out_row_stride,
                  int device, uintptr_t stream) {
  check_dtype(dtype);
  check_rows(rows, vocab, row_stride, inv_t);
  check_device(device);
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
  py::gil_scoped_release release;
  raise_if(tpo::cuda::row_backward(ptr<const void>(logits), dtype, rows, vocab, row_stride,
                                   ptr<const int64_t>(labels), ptr<const void>(lse),
                                   ptr<const void>(grad_logprob), ptr<const void>(grad_entropy),
                                   ptr<const void>(entropy), inv_t, ptr<void>(out),
                                   out_row_stride, device, ptr<void>(stream)),
           "row_backward");
}

void candidate_forward(uintptr_t logits, int dtype, int64_t rows, int64_t vocab,
                       int64_t row_stride, uintptr_t candidates, int64_t k, double inv_t,
                       uintptr_t out, int device, uintptr_t stream) {
  check_dtype(dtype);
  check_rows(rows, vocab, row_stride, inv_t);
  check_device(device);
  check(k >= 0, "number of candidates must be >= 0");
  if (rows == 0 || k == 0) return;
  check_ptr(logits, "logits");
  check_ptr(candidates, "candidates");
  check_ptr(out, "cand_logits");
  py::gil_scoped_release release;
  raise_if(tpo::cuda::candidate_forward(ptr<const void>(logits), dtype, rows, vocab, row_stride,
                                        ptr<const int64_t>(candidates), k, inv_t, ptr<void>(out),
                                        device, ptr<void>(stream)),
           "candidate_forward");
}

void candidate_backward(uintptr_t grad, uintptr_t candidates, int64_t rows, int64_t k,
                        int64_t vocab, double inv_t, uintptr_t out, int dtype, int device,
                        uintptr_t stream) {
  check_dtype(dtype);
  check_rows(rows, vocab, vocab, inv_t);
  check_device(device);
  check(k >= 0, "number of candidates must be >= 0");
  if (rows == 0) return;
  check_ptr(out, "out");
  if (k > 0) {
    check_ptr(grad, "grad_cand");
    check_ptr(candidates, "candidates");
  }
  py::gil_scoped_release release;
  raise_if(tpo::cuda::candidate_backward(ptr<const void>(grad), ptr<const int64_t>(candidates),
                                         rows, k, vocab, inv_t, ptr<void>(out), dtype, device,
                                         ptr<void>(stream)),
           "candidate_backward");
}

void group_targets(int value_dtype, uintptr_t token_logprobs, uintptr_t seq_start,
                   uintptr_t seq_len, uintptr_t group_offsets, uintptr_t group_members,
                   int64_t num_groups, uintptr_t scores, uintptr_t old_seq_logprobs, double eta,
                   bool anchor, double weight, uintptr_t seq_logprobs, uintptr_t u, uintptr_t p,
                   uintptr_t q, uintptr_t group_loss, uintptr_t coef, int device,
                   uintptr_t stream) {
  check(value_dtype == 0 || value_dtype == 3, "group_targets value dtype must be 0 or 3");
  check(num_groups >= 0, "num_groups must be >= 0");
  check(std::isfinite(eta) && eta > 0.0, "eta must be finite and > 0");
  check_device(device);
  if (num_groups == 0) return;
  const std::pair<uintptr_t, const char*> required[] = {
      {token_logprobs, "token_logprobs"}, {seq_start, "seq_start"}, {seq_len, "seq_len"},
      {group_offsets, "group_offsets"}, {group_members, "group_members"}, {scores, "scores"},
      {seq_logprobs, "seq_logprobs"}, {u, "u"}, {p, "p"}, {q, "q"},
      {group_loss, "group_loss"}, {coef, "coef"}};
  for (const auto& item : required) check_ptr(item.first, item.second);
  py::gil_scoped_release release;
  raise_if(tpo::cuda::group_targets(
               value_dtype, ptr<const void>(token_logprobs), ptr<const int64_t>(seq_start),
               ptr<const int64_t>(seq_len), ptr<const int64_t>(group_offsets),
               ptr<const int64_t>(group_members), num_groups, ptr<const void>(scores),
               ptr<const void>(old_seq_logprobs), eta, anchor, weight, ptr<void>(seq_logprobs),
               ptr<void>(u), ptr<void>(p), ptr<void>(q), ptr<void>(group_loss), ptr<void>(coef),
               device, ptr<void>(stream)),
           "group_targets");
}

int device_count() {
  const char* error = nullptr;
  const int count = tpo::cuda::device_count(&error);
  return count < 0 ? 0 : count;
}

std::string device_error() {
  const char* error = nullptr;
  return tpo::cuda::device_count(&error) < 0 && error != nullptr ? std::string(error) : "";
}

}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() =
      "TPO CUDA kernels over raw device pointers. dtype codes: 0 float32, 1 float16, "
      "2 bfloat16, 3 float64; per-row values use float64 for float64 logits, float32 otherwise. "
      "Pass 0 for an absent optional pointer; stream is the integer cudaStream_t handle.";
  m.def("row_forward", &row_forward, py::arg("logits"), py::arg("dtype"), py::arg("rows"),
        py::arg("vocab"), py::arg("row_stride"), py::arg("labels"), py::arg("inv_temperature"),
        py::arg("lse"), py::arg("target"), py::arg("entropy"), py::arg("device"),
        py::arg("stream"));
  m.def("row_backward", &row_backward, py::arg("logits"), py::arg("dtype"), py::arg("rows"),
        py::arg("vocab"), py::arg("row_stride"), py::arg("labels"), py::arg("lse"),
        py::arg("grad_logprob"), py::arg("grad_entropy"), py::arg("entropy"),
        py::arg("inv_temperature"), py::arg("out"), py::arg("out_row_stride"),
        py::arg("device"), py::arg("stream"));
  m.def("candidate_forward", &candidate_forward, py::arg("logits"), py::arg("dtype"),
        py::arg("rows"), py::arg("vocab"), py::arg("row_stride"), py::arg("candidates"),
        py::arg("num_candidates"), py::arg("inv_temperature"), py::arg("out"), py::arg("device"),
        py::arg("stream"));
  m.def("candidate_backward", &candidate_backward, py::arg("grad_cand"), py::arg("candidates"),
        py::arg("rows"), py::arg("num_candidates"), py::arg("vocab"),
        py::arg("inv_temperature"), py::arg("out"), py::arg("dtype"), py::arg("device"),
        py::arg("stream"));
  m.def("group_targets", &group_targets, py::arg("value_dtype"), py::arg("token_logprobs"),
        py::arg("seq_start"), py::arg("seq_len"), py::arg("group_offsets"),
        py::arg("group_members"), py::arg("num_groups"), py::arg("scores"),
        py::arg("old_seq_logprobs"), py::arg("eta"), py::arg("anchor"), py::arg("weight"),
        py::arg("seq_logprobs"), py::arg("u"), py::arg("p"), py::arg("q"),
        py::arg("group_loss"), py::arg("coef"), py::arg("device"), py::arg("stream"));
  m.def("device_count", &device_count,
        "CUDA devices visible to this extension's runtime (0 when there is no usable driver).");
  m.def("device_error", &device_error,
        "Why the CUDA runtime sees no device ('' when it works).");
}
