// x (G, M, K) float32 -> x^T (G, K, M) bfloat16, as an XLA FFI handler.
// Built beside the attention kernel (vit_jax/kernels/cpu_build.py); used by
// vit_jax/kernels/cpu_transpose.py, which says why.
//
// Rounding is to nearest, ties to even, as XLA's convert from f32 to bf16;
// a NaN stays a (quiet) NaN.

#include <cstdint>
#include <cstring>

#include "vectors.h"  // RoundToBfloat16
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// out (columns x rows) = in (rows x columns)^T, rounded to bfloat16.
//
// Rows go in pairs: out's 32-bit word (c, p) holds rows 2p and 2p+1 of
// column c, so a block of 2 * kPairs rows by kColumns columns is a
// kPairs x kColumns transpose of words: half the scattered stores of a
// transpose of 16-bit values (2.4x faster at 3152 x 192 on one core).
// The block's rows are read whole and rounded as vectors. Columns and rows
// that make no whole block (odd row counts included) go one at a time.
constexpr int kPairs = 16, kColumns = 16;
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "a word's low half is the even row's value");

void TransposeMatrix(int64_t rows, int64_t columns, const uint32_t* in,
                     uint16_t* out) {
  const int64_t block_rows = rows % 2 ? 0 : rows / (2 * kPairs) * 2 * kPairs;
  const int64_t block_columns = columns / kColumns * kColumns;
  for (int64_t r0 = 0; r0 < block_rows; r0 += 2 * kPairs) {
    for (int64_t c0 = 0; c0 < block_columns; c0 += kColumns) {
      uint32_t words[kPairs][kColumns];
      for (int p = 0; p < kPairs; ++p) {
        const uint32_t* even = in + (r0 + 2 * p) * columns + c0;
        const uint32_t* odd = even + columns;
        for (int c = 0; c < kColumns; ++c)
          words[p][c] = RoundToBfloat16(even[c]) |
                        (RoundToBfloat16(odd[c]) << 16);
      }
      for (int c = 0; c < kColumns; ++c) {
        uint16_t* column = out + (c0 + c) * rows + r0;
        for (int p = 0; p < kPairs; ++p)
          std::memcpy(column + 2 * p, &words[p][c], sizeof(uint32_t));
      }
    }
  }
  auto one = [&](int64_t r, int64_t c) {
    out[c * rows + r] =
        static_cast<uint16_t>(RoundToBfloat16(in[r * columns + c]));
  };
  for (int64_t r = 0; r < block_rows; ++r)  // the columns right of the blocks
    for (int64_t c = block_columns; c < columns; ++c) one(r, c);
  for (int64_t r = block_rows; r < rows; ++r)  // the rows below them
    for (int64_t c = 0; c < columns; ++c) one(r, c);
}

ffi::Error TransposeToBfloat16(ffi::Buffer<ffi::F32> x,
                               ffi::ResultBuffer<ffi::BF16> out) {
  const auto dims = x.dimensions();
  if (dims.size() != 3) {
    return ffi::Error::InvalidArgument(
        "VitTransposeToBfloat16 takes a (G, M, K) array");
  }
  const int64_t groups = dims[0], rows = dims[1], columns = dims[2];
  // The floats' bits: rounding works on them.
  const uint32_t* in = reinterpret_cast<const uint32_t*>(x.typed_data());
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
