// CPU row ops (layer 1 of DESIGN.md) over raw pointers. Shapes and pointers are checked by the
// callers in bindings_cpu.cpp; these functions assume valid arguments.
#pragma once

#include <stdint.h>

namespace tpo {
namespace cpu {

// Element type codes shared with the Python side (tpo_kernels/backends/cpu.py, cuda.py).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// lse/target/entropy are float64 for kFloat64 logits, float32 otherwise ("compute dtype").
// Rows with labels[r] < 0 get zeros and are never read. entropy may be null.
void row_forward(const void* logits, int dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                 const int64_t* labels, double inv_temperature, void* lse, void* target,
                 void* entropy);

// out[r, v] = it * (g (onehot - p) - ge p (log p + H)). out may alias logits (same row stride).
// grad_entropy and entropy may be null (ge = 0). Rows with g == 0 and ge == 0 are zero-filled
// without reading the logits.
void row_backward(const void* logits, int dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                  const int64_t* labels, const void* lse, const void* grad_logprob,
                  const void* grad_entropy, const void* entropy, double inv_temperature,
                  void* out, int64_t out_row_stride);

// cand[r, k] = logits[r, candidates[r, k]] * it (compute dtype, [rows, k] contiguous).
void candidate_forward(const void* logits, int dtype, int64_t rows, int64_t vocab,
                       int64_t row_stride, const int64_t* candidates, int64_t num_candidates,
                       double inv_temperature, void* cand_logits);

// out ([rows, vocab] contiguous, logits dtype) = 0 except out[r, c[r,k]] += grad[r,k] * it,
// duplicates accumulated in the compute dtype in ascending k order.
void candidate_backward(const void* grad_cand, const int64_t* candidates, int64_t rows,
                        int64_t num_candidates, int64_t vocab, double inv_temperature, void* out,
                        int dtype);

// Number of OpenMP threads the row ops use (1 without OpenMP).
int max_threads();

// Instruction set used by the row kernels ("generic", "avx2", "avx512"), and a way to force one
// (falls back to the best supported when the CPU lacks it). Returns the one now in use.
const char* isa_name();
const char* set_isa(const char* name);

}  // namespace cpu
}  // namespace tpo
