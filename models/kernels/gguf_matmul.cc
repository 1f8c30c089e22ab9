// Products with a weight kept in its GGUF block format (Q4_K, Q5_0, Q6_K, Q8_0, ...), for
// XLA:CPU through jax.ffi (models/kernels/gguf_matmul.py). The block formats' arithmetic is
// ggml's own (llama.cpp's CPU backend, built from the registry's llama-cpp-python sdist with
// GGML_NATIVE): this file only lays the calls out over rows and threads.
//
//   y[M, N] = x[M, K] . W[N, K]^T, each row of W the GGUF row of blocks (row_bytes bytes)
//
// Two ways to multiply, an attribute of the call:
//   quantize_x = 0 (precision "gguf", faithful): each weight row is dequantized with ggml's
//     reference to_float (the numbers gguf-py's and llama.cpp's dequantization give) into float32,
//     then dotted with each float32 row of x (ggml's f32 vec_dot). The checkpoint's numbers.
//   quantize_x = 1 (precision "gguf_q8"): each row of x is quantized once per call to the weight
//     type's vec_dot_type (Q8_K for the K-quants, Q8_0 for Q4_0 / Q5_0 / Q8_0: 8-bit values with
//     a scale per block of 256 / 32) and multiplied with integer dot products, as llama.cpp
//     decodes: Q4_K and Q6_K by this file's multi-row kernels (AVX-512 VNNI, below; one row of
//     Q6_K: that kernel or ggml's vec_dot, whose bits it reproduces, whichever is faster on this
//     CPU: OwnOneRow), the other
//     types (and every type with ggml_dot = 1, the reference the tests compare with) by ggml's
//     own vec_dot, one call per (row of x, row of W).
//   interleaved = 1 (Q4_K at gguf_q8, on a CPU): the weight's rows in groups of 8 with their blocks
//     interleaved (ggml's block_q4_Kx8, what llama.cpp's CPU backend repacks Q4_K into;
//     SpecJaxGgufInterleaveQ4K below writes it), over chunks of kInterleavedChunk weight rows,
//     multiplied by this file's multi-row kernel (Q4Kx8Group: each block unpacked once for up to
//     8 rows of x, each row given exactly the bits of ggml's ggml_gemv_q4_K_8x8_q8_K, which a
//     one-row call may run itself (OwnOneRow), as ggml_dot = 1 does for every row). With
//     bulk = 1 (a prefill, whose rows nothing compares with a decode step's) on a CPU without
//     that kernel, or with ggml_dot = 1 on any CPU, rows of x in groups of 4 go through ggml's
//     ggml_gemm_q4_K_8x8_q8_K instead (its bits differ from gemv's in the last places), the rest
//     as above: how llama.cpp reads a prompt.
//   interleaved = 1 with Q6_K (at gguf_q8, the multi-row build only): the weight's rows in groups
//     of 8 in this file's own layout (BlockQ6Kx8; SpecJaxGgufInterleaveQ6K writes it), multiplied
//     by Q6Kx8Group: each block unpacked once for up to 8 rows of x, each row given exactly the
//     bits of ggml's vec_dot on the file's layout, at every row count, one row included.
//   live (an int32 operand): rows of x from it on are padding (a prefill's last chunk, shorter
//     than its call): they are not computed and their outputs are 0 (spec_jax::LiveRows).
//
// One pass over the weights: a chunk of weight rows is read once for every row of x (the
// rows of x taken in blocks that stay in cache), so a verification call over gamma + 1 positions
// reads the weights' bytes once, like a decode step. Numerics: y[m, n] is one vec_dot of row m
// of x with row n of W, whatever M and whichever thread computes it, so a row's result is
// bit-identical between a decode call (M = 1) and a verification call (M = gamma + 1).

#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <atomic>
#include <cstdint>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu_parallel.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// ggml's repacked Q4_K x Q8_K product (ggml-cpu/repack.h; exported by libggml-cpu): y[0, nc) of
// one row of x (vy, block_q8_K) against nc weight rows in groups of 8 (vx, block_q4_Kx8).
extern "C" void ggml_gemv_q4_K_8x8_q8_K(int n, float* s, size_t bs, const void* vx, const void* vy, int nr, int nc);
// The same for nr rows of x at once (nr a multiple of 4; vy: block_q8_Kx4, 4 rows interleaved,
// as ggml_quantize_mat_q8_K_4x8 writes them): what ggml's CPU backend runs over 4 or more rows.
// Its rows differ from gemv's in the last bits, so only calls that allow it use it (bulk).
extern "C" void ggml_gemm_q4_K_8x8_q8_K(int n, float* s, size_t bs, const void* vx, const void* vy, int nr, int nc);
extern "C" void ggml_quantize_mat_q8_K_4x8(const float* x, void* vy, int64_t k);

namespace {

constexpr int64_t kRowsPerChunk = 32;  // weight rows per task where a task dequantizes its rows to floats
// Weight rows per task of the block products (EachTile), or fewer where that would leave a thread
// idle: a task streams its rows' blocks from memory, and longer runs keep the prefetchers ahead
// (the lm head, 151936 Q6_K rows at K 1536, one row of x: 8.3 ms in tasks of 32 rows, 6.1 in 256,
// 5.9 in 2048; a decode step of the Qwen 1.5B at gguf_q8 35.1 against 33.6 ms with 256, medians
// of 30 interleaved; docs/benchmarks.md).
constexpr int64_t kRowsPerTile = 256;
constexpr int64_t kXBlock = 64;        // rows of x per pass over a chunk (their bytes stay in L2)
constexpr int64_t kInterleavedChunk = 256;  // weight rows per task on the interleaved path (~220 KB at K 1536)

void InitOnce() {
  static std::once_flag once;
  std::call_once(once, [] { ggml_cpu_init(); });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
// ---------------------------------------------------------------------------------------------
// Multi-row Q4_K x Q8_K (precision gguf_q8), AVX-512 VNNI, on the file's own layout (a Q4_K
// matrix whose rows are not a multiple of 8; the others are interleaved, Q4Kx8Group below).
// ggml's vec_dot unpacks a weight block for each row of x it meets; here a block is unpacked
// once per group of up to kGroup rows of x (its 256 values as unsigned bytes in order, 4 zmm,
// and the float scale d * sc of each lane) and multiplied with each row of the group: vpdpbusd
// (unsigned weight x signed activation, 4 products summed to an exact int32 a lane), converted
// and scaled in float. The math is ggml's (its _q8_K dot products), with the scales applied in
// float:
//   w = d * sc_j * q - dmin * m_j (q in 0..15, 6-bit sc / m per 32 values)
//   row . x = sum_blocks dx * (sum_lanes d sc * sum q x)  -  dx * dmin * sum_j m_j sum x
// where sum x over 16 values is the Q8_K block's bsums. Each (row m, column n) runs the same
// float steps in the same order (chunks, blocks, then one reduction), whatever M and whichever
// group or thread computes it: a row's result is the same bits in a decode step and a
// verification call.
#define SPEC_JAX_MULTIROW 1

struct BlockQ8K {
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};
struct BlockQ4K {
  uint16_t d, dmin;  // float16
  uint8_t scales[12];
  uint8_t qs[128];
};
struct BlockQ6K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;  // float16
};
static_assert(sizeof(BlockQ8K) == 292 && sizeof(BlockQ4K) == 144 && sizeof(BlockQ6K) == 210, "ggml's layouts");

constexpr int kGroup = 8;  // rows of x per unpacked block: u, scales, kGroup x 2 accumulators in 32 zmm

// group(std::integral_constant<int, R>, m) for the rows [m0, m1) of x in groups of up to kGroup:
// the multi-row kernels' one dispatch from a run-time row count to their compile-time R.
template <typename F>
void InRowGroups(int64_t m0, int64_t m1, const F& group) {
  for (int64_t m = m0; m < m1;) {
    const int64_t r = std::min<int64_t>(kGroup, m1 - m);
    switch (r) {
      case 1: group(std::integral_constant<int, 1>{}, m); break;
      case 2: group(std::integral_constant<int, 2>{}, m); break;
      case 3: group(std::integral_constant<int, 3>{}, m); break;
      case 4: group(std::integral_constant<int, 4>{}, m); break;
      case 5: group(std::integral_constant<int, 5>{}, m); break;
      case 6: group(std::integral_constant<int, 6>{}, m); break;
      case 7: group(std::integral_constant<int, 7>{}, m); break;
      default: group(std::integral_constant<int, 8>{}, m); break;
    }
    m += r;
  }
}
static_assert(kGroup == 8, "InRowGroups has a case per group size");

// One weight block unpacked: 256 unsigned values in order (4 x 64 bytes), the float scale of
// each int32 lane of each chunk's vpdpbusd, and the correction of the x block's bsums.
struct Unpacked {
  __m512i u[4];
  __m512 scale[4];
  __m256i bsum_factor;  // m_j of the 16-value group's sub-block
  float corr;           // dmin
};

struct Lanes {  // which of the 8 scales each int32 lane of each chunk takes
  alignas(64) int32_t q4[4][16];
  constexpr Lanes() : q4{} {
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 16; ++l) {
        q4[c][l] = 2 * c + l / 8;  // lanes 0..7: values 64c .. 64c + 31, sub-block 2c
      }
    }
  }
};
constexpr Lanes kLanes;

