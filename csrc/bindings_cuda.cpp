// pybind11 module tpo_kernels._C_cuda: the CUDA kernels over raw device pointers (Python ints
// from tensor.data_ptr()), the device index and the caller's stream handle
// (torch.cuda.current_stream().cuda_stream). No torch headers, no torch C++ ABI.
//
// Each op reads its keyword arguments into its ABI struct (tpo_abi.h) plus `device` and `stream`,
// and checks the struct (binding_args.h) before anything is launched. Ids (labels, kept
// ids) and the kept sets' offsets and label slots live on the device and are not inspected
// here (OffsetsIn::kDevice): the kernels never dereference an out-of-range id and clamp every
// row's pair range to [0, num_pairs) (cuda/launch.h).
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "binding_args.h"
#include "cuda/launch.h"

namespace py = pybind11;

namespace {

using tpo::binding::Kwargs;
using tpo::binding::OffsetsIn;

tpo::cuda::Launch launch_args(Kwargs& in) {
  tpo::cuda::Launch launch{};
  launch.device = in.small_integer("device");
  launch.stream = in.optional_pointer<void>("stream");  // 0: the legacy default stream
  tpo::binding::check(launch.device >= 0,
                      "device index must be >= 0, got " + std::to_string(launch.device));
  return launch;
}

void raise_if(const char* error, const char* what) {
  if (error != nullptr) throw std::runtime_error(std::string(what) + ": CUDA error: " + error);
}

void row_forward(const py::kwargs& kwargs) {
  Kwargs in(kwargs, "row_forward");
  const tpo::RowForwardArgs args = tpo::binding::row_forward_args(in);
  const tpo::cuda::Launch launch = launch_args(in);
  in.finish();
  tpo::binding::check_args(args);
  py::gil_scoped_release release;
  raise_if(tpo::cuda::row_forward(args, launch), "row_forward");
}

void row_backward(const py::kwargs& kwargs) {
  Kwargs in(kwargs, "row_backward");
  const tpo::RowBackwardArgs args = tpo::binding::row_backward_args(in);
  const tpo::cuda::Launch launch = launch_args(in);
  in.finish();
  tpo::binding::check_args(args);
  py::gil_scoped_release release;
  raise_if(tpo::cuda::row_backward(args, launch), "row_backward");
}

void group_targets(const py::kwargs& kwargs) {
  Kwargs in(kwargs, "group_targets");
  const tpo::GroupArgs args = tpo::binding::group_args(in);
  const tpo::cuda::Launch launch = launch_args(in);
  in.finish();
  tpo::binding::check_args(args);
  py::gil_scoped_release release;
  raise_if(tpo::cuda::group_targets(args, launch), "group_targets");
}

void kept_index(const py::kwargs& kwargs, tpo::KeptIndexOp op, const char* name) {
  Kwargs in(kwargs, name);
  const tpo::KeptIndexArgs args = tpo::binding::kept_index_args(in, op);
  const tpo::cuda::Launch launch = launch_args(in);
  in.finish();
  tpo::binding::check_args(args, op);
  py::gil_scoped_release release;
  raise_if(op == tpo::KeptIndexOp::kGather ? tpo::cuda::kept_gather(args, launch)
                                           : tpo::cuda::kept_scatter(args, launch),
           name);
}

void kept_gather(const py::kwargs& kwargs) { kept_index(kwargs, tpo::KeptIndexOp::kGather, "kept_gather"); }

void kept_scatter(const py::kwargs& kwargs) { kept_index(kwargs, tpo::KeptIndexOp::kScatter, "kept_scatter"); }

void kept_linear_forward(const py::kwargs& kwargs) {
  Kwargs in(kwargs, "kept_linear_forward");
  const tpo::KeptDotArgs args = tpo::binding::kept_dot_args(in);
  const tpo::cuda::Launch launch = launch_args(in);
  in.finish();
  tpo::binding::check_args(args, OffsetsIn::kDevice);
  py::gil_scoped_release release;
  raise_if(tpo::cuda::kept_linear_forward(args, launch), "kept_linear_forward");
}

void ragged_row(const py::kwargs& kwargs, tpo::RaggedOp op, const char* name) {
  Kwargs in(kwargs, name);
  const tpo::RaggedRowArgs args = tpo::binding::ragged_row_args(in, op);
  const tpo::cuda::Launch launch = launch_args(in);
  in.finish();
  tpo::binding::check_args(args, op, OffsetsIn::kDevice);
  py::gil_scoped_release release;
  raise_if(tpo::cuda::ragged_rows(args, op, launch), name);
}

void ragged_row_forward(const py::kwargs& kwargs) { ragged_row(kwargs, tpo::RaggedOp::kForward, "ragged_row_forward"); }

void ragged_row_backward(const py::kwargs& kwargs) {
  ragged_row(kwargs, tpo::RaggedOp::kBackward, "ragged_row_backward");
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
      "TPO CUDA kernels over raw device pointers, keyword arguments only (the fields of the "
      "structs in csrc/tpo_abi.h, plus device and stream, the integer cudaStream_t handle). "
      "dtype codes: 0 float32, 1 float16, 2 bfloat16, 3 float64; per-row values use float64 for "
      "float64 logits, float32 otherwise. The kept-set ops' offsets and label slots are device "
      "memory: not checked here, each kernel clamps a row's pairs to [0, num_pairs).";
  m.def("row_forward", &row_forward, tpo::binding::kRowForwardDoc);
  m.def("row_backward", &row_backward, tpo::binding::kRowBackwardDoc);
  m.def("group_targets", &group_targets,
        "group_targets(*, dtype, num_groups, token_logprobs, seq_start, seq_len, group_offsets, "
        "group_members, scores, old_seq_logprobs=0, seq_log_weights=0, eta, score_eps, anchor, seq_logprobs, u, p, q, "
        "group_loss, device, stream): the group op of tpo_kernels.group_op, one block per group "
        "(dtype 0 float32 or 3 float64 for every value array).");
  m.def("kept_gather", &kept_gather, tpo::binding::kKeptGatherDoc);
  m.def("kept_scatter", &kept_scatter, tpo::binding::kKeptScatterDoc);
  m.def("kept_linear_forward", &kept_linear_forward, tpo::binding::kKeptLinearForwardDoc);
  m.def("ragged_row_forward", &ragged_row_forward, tpo::binding::kRaggedRowForwardDoc);
  m.def("ragged_row_backward", &ragged_row_backward, tpo::binding::kRaggedRowBackwardDoc);
  m.def("device_count", &device_count,
        "CUDA devices visible to this extension's runtime (0 when there is no usable driver).");
  m.def("device_error", &device_error,
        "Why the CUDA runtime sees no device ('' when it works).");
}
