// CPU row ops over the ABI structs of tpo_abi.h, over rows on at most `num_threads` threads (the
// caller passes torch.get_num_threads(); parallel.h says how many a call uses, and how). The structs are checked by
// bindings_cpu.cpp (binding_args.h) before they get here; these functions assume valid arguments.
#pragma once

#include "../tpo_abi.h"

namespace tpo {
namespace cpu {

void row_forward(const RowForwardArgs& args, int num_threads);
void row_backward(const RowBackwardArgs& args, int num_threads);
void kept_linear_forward(const KeptDotArgs& args, int num_threads);
void ragged_rows(const RaggedRowArgs& args, RaggedOp op, int num_threads);

// The thread budget of a call that gives none: the number of hardware threads.
int max_threads();

// Threads a row op over `rows` rows of `vocab` elements runs on when `requested` are allowed
// (plan_threads of parallel.h).
int row_threads(int64_t rows, int64_t vocab, int requested);

// Instruction set used by the row kernels ("generic", "avx2", "avx512"), and a way to force one
// (falls back to the best supported when the CPU lacks it). Returns the one now in use.
const char* isa_name();
const char* set_isa(const char* name);

}  // namespace cpu
}  // namespace tpo
