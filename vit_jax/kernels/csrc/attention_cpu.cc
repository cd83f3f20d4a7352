// The attention core softmax(Q K^T) V and its gradient for XLA:CPU, as XLA
// FFI handlers. Built and loaded by vit_jax/cpu_attention.py (see there for
// why it exists and when it is used).
//
// Layout: q (B, H, Tq, D), k and v (B, H, Tk, D), float32, row major; q is
// already scaled by 1/sqrt(D). The probabilities p that the backward pass
// reads are (B, H, Tq, Tk_padded): each row padded with zeros to a multiple
// of 16 columns, so every product below runs on whole vectors.
//
// Each (batch, head) pair is one task: its operands (~0.3 MB at 197 tokens)
// stay in L2 through the two products and the softmax of the forward pass,
// or the four products and the softmax gradient of the backward pass. The
// products are register-blocked: a tile of ROWS rows by VECTORS hardware
// vectors is accumulated in registers over the whole contraction and stored
// once.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows of probabilities and head_dim are multiples of kPad floats (the
// Python side's LANES). A Vec is one hardware register of kLanes floats,
// which divides kPad: a vector wider than the registers would be split by
// the compiler, which then keeps a tile's accumulators on the stack (32x
// slower with AVX2). Tiles of kMaxRows x kMaxVectors accumulators leave a
// register for each of the VECTORS loads of B and one for A's broadcast.
constexpr int kPad = 16;
#if defined(__AVX512F__)
constexpr int kLanes = 16, kMaxRows = 6, kMaxVectors = 4;  // 24 of 32 zmm
#elif defined(__AVX2__)
constexpr int kLanes = 8, kMaxRows = 6, kMaxVectors = 2;  // 12 of 16 ymm
#elif defined(__aarch64__)
constexpr int kLanes = 4, kMaxRows = 6, kMaxVectors = 4;  // 24 of 32 q
#else
constexpr int kLanes = 4, kMaxRows = 6, kMaxVectors = 2;  // 12 of 16 xmm
#endif
static_assert(kPad % kLanes == 0, "a row of kPad floats is whole vectors");
typedef float Vec __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(kLanes * 4), aligned(4)));

inline Vec Load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }
// x - 0 is x for every float (-0 included), so the compiler drops the
// subtraction and broadcasts straight from memory; Vec{} + x would be an add
// (0 + -0 is +0) and a register shuffle per splat: a third of the AVX2
// tile's instructions, 16-24% of its products' time.
inline Vec Splat(float x) { return x - Vec{}; }

int64_t RoundUp(int64_t n) { return (n + kPad - 1) / kPad * kPad; }

// C[r, v*kLanes ..] = sum_k A(r, k) B[k, v*kLanes ..] for ROWS rows and
// VECTORS vectors, where A(r, k) = a[r * a_row + k * a_k].
template <int ROWS, int VECTORS>
inline void Tile(int64_t depth, const float* a, int64_t a_row, int64_t a_k,
                 const float* b, int64_t ldb, float* c, int64_t ldc) {
  Vec acc[ROWS][VECTORS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECTORS; ++v) acc[r][v] = Vec{};
  for (int64_t k = 0; k < depth; ++k) {
    Vec bk[VECTORS];
    for (int v = 0; v < VECTORS; ++v) bk[v] = Load(b + k * ldb + v * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const Vec ar = Splat(a[r * a_row + k * a_k]);
      for (int v = 0; v < VECTORS; ++v) acc[r][v] += ar * bk[v];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECTORS; ++v)
      Store(c + r * ldc + v * kLanes, acc[r][v]);
}

template <int VECTORS>
void RowsOf(int64_t rows, int64_t depth, const float* a, int64_t a_row,
            int64_t a_k, const float* b, int64_t ldb, float* c, int64_t ldc) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    Tile<kMaxRows, VECTORS>(depth, a + r * a_row, a_row, a_k, b, ldb,
                            c + r * ldc, ldc);
  for (; r < rows; ++r)  // at most kMaxRows - 1 rows left
    Tile<1, VECTORS>(depth, a + r * a_row, a_row, a_k, b, ldb, c + r * ldc,
                     ldc);
}