// ggml's unpacking of a Q4_K block's twelve bytes: the bytes of t[0], t[1] are sc_0..7, of t[2],
// t[3] m_0..7 (6 bits each, one per 32 values).
inline void ScalesMins12(const uint8_t* scales, uint32_t t[4]) {
  std::memcpy(t, scales, 12);
  t[3] = ((t[2] >> 4) & 0x0f0f0f0f) | (((t[1] >> 6) & 0x03030303) << 4);
  const uint32_t aux = t[1] & 0x3f3f3f3f;
  t[1] = (t[2] & 0x0f0f0f0f) | (((t[0] >> 6) & 0x03030303) << 4);
  t[2] = aux;
  t[0] &= 0x3f3f3f3f;
}
inline void ScalesMinsQ4K(const BlockQ4K& b, uint32_t t[4]) { ScalesMins12(b.scales, t); }

// A block's 256 unsigned values in order, 64 a zmm.
inline void ValuesQ4K(const BlockQ4K& b, __m512i u[4]) {
  const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);  // low nibbles, then high
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {  // values 64c .. 64c + 63: qs[32c .. 32c + 31], low then high nibbles
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * c));
    u[c] = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(q), shift), nibble);
  }
}

inline void ValuesQ6K(const BlockQ6K& b, __m512i u[4]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  const __m512i shift_lo = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i shift_hi = _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4);
  for (int half = 0; half < 2; ++half) {  // values 128 h .. 128 h + 127
    const __m512i ql = _mm512_loadu_si512(b.ql + 64 * half);
    const __m512i qh =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * half)));
    const __m512i h_lo = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(qh, shift_lo), two), 4);
    const __m512i h_hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(qh, shift_hi), two), 4);
    u[2 * half] = _mm512_or_si512(_mm512_and_si512(ql, nibble), h_lo);
    u[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble), h_hi);
  }
}

inline void UnpackQ4K(const BlockQ4K& b, Unpacked& out) {
  uint32_t t[4];
  ScalesMinsQ4K(b, t);
  const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b.d)),
                                   _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi32(0, 0, t[1], t[0]))));
  ValuesQ4K(b, out.u);
  for (int c = 0; c < 4; ++c) out.scale[c] = _mm512_permutexvar_ps(_mm512_load_si512(kLanes.q4[c]), dsc);
  const __m128i mins = _mm_set_epi32(0, 0, t[3], t[2]);
  out.bsum_factor = _mm256_cvtepu8_epi16(
      _mm_shuffle_epi8(mins, _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0)));
  out.corr = _cvtsh_ss(b.dmin);
}

inline float Reduce256(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Columns [n0, n1) of rows [m0, m0 + R) of y.
template <int R>
void Group(const uint8_t* w, int64_t row_bytes, const BlockQ8K* xq, int64_t blocks, int64_t m0, int64_t n0,
           int64_t n1, float* y, int64_t n_dim) {
  Unpacked un;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[R];
    __m256 acc_corr[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_ps();
      acc_corr[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      UnpackQ4K(reinterpret_cast<const BlockQ4K*>(row)[b], un);
      for (int r = 0; r < R; ++r) {
        const BlockQ8K& xb = xq[(m0 + r) * blocks + b];
        __m512 blk = _mm512_setzero_ps();
        for (int c = 0; c < 4; ++c) {
          const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), un.u[c], _mm512_loadu_si512(xb.qs + 64 * c));
          blk = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), un.scale[c], blk);
        }
        acc[r] = _mm512_fmadd_ps(blk, _mm512_set1_ps(xb.d), acc[r]);
        const __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums)),
                                             un.bsum_factor);  // 8 int32, exact
        acc_corr[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bs), _mm256_set1_ps(un.corr * xb.d), acc_corr[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[(m0 + r) * n_dim + n] = _mm512_reduce_add_ps(acc[r]) - Reduce256(acc_corr[r]);
  }
}

void MultiRow(const uint8_t* w, int64_t row_bytes, const BlockQ8K* xq, int64_t blocks, int64_t m0,
              int64_t m1, int64_t n0, int64_t n1, float* y, int64_t n_dim) {
  InRowGroups(m0, m1, [&](auto rows, int64_t m) {
    Group<decltype(rows)::value>(w, row_bytes, xq, blocks, m, n0, n1, y, n_dim);
  });
}

// Faithful (precision gguf) multi-row Q4_K / Q6_K: a block is dequantized once per group of
// rows, 16 values at a time in registers, to the very floats of ggml's to_float (every
// d * sc * q and dmin * m is exact in float32, so w = d sc q - dmin m rounds once, as there),
// and each row of the group adds w * x in 16 lanes, blocks in turn, then one reduction: the
// same fixed order for (row m, column n) whatever M.
template <bool Q4, int R>
void FaithfulGroup(const uint8_t* w, int64_t row_bytes, const float* x, int64_t k_dim, int64_t blocks, int64_t m0,
                   int64_t n0, int64_t n1, float* y, int64_t n_dim) {
  __m512i u[4];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      float scale[16], offset[16];  // each 16 values: w = scale * u - offset
      if constexpr (Q4) {
        const BlockQ4K& blk = reinterpret_cast<const BlockQ4K*>(row)[b];
        ValuesQ4K(blk, u);
        uint32_t t[4];
        ScalesMinsQ4K(blk, t);
        uint8_t sm[16];
        std::memcpy(sm, t, 16);  // sc_0..7, m_0..7
        const float d = _cvtsh_ss(blk.d), dmin = _cvtsh_ss(blk.dmin);
        for (int f = 0; f < 16; ++f) {
          scale[f] = d * static_cast<float>(sm[f / 2]);
          offset[f] = dmin * static_cast<float>(sm[8 + f / 2]);
        }
      } else {
        const BlockQ6K& blk = reinterpret_cast<const BlockQ6K*>(row)[b];
        ValuesQ6K(blk, u);
        const float d = _cvtsh_ss(blk.d);
        for (int f = 0; f < 16; ++f) {
          scale[f] = d * static_cast<float>(blk.scales[f]);
          offset[f] = scale[f] * 32.0f;  // w = d sc (u - 32) = d sc u - 32 d sc, both exact
        }
      }
      for (int f = 0; f < 16; ++f) {  // values 16f .. 16f + 15
        __m128i part;
        switch (f % 4) {
          case 0: part = _mm512_extracti32x4_epi32(u[f / 4], 0); break;
          case 1: part = _mm512_extracti32x4_epi32(u[f / 4], 1); break;
          case 2: part = _mm512_extracti32x4_epi32(u[f / 4], 2); break;
          default: part = _mm512_extracti32x4_epi32(u[f / 4], 3); break;
        }
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part));
        const __m512 wv = _mm512_fmsub_ps(_mm512_set1_ps(scale[f]), q, _mm512_set1_ps(offset[f]));
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (m0 + r) * k_dim + 256 * b + 16 * f), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[(m0 + r) * n_dim + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

template <bool Q4>
void FaithfulRows(const uint8_t* w, int64_t row_bytes, const float* x, int64_t k_dim, int64_t m0, int64_t m1,
                  int64_t n0, int64_t n1, float* y, int64_t n_dim) {
  const int64_t blocks = k_dim / 256;
  InRowGroups(m0, m1, [&](auto rows, int64_t m) {
    FaithfulGroup<Q4, decltype(rows)::value>(w, row_bytes, x, k_dim, blocks, m, n0, n1, y, n_dim);
  });
}

// ---------------------------------------------------------------------------------------------
// Multi-row Q4_K x Q8_K on the interleaved layout (block_q4_Kx8: 8 weight rows per group), giving
// each row of x the very bits of ggml's ggml_gemv_q4_K_8x8_q8_K. That gemv keeps everything exact
// in int32 within a block: for each of the 8 columns (weight rows) c and block b,
//   i_b(c)   = sum_j sc_j(c) * sum_{v in sub-block j} q_v(c) x_v      (j = 0..7, 32 values each)
//   imin_b(c) = sum_j m_j(c) * bsum32_j(x)
// and then, in float, block after block: acc(c) = fma(float(i_b(c)), d(c) * dx, acc(c)), likewise
// acc_min(c) with dmin(c), and y(c) = acc(c) - acc_min(c). Here the same integers come from
// vpdpbusd (each 64-byte load of a group's quants is 8 columns x 8 consecutive values; the 8
// values of x they meet are broadcast to every column), the 4-bit values are unpacked once per
// block for up to kGroup rows of x, and the float steps are gemv's, in its order. So a row's
// result is the same bits as gemv's, whatever M, which the tests check against ggml's gemv.
struct BlockQ4Kx8 {
  uint16_t d[8], dmin[8];  // float16, one per column
  uint8_t scales[96];      // sub-block j's 6-bit scales and mins of the 8 columns at 12 j
  uint8_t qs[1024];        // 8 bytes of column 0, of column 1, ... of column 7, then the next 8
};
static_assert(sizeof(BlockQ4Kx8) == 8 * 144, "ggml's block_q4_Kx8");

inline __m512i Broadcast8(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

// Sums the int32 lane pairs (2c, 2c + 1) of v: column c's total, in lane c of the result.
inline __m256i ColumnSums(__m512i v) { return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32))); }

