// The native ABI: the element-type codes and one argument struct per kernel family. Each binding
// (bindings_cpu.cpp, bindings_cuda.cpp) fills a struct once from its Python call, checks it
// (binding_args.h) and hands it to the CPU kernels (cpu/row_ops.h) or the CUDA launchers
// (cuda/launch.h), which read their arguments from it and nothing else.
//
// Plain C++ (no CUDA, no pybind11), so the host compiler and nvcc both include it.
//
// Conventions shared by every struct:
//  * pointers are raw addresses of host memory (CPU) or device memory (CUDA); an optional
//    pointer is null when absent;
//  * "compute dtype": per-row and per-pair values are double for kFloat64 matrices and
//    float for every other element type;
//  * a [rows, vocab] matrix has unit column stride and `row_stride` elements between rows
//    (row_stride >= vocab);
//  * the row ops also read a batch of such matrices, a [B, T, vocab] view whose rows do not
//    flatten into one row stride (logits[:, :-1]): rows = B * T, `rows_per_batch` = T and
//    `batch_stride` elements between batch entries, so that row r = b * T + t starts at
//    b * batch_stride + t * row_stride (row_offset in row_math.h). A plain matrix is the batch of
//    one: rows_per_batch = rows, batch_stride = 0 (the bindings' defaults). One launch covers
//    the batch.
//  * ids (labels, kept ids) are int64; a negative label marks a row that is skipped. The
//    kernels guard every id against [0, vocab) where they touch memory (the bindings do not
//    check ids): DESIGN.md, "Ids outside the vocabulary".
#pragma once

#include <stdint.h>

