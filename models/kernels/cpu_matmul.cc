// Small-M matrix products for XLA:CPU, called through jax.ffi (models/kernels/cpu_matmul.py).
//
//   y[M, N] = x[M, K] . w[N, K]^T          (float32 or bfloat16 weights)
//   y[M, N] = (x[M, K] . w[N, K]^T) * s[N]  (int8 weights with one float32 scale per row)
//
// x and y are float32; the weights keep the [out, in] layout of the model. Why: XLA:CPU sends
// every product of 2 or more activation rows to YNNPACK, which on an AVX2 CPU costs 2.6-4.7x a
// 1-row mat-vec (docs/design.md), so a speculative verification call over gamma + 1 rows cost
// several decode steps. This kernel loads each weight once per call and multiplies it, in
// registers, with several rows of x at once (more rows: several passes over a block of weight
// rows held in cache), so a call over a few rows costs little more than one row (the weights'
// bytes), and int8 / bfloat16 weights are widened to float32 in registers, once for all those
// rows.
//
// Two builds of this one source (the Python side picks one from the CPU's flags, or
// $SPEC_JAX_CPU_ISA): -mavx2 -mfma (8 lanes, 16 ymm registers, up to 5 rows of x per pass) and,
// with -mavx512f -mavx512bw -mavx512vl -mavx512dq, AVX-512 (16 lanes, 32 zmm registers, up to 9
// rows per pass, x packed per call, each weight row prefetched 1 KB ahead). Measured on a
// 2-vCPU Intel Xeon (model 207, one core's two hyperthreads), interleaved, under another job's
// load: AVX2 -> AVX-512, the 1.5B target's int8 step 225-232 -> 135-137 ms, a verify call over 5
// positions 1.85 -> 1.33 steps (bfloat16 1.87 -> 1.25, float32 1.59 -> 1.26); one int8 product
// of N 8960 x K 1536 over 1 / 5 / 9 rows 1.99 / 3.92 / 6.81 -> 1.19 / 1.64 / 2.51 ms
// (docs/design.md, scripts/matmul_kernel_bench.py).
//
// Numerics: row m of y depends on row m of x alone, summed in the same order whatever M is
// (AVX2: 8 lanes over k = 0, 8, 16, ..., then the lanes added, then the k tail; AVX-512: 16
// lanes over k = 0, 16, ..., the tail as one masked step, then the lanes added), so within a
// build a row's result is bit-identical between a decode call (M = 1) and a verification call
// (M = gamma + 1); the two builds differ from each other in the last bits. Built with
// -ffp-contract=off: no fused multiply-add but the explicit ones, so every instantiation rounds
// alike. The Python side checks the CPU first; AVX2 + FMA is every x86-64 server and laptop
// since 2013-2015.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <cstdint>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// ---------------------------------------------------------------------------------------------
// AVX-512: 16 lanes, 32 zmm registers.
//
// x is first packed, once per call, pass by pass: the rows of one pass interleaved by chunk of
// 16 k ([k / 16][row][16], the k tail zero-filled), so that a pass reads its MB x vectors of a
// step at one pointer, one stream. A tile of MB rows of x and NB weight rows keeps MB x NB
// accumulators, NB widened weight vectors and one x vector in registers (at most 31 of the 32):
// each weight is loaded and widened once per pass, for all MB rows, and each x vector serves NB
// FMAs. The k tail is one more step with the weights' load masked (x is zero there). Each
// (row, column) has one accumulator: 16 lanes over k = 0, 16, 32, ..., the tail, then the
// lanes added in a fixed tree, then the scale; the same order whatever tile computed it, so
// whatever M. Every weight row is prefetched kPrefetchBytes ahead of its loads, on into the
// rows of the tile that runs next.

constexpr int kMaxPassRows512 = 9;  // rows of x per pass: gamma + 1 for gamma up to 8
constexpr int64_t kRowBlock512 = 24;  // weight rows per block: a whole number of tiles of each NB
constexpr int kNb[kMaxPassRows512 + 1] = {0, 8, 8, 6, 6, 4, 4, 3, 3, 3};  // NB by the pass's MB
constexpr int64_t kPrefetchBytes = 1024;

inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const uint16_t* p) {  // bfloat16: the high half of a float32
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// The same, lanes past the mask zero (not read).
inline __m512 Load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Load16(const uint16_t* p, __mmask16 m) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 Load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

inline float ReduceAdd(__m512 v) {  // a fixed tree: 8 + 8, 4 + 4, 2 + 2, 1 + 1
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One tile: MB packed rows of x (xp) times the NB weight rows from w, nb of them valid (the
// others repeat the last valid row: nothing is read past the weights' end), into y (row stride
// n_dim), scaled when scale is not null. next: the first row of the tile that runs next.
template <int MB, int NB, typename W>
inline void Tile(const float* xp, const W* w, const W* next, int64_t k_dim, int64_t nb, const float* scale,
                 float* y, int64_t n_dim) {
  const W* row[NB];
  for (int j = 0; j < NB; ++j) row[j] = w + std::min<int64_t>(j, nb - 1) * k_dim;
  __m512 acc[MB][NB];
  for (int a = 0; a < MB; ++a) {
    for (int j = 0; j < NB; ++j) acc[a][j] = _mm512_setzero_ps();
  }
  constexpr int64_t ahead = kPrefetchBytes / sizeof(W);  // weights ahead, in each row
  constexpr int64_t line = 64 / sizeof(W);               // weights per cache line
  const int64_t k16 = k_dim & ~int64_t{15};
  int64_t k = 0;
  for (; k < k16; k += 16, xp += MB * 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) {
      if (line <= 16 || (k & (line - 1)) == 0) {  // once per line
        const W* p = k + ahead < k_dim ? w + j * k_dim + k + ahead : next + j * k_dim + (k + ahead - k_dim);
        _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
      }
      wv[j] = Load16(row[j] + k);
    }
    for (int a = 0; a < MB; ++a) {
      __m512 xv = _mm512_loadu_ps(xp + a * 16);
      asm("" : "+v"(xv));  // one load of x per row, not one folded into each of the NB FMAs
      for (int j = 0; j < NB; ++j) acc[a][j] = _mm512_fmadd_ps(xv, wv[j], acc[a][j]);
    }
  }
  if (k < k_dim) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k_dim - k)) - 1);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = Load16(row[j] + k, mask);
    for (int a = 0; a < MB; ++a) {
      const __m512 xv = _mm512_loadu_ps(xp + a * 16);
      for (int j = 0; j < NB; ++j) acc[a][j] = _mm512_fmadd_ps(xv, wv[j], acc[a][j]);
    }
  }
  for (int a = 0; a < MB; ++a) {
    for (int j = 0; j < NB; ++j) {
      if (j < nb) {
        const float sum = ReduceAdd(acc[a][j]);
        y[a * n_dim + j] = scale == nullptr ? sum : sum * scale[j];
      }
    }
  }
}

// One pass of MB packed rows of x over the weight rows [n, n_end), a tile of NB rows at a time.
template <int MB, typename W>
void Pass512(const float* xp, const W* w, const float* scale, float* y, int64_t k_dim, int64_t n_dim,
             int64_t n, int64_t n_end) {
  constexpr int NB = kNb[MB];
  static_assert(NB > 0 && kRowBlock512 % NB == 0, "a block of weight rows is a whole number of tiles");
  static_assert(MB * NB + NB + 1 <= 32, "accumulators, weights and x fit in the 32 zmm registers");
  for (int64_t m = n; m < n_end; m += NB) {
    const W* next = w + std::min(m + NB, n_end) * k_dim;
    Tile<MB, NB>(xp, w + m * k_dim, next, k_dim, std::min<int64_t>(NB, n_end - m),
                 scale == nullptr ? nullptr : scale + m, y + m, n_dim);
  }
}

template <typename W>
void PassAny(int64_t rows, const float* xp, const W* w, const float* scale, float* y, int64_t k_dim,
             int64_t n_dim, int64_t n, int64_t n_end) {
  switch (rows) {
    case 1: return Pass512<1>(xp, w, scale, y, k_dim, n_dim, n, n_end);
    case 2: return Pass512<2>(xp, w, scale, y, k_dim, n_dim, n, n_end);
    case 3: return Pass512<3>(xp, w, scale, y, k_dim, n_dim, n, n_end);
    case 4: return Pass512<4>(xp, w, scale, y, k_dim, n_dim, n, n_end);
    case 5: return Pass512<5>(xp, w, scale, y, k_dim, n_dim, n, n_end);
    case 6: return Pass512<6>(xp, w, scale, y, k_dim, n_dim, n, n_end);
    case 7: return Pass512<7>(xp, w, scale, y, k_dim, n_dim, n, n_end);
    case 8: return Pass512<8>(xp, w, scale, y, k_dim, n_dim, n, n_end);
    default: return Pass512<9>(xp, w, scale, y, k_dim, n_dim, n, n_end);
  }
}
static_assert(kMaxPassRows512 == 9, "PassAny has a case per pass size");

