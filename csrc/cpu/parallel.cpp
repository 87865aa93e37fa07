// The row ops' thread pool (see parallel.h for why it exists and how it behaves).
#include "parallel.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace tpo {
namespace cpu {

namespace {

thread_local int t_last_threads = 1;

// One call's work: chunks of `chunk` rows, claimed through `next`; `done` counts finished chunks.
struct Job {
  const std::function<void(int64_t, int64_t)>* body = nullptr;
  int64_t rows = 0;
  int64_t chunk = 1;
  int64_t num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;  // guards the caller's wait on `finished`
  std::condition_variable finished;
};

// Claims and runs chunks until none is left. Only a claimed chunk touches `body`, and the caller
// waits for every chunk to be done before it returns, so `body` (on the caller's stack) outlives
// every use.
void work_on(Job& job) {
  int64_t finished = 0;
  for (int64_t c = job.next.fetch_add(1); c < job.num_chunks; c = job.next.fetch_add(1)) {
    const int64_t begin = c * job.chunk;
    const int64_t end = begin + job.chunk < job.rows ? begin + job.chunk : job.rows;
    (*job.body)(begin, end);
    ++finished;
  }
  if (finished > 0 && job.done.fetch_add(finished) + finished == job.num_chunks) {
    std::lock_guard<std::mutex> lock(job.mutex);
    job.finished.notify_all();
  }
}

class Pool {
 public:
  void run(int64_t rows, int64_t chunk, int threads, const std::function<void(int64_t, int64_t)>& body) {
    auto job = std::make_shared<Job>();
    job->body = &body;
    job->rows = rows;
    job->chunk = chunk;
    job->num_chunks = (rows + chunk - 1) / chunk;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(helpers_.size()) < threads - 1) {
        std::thread helper([this] { helper_loop(); });
        helper_ids_.push_back(0);
        helpers_.push_back(std::move(helper));
      }
      job_ = job;
      wanted_ = threads - 1;
      ++generation_;
    }
    wake_.notify_all();
    work_on(*job);
    if (job->done.load() != job->num_chunks) {  // helpers still on claimed chunks: sleep until done
      std::unique_lock<std::mutex> lock(job->mutex);
      job->finished.wait(lock, [&] { return job->done.load() == job->num_chunks; });
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (job_ == job) {  // helpers that wake from now on find nothing to do
      job_.reset();
      wanted_ = 0;
    }
  }

  std::mutex& busy() { return busy_; }

  std::vector<int64_t> helper_ids() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::vector<int64_t>(helper_ids_.begin(), helper_ids_.end());
  }

 private:
  void helper_loop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < helpers_.size(); ++i) {
        if (helpers_[i].get_id() == std::this_thread::get_id()) {
          helper_ids_[i] = static_cast<int64_t>(syscall(SYS_gettid));
        }
      }
    }
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (wanted_ <= 0 || !job_) continue;
        --wanted_;
        job = job_;  // a reference of our own: the Job outlives the caller's if we are late
      }
      work_on(*job);
    }
  }

  std::mutex busy_;   // held by the one caller using the pool
  std::mutex mutex_;  // guards everything below
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  std::vector<int64_t> helper_ids_;
  std::shared_ptr<Job> job_;
  int wanted_ = 0;  // helpers still to join the current job
  uint64_t generation_ = 0;
};

// Never destroyed: helpers block on its condition variable until the process exits.
Pool* g_pool = nullptr;
std::mutex g_pool_mutex;
std::once_flag g_atfork_once;

// A forked child has none of the parent's helper threads (and maybe a lock some thread held at
// the fork): it starts a new pool on first use and leaks the old one.
void forget_pool_in_child() {
  g_pool = nullptr;
  new (&g_pool_mutex) std::mutex();
}

Pool& pool() {
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (g_pool == nullptr) g_pool = new Pool();
  return *g_pool;
}

}  // namespace

void parallel_rows(int64_t rows, int64_t elements_per_row, int threads,
                   const std::function<void(int64_t, int64_t)>& body) {
  const int64_t chunk = chunk_rows(elements_per_row);
  if (threads > 1 && rows > chunk) {
    Pool& p = pool();
    std::unique_lock<std::mutex> busy(p.busy(), std::try_to_lock);
    if (busy.owns_lock()) {  // else another thread's call holds the pool: run this one here
      t_last_threads = threads;
      p.run(rows, chunk, threads, body);
      return;
    }
  }
  t_last_threads = 1;
  if (rows > 0) body(0, rows);
}

int last_threads() { return t_last_threads; }

std::vector<int64_t> pool_thread_ids() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  return g_pool == nullptr ? std::vector<int64_t>() : g_pool->helper_ids();
}

}  // namespace cpu
}  // namespace tpo
