// The row-wise operations of a model call for XLA:CPU, each row computed alone in one fixed
// order: attention and RMSNorm, called through jax.ffi (models/kernels/cpu_matmul.py builds this
// file into the CPU kernel library with the products).
//
// Attention, under the contract of models/kernels/__init__.py, on a model's stacked cache: k and v
// are [L, B, S, KVH, D] read at the int32 scalar operand `layer` (a lone layer is L = 1), so no
// layer's slice is copied for the call, and each query reads only the slots its mask lets it see:
//
//   out[b, t, h] = softmax_s(q[b, t, h] . k[b, s, h / G] / sqrt(D)) . v[b, s, h / G]
//   over s <= q_positions[b, t], s < kv_lengths[b] and q_positions[b, t] - s < window;
//   zeros where no key is visible. window is an int32 scalar operand (the largest int32 for none):
//   a query's loop starts at max(0, p + 1 - window), so with a large window nothing changes.
//   tree is an int32 operand, empty (no tree) or [B, T]: the queries are a token tree's nodes,
//   whose keys sit in the last T slots, first = kv_lengths[b] - T + j for query j; query t then
//   sees the keys s < first by the rule above and key first + j where bit j of tree[b, t] is set.
//
// A query's visible keys are gathered into a list, in slot order (the committed keys within the
// window, then a tree's keys whose bit is set), and that list is reduced in the one order below.
// So a tree node gives the same bits as the same query decoded with its path laid out
// contiguously (its ancestors' keys, in slot order, are its path in depth order): the list, and
// so each 8-lane group of the sum, is the same.
//
// Why: XLA fuses and vectorizes the reference's einsums and softmax differently for different
// numbers of queries, so a query's result in a verification call (T = gamma + 1) differed from
// the same query's decode step (T = 1) in the last bits (about 1e-6 on the Qwen pair's logits at
// float32), which 8-bit activations (precision gguf_q8) and bfloat16 magnify into flipped
// near-ties. Here each query is computed alone, in one fixed order: the dot products over D in
// 8 lanes then a fixed tree, the scores' maximum, exp in 8 lanes then a fixed tree for their
// sum, and the weighted values in order of s. Nothing depends on T, the batch or the thread, so
// a query's result is the same bits in any call. AVX2 + FMA intrinsics, the same code in both
// builds of the library (both builds give the same bits).
//
// RMSNorm: y[m] = x[m] * (1 / sqrt(mean(x[m]^2) + eps)) * scale, the sum of squares in 8 lanes
// then a fixed tree then the tail, for the same reason (XLA's reduction of a [T, D] array is not
// the same bits as of a [1, D] one inside the model's fusions).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kInlineWork = 1 << 18;  // query x key x head-dim products below which attention runs inline

inline float Sum8(__m256 v) {  // a fixed tree: 4 + 4, 2 + 2, 1 + 1
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 in 8 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial, then 2^n; relative error about 2e-7). Lanes below -87.3 give 0.
inline __m256 Exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// q . k over d values: 8 lanes over d = 0, 8, ..., the lanes by Sum8, then the tail in order.
inline float Dot(const float* q, const float* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
  float s = Sum8(acc);
  for (; i < d; ++i) s += q[i] * k[i];
  return s;
}

// Dot for four keys at once, each key's sum in Dot's order (so the same bits): four independent
// chains of FMAs, which overlap where Dot's one chain waits on each FMA's latency.
inline void Dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t d,
                 float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 x = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + i), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + i), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + i), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + i), a3);
  }
  float s0 = Sum8(a0), s1 = Sum8(a1), s2 = Sum8(a2), s3 = Sum8(a3);
  for (; i < d; ++i) {
    s0 += q[i] * k0[i];
    s1 += q[i] * k1[i];
    s2 += q[i] * k2[i];
    s3 += q[i] * k3[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// One query: q [D] against the n keys / values at k + rows[i], v + rows[i] (i < n, each [D]),
// into out [D]. Every sum runs in the order the file's header gives; keys go four at a time
// (Dot4) and the weighted values 64 columns at a time (eight 8-lane sums over s side by side),
// which changes only how the independent sums interleave, not their bits.
void OneQuery(const float* q, const float* k, const float* v, const int64_t* rows, int64_t n, int64_t d,
              float scale, float* scores, float* out) {
  if (n <= 0) {
    std::fill(out, out + d, 0.0f);
    return;
  }
  int64_t s = 0;
  for (; s + 4 <= n; s += 4) Dot4(q, k + rows[s], k + rows[s + 1], k + rows[s + 2], k + rows[s + 3], d, scores + s);
  for (; s < n; ++s) scores[s] = Dot(q, k + rows[s], d);
  float top = -INFINITY;
  for (s = 0; s < n; ++s) {
    scores[s] *= scale;
    top = std::max(top, scores[s]);
  }
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  for (s = 0; s + 8 <= n; s += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), top8));
    _mm256_storeu_ps(scores + s, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = Sum8(sum8);
  if (s < n) {  // the tail as one masked step: the same exp as the lanes'
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = s + i < n ? scores[s + i] - top : -INFINITY;
    _mm256_store_ps(tail, Exp8(_mm256_load_ps(tail)));
    for (int64_t i = 0; s + i < n; ++i) {
      scores[s + i] = tail[i];
      total += tail[i];
    }
  }
  const __m256 inv8 = _mm256_set1_ps(1.0f / total);
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(scores[j]);
      const float* row = v + rows[j] + c;
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * u), acc[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + c + 8 * u, _mm256_mul_ps(acc[u], inv8));
  }
  for (; c + 8 <= d; c += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[j]), _mm256_loadu_ps(v + rows[j] + c), acc);
    _mm256_storeu_ps(out + c, _mm256_mul_ps(acc, inv8));
  }
  for (; c < d; ++c) {
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) acc += scores[j] * v[rows[j] + c];
    out[c] = acc * (1.0f / total);
  }
}

