// The threads that run the kernels' short calls' tasks beside the calling
// thread, one set for the whole process (parallel_tasks.h hands them work;
// long calls' tasks go to XLA's intra-op threads). Internal to the
// kernels' sources.
//
// Why not XLA's threads for all: an idle one sleeps, and waking it costs
// more than a small task. On a 2-core Zen 5
// guest a bfloat16 product of 65 x 192 x 768 (a batch-1 vit_tiny_cifar
// MLP's) took 45 us on one thread, 47-52 us split over two when the second
// was woken for it, and 24-26 us when the second was waiting in a spin;
// the whole batch-1 forward pass ran 1.3-1.6 times as fast on helpers
// that spin (docs/performance.md, *The Zen 5 an eighth time*). OpenMP's
// threads, which PyTorch's kernels run on, wait the same way.
//
// So a helper that finishes a task waits for the next one by spinning, up
// to kSpinMicroseconds (or $VIT_JAX_KERNEL_SPIN_US), yielding the core to
// any other thread that wants it, and only then sleeps. Helpers are
// started on demand: when a call asks for more than are idle (several
// devices' kernels at once), up to one fewer than the CPUs this process
// may run on.

#ifndef VIT_JAX_KERNELS_CSRC_HELPER_THREADS_H_
#define VIT_JAX_KERNELS_CSRC_HELPER_THREADS_H_

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Outside the sources' unnamed namespace: one set of helpers for both of
// the library's translation units (an inline function's static is one
// object across them).
namespace vit_jax_kernels {

// A spinning thread's hint to the core that it is waiting.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle helper spins for the next task before it sleeps: long
// enough to span a step's gaps between kernels and the dispatch between
// steps (~0.4 ms at batch 1); OpenMP runtimes' threads spin a while too.
constexpr int64_t kSpinMicroseconds = 1000;

class HelperThreads {
 public:
  // The process's helpers (started on first use, never stopped).
  static HelperThreads& Get() {
    static const bool registered = [] {
      // A child of fork() has none of the parent's threads: it starts a set
      // of its own (the old one, its mutex perhaps held, is left alone).
      pthread_atfork(nullptr, nullptr, [] {
        Instance().store(nullptr, std::memory_order_relaxed);
      });
      return true;
    }();
    (void)registered;
    HelperThreads* helpers = Instance().load(std::memory_order_acquire);
    if (helpers != nullptr) return *helpers;
    HelperThreads* created = new HelperThreads;
    if (Instance().compare_exchange_strong(helpers, created)) return *created;
    delete created;  // another thread's came first (no threads started yet)
    return *helpers;
  }

  // Whether short calls' tasks go to helpers at all: not where
  // $VIT_JAX_KERNEL_HELPERS is 0, which gives every call's tasks to XLA's
  // threads (read once; for comparing the two on a CPU, e.g. with
  // benchmarks/latency.py --jax_env=VIT_JAX_KERNEL_HELPERS=0).
  static bool Wanted() {
    static const bool wanted = [] {
      const char* text = std::getenv("VIT_JAX_KERNEL_HELPERS");
      return !(text && std::string(text) == "0");
    }();
    return wanted;
  }

  // Hands `job` to `count` helpers (each runs it once), starting threads
  // where fewer than `count` are idle. Returns at once.
  void Run(const std::function<void()>& job, int64_t count) {
    std::lock_guard<std::mutex> lock(mutex_);
    count = std::min(count, max_threads_);
    if (count <= 0) return;  // one CPU: the caller runs every task
    for (int64_t i = 0; i < count; ++i) jobs_.push_back(job);
    queued_.fetch_add(count, std::memory_order_release);
    while (idle_ < static_cast<int64_t>(jobs_.size()) &&
           started_ < max_threads_) {
      try {
        std::thread([this] { Loop(); }).detach();
      } catch (const std::system_error&) {  // no more threads to be had
        max_threads_ = started_;
        if (started_ == 0) {  // nobody would take the jobs: the caller will
          jobs_.clear();
          queued_.store(0, std::memory_order_relaxed);
        }
        break;
      }
      ++started_;
      ++idle_;
    }
    if (sleeping_ > 0) wake_.notify_all();
  }

 private:
  static std::atomic<HelperThreads*>& Instance() {
    static std::atomic<HelperThreads*> instance{nullptr};
    return instance;
  }

  HelperThreads() : spin_(SpinTime()), max_threads_(CpusToRunOn() - 1) {}

  static std::chrono::microseconds SpinTime() {
    const char* text = std::getenv("VIT_JAX_KERNEL_SPIN_US");
    char* end = nullptr;
    const long long value = text ? std::strtoll(text, &end, 10) : -1;
    return std::chrono::microseconds(
        text && *text && *end == '\0' && value >= 0 ? value
                                                    : kSpinMicroseconds);
  }

  static int64_t CpusToRunOn() {
#if defined(__linux__)
    cpu_set_t cpus;
    if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return CPU_COUNT(&cpus);
#endif
    return std::max(1u, std::thread::hardware_concurrency());
  }

  // Whether a job was queued within the spin time.
  bool SpinForJob() const {
    const auto deadline = std::chrono::steady_clock::now() + spin_;
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (queued_.load(std::memory_order_acquire) != 0) return true;
        CpuRelax();
      }
      if (std::chrono::steady_clock::now() > deadline) return false;
      sched_yield();  // the core to any thread waiting for it
    }
  }

  void Loop() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "vit_jax_helper");  // for ps and top
#elif defined(__APPLE__)
    pthread_setname_np("vit_jax_helper");
#endif
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (jobs_.empty()) {
        lock.unlock();
        const bool queued = SpinForJob();
        lock.lock();
        if (!queued) {
          ++sleeping_;
          wake_.wait(lock, [this] { return !jobs_.empty(); });
          --sleeping_;
        }
        if (jobs_.empty()) continue;  // another helper took it
      }
      const std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
      --idle_;
      lock.unlock();
      job();
      lock.lock();
      ++idle_;
    }
  }

  const std::chrono::microseconds spin_;
  int64_t max_threads_;  // guarded by mutex_, as the counts below
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  std::atomic<int64_t> queued_{0};  // jobs_.size(), read while spinning
  int64_t started_ = 0, idle_ = 0, sleeping_ = 0;
};

}  // namespace vit_jax_kernels

#endif  // VIT_JAX_KERNELS_CSRC_HELPER_THREADS_H_
