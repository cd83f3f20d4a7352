// LayerNorm over the last axis, forward and backward, as XLA FFI handlers;
// vit_jax/kernels/cpu_layer_norm.py binds them and says why they exist.
//
// Every operand and result has a leading axis of G groups of rows (under a
// batch-split mesh, each device's part); float32, row major:
//   VitLayerNormForward   x (G, R, D), scale (G, D), bias (G, D)
//                         -> y (G, R, D), mean (G, R), rstd (G, R)
//   VitLayerNormBackward  x, scale, mean, rstd, dy (G, R, D)
//                         -> dx (G, R, D), dscale (G, D), dbias (G, D)
// with y = (x - mean) * rstd * scale + bias, rstd = 1 / sqrt(var + epsilon)
// (var by two passes over the row, as a float64 reference computes it).
// The attribute `tasks` splits each group's rows into that many blocks
// (parallel_tasks.h); each block sums its own rows' dscale and dbias,
// then the blocks' sums are added per group (the caller's sum over G is the
// gradient's all-reduce).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel_tasks.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The row's mean and 1 / sqrt(variance + epsilon).
inline void Moments(const float* x, int64_t d, float epsilon, float* mean,
                    float* rstd) {
  const int64_t whole = d / kLanes * kLanes;
  Vec sum = {};
  for (int64_t i = 0; i < whole; i += kLanes) sum += Load(x + i);
  float total = SumOfLanes(sum);
  for (int64_t i = whole; i < d; ++i) total += x[i];
  const float m = total / d;
  Vec squares = {};
  for (int64_t i = 0; i < whole; i += kLanes) {
    const Vec centred = Load(x + i) - m;
    squares += centred * centred;
  }
  float square_total = SumOfLanes(squares);
  for (int64_t i = whole; i < d; ++i) square_total += (x[i] - m) * (x[i] - m);
  *mean = m;
  *rstd = 1.0f / std::sqrt(square_total / d + epsilon);
}

