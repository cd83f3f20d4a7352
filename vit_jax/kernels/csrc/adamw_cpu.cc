// AdamW's update of a model's parameters, a few leaves to an XLA FFI call;
// vit_jax/kernels/cpu_adamw.py binds it and says why it exists.
//
// VitAdamW takes scalars (4,) = (1 - b1^t, 1 - b2^t, step size, gradient
// scale), then L gradients, L first moments, L second moments and L
// parameters (float32, any shapes, leaf i's four of one size), and returns
// L updates (with the attribute `apply`, the parameters updated: p + u),
// L first moments and L second moments; for each element, in
// optim.adamw's order, with g the gradient times the scale (clipping by
// the global norm sets it):
//   mu = (1 - b1) g + b1 mu,  nu = (1 - b2) g^2 + b2 nu,
//   u = step size ((mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t)) + eps)
//                  [+ weight_decay p where decayed[i]]).
// 1 - b1 and 1 - b2 come rounded from double, as XLA's constants do (1.0f -
// 0.999f is 1.3e-5 off 0.001f). Each element is read before it is written,
// so the results may alias the operands (cpu_adamw.py aliases the
// moments, and the parameters where it applies the updates). The attribute
// `tasks` spreads the leaves' chunks (kElementsPerTask elements each,
// parallel_tasks.h) over that many threads.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "parallel_tasks.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct AdamWConstants {
  float one_minus_b1, b1, one_minus_b2, b2, eps, weight_decay;
  Vec correction1, correction2, step_size, grad_scale;
  bool apply;  // the first results are p + u, not u
};

// One leaf's elements [start, start + length): its inputs and results.
struct AdamWChunk {
  const float *grad, *mu, *nu, *param;
  float *update, *new_mu, *new_nu;
  int64_t start, length;
  bool decayed;
};

void UpdateChunk(const AdamWChunk& c, const AdamWConstants& k) {
  for (int64_t i = c.start; i < c.start + c.length; i += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, c.start + c.length - i);
    const Vec g = LoadPart(c.grad + i, count) * k.grad_scale;
    const Vec mu = k.one_minus_b1 * g + k.b1 * LoadPart(c.mu + i, count);
    const Vec nu =
        k.one_minus_b2 * (g * g) + k.b2 * LoadPart(c.nu + i, count);
    const Vec p =
        c.decayed || k.apply ? LoadPart(c.param + i, count) : Vec{};
    Vec u = (mu / k.correction1) / (Sqrt(nu / k.correction2) + k.eps);
    if (c.decayed) u = u + k.weight_decay * p;
    u = k.step_size * u;
    StorePart(c.update + i, k.apply ? p + u : u, count);
    StorePart(c.new_mu + i, mu, count);
    StorePart(c.new_nu + i, nu, count);
  }
}

ffi::Error AdamW(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars,
                 ffi::RemainingArgs args, ffi::RemainingRets rets, float b1,
                 float one_minus_b1, float b2, float one_minus_b2, float eps,
                 float weight_decay, ffi::Span<const int64_t> decayed,
                 bool apply, int64_t tasks) {
  const int64_t leaves = static_cast<int64_t>(decayed.size());
  if (scalars.element_count() != 4 ||
      static_cast<int64_t>(args.size()) != 4 * leaves ||
      static_cast<int64_t>(rets.size()) != 3 * leaves)
    return ffi::Error::InvalidArgument(
        "VitAdamW takes scalars (4,), then L gradients, first moments, "
        "second moments and parameters, and returns L updates, first and "
        "second moments, for the L leaves that `decayed` has flags for");
  const float* s = scalars.typed_data();
  const AdamWConstants constants{one_minus_b1, b1, one_minus_b2, b2, eps,
                                 weight_decay, Splat(s[0]), Splat(s[1]),
                                 Splat(s[2]), Splat(s[3]), apply};
  std::vector<AdamWChunk> chunks;
  for (int64_t leaf = 0; leaf < leaves; ++leaf) {
    float* data[7];  // gradient, mu, nu, parameter; update, mu, nu
    int64_t size = -1;
    for (int64_t j = 0; j < 7; ++j) {
      const int64_t index = (j < 4 ? j : j - 4) * leaves + leaf;
      std::optional<ffi::AnyBuffer> buffer;
      if (j < 4) {
        if (auto arg = args.get<ffi::AnyBuffer>(index)) buffer = *arg;
      } else if (auto ret = rets.get<ffi::AnyBuffer>(index)) {
        buffer = **ret;
      }
      if (j == 0 && buffer) size = buffer->element_count();
      if (!buffer || buffer->element_type() != ffi::F32 ||
          static_cast<int64_t>(buffer->element_count()) != size)
        return ffi::Error::InvalidArgument(
            "VitAdamW: a leaf's gradient, moments, parameter and results "
            "must be float32 arrays of one size");
      data[j] = static_cast<float*>(buffer->untyped_data());
    }
    for (int64_t start = 0; start < size; start += kElementsPerTask)
      chunks.push_back({data[0], data[1], data[2], data[3], data[4], data[5],
                        data[6], start,
                        std::min(kElementsPerTask, size - start),
                        decayed[leaf] != 0});
  }
  // Per element: gradient, moments and parameter read, update and moments
  // written.
  CallCost cost;
  cost.helpers = false;  // a train step's call
  for (const AdamWChunk& chunk : chunks) cost.bytes += 7 * 4 * chunk.length;
  ForEachTask(pool, cost, static_cast<int64_t>(chunks.size()),
              [&](int64_t task) { UpdateChunk(chunks[task], constants); },
              tasks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitAdamW, AdamW,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scalars
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<float>("b1")
                                  .Attr<float>("one_minus_b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("one_minus_b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay")
                                  .Attr<ffi::Span<const int64_t>>("decayed")
                                  .Attr<bool>("apply")
                                  .Attr<int64_t>("tasks"));