// C (rows x columns, columns a multiple of kPad) = A B, A(r, k) as in Tile,
// B (depth x columns) row major with leading dimension ldb.
void Product(int64_t rows, int64_t columns, int64_t depth, const float* a,
             int64_t a_row, int64_t a_k, const float* b, int64_t ldb, float* c,
             int64_t ldc) {
  int64_t vectors = columns / kLanes;
  int64_t column = 0;
  // Widest tiles first; a remainder below kMaxVectors runs once, narrower.
  while (vectors > 0) {
    const int64_t width = std::min<int64_t>(vectors, kMaxVectors);
    const float* bc = b + column;
    float* cc = c + column;
    switch (width) {
      case 4: RowsOf<4>(rows, depth, a, a_row, a_k, bc, ldb, cc, ldc); break;
      case 3: RowsOf<3>(rows, depth, a, a_row, a_k, bc, ldb, cc, ldc); break;
      case 2: RowsOf<2>(rows, depth, a, a_row, a_k, bc, ldb, cc, ldc); break;
      default: RowsOf<1>(rows, depth, a, a_row, a_k, bc, ldb, cc, ldc);
    }
    vectors -= width;
    column += width * kLanes;
  }
}

// x^T: (rows x columns) -> (columns x padded_rows), the padding zero.
void Transpose(int64_t rows, int64_t columns, const float* x,
               int64_t padded_rows, float* out) {
  for (int64_t j = 0; j < columns; ++j) {
    float* row = out + j * padded_rows;
    for (int64_t i = 0; i < rows; ++i) row[i] = x[i * columns + j];
    std::fill(row + rows, row + padded_rows, 0.0f);
  }
}

// exp(x) to about one ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
// series to degree 7 (truncation error below 6e-9), 2^n through the exponent
// bits. Inputs are clamped to [-87, 88]: below, only the shifted logits'
// far tail, whose exp (~1.6e-38) is nothing beside the row maximum's 1.
inline Vec Exp(Vec x) {
  const Vec low = Splat(-87.0f), high = Splat(88.0f);
  x = x < low ? low : x;
  x = x > high ? high : x;
  const float kShifter = 12582912.0f;  // 1.5 * 2^23: adds round to integer
  const Vec shifted = x * Splat(1.44269504088896341f) + Splat(kShifter);
  const Vec n = shifted - Splat(kShifter);
  const Vec r = (x - n * Splat(0.693359375f)) - n * Splat(-2.12194440e-4f);
  Vec p = Splat(1.0f / 5040);
  p = p * r + Splat(1.0f / 720);
  p = p * r + Splat(1.0f / 120);
  p = p * r + Splat(1.0f / 24);
  p = p * r + Splat(1.0f / 6);
  p = p * r + Splat(0.5f);
  p = p * r + Splat(1.0f);
  p = p * r + Splat(1.0f);
  const IVec bits = reinterpret_cast<const IVec&>(shifted);
  const IVec exponent = (bits - 0x4B400000 + 127) << 23;
  return p * reinterpret_cast<const Vec&>(exponent);
}

// Rows of logits (padded width) -> probabilities in place; the padding -> 0.
void Softmax(int64_t rows, int64_t width, int64_t padded, float* x) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = x + i * padded;
    std::fill(row + width, row + padded, -INFINITY);
    Vec vmax = Splat(-INFINITY);
    for (int64_t j = 0; j < padded; j += kLanes) {
      const Vec xj = Load(row + j);
      vmax = xj > vmax ? xj : vmax;
    }
    float row_max = vmax[0];
    for (int l = 1; l < kLanes; ++l) row_max = std::max(row_max, vmax[l]);
    Vec vsum{};
    for (int64_t j = 0; j < padded; j += kLanes) {
      const Vec e = Exp(Load(row + j) - row_max);
      Store(row + j, e);
      vsum += e;
    }
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += vsum[l];
    const float inverse = 1.0f / sum;
    for (int64_t j = 0; j < padded; j += kLanes)
      Store(row + j, Load(row + j) * inverse);
    std::fill(row + width, row + padded, 0.0f);
  }
}

