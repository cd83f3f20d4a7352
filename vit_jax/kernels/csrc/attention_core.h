// What the attention kernels (attention_cpu.cc in float32,
// attention_bf16_cpu.cc with bfloat16 operands) share for one pair: the
// register-tiled float32 products, the softmax and its gradient, the pairs'
// shape. Internal to those files (its definitions are in an unnamed
// namespace); attention_handlers.h runs pairs as XLA FFI handlers.

#ifndef VIT_JAX_KERNELS_CSRC_ATTENTION_CORE_H_
#define VIT_JAX_KERNELS_CSRC_ATTENTION_CORE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector_transpose.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows of probabilities and head_dim are multiples of kPad floats (the
// Python side's LANES), which a Vec (vectors.h) divides. Tiles of
// kMaxRows x kMaxVectors accumulators leave a register for each of the
// VECTORS loads of B and one for A's broadcast.
constexpr int kPad = 16;
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kMaxRows = 6, kMaxVectors = 4;  // 24 of 32 registers
#else
constexpr int kMaxRows = 6, kMaxVectors = 2;  // 12 of 16 registers
#endif
static_assert(kPad % kLanes == 0, "a row of kPad floats is whole vectors");

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
  // The rows left (fewer than kMaxRows) as one tile: row by row, each
  // multiply-add would wait on a load of its own (197 tokens leave 5).
  static_assert(kMaxRows == 6, "a case for each remainder");
  a += r * a_row;
  c += r * ldc;
  switch (rows - r) {
    case 5: Tile<5, VECTORS>(depth, a, a_row, a_k, b, ldb, c, ldc); break;
    case 4: Tile<4, VECTORS>(depth, a, a_row, a_k, b, ldb, c, ldc); break;
    case 3: Tile<3, VECTORS>(depth, a, a_row, a_k, b, ldb, c, ldc); break;
    case 2: Tile<2, VECTORS>(depth, a, a_row, a_k, b, ldb, c, ldc); break;
    case 1: Tile<1, VECTORS>(depth, a, a_row, a_k, b, ldb, c, ldc); break;
    default: break;
  }
}

// C (rows x columns, columns a multiple of kPad) = A B, A(r, k) as in Tile,
// B (depth x columns) row major with leading dimension ldb.
void Product(int64_t rows, int64_t columns, int64_t depth, const float* a,
             int64_t a_row, int64_t a_k, const float* b, int64_t ldb, float* c,
             int64_t ldc) {
  int64_t vectors = columns / kLanes;
  int64_t column = 0;
  // As few tiles across as kMaxVectors allows, their widths as even as can
  // be: 13 vectors (208 keys) as 3 + 3 + 3 + 4, not 4 + 4 + 4 + 1, whose
  // last tile would load a broadcast for every multiply-add.
  while (vectors > 0) {
    const int64_t tiles = (vectors + kMaxVectors - 1) / kMaxVectors;
    const int64_t width = vectors / tiles;
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

// Writes a row of softmax probabilities in place: its exps (`padded`
// floats, the padding past `width` included) times the inverse of their
// sum, the padding zero.
struct NormalizeInPlace {
  int64_t width, padded;
  void operator()(int64_t /*row*/, float* exps, Vec inverse) const {
    for (int64_t j = 0; j < padded; j += kLanes)
      Store(exps + j, Load(exps + j) * inverse);
    std::fill(exps + width, exps + padded, 0.0f);
  }
};

// ROWS rows of logits (padded width, rows `padded` floats apart, the
// first row `row`) -> their exps, shifted by each row's maximum, in place,
// then normalize(row + r, exps of row r, 1 / their sum) for each.
template <int ROWS, typename Normalize>
inline void SoftmaxRows(int64_t row, int64_t width, int64_t padded,
                        float scale, float* x, const Normalize& normalize) {
  Vec vmax[ROWS], shift[ROWS], vsum[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    std::fill(x + r * padded + width, x + (r + 1) * padded, -INFINITY);
    vmax[r] = Load(x + r * padded);
  }
  for (int64_t j = kLanes; j < padded; j += kLanes)
    for (int r = 0; r < ROWS; ++r) {
      const Vec xj = Load(x + r * padded + j);
      vmax[r] = xj > vmax[r] ? xj : vmax[r];
    }
  for (int r = 0; r < ROWS; ++r) {
    shift[r] = Splat(MaxOfLanes(vmax[r]) * scale);
    vsum[r] = Vec{};
  }
  for (int64_t j = 0; j < padded; j += kLanes)
    for (int r = 0; r < ROWS; ++r) {
      const Vec e = Exp(Load(x + r * padded + j) * scale - shift[r]);
      Store(x + r * padded + j, e);
      vsum[r] += e;
    }
  for (int r = 0; r < ROWS; ++r)
    normalize(row + r, x + r * padded, Splat(1.0f / SumOfLanes(vsum[r])));
}

// Rows of logits (padded width) -> softmax(scale * logits), scale > 0, as
// `normalize` writes each row from its exps and their sum's inverse
// (SoftmaxRows). Two rows at a time: a row's maximum, its sum and their
// reductions are chains of dependent instructions, which the other row's
// work fills (31 against 48 us at 197 x 208 on an Intel Xeon core).
template <typename Normalize>
void Softmax(int64_t rows, int64_t width, int64_t padded, float scale,
             float* x, const Normalize& normalize) {
  int64_t i = 0;
  for (; i + 2 <= rows; i += 2)
    SoftmaxRows<2>(i, width, padded, scale, x + i * padded, normalize);
  if (i < rows)
    SoftmaxRows<1>(i, width, padded, scale, x + i * padded, normalize);
}

// The same in place, the padding 0.
void Softmax(int64_t rows, int64_t width, int64_t padded, float scale,
             float* x) {
  Softmax(rows, width, padded, scale, x, NormalizeInPlace{width, padded});
}

// dS = scale * P * (dP - rowsum(P * dP)) in place of dP: the gradient of
// the unscaled logits of Softmax.
void SoftmaxGradient(int64_t rows, int64_t padded, float scale, const float* p,
                     float* dp) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* pi = p + i * padded;
    float* gi = dp + i * padded;
    Vec vdot{};
    for (int64_t j = 0; j < padded; j += kLanes)
      vdot += Load(pi + j) * Load(gi + j);
    const float dot = SumOfLanes(vdot);
    for (int64_t j = 0; j < padded; j += kLanes)
      Store(gi + j, Load(pi + j) * (Load(gi + j) - dot) * scale);
  }
}

// One call's pairs and where each pair's rows lie. A pair (batch b, head
// h) reads its q, k and v as contiguous rows of head_dim floats (copied
// out of the projections, attention_handlers.h) and writes its output and
// gradients into token-major arrays, at column h * head_dim, one token's
// row q_row (the queries' gradient), kv_row (the keys' and values') or
// o_row (the output, and its gradient, which it reads) floats after the
// last. The probabilities are (B, H, Tq, padded_keys), contiguous per pair.
struct Shape {
  int64_t batch, heads, query_tokens, key_tokens, padded_keys, head_dim;
  int64_t q_row, kv_row, o_row;
  float scale;  // of the logits q k^T
  // The threads a call's pairs run on: this device's cores (with a device
  // per core, 1: another thread would take another device's core).
  int64_t threads;
};

// Scratch of one thread, reused across calls.
std::vector<float>& Scratch(size_t size) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < size) scratch.resize(size);
  return scratch;
}

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_ATTENTION_CORE_H_
