// x (G, M, K) float32 -> x^T (G, K, M) bfloat16, as an XLA FFI handler.
// Built beside the attention kernel (vit_jax/kernels/cpu_build.py); used by
// vit_jax/kernels/cpu_transpose.py, which says why.
//
// Rounding is to nearest, ties to even, as XLA's convert from f32 to bf16;
// a NaN stays a (quiet) NaN. The transpose runs in 16 x 16 blocks, so both
// the reads and the writes touch a few cache lines at a time.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 16;

// Branch-free, so that the loop over a block's row vectorises.
inline uint16_t RoundToBfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;  // a NaN stays one
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan
                                                                  : rounded);
}

// out (columns x rows) = in (rows x columns)^T, rounded to bfloat16. Each
// block's rows are read whole and rounded into a small buffer, which is
// then written out by columns.
void TransposeMatrix(int64_t rows, int64_t columns, const float* in,
                     uint16_t* out) {
  uint16_t block[kBlock][kBlock];
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t height = std::min(kBlock, rows - r0);
    for (int64_t c0 = 0; c0 < columns; c0 += kBlock) {
      const int64_t width = std::min(kBlock, columns - c0);
      for (int64_t r = 0; r < height; ++r) {
        const float* row = in + (r0 + r) * columns + c0;
        for (int64_t c = 0; c < width; ++c) block[r][c] = RoundToBfloat16(row[c]);
      }
      for (int64_t c = 0; c < width; ++c) {
        uint16_t* column = out + (c0 + c) * rows + r0;
        for (int64_t r = 0; r < height; ++r) column[r] = block[r][c];
      }
    }
  }
}

ffi::Error TransposeToBfloat16(ffi::Buffer<ffi::F32> x,
                               ffi::ResultBuffer<ffi::BF16> out) {
  const auto dims = x.dimensions();
  if (dims.size() != 3) {
    return ffi::Error::InvalidArgument(
        "VitTransposeToBfloat16 takes a (G, M, K) array");
  }
  const int64_t groups = dims[0], rows = dims[1], columns = dims[2];
  const float* in = x.typed_data();
  // ffi::BF16's native type is a 16-bit value: write its bits.
  uint16_t* result = reinterpret_cast<uint16_t*>(out->typed_data());
  for (int64_t g = 0; g < groups; ++g)
    TransposeMatrix(rows, columns, in + g * rows * columns,
                    result + g * rows * columns);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitTransposeToBfloat16, TransposeToBfloat16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
