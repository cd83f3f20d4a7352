// The MLP's tanh-approximate GELU of the first product plus its bias,
// forward and backward, as XLA FFI handlers; vit_jax/kernels/cpu_gelu.py
// binds them and says why they exist.
//
// float32, h of any shape with a leading axis of G groups (under a
// batch-split mesh, each device's part), read as G groups of rows of n
// values, n the length of the bias b (G, n) (a copy per group):
//   VitGelu          h, b -> gelu(h + b)
//   VitGeluBackward  h, b, da -> gelu(h + b), da * gelu'(h + b), and the
//                    bias's gradient (G, n): the column sums of the second
//                    (unrounded) in each group
// VitGeluBf16 and VitGeluBackwardBf16 return gelu(h + b) rounded to
// bfloat16, for products that read it so: XLA's rounding would be a pass
// of its own over the activations. VitGeluBackwardRounded returns
// da * gelu'(h + b) rounded to bfloat16 as well, for the first product's
// gradients where both read it so.
// gelu(x) = x / 2 (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), as
// jax.nn.gelu(approximate=True) defines it, computed as x / (1 + exp(-2u)).
// The backward pass returns the activations too: the weight gradient of
// the product that reads them needs them, and the pass has x in registers
// already. The bias is added, and its gradient summed, in the same passes:
// as XLA fusions of their own they were two more passes over the
// (rows, n) arrays. The attribute `tasks` splits each group's rows into
// that many blocks (parallel_tasks.h).

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

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

// A result's element: float32, or bfloat16's bits.
template <ffi::DataType kType>
using ElementOf =
    std::conditional_t<kType == ffi::DataType::BF16, uint16_t, float>;

inline void StoreResult(float* p, Vec v, int64_t count) {
  StorePart(p, v, count);
}
// Rounded to bfloat16. With AVX512_BF16, by its instruction (vcvtneps2bf16)
// in place of StoreBfloat16Part's ten: the bfloat16 GELU's passes took 31%
// (forward) and 17% (backward) less time on a Zen 5 core. The same values
// as XLA's rounding (to nearest, ties to even; a NaN stays one): the
// instruction flushes denormals to zero, and XLA:CPU runs its programs,
// this kernel included, with denormals flushed to zero already (a GELU of
// 1e-38 is 0 in float32 too).
inline void StoreResult(uint16_t* p, Vec v, int64_t count) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh((__m512)v);
  if (count == kLanes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), rounded);
  } else {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << count) - 1),
                             rounded);
  }
#else
  StoreBfloat16Part(p, v, count);
#endif
}

// The h, b and da of a call and its shape: `groups` groups of `rows` rows
// of n values.
struct GeluShape {
  int64_t groups, rows, n;
};

ffi::Error CheckShape(const ffi::Buffer<ffi::F32>& h,
                      const ffi::Buffer<ffi::F32>& bias, int64_t elements,
                      GeluShape* shape) {
  auto hd = h.dimensions(), bd = bias.dimensions();
  if (hd.size() < 2 || bd.size() != 2 || bd[0] != hd[0] || bd[1] == 0 ||
      elements != h.element_count() ||
      (hd[0] && h.element_count() / hd[0] % bd[1] != 0))
    return ffi::Error::InvalidArgument(
        "the GELU kernel takes h (G, ..., n), its bias (G, n) and (backward) "
        "da of h's shape");
  const int64_t groups = hd[0], n = bd[1],
                count = static_cast<int64_t>(h.element_count());
  *shape = GeluShape{groups, groups ? count / groups / n : 0, n};
  return ffi::Error::Success();
}

// Runs vector(index, column, count) over the vectors of rows [start, start
// + length) of group g: index the first value's in h, column its column,
// count (at most kLanes) its values.
template <typename VectorWork>
inline void ForEachVector(const GeluShape& s, int64_t g, int64_t start,
                          int64_t length, VectorWork vector) {
  for (int64_t r = start; r < start + length; ++r)
    for (int64_t c = 0; c < s.n; c += kLanes)
      vector((g * s.rows + r) * s.n + c, c,
             std::min<int64_t>(kLanes, s.n - c));
}

template <ffi::DataType kActivations>
ffi::Error GeluForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h,
                       ffi::Buffer<ffi::F32> bias,
                       ffi::ResultBuffer<kActivations> a, int64_t tasks,
                       bool helpers) {
  GeluShape s;
  if (ffi::Error error = CheckShape(h, bias, h.element_count(), &s);
      error.failure())
    return error;
  const float *hp = h.typed_data(), *bp = bias.typed_data();
  auto* ap = reinterpret_cast<ElementOf<kActivations>*>(a->typed_data());
  const CallCost cost{static_cast<int64_t>(h.size_bytes() + a->size_bytes()),
                      0, helpers};
  ForEachBlock(pool, cost, s.groups, Blocks(s.rows, tasks, 1),
               [=](int64_t g, int64_t start, int64_t length) {
                 const float* b = bp + g * s.n;
                 ForEachVector(s, g, start, length,
                               [=](int64_t i, int64_t c, int64_t count) {
                   StoreResult(ap + i,
                               Gelu(LoadPart(hp + i, count) +
                                    LoadPart(b + c, count)),
                               count);
                 });
               });
  return ffi::Error::Success();
}