constexpr int64_t kColumnBlock = kRowBlock512;  // columns per chunk: a multiple of this

// One call's product, split into column ranges: x packed once, then any [n0, n1) from any thread.
// The rows of x are taken in passes of at most kMaxPassRows512, sized alike (11 rows: 5 + 6).
template <typename W>
class Product {
 public:
  Product(const float* x, const W* w, const float* scale, float* y, int64_t m_rows, int64_t k_dim,
          int64_t n_dim)
      : m_rows_(m_rows), k_dim_(k_dim), n_dim_(n_dim), k_pad_((k_dim + 15) & ~int64_t{15}),
        passes_((m_rows + kMaxPassRows512 - 1) / kMaxPassRows512), xp_(m_rows * k_pad_, 0.0f), w_(w),
        scale_(scale), y_(y) {
    for (int64_t p = 0, m = 0; p < passes_; ++p) {  // pass p's rows: [k / 16][row][16]
      const int64_t rows = Rows(p, m);
      float* out = xp_.data() + m * k_pad_;
      for (int64_t a = 0; a < rows; ++a) {
        for (int64_t k = 0; k < k_dim; ++k) {
          out[(k / 16) * rows * 16 + a * 16 + k % 16] = x[(m + a) * k_dim + k];
        }
      }
      m += rows;
    }
  }

  // Output columns [n0, n1) for every row of x, a block of kRowBlock512 weight rows at a time:
  // every pass over a block before the next, so for M > kMaxPassRows512 the later passes read
  // the block from cache.
  void operator()(int64_t n0, int64_t n1) const {
    for (int64_t n = n0; n < n1; n += kRowBlock512) {
      const int64_t n_end = std::min(n1, n + kRowBlock512);
      for (int64_t p = 0, m = 0; p < passes_; ++p) {
        const int64_t rows = Rows(p, m);
        PassAny(rows, xp_.data() + m * k_pad_, w_, scale_, y_ + m * n_dim_, k_dim_, n_dim_, n, n_end);
        m += rows;
      }
    }
  }

 private:
  int64_t Rows(int64_t p, int64_t m) const { return (m_rows_ - m) / (passes_ - p); }  // of pass p at row m

  int64_t m_rows_, k_dim_, n_dim_, k_pad_, passes_;
  std::vector<float> xp_;
  const W* w_;
  const float* scale_;
  float* y_;
};

#else
// ---------------------------------------------------------------------------------------------
// AVX2 + FMA: 8 lanes, 16 ymm registers (the build for CPUs without AVX-512).

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

// Rows of x per pass and the weight rows a pass takes at once: MB x NB accumulators, NB widened
// weight vectors and one x vector stay in the 16 ymm registers, and each weight is loaded and
// widened once per pass, for all its MB rows. A call over M <= kMaxPassRows rows of x streams
// the weights once, in one pass; more rows take several passes over each block of kRowBlock
// weight rows (from cache).
constexpr int64_t kMaxPassRows = 5;

template <int MB, typename W>
void Passes(const float* x, const W* block, const float* s, float* y, int64_t k_dim, int64_t k8,
            int64_t n_dim, int64_t n, int64_t nb) {
  constexpr int NB = MB == 1 ? 8 : MB == 2 ? 4 : 2;
  for (int64_t half = 0; half < kRowBlock; half += NB) {
    __m256 acc[MB][NB];
    Pass<MB, NB>(x, block + half * k_dim, k_dim, k8, acc);
    const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(NB, nb - half));
    Store<MB, NB>(x, block + half * k_dim, s == nullptr ? nullptr : s + half, y + n + half, k_dim, k8,
                  n_dim, valid, acc);
  }
}

// All rows of x against one block of kRowBlock weight rows (nb of them valid), in passes of at
// most kMaxPassRows rows, sized alike (7 rows: 3 + 4).
template <typename W>
void Block(const float* x, const W* block, const float* s, float* y, int64_t m_rows, int64_t k_dim,
           int64_t k8, int64_t n_dim, int64_t n, int64_t nb) {
  const int64_t passes = (m_rows + kMaxPassRows - 1) / kMaxPassRows;
  for (int64_t p = 0, m = 0; p < passes; ++p) {
    const int64_t rows = (m_rows - m) / (passes - p);  // the rows left, shared by the passes left
    const float* xm = x + m * k_dim;
    float* ym = y + m * n_dim;
    switch (rows) {
      case 1: Passes<1>(xm, block, s, ym, k_dim, k8, n_dim, n, nb); break;
      case 2: Passes<2>(xm, block, s, ym, k_dim, k8, n_dim, n, nb); break;
      case 3: Passes<3>(xm, block, s, ym, k_dim, k8, n_dim, n, nb); break;
      case 4: Passes<4>(xm, block, s, ym, k_dim, k8, n_dim, n, nb); break;
      default: Passes<5>(xm, block, s, ym, k_dim, k8, n_dim, n, nb); break;
    }
    m += rows;
  }
}

