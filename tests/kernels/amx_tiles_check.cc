// Checks that the bfloat16 attention kernel's AMX passes leave a thread's
// own tile configuration as they found it (another library on the thread,
// e.g. YNNPACK, may keep its tiles configured between calls), and that
// their AMX products give the rounded-operand values of the path without
// AMX. Built with the kernel's source included, for a CPU with AMX-BF16
// (tests/kernels/test_cpu_attention.py). Prints "ok ..." lines and exits 1
// on a failure.

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "attention_bf16_cpu.cc"

namespace {

bool SameConfig(const TileConfig& a, const TileConfig& b) {
  return std::memcmp(&a, &b, sizeof(TileConfig)) == 0;
}

int Check(int64_t tq, int64_t tk, int64_t d) {
  const Shape s{1, 1, tq, tk, RoundUp(tk), d, d, d, d, 0.125f};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  auto draw = [&](int64_t n) {
    std::vector<float> x(n);
    for (float& value : x) value = normal(rng);
    return x;
  };
  const std::vector<float> q = draw(tq * d), k = draw(tk * d),
                           v = draw(tk * d), dout = draw(tq * d);
  std::vector<float> o(tq * d), o_ref(tq * d), p(tq * s.padded_keys),
      p_ref(tq * s.padded_keys), grads(2 * tq * d + 4 * tk * d);
  float* dq = grads.data();
  float* dk = dq + tq * d;
  float* dv = dk + tk * d;
  float* dq_ref = dv + tk * d;
  float* dk_ref = dq_ref + tq * d;
  float* dv_ref = dk_ref + tk * d;

  // Another library's configuration: 8 rows of 32 bytes in tile 0.
  TileConfig theirs;
  theirs.bytes_per_row[0] = 32;
  theirs.rows[0] = 8;
  _tile_loadconfig(&theirs);
  ForwardPairAmx(s, q.data(), k.data(), v.data(), o.data(), p.data());
  BackwardPairAmx(s, q.data(), k.data(), v.data(), p.data(), dout.data(), dq,
                  dk, dv);
  TileConfig after;
  _tile_storeconfig(&after);
  _tile_release();
  if (!SameConfig(theirs, after)) {
    std::printf("FAIL tq=%ld: the thread's tile configuration changed\n",
                static_cast<long>(tq));
    return 1;
  }
  ForwardPairRounded(s, q.data(), k.data(), v.data(), o_ref.data(),
                     p_ref.data());
  BackwardPairRounded(s, q.data(), k.data(), v.data(), p.data(), dout.data(),
                      dq_ref, dk_ref, dv_ref);
  double worst = 0.0, largest = 0.0;
  auto compare = [&](const float* got, const float* want, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::fabs(double(got[i]) - want[i]));
      largest = std::max(largest, std::fabs(double(want[i])));
    }
  };
  compare(o.data(), o_ref.data(), tq * d);
  compare(dq, dq_ref, tq * d);
  compare(dk, dk_ref, tk * d);
  compare(dv, dv_ref, tk * d);
  // The same rounded operands, summed in another order.
  const bool ok = worst <= 1e-4 * largest;
  std::printf("%s tq=%ld tk=%ld d=%ld worst=%.2e largest=%.2e\n",
              ok ? "ok" : "FAIL", static_cast<long>(tq), static_cast<long>(tk),
              static_cast<long>(d), worst, largest);
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  if (!AmxGranted()) {
    std::printf("no AMX tile data for this process\n");
    return 2;
  }
  int failures = 0;
  for (auto [tq, tk, d] : {std::tuple<int64_t, int64_t, int64_t>{197, 197, 64},
                           {65, 65, 64}, {1, 65, 64}, {5, 7, 80}}) {
    failures += Check(tq, tk, d);
  }
  return failures ? 1 : 0;
}