// Each block asks for the bytes 2 KB past it (1.8 blocks of 8 rows ahead), as Q6Kx8Group does:
// 8960 x 1536 on one thread of the Xeon, 20 copies cycled on huge pages, 1/2/3/5/8 rows of x
// 0.57/0.62/0.68/0.81/1.07 ms against 0.83-1.07/0.94/1.02-1.03/1.14-1.16/1.42-2.19 without (4 KB
// ahead: the same as 2 KB in one run of two, slower in the other; least thread CPU time of 20).
// q4k_prefetch: SpecJaxGgufPrefetchQ4K's switch, so that a benchmark can time the path before.
// The loops over rows of x and the 4 loads of a sub-block are unrolled by pragma (GCC left them
// rolled from R = 2 on, the accumulators in memory): the same shape then took 0.55/0.56/0.60/
// 0.68/0.79 ms (two runs, within 0.04).
constexpr int kQ4Kx8Prefetch = 2048;
std::atomic<bool> q4k_prefetch{true};

// Rows [m0, m0 + R) of x against `groups` groups of 8 weight rows starting at w; y's column n0
// is the first group's first row. bs32: per row of x and block, the 8 sums of its 32-value
// sub-blocks (from the Q8_K block's bsums, summed in pairs as gemv does).
template <int R>
void Q4Kx8Group(const uint8_t* w, int64_t groups, int64_t blocks, const BlockQ8K* xq, const int16_t* bs32,
                int64_t m0, float* y, int64_t n_dim, int64_t n0) {
  const bool prefetch = q4k_prefetch.load(std::memory_order_relaxed);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m128i pairs = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  for (int64_t g = 0; g < groups; ++g) {
    const auto* wg = reinterpret_cast<const BlockQ4Kx8*>(w) + g * blocks;
    __m256 acc[R], acc_min[R];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const BlockQ4Kx8& blk = wg[b];
      if (prefetch) {
        for (int line = 0; line < static_cast<int>(sizeof(BlockQ4Kx8)); line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(&blk) + kQ4Kx8Prefetch + line, _MM_HINT_T0);
        }
      }
      __m512i iacc[R];   // lanes 2c, 2c + 1: column c's sum of sc_j * (q . x) so far
      __m256i imin[R];   // lane c: column c's sum of m_j * bsum32_j so far
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) iacc[r] = _mm512_setzero_si512(), imin[r] = _mm256_setzero_si256();
      for (int sb = 0; sb < 4; ++sb) {  // sub-blocks 2 sb (low nibbles) and 2 sb + 1 (high)
        uint32_t t0[4], t1[4];
        ScalesMins12(blk.scales + 24 * sb, t0);
        ScalesMins12(blk.scales + 24 * sb + 12, t1);
        const __m512i sc_lo = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_set_epi32(0, 0, t0[1], t0[0]), pairs));
        const __m512i sc_hi = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_set_epi32(0, 0, t1[1], t1[0]), pairs));
        // int16 lanes 2c, 2c + 1: m_{2 sb}(c), m_{2 sb + 1}(c), for vpmaddwd with (bsum32_{2 sb}, bsum32_{2 sb + 1})
        const __m256i mins = _mm256_cvtepu8_epi16(
            _mm_unpacklo_epi8(_mm_set_epi32(0, 0, t0[3], t0[2]), _mm_set_epi32(0, 0, t1[3], t1[2])));
        __m512i lo[4], hi[4];  // 8 columns x 8 values: 64 sb + 8 q + i (lo), 64 sb + 32 + 8 q + i (hi)
        _Pragma("GCC unroll 8") for (int q = 0; q < 4; ++q) {
          const __m512i raw = _mm512_loadu_si512(blk.qs + 256 * sb + 64 * q);
          lo[q] = _mm512_and_si512(raw, nibble);
          hi[q] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
          const int8_t* a = xq[(m0 + r) * blocks + b].qs + 64 * sb;
          __m512i s_lo = _mm512_setzero_si512(), s_hi = _mm512_setzero_si512();
          _Pragma("GCC unroll 8") for (int q = 0; q < 4; ++q) {
            s_lo = _mm512_dpbusd_epi32(s_lo, lo[q], Broadcast8(a + 8 * q));
            s_hi = _mm512_dpbusd_epi32(s_hi, hi[q], Broadcast8(a + 32 + 8 * q));
          }
          iacc[r] = _mm512_add_epi32(iacc[r], _mm512_add_epi32(_mm512_mullo_epi32(s_lo, sc_lo),
                                                               _mm512_mullo_epi32(s_hi, sc_hi)));
          int32_t bs;
          std::memcpy(&bs, bs32 + ((m0 + r) * blocks + b) * 8 + 2 * sb, 4);
          imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(mins, _mm256_set1_epi32(bs)));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.d)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.dmin)));
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xq[(m0 + r) * blocks + b].d);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ColumnSums(iacc[r])), _mm256_mul_ps(d, dx), acc[r]);
        acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[r]), _mm256_mul_ps(dmin, dx), acc_min[r]);
      }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * n_dim + n0 + 8 * g, _mm256_sub_ps(acc[r], acc_min[r]));
  }
}

void Q4Kx8Rows(const uint8_t* w, int64_t groups, int64_t blocks, const BlockQ8K* xq, const int16_t* bs32, int64_t m0,
               int64_t m1, float* y, int64_t n_dim, int64_t n0) {
  InRowGroups(m0, m1, [&](auto rows, int64_t m) {
    Q4Kx8Group<decltype(rows)::value>(w, groups, blocks, xq, bs32, m, y, n_dim, n0);
  });
}

