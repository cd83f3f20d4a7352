// Tile products of bfloat16 operands and the packing they take, for
// attention_bf16_cpu.cc (included there only where the compiler targets a
// CPU with AVX512_BF16). Two engines take the same packed operands: AMX's
// tiles (TileProduct, where the CPU has AMX-BF16) and AVX512_BF16's dot
// instruction on register tiles (DotTileProduct). A product's A operand is
// rows of bfloat16 values, its B operand rows of 32-bit words that each
// pair two depth steps (AMX's layout, and the pairs vdpbf16ps takes), its
// sums float32, in blocks of 16 x 16.

#ifndef VIT_JAX_KERNELS_CSRC_BF16_TILES_H_
#define VIT_JAX_KERNELS_CSRC_BF16_TILES_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector_transpose.h"

namespace {

inline int64_t RoundUpTo(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
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
// two columns of x (x^T as a product's right side). columns is a multiple
// of 16, depth_pairs too; out_columns of 16 at least rows rounded up to
// 16. In blocks of 16 rows by 16 pairs: each row's 32 values rounded into
// 16 words, the block's words transposed through registers.
void PairColumns(int64_t rows, int64_t columns, const float* x, int64_t ld,
                 int64_t depth_pairs, int64_t out_columns, uint32_t* out) {
  const int64_t whole = RoundUpTo(rows, 16);
  for (int64_t n0 = 0; n0 < rows; n0 += 16)
    for (int64_t j0 = 0; j0 < depth_pairs; j0 += 16) {
      const int64_t c = 2 * j0;  // the block's first column of x
      Vec block[16];
      for (int i = 0; i < 16; ++i) {
        const float* row = x + (n0 + i) * ld + c;
        const bool inside = n0 + i < rows && c < columns;
        const __m512 low = inside ? _mm512_loadu_ps(row) : _mm512_setzero_ps(),
                     high = inside && c + 16 < columns
                                ? _mm512_loadu_ps(row + 16)
                                : _mm512_setzero_ps();
        block[i] = (Vec)_mm512_cvtne2ps_pbh(high, low);  // 32 values in order
      }
      TransposeLanes(block);
      for (int i = 0; i < 16; ++i)
        Store(reinterpret_cast<float*>(out + (j0 + i) * out_columns + n0),
              block[i]);
    }
  for (int64_t j = 0; j < depth_pairs; ++j)
    std::fill(out + j * out_columns + whole, out + (j + 1) * out_columns, 0u);
}

// out (out_rows x out_columns bfloat16): x^T rounded, zero past x's
// columns and rows: A operand rows from x's columns. columns is a multiple
// of 16, out_columns of 16 at least rows rounded up to 16. In blocks of 16
// x 16 floats transposed through registers, each column rounded whole.
void ToBfloat16Transposed(int64_t rows, int64_t columns, const float* x,
                          int64_t ld, int64_t out_rows, int64_t out_columns,
                          uint16_t* out) {
  const int64_t whole = RoundUpTo(rows, 16);
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < columns; c0 += 16) {
      Vec block[16];
      LoadTransposed(rows, x, ld, r0, c0, block);
      for (int j = 0; j < 16; ++j)
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(out + (c0 + j) * out_columns + r0),
            (__m256i)_mm512_cvtneps_pbh((__m512)block[j]));
    }
  for (int64_t n = 0; n < out_rows; ++n) {
    uint16_t* row = out + n * out_columns;
    std::fill(row + (n < columns ? whole : 0), row + out_columns,
              uint16_t{0});
  }
}

