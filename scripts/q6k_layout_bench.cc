// The multi-row Q6_K kernels of models/kernels/gguf_matmul.cc side by side on one thread: Q6KRows
// (the file's own rows) against Q6Kx8Rows (the interleaved Q6Kx8 layout), y[M, N] = x[M, K] . W^T
// for M = 1, 2, 3, 4, 5, 8, random blocks from ggml's quantizer, x quantized to Q8_K. Each figure
// is the least thread CPU time of the repeats (the two kernels alternating), so that the machine's
// other load counts only through the memory and the core it shares; checks that both give the
// same bits at every M. HUGE=1 advises the weights for transparent huge pages (as models.load
// places them); `copies` weights cycled, so that a shape smaller than the caches comes from memory.
//
//   SRC=$(python -c "from models.kernels import llama_cpp as l; print(l.source())")
//   BUILD=$(python -c "from models.kernels import llama_cpp as l; print(l.build_dir())")
//   FFI=$(python -c "import jax; print(jax.ffi.include_dir())")
//   g++ -O2 -march=native -ffp-contract=off -std=c++17 -w -I$FFI -I$SRC/ggml/include \
//       scripts/q6k_layout_bench.cc -L$BUILD/bin -lggml-cpu -lggml-base -Wl,-rpath,$BUILD/bin -o /tmp/q6k_bench
//   HUGE=1 /tmp/q6k_bench N K [repeats=15] [copies=1]      # e.g. 151936 1536 (the lm head)
#include "../models/kernels/gguf_matmul.cc"

#include <sys/mman.h>
#include <time.h>

#include <cstdio>
#include <random>

namespace {

double ThreadSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Bytes in 2 MB-aligned memory, advised for huge pages where $HUGE is set.
struct Weights {
  explicit Weights(size_t n) : size((n + (2 << 20) - 1) / (2 << 20) * (2 << 20)) {
    data = static_cast<uint8_t*>(aligned_alloc(2 << 20, size));
    if (getenv("HUGE")) madvise(data, size, MADV_HUGEPAGE);
  }
  ~Weights() { free(data); }
  Weights(const Weights&) = delete;
  size_t size;
  uint8_t* data;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s N K [repeats] [copies]  (N a multiple of 8, K of 256)\n", argv[0]);
    return 2;
  }
  const int64_t n = atoll(argv[1]), k = atoll(argv[2]);
  const int reps = argc > 3 ? atoi(argv[3]) : 15, copies = argc > 4 ? atoi(argv[4]) : 1;
  if (n <= 0 || n % 8 || k <= 0 || k % 256 || reps < 1 || copies < 1) {
    fprintf(stderr, "N must be a positive multiple of 8, K of 256, repeats and copies at least 1\n");
    return 2;
  }
  ggml_cpu_init();
  const int64_t row_bytes = k / 256 * 210, blocks = k / 256;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> wf(n * k), xf(8 * k);
  for (auto& v : wf) v = normal(rng);
  for (auto& v : xf) v = 3 * normal(rng);
  std::vector<std::unique_ptr<Weights>> rows, x8;
  for (int c = 0; c < copies; ++c) {
    rows.push_back(std::make_unique<Weights>(n * row_bytes));
    x8.push_back(std::make_unique<Weights>(n * row_bytes));
    ggml_quantize_chunk(GGML_TYPE_Q6_K, wf.data(), rows[c]->data, 0, n, k, nullptr);
    SpecJaxGgufInterleaveQ6K(rows[c]->data, x8[c]->data, n, k, 1);
  }
  std::vector<BlockQ8K> xq(8 * blocks);
  for (int m = 0; m < 8; ++m) ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(xf.data() + m * k, &xq[m * blocks], k);
  std::vector<float> y_rows(8 * n), y_x8(8 * n);
  printf("N %ld K %ld, %d cop%s of %.1f MB%s; least thread CPU ms of %d\n", n, k, copies, copies > 1 ? "ies" : "y",
         n * row_bytes / 1e6, getenv("HUGE") ? " on huge pages" : "", reps);
  printf("| M | Q6KRows ms (x M=1) | Q6Kx8Rows ms (x M=1) | Q6Kx8 / rows |\n|---|---|---|---|\n");
  double first_rows = 0, first_x8 = 0;
  for (int m : {1, 2, 3, 4, 5, 8}) {
    double best_rows = 1e30, best_x8 = 1e30;
    for (int r = 0, turn = 0; r < reps; ++r) {
      for (int x8_path = 0; x8_path < 2; ++x8_path) {
        const int c = turn++ % copies;
        const double t0 = ThreadSeconds();
        for (int64_t n0 = 0; n0 < n; n0 += kRowsPerTile) {
          const int64_t n1 = std::min(n, n0 + kRowsPerTile);
          if (x8_path) {
            Q6Kx8Rows(x8[c]->data + n0 * row_bytes, (n1 - n0) / 8, blocks, xq.data(), 0, m, y_x8.data(), n, n0);
          } else {
            Q6KRows(rows[c]->data, row_bytes, xq.data(), blocks, 0, m, n0, n1, y_rows.data(), n);
          }
        }
        double& best = x8_path ? best_x8 : best_rows;
        best = std::min(best, ThreadSeconds() - t0);
      }
    }
    if (std::memcmp(y_rows.data(), y_x8.data(), m * n * sizeof(float)) != 0) {
      printf("different bits at M=%d\n", m);
      return 1;
    }
    if (m == 1) first_rows = best_rows, first_x8 = best_x8;
    printf("| %d | %.3f (%.2f) | %.3f (%.2f) | %.2f |\n", m, 1e3 * best_rows, best_rows / first_rows, 1e3 * best_x8,
           best_x8 / first_x8, best_x8 / best_rows);
  }
  return 0;
}