namespace tpo {

// Element type codes. The Python side mirrors them in tpo_kernels/backends/native.py.
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// Row forward: for each row r with labels[r] >= 0, with z = logits[r, :], y = labels[r] and
// d = (z - max z) * inv_temperature (csrc/row_math.h has the math):
//   row_max[r] = max z (untempered),  log_sum[r] = log sum exp(d),
//   logprob[r] = log softmax(z * it)[y] (1 - p_y kept to full relative accuracy),
//   entropy[r] = -sum softmax(z * it) log softmax(z * it).
// The tempered logsumexp is row_max * it + log_sum; keeping the two apart keeps log-probs of
// logits with a large common offset accurate. Rows with labels[r] < 0 get 0 in every output and
// are never read; rows with labels[r] >= vocab get NaN in every output and are never read. A row holding NaN (or +inf) gets NaN; a row of only -inf logits gets
// row_max = -inf and NaN elsewhere.
struct RowForwardArgs {
  int dtype;                 // element type of logits
  int64_t rows;
  int64_t vocab;
  int64_t row_stride;
  int64_t rows_per_batch;    // T >= 1 dividing rows (rows when not batched)
  int64_t batch_stride;      // >= 0, elements between batch entries
  const void* logits;        // [rows, vocab] (or [rows / T, T, vocab])
  const int64_t* labels;     // [rows]
  double inv_temperature;
  void* row_max;             // [rows] compute dtype
  void* log_sum;             // [rows] compute dtype
  void* logprob;             // [rows] compute dtype
  void* entropy;             // [rows] compute dtype, optional
};

// Row backward: with the forward's row statistics, log p = (logits[r, :] - row_max[r]) * it -
// log_sum[r], p = exp(log p), g = grad_logprob, ge = grad_entropy,
//   out[r, v] = it * (g[r] (onehot(labels[r])[v] - p[v]) - ge[r] p[v] (log p[v] + entropy[r])),
// where the label's entry takes log p from logprob[r] (its 1 - p as -expm1(logprob)).
// out may be logits itself (in-place backward, then out_row_stride == row_stride). Rows with
// g == ge == 0 are written as zeros without reading logits; a label outside [0, vocab) adds no
// one-hot term.
struct RowBackwardArgs {
  int dtype;                 // element type of logits and out
  int64_t rows;
  int64_t vocab;
  int64_t row_stride;
  int64_t rows_per_batch;    // T >= 1 dividing rows (rows when not batched), logits and out
  int64_t batch_stride;      // >= 0, elements between the logits' batch entries
  const void* logits;        // [rows, vocab] (or [rows / T, T, vocab])
  const int64_t* labels;     // [rows]
  const void* row_max;       // [rows] compute dtype
  const void* log_sum;       // [rows] compute dtype
  const void* logprob;       // [rows] compute dtype (read where labels[r] >= 0)
  const void* grad_logprob;  // [rows] compute dtype
  const void* grad_entropy;  // [rows] compute dtype, optional (absent: ge = 0)
  const void* entropy;       // [rows] compute dtype, required when grad_entropy is given
  double inv_temperature;
  void* out;                 // [rows, vocab], out_row_stride between rows
  int64_t out_row_stride;
  int64_t out_batch_stride;  // >= 0, elements between out's batch entries
};

// Kept-set dot products (sampling-mask replay on the fused head): for each row r and each pair p
// in [offsets[r], offsets[r + 1]),
//   out[p] = hidden[r] . weight[ids[p]] (+ bias[ids[p]]),
// summed in the compute dtype in a fixed order that depends on hidden_size only (16 lane sums,
// then a fixed tree), so a pair's value does not depend on its row's position or its batch.
// ids[p] < 0 is a hole: out[p] = -inf; ids[p] >= vocab: NaN (never read). offsets run from 0 to
// num_pairs without decreasing (the CPU binding checks them; no binding checks ids). Offsets in
// device memory cannot be checked on the host: the CUDA kernels clamp each row's pair range to
// [0, num_pairs) instead (OffsetsIn::kDevice in binding_args.h), so malformed offsets read and
// write no memory outside the [num_pairs] arrays (pairs then covered by no row are not written).
struct KeptDotArgs {
  int dtype;                 // element type of hidden, weight and bias
  int64_t rows;
  int64_t hidden_size;
  int64_t vocab;
  const void* hidden;        // [rows, hidden_size], hidden_row_stride between rows
  int64_t hidden_row_stride;
  const void* weight;        // [vocab, hidden_size], weight_row_stride between rows
  int64_t weight_row_stride;
  const void* bias;          // [vocab], optional
  const int64_t* ids;        // [num_pairs]
  const int64_t* offsets;    // [rows + 1]
  int64_t num_pairs;
  void* out;                 // [num_pairs] compute dtype
};

// Kept gather / scatter (replay on the logits path): a [rows, vocab] matrix, or a batch of them laid
// out as the row ops' (rows_per_batch, batch_stride), and the CSR pairs of its rows (ids, offsets
// as in KeptDotArgs; row r's pairs are offsets[r] <= p < offsets[r + 1]):
//   gather:  kept_logits[p] = matrix[r, ids[p]], raw, in the compute dtype; a hole (ids[p] < 0)
//            gives -inf, an id >= vocab NaN (never read);
//   scatter: out = 0 except out[r, c] = the sum of grad[p] (compute dtype) over row r's pairs with
//            ids[p] == c, in ascending p from 0, rounded once to `dtype` (deterministic, no atomics);
//            holes and ids >= vocab are never written.
// Each op uses its own two pointers and leaves the other two null. CUDA only (the cpu backend
// runs the PyTorch defaults).
enum class KeptIndexOp : int { kGather = 0, kScatter = 1 };

struct KeptIndexArgs {
  int dtype;                 // element type of the matrix (logits or out)
  int64_t rows;
  int64_t vocab;
  int64_t row_stride;
  int64_t rows_per_batch;    // T >= 1 dividing rows (rows when not batched)
  int64_t batch_stride;      // >= 0, elements between batch entries
  const int64_t* ids;        // [num_pairs]
  const int64_t* offsets;    // [rows + 1]
  int64_t num_pairs;
  const void* logits;        // gather: read
  void* kept_logits;         // gather: written, [num_pairs] compute dtype
  const void* grad;          // scatter: read, [num_pairs] compute dtype
  void* out;                 // scatter: written (every element of the rows' vocab columns)
};

// Ragged row ops (replay): the row forward / backward above over ragged rows of the gathered kept
// logits, row r = kept_logits[offsets[r] .. offsets[r + 1]) (raw, in the compute dtype `dtype`,
// kFloat32 or kFloat64, as every [rows] array), its label at pair label_slot[r]: -1 the row does not
// count (outputs 0, never read), -2 (or a slot outside the row) its label is not in the set (the
// statistics computed, logprob NaN). Each row is summed in an order fixed by its own pairs alone
// (the CPU: sequentially in pair order; CUDA: one warp per row, lane l over the pairs first + l +
// 32 k, then a fixed shuffle tree), so a row's results do not depend on the other rows. The backward
// writes out[p] for every pair: 0 on holes (ids[p] < 0), on rows that do not count and on rows with
// g == ge == 0. Offsets as in KeptDotArgs (checked on the host, clamped on the device).
enum class RaggedOp : int { kForward = 0, kBackward = 1 };

struct RaggedRowArgs {
  int dtype;                 // kFloat32 or kFloat64
  int64_t rows;
  int64_t num_pairs;
  const void* kept_logits;   // [num_pairs]
  const int64_t* ids;        // [num_pairs], read by the backward (holes)
  const int64_t* offsets;    // [rows + 1], 0 .. num_pairs, not decreasing
  const int64_t* label_slot; // [rows]
  double inv_temperature;
  void* row_max;             // forward: written; backward: read
  void* log_sum;             // forward: written; backward: read
  void* logprob;             // forward: written; backward: read
  void* entropy;             // optional; the backward reads it with grad_entropy
  const void* grad_logprob;  // backward: [rows]
  const void* grad_entropy;  // backward: [rows], optional
  void* out;                 // backward: [num_pairs]
};

// The group op (layer 2), one group at a time: for the members n of group g,
//   ell[n] = sum of token_logprobs over the member's rows, u = standardized scores (0 when all
//   scores of the group tie; s - mean, not divided, when their population std is at most
//   score_eps), p = softmax(ell), q = softmax(base + u / eta) with base =
//   old_seq_logprobs (ell when absent) if anchor, else 0, and group_loss[g] = -sum q log p
//   (terms with q == 0 count 0: their limit, also when log p = -inf). With seq_log_weights lw:
//   p = softmax(ell + lw), q = softmax((base + lw) + u / eta) (one same add into both), u over the
//   members with lw > -inf; a member with lw = -inf has u = p = q = 0 and no loss term.
// token_logprobs has `dtype` (kFloat32 or kFloat64); everything else, and all the arithmetic, is
// float64 (sums over long completions and the [N]-sized group math lose digits in fp32).
struct GroupArgs {
  int dtype;
  int64_t num_groups;
  const void* token_logprobs;     // [M] of dtype, 0 on rows outside every completion
  const int64_t* seq_start;       // [N] first row of each completion
  const int64_t* seq_len;         // [N]
  const int64_t* group_offsets;   // [G + 1]
  const int64_t* group_members;   // [N] completions listed group by group
  const double* scores;           // [N]
  const double* old_seq_logprobs; // [N], optional (on-policy when absent)
  const double* seq_log_weights;  // [N], optional: log w, finite or -inf (0 when absent)
  double eta;
  double score_eps;               // >= 0; 0: divide by every nonzero std
  bool anchor;
  double* seq_logprobs;           // [N]
  double* u;                      // [N]
  double* p;                      // [N]
  double* q;                      // [N]
  double* group_loss;             // [G]
};

}  // namespace tpo
