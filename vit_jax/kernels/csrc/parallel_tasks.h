// Runs a kernel's independent tasks on XLA's intra-op threads, and splits
// an axis into blocks for them. Internal to the kernels' sources
// (attention_handlers.h, gemm_cpu.cc, layer_norm_cpu.cc, gelu_cpu.cc).

#ifndef VIT_JAX_KERNELS_CSRC_PARALLEL_TASKS_H_
#define VIT_JAX_KERNELS_CSRC_PARALLEL_TASKS_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace {

// Runs work(task) for every task in [0, tasks), on the calling thread and
// up to min(tasks, threads) - 1 of XLA's intra-op threads. Tasks are
// claimed from a shared counter, so a helper that starts late finds
// nothing and nobody waits on a task that never ran.
template <typename Work>
void ForEachTask(xla::ffi::ThreadPool& pool, int64_t tasks, Work work,
                 int64_t threads = INT64_MAX) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto state = std::make_shared<State>();
  auto run = [state, tasks, work]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < tasks;) {
      work(i);
      if (state->done.fetch_add(1) + 1 == tasks) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->finished.notify_all();
      }
    }
  };
  const int64_t helpers =
      std::min<int64_t>({pool.num_threads(), tasks, threads}) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(run)(run));
  run();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->finished.wait(lock, [&] { return state->done.load() == tasks; });
}

// Elements of one array a task of the elementwise optimizer kernels takes
// (adamw_cpu.cc, sum_of_squares_cpu.cc): a multiple of every kLanes.
constexpr int64_t kElementsPerTask = 1 << 15;

// `size` split into at most `tasks` blocks of a multiple of `align` each
// (none if size is 0), the last taking the rest: as even as the alignment
// allows (394 rows in 2 blocks aligned to 16: 192 and 202, where rounding
// the blocks up gave 208 and 186). The first index of block i is
// Start(i).
struct Blocks {
  int64_t size, step, blocks;
  Blocks(int64_t size, int64_t tasks, int64_t align) : size(size) {
    tasks = std::max<int64_t>(tasks, 1);
    const int64_t per_task = (size + tasks - 1) / tasks;
    step = std::max<int64_t>(align, per_task / align * align);
    blocks = std::min<int64_t>(tasks, (size + step - 1) / step);
  }
  int64_t count() const { return blocks; }
  int64_t Start(int64_t i) const { return std::min(size, i * step); }
  int64_t Length(int64_t i) const {
    return i + 1 == blocks ? size - Start(i) : step;
  }
};

// Runs work(group, start, length) for every block of every group, as tasks
// on XLA's intra-op threads (at most `threads` of them).
template <typename Work>
void ForEachBlock(xla::ffi::ThreadPool& pool, int64_t groups,
                  const Blocks& blocks, Work work,
                  int64_t threads = INT64_MAX) {
  ForEachTask(pool, groups * blocks.count(), [=](int64_t task) {
    const int64_t block = task % blocks.count();
    work(task / blocks.count(), blocks.Start(block), blocks.Length(block));
  }, threads);
}

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_PARALLEL_TASKS_H_
