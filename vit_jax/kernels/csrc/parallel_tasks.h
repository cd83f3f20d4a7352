// Runs a kernel's independent tasks on the calling thread and others, and
// splits an axis into blocks for them. Internal to the kernels' sources
// (attention_handlers.h, gemm_cpu.cc, layer_norm_cpu.cc, gelu_cpu.cc,
// adamw_cpu.cc, sum_of_squares_cpu.cc).

#ifndef VIT_JAX_KERNELS_CSRC_PARALLEL_TASKS_H_
#define VIT_JAX_KERNELS_CSRC_PARALLEL_TASKS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "helper_threads.h"
#include "xla/ffi/api/ffi.h"

namespace {

// What a kernel call reads and writes and computes, all its tasks
// together: a rough time on one core (~16 bytes and ~256 flops a
// nanosecond; within a few times of any current CPU's, which is all the
// choice of threads below needs); and whether its tasks may go to the
// helpers at all. Not for a train step's calls (the forward rules of
// custom VJPs, backward passes, the optimizer): a train step keeps XLA's
// own threads busy with independent work, and a helper beyond them
// competes for the cores and is preempted mid-task. A batch-1 train step
// ran 7-14% faster with its calls on XLA's threads, inference 6% slower
// (docs/performance.md, *The Zen 4 again*). The Python side says which a
// call is (`cpu_build.on_xla_threads`) where one handler serves both.
struct CallCost {
  int64_t bytes = 0, flops = 0;
  bool helpers = true;
  int64_t Nanoseconds() const { return bytes / 16 + flops / 256; }
};

// Calls whose share for each thread is estimated shorter than this run on
// the spinning helpers (helper_threads.h), longer ones on XLA's intra-op
// threads. Why: a helper saves a call the wake-up of a sleeping thread
// (~30 us on a Zen 5 guest), which a long one hardly notices; but XLA
// runs its own work on its threads at the same time (other independent
// ops, and the halves of its larger fusions), and helpers are threads
// beyond those, more than there are cores. A ViT-B/16 batch-1 bfloat16
// train step took 220 ms with every kernel's tasks on helpers, 190-200
// with all on XLA's threads, and as fast with only the products over
// ~0.2 ms a thread on XLA's threads
// (docs/performance.md, *The Zen 5 an eighth time*).
constexpr int64_t kHelperTaskNanoseconds = 200000;

// How long the caller, its own tasks done, spins for the others' to finish
// before it sleeps until they have.
constexpr auto kCallerSpin = std::chrono::microseconds(50);

// Runs work(task) for every task in [0, tasks), on the calling thread and
// up to min(tasks, threads, XLA's intra-op threads) - 1 others: as many
// cores as XLA gives the device; helpers or XLA's threads as `cost` says.
// Tasks are claimed from a shared counter, so a thread that starts late
// finds nothing and nobody waits on a task that never ran.
template <typename Work>
void ForEachTask(xla::ffi::ThreadPool& pool, CallCost cost, int64_t tasks,
                 Work work, int64_t threads = INT64_MAX) {
  const int64_t others =
      std::min<int64_t>({pool.num_threads(), tasks, threads}) - 1;
  if (others <= 0) {
    for (int64_t i = 0; i < tasks; ++i) work(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<bool> caller_sleeps{false};
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto state = std::make_shared<State>();
  auto run = [state, tasks, work]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < tasks;) {
      work(i);
      // Sequentially consistent, as the caller's store of caller_sleeps and
      // load of done: one of the two sees the other's.
      if (state->done.fetch_add(1) + 1 == tasks &&
          state->caller_sleeps.load()) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->finished.notify_all();
      }
    }
  };
  // Each thread's share of the call: how long it will be busy.
  if (cost.helpers &&
      cost.Nanoseconds() / (others + 1) < kHelperTaskNanoseconds &&
      vit_jax_kernels::HelperThreads::Wanted()) {
    vit_jax_kernels::HelperThreads::Get().Run(run, others);
  } else {
    for (int64_t h = 0; h < others; ++h) pool.Schedule(decltype(run)(run));
  }
  run();
  const auto spin_until = std::chrono::steady_clock::now() + kCallerSpin;
  while (state->done.load(std::memory_order_acquire) < tasks) {
    for (int i = 0; i < 64; ++i) vit_jax_kernels::CpuRelax();
    if (std::chrono::steady_clock::now() > spin_until) {
      std::unique_lock<std::mutex> lock(state->mutex);
      state->caller_sleeps.store(true);
      state->finished.wait(lock, [&] { return state->done.load() == tasks; });
    }
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
void ForEachBlock(xla::ffi::ThreadPool& pool, CallCost cost, int64_t groups,
                  const Blocks& blocks, Work work,
                  int64_t threads = INT64_MAX) {
  ForEachTask(pool, cost, groups * blocks.count(), [=](int64_t task) {
    const int64_t block = task % blocks.count();
    work(task / blocks.count(), blocks.Start(block), blocks.Length(block));
  }, threads);
}

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_PARALLEL_TASKS_H_
