// The attention kernels' XLA FFI handlers over a pair's forward and
// backward functions: each call's pairs run on XLA's intra-op threads.
// Internal to attention_cpu.cc and attention_bf16_cpu.cc, which define
// their handlers with VIT_ATTENTION_HANDLERS.

#ifndef VIT_JAX_KERNELS_CSRC_ATTENTION_HANDLERS_H_
#define VIT_JAX_KERNELS_CSRC_ATTENTION_HANDLERS_H_

#include "attention_core.h"
#include "parallel_tasks.h"

namespace {

// A call's operands: where pair 0's queries, keys and values start (their
// gradients lie at the same offsets of the gradient arrays), and the
// projections' bias (B, 3, H, D): slot 0 the queries', 1 the keys', 2 the
// values' (one copy per batch element, which the partitioner splits with
// the batch; its gradient is per batch element too).
struct Operands {
  const float *q, *k, *v, *bias;
};

// Pair i's first row in an array of `tokens` tokens, rows `row` floats
// apart: pairs run over (batch, head), heads head_dim floats apart.
int64_t PairOffset(const Shape& s, int64_t i, int64_t tokens, int64_t row) {
  return i / s.heads * tokens * row + i % s.heads * s.head_dim;
}

// Pair i's bias of slot (0 q, 1 k, 2 v) in a (B, 3, H, D) array.
int64_t BiasOffset(const Shape& s, int64_t i, int64_t slot) {
  return ((i / s.heads * 3 + slot) * s.heads + i % s.heads) * s.head_dim;
}

// out (rows x columns, contiguous) = x (leading dimension ld) + bias per
// row; columns a multiple of kLanes.
void AddBias(int64_t rows, int64_t columns, const float* x, int64_t ld,
             const float* bias, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; c += kLanes)
      Store(out + r * columns + c, Load(x + r * ld + c) + Load(bias + c));
}

// sums[c] = sum over the rows of x (leading dimension ld) of x[r, c].
void ColumnSums(int64_t rows, int64_t columns, const float* x, int64_t ld,
                float* sums) {
  for (int64_t c = 0; c < columns; c += kLanes) {
    Vec sum{};
    for (int64_t r = 0; r < rows; ++r) sum += Load(x + r * ld + c);
    Store(sums + c, sum);
  }
}

// A pair's q, k and v with their bias, contiguous: q (Tq x D), k and v
// (Tk x D each), in this thread's scratch (valid until its next pair).
struct BiasedPair {
  const float *q, *k, *v;
};

BiasedPair WithBias(const Shape& s, const Operands& in, int64_t i) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens;
  thread_local std::vector<float> scratch;
  if (scratch.size() < size_t((tq + 2 * tk) * d))
    scratch.resize((tq + 2 * tk) * d);
  float* q = scratch.data();
  float* k = q + tq * d;
  float* v = k + tk * d;
  const int64_t qo = PairOffset(s, i, tq, s.q_row),
                ko = PairOffset(s, i, tk, s.kv_row);
  AddBias(tq, d, in.q + qo, s.q_row, in.bias + BiasOffset(s, i, 0), q);
  AddBias(tk, d, in.k + ko, s.kv_row, in.bias + BiasOffset(s, i, 1), k);
  AddBias(tk, d, in.v + ko, s.kv_row, in.bias + BiasOffset(s, i, 2), v);
  return BiasedPair{q, k, v};
}

// The shape of self-attention over projections (B, T, 3, H, D): q, k and
// v the three slots of each token's row.
ffi::Error PackedShape(const ffi::Buffer<ffi::F32>& qkv,
                       const ffi::Buffer<ffi::F32>& bias, float scale,
                       int64_t threads, Shape* shape, Operands* operands) {
  auto dims = qkv.dimensions(), bd = bias.dimensions();
  if (dims.size() != 5 || dims[2] != 3 || dims[4] % kPad != 0 ||
      bd.size() != 4 || bd[0] != dims[0] || bd[1] != 3 || bd[2] != dims[3] ||
      bd[3] != dims[4] || scale <= 0)
    return ffi::Error::InvalidArgument(
        "vit_jax attention kernel: the projections must be (B, T, 3, H, D) "
        "with D a multiple of 16, the bias (B, 3, H, D), and the scale "
        "positive");
  const int64_t width = dims[3] * dims[4];
  *shape = Shape{dims[0], dims[3], dims[1], dims[1], RoundUp(dims[1]),
                 dims[4], 3 * width, 3 * width, width, scale, threads};
  const float* data = qkv.typed_data();
  *operands = Operands{data, data + width, data + 2 * width,
                       bias.typed_data()};
  return ffi::Error::Success();
}