// Writes a row of softmax probabilities (Softmax's normalize, from its
// exps and their sum's inverse) twice: float32 into p's row, if p is
// given, and rounded into the bfloat16 row of `rounded` that the next
// product reads; the padding past `width` zero in both. One pass, where
// the probabilities normalized in place, copied to p and then rounded took
// three. p's rows go by non-temporal stores where they are 64-byte aligned
// (XLA aligns its buffers so, and the rows are whole cache lines): p is
// read again only in the backward pass, and a plain store would first
// read each line of it from memory. The forward pass of a pair of 197
// tokens, writing a new p each time, took 40 us that way on a Zen 5 core,
// 49 us with plain stores, and 45 us with the normalize, copy and rounding
// as three passes. The caller fences (_mm_sfence) before p is read.
struct NormalizeToBfloat16 {
  int64_t width, padded;  // p's rows: `padded` floats
  int64_t rounded_columns;  // rounded's rows: values, at least padded
  float* p;
  uint16_t* rounded;
  void operator()(int64_t row, const float* exps, Vec inverse) const {
    float* p_row = p ? p + row * padded : nullptr;
    uint16_t* out = rounded + row * rounded_columns;
    const bool stream =
        p_row != nullptr && reinterpret_cast<uintptr_t>(p_row) % 64 == 0;
    for (int64_t j = 0; j < padded; j += 16) {
      __m512 y = (__m512)(Load(exps + j) * inverse);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                          (__m256i)_mm512_cvtneps_pbh(y));
      if (j + 16 > width)  // zero the padding
        y = _mm512_maskz_mov_ps(
            static_cast<__mmask16>((1u << std::max<int64_t>(width - j, 0)) -
                                   1),
            y);
      if (stream) {
        _mm512_stream_ps(p_row + j, y);
      } else if (p_row != nullptr) {
        _mm512_storeu_ps(p_row + j, y);
      }
    }
    std::fill(out + width, out + rounded_columns, uint16_t{0});
  }
};

// dS = scale * P * (dP - rowsum(P * dP)) (SoftmaxGradient's values, P and
// dP rows of `padded` floats) rounded, written as the two operands that
// read it: rows (tq x row_columns values, zero past padded; the caller
// zeroes rows past tq) and pairs of rows (word (j, c) the pair (dS[2j, c],
// dS[2j+1, c]), zero past the rows). One pass, where dS written in place
// and then rounded twice took three (the backward pass ~4% faster on a
// Zen 5 core).
void SoftmaxGradientToBfloat16(int64_t rows, int64_t padded, float scale,
                               const float* p, const float* dp,
                               int64_t row_columns, uint16_t* ds_rows,
                               uint32_t* ds_pairs) {
  auto row_dot = [&](int64_t i) {
    Vec dot{};
    for (int64_t j = 0; j < padded; j += 16)
      dot += Load(p + i * padded + j) * Load(dp + i * padded + j);
    return Splat(SumOfLanes(dot));
  };
  auto gradient = [&](int64_t i, Vec dot, int64_t j) {
    return _mm512_cvtneps_pbh((__m512)(Load(p + i * padded + j) *
                                       (Load(dp + i * padded + j) - dot) *
                                       scale));
  };
  for (int64_t i = 0; i < rows; i += 2) {
    const bool has_second = i + 1 < rows;  // the pair's second row
    const Vec first_dot = row_dot(i),
              second_dot = has_second ? row_dot(i + 1) : Vec{};
    uint16_t* first_row = ds_rows + i * row_columns;
    for (int64_t j = 0; j < padded; j += 16) {
      const __m256i first = (__m256i)gradient(i, first_dot, j),
                    second = has_second
                                 ? (__m256i)gradient(i + 1, second_dot, j)
                                 : _mm256_setzero_si256();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(first_row + j), first);
      if (has_second)
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(first_row + row_columns + j), second);
      _mm512_storeu_si512(
          ds_pairs + i / 2 * padded + j,
          _mm512_or_si512(_mm512_cvtepu16_epi32(first),
                          _mm512_slli_epi32(_mm512_cvtepu16_epi32(second),
                                            16)));
    }
    for (int64_t r = i; r < std::min(i + 2, rows); ++r)
      std::fill(ds_rows + r * row_columns + padded,
                ds_rows + (r + 1) * row_columns, uint16_t{0});
  }
}