// ---------------------------------------------------------------------------------------------
// Multi-row Q6_K x Q8_K giving each row exactly the bits of ggml's own vec_dot (its AVX2 path,
// ggml_vec_dot_q6_K_q8_K), so that a one-row call can run that vec_dot (faster for one row) and
// a call of more rows this kernel (each block unpacked once for up to kGroup rows of x). vec_dot
// keeps, per block, 8 int32 lanes: lane L sums sc_g(v) * u_v * x_v over the values v with
// v % 32 in [4L, 4L + 4) (u in 0..63), minus 32 * (sc_2L bsum16_2L + sc_2L+1 bsum16_2L+1); then
// acc_L = fma(dx * d, float(lane L), acc_L) block after block, and the result is
// ((acc_4 + acc_0) + (acc_6 + acc_2)) + ((acc_5 + acc_1) + (acc_7 + acc_3)). Here lane l of a
// 64-value chunk's vpmaddubsw + vpmaddwd (values 4l .. 4l + 3, one group's scale) goes to lane
// l % 8: the same integers, the same float steps.
inline float HsumLikeGgml(__m256 acc) {
  __m128 res = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
  res = _mm_add_ps(res, _mm_movehl_ps(res, res));
  res = _mm_add_ss(res, _mm_movehdup_ps(res));
  return _mm_cvtss_f32(res);
}

// Rows [m0, m0 + R) of x against weight rows [n0, n1) over the blocks [b0, b1) of each row:
// vec_dot's lanes start at 0 (b0 = 0) or from carry[r * (n1 - n0) + n - n0], and go back there
// (b1 < blocks) or, summed, to y (the last blocks). Without kSpans, [b0, b1) is every block and
// carry is not used: the code of one span, whose lanes stay in registers (a first version that
// carried every shape's lanes made the lm head 1.1-1.3x slower at 5-16 rows).
template <int R, bool kSpans>
void Q6KGroup(const uint8_t* w, int64_t row_bytes, const BlockQ8K* xq, int64_t blocks, int64_t b0, int64_t b1,
              int64_t m0, int64_t n0, int64_t n1, __m256* carry, float* y, int64_t n_dim) {
  // int16 lane i of chunk c's vpmaddwd takes the scale of value 64 c + 2 i: group 4 c + i / 8.
  const __m256i group_of_lane = _mm256_set_epi8(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,  //
                                                1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t nn = n1 - n0;
  for (int64_t n = n0; n < n1; ++n) {
    const auto* row = reinterpret_cast<const BlockQ6K*>(w + n * row_bytes);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = !kSpans || b0 == 0 ? _mm256_setzero_ps() : carry[r * nn + n - n0];
    for (int64_t b = b0; b < b1; ++b) {
      const BlockQ6K& blk = row[b];
      __m512i u[4], sc16[4];
      ValuesQ6K(blk, u);
      const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
      for (int c = 0; c < 4; ++c) {  // the 4 scales of chunk c, each over 8 int16 lanes
        int32_t four;
        std::memcpy(&four, blk.scales + 4 * c, 4);
        sc16[c] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(_mm256_set1_epi32(four), group_of_lane));
      }
      const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
      const float dw = _cvtsh_ss(blk.d);
      for (int r = 0; r < R; ++r) {
        const BlockQ8K& xb = xq[(m0 + r) * blocks + b];
        __m512i sum16 = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          const __m512i p = _mm512_maddubs_epi16(u[c], _mm512_loadu_si512(xb.qs + 64 * c));
          sum16 = _mm512_add_epi32(sum16, _mm512_madd_epi16(p, sc16[c]));
        }
        __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(sum16), _mm512_extracti64x4_epi64(sum16, 1));
        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5));
        const float d = xb.d * dw;
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      if (kSpans && b1 < blocks) {
        carry[r * nn + n - n0] = acc[r];
      } else {
        y[(m0 + r) * n_dim + n] = HsumLikeGgml(acc[r]);
      }
    }
  }
}

// Rows [m0, m1) of y at columns [n0, n1). Where there are several groups of rows and the rows of
// x a group reads over a whole weight row would not stay in L1 (8 rows of the 8960-value down
// projection: 82 KB), the blocks go in spans of 24 KB of x per group, each span over every
// group and weight row in turn, so that a group's x stays in L1 and the task's weights of a span
// in L2 for the next group (16 rows at 1536 x 8960 on the Zen 5: 2.6-3.0 ms before, 2.0 in
// spans, against 1.5-1.6 at 8960 x 1536). One group (a verification call) reads each weight row
// once anyway, and there spans only broke the rows' streams into pieces: a model call over 3
// positions cost 47-51 ms with them and 44-46 without (docs/benchmarks.md, "A Zen 5"). Each
// (row, column) still adds its blocks in order into vec_dot's lanes: the same bits.
constexpr int64_t kSpanBlocks = (24 << 10) / (kGroup * sizeof(BlockQ8K));  // 24 KB of x per group