void ForwardRows(const float* x, const float* scale, const float* bias,
                 int64_t rows, int64_t d, float epsilon, float* y,
                 float* mean, float* rstd) {
  const int64_t whole = d / kLanes * kLanes;
  for (int64_t r = 0; r < rows; ++r, x += d, y += d) {
    Moments(x, d, epsilon, mean + r, rstd + r);
    const float m = mean[r], s = rstd[r];
    for (int64_t i = 0; i < whole; i += kLanes)
      Store(y + i, (Load(x + i) - m) * s * Load(scale + i) + Load(bias + i));
    for (int64_t i = whole; i < d; ++i)
      y[i] = (x[i] - m) * s * scale[i] + bias[i];
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy scale; adds dy xhat
// and dy to dscale and dbias.
void BackwardRows(const float* x, const float* scale, const float* mean,
                  const float* rstd, const float* dy, int64_t rows, int64_t d,
                  float* dx, float* dscale, float* dbias) {
  const int64_t whole = d / kLanes * kLanes;
  for (int64_t r = 0; r < rows; ++r, x += d, dy += d, dx += d) {
    const float m = mean[r], s = rstd[r];
    Vec g_sum = {}, gx_sum = {};
    for (int64_t i = 0; i < whole; i += kLanes) {
      const Vec xhat = (Load(x + i) - m) * s, dyi = Load(dy + i);
      const Vec g = dyi * Load(scale + i);
      g_sum += g;
      gx_sum += g * xhat;
      Store(dscale + i, Load(dscale + i) + dyi * xhat);
      Store(dbias + i, Load(dbias + i) + dyi);
    }
    float g_total = SumOfLanes(g_sum), gx_total = SumOfLanes(gx_sum);
    for (int64_t i = whole; i < d; ++i) {
      const float xhat = (x[i] - m) * s, g = dy[i] * scale[i];
      g_total += g;
      gx_total += g * xhat;
      dscale[i] += dy[i] * xhat;
      dbias[i] += dy[i];
    }
    const float g_mean = g_total / d, gx_mean = gx_total / d;
    for (int64_t i = 0; i < whole; i += kLanes) {
      const Vec xhat = (Load(x + i) - m) * s;
      Store(dx + i,
            (Load(dy + i) * Load(scale + i) - g_mean - xhat * gx_mean) * s);
    }
    for (int64_t i = whole; i < d; ++i) {
      const float xhat = (x[i] - m) * s;
      dx[i] = (dy[i] * scale[i] - g_mean - xhat * gx_mean) * s;
    }
  }
}

ffi::Error LayerNormForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                   ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                   ffi::ResultBuffer<ffi::F32> y,
                   ffi::ResultBuffer<ffi::F32> mean,
                   ffi::ResultBuffer<ffi::F32> rstd, float epsilon,
                   int64_t tasks, bool helpers) {
  auto xd = x.dimensions();
  if (xd.size() != 3 || scale.dimensions().size() != 2 ||
      scale.dimensions()[1] != xd[2] || bias.dimensions()[1] != xd[2])
    return ffi::Error::InvalidArgument(
        "VitLayerNormForward takes x (G, R, D), scale and bias (G, D)");
  const int64_t groups = xd[0], rows = xd[1], d = xd[2];
  const float *xp = x.typed_data(), *sp = scale.typed_data(),
              *bp = bias.typed_data();
  float *yp = y->typed_data(), *mp = mean->typed_data(),
        *rp = rstd->typed_data();
  // x read, y written.
  const CallCost cost{2 * static_cast<int64_t>(x.size_bytes()), 0, helpers};
  ForEachBlock(pool, cost, groups, Blocks(rows, tasks, 1),
               [=](int64_t g, int64_t start, int64_t length) {
                 const int64_t row = g * rows + start;
                 ForwardRows(xp + row * d, sp + g * d, bp + g * d, length, d,
                             epsilon, yp + row * d, mp + row, rp + row);
               });
  return ffi::Error::Success();
}

ffi::Error LayerNormBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> mean,
                    ffi::Buffer<ffi::F32> rstd, ffi::Buffer<ffi::F32> dy,
                    ffi::ResultBuffer<ffi::F32> dx,
                    ffi::ResultBuffer<ffi::F32> dscale,
                    ffi::ResultBuffer<ffi::F32> dbias, int64_t tasks) {
  auto xd = x.dimensions();
  if (xd.size() != 3 || dy.dimensions().size() != 3 ||
      dy.dimensions()[1] != xd[1] || dy.dimensions()[2] != xd[2] ||
      scale.dimensions().size() != 2 || scale.dimensions()[1] != xd[2])
    return ffi::Error::InvalidArgument(
        "VitLayerNormBackward takes x and dy (G, R, D), scale (G, D), mean "
        "and rstd (G, R)");
  const int64_t groups = xd[0], rows = xd[1], d = xd[2];
  const float *xp = x.typed_data(), *sp = scale.typed_data(),
              *mp = mean.typed_data(), *rp = rstd.typed_data(),
              *dyp = dy.typed_data();
  float* dxp = dx->typed_data();
  // Each block's sums of dy xhat and dy, then added up per group.
  const Blocks blocks(rows, tasks, 1);
  const int64_t count = blocks.count();
  std::vector<float> sums(2 * groups * count * d, 0.0f);
  float* sums_p = sums.data();
  // x and dy read, dx written.
  const CallCost cost{3 * static_cast<int64_t>(x.size_bytes()), 0,
                      /*helpers=*/false};  // a train step's call
  ForEachBlock(pool, cost, groups, blocks,
               [=](int64_t g, int64_t start, int64_t length) {
                 const int64_t row = g * rows + start;
                 float* block_sums =
                     sums_p + 2 * (g * count + start / blocks.step) * d;
                 BackwardRows(xp + row * d, sp + g * d, mp + row, rp + row,
                              dyp + row * d, length, d, dxp + row * d,
                              block_sums, block_sums + d);
               });
  float *dsp = dscale->typed_data(), *dbp = dbias->typed_data();
  for (int64_t g = 0; g < groups; ++g) {
    std::fill(dsp + g * d, dsp + (g + 1) * d, 0.0f);
    std::fill(dbp + g * d, dbp + (g + 1) * d, 0.0f);
    for (int64_t b = 0; b < count; ++b) {
      const float* block_sums = sums_p + 2 * (g * count + b) * d;
      for (int64_t i = 0; i < d; ++i) {
        dsp[g * d + i] += block_sums[i];
        dbp[g * d + i] += block_sums[d + i];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitLayerNormForward, LayerNormForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // mean
                                  .Ret<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Attr<float>("epsilon")
                                  .Attr<int64_t>("tasks")
                                  .Attr<bool>("helpers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitLayerNormBackward, LayerNormBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mean
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dy
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dscale
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dbias
                                  .Attr<int64_t>("tasks"));
