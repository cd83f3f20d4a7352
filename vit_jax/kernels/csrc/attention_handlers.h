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
// gradients lie at the same offsets of the gradient arrays).
struct Operands {
  const float *q, *k, *v;
};

// Pair i's first row in an array of `tokens` tokens, rows `row` floats
// apart: pairs run over (batch, head), heads head_dim floats apart.
int64_t PairOffset(const Shape& s, int64_t i, int64_t tokens, int64_t row) {
  return i / s.heads * tokens * row + i % s.heads * s.head_dim;
}

// The shape of self-attention over projections (B, T, 3, H, D): q, k and
// v the three slots of each token's row.
ffi::Error PackedShape(const ffi::Buffer<ffi::F32>& qkv, float scale,
                       Shape* shape, Operands* operands) {
  auto dims = qkv.dimensions();
  if (dims.size() != 5 || dims[2] != 3 || dims[4] % kPad != 0 || scale <= 0)
    return ffi::Error::InvalidArgument(
        "vit_jax attention kernel: the projections must be (B, T, 3, H, D) "
        "with D a multiple of 16, and the scale positive");
  const int64_t width = dims[3] * dims[4];
  *shape = Shape{dims[0], dims[3], dims[1], dims[1], RoundUp(dims[1]),
                 dims[4], 3 * width, 3 * width, width, scale};
  const float* data = qkv.typed_data();
  *operands = Operands{data, data + width, data + 2 * width};
  return ffi::Error::Success();
}

// The shape of attention from queries (B, Tq, H, D) to keys and values
// (B, Tk, 2, H, D).
ffi::Error SplitShape(const ffi::Buffer<ffi::F32>& q,
                      const ffi::Buffer<ffi::F32>& kv, float scale,
                      Shape* shape, Operands* operands) {
  auto qd = q.dimensions(), kd = kv.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || kd[2] != 2 || qd[0] != kd[0] ||
      qd[2] != kd[3] || qd[3] != kd[4] || qd[3] % kPad != 0 || scale <= 0)
    return ffi::Error::InvalidArgument(
        "vit_jax attention kernel: q must be (B, Tq, H, D) and the keys and "
        "values (B, Tk, 2, H, D), with D a multiple of 16, and the scale "
        "positive");
  const int64_t width = qd[2] * qd[3];
  *shape = Shape{qd[0], qd[2], qd[1], kd[1], RoundUp(kd[1]), qd[3], width,
                 2 * width, width, scale};
  *operands = Operands{q.typed_data(), kv.typed_data(),
                       kv.typed_data() + width};
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
    const int64_t qo = PairOffset(s, i, s.query_tokens, s.q_row),
                  ko = PairOffset(s, i, s.key_tokens, s.kv_row);
    forward_pair(s, in.q + qo, in.k + ko, in.v + ko,
                 o + PairOffset(s, i, s.query_tokens, s.o_row),
                 p ? p + i * s.query_tokens * s.padded_keys : nullptr);
  });
}

// The backward pass of every pair: dq, dk and dv at the offsets of q, k
// and v.
void Backward(ffi::ThreadPool& pool, const Shape& s, const Operands& in,
              const float* p, const float* dout, float* dq, float* dk,
              float* dv, BackwardPairFunction backward_pair) {
  ForEachTask(pool, s.batch * s.heads, [=](int64_t i) {
    const int64_t qo = PairOffset(s, i, s.query_tokens, s.q_row),
                  ko = PairOffset(s, i, s.key_tokens, s.kv_row);
    backward_pair(s, in.q + qo, in.k + ko, in.v + ko,
                  p + i * s.query_tokens * s.padded_keys,
                  dout + PairOffset(s, i, s.query_tokens, s.o_row), dq + qo,
                  dk + ko, dv + ko);
  });
}

