// Runs a kernel's independent tasks on the calling thread and the
// process's helper threads (helper_threads.h), and splits an axis into
// blocks for them. Internal to the kernels' sources (attention_handlers.h,
// gemm_cpu.cc, layer_norm_cpu.cc, gelu_cpu.cc, adamw_cpu.cc,
// sum_of_squares_cpu.cc).

#ifndef VIT_JAX_KERNELS_CSRC_PARALLEL_TASKS_H_
#define VIT_JAX_KERNELS_CSRC_PARALLEL_TASKS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "helper_threads.h"
#include "xla/ffi/api/ffi.h"

namespace {

// Runs work(task) for every task in [0, tasks), on the calling thread and
// up to min(tasks, threads, XLA's intra-op threads) - 1 helpers: as many
// cores as XLA gives the device. Tasks are claimed from a shared counter,
// so a helper that starts late finds nothing and nobody waits on a task
// that never ran; the caller waits for the others' by spinning (they are
// running, and short).
template <typename Work>
void ForEachTask(xla::ffi::ThreadPool& pool, int64_t tasks, Work work,
                 int64_t threads = INT64_MAX) {
  const int64_t helpers =
      std::min<int64_t>({pool.num_threads(), tasks, threads}) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < tasks; ++i) work(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto run = [state, tasks, work]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < tasks;) {
      work(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  vit_jax_kernels::HelperThreads::Get().Run(run, helpers);
  run();
  for (int spins = 1; state->done.load(std::memory_order_acquire) < tasks;
       ++spins) {
    vit_jax_kernels::CpuRelax();
    if (spins % 64 == 0) std::this_thread::yield();  // a helper on our core
  }
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

// Runs work(group, start, length) for every block of every group, as
// ForEachTask's tasks (on at most `threads` threads).
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
