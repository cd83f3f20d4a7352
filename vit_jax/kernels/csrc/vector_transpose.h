// Transposes through registers: a block of kLanes x kLanes floats (or
// 32-bit words) as kLanes Vecs (vectors.h), and matrices in such blocks.
// What the attention kernels' transposed operands are made with: one value
// at a time, the keys' transpose of one pair (197 x 64 floats) took 4.8 us
// of a 57 us forward pass on a Zen 5 core, and 0.5 us this way.
// Internal to the kernels' sources (its definitions are in an unnamed
// namespace).

#ifndef VIT_JAX_KERNELS_CSRC_VECTOR_TRANSPOSE_H_
#define VIT_JAX_KERNELS_CSRC_VECTOR_TRANSPOSE_H_

#include <algorithm>
#include <cstdint>

#include "vectors.h"

namespace {

// r[0..kLanes-1], the rows of a kLanes x kLanes block, transposed in
// place: r[j] becomes the block's column j.
inline void TransposeLanes(Vec r[kLanes]) {
#if defined(__AVX512F__)
  // Within 128-bit lanes, then across them: rows interleaved by single
  // values, then by pairs, then lanes of four gathered from four groups of
  // rows.
  __m512 t[16], u[16];
  for (int i = 0; i < 16; ++i) u[i] = (__m512)r[i];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(u[i], u[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(u[i], u[i + 1]);
  }
  // u[4g + m], lane L: column 4L + m of rows 4g .. 4g + 3.
  for (int i = 0; i < 16; i += 4)
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[i + h]),
                    b = _mm512_castps_pd(t[i + h + 2]);
      u[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int m = 0; m < 4; ++m)
    for (int g = 0; g < 16; g += 8) {
      t[m + g] = _mm512_shuffle_f32x4(u[m + g], u[m + g + 4], 0x88);
      t[m + g + 4] = _mm512_shuffle_f32x4(u[m + g], u[m + g + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = (Vec)_mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = (Vec)_mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
#elif defined(__AVX2__)
  // Pairs of rows interleaved, then their 64-bit halves, then the 128-bit
  // lanes of rows i and i + 4 exchanged.
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps((__m256)r[i], (__m256)r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps((__m256)r[i], (__m256)r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      u[i + 2 * h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0x44);
      u[i + 2 * h + 1] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0xee);
    }
  for (int i = 0; i < 4; ++i) {
    r[i] = (Vec)_mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = (Vec)_mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
#else
  for (int i = 0; i < kLanes; ++i)
    for (int j = i + 1; j < kLanes; ++j) {
      const float value = r[i][j];
      r[i][j] = r[j][i];
      r[j][i] = value;
    }
#endif
}

// x's rows [r0, r0 + kLanes) at columns [c0, c0 + kLanes) as a block of
// Vecs, transposed: block[j] holds column c0 + j of those rows, zero for
// rows at or past `rows`.
inline void LoadTransposed(int64_t rows, const float* x, int64_t ld,
                           int64_t r0, int64_t c0, Vec block[kLanes]) {
  for (int i = 0; i < kLanes; ++i)
    block[i] = r0 + i < rows ? Load(x + (r0 + i) * ld + c0) : Vec{};
  TransposeLanes(block);
}

// x^T: x (rows x columns, leading dimension ld; columns a multiple of
// kLanes) -> out (columns x padded_rows), padded_rows >= rows rounded up
// to kLanes, the padding zero.
void Transpose(int64_t rows, int64_t columns, const float* x, int64_t ld,
               int64_t padded_rows, float* out) {
  const int64_t whole = (rows + kLanes - 1) / kLanes * kLanes;
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes)
    for (int64_t c0 = 0; c0 < columns; c0 += kLanes) {
      Vec block[kLanes];
      LoadTransposed(rows, x, ld, r0, c0, block);
      for (int j = 0; j < kLanes; ++j)
        Store(out + (c0 + j) * padded_rows + r0, block[j]);
    }
  for (int64_t c = 0; c < columns; ++c)
    std::fill(out + c * padded_rows + whole, out + (c + 1) * padded_rows,
              0.0f);
}

// out's first `columns` rows (leading dimension ldo) = x^T, x (rows x
// columns, leading dimension ldx); rows a multiple of kLanes, x's rows
// readable up to a multiple of kLanes columns. The backward pass's dV and
// dK, computed transposed, were stored one value at a time, ~10% of the
// pass.
void StoreTransposed(int64_t rows, int64_t columns, const float* x,
                     int64_t ldx, float* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes)
    for (int64_t c0 = 0; c0 < columns; c0 += kLanes) {
      Vec block[kLanes];
      LoadTransposed(rows, x, ldx, r0, c0, block);
      const int64_t n = std::min<int64_t>(kLanes, columns - c0);
      for (int64_t j = 0; j < n; ++j)
        Store(out + (c0 + j) * ldo + r0, block[j]);
    }
}

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_VECTOR_TRANSPOSE_H_
