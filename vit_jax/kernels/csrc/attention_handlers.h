// The attention kernels' XLA FFI handlers over a pair's forward and
// backward functions: each call's pairs run on XLA's intra-op threads.
// Internal to attention_cpu.cc and attention_bf16_cpu.cc, which define
// their handlers with VIT_ATTENTION_HANDLERS.

#ifndef VIT_JAX_KERNELS_CSRC_ATTENTION_HANDLERS_H_
#define VIT_JAX_KERNELS_CSRC_ATTENTION_HANDLERS_H_

#include "attention_core.h"
#include "parallel_tasks.h"

namespace {

ffi::Error ShapeOf(const ffi::Buffer<ffi::F32>& q,
                   const ffi::Buffer<ffi::F32>& k, Shape* shape) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[1] != kd[1] ||
      qd[3] != kd[3] || qd[3] % kPad != 0)
    return ffi::Error::InvalidArgument(
        "vit_jax attention kernel: q must be (B, H, Tq, D) and k, v "
        "(B, H, Tk, D) with D a multiple of 16");
  *shape = Shape{qd[0] * qd[1], qd[2], kd[2], RoundUp(kd[2]), qd[3]};
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
ffi::Error Forward(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& q,
                   const ffi::Buffer<ffi::F32>& k,
                   const ffi::Buffer<ffi::F32>& v, float* o, float* p,
                   ForwardPairFunction forward_pair) {
  Shape s;
  if (ffi::Error error = ShapeOf(q, k, &s); error.failure()) return error;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  ForEachTask(pool, s.pairs, [=](int64_t i) {
    const int64_t qo = i * s.query_tokens * s.head_dim,
                  ko = i * s.key_tokens * s.head_dim;
    forward_pair(s, qp + qo, kp + ko, vp + ko, o + qo,
                 p ? p + i * s.query_tokens * s.padded_keys : nullptr);
  });
  return ffi::Error::Success();
}

// The backward pass of every pair.
ffi::Error Backward(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& q,
                    const ffi::Buffer<ffi::F32>& k,
                    const ffi::Buffer<ffi::F32>& v,
                    const ffi::Buffer<ffi::F32>& p,
                    const ffi::Buffer<ffi::F32>& dout, float* dq, float* dk,
                    float* dv, BackwardPairFunction backward_pair) {
  Shape s;
  if (ffi::Error error = ShapeOf(q, k, &s); error.failure()) return error;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(),
              *pp = p.typed_data(), *gp = dout.typed_data();
  ForEachTask(pool, s.pairs, [=](int64_t i) {
    const int64_t qo = i * s.query_tokens * s.head_dim,
                  ko = i * s.key_tokens * s.head_dim,
                  po = i * s.query_tokens * s.padded_keys;
    backward_pair(s, qp + qo, kp + ko, vp + ko, pp + po, gp + qo, dq + qo,
                  dk + ko, dv + ko);
  });
  return ffi::Error::Success();
}

// The three XLA FFI handlers over a pair's forward and backward functions.
template <ForwardPairFunction kForwardPair>
ffi::Error ForwardForTraining(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                              ffi::ResultBuffer<ffi::F32> o,
                              ffi::ResultBuffer<ffi::F32> p) {
  return Forward(pool, q, k, v, o->typed_data(), p->typed_data(),
                 kForwardPair);
}

template <ForwardPairFunction kForwardPair>
ffi::Error ForwardForInference(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::ResultBuffer<ffi::F32> o) {
  return Forward(pool, q, k, v, o->typed_data(), nullptr, kForwardPair);
}

template <BackwardPairFunction kBackwardPair>
ffi::Error BackwardForTraining(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::Buffer<ffi::F32> p,
                               ffi::Buffer<ffi::F32> dout,
                               ffi::ResultBuffer<ffi::F32> dq,
                               ffi::ResultBuffer<ffi::F32> dk,
                               ffi::ResultBuffer<ffi::F32> dv) {
  return Backward(pool, q, k, v, p, dout, dq->typed_data(), dk->typed_data(),
                  dv->typed_data(), kBackwardPair);
}

}  // namespace

// Defines the handlers VitAttentionForwardForTraining<SUFFIX>,
// VitAttentionForwardForInference<SUFFIX> and VitAttentionBackward<SUFFIX>
// (the names cpu_build.TARGETS lists) over a pair's forward and backward
// functions.
#define VIT_ATTENTION_HANDLERS(SUFFIX, FORWARD_PAIR, BACKWARD_PAIR)          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionForwardForTraining##SUFFIX,                                \
      ForwardForTraining<FORWARD_PAIR>,                                      \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionForwardForInference##SUFFIX,                               \
      ForwardForInference<FORWARD_PAIR>,                                     \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>());                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      VitAttentionBackward##SUFFIX, BackwardForTraining<BACKWARD_PAIR>,      \
      ffi::Ffi::Bind()                                                       \
          .Ctx<ffi::ThreadPool>()                                            \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Arg<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>()                                      \
          .Ret<ffi::Buffer<ffi::F32>>())

#endif  // VIT_JAX_KERNELS_CSRC_ATTENTION_HANDLERS_H_