void Q6KRows(const uint8_t* w, int64_t row_bytes, const BlockQ8K* xq, int64_t blocks, int64_t m0, int64_t m1,
             int64_t n0, int64_t n1, float* y, int64_t n_dim) {
  const int64_t nn = n1 - n0, span = kSpanBlocks;
  if (m1 - m0 <= kGroup || blocks <= span) {
    InRowGroups(m0, m1, [&](auto rows, int64_t m) {
      Q6KGroup<decltype(rows)::value, false>(w, row_bytes, xq, blocks, 0, blocks, m, n0, n1, nullptr, y, n_dim);
    });
    return;
  }
  thread_local std::vector<__m256> lanes;  // the lanes between spans, reused
  if (lanes.size() < static_cast<size_t>((m1 - m0) * nn)) lanes.resize((m1 - m0) * nn);
  for (int64_t b0 = 0; b0 < blocks; b0 += span) {
    const int64_t b1 = std::min(blocks, b0 + span);
    InRowGroups(m0, m1, [&](auto rows, int64_t m) {
      Q6KGroup<decltype(rows)::value, true>(w, row_bytes, xq, blocks, b0, b1, m, n0, n1, lanes.data() + (m - m0) * nn,
                                            y, n_dim);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Multi-row Q6_K x Q8_K on an interleaved layout (this file's Q6Kx8: 8 weight rows per group, the
// same 210 bytes a block; llama.cpp repacks Q6_K only for ARM), giving each row of x exactly the
// bits of ggml's vec_dot, as Q6KGroup does, at about half its instructions per row of x: a 64-byte
// load of the group's values is 8 columns x 8 consecutive values of one 8-value step t, met by the
// 8 values of x broadcast to every column (vpmaddubsw, then vpdpwssd with the 16-value group's
// scale: each int32 lane of a column sums 4 values, exact), so per row of x a block of 8 columns
// costs 32 broadcasts, 32 vpmaddubsw and 32 vpdpwssd, 4 bsums products, 4 conversions and 4 fmas,
// with no per-column reduction inside the block. vec_dot's lane L of a column (the values v with
// v % 32 in [4L, 4L + 4)) is lane (2c + h) of pass k's accumulator, L = 2k + h, over the steps
// t = k + 4j (j = 0..7; value 8t + 4h + i has v % 32 = 8k + 4h + i); its correction
// -32 (sc_2L bsum_2L + sc_2L+1 bsum_2L+1) starts that accumulator. Then, as vec_dot, block after
// block acc_L = fma(dx * d, float(lane L), acc_L), and the column's result is
// ((acc_4 + acc_0) + (acc_6 + acc_2)) + ((acc_5 + acc_1) + (acc_7 + acc_3)).
//
// Q6Kx8, per group of 8 rows and block (1680 bytes):
//   d[8]          float16, one per column
//   scales[128]   scales[32 k + 4 c + q] = sc_{4k+q} of column c (k = 0..3, q = 0..3)
//   ql[1024]      64 bytes per j = 0..15; byte 8 c + i: the low 4 bits of value 8 j + i of column c
//                 (step t = j), and in its high nibble those of value 8 (j + 16) + i (t = j + 16)
//   qh[512]       64 bytes per j = 0..7; byte 8 c + i: bits 2q, 2q + 1 hold the top 2 bits of value
//                 8 (j + 8 q) + i of column c (q = 0..3)
struct BlockQ6Kx8 {
  uint16_t d[8];
  int8_t scales[128];
  uint8_t ql[1024];
  uint8_t qh[512];
};
static_assert(sizeof(BlockQ6Kx8) == 8 * sizeof(BlockQ6K), "Q6Kx8 holds the 8 blocks' bytes");

// The 6-bit values (0..63) of step t of a Q6Kx8 block: 8 columns x 8 values.
template <int t>
inline __m512i ValuesQ6Kx8(const BlockQ6Kx8& blk) {
  const __m512i ql = _mm512_loadu_si512(blk.ql + 64 * (t % 16));
  const __m512i lo = t < 16 ? ql : _mm512_srli_epi16(ql, 4);
  const __m512i qh = _mm512_loadu_si512(blk.qh + 64 * (t % 8));
  constexpr int q = t / 8;  // the top bits at 2q, 2q + 1 go to bits 4, 5
  const __m512i hi = q == 0 ? _mm512_slli_epi16(qh, 4)
                     : q == 1 ? _mm512_slli_epi16(qh, 2)
                     : q == 2 ? qh
                              : _mm512_srli_epi16(qh, 2);
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(0x0F)), _mm512_and_si512(hi, _mm512_set1_epi8(0x30)));
}

// int16 lanes 4c .. 4c + 3 of a scale vector all take lane 4c + q of the source (the scale
// sc_{4k+q} of column c): a vpshufb within 128-bit lanes (two columns each).
template <int q>
inline __m512i SpreadScale(__m512i s16) {
  const __m512i ctrl = _mm512_broadcast_i32x4(_mm_set_epi8(8 + 2 * q + 1, 8 + 2 * q, 8 + 2 * q + 1, 8 + 2 * q,
                                                            8 + 2 * q + 1, 8 + 2 * q, 8 + 2 * q + 1, 8 + 2 * q,
                                                            2 * q + 1, 2 * q, 2 * q + 1, 2 * q, 2 * q + 1, 2 * q,
                                                            2 * q + 1, 2 * q));
  return _mm512_shuffle_epi8(s16, ctrl);
}

// Pass k (lanes L = 2k, 2k + 1 of each column) of one block for rows [m0, m0 + R): steps
// t = k + 4j, whose values take the scales s = 2j + k / 2 (source vector k' = s / 4, lane q = s % 4).
template <int R, int k, int j = 0>
inline void Q6Kx8Steps(const BlockQ6Kx8& blk, const __m512i s16[4], const int8_t* const xs[R], __m512i acc[R]) {
  if constexpr (j < 8) {
    constexpr int t = k + 4 * j, s = 2 * j + k / 2;
    const __m512i u = ValuesQ6Kx8<t>(blk);
    const __m512i sc = SpreadScale<s % 4>(s16[s / 4]);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(u, Broadcast8(xs[r] + 8 * t)), sc);
    }
    Q6Kx8Steps<R, k, j + 1>(blk, s16, xs, acc);
  }
}

template <int R, int k>
inline void Q6Kx8Pass(const BlockQ6Kx8& blk, const __m512i s16[4], const BlockQ8K* const xb[R], const __m512 dw,
                      __m512 facc[R][4]) {
  // -32 sc_{4k+q} of column c in int16 lane 4c + q, against bsums 4k .. 4k + 3 of the row: lane
  // (2c + h) gets -32 (sc_{2L} bsum_{2L} + sc_{2L+1} bsum_{2L+1}), L = 2k + h.
  const __m512i corr = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(s16[k], 5));
  __m512i acc[R];
  const int8_t* xs[R];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_madd_epi16(corr, Broadcast8(xb[r]->bsums + 4 * k));
    xs[r] = xb[r]->qs;
  }
  Q6Kx8Steps<R, k>(blk, s16, xs, acc);
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    const __m512 d = _mm512_mul_ps(_mm512_set1_ps(xb[r]->d), dw);  // dx * dw, as vec_dot's float
    facc[r][k] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acc[r]), facc[r][k]);
  }
}

// Each block asks for the bytes 4 KB past it (about 2.4 blocks of 8 rows ahead, the next group's
// where the row ends): the lm head (151936 x 1536) on one thread of the Xeon, weights on huge
// pages, took 13.8 ms for a row of x against 19.3 without (on 4 KB pages: 2 KB ahead 15.8, 4 KB
// 14.1, 8 KB 16.4; scripts/q6k_layout_bench.cc, min thread CPU time): the hardware prefetchers
// fall behind the stream between a block's products. The loops over the R rows are unrolled by
// pragma: GCC left them rolled from R = 3 on, the accumulators in memory, and 3-8 rows of x
// cost about twice as much per row.
constexpr int kQ6Kx8Prefetch = 4096;

// Rows [m0, m0 + R) of x against `groups` groups of 8 weight rows from w; y's column n0 is the
// first group's first row.
template <int R>
void Q6Kx8Group(const uint8_t* w, int64_t groups, int64_t blocks, const BlockQ8K* xq, int64_t m0, float* y,
                int64_t n_dim, int64_t n0) {
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i evens = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
  for (int64_t g = 0; g < groups; ++g) {
    const auto* wg = reinterpret_cast<const BlockQ6Kx8*>(w) + g * blocks;
    __m512 facc[R][4];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      for (int k = 0; k < 4; ++k) facc[r][k] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const BlockQ6Kx8& blk = wg[b];
      for (int line = 0; line < static_cast<int>(sizeof(BlockQ6Kx8)); line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(&blk) + kQ6Kx8Prefetch + line, _MM_HINT_T0);
      }
      __m512i s16[4];
      for (int k = 0; k < 4; ++k) {
        s16[k] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.scales + 32 * k)));
      }
      const __m512 dw = _mm512_permutexvar_ps(
          pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.d)))));
      const BlockQ8K* xb[R];
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) xb[r] = &xq[(m0 + r) * blocks + b];
      Q6Kx8Pass<R, 0>(blk, s16, xb, dw, facc);
      Q6Kx8Pass<R, 1>(blk, s16, xb, dw, facc);
      Q6Kx8Pass<R, 2>(blk, s16, xb, dw, facc);
      Q6Kx8Pass<R, 3>(blk, s16, xb, dw, facc);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      // lane 2c + h: ((acc_h + acc_4+h) + (acc_2+h + acc_6+h)), then h = 0 plus h = 1: vec_dot's order
      const __m512 s = _mm512_add_ps(_mm512_add_ps(facc[r][0], facc[r][2]), _mm512_add_ps(facc[r][1], facc[r][3]));
      const __m512 both = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));  // lanes 2c, 2c + 1 swapped
      _mm256_storeu_ps(y + (m0 + r) * n_dim + n0 + 8 * g,
                       _mm512_castps512_ps256(_mm512_permutexvar_ps(evens, both)));
    }
  }
}

