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
// where b, the kernel, may be several (b_1 ... b_P) side by side, each a
// separate operand (of VitGemm and VitGemmTransposedRight), and c of
// VitGemmOverRows, the kernels' gradient, several results side by side
// (`SideBySide`): the P products of the same rows as one.
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
#include <vector>

#include "parallel_tasks.h"
#include "side_by_side.h"
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

// One block's product, c = alpha op(a) op(b) + beta c with alpha 1; a
// failure's oneDNN status (e.g. its bfloat16 gemm on a CPU without
// AVX-512: unimplemented) is kept in `status`.
template <typename T>
void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k,
          const T* a, int64_t lda, const T* b, int64_t ldb, float beta,
          float* c, int64_t ldc, std::atomic<int>* status) {
  set_omp_threads(1);  // per thread: this call's team is this thread
  const int result = GemmFor<T>()(transa, transb, m, n, k, 1.0f, a, lda, b,
                                  ldb, beta, c, ldc);
  if (result != 0) status->store(result);
}

ffi::Error GemmStatus(const std::atomic<int>& status) {
  if (status.load() == 0) return ffi::Error::Success();
  return ffi::Error::Internal(
      "vit_jax's oneDNN products: oneDNN's gemm failed with dnnl_status_t " +
      std::to_string(status.load()) +
      " (5: unimplemented on this CPU); use matmul_implementation='xla'");
}

template <typename T>
ffi::Error Loaded() {
  if (GemmFor<T>() == nullptr || set_omp_threads == nullptr)
    return ffi::Error::Internal(
        "vit_jax's oneDNN products: oneDNN's gemm is not loaded "
        "(vit_jax.kernels.cpu_gemm.problem() says why)");
  return ffi::Error::Success();
}