// The six XLA FFI handlers over a pair's forward and backward functions:
// self-attention over packed projections (B, T, 3, H, D), and attention
// from split queries (B, Tq, H, D) to keys and values (B, Tk, 2, H, D);
// outputs (B, Tq, H, D), probabilities (B, H, Tq, padded keys).
template <ForwardPairFunction kForwardPair>
ffi::Error PackedForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                         float scale, ffi::ResultBuffer<ffi::F32> o,
                         float* p) {
  Shape s;
  Operands in;
  if (ffi::Error error = PackedShape(qkv, scale, &s, &in); error.failure())
    return error;
  Forward(pool, s, in, o->typed_data(), p, kForwardPair);
  return ffi::Error::Success();
}

template <ForwardPairFunction kForwardPair>
ffi::Error PackedForTraining(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                             float scale, ffi::ResultBuffer<ffi::F32> o,
                             ffi::ResultBuffer<ffi::F32> p) {
  return PackedForward<kForwardPair>(pool, qkv, scale, o, p->typed_data());
}

template <ForwardPairFunction kForwardPair>
ffi::Error PackedForInference(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                              float scale, ffi::ResultBuffer<ffi::F32> o) {
  return PackedForward<kForwardPair>(pool, qkv, scale, o, nullptr);
}

template <BackwardPairFunction kBackwardPair>
ffi::Error PackedBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                          ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> dout,
                          float scale, ffi::ResultBuffer<ffi::F32> dqkv) {
  Shape s;
  Operands in;
  if (ffi::Error error = PackedShape(qkv, scale, &s, &in); error.failure())
    return error;
  float* d = dqkv->typed_data();
  const int64_t width = s.heads * s.head_dim;
  Backward(pool, s, in, p.typed_data(), dout.typed_data(), d, d + width,
           d + 2 * width, kBackwardPair);
  return ffi::Error::Success();
}

template <ForwardPairFunction kForwardPair>
ffi::Error SplitForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                        ffi::Buffer<ffi::F32> kv, float scale,
                        ffi::ResultBuffer<ffi::F32> o, float* p) {
  Shape s;
  Operands in;
  if (ffi::Error error = SplitShape(q, kv, scale, &s, &in); error.failure())
    return error;
  Forward(pool, s, in, o->typed_data(), p, kForwardPair);
  return ffi::Error::Success();
}

template <ForwardPairFunction kForwardPair>
ffi::Error SplitForTraining(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> kv, float scale,
                            ffi::ResultBuffer<ffi::F32> o,
                            ffi::ResultBuffer<ffi::F32> p) {
  return SplitForward<kForwardPair>(pool, q, kv, scale, o, p->typed_data());
}

template <ForwardPairFunction kForwardPair>
ffi::Error SplitForInference(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> kv, float scale,
                             ffi::ResultBuffer<ffi::F32> o) {
  return SplitForward<kForwardPair>(pool, q, kv, scale, o, nullptr);
}

template <BackwardPairFunction kBackwardPair>
ffi::Error SplitBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<ffi::F32> kv, ffi::Buffer<ffi::F32> p,
                         ffi::Buffer<ffi::F32> dout, float scale,
                         ffi::ResultBuffer<ffi::F32> dq,
                         ffi::ResultBuffer<ffi::F32> dkv) {
  Shape s;
  Operands in;
  if (ffi::Error error = SplitShape(q, kv, scale, &s, &in); error.failure())
    return error;
  float* d = dkv->typed_data();
  Backward(pool, s, in, p.typed_data(), dout.typed_data(), dq->typed_data(),
           d, d + s.heads * s.head_dim, kBackwardPair);
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
          .Attr<float>("scale")                                              \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionPackedForInference##SUFFIX,                                \
      PackedForInference<FORWARD_PAIR>,                                      \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionPackedBackward##SUFFIX, PackedBackward<BACKWARD_PAIR>,     \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionSplitForTraining##SUFFIX, SplitForTraining<FORWARD_PAIR>,  \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionSplitForInference##SUFFIX,                                 \
      SplitForInference<FORWARD_PAIR>,                                       \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionSplitBackward##SUFFIX, SplitBackward<BACKWARD_PAIR>,       \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Attr<float>("scale")                                              \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>())

#endif  // VIT_JAX_KERNELS_CSRC_ATTENTION_HANDLERS_H_
