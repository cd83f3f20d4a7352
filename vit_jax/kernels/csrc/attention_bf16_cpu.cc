// The attention core with its products' operands rounded to bfloat16 (to
// nearest even) and float32 sums, as XLA FFI handlers: what
// vit_jax/kernels/cpu_attention.py's attention_core runs when the model's
// products are bfloat16 (see there). The forward pass rounds q, k, v and
// the probabilities; the backward pass dO, V, K, Q, P and dS; the softmax
// and its gradient stay float32. Same layouts and pairs as
// attention_cpu.cc (attention_core.h).
//
// The products run on bfloat16 instructions where they were measured to
// pay (bf16_tiles.h): as AMX tile products where the CPU has AMX (and Linux
// grants this process its tile data), and with AVX512_BF16's dot
// instruction on AMD's CPUs with it (Zen 4: twice float32's rate).
// Elsewhere the same rounded values go through the float32 products: on
// the AMX Xeon the dot instruction ran at half float32's rate, and Intel's
// CPUs with it and no AMX are unmeasured (docs/performance.md).

#include "attention_handlers.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include "bf16_tiles.h"
#endif

namespace {

// x rounded to bfloat16 (its bits), as XLA's convert rounds; a NaN stays
// one.
inline uint16_t ToBfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;  // a NaN stays one
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

inline float FromBfloat16(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float result;
  std::memcpy(&result, &bits, 4);
  return result;
}

// out[i] = x[i] rounded to bfloat16 and widened back (out may be x).
void Round(int64_t n, const float* x, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FromBfloat16(ToBfloat16(x[i]));
}

// Rows x columns of x (contiguous) into out (leading dimension ld).
void CopyRows(int64_t rows, int64_t columns, const float* x, float* out,
              int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + r * ld, x + r * columns, columns * sizeof(float));
}

// The rounded operands widened back to float32, through the float32
// products: the values of ForwardPairTiled without bfloat16 instructions.
void ForwardPairRounded(const Shape& s, const float* q, const float* k,
                        const float* v, float* o, float* p) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  thread_local std::vector<float> rounded;
  const size_t size = tq * d + 2 * tk * d + d * tkp + 2 * tq * tkp;
  if (rounded.size() < size) rounded.resize(size);
  float* qr = rounded.data();
  float* kr = qr + tq * d;
  float* vr = kr + tk * d;
  float* kt = vr + tk * d;
  float* pr = kt + d * tkp;
  if (p == nullptr) p = pr + tq * tkp;
  Round(tq * d, q, qr);
  Round(tk * d, k, kr);
  Round(tk * d, v, vr);
  Transpose(tk, d, kr, d, tkp, kt);
  Product(tq, tkp, d, qr, d, 1, kt, tkp, p, tkp);
  Softmax(tq, tk, tkp, s.scale, p);
  Round(tq * tkp, p, pr);
  Product(tq, d, tk, pr, tkp, 1, vr, d, o, s.o_row);
}

// BackwardPair from rounded operands (dO, V, K, Q, P and dS), through the
// float32 products: the values of BackwardPairTiled without bfloat16
// instructions.
void BackwardPairRounded(const Shape& s, const float* q, const float* k,
                         const float* v, const float* p, const float* dout,
                         float* dq, float* dk, float* dv) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  thread_local std::vector<float> rounded;
  const size_t size = 2 * tq * d + 2 * tk * d + 2 * tq * tkp + d * tkp;
  if (rounded.size() < size) rounded.resize(size);
  float* qr = rounded.data();
  float* gr = qr + tq * d;
  float* kr = gr + tq * d;
  float* vr = kr + tk * d;
  float* pr = vr + tk * d;
  float* ds = pr + tq * tkp;
  float* vt = ds + tq * tkp;
  Round(tq * d, q, qr);
  for (int64_t r = 0; r < tq; ++r) Round(d, dout + r * s.o_row, gr + r * d);
  Round(tk * d, k, kr);
  Round(tk * d, v, vr);
  Round(tq * tkp, p, pr);
  Product(tk, d, tq, pr, 1, tkp, gr, d, dv, s.kv_row);  // dV = P^T dO
  Transpose(tk, d, vr, d, tkp, vt);
  Product(tq, tkp, d, gr, d, 1, vt, tkp, ds, tkp);  // dP = dO V^T
  SoftmaxGradient(tq, tkp, s.scale, p, ds);
  Round(tq * tkp, ds, ds);
  Product(tq, d, tk, ds, tkp, 1, kr, d, dq, s.q_row);  // dQ = dS K
  Product(tk, d, tq, ds, 1, tkp, qr, d, dk, s.kv_row);  // dK = dS^T Q
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The tile products of AVX512_BF16's dot instruction, for the passes below.
struct DotTiles {
  static void Product(int64_t m_blocks, int64_t n_blocks, int64_t depth,
                      const uint16_t* a, int64_t a_stride, const uint32_t* b,
                      int64_t b_stride, float* c, int64_t ldc) {
    DotTileProduct(m_blocks, n_blocks, depth, a, a_stride, b, b_stride, c,
                   ldc);
  }
};

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// AMX's tile products, configured while an object lives (ScopedTiles).
struct AmxTiles {
  ScopedTiles scope;
  static void Product(int64_t m_blocks, int64_t n_blocks, int64_t depth,
                      const uint16_t* a, int64_t a_stride, const uint32_t* b,
                      int64_t b_stride, float* c, int64_t ldc) {
    TileProduct(m_blocks, n_blocks, depth, a, a_stride, b, b_stride, c, ldc);
  }
};
#endif

