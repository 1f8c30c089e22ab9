// Small-M matrix products for XLA:CPU, called through jax.ffi (models/kernels/cpu_matmul.py).
//
//   y[M, N] = x[M, K] . w[N, K]^T          (float32 or bfloat16 weights)
//   y[M, N] = (x[M, K] . w[N, K]^T) * s[N]  (int8 weights with one float32 scale per row)
//
// x and y are float32; the weights keep the [out, in] layout of the model. Why: XLA:CPU sends
// every product of 2 or more activation rows to YNNPACK, which on an AVX2 CPU costs 2.6-4.7x a
// 1-row mat-vec (docs/design.md), so a speculative verification call over gamma + 1 rows cost
// several decode steps. This kernel streams each weight row block once per call and multiplies
// it with every row of x while it sits in L1, so a call over a few rows costs about what one
// row costs (the weights' bytes), and int8 / bfloat16 weights are widened to float32 in
// registers, never in memory.
//
// Numerics: row m of y depends on row m of x alone, summed in the same order whatever M is
// (8 lanes over k = 0, 8, 16, ..., then the lanes added, then the k tail), so a row's result
// is bit-identical between a decode call (M = 1) and a verification call (M = gamma + 1).
// Built with -mavx2 -mfma -ffp-contract=off: no fused multiply-add but the explicit ones, so
// every instantiation rounds the k tail alike. The Python side checks the CPU first; AVX2 + FMA
// is every x86-64 server and laptop since 2013-2015.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowBlock = 8;  // weight rows per block: a pass over x rows takes them in
                                  // turn from cache (8 x K bytes of int8: L1 / L2)

// Eight weights starting at p, widened to float32.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {  // bfloat16: the high half of a float32
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 Load8(const int8_t* p) {
  __m128i w = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w));
}

inline float ToFloat(float w) { return w; }
inline float ToFloat(uint16_t w) {
  uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float ToFloat(int8_t w) { return static_cast<float>(w); }

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One pass of MB rows of x over NB weight rows (n .. n + NB, all valid) from k = 0 to k8 in
// steps of 8: acc[a][j] += x[m + a, k:k+8] * w[n + j, k:k+8]. Constant loop bounds keep the
// MB x NB accumulators in registers; every (row, column) pair has its own single accumulator,
// so its sum is the same whichever pass shape computed it.
template <int MB, int NB, typename W>
inline void Pass(const float* x, const W* w, int64_t k_dim, int64_t k8, __m256 (&acc)[MB][NB]) {
  for (int a = 0; a < MB; ++a) {
    for (int j = 0; j < NB; ++j) acc[a][j] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = Load8(w + j * k_dim + k);
    for (int a = 0; a < MB; ++a) {
      const __m256 xv = _mm256_loadu_ps(x + a * k_dim + k);
      for (int j = 0; j < NB; ++j) acc[a][j] = _mm256_fmadd_ps(xv, wv[j], acc[a][j]);
    }
  }
}

// Finishes a pass: lanes summed, the k tail added, scaled, stored (only the nb valid columns).
template <int MB, int NB, typename W>
inline void Store(const float* x, const W* w, const float* scale, float* y, int64_t k_dim, int64_t k8,
                  int64_t n_dim, int64_t nb, __m256 (&acc)[MB][NB]) {
  for (int a = 0; a < MB; ++a) {
    for (int64_t j = 0; j < nb; ++j) {
      float sum = HorizontalSum(acc[a][j]);
      for (int64_t k = k8; k < k_dim; ++k) sum += x[a * k_dim + k] * ToFloat(w[j * k_dim + k]);
      y[a * n_dim + j] = scale == nullptr ? sum : sum * scale[j];
    }
  }
}

// All rows of x against one block of kRowBlock weight rows (nb of them valid): pairs of x rows
// take the block as two halves of 4 rows (2 x 4 accumulators), a last single row takes it whole
// (1 x 8).
template <typename W>
void Block(const float* x, const W* block, const float* s, float* y, int64_t m_rows, int64_t k_dim,
           int64_t k8, int64_t n_dim, int64_t n, int64_t nb) {
  int64_t m = 0;
  for (; m + 2 <= m_rows; m += 2) {
    for (int64_t half = 0; half < kRowBlock; half += 4) {
      __m256 acc[2][4];
      Pass<2, 4>(x + m * k_dim, block + half * k_dim, k_dim, k8, acc);
      const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(4, nb - half));
      Store<2, 4>(x + m * k_dim, block + half * k_dim, s == nullptr ? nullptr : s + half,
                  y + m * n_dim + n + half, k_dim, k8, n_dim, valid, acc);
    }
  }
  if (m < m_rows) {
    __m256 acc[1][kRowBlock];
    Pass<1, kRowBlock>(x + m * k_dim, block, k_dim, k8, acc);
    Store<1, kRowBlock>(x + m * k_dim, block, s, y + m * n_dim + n, k_dim, k8, n_dim, nb, acc);
  }
}

