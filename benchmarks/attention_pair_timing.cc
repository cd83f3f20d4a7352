// Times the float32 attention kernel's forward and backward pass for one
// (batch, head) pair on one thread, without JAX: the kernel's source is
// included whole (benchmarks/attention_pair.py builds and runs this).
//
//   attention_pair_timing TOKENS [HEAD_DIM]
//
// Prints one line: tokens, head_dim, the best of 7 rounds of 200 calls of
// each pass in microseconds, and the GFLOP/s of their products (the keys
// padded to a multiple of 16, as the kernel computes them).

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "attention_cpu.cc"

namespace {

template <typename Pass>
double BestMicroseconds(Pass pass) {
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int call = 0; call < 200; ++call) pass();
    const std::chrono::duration<double, std::micro> took =
        std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count() / 200);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TOKENS [HEAD_DIM]\n", argv[0]);
    return 2;
  }
  const int64_t t = std::atoi(argv[1]), d = argc > 2 ? std::atoi(argv[2]) : 64;
  const int64_t padded = RoundUp(t);
  const Shape s{1, 1, t, t, padded, d, d, d, d, 1.0f / std::sqrt(float(d)), 1};
  std::mt19937 generator(0);
  std::normal_distribution<float> normal;
  std::vector<float> q(t * d), k(t * d), v(t * d), dout(t * d), o(t * d),
      dq(t * d), dk(t * d), dv(t * d), p(t * padded);
  for (std::vector<float>* x : {&q, &k, &v, &dout})
    for (float& value : *x) value = normal(generator);
  const double forward = BestMicroseconds([&] {
    ForwardPair(s, q.data(), k.data(), v.data(), o.data(), p.data());
  });
  const double backward = BestMicroseconds([&] {
    BackwardPair(s, q.data(), k.data(), v.data(), p.data(), dout.data(),
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