// dS = P * (dP - rowsum(P * dP)) in place of dP; the softmax's gradient.
void SoftmaxGradient(int64_t rows, int64_t padded, const float* p, float* dp) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* pi = p + i * padded;
    float* gi = dp + i * padded;
    Vec vdot{};
    for (int64_t j = 0; j < padded; j += kLanes)
      vdot += Load(pi + j) * Load(gi + j);
    float dot = 0.0f;
    for (int l = 0; l < kLanes; ++l) dot += vdot[l];
    for (int64_t j = 0; j < padded; j += kLanes)
      Store(gi + j, Load(pi + j) * (Load(gi + j) - dot));
  }
}

struct Shape {
  int64_t pairs, query_tokens, key_tokens, padded_keys, head_dim;
};

// Scratch of one thread, reused across calls.
std::vector<float>& Scratch(size_t size) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < size) scratch.resize(size);
  return scratch;
}

void ForwardPair(const Shape& s, const float* q, const float* k, const float* v,
                 float* o, float* p) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  std::vector<float>& scratch = Scratch(d * tkp + (p ? 0 : tq * tkp));
  float* kt = scratch.data();
  if (p == nullptr) p = kt + d * tkp;
  Transpose(tk, d, k, tkp, kt);
  Product(tq, tkp, d, q, d, 1, kt, tkp, p, tkp);
  Softmax(tq, tk, tkp, p);
  Product(tq, d, tk, p, tkp, 1, v, d, o, d);
}

void BackwardPair(const Shape& s, const float* q, const float* k,
                  const float* v, const float* p, const float* dout, float* dq,
                  float* dk, float* dv) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  std::vector<float>& scratch = Scratch(d * tkp + tq * tkp);
  float* vt = scratch.data();
  float* ds = vt + d * tkp;
  Product(tk, d, tq, p, 1, tkp, dout, d, dv, d);  // dV = P^T dO
  Transpose(tk, d, v, tkp, vt);
  Product(tq, tkp, d, dout, d, 1, vt, tkp, ds, tkp);  // dP = dO V^T
  SoftmaxGradient(tq, tkp, p, ds);
  Product(tq, d, tk, ds, tkp, 1, k, d, dq, d);  // dQ = dS K
  Product(tk, d, tq, ds, 1, tkp, q, d, dk, d);  // dK = dS^T Q
}

// The forward pass with q, k, v and the probabilities rounded to bfloat16
// (to nearest even) for its two products, which sum in float32: what the
// model's bfloat16 products ask for (cpu_attention.py). Where the CPU has
// AMX (and Linux grants this process its tile registers) the products run
// as AMX tile products; elsewhere the same rounded values go through the
// float32 products. (AVX512_BF16's dot instruction is no help: on an AMX
// Xeon it ran at half the rate of float32 FMAs, docs/performance.md.)
inline uint16_t ToBfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;  // a NaN stays one
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

inline float FromBfloat16(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float result;
  std::memcpy(&result, &bits, 4);
  return result;
}

