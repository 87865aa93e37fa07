// Host entry points of the CUDA kernels. Plain C++ types only (streams are `void*`, i.e. the
// cudaStream_t from torch.cuda.current_stream().cuda_stream), so bindings_cuda.cpp compiles with
// the host compiler without CUDA headers. Each returns nullptr on success or an error message.
//
// Pointers are device pointers; dtype codes are those of csrc/cpu/row_ops.h (0 float32,
// 1 float16, 2 bfloat16, 3 float64); per-row values use float64 for float64 logits, float32
// otherwise. All launches go to `stream` on `device`.
#pragma once

#include <stdint.h>

namespace tpo {
namespace cuda {

// lse[r], target[r] (and entropy[r] when non-null); rows with labels[r] < 0 get 0, unread.
// A label >= vocab is never dereferenced: that row's outputs become NaN.
const char* row_forward(const void* logits, int dtype, int64_t rows, int64_t vocab,
                        int64_t row_stride, const int64_t* labels, double inv_temperature,
                        void* lse, void* target, void* entropy, int device, void* stream);

// out[r, v] = it (g (onehot - p) - ge p (log p + H)); out may alias logits. grad_entropy and
// entropy may be null. Rows with g == ge == 0 are zero-filled without reading logits.
const char* row_backward(const void* logits, int dtype, int64_t rows, int64_t vocab,
                         int64_t row_stride, const int64_t* labels, const void* lse,
                         const void* grad_logprob, const void* grad_entropy, const void* entropy,
                         double inv_temperature, void* out, int64_t out_row_stride, int device,
                         void* stream);

// cand[r, k] = logits[r, candidates[r, k]] * it ([rows, k] contiguous, compute dtype).
// Out-of-range candidates give NaN and are not dereferenced.
const char* candidate_forward(const void* logits, int dtype, int64_t rows, int64_t vocab,
                              int64_t row_stride, const int64_t* candidates, int64_t k,
                              double inv_temperature, void* cand_logits, int device, void* stream);

// out ([rows, vocab] contiguous, logits dtype) = 0 except out[r, c[r,k]] += grad[r,k] * it,
// one thread per row, duplicates summed in ascending k order (deterministic). Out-of-range
// candidates are ignored.
const char* candidate_backward(const void* grad_cand, const int64_t* candidates, int64_t rows,
                               int64_t k, int64_t vocab, double inv_temperature, void* out,
                               int dtype, int device, void* stream);

// The group op of tpo_kernels.targets.group_targets, one block per group. value_dtype: 0 float32,
// 3 float64 (token_logprobs, scores, old_seq_logprobs and every output share it).
// old_seq_logprobs may be null (on-policy). weight = 1/G for reduction "mean", else 1.
const char* group_targets(int value_dtype, const void* token_logprobs, const int64_t* seq_start,
                          const int64_t* seq_len, const int64_t* group_offsets,
                          const int64_t* group_members, int64_t num_groups, const void* scores,
                          const void* old_seq_logprobs, double eta, bool anchor, double weight,
                          void* seq_logprobs, void* u, void* p, void* q, void* group_loss,
                          void* coef, int device, void* stream);

// Number of CUDA devices, or -1 with *error set when the driver/runtime is unusable.
int device_count(const char** error);

}  // namespace cuda
}  // namespace tpo
