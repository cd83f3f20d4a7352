// The Dense layers' three products through oneDNN's sgemm, as XLA FFI
// handlers. vit_jax/kernels/cpu_gemm.py loads oneDNN, hands its sgemm to
// VitSetSgemm, and says why these exist.
//
// Every operand and result has a leading axis of G groups of rows (under a
// batch-split mesh, each device's part); per group, float32, row major:
//   VitGemm                  c (M, N) = a (M, K) b (K, N)        x.W
//   VitGemmTransposedRight   c (M, N) = a (M, K) b (N, K)^T      dy.W^T
//   VitGemmOverRows          c (K, N) = a (R, K)^T b (R, N)      x^T.dy
// The attribute `tasks` splits each group's product into that many parts on
// XLA's intra-op threads: blocks of c's rows for the first two, of c's
// columns for the third (whose rows are the contraction). sgemm itself runs
// on one OpenMP thread: the parallelism is XLA's devices and these tasks.

#include <algorithm>
#include <cstdint>

#include "parallel_tasks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// oneDNN's dnnl_sgemm (row major, like its BLAS namesake otherwise) and
// OpenMP's omp_set_num_threads, from the libraries cpu_gemm.py loads.
typedef int (*SgemmFunction)(char transa, char transb, int64_t m, int64_t n,
                             int64_t k, float alpha, const float* a,
                             int64_t lda, const float* b, int64_t ldb,
                             float beta, float* c, int64_t ldc);
typedef void (*SetThreadsFunction)(int);
SgemmFunction sgemm = nullptr;
SetThreadsFunction set_omp_threads = nullptr;

void Sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k,
           const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
           int64_t ldc) {
  set_omp_threads(1);  // per thread: this call's team is this thread
  sgemm(transa, transb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& a,
                       const ffi::Buffer<ffi::F32>& b, const char* what) {
  if (sgemm == nullptr || set_omp_threads == nullptr)
    return ffi::Error::Internal(
        "vit_jax's oneDNN products: oneDNN's sgemm is not loaded "
        "(vit_jax.kernels.cpu_gemm.problem() says why)");
  auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 3 || bd.size() != 3 || ad[0] != bd[0])
    return ffi::Error::InvalidArgument(what);
  return ffi::Error::Success();
}

// c = a b, or a b^T with kTransposedRight; each group's rows of c in
// blocks.
template <bool kTransposedRight>
ffi::Error RowsTimes(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                     ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> c,
                     int64_t tasks) {
  if (ffi::Error error = CheckShapes(
          a, b, "VitGemm takes a (G, M, K) and b (G, K, N) or (G, N, K)");
      error.failure())
    return error;
  auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t groups = ad[0], m = ad[1], k = ad[2],
                n = kTransposedRight ? bd[1] : bd[2];
  if ((kTransposedRight ? bd[2] : bd[1]) != k)
    return ffi::Error::InvalidArgument("VitGemm: a's and b's K differ");
  const float *ap = a.typed_data(), *bp = b.typed_data();
  float* cp = c->typed_data();
  ForEachBlock(pool, groups, Blocks(m, tasks, 16),
               [=](int64_t g, int64_t r0, int64_t rows) {
                 Sgemm('N', kTransposedRight ? 'T' : 'N', rows, n, k,
                       ap + (g * m + r0) * k, k, bp + g * k * n,
                       kTransposedRight ? k : n, cp + (g * m + r0) * n, n);
               });
  return ffi::Error::Success();
}

// c = a^T b, contracting each group's rows; c's columns in blocks.
ffi::Error OverRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                    ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> c,
                    int64_t tasks) {
  if (ffi::Error error = CheckShapes(
          a, b, "VitGemmOverRows takes a (G, R, K) and b (G, R, N)");
      error.failure())
    return error;
  auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t groups = ad[0], r = ad[1], k = ad[2], n = bd[2];
  if (bd[1] != r)
    return ffi::Error::InvalidArgument("VitGemmOverRows: a's and b's R differ");
  const float *ap = a.typed_data(), *bp = b.typed_data();
  float* cp = c->typed_data();
  ForEachBlock(pool, groups, Blocks(n, tasks, 16),
               [=](int64_t g, int64_t c0, int64_t columns) {
                 Sgemm('T', 'N', k, columns, r, ap + g * r * k, k,
                       bp + g * r * n + c0, n, cp + g * k * n + c0, n);
               });
  return ffi::Error::Success();
}

}  // namespace

// Called once by cpu_gemm.py with dnnl_sgemm and omp_set_num_threads.
extern "C" void VitSetSgemm(void* sgemm_function, void* set_threads_function) {
  sgemm = reinterpret_cast<SgemmFunction>(sgemm_function);
  set_omp_threads = reinterpret_cast<SetThreadsFunction>(set_threads_function);
}

#define VIT_GEMM_HANDLER(NAME, FUNCTION)       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(               \
      NAME, FUNCTION,                          \
      ffi::Ffi::Bind()                         \
          .Ctx<ffi::ThreadPool>()              \
          .Arg<ffi::Buffer<ffi::F32>>()        \
          .Arg<ffi::Buffer<ffi::F32>>()        \
          .Ret<ffi::Buffer<ffi::F32>>()        \
          .Attr<int64_t>("tasks"))

VIT_GEMM_HANDLER(VitGemm, RowsTimes<false>);
VIT_GEMM_HANDLER(VitGemmTransposedRight, RowsTimes<true>);
VIT_GEMM_HANDLER(VitGemmOverRows, OverRows);
