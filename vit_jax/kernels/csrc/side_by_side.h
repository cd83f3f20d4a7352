// Arrays side by side, for the oneDNN products of gemm_cpu.cc: a product
// with several kernels read where they lie, or a product whose result is
// several arrays. Internal to the kernels' sources.

#ifndef VIT_JAX_KERNELS_CSRC_SIDE_BY_SIDE_H_
#define VIT_JAX_KERNELS_CSRC_SIDE_BY_SIDE_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace {

// Arrays of G groups of (rows, width_i) each, side by side along their
// last axis as one of (rows, sum of the widths) a group: the kernels of a
// joined product (attention's query, key and value), which oneDNN reads
// where they lie, or the gradients a split product writes apart. What this
// saves is XLA's copies that join the kernels and split their gradient:
// 1.5 of a batch-1 vit_tiny_cifar train step's 14 ms on a Zen 5
// (docs/performance.md, *The Zen 5 a ninth time*).
template <typename T>
struct SideBySide {
  static constexpr int kMax = 8;
  T* data[kMax];
  int64_t width[kMax], start[kMax];
  int count = 0;
  int64_t rows = 0, total = 0, bytes = 0;

  // Adds a (G, rows, width) array, or says why it cannot join.
  template <typename Array>
  xla::ffi::Error Add(const Array& array, int64_t groups) {
    auto d = array.dimensions();
    if (count == kMax)
      return xla::ffi::Error::InvalidArgument("VitGemm: more than 8 kernels");
    if (d.size() != 3 || d[0] != groups || (count > 0 && d[1] != rows))
      return xla::ffi::Error::InvalidArgument(
          "VitGemm: the kernels side by side must be (G, rows, width_i) "
          "with the same G and rows");
    data[count] = reinterpret_cast<T*>(array.untyped_data());
    rows = d[1];
    width[count] = d[2];
    start[count] = total;
    total += d[2];
    bytes += array.size_bytes();
    ++count;
    return xla::ffi::Error::Success();
  }

  // Array i's group g.
  T* Group(int i, int64_t g) const { return data[i] + g * rows * width[i]; }

  using Value = std::remove_const_t<T>;

  // The arrays copied side by side into `joined` ((G, rows, total),
  // resized), as one array; not copied (for results) unless `copy`.
  SideBySide Joined(int64_t groups, std::vector<Value>* joined,
                    bool copy = true) const {
    joined->resize(groups * rows * total);
    for (int64_t g = 0; copy && g < groups; ++g)
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < count; ++i)
          std::copy_n(Group(i, g) + r * width[i], width[i],
                      joined->data() + (g * rows + r) * total + start[i]);
    SideBySide one = *this;
    one.count = 1;
    one.data[0] = joined->data();
    one.width[0] = total;
    one.start[0] = 0;
    return one;
  }

  // The inverse: `joined`'s columns copied into the arrays.
  void SplitFrom(const Value* joined, int64_t groups) const {
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < count; ++i)
          std::copy_n(joined + (g * rows + r) * total + start[i], width[i],
                      Group(i, g) + r * width[i]);
  }

  // Calls f(i, column of array i, column of the whole, columns) for each
  // array's part of the whole's columns [c0, c0 + columns).
  template <typename Part>
  void ForEachPart(int64_t c0, int64_t columns, Part f) const {
    for (int i = 0; i < count; ++i) {
      const int64_t lo = std::max(c0, start[i]),
                    hi = std::min(c0 + columns, start[i] + width[i]);
      if (lo < hi) f(i, lo - start[i], lo, hi - lo);
    }
  }
};

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_SIDE_BY_SIDE_H_