// Output columns [n0, n1) for every row of x, a block of kRowBlock weight rows at a time. With
// more than two rows of x (several passes over a block) an int8 / bfloat16 block is widened to
// float32 once, into a buffer the passes read from cache, instead of once per pass; the sums are
// the same either way (widening is exact). scale is null for float weights.
template <typename W>
void Columns(const float* x, const W* w, const float* scale, float* y, int64_t m_rows, int64_t k_dim,
             int64_t n_dim, int64_t n0, int64_t n1) {
  const int64_t k8 = k_dim & ~int64_t{7};
  const bool widen = !std::is_same_v<W, float> && m_rows > 2;
  thread_local std::vector<W> padded;      // a last block of fewer than kRowBlock rows, zero-filled
  thread_local std::vector<float> widened;
  for (int64_t n = n0; n < n1; n += kRowBlock) {
    const int64_t nb = std::min(kRowBlock, n1 - n);
    const W* block = w + n * k_dim;
    if (nb < kRowBlock) {
      padded.assign(kRowBlock * k_dim, W{});
      std::copy(block, block + nb * k_dim, padded.begin());
      block = padded.data();
    }
    const float* s = scale == nullptr ? nullptr : scale + n;
    if (widen) {
      const int64_t total = kRowBlock * k_dim, total8 = total & ~int64_t{7};
      widened.resize(total);
      for (int64_t i = 0; i < total8; i += 8) _mm256_storeu_ps(&widened[i], Load8(block + i));
      for (int64_t i = total8; i < total; ++i) widened[i] = ToFloat(block[i]);
      Block(x, widened.data(), s, y, m_rows, k_dim, k8, n_dim, n, nb);
    } else {
      Block(x, block, s, y, m_rows, k_dim, k8, n_dim, n, nb);
    }
  }
}

// Splits the columns into chunks that the calling thread and XLA's intra-op thread pool take in
// turn from a shared counter. The caller never waits for a task that has not started: XLA may
// run several products at once (q, k and v are independent), each from a pool thread, so a task
// scheduled here can stay queued until this call returns; the caller takes every chunk left
// and waits only for chunks another thread is computing. The shared state lives on the heap,
// owned by every task, so a task that starts late finds no chunk and touches nothing else.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

template <typename W>
ffi::Error Matmul(ffi::ThreadPool pool, const float* x, const W* w, const float* scale, float* y,
                  int64_t m_rows, int64_t k_dim, int64_t n_dim) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t blocks = (n_dim + kRowBlock - 1) / kRowBlock;
  const int64_t chunk = std::max<int64_t>(1, blocks / (4 * threads)) * kRowBlock;  // columns
  const int64_t chunks = (n_dim + chunk - 1) / chunk;
  auto work = std::make_shared<Work>();
  auto drain = [=]() {
    for (;;) {
      work->active.fetch_add(1, std::memory_order_acq_rel);
      const int64_t c = work->next.fetch_add(1, std::memory_order_acq_rel);
      if (c >= chunks) {
        work->active.fetch_sub(1, std::memory_order_acq_rel);
        return;
      }
      Columns(x, w, scale, y, m_rows, k_dim, n_dim, c * chunk, std::min(n_dim, (c + 1) * chunk));
      work->active.fetch_sub(1, std::memory_order_acq_rel);
    }
  };
  for (int64_t t = 1; t < std::min(threads, chunks); ++t) pool.Schedule([drain]() { drain(); });
  drain();
  while (work->active.load(std::memory_order_acquire) > 0) _mm_pause();
  return ffi::Error::Success();
}

ffi::Error CheckShapes(ffi::Span<const int64_t> x, ffi::Span<const int64_t> w, int64_t scale_size,
                       ffi::Span<const int64_t> y) {
  if (x.size() != 2 || w.size() != 2 || y.size() != 2 || x[1] != w[1] || y[0] != x[0] || y[1] != w[0] ||
      (scale_size >= 0 && scale_size != w[0])) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "spec_jax cpu_matmul expects x [M, K], w [N, K], scale [N], y [M, N]");
  }
  return ffi::Error::Success();
}

ffi::Error MatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), -1, y->dimensions()); e.failure()) return e;
  return Matmul(pool, x.typed_data(), w.typed_data(), static_cast<const float*>(nullptr), y->typed_data(),
                x.dimensions()[0], x.dimensions()[1], w.dimensions()[0]);
}

ffi::Error MatmulBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), -1, y->dimensions()); e.failure()) return e;
  return Matmul(pool, x.typed_data(), w.typed_data(), static_cast<const float*>(nullptr), y->typed_data(),
                x.dimensions()[0], x.dimensions()[1], w.dimensions()[0]);
}

ffi::Error MatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), scale.element_count(), y->dimensions());
      e.failure()) {
    return e;
  }
  return Matmul(pool, x.typed_data(), w.typed_data(), scale.typed_data(), y->typed_data(), x.dimensions()[0],
                x.dimensions()[1], w.dimensions()[0]);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxMatmulF32, MatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxMatmulBF16, MatmulBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxMatmulInt8, MatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
