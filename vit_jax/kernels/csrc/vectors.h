// Float vectors one hardware register wide, their exp and the sum and
// maximum of their lanes: what the kernels' elementwise and product loops
// share. Internal to the kernels' sources (its definitions are in an
// unnamed namespace).

#ifndef VIT_JAX_KERNELS_CSRC_VECTORS_H_
#define VIT_JAX_KERNELS_CSRC_VECTORS_H_

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace {

// A Vec is one register of kLanes floats: a vector wider than the
// registers would be split by the compiler, which then keeps a product
// tile's accumulators on the stack (32x slower with AVX2).
#if defined(__AVX512F__)
constexpr int kLanes = 16;  // zmm
#elif defined(__AVX2__)
constexpr int kLanes = 8;  // ymm
#else
constexpr int kLanes = 4;  // xmm, or NEON's q
#endif
typedef float Vec __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint32_t UVec __attribute__((vector_size(kLanes * 4), aligned(4)));
// kLanes bfloat16 values' bits.
typedef uint16_t Bf16Vec __attribute__((vector_size(kLanes * 2), aligned(2)));

inline Vec Load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }

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

// The bfloat16 bits of a float's bits (a uint32_t, or a UVec of them), in
// the low 16 bits: rounded to nearest, ties to even, as XLA's convert from
// f32 to bf16; a NaN stays a (quiet) NaN. Branch-free, so that loops of it
// vectorise.
template <typename Bits>
inline Bits RoundToBfloat16(Bits bits) {
  const Bits rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const Bits quiet_nan = (bits >> 16) | 0x0040u;
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

// v's first `count` lanes (at most kLanes) rounded to bfloat16, their bits
// written at p.
inline void StoreBfloat16Part(uint16_t* p, Vec v, int64_t count) {
  const UVec bits = RoundToBfloat16(reinterpret_cast<const UVec&>(v));
  if (count == kLanes) {
    *reinterpret_cast<Bf16Vec*>(p) = __builtin_convertvector(bits, Bf16Vec);
    return;
  }
  for (int64_t i = 0; i < count; ++i) p[i] = static_cast<uint16_t>(bits[i]);
}

// x - 0 is x for every float (-0 included), so the compiler drops the
// subtraction and broadcasts straight from memory; Vec{} + x would be an add
// (0 + -0 is +0) and a register shuffle per splat: a third of the AVX2
// tile's instructions, 16-24% of its products' time.
inline Vec Splat(float x) { return x - Vec{}; }

// The square root of each lane, correctly rounded as std::sqrt's.
inline Vec Sqrt(Vec v) {
#if defined(__AVX512F__)
  return (Vec)_mm512_sqrt_ps((__m512)v);
#elif defined(__AVX2__)
  return (Vec)_mm256_sqrt_ps((__m256)v);
#elif defined(__aarch64__)
  return (Vec)vsqrtq_f32((float32x4_t)v);
#else
  for (int i = 0; i < kLanes; ++i) v[i] = __builtin_sqrtf(v[i]);
  return v;
#endif
}

// max(low, x) and min(high, x) lane by lane; a NaN x stays x (x86's
// max and min return their second operand where either is a NaN). The
// compilers make `x < low ? low : x` a compare and a masked move.
inline Vec AtLeast(Vec low, Vec x) {
#if defined(__AVX512F__)
  return (Vec)_mm512_max_ps((__m512)low, (__m512)x);
#elif defined(__AVX2__)
  return (Vec)_mm256_max_ps((__m256)low, (__m256)x);
#else
  return x < low ? low : x;
#endif
}

inline Vec AtMost(Vec high, Vec x) {
#if defined(__AVX512F__)
  return (Vec)_mm512_min_ps((__m512)high, (__m512)x);
#elif defined(__AVX2__)
  return (Vec)_mm256_min_ps((__m256)high, (__m256)x);
#else
  return x > high ? high : x;
#endif
}

// exp(x) to within three ulp (2.55 at most over [-87, 88] against a
// double-precision exp): x = n ln2 + r, |r| <= ln2 / 2, e^r by a
// degree-5 polynomial fitted to minimise the relative error there (7.5e-8,
// against the float's 6e-8 half ulp; Taylor's series needs degree 7 for
// that, two more multiply-adds in each exp of the softmax and the GELU),
// 2^n through the exponent bits (AVX-512's vscalefps in one instruction).
// Inputs are clamped to [-87, 88], where the result is a normal float (for
// the softmax's shifted logits, below -87 is only the far tail, whose exp
// is nothing beside the row maximum's 1). With AVX-512, n by vrndscaleps
// and the clamps by vmaxps and vminps: 20% less time for a softmax's exps
// on a Zen 5 core than n by adding and subtracting 1.5 * 2^23 and the
// clamps as compares.
inline Vec Exp(Vec x) {
  x = AtMost(Splat(88.0f), AtLeast(Splat(-87.0f), x));
#if defined(__AVX512F__)
  const Vec n = (Vec)_mm512_roundscale_ps(
      (__m512)(x * Splat(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const float kShifter = 12582912.0f;  // 1.5 * 2^23: adds round to integer
  const Vec shifted = x * Splat(1.44269504088896341f) + Splat(kShifter);
  const Vec n = shifted - Splat(kShifter);
#endif
  const Vec r = (x - n * Splat(0.693359375f)) - n * Splat(-2.12194440e-4f);
  Vec p = Splat(8.297654800e-3f);
  p = p * r + Splat(4.191538319e-2f);
  p = p * r + Splat(1.666757464e-1f);
  p = p * r + Splat(4.999889433e-1f);
  p = p * r + Splat(9.999997020e-1f);
  p = p * r + Splat(1.000000119f);
#if defined(__AVX512F__)
  return (Vec)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
  const IVec bits = reinterpret_cast<const IVec&>(shifted);
  const IVec exponent = (bits - 0x4B400000 + 127) << 23;
  return p * reinterpret_cast<const Vec&>(exponent);
#endif
}

// The sum and the maximum of a vector's lanes, as a tree of shuffles: a
// loop over the lanes is a chain of kLanes dependent additions, which a
// softmax row waits on twice.
inline float SumOfLanes(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128((__m256)v),
                                 _mm256_extractf128_ps((__m256)v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
#elif defined(__aarch64__)
  return vaddvq_f32((float32x4_t)v);
#else
  static_assert(kLanes == 4, "SSE's vectors are 4 floats");
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

inline float MaxOfLanes(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX2__)
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128((__m256)v),
                                 _mm256_extractf128_ps((__m256)v, 1));
  const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
#elif defined(__aarch64__)
  return vmaxvq_f32((float32x4_t)v);
#else
  const float a = v[0] > v[1] ? v[0] : v[1], b = v[2] > v[3] ? v[2] : v[3];
  return a > b ? a : b;
#endif
}

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_VECTORS_H_
