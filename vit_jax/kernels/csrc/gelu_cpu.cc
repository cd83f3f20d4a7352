// The MLP's tanh-approximate GELU, forward and backward, as XLA FFI
// handlers; vit_jax/kernels/cpu_gelu.py binds them and says why they exist.
//
// float32, any shape with a leading axis of G groups (under a batch-split
// mesh, each device's part), read as G rows of n values:
//   VitGelu          h -> gelu(h)
//   VitGeluBackward  h, da -> gelu(h), da * gelu'(h)
// gelu(h) = h / 2 (1 + tanh(u)), u = sqrt(2 / pi) (h + 0.044715 h^3), as
// jax.nn.gelu(approximate=True) defines it. The backward pass returns the
// activations too: the weight gradient of the product that reads them
// needs them, and the pass has h in registers already. The attribute
// `tasks` splits each group into that many blocks on XLA's intra-op
// threads.

#include <algorithm>
#include <cstdint>

#include "parallel_tasks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 16 floats: one AVX-512 register, two AVX2 or four SSE/NEON ones.
constexpr int64_t kGeluWidth = 16;
typedef float GeluVec __attribute__((vector_size(kGeluWidth * 4), aligned(4)));
typedef int32_t GeluIntVec
    __attribute__((vector_size(kGeluWidth * 4), aligned(4)));

// exp(x) for x in [-19, 0]: x = n ln 2 + r with |r| <= ln 2 / 2, exp(r) by
// its Taylor series to r^7 (relative error < 1e-8 there), times 2^n built
// in the exponent bits.
inline GeluVec ExpOfNegative(GeluVec x) {
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to int
  const GeluVec n = (x * 1.44269504f + kRound) - kRound;
  // ln 2 in two parts, so that n ln 2 is subtracted without rounding.
  const GeluVec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  GeluVec p = 1.0f / 5040.0f + r * (1.0f / 40320.0f);
  p = 1.0f / 720.0f + r * p;
  p = 1.0f / 120.0f + r * p;
  p = 1.0f / 24.0f + r * p;
  p = 1.0f / 6.0f + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  const GeluIntVec bits = (__builtin_convertvector(n, GeluIntVec) + 127) << 23;
  return p * (GeluVec)bits;  // the same bits, read as floats
}

// tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2 |u|); |u| >= 9 gives
// +-1 in float32.
inline GeluVec Tanh(GeluVec u) {
  const GeluVec magnitude = u < 0.0f ? -u : u;
  const GeluVec e = ExpOfNegative(
      -2.0f * (magnitude < 9.0f ? magnitude : GeluVec{} + 9.0f));
  const GeluVec t = (1.0f - e) / (1.0f + e);
  return u < 0.0f ? -t : t;
}

constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;

inline GeluVec Gelu(GeluVec h) {
  const GeluVec t = Tanh(kSqrt2OverPi * (h + kCubic * h * h * h));
  return 0.5f * h * (1.0f + t);
}

// gelu(h) and da * gelu'(h).
inline void GeluAndGradient(GeluVec h, GeluVec da, GeluVec* a, GeluVec* dh) {
  const GeluVec h2 = h * h;
  const GeluVec t = Tanh(kSqrt2OverPi * h * (1.0f + kCubic * h2));
  *a = 0.5f * h * (1.0f + t);
  *dh = da * (0.5f * (1.0f + t) + 0.5f * h * (1.0f - t * t) * kSqrt2OverPi *
                                      (1.0f + 3.0f * kCubic * h2));
}

inline GeluVec LoadGelu(const float* p, int64_t count) {
  if (count == kGeluWidth) return *reinterpret_cast<const GeluVec*>(p);
  GeluVec v = {};
  for (int64_t i = 0; i < count; ++i) v[i] = p[i];
  return v;
}

inline void StoreGelu(float* p, GeluVec v, int64_t count) {
  if (count == kGeluWidth) {
    *reinterpret_cast<GeluVec*>(p) = v;
    return;
  }
  for (int64_t i = 0; i < count; ++i) p[i] = v[i];
}

// Runs work(start, length) over each group's n values, split into `tasks`
// blocks of whole vectors, on XLA's intra-op threads.
template <typename Work>
void ForEachGeluBlock(ffi::ThreadPool& pool, int64_t groups, int64_t n,
                      int64_t tasks, Work work) {
  tasks = std::max<int64_t>(tasks, 1);
  const int64_t per_task =
      ((n + tasks - 1) / tasks + kGeluWidth - 1) / kGeluWidth * kGeluWidth;
  const int64_t blocks = std::max<int64_t>(1, (n + per_task - 1) / per_task);
  ForEachTask(pool, groups * blocks, [=](int64_t item) {
    const int64_t start = std::min(n, item % blocks * per_task);
    work(item / blocks * n + start, std::min(n, start + per_task) - start);
  });
}

ffi::Error GeluForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h,
                       ffi::ResultBuffer<ffi::F32> a, int64_t tasks) {
  if (h.dimensions().size() == 0)
    return ffi::Error::InvalidArgument("VitGelu takes h with a group axis");
  const int64_t groups = h.dimensions()[0];
  const int64_t n = groups ? h.element_count() / groups : 0;
  const float* hp = h.typed_data();
  float* ap = a->typed_data();
  ForEachGeluBlock(pool, groups, n, tasks, [=](int64_t start, int64_t length) {
    for (int64_t i = 0; i < length; i += kGeluWidth) {
      const int64_t count = std::min(kGeluWidth, length - i);
      StoreGelu(ap + start + i, Gelu(LoadGelu(hp + start + i, count)), count);
    }
  });
  return ffi::Error::Success();
}

ffi::Error GeluBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h,
                        ffi::Buffer<ffi::F32> da,
                        ffi::ResultBuffer<ffi::F32> a,
                        ffi::ResultBuffer<ffi::F32> dh, int64_t tasks) {
  if (h.dimensions().size() == 0 || da.element_count() != h.element_count())
    return ffi::Error::InvalidArgument(
        "VitGeluBackward takes h and da of one shape, with a group axis");
  const int64_t groups = h.dimensions()[0];
  const int64_t n = groups ? h.element_count() / groups : 0;
  const float *hp = h.typed_data(), *dap = da.typed_data();
  float *ap = a->typed_data(), *dhp = dh->typed_data();
  ForEachGeluBlock(pool, groups, n, tasks, [=](int64_t start, int64_t length) {
    for (int64_t i = 0; i < length; i += kGeluWidth) {
      const int64_t count = std::min(kGeluWidth, length - i), at = start + i;
      GeluVec activations, gradient;
      GeluAndGradient(LoadGelu(hp + at, count), LoadGelu(dap + at, count),
                      &activations, &gradient);
      StoreGelu(ap + at, activations, count);
      StoreGelu(dhp + at, gradient, count);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitGelu, GeluForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // a
                                  .Attr<int64_t>("tasks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitGeluBackward, GeluBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h
                                  .Arg<ffi::Buffer<ffi::F32>>()  // da
                                  .Ret<ffi::Buffer<ffi::F32>>()  // a
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dh
                                  .Attr<int64_t>("tasks"));
