// The attention core softmax(s Q K^T) V and its gradient for XLA:CPU, as XLA
// FFI handlers. Built and loaded by vit_jax/cpu_attention.py (see there for
// why it exists and when it is used).
//
// Layout (attention_core.h, Shape): a pair's q, k and v contiguous rows of D
// floats (attention_handlers.h copies them out of the projections, their
// bias added); its output and the gradients written, and the output's
// gradient read, in the token-major arrays (rows q_row, kv_row and o_row
// floats apart), float32; the logits are scaled by s.scale. The
// probabilities p that the backward pass reads are (B, H, Tq, Tk_padded):
// each row padded with zeros to a multiple of 16 columns, so every product
// below runs on whole vectors.
//
// Each (batch, head) pair is one task: its operands (~0.3 MB at 197 tokens)
// stay in L2 through the two products and the softmax of the forward pass,
// or the four products and the softmax gradient of the backward pass. The
// products are register-blocked: a tile of ROWS rows by VECTORS hardware
// vectors is accumulated in registers over the whole contraction and stored
// once. The pieces shared with attention_bf16_cpu.cc are in
// attention_core.h.

#include "attention_handlers.h"

namespace {

void ForwardPair(const Shape& s, const float* q, const float* k, const float* v,
                 float* o, float* p) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  std::vector<float>& scratch = Scratch(d * tkp + (p ? 0 : tq * tkp));
  float* kt = scratch.data();
  if (p == nullptr) p = kt + d * tkp;
  Transpose(tk, d, k, d, tkp, kt);
  Product(tq, tkp, d, q, d, 1, kt, tkp, p, tkp);
  Softmax(tq, tk, tkp, s.scale, p);
  Product(tq, d, tk, p, tkp, 1, v, d, o, s.o_row);
}

void BackwardPair(const Shape& s, const float* q, const float* k,
                  const float* v, const float* p, const float* dout, float* dq,
                  float* dk, float* dv) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  std::vector<float>& scratch = Scratch(d * tkp + tq * tkp);
  float* vt = scratch.data();
  float* ds = vt + d * tkp;
  Transpose(tk, d, v, d, tkp, vt);
  Product(tq, tkp, d, dout, s.o_row, 1, vt, tkp, ds, tkp);  // dP = dO V^T
  // The softmax gradient reads P row by row, so P (in memory since the
  // forward pass) is in cache for dV's product, which reads it by columns:
  // 5% less time for the pass than with dV first.
  SoftmaxGradient(tq, tkp, s.scale, p, ds);  // dS, of the unscaled logits
  Product(tk, d, tq, p, 1, tkp, dout, s.o_row, dv, s.kv_row);  // dV = P^T dO
  Product(tq, d, tk, ds, tkp, 1, k, d, dq, s.q_row);  // dQ = dS K
  Product(tk, d, tq, ds, 1, tkp, q, d, dk, s.kv_row);  // dK = dS^T Q
}

}  // namespace

VIT_ATTENTION_HANDLERS(, ForwardPair, BackwardPair);