bool SameDims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_buf, ffi::Buffer<ffi::F32> k_buf,
                     ffi::Buffer<ffi::F32> v_buf, ffi::Buffer<ffi::S32> qpos_buf, ffi::Buffer<ffi::S32> kvlen_buf,
                     ffi::Buffer<ffi::S32> window_buf, ffi::Buffer<ffi::S32> tree_buf, ffi::Buffer<ffi::S32> layer_buf,
                     ffi::ResultBuffer<ffi::F32> out_buf) {
  // k and v are [L, B, S, KVH, D], read at layer `layer` (the model's whole stacked cache: no
  // copy of the layer's slice, and only the live slots of it are read).
  const auto qd = q_buf.dimensions(), kd5 = k_buf.dimensions();
  if (qd.size() != 4 || kd5.size() != 5 || !SameDims(v_buf.dimensions(), kd5) || qd[0] != kd5[1] ||
      qd[3] != kd5[4] || kd5[3] == 0 || qd[2] % kd5[3] != 0 || qpos_buf.element_count() != qd[0] * qd[1] ||
      kvlen_buf.element_count() != qd[0] || window_buf.element_count() != 1 || layer_buf.element_count() != 1 ||
      (tree_buf.element_count() != 0 && (tree_buf.element_count() != qd[0] * qd[1] || qd[1] > 32)) ||
      !SameDims(out_buf->dimensions(), qd)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "spec_jax attention expects q [B, T, H, D], k and v [L, B, S, KVH, D] with KVH dividing H, "
                      "q_positions [B, T], kv_lengths [B], window [], tree empty or [B, T] with T <= 32, "
                      "layer [], out [B, T, H, D]");
  }
  const int64_t batch = qd[0], t_dim = qd[1], heads = qd[2], d = qd[3], keys = kd5[2], kv_heads = kd5[3];
  const int64_t group = heads / kv_heads, kv_stride = kv_heads * d;
  const int64_t layer = std::clamp<int64_t>(layer_buf.typed_data()[0], 0, kd5[0] - 1);
  const float scale = static_cast<float>(std::pow(static_cast<double>(d), -0.5));
  const int64_t layer_offset = layer * batch * keys * kv_stride;
  const float *q = q_buf.typed_data(), *k = k_buf.typed_data() + layer_offset, *v = v_buf.typed_data() + layer_offset;
  const int32_t *qpos = qpos_buf.typed_data(), *kvlen = kvlen_buf.typed_data();
  const int64_t window = window_buf.typed_data()[0];
  const int32_t* tree = tree_buf.element_count() ? tree_buf.typed_data() : nullptr;
  float* out = out_buf->typed_data();
  const int64_t items = batch * t_dim * heads;  // one query head of one position of one row each
  auto body = [=](int64_t item) {
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> rows;  // the visible keys' offsets, in slot order
    scores.resize(std::max<int64_t>(keys, 1));
    rows.resize(std::max<int64_t>(keys, 1));
    const int64_t h = item % heads, bt = item / heads, b = bt / t_dim;
    const int64_t p = qpos[bt], length = std::min<int64_t>(kvlen[b], keys);
    const int64_t tree_first = static_cast<int64_t>(kvlen[b]) - t_dim;  // a tree's first slot
    int64_t end = std::min<int64_t>(p + 1, length);  // committed keys s < end ...
    if (tree) end = std::min<int64_t>(end, std::max<int64_t>(tree_first, 0));  // (below the tree's)
    // ... from the window's first (int64: no wrap for any int32 window), never past end.
    const int64_t start = std::max<int64_t>(0, std::min<int64_t>(end, p + 1 - window));
    const int64_t base = b * keys * kv_stride + (h / group) * d;
    int64_t n = 0;
    for (int64_t s = start; s < end; ++s) rows[n++] = s * kv_stride;
    for (int64_t j = 0; tree && j < t_dim; ++j) {  // the tree's keys: ancestors and itself
      const int64_t s = tree_first + j;
      if ((tree[bt] >> j & 1) && s >= 0 && s < length) rows[n++] = s * kv_stride;
    }
    OneQuery(q + item * d, k + base, v + base, rows.data(), n, d, scale, scores.data(), out + item * d);
  };
  // A call whose work is a few microseconds (a decode step's 12 heads over a short context) runs
  // on the calling thread: waking a pool thread cost more than it saved. Which thread computes a
  // query never changes its bits.
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, std::min<int64_t>(kvlen[b], keys));
  if (items * longest * d < kInlineWork) {
    for (int64_t i = 0; i < items; ++i) body(i);
    return ffi::Error::Success();
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(1, items / (4 * threads));
  spec_jax::ParallelChunks(pool, (items + chunk - 1) / chunk, [&](int64_t c) {
    for (int64_t i = c * chunk; i < std::min(items, (c + 1) * chunk); ++i) body(i);
  });
  return ffi::Error::Success();
}

ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x_buf, ffi::Buffer<ffi::F32> scale_buf, ffi::ResultBuffer<ffi::F32> y_buf,
                   float eps) {
  const auto xd = x_buf.dimensions();
  if (xd.size() != 2 || scale_buf.element_count() != xd[1] || !SameDims(y_buf->dimensions(), xd)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "spec_jax rms_norm expects x [M, D], scale [D], y [M, D]");
  }
  const int64_t rows = xd[0], d = xd[1];
  const float *x = x_buf.typed_data(), *scale = scale_buf.typed_data();
  float* y = y_buf->typed_data();
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * d;
    const float inv = 1.0f / std::sqrt(Dot(row, row, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[m * d + i] = row[i] * inv * scale[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