void Q6Kx8Rows(const uint8_t* w, int64_t groups, int64_t blocks, const BlockQ8K* xq, int64_t m0, int64_t m1,
               float* y, int64_t n_dim, int64_t n0) {
  for (int64_t g = 0; g < groups; ++g) {  // a group's blocks stay in cache for every group of rows
    InRowGroups(m0, m1, [&](auto rows, int64_t m) {
      Q6Kx8Group<decltype(rows)::value>(w + g * blocks * sizeof(BlockQ6Kx8), 1, blocks, xq, m, y, n_dim, n0 + 8 * g);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Which kernel a product of one row of x runs: ggml's own (gemv for interleaved Q4_K, vec_dot for
// Q6_K) or this file's multi-row kernel, which gives that row the same bits. Which is faster
// depends on how the CPU runs 512-bit instructions. A Zen 4 runs them in two passes, and there
// ggml's one-row products (256-bit) were faster. A Zen 5 runs them whole, and there this file's
// made the Qwen 1.5B's decode step 25.8-27.9 ms against 31.5-33.3 ms with ggml's (the Q4_K
// products nearly all of it; docs/benchmarks.md, "A Zen 5"). So each process times 512-bit
// against 256-bit vpdpbusd once (about 0.1 ms): this file's kernels for one row where a 512-bit
// one costs under 1.5 times a 256-bit one.
// SpecJaxGgufFixOneRow fixes the choice instead (models/kernels/gguf_matmul.py: from
// $SPEC_JAX_GGUF_ONE_ROW, before any product). A row's bits are the same either way.
template <typename V, typename Dot>
double DotChainsSeconds(const Dot& dot) {
  constexpr int kChains = 12, kSteps = 4000;  // independent chains: throughput, not latency
  V acc[kChains] = {};
  V a, b;
  std::memset(&a, 1, sizeof(a));
  std::memset(&b, 2, sizeof(b));
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kSteps; ++i) {
      for (int c = 0; c < kChains; ++c) {
        acc[c] = dot(acc[c], a, b);
        asm volatile("" : "+v"(acc[c]));
      }
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

bool FullWidth512() {
  const double wide =
      DotChainsSeconds<__m512i>([](__m512i s, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(s, a, b); });
  const double half =
      DotChainsSeconds<__m256i>([](__m256i s, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(s, a, b); });
  return wide < 1.5 * half;
}

std::atomic<int> fixed_one_row{-1};  // SpecJaxGgufFixOneRow's: 0 ggml's, 1 own, -1 measured

// Whether a one-row product runs this file's kernel (true) or ggml's: decided at the first.
bool OwnOneRow() {
  static const bool own = fixed_one_row.load() >= 0 ? fixed_one_row.load() == 1 : FullWidth512();
  return own;
}
#endif  // AVX-512 VNNI

// fn(m) for the rows m = m0, m0 + step, ... below m1 of x (quantizing them): on XLA's threads
// where they hold at least kParallelValues values, else on the calling thread. A row's bytes
// do not depend on the thread. Quantizing a value to Q8_K costs about 0.9 ns on the Zen 5, so a
// prefill chunk's rows (32 x 8960 for the down projection: 0.25 ms) kept one of two threads
// waiting on the other.
constexpr int64_t kParallelValues = 1 << 15;

template <typename F>
void EachXRow(ffi::ThreadPool& pool, int64_t m0, int64_t m1, int64_t step, int64_t k_dim, const F& fn) {
  const int64_t rows = m1 > m0 ? (m1 - m0 + step - 1) / step : 0;
  if (rows > 1 && rows * step * k_dim >= kParallelValues) {
    spec_jax::ParallelChunks(pool, rows, [&](int64_t i) { fn(m0 + i * step); });
  } else {
    for (int64_t i = 0; i < rows; ++i) fn(m0 + i * step);
  }
}

// Weight rows per task over n_dim rows: `most`, or fewer where that would leave one of the pool's
// threads without a task, in multiples of `multiple`.
int64_t RowsPerTask(ffi::ThreadPool& pool, int64_t n_dim, int64_t most, int64_t multiple) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return std::min(most, std::max(multiple, ((n_dim + threads - 1) / threads + multiple - 1) / multiple * multiple));
}

// fn(m0, m1, n0, n1) over tasks of kRowsPerTile weight rows (fewer, in multiples of 32, where a
// thread would be left without one) on XLA's threads, each taking the rows of x in passes of
// kXBlock. Each output is computed alone: which task holds it never changes its bits.
template <typename F>
void EachTile(ffi::ThreadPool& pool, int64_t m_rows, int64_t n_dim, const F& fn) {
  const int64_t per_task = RowsPerTask(pool, n_dim, kRowsPerTile, 32);
  spec_jax::ParallelChunks(pool, (n_dim + per_task - 1) / per_task, [&](int64_t c) {
    const int64_t n0 = c * per_task, n1 = std::min(n_dim, n0 + per_task);
    for (int64_t m0 = 0; m0 < m_rows; m0 += kXBlock) fn(m0, std::min(m_rows, m0 + kXBlock), n0, n1);
  });
}

ffi::Error Check(ggml_type type, int64_t k_dim, int64_t row_bytes) {
  if (type < 0 || type >= GGML_TYPE_COUNT || ggml_get_type_traits(type)->blck_size == 0 ||
      ggml_get_type_traits(type)->to_float == nullptr || ggml_get_type_traits_cpu(type)->vec_dot == nullptr) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "spec_jax gguf_matmul: unsupported ggml type");
  }
  if (k_dim % ggml_blck_size(type) != 0 || static_cast<int64_t>(ggml_row_size(type, k_dim)) != row_bytes) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "spec_jax gguf_matmul: a weight row's bytes do not hold K values of its type");
  }
  return ffi::Error::Success();
}

ffi::Error GgufMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_buf, ffi::Buffer<ffi::U8> w_buf,
                      ffi::Buffer<ffi::S32> live_buf, ffi::ResultBuffer<ffi::F32> y_buf, int64_t type_id,
                      bool quantize_x, bool ggml_dot, bool interleaved, bool bulk) {
  InitOnce();
  const auto xd = x_buf.dimensions(), wd = w_buf.dimensions(), yd = y_buf->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] ||
      live_buf.element_count() != 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "spec_jax gguf_matmul expects x [M, K], w [N, row_bytes], live rows [], y [M, N]");
  }
  const auto type = static_cast<ggml_type>(type_id);
  const int64_t k_dim = xd[1], n_dim = wd[0], row_bytes = wd[1];
  if (auto e = Check(type, k_dim, row_bytes); e.failure()) return e;
  if (interleaved && !quantize_x) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "spec_jax gguf_matmul: interleaved weights need quantize_x");
  }
  // Interleaved Q6_K (Q6Kx8) is this file's layout: only its multi-row kernel reads it.
  const bool q6k_x8 = interleaved && type == GGML_TYPE_Q6_K;
  if (q6k_x8 && (ggml_dot || n_dim % 8 != 0 || k_dim % 256 != 0)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "spec_jax gguf_matmul: interleaved Q6_K has rows a multiple of 8 and no ggml product");
  }
#ifndef SPEC_JAX_MULTIROW
  if (q6k_x8) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "spec_jax gguf_matmul: interleaved Q6_K needs the multi-row build (AVX-512 VNNI)");
  }
#endif
#ifdef SPEC_JAX_MULTIROW
  // The multi-row kernel is faster than ggml's gemm at every row count (docs/benchmarks.md, "The
  // GGUF kernel's paths"), and gives each row gemv's bits whatever the row count: bulk takes gemm
  // only with ggml_dot (ggml's own calls: its prefill product, which tests and benchmarks compare).
  const bool gemm = interleaved && !q6k_x8 && bulk && ggml_dot;
#else
  const bool gemm = interleaved && !q6k_x8 && bulk;
