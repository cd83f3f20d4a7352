// The sum of the squares of a model's gradients, a few leaves to an XLA FFI
// call: the square of their global norm, which clipping and the train
// step's metrics read (vit_jax/kernels/cpu_sum_of_squares.py binds it and
// says why it exists).
//
// VitSumOfSquares takes L float32 arrays (any shapes) and returns a float32
// scalar, the sum over every element of x^2. Each chunk of
// kElementsPerTask elements (parallel_tasks.h) is a task, summed in float32
// vector lanes (a lane adds at most kElementsPerTask / kLanes / kSums
// squares); the chunks' sums are added in double, in the chunks' order, so
// the result does not depend on how many threads ran or in what order they
// finished. The attribute `tasks` spreads the chunks over that many
// threads (parallel_tasks.h).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel_tasks.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One leaf's elements [start, start + length).
struct SquaresChunk {
  const float* data;
  int64_t start, length;
};

// Independent sums a chunk keeps: the adds of one do not wait on another's.
constexpr int kSums = 4;

double SumChunkSquares(const SquaresChunk& c) {
  Vec sums[kSums] = {};
  const float* x = c.data + c.start;
  int64_t i = 0;
  for (; i + kSums * kLanes <= c.length; i += kSums * kLanes)
    for (int s = 0; s < kSums; ++s) {
      const Vec v = Load(x + i + s * kLanes);
      sums[s] += v * v;
    }
  for (; i < c.length; i += kLanes) {
    const Vec v = LoadPart(x + i, std::min<int64_t>(kLanes, c.length - i));
    sums[0] += v * v;
  }
  double total = 0;
  for (int s = 0; s < kSums; ++s) total += SumOfLanes(sums[s]);
  return total;
}

ffi::Error SumOfSquares(ffi::ThreadPool pool, ffi::RemainingArgs args,
                        ffi::Result<ffi::BufferR0<ffi::F32>> out,
                        int64_t tasks) {
  std::vector<SquaresChunk> chunks;
  for (size_t leaf = 0; leaf < args.size(); ++leaf) {
    auto buffer = args.get<ffi::AnyBuffer>(leaf);
    if (!buffer || buffer->element_type() != ffi::F32)
      return ffi::Error::InvalidArgument(
          "VitSumOfSquares takes float32 arrays");
    const int64_t size = buffer->element_count();
    const float* data = static_cast<const float*>(buffer->untyped_data());
    for (int64_t start = 0; start < size; start += kElementsPerTask)
      chunks.push_back(
          {data, start, std::min(kElementsPerTask, size - start)});
  }
  std::vector<double> chunk_sums(chunks.size());
  CallCost cost;
  cost.helpers = false;  // a train step's call
  for (const SquaresChunk& chunk : chunks) cost.bytes += 4 * chunk.length;
  ForEachTask(pool, cost, static_cast<int64_t>(chunks.size()),
              [&](int64_t task) {
                chunk_sums[task] = SumChunkSquares(chunks[task]);
              },
              tasks);
  double total = 0;
  for (double sum : chunk_sums) total += sum;
  *out->typed_data() = static_cast<float>(total);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitSumOfSquares, SumOfSquares,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::BufferR0<ffi::F32>>()
                                  .Attr<int64_t>("tasks"));