// The rounded operands widened back to float32, through the float32
// products: the values of ForwardPairAmx without AMX.
void ForwardPairRounded(const Shape& s, const float* q, const float* k,
                        const float* v, float* o, float* p) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  thread_local std::vector<float> rounded;
  const size_t size = tq * d + 2 * tk * d + d * tkp + 2 * tq * tkp;
  if (rounded.size() < size) rounded.resize(size);
  float* qr = rounded.data();
  float* kr = qr + tq * d;
  float* vr = kr + tk * d;
  float* kt = vr + tk * d;
  float* pr = kt + d * tkp;
  if (p == nullptr) p = pr + tq * tkp;
  auto round = [](int64_t n, const float* x, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = FromBfloat16(ToBfloat16(x[i]));
  };
  round(tq * d, q, qr);
  round(tk * d, k, kr);
  round(tk * d, v, vr);
  Transpose(tk, d, kr, tkp, kt);
  Product(tq, tkp, d, qr, d, 1, kt, tkp, p, tkp);
  Softmax(tq, tk, tkp, p);
  round(tq * tkp, p, pr);
  Product(tq, d, tk, pr, tkp, 1, vr, d, o, d);
}

// BackwardPair from rounded operands (dO, V, K, Q, P and dS), through the
// float32 products: the values of BackwardPairAmx without AMX.
void BackwardPairRounded(const Shape& s, const float* q, const float* k,
                         const float* v, const float* p, const float* dout,
                         float* dq, float* dk, float* dv) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  thread_local std::vector<float> rounded;
  const size_t size = 2 * tq * d + 2 * tk * d + 2 * tq * tkp + d * tkp;
  if (rounded.size() < size) rounded.resize(size);
  float* qr = rounded.data();
  float* gr = qr + tq * d;
  float* kr = gr + tq * d;
  float* vr = kr + tk * d;
  float* pr = vr + tk * d;
  float* ds = pr + tq * tkp;
  float* vt = ds + tq * tkp;
  auto round = [](int64_t n, const float* x, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = FromBfloat16(ToBfloat16(x[i]));
  };
  round(tq * d, q, qr);
  round(tq * d, dout, gr);
  round(tk * d, k, kr);
  round(tk * d, v, vr);
  round(tq * tkp, p, pr);
  Product(tk, d, tq, pr, 1, tkp, gr, d, dv, d);  // dV = P^T dO
  Transpose(tk, d, vr, tkp, vt);
  Product(tq, tkp, d, gr, d, 1, vt, tkp, ds, tkp);  // dP = dO V^T
  SoftmaxGradient(tq, tkp, p, ds);
  round(tq * tkp, ds, ds);
  Product(tq, d, tk, ds, tkp, 1, kr, d, dq, d);  // dQ = dS K
  Product(tk, d, tq, ds, 1, tkp, qr, d, dk, d);  // dK = dS^T Q
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
// Whether Linux lets this process use AMX's tile data (asked once).
bool AmxGranted() {
  static const bool granted =
      syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
              18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: an accumulator of 16 x 16 floats, an A
// operand of 16 rows of 32 bfloat16 values, a B operand of 16 rows of 16
// pairs (two depth steps per 32-bit word).
void ConfigureTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// x (rows x columns floats, leading dimension ld) rounded into out (rows
// of out_columns bfloat16 values, zero past columns; out_rows rows, zero
// past rows). columns is a multiple of 16.
void ToBfloat16Rows(int64_t rows, int64_t columns, const float* x, int64_t ld,
                    int64_t out_rows, int64_t out_columns, uint16_t* out) {
  for (int64_t i = 0; i < out_rows; ++i) {
    uint16_t* row = out + i * out_columns;
    int64_t j = 0;
    if (i < rows) {
      for (; j < columns; j += 16)
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(row + j),
            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i * ld + j)));
    }
    std::fill(row + j, row + out_columns, uint16_t{0});
  }
}

// C (16 m_blocks x 16 n_blocks floats, leading dimension ldc) = A B: A
// rows of depth bfloat16 values (a_stride bytes apart), B rows of pairs
// (b_stride bytes apart), depth a multiple of 32.
void TileProduct(int64_t m_blocks, int64_t n_blocks, int64_t depth,
                 const uint16_t* a, int64_t a_stride, const uint32_t* b,
                 int64_t b_stride, float* c, int64_t ldc) {
  for (int64_t m = 0; m < m_blocks; ++m)
    for (int64_t n = 0; n < n_blocks; ++n) {
      _tile_zero(0);
      for (int64_t kk = 0; kk < depth; kk += 32) {
        _tile_loadd(1, reinterpret_cast<const char*>(a) + 16 * m * a_stride +
                           kk * 2, a_stride);
        _tile_loadd(2, reinterpret_cast<const char*>(b) +
                           (kk / 2) * b_stride + n * 64, b_stride);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, c + 16 * m * ldc + 16 * n, ldc * 4);
    }
}

