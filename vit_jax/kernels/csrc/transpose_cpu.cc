// x (G, M, K) float32 -> x^T (G, K, M), float32 or rounded to bfloat16, as
// XLA FFI handlers. Built beside the attention kernel
// (vit_jax/kernels/cpu_build.py); used by vit_jax/kernels/cpu_transpose.py,
// which says why.
//
// Rounding to bfloat16 is to nearest, ties to even, as XLA's convert from
// f32 to bf16; a NaN stays a (quiet) NaN.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Branch-free, so that the loop over a block's row vectorises: the bfloat16
// bits of a float's bits, in the low 16 bits of the result.
inline uint32_t RoundToBfloat16(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;  // a NaN stays one
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

// The result is written in 32-bit words: a float, or (kRowsPerWord = 2) two
// rows' bfloat16 values, so that a block of kWords * kRowsPerWord rows by
// kColumns columns is a kWords x kColumns transpose of words. For bfloat16
// that halves the scattered stores of a 16-bit transpose (2.4x faster at
// 3152 x 192 on one core). The block's rows are read whole (and rounded as
// vectors). Columns and rows that make no whole block (odd row counts, for
// bfloat16) go one value at a time.
constexpr int kWords = 16, kColumns = 16;
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "a word's low half is the even row's bfloat16 value");

template <int kRowsPerWord>
inline uint32_t Word(const uint32_t* value, int64_t columns) {
  if constexpr (kRowsPerWord == 1) {
    return *value;
  } else {
    return RoundToBfloat16(value[0]) | (RoundToBfloat16(value[columns]) << 16);
  }
}

// out (columns x rows) = in (rows x columns)^T: float32 bits
// (kRowsPerWord 1) or bfloat16 ones (2).
template <int kRowsPerWord>
void TransposeMatrix(int64_t rows, int64_t columns, const uint32_t* in,
                     void* out) {
  constexpr int64_t kValueBytes = 4 / kRowsPerWord, kBlockRows =
      kWords * kRowsPerWord;
  char* bytes = static_cast<char*>(out);
  const int64_t block_rows =
      rows % kRowsPerWord ? 0 : rows / kBlockRows * kBlockRows;
  const int64_t block_columns = columns / kColumns * kColumns;
  for (int64_t r0 = 0; r0 < block_rows; r0 += kBlockRows) {
    for (int64_t c0 = 0; c0 < block_columns; c0 += kColumns) {
      uint32_t words[kWords][kColumns];
      for (int w = 0; w < kWords; ++w) {
        const uint32_t* row = in + (r0 + kRowsPerWord * w) * columns + c0;
        for (int c = 0; c < kColumns; ++c)
          words[w][c] = Word<kRowsPerWord>(row + c, columns);
      }
      for (int c = 0; c < kColumns; ++c) {
        char* column = bytes + ((c0 + c) * rows + r0) * kValueBytes;
        for (int w = 0; w < kWords; ++w)
          std::memcpy(column + 4 * w, &words[w][c], 4);
      }
    }
  }
  auto one = [&](int64_t r, int64_t c) {
    const uint32_t value = kRowsPerWord == 1
                               ? in[r * columns + c]
                               : RoundToBfloat16(in[r * columns + c]);
    std::memcpy(bytes + (c * rows + r) * kValueBytes, &value, kValueBytes);
  };
  for (int64_t r = 0; r < block_rows; ++r)  // the columns right of the blocks
    for (int64_t c = block_columns; c < columns; ++c) one(r, c);
  for (int64_t r = block_rows; r < rows; ++r)  // the rows below them
    for (int64_t c = 0; c < columns; ++c) one(r, c);
}

template <int kRowsPerWord, typename Result>
ffi::Error Transpose(ffi::Buffer<ffi::F32> x, Result out) {
  const auto dims = x.dimensions();
  if (dims.size() != 3) {
    return ffi::Error::InvalidArgument(
        "the transpose kernels take a (G, M, K) array");
  }
  const int64_t groups = dims[0], rows = dims[1], columns = dims[2];
  // The floats' bits: rounding works on them.
  const uint32_t* in = reinterpret_cast<const uint32_t*>(x.typed_data());
  char* result = static_cast<char*>(out->untyped_data());
  for (int64_t g = 0; g < groups; ++g)
    TransposeMatrix<kRowsPerWord>(rows, columns, in + g * rows * columns,
                                  result + g * rows * columns * 4 /
                                               kRowsPerWord);
  return ffi::Error::Success();
}

ffi::Error TransposeFloat32(ffi::Buffer<ffi::F32> x,
                            ffi::ResultBuffer<ffi::F32> out) {
  return Transpose<1>(x, out);
}

ffi::Error TransposeToBfloat16(ffi::Buffer<ffi::F32> x,
                               ffi::ResultBuffer<ffi::BF16> out) {
  return Transpose<2>(x, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitTransposeFloat32, TransposeFloat32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitTransposeToBfloat16, TransposeToBfloat16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