// The shape of attention from queries (B, Tq, H, D) to keys and values
// (B, Tk, 2, H, D).
ffi::Error SplitShape(const ffi::Buffer<ffi::F32>& q,
                      const ffi::Buffer<ffi::F32>& kv,
                      const ffi::Buffer<ffi::F32>& bias, float scale,
                      int64_t threads, Shape* shape, Operands* operands) {
  auto qd = q.dimensions(), kd = kv.dimensions(), bd = bias.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || kd[2] != 2 || qd[0] != kd[0] ||
      qd[2] != kd[3] || qd[3] != kd[4] || qd[3] % kPad != 0 ||
      bd.size() != 4 || bd[0] != qd[0] || bd[1] != 3 || bd[2] != qd[2] ||
      bd[3] != qd[3] || scale <= 0)
    return ffi::Error::InvalidArgument(
        "vit_jax attention kernel: q must be (B, Tq, H, D), the keys and "
        "values (B, Tk, 2, H, D), with D a multiple of 16, the bias "
        "(B, 3, H, D), and the scale positive");
  const int64_t width = qd[2] * qd[3];
  *shape = Shape{qd[0], qd[2], qd[1], kd[1], RoundUp(kd[1]), qd[3], width,
                 2 * width, width, scale, threads};
  *operands = Operands{q.typed_data(), kv.typed_data(),
                       kv.typed_data() + width, bias.typed_data()};
  return ffi::Error::Success();
}

// A pair's forward pass: (shape, q, k, v) -> o and, unless p is null, the
// probabilities.
typedef void (*ForwardPairFunction)(const Shape&, const float*, const float*,
                                    const float*, float*, float*);
// A pair's backward pass: (shape, q, k, v, p, dO) -> dQ, dK, dV.
typedef void (*BackwardPairFunction)(const Shape&, const float*, const float*,
                                     const float*, const float*, const float*,
                                     float*, float*, float*);

// The forward pass of every pair. p is null for inference: the
// probabilities then stay in scratch.
void Forward(ffi::ThreadPool& pool, const Shape& s, const Operands& in,
             float* o, float* p, ForwardPairFunction forward_pair) {
  ForEachTask(pool, s.batch * s.heads, [=](int64_t i) {
    const BiasedPair pair = WithBias(s, in, i);
    forward_pair(s, pair.q, pair.k, pair.v,
                 o + PairOffset(s, i, s.query_tokens, s.o_row),
                 p ? p + i * s.query_tokens * s.padded_keys : nullptr);
  }, s.threads);
}

// The backward pass of every pair: dq, dk and dv at the offsets of q, k
// and v, and the bias's gradient (B, 3, H, D) summed over each batch
// element's tokens.
void Backward(ffi::ThreadPool& pool, const Shape& s, const Operands& in,
              const float* p, const float* dout, float* dq, float* dk,
              float* dv, float* dbias, BackwardPairFunction backward_pair) {
  ForEachTask(pool, s.batch * s.heads, [=](int64_t i) {
    const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                  qo = PairOffset(s, i, tq, s.q_row),
                  ko = PairOffset(s, i, tk, s.kv_row);
    const BiasedPair pair = WithBias(s, in, i);
    backward_pair(s, pair.q, pair.k, pair.v, p + i * tq * s.padded_keys,
                  dout + PairOffset(s, i, tq, s.o_row), dq + qo, dk + ko,
                  dv + ko);
    ColumnSums(tq, d, dq + qo, s.q_row, dbias + BiasOffset(s, i, 0));
    ColumnSums(tk, d, dk + ko, s.kv_row, dbias + BiasOffset(s, i, 1));
    ColumnSums(tk, d, dv + ko, s.kv_row, dbias + BiasOffset(s, i, 2));
  }, s.threads);
}

// The six XLA FFI handlers over a pair's forward and backward functions:
// self-attention over packed projections (B, T, 3, H, D), and attention
// from split queries (B, Tq, H, D) to keys and values (B, Tk, 2, H, D),
// each with the projections' bias (B, 3, H, D); outputs (B, Tq, H, D),
// probabilities (B, H, Tq, padded keys). Attributes: the logits' scale and
// the threads the pairs run on (Shape).
template <ForwardPairFunction kForwardPair>
ffi::Error PackedForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                         ffi::Buffer<ffi::F32> bias, float scale,
                         int64_t threads, ffi::ResultBuffer<ffi::F32> o,
                         float* p) {
  Shape s;
  Operands in;
  if (ffi::Error error = PackedShape(qkv, bias, scale, threads, &s, &in);
      error.failure())
    return error;
  Forward(pool, s, in, o->typed_data(), p, kForwardPair);
  return ffi::Error::Success();
}

template <ForwardPairFunction kForwardPair>
ffi::Error PackedForTraining(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                             ffi::Buffer<ffi::F32> bias, float scale,
                             int64_t threads, ffi::ResultBuffer<ffi::F32> o,
                             ffi::ResultBuffer<ffi::F32> p) {
  return PackedForward<kForwardPair>(pool, qkv, bias, scale, threads, o,
                                     p->typed_data());
}