// out (out_pairs x columns words): word (j, c) the pair (x[2j, c],
// x[2j+1, c]), zero past x's rows: B operand rows that pair two rows of
// x. columns is a multiple of 16.
void PairRows(int64_t rows, int64_t columns, const float* x, int64_t ld,
              int64_t out_pairs, uint32_t* out) {
  auto row = [&](int64_t t, int64_t c) {
    return t < rows ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                          _mm512_loadu_ps(x + t * ld + c)))
                    : _mm512_setzero_si512();
  };
  for (int64_t j = 0; j < out_pairs; ++j)
    for (int64_t c = 0; c < columns; c += 16)
      _mm512_storeu_si512(out + j * columns + c,
                          _mm512_or_si512(row(2 * j, c),
                                          _mm512_slli_epi32(row(2 * j + 1, c),
                                                            16)));
}

// out (depth_pairs x out_columns words): word (j, n) the pair (x[n, 2j],
// x[n, 2j+1]), zero past x's rows and columns: B operand rows that pair
// two columns of x (x^T as a product's right side). scratch holds rows *
// depth_pairs words.
void PairColumns(int64_t rows, int64_t columns, const float* x, int64_t ld,
                 int64_t depth_pairs, int64_t out_columns, uint32_t* out,
                 uint32_t* scratch) {
  ToBfloat16Rows(rows, columns, x, ld, rows, 2 * depth_pairs,
                 reinterpret_cast<uint16_t*>(scratch));
  for (int64_t j = 0; j < depth_pairs; ++j) {
    uint32_t* row = out + j * out_columns;
    for (int64_t n = 0; n < rows; ++n) row[n] = scratch[n * depth_pairs + j];
    std::fill(row + rows, row + out_columns, 0u);
  }
}

// out (out_rows x out_columns bfloat16): x^T rounded, zero past x's
// columns and rows: A operand rows from x's columns. scratch holds rows *
// columns values.
void ToBfloat16Transposed(int64_t rows, int64_t columns, const float* x,
                          int64_t ld, int64_t out_rows, int64_t out_columns,
                          uint16_t* out, uint16_t* scratch) {
  ToBfloat16Rows(rows, columns, x, ld, rows, columns, scratch);
  // In blocks of 16 x 16 values, which stay in L1.
  for (int64_t n0 = 0; n0 < columns; n0 += 16)
    for (int64_t t0 = 0; t0 < rows; t0 += 16) {
      const int64_t n1 = std::min(columns, n0 + 16),
                    t1 = std::min(rows, t0 + 16);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t t = t0; t < t1; ++t)
          out[n * out_columns + t] = scratch[t * columns + n];
    }
  for (int64_t n = 0; n < out_rows; ++n) {
    uint16_t* row = out + n * out_columns;
    std::fill(row + (n < columns ? rows : 0), row + out_columns, uint16_t{0});
  }
}

// Scratch of one thread for the AMX passes, in 32-bit words.
uint32_t* AmxScratch(size_t words) {
  thread_local std::vector<uint32_t> scratch;
  if (scratch.size() < words) scratch.resize(words);
  return scratch.data();
}

