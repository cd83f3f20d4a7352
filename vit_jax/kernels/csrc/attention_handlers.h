// The attention kernels' XLA FFI handlers over a pair's forward and
// backward functions: each call's pairs run as tasks (parallel_tasks.h).
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

// dk and dv (rows x columns, leading dimension ld) = the sums of `blocks`
// blocks' parts, each a contiguous (rows x columns) dk then dv.
void SumBlocks(int64_t rows, int64_t columns, int64_t blocks,
               const float* parts, int64_t ld, float* dk, float* dv) {
  const int64_t size = rows * columns;
  for (int64_t which = 0; which < 2; ++which) {
    float* out = which == 0 ? dk : dv;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < columns; c += kLanes) {
        Vec sum = Load(parts + which * size + r * columns + c);
        for (int64_t b = 1; b < blocks; ++b)
          sum += Load(parts + (2 * b + which) * size + r * columns + c);
        Store(out + r * ld + c, sum);
      }
  }
}

// A pair's queries [start, start + length) and its keys and values with
// their bias, contiguous: q (length x D), k and v (Tk x D each), in this
// thread's scratch (valid until its next block).
struct BiasedPair {
  const float *q, *k, *v;
};

BiasedPair WithBias(const Shape& s, const Operands& in, int64_t i,
                    int64_t start, int64_t length) {
  const int64_t d = s.head_dim, tk = s.key_tokens;
  thread_local std::vector<float> scratch;
  if (scratch.size() < size_t((length + 2 * tk) * d))
    scratch.resize((length + 2 * tk) * d);
  float* q = scratch.data();
  float* k = q + length * d;
  float* v = k + tk * d;
  const int64_t qo = PairOffset(s, i, s.query_tokens, s.q_row),
                ko = PairOffset(s, i, tk, s.kv_row);
  AddBias(length, d, in.q + qo + start * s.q_row, s.q_row,
          in.bias + BiasOffset(s, i, 0), q);
  AddBias(tk, d, in.k + ko, s.kv_row, in.bias + BiasOffset(s, i, 1), k);
  AddBias(tk, d, in.v + ko, s.kv_row, in.bias + BiasOffset(s, i, 2), v);
  return BiasedPair{q, k, v};
}

// Query rows a block starts on a multiple of (the bfloat16 kernel's tiles
// are 16 rows), and what a block costs beyond its rows, in rows: its copy
// of the keys and values with their bias, and their transpose.
constexpr int64_t kQueryAlign = 16, kBlockOverheadRows = 4;

// The blocks each pair's queries are split into, so that a call's tasks
// (pairs x blocks) end together on its threads: one block, the whole pair,
// unless the pairs alone leave threads idle at the end. One image's 3 heads
// on 2 threads ran 2 pairs on one and 1 on the other; as 6 half pairs, 3
// each. The count minimises rounds of tasks x rows a task.
Blocks QueryBlocks(const Shape& s, const ffi::ThreadPool& pool) {
  const int64_t pairs = s.batch * s.heads, tq = s.query_tokens,
                workers = std::max<int64_t>(
                    1, std::min<int64_t>(pool.num_threads(), s.threads));
  Blocks best(tq, 1, kQueryAlign);
  int64_t best_cost = INT64_MAX;
  for (int64_t split = 1; split <= std::min<int64_t>(workers, tq / kQueryAlign);
       ++split) {
    const Blocks blocks(tq, split, kQueryAlign);
    const int64_t rounds = (pairs * blocks.count() + workers - 1) / workers;
    const int64_t cost =
        rounds * (blocks.Length(blocks.count() - 1) + kBlockOverheadRows);
    if (cost < best_cost) best = blocks, best_cost = cost;
  }
  return best;
}