template <ForwardPairFunction kForwardPair>
ffi::Error PackedForInference(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                              ffi::Buffer<ffi::F32> bias, float scale,
                              int64_t threads,
                              ffi::ResultBuffer<ffi::F32> o) {
  return PackedForward<kForwardPair>(pool, qkv, bias, scale, threads, o,
                                     nullptr);
}

template <BackwardPairFunction kBackwardPair>
ffi::Error PackedBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                          ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> p,
                          ffi::Buffer<ffi::F32> dout, float scale,
                          int64_t threads, ffi::ResultBuffer<ffi::F32> dqkv,
                          ffi::ResultBuffer<ffi::F32> dbias) {
  Shape s;
  Operands in;
  if (ffi::Error error = PackedShape(qkv, bias, scale, threads, &s, &in);
      error.failure())
    return error;
  float* d = dqkv->typed_data();
  const int64_t width = s.heads * s.head_dim;
  Backward(pool, s, in, p.typed_data(), dout.typed_data(), d, d + width,
           d + 2 * width, dbias->typed_data(), kBackwardPair);
  return ffi::Error::Success();
}

template <ForwardPairFunction kForwardPair>
ffi::Error SplitForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                        ffi::Buffer<ffi::F32> kv, ffi::Buffer<ffi::F32> bias,
                        float scale, int64_t threads,
                        ffi::ResultBuffer<ffi::F32> o, float* p) {
  Shape s;
  Operands in;
  if (ffi::Error error = SplitShape(q, kv, bias, scale, threads, &s, &in);
      error.failure())
    return error;
  Forward(pool, s, in, o->typed_data(), p, kForwardPair);
  return ffi::Error::Success();
}

template <ForwardPairFunction kForwardPair>
ffi::Error SplitForTraining(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> kv,
                            ffi::Buffer<ffi::F32> bias, float scale,
                            int64_t threads, ffi::ResultBuffer<ffi::F32> o,
                            ffi::ResultBuffer<ffi::F32> p) {
  return SplitForward<kForwardPair>(pool, q, kv, bias, scale, threads, o,
                                    p->typed_data());
}

template <ForwardPairFunction kForwardPair>
ffi::Error SplitForInference(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> kv,
                             ffi::Buffer<ffi::F32> bias, float scale,
                             int64_t threads,
                             ffi::ResultBuffer<ffi::F32> o) {
  return SplitForward<kForwardPair>(pool, q, kv, bias, scale, threads, o,
                                    nullptr);
}

template <BackwardPairFunction kBackwardPair>
ffi::Error SplitBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<ffi::F32> kv, ffi::Buffer<ffi::F32> bias,
                         ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> dout,
                         float scale, int64_t threads,
                         ffi::ResultBuffer<ffi::F32> dq,
                         ffi::ResultBuffer<ffi::F32> dkv,
                         ffi::ResultBuffer<ffi::F32> dbias) {
  Shape s;
  Operands in;
  if (ffi::Error error = SplitShape(q, kv, bias, scale, threads, &s, &in);
      error.failure())
    return error;
  float* d = dkv->typed_data();
  Backward(pool, s, in, p.typed_data(), dout.typed_data(), dq->typed_data(),
           d, d + s.heads * s.head_dim, dbias->typed_data(), kBackwardPair);
  return ffi::Error::Success();
}

}  // namespace

// Defines the handlers VitAttention{Packed,Split}{ForTraining,
// ForInference,Backward}<SUFFIX> (the names cpu_build.TARGETS lists) over a
// pair's forward and backward functions.
#define VIT_ATTENTION_HANDLERS(SUFFIX, FORWARD_PAIR, BACKWARD_PAIR)          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionPackedForTraining##SUFFIX,                                 \
      PackedForTraining<FORWARD_PAIR>,                                       \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Attr<int64_t>("threads")                                          \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionPackedForInference##SUFFIX,                                \
      PackedForInference<FORWARD_PAIR>,                                      \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Attr<int64_t>("threads")                                          \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionPackedBackward##SUFFIX,                                    \
      PackedBackward<BACKWARD_PAIR>,                                         \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Attr<int64_t>("threads")                                          \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionSplitForTraining##SUFFIX,                                  \
      SplitForTraining<FORWARD_PAIR>,                                        \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Attr<int64_t>("threads")                                          \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionSplitForInference##SUFFIX,                                 \
      SplitForInference<FORWARD_PAIR>,                                       \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Attr<int64_t>("threads")                                          \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionSplitBackward##SUFFIX,                                     \
      SplitBackward<BACKWARD_PAIR>,                                          \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Attr<int64_t>("threads")                                          \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>())

#endif  // VIT_JAX_KERNELS_CSRC_ATTENTION_HANDLERS_H_