inline int64_t RoundUpTo(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// The forward pass of one pair on AMX (see above). Query rows are padded
// to whole tiles of 16, head_dim and keys to whole depth steps of 32.
void ForwardPairAmx(const Shape& s, const float* q, const float* k,
                    const float* v, float* o, float* p) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  const int64_t tqt = RoundUpTo(tq, 16), dd = RoundUpTo(d, 32),
                tkd = RoundUpTo(tkp, 32);
  const int64_t qn = tqt * dd / 2, kn = dd / 2 * tkp, vn = tkd / 2 * d,
                pn = tqt * tkd / 2, rows = tk * dd / 2;
  uint32_t* qw = AmxScratch(qn + kn + vn + pn + rows + tqt * tkp + tqt * d);
  uint32_t* kw = qw + qn;
  uint32_t* vw = kw + kn;
  uint32_t* pw = vw + vn;
  uint32_t* krows = pw + pn;
  float* logits = reinterpret_cast<float*>(krows + rows);  // tqt x tkp
  float* out = logits + tqt * tkp;
  ToBfloat16Rows(tq, d, q, d, tqt, dd, reinterpret_cast<uint16_t*>(qw));
  PairColumns(tk, d, k, d, dd / 2, tkp, kw, krows);
  PairRows(tk, d, v, d, tkd / 2, vw);
  ConfigureTiles();
  TileProduct(tqt / 16, tkp / 16, dd, reinterpret_cast<uint16_t*>(qw), dd * 2,
              kw, tkp * 4, logits, tkp);
  Softmax(tq, tk, tkp, logits);
  if (p) std::memcpy(p, logits, tq * tkp * sizeof(float));
  ToBfloat16Rows(tq, tkp, logits, tkp, tqt, tkd,
                 reinterpret_cast<uint16_t*>(pw));
  TileProduct(tqt / 16, d / 16, tkd, reinterpret_cast<uint16_t*>(pw), tkd * 2,
              vw, d * 4, out, d);
  _tile_release();
  std::memcpy(o, out, tq * d * sizeof(float));
}

// The backward pass of one pair on AMX: BackwardPair's four products from
// bfloat16 operands (dO, V, K, Q, P and dS rounded), float32 sums and
// softmax gradient.
void BackwardPairAmx(const Shape& s, const float* q, const float* k,
                     const float* v, const float* p, const float* dout,
                     float* dq, float* dk, float* dv) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  const int64_t tqt = RoundUpTo(tq, 16), tqd = RoundUpTo(tq, 32),
                dd = RoundUpTo(d, 32), tkd = RoundUpTo(tkp, 32);
  // Operands (words): A (d x tqd or tqt x max(tkd, dd) bfloat16), B (pair
  // rows: tkd/2 of d, tqd/2 or dd/2 of tkp), the conversions' scratch;
  // results: dS (tqt x tkp floats) and one product (d x tkp or tqt x d).
  const int64_t an = std::max(d * tqd, tqt * std::max(tkd, dd)) / 2,
                bn = std::max(tkd / 2 * d, std::max(tqd, dd) / 2 * tkp),
                sn = std::max(tq * d / 2 + 1, tk * dd / 2);
  uint32_t* a = AmxScratch(an + bn + sn + tqt * tkp +
                           std::max(tkp, tqt) * d);
  uint32_t* b = a + an;
  uint32_t* scratch = b + bn;
  float* ds = reinterpret_cast<float*>(scratch + sn);
  float* product = ds + tqt * tkp;
  uint16_t* a16 = reinterpret_cast<uint16_t*>(a);
  ConfigureTiles();
  // dV = (dO^T P)^T: of the two operands contracted over their rows, the
  // narrower one (dO, not P) is the one transposed.
  ToBfloat16Transposed(tq, d, dout, d, d, tqd, a16,
                       reinterpret_cast<uint16_t*>(scratch));
  PairRows(tq, tkp, p, tkp, tqd / 2, b);
  TileProduct(d / 16, tkp / 16, tqd, a16, tqd * 2, b, tkp * 4, product, tkp);
  for (int64_t n = 0; n < tk; ++n)
    for (int64_t c = 0; c < d; ++c) dv[n * d + c] = product[c * tkp + n];
  // dP = dO V^T, then dS in its place
  ToBfloat16Rows(tq, d, dout, d, tqt, dd, a16);
  PairColumns(tk, d, v, d, dd / 2, tkp, b, scratch);
  TileProduct(tqt / 16, tkp / 16, dd, a16, dd * 2, b, tkp * 4, ds, tkp);
  SoftmaxGradient(tq, tkp, p, ds);
  // dQ = dS K
  ToBfloat16Rows(tq, tkp, ds, tkp, tqt, tkd, a16);
  PairRows(tk, d, k, d, tkd / 2, b);
  TileProduct(tqt / 16, d / 16, tkd, a16, tkd * 2, b, d * 4, product, d);
  std::memcpy(dq, product, tq * d * sizeof(float));
  // dK = (Q^T dS)^T, the same way round
  ToBfloat16Transposed(tq, d, q, d, d, tqd, a16,
                       reinterpret_cast<uint16_t*>(scratch));
  PairRows(tq, tkp, ds, tkp, tqd / 2, b);
  TileProduct(d / 16, tkp / 16, tqd, a16, tqd * 2, b, tkp * 4, product, tkp);
  for (int64_t n = 0; n < tk; ++n)
    for (int64_t c = 0; c < d; ++c) dk[n * d + c] = product[c * tkp + n];
  _tile_release();
}