// DotTileProduct's register tile: 8 rows of C by kVectors vectors of 16
// columns, summed over depth_pairs pairs of depth steps. Each step
// broadcasts a row's pair of A values and takes one dot of it with each of
// B's vectors of pairs.
template <int kVectors>
inline void DotTile(int64_t depth_pairs, const char* a, int64_t a_stride,
                    const uint32_t* b, int64_t b_words, float* c,
                    int64_t ldc) {
  constexpr int kRows = 8;
  __m512 sums[kRows][kVectors];
  for (auto& row : sums)
    for (__m512& sum : row) sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < depth_pairs; ++j) {
    __m512bh pairs[kVectors];
    for (int v = 0; v < kVectors; ++v)
      pairs[v] = (__m512bh)_mm512_loadu_si512(b + j * b_words + 16 * v);
    for (int r = 0; r < kRows; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * a_stride + 4 * j, 4);
      const __m512bh row = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVectors; ++v)
        sums[r][v] = _mm512_dpbf16_ps(sums[r][v], row, pairs[v]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVectors; ++v)
      _mm512_storeu_ps(c + r * ldc + 16 * v, sums[r][v]);
}

// C (16 m_blocks x 16 n_blocks floats, leading dimension ldc) = A B: A
// rows of depth bfloat16 values (a_stride bytes apart), B rows of pairs
// (b_stride bytes apart), depth even: TileProduct's product (below) with
// AVX512_BF16's dot instruction (vdpbf16ps) in place of AMX. Why: a Zen 4
// core does twice float32's multiply-adds with it (221 against 112
// GFLOP/s, each in a loop of independent sums; docs/performance.md).
void DotTileProduct(int64_t m_blocks, int64_t n_blocks, int64_t depth,
                    const uint16_t* a, int64_t a_stride, const uint32_t* b,
                    int64_t b_stride, float* c, int64_t ldc) {
  const char* a_bytes = reinterpret_cast<const char*>(a);
  const int64_t pairs = depth / 2, b_words = b_stride / 4;
  for (int64_t row = 0; row < 16 * m_blocks; row += 8) {
    const char* a_rows = a_bytes + row * a_stride;
    float* c_rows = c + row * ldc;
    int64_t n = 0;
    for (; n + 3 <= n_blocks; n += 3)
      DotTile<3>(pairs, a_rows, a_stride, b + 16 * n, b_words,
                 c_rows + 16 * n, ldc);
    if (n_blocks - n == 2) {
      DotTile<2>(pairs, a_rows, a_stride, b + 16 * n, b_words,
                 c_rows + 16 * n, ldc);
    } else if (n_blocks - n == 1) {
      DotTile<1>(pairs, a_rows, a_stride, b + 16 * n, b_words,
                 c_rows + 16 * n, ldc);
    }
  }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

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

// The tile configuration while a pair runs; the thread's own one comes back
// after (a library on the same thread may keep its tiles configured between
// its calls: YNNPACK runs XLA's bfloat16 dots on AMX). Every tile is 16 rows
// of 64 bytes: an accumulator of 16 x 16 floats, an A operand of 16 rows of
// 32 bfloat16 values, a B operand of 16 rows of 16 pairs (two depth steps
// per 32-bit word).
class ScopedTiles {
 public:
  ScopedTiles() {
    _tile_storeconfig(&previous_);
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.bytes_per_row[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
  }
  ~ScopedTiles() {
    if (previous_.palette != 0) {
      _tile_loadconfig(&previous_);
    } else {
      _tile_release();
    }
  }
  ScopedTiles(const ScopedTiles&) = delete;
  ScopedTiles& operator=(const ScopedTiles&) = delete;

 private:
  TileConfig previous_;
};

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

#endif  // AMX

// Scratch of one thread for the tiled passes, in 32-bit words.
uint32_t* TileScratch(size_t words) {
  thread_local std::vector<uint32_t> scratch;
  if (scratch.size() < words) scratch.resize(words);
  return scratch.data();
}

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_BF16_TILES_H_
