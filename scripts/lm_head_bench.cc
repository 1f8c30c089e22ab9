// The lm head's product alone, as llama.cpp and as this project run it: y[151936] = W . x for a
// Q6_K weight of 151936 rows of 1536 values (the Qwen2.5-Coder-1.5B GGUF's output.weight, 191
// MB; random blocks) and one row of x quantized to Q8_K, on 4 KB pages and on transparent huge
// pages. Variants, timed round-robin:
//   ggml graph     ggml_mul_mat in a ggml graph on a ggml threadpool: llama.cpp's own call (on
//                  x86 this version repacks no Q6_K, so it runs ggml's vec_dot row by row);
//   vec_dot rows   ggml's vec_dot over chunks of 32 weight rows taken in turn by the threads:
//                  what models/kernels/gguf_matmul.cc runs for this product;
//   read only      the weight's bytes read and nothing else: the memory's rate.
// Each on the weight as malloc gives it (4 KB pages where transparent huge pages are on
// `madvise`) and on a copy advised for huge pages (MADV_HUGEPAGE, as models.convert.to_device
// places weights). Checks that the ggml graph's results equal vec_dot's bit for bit.
//
//   SRC, BUILD: python -c "from models.kernels import llama_cpp as l; print(l.source(), l.build_dir())"
//   g++ -O2 -march=native -std=c++17 -I$SRC/ggml/include scripts/lm_head_bench.cc \
//       -L$BUILD/bin -lggml-cpu -lggml-base -Wl,-rpath,$BUILD/bin -lpthread -o /tmp/lm_head_bench
//   /tmp/lm_head_bench [threads=2] [repeats=20]
// With threads=1 the times are the thread's CPU time (others' load on the machine then counts
// only through the memory they share); with 2, wall time.
#include <immintrin.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

constexpr int64_t kRows = 151936, kK = 1536, kRowBytes = kK / 256 * 210, kChunk = 32;
constexpr size_t kHuge = 2u << 20;

// fn(c) for c in [0, chunks) on the caller and one spinning worker (threads = 2), or the caller.
class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    if (threads_ > 1) worker_ = std::thread([this] { Work(); });
  }
  ~Pool() {
    stop_ = true;
    if (worker_.joinable()) worker_.join();
  }
  void Run(int64_t chunks, const std::function<void(int64_t)>& fn) {
    fn_ = &fn;
    chunks_ = chunks;
    next_ = 0;
    if (threads_ > 1) {
      busy_ = 1;
      generation_.fetch_add(1, std::memory_order_release);
    }
    Drain();
    while (busy_.load(std::memory_order_acquire) > 0) _mm_pause();
  }

 private:
  void Drain() {
    for (int64_t c; (c = next_.fetch_add(1)) < chunks_;) (*fn_)(c);
  }
  void Work() {
    for (int seen = 0; !stop_;) {
      if (generation_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        continue;
      }
      seen = generation_.load();
      Drain();
      busy_.fetch_sub(1, std::memory_order_release);
    }
  }
  int threads_;
  std::thread worker_;
  std::atomic<bool> stop_{false};
  std::atomic<int> generation_{0}, busy_{0};
  std::atomic<int64_t> next_{0};
  int64_t chunks_ = 0;
  const std::function<void(int64_t)>* fn_ = nullptr;
};