void ForwardPairBf16(const Shape& s, const float* q, const float* k,
                     const float* v, float* o, float* p) {
  if (AmxGranted()) {
    ForwardPairAmx(s, q, k, v, o, p);
  } else {
    ForwardPairRounded(s, q, k, v, o, p);
  }
}

void BackwardPairBf16(const Shape& s, const float* q, const float* k,
                      const float* v, const float* p, const float* dout,
                      float* dq, float* dk, float* dv) {
  if (AmxGranted()) {
    BackwardPairAmx(s, q, k, v, p, dout, dq, dk, dv);
  } else {
    BackwardPairRounded(s, q, k, v, p, dout, dq, dk, dv);
  }
}
#else
void ForwardPairBf16(const Shape& s, const float* q, const float* k,
                     const float* v, float* o, float* p) {
  ForwardPairRounded(s, q, k, v, o, p);
}

void BackwardPairBf16(const Shape& s, const float* q, const float* k,
                      const float* v, const float* p, const float* dout,
                      float* dq, float* dk, float* dv) {
  BackwardPairRounded(s, q, k, v, p, dout, dq, dk, dv);
}
#endif

// Runs work(pair) for every pair, on the calling thread and up to
// num_threads - 1 of XLA's intra-op threads. Pairs are claimed from a shared
// counter, so a helper that starts late finds nothing and nobody waits on a
// task that never ran.
template <typename Work>
void ForEachPair(ffi::ThreadPool& pool, int64_t pairs, Work work) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto state = std::make_shared<State>();
  auto run = [state, pairs, work]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < pairs;) {
      work(i);
      if (state->done.fetch_add(1) + 1 == pairs) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->finished.notify_all();
      }
    }
  };
  const int64_t helpers =
      std::min<int64_t>(pool.num_threads(), pairs) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(run)(run));
  run();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->finished.wait(lock, [&] { return state->done.load() == pairs; });
}

ffi::Error ShapeOf(const ffi::Buffer<ffi::F32>& q,
                   const ffi::Buffer<ffi::F32>& k, Shape* shape) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[1] != kd[1] ||
      qd[3] != kd[3] || qd[3] % kPad != 0)
    return ffi::Error::InvalidArgument(
        "vit_jax attention kernel: q must be (B, H, Tq, D) and k, v "
        "(B, H, Tk, D) with D a multiple of 16");
  *shape = Shape{qd[0] * qd[1], qd[2], kd[2], RoundUp(kd[2]), qd[3]};
  return ffi::Error::Success();
}