// C's first `rows` rows (leading dimension ldc) = A B, Tiles::Product's
// operands: whole blocks of 16 rows straight into C, the rest through
// `partial` (16 x 16 n_blocks floats) and copied, so that nothing past
// C's rows is written (the rows after them are another pair's).
template <typename Tiles>
void ProductRows(const Tiles& tiles, int64_t rows, int64_t n_blocks,
                 int64_t depth, const uint16_t* a, int64_t a_stride,
                 const uint32_t* b, int64_t b_stride, float* c, int64_t ldc,
                 float* partial) {
  const int64_t whole = rows / 16, left = rows % 16;
  if (whole > 0)
    tiles.Product(whole, n_blocks, depth, a, a_stride, b, b_stride, c, ldc);
  if (left > 0) {
    const uint16_t* a_left = reinterpret_cast<const uint16_t*>(
        reinterpret_cast<const char*>(a) + whole * 16 * a_stride);
    tiles.Product(1, n_blocks, depth, a_left, a_stride, b, b_stride, partial,
                  16 * n_blocks);
    CopyRows(left, 16 * n_blocks, partial, c + whole * 16 * ldc, ldc);
  }
}

// The forward pass of one pair on Tiles (DotTiles or AmxTiles). Query rows
// are padded to whole tiles of 16 in the operands, head_dim and keys to
// whole depth steps of 32.
template <typename Tiles>
void ForwardPairTiled(const Shape& s, const float* q, const float* k,
                      const float* v, float* o, float* p) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  const int64_t tqt = RoundUpTo(tq, 16), dd = RoundUpTo(d, 32),
                tkd = RoundUpTo(tkp, 32);
  const int64_t qn = tqt * dd / 2, kn = dd / 2 * tkp, vn = tkd / 2 * d,
                pn = tqt * tkd / 2;
  uint32_t* qw = TileScratch(qn + kn + vn + pn + tqt * tkp + 16 * d);
  uint32_t* kw = qw + qn;
  uint32_t* vw = kw + kn;
  uint32_t* pw = vw + vn;
  // The logits, then their exps, in scratch: computed in p (new memory
  // each pair), the pass took ~4% longer than with p written once (one
  // core of a Zen 4, 48 pairs of 197 tokens).
  float* logits = reinterpret_cast<float*>(pw + pn);  // tqt x tkp
  float* partial = logits + tqt * tkp;  // 16 x d
  ToBfloat16Rows(tq, d, q, d, tqt, dd, reinterpret_cast<uint16_t*>(qw));
  PairColumns(tk, d, k, d, dd / 2, tkp, kw);
  PairRows(tk, d, v, d, tkd / 2, vw);
  const Tiles tiles{};
  tiles.Product(tqt / 16, tkp / 16, dd, reinterpret_cast<uint16_t*>(qw),
                dd * 2, kw, tkp * 4, logits, tkp);
  uint16_t* probabilities = reinterpret_cast<uint16_t*>(pw);  // tqt x tkd
  Softmax(tq, tk, tkp, s.scale, logits,
          NormalizeToBfloat16{tk, tkp, tkd, p, probabilities});
  _mm_sfence();  // p's non-temporal stores done before anything reads it
  std::fill(probabilities + tq * tkd, probabilities + tqt * tkd, uint16_t{0});
  ProductRows(tiles, tq, d / 16, tkd, probabilities, tkd * 2, vw, d * 4, o,
              s.o_row, partial);
}

