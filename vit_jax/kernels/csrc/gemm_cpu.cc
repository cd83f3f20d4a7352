// The Dense layers' three products through oneDNN's gemms, as XLA FFI
// handlers. vit_jax/kernels/cpu_gemm.py loads oneDNN, hands its gemms to
// VitSetGemm, and says why these exist.
//
// Every operand and result has a leading axis of G groups of rows (under a
// batch-split mesh, each device's part); per group, row major, float32
// operands (sgemm) or, in the handlers named ...Bf16, bfloat16 operands
// (oneDNN's gemm_bf16bf16f32), the result float32 either way:
//   VitGemm                  c (M, N) = a (M, K) b (K, N)        x.W
//   VitGemmTransposedRight   c (M, N) = a (M, K) b (N, K)^T      dy.W^T
//   VitGemmOverRows          c (K, N) = a (R, K)^T b (R, N)      x^T.dy
// The attribute `tasks` splits each group's product into that many parts
// (parallel_tasks.h): blocks of c's rows for the first two (of its
// columns where the rows are few and the columns many, kRowsPerTask), of
// c's columns for the third (whose rows are the contraction). sgemm itself
// runs on one OpenMP thread: the parallelism is XLA's devices and these
// tasks.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "parallel_tasks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// oneDNN's dnnl_sgemm and dnnl_gemm_bf16bf16f32 (row major, like their
// BLAS namesakes otherwise; bfloat16 as its 16 bits) and OpenMP's
// omp_set_num_threads, from the libraries cpu_gemm.py loads.
template <typename T>
using GemmFunction = int (*)(char transa, char transb, int64_t m, int64_t n,
                             int64_t k, float alpha, const T* a, int64_t lda,
                             const T* b, int64_t ldb, float beta, float* c,
                             int64_t ldc);
typedef void (*SetThreadsFunction)(int);
GemmFunction<float> sgemm = nullptr;
GemmFunction<uint16_t> gemm_bf16 = nullptr;
SetThreadsFunction set_omp_threads = nullptr;

// The operands' element type in memory: float, or bfloat16's bits.
template <ffi::DataType kType>
using Element =
    std::conditional_t<kType == ffi::DataType::F32, float, uint16_t>;

template <typename T>
GemmFunction<T> GemmFor() {
  if constexpr (std::is_same_v<T, float>) {
    return sgemm;
  } else {
    return gemm_bf16;
  }
}

// One block's product; a failure's oneDNN status (e.g. its bfloat16 gemm
// on a CPU without AVX-512: unimplemented) is kept in `status`.
template <typename T>
void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k,
          const T* a, int64_t lda, const T* b, int64_t ldb, float* c,
          int64_t ldc, std::atomic<int>* status) {
  set_omp_threads(1);  // per thread: this call's team is this thread
  const int result = GemmFor<T>()(transa, transb, m, n, k, 1.0f, a, lda, b,
                                  ldb, 0.0f, c, ldc);
  if (result != 0) status->store(result);
}

ffi::Error GemmStatus(const std::atomic<int>& status) {
  if (status.load() == 0) return ffi::Error::Success();
  return ffi::Error::Internal(
      "vit_jax's oneDNN products: oneDNN's gemm failed with dnnl_status_t " +
      std::to_string(status.load()) +
      " (5: unimplemented on this CPU); use matmul_implementation='xla'");
}

template <ffi::DataType kType>
ffi::Error CheckShapes(const ffi::Buffer<kType>& a,
                       const ffi::Buffer<kType>& b, const char* what) {
  if (GemmFor<Element<kType>>() == nullptr || set_omp_threads == nullptr)
    return ffi::Error::Internal(
        "vit_jax's oneDNN products: oneDNN's gemm is not loaded "
        "(vit_jax.kernels.cpu_gemm.problem() says why)");
  auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 3 || bd.size() != 3 || ad[0] != bd[0])
    return ffi::Error::InvalidArgument(what);
  return ffi::Error::Success();
}

// A product's operands and result, and its multiply-adds.
template <ffi::DataType kType>
CallCost ProductCost(const ffi::Buffer<kType>& a, const ffi::Buffer<kType>& b,
                     const ffi::Buffer<ffi::F32>& c, int64_t multiply_adds) {
  return {static_cast<int64_t>(a.size_bytes() + b.size_bytes() +
                               c.size_bytes()),
          2 * multiply_adds};
}

// With fewer than kRowsPerTask of c's rows per task and at least
// kColumnsPerTask of its columns, x.W and dy.W^T split c's columns instead
// of its rows. oneDNN's sgemm runs rows in whole tiles (48 on AVX-512), so
// a few rows per task ran slowly: on 2 threads of a Zen 4, 65 x 192 x 768
// took 141 us split into 48 and 17 rows, 131 into 32 and 33, 103 into 384
// columns each; 197 x 768 x 3072 6.7, 6.3 and 5.5 ms. Narrow products
// split by columns ran slower (65 x 768 x 192 with b transposed: 138 us by
// rows, 169 by columns), and from ~200 rows a task on the rows' split is
// as fast or faster (6304 x 192 x 768: 9.8 against 11.4 ms by columns). A
// device per core (tasks = 1) never splits; one device with several cores
// and small batches does (one image at a time: 65 or 197 rows).
constexpr int64_t kRowsPerTask = 128, kColumnsPerTask = 256;