// Output columns [n0, n1) for every row of x, a block of kRowBlock weight rows at a time.
// scale is null for float weights.
template <typename W>
void Columns(const float* x, const W* w, const float* scale, float* y, int64_t m_rows, int64_t k_dim,
             int64_t n_dim, int64_t n0, int64_t n1) {
  const int64_t k8 = k_dim & ~int64_t{7};
  thread_local std::vector<W> padded;  // a last block of fewer than kRowBlock rows, zero-filled
  for (int64_t n = n0; n < n1; n += kRowBlock) {
    const int64_t nb = std::min(kRowBlock, n1 - n);
    const W* block = w + n * k_dim;
    if (nb < kRowBlock) {
      padded.assign(kRowBlock * k_dim, W{});
      std::copy(block, block + nb * k_dim, padded.begin());
      block = padded.data();
    }
    Block(x, block, scale == nullptr ? nullptr : scale + n, y, m_rows, k_dim, k8, n_dim, n, nb);
  }
}


constexpr int64_t kColumnBlock = kRowBlock;  // columns per chunk: a multiple of this

template <typename W>
class Product {
 public:
  Product(const float* x, const W* w, const float* scale, float* y, int64_t m_rows, int64_t k_dim,
          int64_t n_dim)
      : x_(x), w_(w), scale_(scale), y_(y), m_rows_(m_rows), k_dim_(k_dim), n_dim_(n_dim) {}
  void operator()(int64_t n0, int64_t n1) const {
    Columns(x_, w_, scale_, y_, m_rows_, k_dim_, n_dim_, n0, n1);
  }

 private:
  const float* x_;
  const W* w_;
  const float* scale_;
  float* y_;
  int64_t m_rows_, k_dim_, n_dim_;
};
#endif  // AVX-512 or AVX2

// The columns in chunks over the calling thread and XLA's pool (cpu_parallel.h).
template <typename W>
ffi::Error Matmul(ffi::ThreadPool pool, const float* x, const W* w, const float* scale, float* y,
                  int64_t m_rows, int64_t k_dim, int64_t n_dim) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t blocks = (n_dim + kColumnBlock - 1) / kColumnBlock;
  const int64_t chunk = std::max<int64_t>(1, blocks / (4 * threads)) * kColumnBlock;  // columns
  const Product<W> product(x, w, scale, y, m_rows, k_dim, n_dim);
  spec_jax::ParallelChunks(pool, (n_dim + chunk - 1) / chunk,
                           [&](int64_t c) { product(c * chunk, std::min(n_dim, (c + 1) * chunk)); });
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
                     ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), -1, y->dimensions()); e.failure()) return e;
  const int64_t n_dim = w.dimensions()[0];
  const int64_t rows = spec_jax::LiveRows(*live.typed_data(), x.dimensions()[0], n_dim, y->typed_data());
  return Matmul(pool, x.typed_data(), w.typed_data(), static_cast<const float*>(nullptr), y->typed_data(), rows,
                x.dimensions()[1], n_dim);
}

ffi::Error MatmulBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                      ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), -1, y->dimensions()); e.failure()) return e;
  const int64_t n_dim = w.dimensions()[0];
  const int64_t rows = spec_jax::LiveRows(*live.typed_data(), x.dimensions()[0], n_dim, y->typed_data());
  return Matmul(pool, x.typed_data(), w.typed_data(), static_cast<const float*>(nullptr), y->typed_data(), rows,
                x.dimensions()[1], n_dim);
}

ffi::Error MatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), scale.element_count(), y->dimensions());
      e.failure()) {
    return e;
  }
  const int64_t n_dim = w.dimensions()[0];
  const int64_t rows = spec_jax::LiveRows(*live.typed_data(), x.dimensions()[0], n_dim, y->typed_data());
  return Matmul(pool, x.typed_data(), w.typed_data(), scale.typed_data(), y->typed_data(), rows, x.dimensions()[1],
                n_dim);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxMatmulF32, MatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxMatmulBF16, MatmulBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxMatmulInt8, MatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