template <ffi::DataType kActivations, ffi::DataType kGradient>
ffi::Error GeluBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h,
                        ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> da,
                        ffi::ResultBuffer<kActivations> a,
                        ffi::ResultBuffer<kGradient> dh,
                        ffi::ResultBuffer<ffi::F32> dbias, int64_t tasks) {
  GeluShape s;
  if (ffi::Error error = CheckShape(h, bias, da.element_count(), &s);
      error.failure())
    return error;
  const float *hp = h.typed_data(), *bp = bias.typed_data(),
              *dap = da.typed_data();
  auto* ap = reinterpret_cast<ElementOf<kActivations>*>(a->typed_data());
  auto* dhp = reinterpret_cast<ElementOf<kGradient>*>(dh->typed_data());
  const Blocks blocks(s.rows, tasks, 1);
  // Each block's column sums, added up per group once all have run.
  std::vector<float> sums(s.groups * blocks.count() * s.n, 0.0f);
  float* sums_p = sums.data();
  const CallCost cost{static_cast<int64_t>(
      h.size_bytes() + da.size_bytes() + a->size_bytes() + dh->size_bytes()),
      0, /*helpers=*/false};  // a train step's call
  ForEachBlock(pool, cost, s.groups, blocks,
               [=](int64_t g, int64_t start, int64_t length) {
                 const float* b = bp + g * s.n;
                 const int64_t block = start / blocks.step;
                 float* sum = sums_p + (g * blocks.count() + block) * s.n;
                 ForEachVector(s, g, start, length,
                               [=](int64_t i, int64_t c, int64_t count) {
                   Vec activations, gradient;
                   GeluAndGradient(
                       LoadPart(hp + i, count) + LoadPart(b + c, count),
                       LoadPart(dap + i, count), &activations, &gradient);
                   StoreResult(ap + i, activations, count);
                   StoreResult(dhp + i, gradient, count);
                   StorePart(sum + c, LoadPart(sum + c, count) + gradient,
                             count);
                 });
               });
  float* dbp = dbias->typed_data();
  for (int64_t g = 0; g < s.groups; ++g) {
    float* out = dbp + g * s.n;
    std::fill(out, out + s.n, 0.0f);
    for (int64_t block = 0; block < blocks.count(); ++block) {
      const float* sum = sums_p + (g * blocks.count() + block) * s.n;
      for (int64_t c = 0; c < s.n; ++c) out[c] += sum[c];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// The backward handler NAME, whose activations are `ACTIVATIONS` and the
// GELU's input's gradient `GRADIENT`.
#define VIT_GELU_BACKWARD_HANDLER(NAME, ACTIVATIONS, GRADIENT)         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                       \
      NAME, (GeluBackward<ACTIVATIONS, GRADIENT>),                     \
      ffi::Ffi::Bind()                                                 \
          .Ctx<ffi::ThreadPool>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>() /* h */                        \
          .Arg<ffi::Buffer<ffi::F32>>() /* b */                        \
          .Arg<ffi::Buffer<ffi::F32>>() /* da */                       \
          .Ret<ffi::Buffer<ACTIVATIONS>>() /* a */                     \
          .Ret<ffi::Buffer<GRADIENT>>() /* dh */                       \
          .Ret<ffi::Buffer<ffi::F32>>() /* db */                       \
          .Attr<int64_t>("tasks"))

// The forward and backward handlers whose activations are `ACTIVATIONS`
// (the gradient float32).
#define VIT_GELU_HANDLERS(SUFFIX, ACTIVATIONS)                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(VitGelu##SUFFIX, GeluForward<ACTIVATIONS>,   \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* h */    \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* b */    \
                                    .Ret<ffi::Buffer<ACTIVATIONS>>()         \
                                    .Attr<int64_t>("tasks")                  \
                                    .Attr<bool>("helpers"));                 \
  VIT_GELU_BACKWARD_HANDLER(VitGeluBackward##SUFFIX, ACTIVATIONS, ffi::F32)

VIT_GELU_HANDLERS(, ffi::F32);
VIT_GELU_HANDLERS(Bf16, ffi::BF16);
VIT_GELU_BACKWARD_HANDLER(VitGeluBackwardRounded, ffi::BF16, ffi::BF16);
