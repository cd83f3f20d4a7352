// The MLP's tanh-approximate GELU, forward and backward, as XLA FFI
// handlers; vit_jax/kernels/cpu_gelu.py binds them and says why they exist.
//
// float32, any shape with a leading axis of G groups (under a batch-split
// mesh, each device's part), read as G rows of n values:
//   VitGelu          h -> gelu(h)
//   VitGeluBackward  h, da -> gelu(h), da * gelu'(h)
// gelu(h) = h / 2 (1 + tanh(u)), u = sqrt(2 / pi) (h + 0.044715 h^3), as
// jax.nn.gelu(approximate=True) defines it, computed as h / (1 + exp(-2u)).
// The backward pass returns the activations too: the weight gradient of
// the product that reads them needs them, and the pass has h in registers
// already. The attribute `tasks` splits each group into that many blocks
// on XLA's intra-op threads.

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel_tasks.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 1 / x for x >= 1: the CPU's reciprocal estimate (14 bits with AVX-512,
// 12 with AVX2) and a Newton step, to about float rounding at a fraction
// of a division's cost; a division elsewhere.
inline Vec Reciprocal(Vec x) {
#if defined(__AVX512F__)
  const Vec estimate = (Vec)_mm512_rcp14_ps((__m512)x);
#elif defined(__AVX2__)
  const Vec estimate = (Vec)_mm256_rcp_ps((__m256)x);
#else
  const Vec estimate = 1.0f / x;  // the Newton step below keeps it
#endif
  return estimate * (2.0f - x * estimate);
}

constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;

// (1 + tanh(u)) / 2 = 1 / (1 + e), e = exp(-2u), u = sqrt(2 / pi) h (1 +
// c h^2); e to *e_out.
inline Vec HalfOnePlusTanh(Vec h, Vec h2, Vec* e_out) {
  const Vec minus_2u =
      h * ((-2.0f * kSqrt2OverPi) + (-2.0f * kSqrt2OverPi * kCubic) * h2);
  *e_out = Exp(minus_2u);  // Exp clamps to [-87, 88]
  return Reciprocal(1.0f + *e_out);
}

inline Vec Gelu(Vec h) {
  Vec e;
  return h * HalfOnePlusTanh(h, h * h, &e);
}

// gelu(h) and da * gelu'(h), with s = (1 + tanh(u)) / 2:
// gelu' = s + h s (1 - s) 2 sqrt(2 / pi) (1 + 3 c h^2), where 1 - s is
// taken as e s: 1 - s itself would keep the reciprocal estimate's last-bit
// error where s rounds to 1, which h^3 then magnifies.
inline void GeluAndGradient(Vec h, Vec da, Vec* a, Vec* dh) {
  const Vec h2 = h * h;
  Vec e;
  const Vec s = HalfOnePlusTanh(h, h2, &e);
  *a = h * s;
  *dh = da * (s + *a * e * s * (2.0f * kSqrt2OverPi) *
                      (1.0f + 3.0f * kCubic * h2));
}

// The first `count` floats at p (at most kLanes), the rest zeros.
inline Vec LoadPart(const float* p, int64_t count) {
  if (count == kLanes) return Load(p);
  Vec v = {};
  for (int64_t i = 0; i < count; ++i) v[i] = p[i];
  return v;
}

inline void StorePart(float* p, Vec v, int64_t count) {
  if (count == kLanes) {
    Store(p, v);
    return;
  }
  for (int64_t i = 0; i < count; ++i) p[i] = v[i];
}

ffi::Error GeluForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h,
                       ffi::ResultBuffer<ffi::F32> a, int64_t tasks) {
  if (h.dimensions().size() == 0)
    return ffi::Error::InvalidArgument("VitGelu takes h with a group axis");
  const int64_t groups = h.dimensions()[0];
  const int64_t n = groups ? h.element_count() / groups : 0;
  const float* hp = h.typed_data();
  float* ap = a->typed_data();
  ForEachBlock(pool, groups, Blocks(n, tasks, kLanes),
               [=](int64_t g, int64_t start, int64_t length) {
                 const int64_t end = g * n + start + length;
                 for (int64_t i = g * n + start; i < end; i += kLanes) {
                   const int64_t count = std::min<int64_t>(kLanes, end - i);
                   StorePart(ap + i, Gelu(LoadPart(hp + i, count)), count);
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
  ForEachBlock(pool, groups, Blocks(n, tasks, kLanes),
               [=](int64_t g, int64_t start, int64_t length) {
                 const int64_t end = g * n + start + length;
                 for (int64_t i = g * n + start; i < end; i += kLanes) {
                   const int64_t count = std::min<int64_t>(kLanes, end - i);
                   Vec activations, gradient;
                   GeluAndGradient(LoadPart(hp + i, count),
                                   LoadPart(dap + i, count), &activations,
                                   &gradient);
                   StorePart(ap + i, activations, count);
                   StorePart(dhp + i, gradient, count);
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