#endif
  const float* x = x_buf.typed_data();
  const uint8_t* w = w_buf.typed_data();
  float* y = y_buf->typed_data();
  // Rows of x from `live` on are padding (spec_jax::LiveRows). gemm takes rows in groups of 4 (a
  // row's bits are the same in any group), so it computes the live rows rounded up to 4 (each
  // live row then has the bits a call of all M rows gives it) and zeroes the extra ones after.
  const int64_t live = spec_jax::LiveRows(*live_buf.typed_data(), xd[0], n_dim, y);
  const int64_t m_rows = gemm ? std::min<int64_t>(xd[0], (live + 3) / 4 * 4) : live;

  if (quantize_x) {
    const auto* traits = ggml_get_type_traits_cpu(type);
    const ggml_type xt = traits->vec_dot_type;
    const int64_t x_bytes = static_cast<int64_t>(ggml_row_size(xt, k_dim));
    // Rows of x in groups of 4 for ggml's gemm (interleaved Q4_K, bulk): quantized 4 at a time
    // below, so the one-row quantization here skips them.
    const int64_t grouped = gemm ? m_rows / 4 * 4 : 0;
    std::vector<uint8_t> xq(m_rows * x_bytes);
    EachXRow(pool, grouped, m_rows, 1, k_dim, [&](int64_t m) {
      if (xt == GGML_TYPE_F32) {
        std::memcpy(xq.data() + m * x_bytes, x + m * k_dim, x_bytes);
      } else {
        ggml_get_type_traits_cpu(xt)->from_float(x + m * k_dim, xq.data() + m * x_bytes, k_dim);
      }
    });
    const uint8_t* xs = xq.data();
#ifdef SPEC_JAX_MULTIROW
    if (q6k_x8) {  // tasks of whole groups of 8 weight rows; each output computed alone
      const int64_t per_task = RowsPerTask(pool, n_dim, kRowsPerTile, 8), blocks = k_dim / 256;
      spec_jax::ParallelChunks(pool, (n_dim + per_task - 1) / per_task, [&](int64_t c) {
        const int64_t n0 = c * per_task, n1 = std::min(n_dim, n0 + per_task);
        Q6Kx8Rows(w + n0 * row_bytes, (n1 - n0) / 8, blocks, reinterpret_cast<const BlockQ8K*>(xs), 0, m_rows, y,
                  n_dim, n0);
      });
      return ffi::Error::Success();
    }
#endif
    if (interleaved) {
      if (type != GGML_TYPE_Q4_K || n_dim % 8 != 0 || k_dim % 256 != 0) {
        return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                          "spec_jax gguf_matmul: interleaved weights are Q4_K with rows a multiple of 8");
      }
      // Weight rows per task: kInterleavedChunk, or fewer where that would leave a thread idle
      // (the k and v products' 256 rows: 2 tasks of 128), in multiples of 16 so that each column
      // goes through the same code of ggml's gemm and gemv (16 columns at a time in their AVX-512
      // loops, a remainder of 8 in their AVX2 loop) as with kInterleavedChunk: the same bits.
      const int64_t per_task = RowsPerTask(pool, n_dim, kInterleavedChunk, 16);
      const int64_t tasks = (n_dim + per_task - 1) / per_task;
      std::vector<uint8_t> x4(grouped * x_bytes);
      EachXRow(pool, 0, grouped, 4, k_dim,
               [&](int64_t m) { ggml_quantize_mat_q8_K_4x8(x + m * k_dim, x4.data() + m * x_bytes, k_dim); });
      const int64_t blocks = k_dim / 256;
#ifdef SPEC_JAX_MULTIROW
      // This file's multi-row kernel (gemv's bits) for 2 or more rows of x left after gemm's; one
      // row runs whichever of it and ggml's gemv is faster on this CPU (OwnOneRow).
      const bool own = !ggml_dot && m_rows - grouped > (OwnOneRow() ? 0 : 1);
      std::vector<int16_t> bs32(own ? m_rows * blocks * 8 : 0);
      const auto* xb = reinterpret_cast<const BlockQ8K*>(xs);
      for (int64_t m = own ? grouped : m_rows; m < m_rows; ++m) {
        for (int64_t b = 0; b < blocks; ++b) {
          for (int j = 0; j < 8; ++j) {
            bs32[(m * blocks + b) * 8 + j] =
                static_cast<int16_t>(xb[m * blocks + b].bsums[2 * j] + xb[m * blocks + b].bsums[2 * j + 1]);
          }
        }
      }
#else
      const bool own = false;
#endif
      spec_jax::ParallelChunks(pool, tasks, [&](int64_t c) {
        const int64_t n0 = c * per_task, n1 = std::min(n_dim, n0 + per_task);
        if (grouped > 0) {
          ggml_gemm_q4_K_8x8_q8_K(static_cast<int>(k_dim), y + n0, static_cast<size_t>(n_dim), w + n0 * row_bytes,
                                  x4.data(), static_cast<int>(grouped), static_cast<int>(n1 - n0));
        }
#ifdef SPEC_JAX_MULTIROW
        if (own) {
          Q4Kx8Rows(w + n0 * row_bytes, (n1 - n0) / 8, blocks, xb, bs32.data(), grouped, m_rows, y, n_dim, n0);
          return;
        }
#endif
        for (int64_t m = grouped; m < m_rows; ++m) {
          ggml_gemv_q4_K_8x8_q8_K(static_cast<int>(k_dim), y + m * n_dim + n0, 0, w + n0 * row_bytes,
                                  xs + m * x_bytes, 1, static_cast<int>(n1 - n0));
        }
      });
      std::memset(y + live * n_dim, 0, (m_rows - live) * n_dim * sizeof(float));  // gemm's rounding
      return ffi::Error::Success();
    }
#ifdef SPEC_JAX_MULTIROW
    // Q6_K: more than one row by Q6KRows, one by it or ggml's vec_dot (the same bits), whichever
    // is faster on this CPU (OwnOneRow).
    if (!ggml_dot && (type == GGML_TYPE_Q4_K || (type == GGML_TYPE_Q6_K && (m_rows > 1 || OwnOneRow())))) {
      const auto* xb = reinterpret_cast<const BlockQ8K*>(xs);
      const int64_t blocks = k_dim / 256;
      EachTile(pool, m_rows, n_dim, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
        if (type == GGML_TYPE_Q4_K) {
          MultiRow(w, row_bytes, xb, blocks, m0, m1, n0, n1, y, n_dim);
        } else {
          Q6KRows(w, row_bytes, xb, blocks, m0, m1, n0, n1, y, n_dim);
        }
      });
      return ffi::Error::Success();
    }
#endif
    const ggml_vec_dot_t dot = traits->vec_dot;
    EachTile(pool, m_rows, n_dim, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * row_bytes;
        for (int64_t m = m0; m < m1; ++m) {
          float s;
          dot(static_cast<int>(k_dim), &s, 0, row, 0, xs + m * x_bytes, 0, 1);
          y[m * n_dim + n] = s;
        }
      }
    });
  } else {
#ifdef SPEC_JAX_MULTIROW
    if (!ggml_dot && (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K)) {
      EachTile(pool, m_rows, n_dim, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
        if (type == GGML_TYPE_Q4_K) {
          FaithfulRows<true>(w, row_bytes, x, k_dim, m0, m1, n0, n1, y, n_dim);
        } else {
          FaithfulRows<false>(w, row_bytes, x, k_dim, m0, m1, n0, n1, y, n_dim);
        }
      });
      return ffi::Error::Success();
    }
#endif
    const ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
    const ggml_vec_dot_t dot = ggml_get_type_traits_cpu(GGML_TYPE_F32)->vec_dot;
    spec_jax::ParallelChunks(pool, (n_dim + kRowsPerChunk - 1) / kRowsPerChunk, [&](int64_t c) {
      const int64_t n0 = c * kRowsPerChunk, n1 = std::min(n_dim, n0 + kRowsPerChunk);
      std::vector<float> rows((n1 - n0) * k_dim);  // the chunk's weight rows, dequantized once
      for (int64_t n = n0; n < n1; ++n) to_float(w + n * row_bytes, rows.data() + (n - n0) * k_dim, k_dim);
      for (int64_t m0 = 0; m0 < m_rows; m0 += kXBlock) {
        const int64_t m1 = std::min(m_rows, m0 + kXBlock);
        for (int64_t n = n0; n < n1; ++n) {
          const float* row = rows.data() + (n - n0) * k_dim;
          for (int64_t m = m0; m < m1; ++m) {
            float s;
            dot(static_cast<int>(k_dim), &s, 0, row, 0, x + m * k_dim, 0, 1);
            y[m * n_dim + n] = s;
          }
        }
      }
    });
  }
  return ffi::Error::Success();
}

