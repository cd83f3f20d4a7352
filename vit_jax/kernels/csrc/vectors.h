// Float vectors one hardware register wide, and their exp: what the
// kernels' elementwise and product loops share. Internal to the kernels'
// sources (its definitions are in an unnamed namespace).

#ifndef VIT_JAX_KERNELS_CSRC_VECTORS_H_
#define VIT_JAX_KERNELS_CSRC_VECTORS_H_

#include <cstdint>

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

inline Vec Load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }
// x - 0 is x for every float (-0 included), so the compiler drops the
// subtraction and broadcasts straight from memory; Vec{} + x would be an add
// (0 + -0 is +0) and a register shuffle per splat: a third of the AVX2
// tile's instructions, 16-24% of its products' time.
inline Vec Splat(float x) { return x - Vec{}; }

// exp(x) to about one ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
// series to degree 7 (truncation error below 6e-9), 2^n through the exponent
// bits. Inputs are clamped to [-87, 88], where the result is a normal
// float (for the softmax's shifted logits, below -87 is only the far tail,
// whose exp is nothing beside the row maximum's 1).
inline Vec Exp(Vec x) {
  const Vec low = Splat(-87.0f), high = Splat(88.0f);
  x = x < low ? low : x;
  x = x > high ? high : x;
  const float kShifter = 12582912.0f;  // 1.5 * 2^23: adds round to integer
  const Vec shifted = x * Splat(1.44269504088896341f) + Splat(kShifter);
  const Vec n = shifted - Splat(kShifter);
  const Vec r = (x - n * Splat(0.693359375f)) - n * Splat(-2.12194440e-4f);
  Vec p = Splat(1.0f / 5040);
  p = p * r + Splat(1.0f / 720);
  p = p * r + Splat(1.0f / 120);
  p = p * r + Splat(1.0f / 24);
  p = p * r + Splat(1.0f / 6);
  p = p * r + Splat(0.5f);
  p = p * r + Splat(1.0f);
  p = p * r + Splat(1.0f);
  const IVec bits = reinterpret_cast<const IVec&>(shifted);
  const IVec exponent = (bits - 0x4B400000 + 127) << 23;
  return p * reinterpret_cast<const Vec&>(exponent);
}

}  // namespace

#endif  // VIT_JAX_KERNELS_CSRC_VECTORS_H_
