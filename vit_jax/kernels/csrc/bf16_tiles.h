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

namespace {

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

// r[0..15], the rows of a 16 x 16 block, transposed in place: r[j] becomes
// the block's column j. Within 128-bit lanes, then across them: rows
// interleaved by single values, then by pairs, then lanes of four
// gathered from four groups of rows.
inline void Transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[4g + m], lane L: column 4L + m of rows 4g .. 4g + 3.
  for (int i = 0; i < 16; i += 4)
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[i + h]),
                    b = _mm512_castps_pd(t[i + h + 2]);
      r[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int m = 0; m < 4; ++m)
    for (int g = 0; g < 16; g += 8) {
      t[m + g] = _mm512_shuffle_f32x4(r[m + g], r[m + g + 4], 0x88);
      t[m + g + 4] = _mm512_shuffle_f32x4(r[m + g], r[m + g + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// out (columns x rows, leading dimension ldo) = x^T, x (rows x columns,
// leading dimension ldx); rows a multiple of 16, x's rows readable up to a
// multiple of 16 columns. In 16 x 16 blocks through registers: the
// backward pass's dV and dK, computed transposed, were stored one value at
// a time, ~10% of the pass.
void StoreTransposed(int64_t rows, int64_t columns, const float* x,
                     int64_t ldx, float* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < columns; c0 += 16) {
      __m512 block[16];
      for (int i = 0; i < 16; ++i)
        block[i] = _mm512_loadu_ps(x + (r0 + i) * ldx + c0);
      Transpose16x16(block);
      const int64_t n = std::min<int64_t>(16, columns - c0);
      for (int64_t j = 0; j < n; ++j)
        _mm512_storeu_ps(out + (c0 + j) * ldo + r0, block[j]);
    }
}

// Scratch of one thread for the tiled passes, in 32-bit words.
uint32_t* TileScratch(size_t words) {
  thread_local std::vector<uint32_t> scratch;
  if (scratch.size() < words) scratch.resize(words);
  return scratch.data();
}

inline int64_t RoundUpTo(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_BF16_TILES_H_