// The backward pass of one pair on Tiles: BackwardPair's four products from
// bfloat16 operands (dO, V, K, Q, P and dS rounded), float32 sums and
// softmax gradient.
template <typename Tiles>
void BackwardPairTiled(const Shape& s, const float* q, const float* k,
                       const float* v, const float* p, const float* dout,
                       float* dq, float* dk, float* dv) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  const int64_t tqt = RoundUpTo(tq, 16), tqd = RoundUpTo(tq, 32),
                dd = RoundUpTo(d, 32), tkd = RoundUpTo(tkp, 32);
  // Operands (words): A (d x tqd or tqt x dd bfloat16), B (pair rows:
  // tkd/2 of d, tqd/2 or dd/2 of tkp), dS as rows (tqt x tkd bfloat16) and
  // as pairs of rows (tqd/2 x tkp); results: dP (tqt x tkp floats) and one
  // product (d x tkp or tqt x d).
  const int64_t an = std::max(d * tqd, tqt * dd) / 2,
                bn = std::max(tkd / 2 * d, std::max(tqd, dd) / 2 * tkp),
                rows_n = tqt * tkd / 2, pairs_n = tqd / 2 * tkp;
  uint32_t* a = TileScratch(an + bn + rows_n + pairs_n + tqt * tkp +
                            std::max(tkp, tqt) * d);
  uint32_t* b = a + an;
  uint16_t* ds_rows = reinterpret_cast<uint16_t*>(b + bn);
  uint32_t* ds_pairs = b + bn + rows_n;
  float* dp = reinterpret_cast<float*>(ds_pairs + pairs_n);
  float* product = dp + tqt * tkp;
  uint16_t* a16 = reinterpret_cast<uint16_t*>(a);
  const Tiles tiles{};
  // dV = (dO^T P)^T: of the two operands contracted over their rows, the
  // narrower one (dO, not P) is the one transposed.
  ToBfloat16Transposed(tq, d, dout, s.o_row, d, tqd, a16);
  PairRows(tq, tkp, p, tkp, tqd / 2, b);
  tiles.Product(d / 16, tkp / 16, tqd, a16, tqd * 2, b, tkp * 4, product,
                tkp);
  StoreTransposed(d, tk, product, tkp, dv, s.kv_row);
  // dP = dO V^T, then dS rounded as both products read it
  ToBfloat16Rows(tq, d, dout, s.o_row, tqt, dd, a16);
  PairColumns(tk, d, v, d, dd / 2, tkp, b);
  tiles.Product(tqt / 16, tkp / 16, dd, a16, dd * 2, b, tkp * 4, dp, tkp);
  SoftmaxGradientToBfloat16(tq, tkp, s.scale, p, dp, tkd, ds_rows, ds_pairs);
  std::fill(ds_rows + tq * tkd, ds_rows + tqt * tkd, uint16_t{0});
  std::fill(ds_pairs + (tq + 1) / 2 * tkp, ds_pairs + pairs_n, 0u);
  // dQ = dS K
  PairRows(tk, d, k, d, tkd / 2, b);
  ProductRows(tiles, tq, d / 16, tkd, ds_rows, tkd * 2, b, d * 4, dq, s.q_row,
              product);
  // dK = (Q^T dS)^T, the same way round
  ToBfloat16Transposed(tq, d, q, d, d, tqd, a16);
  tiles.Product(d / 16, tkp / 16, tqd, a16, tqd * 2, ds_pairs, tkp * 4,
                product, tkp);
  StoreTransposed(d, tk, product, tkp, dk, s.kv_row);
}

// Which passes run (the file's first comment says why): AMX's where the
// CPU has AMX and Linux grants it, AVX512_BF16's dots on AMD's CPUs, the
// float32 products of the rounded values elsewhere.
enum class Engine { kAmx, kDots, kFloat32 };

Engine ChooseEngine() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (AmxGranted()) return Engine::kAmx;
#endif
  __builtin_cpu_init();  // needed where a library's constructors run first
  return __builtin_cpu_is("amd") ? Engine::kDots : Engine::kFloat32;
}

Engine TheEngine() {
  static const Engine engine = ChooseEngine();
  return engine;
}

void ForwardPairBf16(const Shape& s, const float* q, const float* k,
                     const float* v, float* o, float* p) {
  switch (TheEngine()) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    case Engine::kAmx:
      return ForwardPairTiled<AmxTiles>(s, q, k, v, o, p);
#endif
    case Engine::kDots:
      return ForwardPairTiled<DotTiles>(s, q, k, v, o, p);
    default:
      return ForwardPairRounded(s, q, k, v, o, p);
  }
}

void BackwardPairBf16(const Shape& s, const float* q, const float* k,
                      const float* v, const float* p, const float* dout,
                      float* dq, float* dk, float* dv) {
  switch (TheEngine()) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    case Engine::kAmx:
      return BackwardPairTiled<AmxTiles>(s, q, k, v, p, dout, dq, dk, dv);
#endif
    case Engine::kDots:
      return BackwardPairTiled<DotTiles>(s, q, k, v, p, dout, dq, dk, dv);
    default:
      return BackwardPairRounded(s, q, k, v, p, dout, dq, dk, dv);
  }
}
#else
void ForwardPairBf16(const Shape& s, const float* q, const float* k,
                     const float* v, float* o, float* p) {
  ForwardPairRounded(s, q, k, v, o, p);
}

void BackwardPairBf16(const Shape& s, const float* q, const float* k,
                      const float* v, const float* p, const float* dout,
                      float* dq, float* dk, float* dv) {
  BackwardPairRounded(s, q, k, v, p, dout, dq, dk, dv);
}
#endif

}  // namespace

VIT_ATTENTION_HANDLERS(Bf16, ForwardPairBf16, BackwardPairBf16);
