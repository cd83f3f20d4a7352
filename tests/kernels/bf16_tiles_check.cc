// Checks the bfloat16 attention kernel's tiled passes (bf16_tiles.h) against
// its passes without bfloat16 instructions: the same rounded operands, so
// the same values to 1e-4 of the largest (sums in another order), written
// to their rows of token-major arrays and nowhere else. Built
// with the kernel's source included, for this CPU
// (tests/kernels/test_cpu_attention.py). With argument "amx": the AMX
// passes, which must also leave the thread's own tile configuration as they
// found it (another library on the thread, e.g. YNNPACK, may keep its tiles
// configured between calls); with "dot": AVX512_BF16's dot passes. Prints
// "ok ..." lines and exits 1 on a failure, 2 where the engine cannot run.

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "attention_bf16_cpu.cc"

namespace {

struct PairOperands {
  std::vector<float> q, k, v, dout;
};

PairOperands Draw(int64_t tq, int64_t tk, int64_t d) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  auto draw = [&](int64_t n) {
    std::vector<float> x(n);
    for (float& value : x) value = normal(rng);
    return x;
  };
  return {draw(tq * d), draw(tk * d), draw(tk * d), draw(tq * d)};
}

// Filler between and after the outputs' rows: no pass may write there.
constexpr float kSentinel = 12345.0f;
// Rows of o, dq, dk and dv lie this many floats apart, as in the
// projections' token-major arrays, where another pair's values follow a
// row: the passes must write exactly their own rows and columns.
int64_t RowStride(int64_t d) { return d + 16; }

// The forward output and the three gradients of one pair, by the tiled
// passes of Tiles (tiled=true) or the float32 products of rounded values,
// in rows RowStride(d) floats apart, and the probabilities, each followed
// by 16 rows of sentinels. The probabilities start p_offset floats past a
// 64-byte boundary: the tiled forward pass writes them by non-temporal
// stores where they are aligned so, by plain ones elsewhere.
template <typename Tiles>
std::vector<float> Run(const Shape& s, const PairOperands& x, bool tiled,
                       int64_t p_offset = 0) {
  const int64_t tq = s.query_tokens, tk = s.key_tokens, row = s.o_row,
                tkp = s.padded_keys;
  const int64_t qn = (tq + 16) * row, kn = (tk + 16) * row,
                pn = (tq + 16) * tkp;
  std::vector<float> out(2 * qn + 2 * kn, kSentinel),
      p_storage(pn + 16 + p_offset, kSentinel);
  float* o = out.data();
  float* dq = o + qn;
  float* dk = dq + qn;
  float* dv = dk + kn;
  float* p = p_storage.data() +
             (16 - reinterpret_cast<uintptr_t>(p_storage.data()) / 4 % 16) %
                 16 +
             p_offset;
  if (tiled) {
    ForwardPairTiled<Tiles>(s, x.q.data(), x.k.data(), x.v.data(), o, p);
    BackwardPairTiled<Tiles>(s, x.q.data(), x.k.data(), x.v.data(), p,
                             x.dout.data(), dq, dk, dv);
  } else {
    ForwardPairRounded(s, x.q.data(), x.k.data(), x.v.data(), o, p);
    BackwardPairRounded(s, x.q.data(), x.k.data(), x.v.data(), p,
                        x.dout.data(), dq, dk, dv);
  }
  out.insert(out.end(), p, p + pn);
  return out;
}

template <typename Tiles>
int Check(int64_t tq, int64_t tk, int64_t d) {
  const int64_t row = RowStride(d);
  const Shape s{1, 1, tq, tk, RoundUp(tk), d, row, row, row, 0.125f};
  PairOperands x = Draw(tq, tk, d);
  // dO in rows of the same stride (o_row), its gaps never read.
  std::vector<float> dout((tq + 16) * row, kSentinel);
  for (int64_t i = 0; i < tq; ++i)
    std::memcpy(&dout[i * row], &x.dout[i * d], d * sizeof(float));
  x.dout = dout;
  const std::vector<float> want = Run<Tiles>(s, x, false);
  std::vector<float> got = Run<Tiles>(s, x, true);
  // p not 64-byte aligned: the same values, by plain stores.
  const std::vector<float> unaligned = Run<Tiles>(s, x, true, 4);
  got.insert(got.end(), unaligned.begin(), unaligned.end());
  double worst = 0.0, largest = 0.0;
  int64_t overwritten = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float wanted = want[i % want.size()];
    if (wanted == kSentinel) {
      overwritten += got[i] != kSentinel;
      continue;
    }
    worst = std::max(worst, std::fabs(double(got[i]) - wanted));
    largest = std::max(largest, std::fabs(double(wanted)));
  }
  const bool ok = worst <= 1e-4 * largest && overwritten == 0;
  std::printf("%s tq=%ld tk=%ld d=%ld worst=%.2e largest=%.2e "
              "overwritten=%ld\n",
              ok ? "ok" : "FAIL", static_cast<long>(tq), static_cast<long>(tk),
              static_cast<long>(d), worst, largest,
              static_cast<long>(overwritten));
  return ok ? 0 : 1;
}

template <typename Tiles>
int CheckAll() {
  int failures = 0;
  for (auto [tq, tk, d] : {std::tuple<int64_t, int64_t, int64_t>{197, 197, 64},
                           {65, 65, 64}, {1, 65, 64}, {5, 7, 80}}) {
    failures += Check<Tiles>(tq, tk, d);
  }
  return failures ? 1 : 0;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
bool SameConfig(const TileConfig& a, const TileConfig& b) {
  return std::memcmp(&a, &b, sizeof(TileConfig)) == 0;
}

int CheckAmx() {
  if (!AmxGranted()) {
    std::printf("no AMX tile data for this process\n");
    return 2;
  }
  // Another library's configuration: 8 rows of 32 bytes in tile 0.
  TileConfig theirs;
  theirs.bytes_per_row[0] = 32;
  theirs.rows[0] = 8;
  _tile_loadconfig(&theirs);
  const int64_t tq = 197, tk = 197, d = 64;
  const Shape s{1, 1, tq, tk, RoundUp(tk), d, d, d, d, 0.125f};
  Run<AmxTiles>(s, Draw(tq, tk, d), true);
  TileConfig after;
  _tile_storeconfig(&after);
  _tile_release();
  if (!SameConfig(theirs, after)) {
    std::printf("FAIL: the thread's tile configuration changed\n");
    return 1;
  }
  return CheckAll<AmxTiles>();
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const char* engine = argc > 1 ? argv[1] : "";
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (std::strcmp(engine, "amx") == 0) return CheckAmx();
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (std::strcmp(engine, "dot") == 0) return CheckAll<DotTiles>();
#endif
  std::printf("this build has no engine %s\n", engine);
  return 2;
}
