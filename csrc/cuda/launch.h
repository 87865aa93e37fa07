// Host entry points of the CUDA kernels, over the ABI structs of tpo_abi.h. Plain C++ types only
// (the stream is a `void*`, i.e. the cudaStream_t from torch.cuda.current_stream().cuda_stream),
// so bindings_cuda.cpp compiles with the host compiler without CUDA headers. Each returns nullptr
// on success or an error message. All pointers in the structs are device pointers.
//
// The structs are checked by the binding (binding_args.h) except for the ids, which live in
// device memory: the kernels never dereference an id outside [0, vocab). A label >= vocab gives
// NaN outputs for its row, a kept id outside [0, vocab) gives -inf (a hole) or NaN in the gather
// and is ignored by the scatter.
#pragma once

#include <stdint.h>

#include "../tpo_abi.h"

namespace tpo {
namespace cuda {

// Where to launch: a device index and a stream on it.
struct Launch {
  int device;
  void* stream;
};

const char* row_forward(const RowForwardArgs& args, const Launch& launch);
const char* row_backward(const RowBackwardArgs& args, const Launch& launch);
const char* group_targets(const GroupArgs& args, const Launch& launch);

// Kept-set ops of replay (kept_kernels.cu). Their offsets live on the device too: each kernel
// clamps a row's pair range to [0, num_pairs) and guards every id and label slot, so malformed
// sets read and write nothing outside the arrays the struct describes.
const char* kept_gather(const KeptIndexArgs& args, const Launch& launch);
const char* kept_scatter(const KeptIndexArgs& args, const Launch& launch);
const char* kept_linear_forward(const KeptDotArgs& args, const Launch& launch);
const char* ragged_rows(const RaggedRowArgs& args, RaggedOp op, const Launch& launch);

// Number of CUDA devices, or -1 with *error set when the driver/runtime is unusable.
int device_count(const char** error);

}  // namespace cuda
}  // namespace tpo