// c = a b, or a b^T with kTransposedRight; each group's rows of c in
// blocks, or its columns where the rows are few and the columns many.
template <ffi::DataType kType, bool kTransposedRight>
ffi::Error RowsTimes(ffi::ThreadPool pool, ffi::Buffer<kType> a,
                     ffi::Buffer<kType> b, ffi::ResultBuffer<ffi::F32> c,
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
  const auto *ap = reinterpret_cast<const Element<kType>*>(a.untyped_data()),
             *bp = reinterpret_cast<const Element<kType>*>(b.untyped_data());
  float* cp = c->typed_data();
  std::atomic<int> status{0};
  std::atomic<int>* sp = &status;
  const char b_layout = kTransposedRight ? 'T' : 'N';
  const int64_t ldb = kTransposedRight ? k : n;
  const CallCost cost = ProductCost(a, b, *c, groups * m * n * k);
  if (m < kRowsPerTask * tasks && n >= kColumnsPerTask * tasks) {
    ForEachBlock(pool, cost, groups, Blocks(n, tasks, 16),
                 [=](int64_t g, int64_t c0, int64_t columns) {
                   // Column c0 of b: an offset of c0 rows of b^T.
                   const int64_t b0 = kTransposedRight ? c0 * k : c0;
                   Gemm('N', b_layout, m, columns, k, ap + g * m * k, k,
                        bp + g * k * n + b0, ldb, cp + g * m * n + c0, n, sp);
                 });
  } else {
    ForEachBlock(pool, cost, groups, Blocks(m, tasks, 16),
                 [=](int64_t g, int64_t r0, int64_t rows) {
                   Gemm('N', b_layout, rows, n, k, ap + (g * m + r0) * k, k,
                        bp + g * k * n, ldb, cp + (g * m + r0) * n, n, sp);
                 });
  }
  return GemmStatus(status);
}

// c = a^T b, contracting each group's rows; c's columns in blocks.
template <ffi::DataType kType>
ffi::Error OverRows(ffi::ThreadPool pool, ffi::Buffer<kType> a,
                    ffi::Buffer<kType> b, ffi::ResultBuffer<ffi::F32> c,
                    int64_t tasks) {
  if (ffi::Error error = CheckShapes(
          a, b, "VitGemmOverRows takes a (G, R, K) and b (G, R, N)");
      error.failure())
    return error;
  auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t groups = ad[0], r = ad[1], k = ad[2], n = bd[2];
  if (bd[1] != r)
    return ffi::Error::InvalidArgument("VitGemmOverRows: a's and b's R differ");
  const auto *ap = reinterpret_cast<const Element<kType>*>(a.untyped_data()),
             *bp = reinterpret_cast<const Element<kType>*>(b.untyped_data());
  float* cp = c->typed_data();
  std::atomic<int> status{0};
  std::atomic<int>* sp = &status;
  ForEachBlock(pool, ProductCost(a, b, *c, groups * r * k * n), groups,
               Blocks(n, tasks, 16),
               [=](int64_t g, int64_t c0, int64_t columns) {
                 Gemm('T', 'N', k, columns, r, ap + g * r * k, k,
                      bp + g * r * n + c0, n, cp + g * k * n + c0, n, sp);
               });
  return GemmStatus(status);
}

}  // namespace

// Called once by cpu_gemm.py with dnnl_sgemm, dnnl_gemm_bf16bf16f32 and
// omp_set_num_threads.
extern "C" void VitSetGemm(void* sgemm_function, void* gemm_bf16_function,
                           void* set_threads_function) {
  sgemm = reinterpret_cast<GemmFunction<float>>(sgemm_function);
  gemm_bf16 = reinterpret_cast<GemmFunction<uint16_t>>(gemm_bf16_function);
  set_omp_threads = reinterpret_cast<SetThreadsFunction>(set_threads_function);
}

#define VIT_GEMM_HANDLER(NAME, TYPE, FUNCTION) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(               \
      NAME, (FUNCTION),                        \
      ffi::Ffi::Bind()                         \
          .Ctx<ffi::ThreadPool>()              \
          .Arg<ffi::Buffer<ffi::TYPE>>()       \
          .Arg<ffi::Buffer<ffi::TYPE>>()       \
          .Ret<ffi::Buffer<ffi::F32>>()        \
          .Attr<int64_t>("tasks"))

#define VIT_GEMM_HANDLERS(SUFFIX, TYPE)                                   \
  VIT_GEMM_HANDLER(VitGemm##SUFFIX, TYPE,                                 \
                   (RowsTimes<ffi::DataType::TYPE, false>));              \
  VIT_GEMM_HANDLER(VitGemmTransposedRight##SUFFIX, TYPE,                  \
                   (RowsTimes<ffi::DataType::TYPE, true>));               \
  VIT_GEMM_HANDLER(VitGemmOverRows##SUFFIX, TYPE,                         \
                   OverRows<ffi::DataType::TYPE>)

VIT_GEMM_HANDLERS(, F32);
VIT_GEMM_HANDLERS(Bf16, BF16);
