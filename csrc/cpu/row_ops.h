// CPU row ops over the ABI structs of tpo_abi.h (OpenMP over rows). The structs are checked by
// bindings_cpu.cpp (binding_args.h) before they get here; these functions assume valid arguments.
#pragma once

#include "../tpo_abi.h"

namespace tpo {
namespace cpu {

void row_forward(const RowForwardArgs& args);
void row_backward(const RowBackwardArgs& args);
void candidate_forward(const CandidateArgs& args);
void candidate_backward(const CandidateArgs& args);

// Number of OpenMP threads the row ops use (1 without OpenMP).
int max_threads();

// Instruction set used by the row kernels ("generic", "avx2", "avx512"), and a way to force one
// (falls back to the best supported when the CPU lacks it). Returns the one now in use.
const char* isa_name();
const char* set_isa(const char* name);

}  // namespace cpu
}  // namespace tpo
