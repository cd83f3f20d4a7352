// Times the attention kernel's forward and backward pass for one (batch,
// head) pair on one thread, without JAX: the kernels' sources are included
// whole (benchmarks/attention_pair.py builds and runs this).
//
//   attention_pair_timing TOKENS [HEAD_DIM [float32|bfloat16 [hot|cold]]]
//
// bfloat16 times the passes with bfloat16 products on the engine this CPU
// takes (attention_bf16_cpu.cc: AMX tiles, AVX512_BF16's dot instruction, or
// float32 products of the rounded operands). "cold" gives every call
// probabilities in memory that was not touched since its last use, in a
// ring of 96 MiB, as a train step's forward pass writes them and its
// backward pass reads them; "hot" (the default) one array that stays in
// the core's cache.
//
// Prints one line: tokens, head_dim, the best of 7 rounds of 200 calls of
// each pass in microseconds, and the GFLOP/s of their products (the keys
// padded to a multiple of 16, as the kernel computes them).

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "attention_cpu.cc"
#include "attention_bf16_cpu.cc"

namespace {

// Flushes denormal results and inputs to zero on this thread, as XLA:CPU
// runs its programs and the kernels' custom calls (the calls find FTZ and
// DAZ set in MXCSR). Without it this harness timed something the train
// step never runs: each softmax row's padding (exp(-87) times the sum's
// inverse) is denormal, and every such multiply took a microcode assist,
// 2-3 us of a 197-token forward pass on a Zen 5 core.
void FlushDenormalsAsXlaDoes() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ (bit 15) and DAZ (bit 6)
#elif defined(__aarch64__)
  uint64_t fpcr;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
  __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr | (1ull << 24)));  // FZ
#endif
}

template <typename Pass>
double BestMicroseconds(Pass pass) {
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int call = 0; call < 200; ++call) pass(call);
    const std::chrono::duration<double, std::micro> took =
        std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count() / 200);
  }
  return best;
}

// Probability arrays of `floats` each, 64-byte aligned as XLA's buffers
// are: one, or enough to fill 96 MiB (more than a CPU's last-level cache).
class Probabilities {
 public:
  Probabilities(int64_t floats, bool cold)
      : floats_((floats + 15) / 16 * 16),
        count_(cold ? std::max<int64_t>(2, (96 << 20) / (floats_ * 4)) : 1),
        data_(static_cast<float*>(
            std::aligned_alloc(64, count_ * floats_ * sizeof(float)))) {
    std::memset(data_, 0, count_ * floats_ * sizeof(float));
  }
  ~Probabilities() { std::free(data_); }
  int64_t count() const { return count_; }
  float* operator[](int64_t call) const {
    return data_ + call % count_ * floats_;
  }

 private:
  int64_t floats_, count_;
  float* data_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s TOKENS [HEAD_DIM [float32|bfloat16 [hot|cold]]]\n",
                 argv[0]);
    return 2;
  }
  FlushDenormalsAsXlaDoes();
  const int64_t t = std::atoi(argv[1]), d = argc > 2 ? std::atoi(argv[2]) : 64;
  const bool bfloat16 = argc > 3 && std::string(argv[3]) == "bfloat16",
             cold = argc > 4 && std::string(argv[4]) == "cold";
  const ForwardPairFunction forward_pair =
      bfloat16 ? ForwardPairBf16 : ForwardPair;
  const BackwardPairFunction backward_pair =
      bfloat16 ? BackwardPairBf16 : BackwardPair;
  const int64_t padded = RoundUp(t);
  const Shape s{1, 1, t, t, padded, d, d, d, d, 1.0f / std::sqrt(float(d)), 1};
  std::mt19937 generator(0);
  std::normal_distribution<float> normal;
  std::vector<float> q(t * d), k(t * d), v(t * d), dout(t * d), o(t * d),
      dq(t * d), dk(t * d), dv(t * d);
  for (std::vector<float>* x : {&q, &k, &v, &dout})
    for (float& value : *x) value = normal(generator);
  const Probabilities p(t * padded, cold);
  for (int64_t i = 0; i < p.count(); ++i)  // every array the backward reads
    forward_pair(s, q.data(), k.data(), v.data(), o.data(), p[i]);
  int64_t calls = 0;  // across both passes: each call takes the next array
  const double forward = BestMicroseconds([&](int) {
    forward_pair(s, q.data(), k.data(), v.data(), o.data(), p[calls++]);
  });
  const double backward = BestMicroseconds([&](int) {
    backward_pair(s, q.data(), k.data(), v.data(), p[calls++], dout.data(),
                  dq.data(), dk.data(), dv.data());
  });
  // Two products forward (q k^T, p v), four backward.
  const double forward_flops = 2.0 * t * padded * d + 2.0 * t * d * t;
  std::printf("tokens=%ld head_dim=%ld forward_us=%.1f backward_us=%.1f "
              "forward_gflops=%.1f backward_gflops=%.1f\n",
              long(t), long(d), forward, backward,
              forward_flops / forward / 1e3,
              2 * forward_flops / backward / 1e3);
  return 0;
}