// p is null for inference: the probabilities then stay in scratch.
ffi::Error Forward(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& q,
                   const ffi::Buffer<ffi::F32>& k,
                   const ffi::Buffer<ffi::F32>& v, float* o, float* p,
                   bool bfloat16 = false) {
  Shape s;
  if (ffi::Error error = ShapeOf(q, k, &s); error.failure()) return error;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  ForEachPair(pool, s.pairs, [=](int64_t i) {
    const int64_t qo = i * s.query_tokens * s.head_dim,
                  ko = i * s.key_tokens * s.head_dim;
    float* pi = p ? p + i * s.query_tokens * s.padded_keys : nullptr;
    if (bfloat16) {
      ForwardPairBf16(s, qp + qo, kp + ko, vp + ko, o + qo, pi);
    } else {
      ForwardPair(s, qp + qo, kp + ko, vp + ko, o + qo, pi);
    }
  });
  return ffi::Error::Success();
}

ffi::Error ForwardForTraining(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                              ffi::ResultBuffer<ffi::F32> o,
                              ffi::ResultBuffer<ffi::F32> p) {
  return Forward(pool, q, k, v, o->typed_data(), p->typed_data());
}

ffi::Error ForwardForInference(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::ResultBuffer<ffi::F32> o) {
  return Forward(pool, q, k, v, o->typed_data(), nullptr);
}

ffi::Error ForwardForTrainingBf16(ffi::ThreadPool pool,
                                  ffi::Buffer<ffi::F32> q,
                                  ffi::Buffer<ffi::F32> k,
                                  ffi::Buffer<ffi::F32> v,
                                  ffi::ResultBuffer<ffi::F32> o,
                                  ffi::ResultBuffer<ffi::F32> p) {
  return Forward(pool, q, k, v, o->typed_data(), p->typed_data(), true);
}

ffi::Error ForwardForInferenceBf16(ffi::ThreadPool pool,
                                   ffi::Buffer<ffi::F32> q,
                                   ffi::Buffer<ffi::F32> k,
                                   ffi::Buffer<ffi::F32> v,
                                   ffi::ResultBuffer<ffi::F32> o) {
  return Forward(pool, q, k, v, o->typed_data(), nullptr, true);
}

ffi::Error BackwardOf(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q,
                      ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                      ffi::Buffer<ffi::F32>& p, ffi::Buffer<ffi::F32>& dout,
                      ffi::ResultBuffer<ffi::F32>& dq,
                      ffi::ResultBuffer<ffi::F32>& dk,
                      ffi::ResultBuffer<ffi::F32>& dv, bool bfloat16) {
  Shape s;
  if (ffi::Error error = ShapeOf(q, k, &s); error.failure()) return error;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(),
              *pp = p.typed_data(), *gp = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(),
        *dvp = dv->typed_data();
  ForEachPair(pool, s.pairs, [=](int64_t i) {
    const int64_t qo = i * s.query_tokens * s.head_dim,
                  ko = i * s.key_tokens * s.head_dim,
                  po = i * s.query_tokens * s.padded_keys;
    (bfloat16 ? BackwardPairBf16 : BackwardPair)(
        s, qp + qo, kp + ko, vp + ko, pp + po, gp + qo, dqp + qo, dkp + ko,
        dvp + ko);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                    ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> dout,
                    ffi::ResultBuffer<ffi::F32> dq,
                    ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv) {
  return BackwardOf(pool, q, k, v, p, dout, dq, dk, dv, false);
}

ffi::Error BackwardBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                        ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                        ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> dout,
                        ffi::ResultBuffer<ffi::F32> dq,
                        ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv) {
  return BackwardOf(pool, q, k, v, p, dout, dq, dk, dv, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitAttentionForwardForTraining,
                              ForwardForTraining,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitAttentionForwardForInference,
                              ForwardForInference,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitAttentionForwardForTrainingBf16,
                              ForwardForTrainingBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitAttentionForwardForInferenceBf16,
                              ForwardForInferenceBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitAttentionBackwardBf16, BackwardBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
