// The attention core softmax(Q K^T) V and its gradient for XLA:CPU, as XLA
// FFI handlers. Built and loaded by vit_jax/cpu_attention.py (see there for
// why it exists and when it is used).
//
// Layout: q (B, H, Tq, D), k and v (B, H, Tk, D), float32, row major; q is
// already scaled by 1/sqrt(D). The probabilities p that the backward pass
// reads are (B, H, Tq, Tk_padded): each row padded with zeros to a multiple
// of 16 columns, so every product below runs on whole vectors.
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
  Transpose(tk, d, k, tkp, kt);
  Product(tq, tkp, d, q, d, 1, kt, tkp, p, tkp);
  Softmax(tq, tk, tkp, p);
  Product(tq, d, tk, p, tkp, 1, v, d, o, d);
}

void BackwardPair(const Shape& s, const float* q, const float* k,
                  const float* v, const float* p, const float* dout, float* dq,
                  float* dk, float* dv) {
  const int64_t d = s.head_dim, tq = s.query_tokens, tk = s.key_tokens,
                tkp = s.padded_keys;
  std::vector<float>& scratch = Scratch(d * tkp + tq * tkp);
  float* vt = scratch.data();
  float* ds = vt + d * tkp;
  Product(tk, d, tq, p, 1, tkp, dout, d, dv, d);  // dV = P^T dO
  Transpose(tk, d, v, tkp, vt);
  Product(tq, tkp, d, dout, d, 1, vt, tkp, ds, tkp);  // dP = dO V^T
  SoftmaxGradient(tq, tkp, p, ds);
  Product(tq, d, tk, ds, tkp, 1, k, d, dq, d);  // dQ = dS K
  Product(tk, d, tq, ds, 1, tkp, q, d, dk, d);  // dK = dS^T Q
}

}  // namespace

VIT_ATTENTION_HANDLERS(, ForwardPair, BackwardPair);