// Rows of a block-format table (an embedding) at integer indices, dequantized: out[R, K].
ffi::Error GgufRows(ffi::Buffer<ffi::S32> idx_buf, ffi::Buffer<ffi::U8> w_buf, ffi::ResultBuffer<ffi::F32> out_buf,
                    int64_t type_id) {
  InitOnce();
  const auto wd = w_buf.dimensions(), od = out_buf->dimensions();
  const int64_t rows = idx_buf.element_count();
  if (wd.size() != 2 || od.size() != 2 || od[0] != rows) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "spec_jax gguf_rows expects idx [R], w [V, row_bytes], out [R, K]");
  }
  const auto type = static_cast<ggml_type>(type_id);
  const int64_t k_dim = od[1], row_bytes = wd[1];
  if (auto e = Check(type, k_dim, row_bytes); e.failure()) return e;
  const ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
  const int32_t* idx = idx_buf.typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = std::clamp<int64_t>(idx[r], 0, wd[0] - 1);
    to_float(w_buf.typed_data() + i * row_bytes, out_buf->typed_data() + r * k_dim, k_dim);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxGgufMatmul, GgufMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("ggml_type")
                                  .Attr<bool>("quantize_x")
                                  .Attr<bool>("ggml_dot")
                                  .Attr<bool>("interleaved")
                                  .Attr<bool>("bulk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxGgufRows, GgufRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("ggml_type"));

// For tests and the loader: ggml's quantization of float rows into a block format.
extern "C" size_t SpecJaxGgufQuantize(int type_id, const float* src, void* dst, int64_t rows, int64_t k_dim) {
  InitOnce();
  return ggml_quantize_chunk(static_cast<ggml_type>(type_id), src, dst, 0, rows, k_dim, nullptr);
}

// Q4_K rows [N, K] (N a multiple of 8) -> the same bytes as groups of 8 rows with their blocks
// interleaved: for each group and each block column, one block_q4_Kx8 (ggml-cpu/repack.h): the 8
// blocks' d, then dmin, their scales and mins regrouped per sub-block (96 bytes), their 4-bit
// values 8 bytes at a time round-robin (1024 bytes). The layout llama.cpp's CPU backend repacks
// Q4_K into, which ggml_gemv_q4_K_8x8_q8_K reads. Returns the bytes written (0: bad shape).
extern "C" size_t SpecJaxGgufInterleaveQ4K(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t k_dim) {
  if (rows % 8 != 0 || k_dim % 256 != 0) return 0;
  const int64_t blocks = k_dim / 256;
  struct Q4K { uint16_t d, dmin; uint8_t scales[12], qs[128]; };
  struct Q4Kx8 { uint16_t d[8], dmin[8]; uint8_t scales[96], qs[1024]; };
  static_assert(sizeof(Q4K) == 144 && sizeof(Q4Kx8) == 8 * 144, "ggml's layouts");
  const auto* in = reinterpret_cast<const Q4K*>(src);
  auto* out = reinterpret_cast<Q4Kx8*>(dst);
  for (int64_t g = 0; g < rows / 8; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      const Q4K* r[8];
      for (int i = 0; i < 8; ++i) r[i] = &in[(g * 8 + i) * blocks + b];
      Q4Kx8& o = out[g * blocks + b];
      for (int i = 0; i < 8; ++i) o.d[i] = r[i]->d, o.dmin[i] = r[i]->dmin;
      for (int i = 0; i < 128; ++i) std::memcpy(&o.qs[i * 8], &r[i % 8]->qs[(i / 8) * 8], 8);
      for (int half = 0; half < 2; ++half) {  // sub-blocks 0-3 (6-bit scales in one byte), then 4-7
        for (int i = 0; i < 4; ++i) {
          uint8_t sc[8], mn[8];
          for (int j = 0; j < 8; ++j) {
            const uint8_t* s = r[j]->scales;
            sc[j] = half == 0 ? s[i] & 63 : ((s[i] & 192) >> 2) | (s[i + 8] & 15);
            mn[j] = half == 0 ? s[i + 4] & 63 : ((s[i + 4] & 192) >> 2) | ((s[i + 8] & 240) >> 4);
          }
          uint8_t* t = &o.scales[half * 48 + i * 12];
          for (int j = 0; j < 4; ++j) {
            t[j] = (sc[j] & 63) + ((sc[j + 4] & 48) << 2);
            t[j + 4] = (mn[j] & 63) + ((mn[j + 4] & 48) << 2);
            t[j + 8] = (sc[j + 4] & 15) + ((mn[j + 4] & 15) << 4);
          }
        }
      }
    }
  }
  return static_cast<size_t>(rows * blocks * 144);
}

// Q6_K rows [N, K] (N a multiple of 8) <-> the same blocks as groups of 8 rows in this file's
// Q6Kx8 layout (BlockQ6Kx8 above), forward or back (to_x8 = 0): the 6-bit values, scales and d
// of each of the 8 blocks moved bit for bit, nothing requantized. Returns the bytes written (0:
// bad shape).
extern "C" size_t SpecJaxGgufInterleaveQ6K(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t k_dim,
                                           int to_x8) {
  if (rows % 8 != 0 || k_dim % 256 != 0) return 0;
  struct Q6K { uint8_t ql[128], qh[64]; int8_t scales[16]; uint16_t d; };
  struct Q6Kx8 { uint16_t d[8]; int8_t scales[128]; uint8_t ql[1024], qh[512]; };
  static_assert(sizeof(Q6K) == 210 && sizeof(Q6Kx8) == 8 * 210, "ggml's block_q6_K; Q6Kx8");
  const int64_t blocks = k_dim / 256;
  for (int64_t g = 0; g < rows / 8; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t x8_at = (g * blocks + b) * sizeof(Q6Kx8);
      Q6Kx8 x8;
      if (to_x8) {
        std::memset(&x8, 0, sizeof(x8));
      } else {
        std::memcpy(&x8, src + x8_at, sizeof(x8));
      }
      for (int c = 0; c < 8; ++c) {
        const int64_t at = ((g * 8 + c) * blocks + b) * sizeof(Q6K);
        Q6K one;
        if (to_x8) {
          std::memcpy(&one, src + at, sizeof(one));
        } else {
          std::memset(&one, 0, sizeof(one));
        }
        for (int v = 0; v < 256; ++v) {  // ggml's placing of value v (dequantize_row_q6_K)
          const int half = v / 128, l = v % 32, m = (v % 128) / 32;
          uint8_t& ql = one.ql[64 * half + l + 32 * (m % 2)];
          uint8_t& qh = one.qh[32 * half + l];
          const int ql_shift = 4 * (m / 2), qh_shift = 2 * m;
          const int t = v / 8, i = v % 8;
          uint8_t& xl = x8.ql[64 * (t % 16) + 8 * c + i];
          uint8_t& xh = x8.qh[64 * (t % 8) + 8 * c + i];
          const int xl_shift = 4 * (t / 16), xh_shift = 2 * (t / 8);
          if (to_x8) {
            const int u = ((ql >> ql_shift) & 15) | (((qh >> qh_shift) & 3) << 4);
            xl |= static_cast<uint8_t>((u & 15) << xl_shift);
            xh |= static_cast<uint8_t>((u >> 4) << xh_shift);
          } else {
            const int u = ((xl >> xl_shift) & 15) | (((xh >> xh_shift) & 3) << 4);
            ql |= static_cast<uint8_t>((u & 15) << ql_shift);
            qh |= static_cast<uint8_t>((u >> 4) << qh_shift);
          }
        }
        for (int s = 0; s < 16; ++s) {
          int8_t& xs = x8.scales[32 * (s / 4) + 4 * c + s % 4];
          if (to_x8) {
            xs = one.scales[s];
          } else {
            one.scales[s] = xs;
          }
        }
        if (to_x8) {
          x8.d[c] = one.d;
        } else {
          one.d = x8.d[c];
          std::memcpy(dst + at, &one, sizeof(one));
        }
      }
      if (to_x8) std::memcpy(dst + x8_at, &x8, sizeof(x8));
    }
  }
  return static_cast<size_t>(rows * blocks * sizeof(Q6K));
}

// Whether this build has the multi-row kernels (AVX-512 VNNI): calls of several rows of x then
// unpack each block once for up to 8 rows; without them every row is one ggml product.
extern "C" int SpecJaxGgufMultirow() {
#ifdef SPEC_JAX_MULTIROW
  return 1;
#else
  return 0;
#endif
}

// Whether the multi-row Q4_K kernel on the interleaved layout prefetches (1, the default) or
// not (0: the kernel as before, for benchmarks that time both in one process).
extern "C" void SpecJaxGgufPrefetchQ4K(int on) {
#ifdef SPEC_JAX_MULTIROW
  q4k_prefetch.store(on != 0);
#endif
}

// Fixes OwnOneRow's choice (0 ggml's, 1 this file's) where called before the first product.
extern "C" void SpecJaxGgufFixOneRow(int own) {
#ifdef SPEC_JAX_MULTIROW
  fixed_one_row.store(own);
#endif
}

// Whether one-row products of interleaved Q4_K and Q6_K run this file's kernels on this CPU
// (OwnOneRow) rather than ggml's; 0 without the multi-row build (ggml's, always).
extern "C" int SpecJaxGgufOneRowOwn() {
#ifdef SPEC_JAX_MULTIROW
  return OwnOneRow() ? 1 : 0;
#else
  return 0;
#endif
}