// The handler's kernels, its remaining arguments, side by side.
template <ffi::DataType kType>
ffi::Error Kernels(const ffi::RemainingArgs& args, int64_t groups,
                   SideBySide<const Element<kType>>* kernels) {
  if (args.size() == 0)
    return ffi::Error::InvalidArgument("VitGemm takes one kernel or more");
  for (size_t i = 0; i < args.size(); ++i) {
    auto kernel = args.get<ffi::Buffer<kType>>(i);
    if (kernel.has_error()) return kernel.error();
    if (ffi::Error error = kernels->Add(*kernel, groups); error.failure())
      return error;
  }
  return ffi::Error::Success();
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

bool SplitColumns(int64_t m, int64_t n, int64_t tasks) {
  return m < kRowsPerTask * tasks && n >= kColumnsPerTask * tasks;
}

// Kernels side by side are copied together before the product (and x^T.dy
// computed whole, then copied apart) where a task has this many rows of a
// or more. Why: a gemm per kernel reads the task's rows of a once per
// kernel, from memory once they outgrow the caches, and the copies cost
// little beside products this long. At the race's batches (8,320 rows a
// device), a vit_tiny_cifar train step with a gemm per kernel took 1-3%
// longer; at one image (65 rows) it took 8-9% less than with XLA's copies.
constexpr int64_t kJoinRowsPerTask = 1024;

bool JoinsKernels(int64_t rows, int64_t tasks) {
  return rows >= kJoinRowsPerTask * std::max<int64_t>(tasks, 1);
}

// c (G, M, N) = a (G, M, K) b, b the kernels side by side: [b_1 ... b_P],
// each (G, K, n_i), or with kTransposedRight [b_1 ... b_P]^T, each (G, N,
// k_i) (K = sum of k_i), each kernel's product with its columns of a added
// up in c. Each group's rows of c in blocks, or its columns where the rows
// are few and the columns many.
template <ffi::DataType kType, bool kTransposedRight>
ffi::Error RowsTimes(ffi::ThreadPool pool, ffi::Buffer<kType> a,
                     ffi::RemainingArgs b_args,
                     ffi::ResultBuffer<ffi::F32> c, int64_t tasks,
                     bool helpers) {
  using T = Element<kType>;
  auto ad = a.dimensions();
  SideBySide<const T> b;
  if (ffi::Error error = Loaded<T>(); error.failure()) return error;
  if (ad.size() != 3)
    return ffi::Error::InvalidArgument("VitGemm takes a (G, M, K)");
  if (ffi::Error error = Kernels<kType>(b_args, ad[0], &b); error.failure())
    return error;
  const int64_t groups = ad[0], m = ad[1], k = ad[2],
                n = kTransposedRight ? b.rows : b.total;
  if ((kTransposedRight ? b.total : b.rows) != k)
    return ffi::Error::InvalidArgument("VitGemm: a's and b's K differ");
  std::vector<T> joined;
  if (b.count > 1 && JoinsKernels(m, tasks)) b = b.Joined(groups, &joined);
  const T* ap = reinterpret_cast<const T*>(a.untyped_data());
  float* cp = c->typed_data();
  std::atomic<int> status{0};
  std::atomic<int>* sp = &status;
  const CallCost cost{static_cast<int64_t>(a.size_bytes() + b.bytes +
                                           c->size_bytes()),
                      2 * groups * m * n * k, helpers};
  const bool by_columns = SplitColumns(m, n, tasks);
  ForEachBlock(pool, cost, groups, Blocks(by_columns ? n : m, tasks, 16),
               [=](int64_t g, int64_t start, int64_t length) {
    const int64_t r0 = by_columns ? 0 : start, rows = by_columns ? m : length,
                  c0 = by_columns ? start : 0,
                  columns = by_columns ? length : n;
    const T* a_rows = ap + (g * m + r0) * k;
    float* c_rows = cp + (g * m + r0) * n;
    if constexpr (kTransposedRight) {
      for (int i = 0; i < b.count; ++i) {
        // Column c0 of b_i^T: an offset of c0 rows of b_i.
        Gemm('N', 'T', rows, columns, b.width[i], a_rows + b.start[i], k,
             b.Group(i, g) + c0 * b.width[i], b.width[i], i == 0 ? 0.0f : 1.0f,
             c_rows + c0, n, sp);
      }
    } else {
      b.ForEachPart(c0, columns, [&](int i, int64_t column, int64_t whole,
                                     int64_t width) {
        Gemm('N', 'N', rows, width, k, a_rows, k, b.Group(i, g) + column,
             b.width[i], 0.0f, c_rows + whole, n, sp);
      });
    }
  });
  return GemmStatus(status);
}

// [c_1 ... c_P] (G, K, N) = a (G, R, K)^T b (G, R, N), contracting each
// group's rows; the results c_i (G, K, n_i) apart, b's columns split among
// them in order. Each group's columns of the whole in blocks.
template <ffi::DataType kType>
ffi::Error OverRows(ffi::ThreadPool pool, ffi::Buffer<kType> a,
                    ffi::Buffer<kType> b, ffi::RemainingRets c_rets,
                    int64_t tasks, bool helpers) {
  using T = Element<kType>;
  auto ad = a.dimensions(), bd = b.dimensions();
  if (ffi::Error error = Loaded<T>(); error.failure()) return error;
  if (ad.size() != 3 || bd.size() != 3 || ad[0] != bd[0] || ad[1] != bd[1])
    return ffi::Error::InvalidArgument(
        "VitGemmOverRows takes a (G, R, K) and b (G, R, N)");
  const int64_t groups = ad[0], r = ad[1], k = ad[2], n = bd[2];
  SideBySide<float> c;
  for (size_t i = 0; i < c_rets.size(); ++i) {
    auto result = c_rets.get<ffi::Buffer<ffi::F32>>(i);
    if (result.has_error()) return result.error();
    if (ffi::Error error = c.Add(**result, groups); error.failure())
      return error;
  }
  if (c.count == 0 || c.rows != k || c.total != n)
    return ffi::Error::InvalidArgument(
        "VitGemmOverRows: the results must be (G, K, n_i), the n_i adding "
        "up to b's N");
  const auto *ap = reinterpret_cast<const T*>(a.untyped_data()),
             *bp = reinterpret_cast<const T*>(b.untyped_data());
  std::atomic<int> status{0};
  std::atomic<int>* sp = &status;
  const CallCost cost{
      static_cast<int64_t>(a.size_bytes() + b.size_bytes() + c.bytes),
      2 * groups * r * k * n, helpers};
  const SideBySide<float> parts = c;
  std::vector<float> joined;
  // Every task reads all r rows of a, its blocks being c's columns.
  if (c.count > 1 && JoinsKernels(r, /*tasks=*/1))
    c = c.Joined(groups, &joined, /*copy=*/false);
  ForEachBlock(pool, cost, groups, Blocks(n, tasks, 16),
               [=](int64_t g, int64_t c0, int64_t columns) {
                 c.ForEachPart(c0, columns, [&](int i, int64_t column,
                                                int64_t whole,
                                                int64_t width) {
                   Gemm('T', 'N', k, width, r, ap + g * r * k, k,
                        bp + g * r * n + whole, n, 0.0f,
                        c.Group(i, g) + column, c.width[i], sp);
                 });
               });
  if (!joined.empty()) parts.SplitFrom(joined.data(), groups);
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

#define VIT_GEMM_HANDLER(NAME, FUNCTION, OPERANDS)                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                        \
      NAME, (FUNCTION),                                                 \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() OPERANDS.Attr<int64_t>(   \
          "tasks").Attr<bool>("helpers"))

// x.W and dy.W^T: a, then the kernels side by side; one result.
#define VIT_GEMM_KERNELS(TYPE) \
  .Arg<ffi::Buffer<ffi::TYPE>>().RemainingArgs().Ret<ffi::Buffer<ffi::F32>>()
// x^T.dy: a and b; the results side by side.
#define VIT_GEMM_RESULTS(TYPE)                                   \
  .Arg<ffi::Buffer<ffi::TYPE>>().Arg<ffi::Buffer<ffi::TYPE>>() \
      .RemainingRets()

#define VIT_GEMM_HANDLERS(SUFFIX, TYPE)                                      \
  VIT_GEMM_HANDLER(VitGemm##SUFFIX, (RowsTimes<ffi::DataType::TYPE, false>), \
                   VIT_GEMM_KERNELS(TYPE));                                  \
  VIT_GEMM_HANDLER(VitGemmTransposedRight##SUFFIX,                           \
                   (RowsTimes<ffi::DataType::TYPE, true>),                   \
                   VIT_GEMM_KERNELS(TYPE));                                  \
  VIT_GEMM_HANDLER(VitGemmOverRows##SUFFIX, OverRows<ffi::DataType::TYPE>,   \
                   VIT_GEMM_RESULTS(TYPE))

VIT_GEMM_HANDLERS(, F32);
VIT_GEMM_HANDLERS(Bf16, BF16);