// The shape a block of `length` queries runs as, writing its keys' and
// values' gradients kv_row floats apart.
Shape BlockShape(const Shape& s, int64_t length, int64_t kv_row) {
  Shape block = s;
  block.query_tokens = length;
  block.kv_row = kv_row;
  return block;
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

// A call's pairs' q, k, v, output and probabilities (the latter written
// twice over in the backward pass, with the gradients), and their two
// products (four in the backward pass): an estimate of its time.
CallCost AttentionCost(const Shape& s, int64_t passes) {
  const int64_t pairs = s.batch * s.heads, tq = s.query_tokens,
                tk = s.key_tokens, d = s.head_dim;
  return {passes * pairs * 4 * ((2 * tq + 2 * tk) * d + tq * s.padded_keys),
          passes * pairs * 4 * tq * tk * d};
}

// The forward pass of every pair, a block of its queries to a task. p is
// null for inference: the probabilities then stay in scratch.
void Forward(ffi::ThreadPool& pool, const Shape& s, const Operands& in,
             float* o, float* p, ForwardPairFunction forward_pair) {
  const int64_t tq = s.query_tokens;
  CallCost cost = AttentionCost(s, 1);
  cost.helpers = p == nullptr;  // inference's call, not training's
  ForEachBlock(pool, cost, s.batch * s.heads,
               QueryBlocks(s, pool),
               [=](int64_t i, int64_t start, int64_t length) {
    const BiasedPair pair = WithBias(s, in, i, start, length);
    forward_pair(BlockShape(s, length, s.kv_row), pair.q, pair.k, pair.v,
                 o + PairOffset(s, i, tq, s.o_row) + start * s.o_row,
                 p ? p + (i * tq + start) * s.padded_keys : nullptr);
  }, s.threads);
}

// Pair i's part of the bias's gradient (B, 3, H, D): its dq's, dk's and
// dv's sums over their tokens.
void BiasGradient(const Shape& s, int64_t i, const float* dq, const float* dk,
                  const float* dv, float* dbias) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                qo = PairOffset(s, i, tq, s.q_row),
                ko = PairOffset(s, i, tk, s.kv_row);
  ColumnSums(tq, d, dq + qo, s.q_row, dbias + BiasOffset(s, i, 0));
  ColumnSums(tk, d, dk + ko, s.kv_row, dbias + BiasOffset(s, i, 1));
  ColumnSums(tk, d, dv + ko, s.kv_row, dbias + BiasOffset(s, i, 2));
}

// The backward pass of every pair: dq, dk and dv at the offsets of q, k
// and v, and the bias's gradient. A block of a pair's queries to a task
// (QueryBlocks); where a pair has several, each block's part of dk and dv
// goes to scratch, and a second pass over the pairs adds them up.
void Backward(ffi::ThreadPool& pool, const Shape& s, const Operands& in,
              const float* p, const float* dout, float* dq, float* dk,
              float* dv, float* dbias, BackwardPairFunction backward_pair) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                pairs = s.batch * s.heads;
  const Blocks blocks = QueryBlocks(s, pool);
  const int64_t split = blocks.count(), kv = tk * d;
  // Per pair and block: its dk, then its dv, (Tk x D) each.
  std::vector<float> scratch(split > 1 ? pairs * split * 2 * kv : 0);
  float* const parts = scratch.data();
  CallCost cost = AttentionCost(s, 2);
  cost.helpers = false;  // a train step's call
  ForEachBlock(pool, cost, pairs, blocks,
               [=](int64_t i, int64_t start, int64_t length) {
    const int64_t ko = PairOffset(s, i, tk, s.kv_row);
    const BiasedPair pair = WithBias(s, in, i, start, length);
    float* part = parts + (i * split + start / blocks.step) * 2 * kv;
    backward_pair(BlockShape(s, length, split > 1 ? d : s.kv_row), pair.q,
                  pair.k, pair.v, p + (i * tq + start) * s.padded_keys,
                  dout + PairOffset(s, i, tq, s.o_row) + start * s.o_row,
                  dq + PairOffset(s, i, tq, s.q_row) + start * s.q_row,
                  split > 1 ? part : dk + ko, split > 1 ? part + kv : dv + ko);
    if (split == 1) BiasGradient(s, i, dq, dk, dv, dbias);
  }, s.threads);
  if (split == 1) return;
  // Each pair's blocks' dk and dv read, its own written.
  const CallCost sums{4 * pairs * (split + 1) * 2 * kv, 0, false};
  ForEachTask(pool, sums, pairs, [=](int64_t i) {
    const int64_t ko = PairOffset(s, i, tk, s.kv_row);
    SumBlocks(tk, d, split, parts + i * split * 2 * kv, s.kv_row, dk + ko,
              dv + ko);
    BiasGradient(s, i, dq, dk, dv, dbias);
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
