// Checks the CPU attention kernel's arithmetic for one (batch, head) pair
// against a double-precision reference, without JAX: the kernel's source is
// included whole, so this runs wherever the source compiles, e.g. built for
// aarch64 by a cross compiler and run under qemu (tests/kernels/
// test_cpu_attention.py), where the kernel's NEON tiles (4 floats, 6 x 4)
// are compiled as no x86 build compiles them.
//
// Prints one line per shape and exits 1 if any error exceeds the tolerance.

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "attention_cpu.cc"

namespace {

using Matrix = std::vector<double>;
constexpr double kTolerance = 3e-6;  // relative to the largest |value|

// The forward pass and gradient of softmax(scale q k^T) v in double
// precision; the operands contiguous.
struct Reference {
  Matrix p, o, dq, dk, dv;
};

Reference Compute(int64_t tq, int64_t tk, int64_t d, const std::vector<float>& q,
                  const std::vector<float>& k, const std::vector<float>& v,
                  const std::vector<float>& dout, double scale) {
  Reference r{Matrix(tq * tk), Matrix(tq * d), Matrix(tq * d), Matrix(tk * d),
              Matrix(tk * d)};
  Matrix ds(tq * tk);
  for (int64_t i = 0; i < tq; ++i) {
    double row_max = -INFINITY, sum = 0.0;
    for (int64_t j = 0; j < tk; ++j) {
      double s = 0.0;
      for (int64_t c = 0; c < d; ++c) s += double(q[i * d + c]) * k[j * d + c];
      r.p[i * tk + j] = s *= scale;
      row_max = std::max(row_max, s);
    }
    for (int64_t j = 0; j < tk; ++j)
      sum += r.p[i * tk + j] = std::exp(r.p[i * tk + j] - row_max);
    double dot = 0.0;
    for (int64_t j = 0; j < tk; ++j) {
      const double p = r.p[i * tk + j] /= sum;
      double dp = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        r.o[i * d + c] += p * v[j * d + c];
        dp += double(dout[i * d + c]) * v[j * d + c];
      }
      ds[i * tk + j] = dp;
      dot += p * dp;
    }
    for (int64_t j = 0; j < tk; ++j) {
      const double p = r.p[i * tk + j];
      ds[i * tk + j] = scale * p * (ds[i * tk + j] - dot);
      for (int64_t c = 0; c < d; ++c) {
        r.dv[j * d + c] += p * dout[i * d + c];
        r.dq[i * d + c] += ds[i * tk + j] * k[j * d + c];
        r.dk[j * d + c] += ds[i * tk + j] * q[i * d + c];
      }
    }
  }
  return r;
}

// The largest |got - want| over the rows x columns of want, relative to
// want's largest |value|; got read with leading dimension got_ld (the
// kernel pads the probabilities' rows).
double MaxError(const float* got, int64_t got_ld, const Matrix& want,
                int64_t rows, int64_t columns) {
  double error = 0.0, scale = 0.0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < columns; ++j) {
      error = std::max(error, std::abs(got[i * got_ld + j] -
                                       want[i * columns + j]));
      scale = std::max(scale, std::abs(want[i * columns + j]));
    }
  return error / scale;
}

// rows x columns of x (contiguous) into a new array of rows ld floats apart
// (the rest NaN, which a read there would spread).
std::vector<float> Strided(const std::vector<float>& x, int64_t rows,
                           int64_t columns, int64_t ld) {
  std::vector<float> out(rows * ld, NAN);
  for (int64_t i = 0; i < rows; ++i)
    std::copy(x.begin() + i * columns, x.begin() + (i + 1) * columns,
              out.begin() + i * ld);
  return out;
}

bool Check(int64_t tq, int64_t tk, int64_t d, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  auto draw = [&](int64_t n, float scale) {
    std::vector<float> x(n);
    for (float& value : x) value = scale * normal(rng);
    return x;
  };
  // Logits of order 1-3 after the scale 1/sqrt(d), as in the model.
  const std::vector<float> q = draw(tq * d, 1.5f), k = draw(tk * d, 1.0f),
                           v = draw(tk * d, 1.0f), dout = draw(tq * d, 1.0f);
  const float scale = 1.0f / std::sqrt(float(d));
  // A pair reads its q, k and v contiguous (copied out of the projections
  // with their bias) and writes its output and gradients, and reads the
  // output's gradient, rows apart as in the model's layouts: the queries'
  // gradient and the output with other columns between rows, the keys'
  // and values' gradients interleaved in one array (dk then dv in each
  // row of 2d).
  const int64_t q_row = d + 16, kv_row = 2 * d, o_row = d + 32;
  const Shape s{1, 1, tq, tk, RoundUp(tk), d, q_row, kv_row, o_row, scale};
  const std::vector<float> douts = Strided(dout, tq, d, o_row);
  std::vector<float> o(tq * o_row), p(tq * s.padded_keys, NAN),
      dq(tq * q_row), dkv(tk * kv_row);
  ForwardPair(s, q.data(), k.data(), v.data(), o.data(), p.data());
  BackwardPair(s, q.data(), k.data(), v.data(), p.data(), douts.data(),
               dq.data(), dkv.data(), dkv.data() + d);
  const Reference r = Compute(tq, tk, d, q, k, v, dout, scale);

  double padding = 0.0;  // the probabilities' padded columns must be 0
  for (int64_t i = 0; i < tq; ++i)
    for (int64_t j = tk; j < s.padded_keys; ++j)
      padding = std::max(padding, double(std::abs(p[i * s.padded_keys + j])));
  const double errors[] = {
      MaxError(p.data(), s.padded_keys, r.p, tq, tk),
      MaxError(o.data(), o_row, r.o, tq, d),
      MaxError(dq.data(), q_row, r.dq, tq, d),
      MaxError(dkv.data(), kv_row, r.dk, tk, d),
      MaxError(dkv.data() + d, kv_row, r.dv, tk, d)};
  // float32 sums of up to a few hundred terms against double: the builds
  // for AVX-512, AVX2 and NEON were within 1.3e-6 of the largest value (an
  // ulp is 1.2e-7); a 4% error in exp's x^4 coefficient reached 8e-6.
  bool ok = padding == 0.0;
  for (double error : errors) ok = ok && error <= kTolerance;
  std::printf("%s tq=%lld tk=%lld d=%lld lanes=%d tile=%dx%d: relative error p %.2e "
              "o %.2e dq %.2e dk %.2e dv %.2e, padding %.1e\n",
              ok ? "ok" : "FAILED", (long long)tq, (long long)tk,
              (long long)d, kLanes, kMaxRows, kMaxVectors, errors[0],
              errors[1], errors[2], errors[3], errors[4], padding);
  return ok;
}

}  // namespace

int main() {
  std::mt19937 rng(0);
  // ViT-B/16 and ViT-Ti/16 @224 (197 tokens, head_dim 64), their last
  // block's class-token query, vit_tiny_cifar (65 tokens), and small odd
  // sizes for the tiles' remainders.
  const int64_t shapes[][3] = {{197, 197, 64}, {1, 197, 64}, {65, 65, 64},
                               {7, 13, 16},    {50, 50, 32}, {13, 29, 48}};
  bool ok = true;
  for (const auto& shape : shapes)
    ok = Check(shape[0], shape[1], shape[2], rng) && ok;
  return ok ? 0 : 1;
}
