// How the CPU row ops use threads, so that the CPU backend degrades under load no worse than
// PyTorch.
//
// The row ops used to run each call as an OpenMP parallel region. On a loaded machine (other
// processes on the cores) that collapses: a region is a fork and a join, the join waits for every
// thread of the team, and a thread that another process has pushed off its core arrives only when
// the scheduler gives it a time slice back, milliseconds later; meanwhile the threads already
// there spin in the barrier (libgomp's default wait policy spins ~3 ms before sleeping), taking
// CPU from the very thread they wait for. Measured on a shared 2-core machine: the row ops slowed
// 20-50x where PyTorch slowed 3-5x.
//
// So the row ops no longer use OpenMP threads (`#pragma omp simd` stays, compiled with
// -fopenmp-simd: vectorization only, no runtime). Instead:
//
// * The caller gives the thread budget: the cpu backend passes torch.get_num_threads(), so
//   torch.set_num_threads governs the row ops too.
// * A call uses at most one thread per kGrainElements elements (ATen's grain, as
//   at::parallel_for does), and a small call runs on the calling thread alone, waking nobody.
// * Work is handed out in chunks of rows that threads claim from a shared counter; the calling
//   thread claims too. The call returns when every chunk is done, waiting only for chunks that
//   a helper has claimed and not finished, never for a helper that has not started: under load
//   the caller simply does more of the work itself.
// * Helpers wait for work on a condition variable (a passive wait: no spinning between calls or
//   at the end of one), so they take no CPU from torch's threads or from other processes while
//   idle.
//
// Rows are independent (each row's reductions run in one thread in a fixed order), so results
// are bitwise identical whatever the thread count, the chunking and which thread ran a row.
#pragma once

#include <stdint.h>

#include <functional>
#include <vector>

namespace tpo {
namespace cpu {

// ATen's at::internal::GRAIN_SIZE: the least work (elements) worth handing to one more thread.
constexpr int64_t kGrainElements = 32768;

// Rows per claimed chunk: about one grain of elements (at least one row).
inline int64_t chunk_rows(int64_t elements_per_row) {
  const int64_t per_row = elements_per_row > 0 ? elements_per_row : 1;
  return (kGrainElements + per_row - 1) / per_row;
}

// Threads a pass over `rows` rows of `elements_per_row` elements runs on with a budget of
// `requested`: min(requested, number of chunks), at least 1.
inline int plan_threads(int64_t rows, int64_t elements_per_row, int requested) {
  if (requested <= 1 || rows <= 1) return 1;
  const int64_t per_chunk = chunk_rows(elements_per_row);
  const int64_t chunks = (rows + per_chunk - 1) / per_chunk;
  return chunks < requested ? static_cast<int>(chunks) : requested;
}

// Runs body(begin, end) over consecutive row ranges covering [0, rows) exactly once, on the
// calling thread and up to threads - 1 pool helpers (threads from plan_threads). The body must
// not throw. Concurrent callers are safe: a call that finds the pool busy runs on its own thread.
void parallel_rows(int64_t rows, int64_t elements_per_row, int threads,
                   const std::function<void(int64_t, int64_t)>& body);

// Threads the calling thread's last parallel_rows ran on (1: on the caller alone).
int last_threads();

// Linux thread ids of the pool's helpers (0 for one not started yet); the pool grows to the
// largest budget asked for, and starts on the first call that runs on more than one thread.
std::vector<int64_t> pool_thread_ids();

}  // namespace cpu
}  // namespace tpo