double Now(bool cpu_time) {
  timespec t;
  clock_gettime(cpu_time ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

uint8_t* OnHugePages(const std::vector<uint8_t>& w) {
  void* p = mmap(nullptr, w.size() + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  auto* start = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~uintptr_t(kHuge - 1));
  madvise(start, w.size(), MADV_HUGEPAGE);
  std::memcpy(start, w.data(), w.size());
  return start;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 20;
  ggml_cpu_init();
  std::mt19937 rng(1);
  std::vector<uint8_t> w(kRows * kRowBytes);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  for (int64_t b = 0; b < kRows * kK / 256; ++b) {  // each block's float16 d: a small positive scale
    const uint16_t d = _cvtss_sh(0.001f + 0.01f * static_cast<float>(rng() % 1000) / 1000.f, 0);
    std::memcpy(&w[b * 210 + 208], &d, 2);
  }
  std::vector<float> x(kK);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  std::vector<uint8_t> xq(ggml_row_size(GGML_TYPE_Q8_K, kK));
  ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x.data(), xq.data(), kK);
  const ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(GGML_TYPE_Q6_K)->vec_dot;
  const uint8_t* pages[2] = {w.data(), OnHugePages(w)};
  const char* page_names[2] = {"4 KB pages", "huge pages"};

  // llama.cpp's call: a graph of one ggml_mul_mat per weight copy, on a ggml threadpool.
  ggml_init_params params = {16 << 20, nullptr, false};
  ggml_context* ctx = ggml_init(params);
  ggml_threadpool_params pool_params = ggml_threadpool_params_default(threads);
  ggml_threadpool* ggml_pool = ggml_threadpool_new(&pool_params);
  ggml_tensor* xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, kK, 1);
  std::memcpy(xt->data, x.data(), kK * sizeof(float));
  std::vector<float> ys[2] = {std::vector<float>(kRows), std::vector<float>(kRows)};
  ggml_cgraph* graphs[2];
  ggml_cplan plans[2];
  std::vector<uint8_t> work[2];
  for (int p = 0; p < 2; ++p) {
    ggml_tensor* wt = ggml_new_tensor_2d(ctx, GGML_TYPE_Q6_K, kK, 1);  // one row allocated, then widened
    wt->ne[1] = kRows;
    wt->nb[2] = wt->nb[3] = kRows * kRowBytes;
    wt->data = const_cast<uint8_t*>(pages[p]);
    ggml_tensor* yt = ggml_mul_mat(ctx, wt, xt);
    yt->data = ys[p].data();
    graphs[p] = ggml_new_graph(ctx);
    ggml_build_forward_expand(graphs[p], yt);
    plans[p] = ggml_graph_plan(graphs[p], threads, ggml_pool);
    work[p].resize(plans[p].work_size + 64);
    plans[p].work_data = work[p].data();
  }

  Pool pool(threads);
  std::vector<float> y(kRows), sink(kRows / kChunk + 1);
  struct Variant {
    char name[64];
    std::function<void()> run;
    std::vector<double> seconds;
  };
  std::vector<Variant> variants;
  for (int p = 0; p < 2; ++p) {
    const uint8_t* wp = pages[p];
    Variant graph{{}, [&, p] { ggml_graph_compute(graphs[p], &plans[p]); }, {}};
    Variant rows{{}, [&, wp] {
                   pool.Run((kRows + kChunk - 1) / kChunk, [&](int64_t c) {
                     for (int64_t n = c * kChunk; n < std::min(kRows, (c + 1) * kChunk); ++n) {
                       vec_dot(kK, &y[n], 0, wp + n * kRowBytes, 0, xq.data(), 0, 1);
                     }
                   });
                 }, {}};
    Variant read{{}, [&, wp] {
                   pool.Run((kRows + kChunk - 1) / kChunk, [&](int64_t c) {
                     const int64_t n0 = c * kChunk, bytes = (std::min(kRows, n0 + kChunk) - n0) * kRowBytes;
                     __m512i acc = _mm512_setzero_si512();
                     for (int64_t i = 0; i + 64 <= bytes; i += 64) {
                       acc = _mm512_xor_si512(acc, _mm512_loadu_si512(wp + n0 * kRowBytes + i));
                     }
                     sink[c] = static_cast<float>(_mm512_reduce_add_epi32(acc));
                   });
                 }, {}};
    std::snprintf(graph.name, 64, "ggml graph, %s", page_names[p]);
    std::snprintf(rows.name, 64, "vec_dot rows, %s", page_names[p]);
    std::snprintf(read.name, 64, "read only, %s", page_names[p]);
    variants.push_back(graph);
    variants.push_back(rows);
    variants.push_back(read);
  }
  for (int r = 0; r <= repeats; ++r) {  // the first round warms up
    for (auto& v : variants) {
      const double t0 = Now(threads == 1);
      v.run();
      if (r > 0) v.seconds.push_back(Now(threads == 1) - t0);
    }
  }
  std::vector<float> rows_result(kRows);
  for (int64_t n = 0; n < kRows; ++n) vec_dot(kK, &rows_result[n], 0, w.data() + n * kRowBytes, 0, xq.data(), 0, 1);
  for (int p = 0; p < 2; ++p) {
    ggml_graph_compute(graphs[p], &plans[p]);
    const bool same = std::memcmp(ys[p].data(), rows_result.data(), kRows * sizeof(float)) == 0;
    std::printf("ggml graph on %s: %s vec_dot rows' results bit for bit\n", page_names[p], same ? "equals" : "DIFFERS FROM");
  }
  std::printf("%d thread(s), %s; %d repeats\n", threads, threads == 1 ? "CPU time" : "wall time", repeats);
  for (auto& v : variants) {
    std::sort(v.seconds.begin(), v.seconds.end());
    const double median = v.seconds[v.seconds.size() / 2];
    std::printf("%-28s median %7.3f ms  min %7.3f ms  (%.1f GB/s at the median)\n", v.name, median * 1e3,
                v.seconds[0] * 1e3, static_cast<double>(w.size()) / median / 1e9);
  }
  return 0;
}
