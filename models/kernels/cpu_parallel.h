// What the project's CPU kernels (cpu_matmul.cc, cpu_rowwise.cc, gguf_matmul.cc) share: one way to
// split a kernel's work over XLA's intra-op thread pool, and one rule for a product's padding rows
// (LiveRows, below).
//
// ParallelChunks(pool, chunks, fn) runs fn(c) for every c in [0, chunks) on the calling thread and
// the pool's threads, which take chunks in turn from a shared counter. The caller never waits for
// a task that has not started: XLA may run several custom calls at once (q, k and v are
// independent), each from a pool thread, so a task scheduled here can stay queued until this call
// returns; the caller takes every chunk left and waits only for chunks another thread is
// computing. The shared state lives on the heap, owned by every task, so a task that starts late
// finds no chunk and touches nothing else. Which thread computes a chunk never changes its result.

#ifndef SPEC_JAX_CPU_PARALLEL_H_
#define SPEC_JAX_CPU_PARALLEL_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace spec_jax {

struct ChunkCounter {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

template <typename F>
void ParallelChunks(xla::ffi::ThreadPool& pool, int64_t chunks, const F& fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto work = std::make_shared<ChunkCounter>();
  const F* body = &fn;  // late tasks find no chunk and never touch it
  auto drain = [work, body, chunks]() {
    for (;;) {
      work->active.fetch_add(1, std::memory_order_acq_rel);
      const int64_t c = work->next.fetch_add(1, std::memory_order_acq_rel);
      if (c >= chunks) {
        work->active.fetch_sub(1, std::memory_order_acq_rel);
        return;
      }
      (*body)(c);
      work->active.fetch_sub(1, std::memory_order_acq_rel);
    }
  };
  for (int64_t t = 1; t < std::min(threads, chunks); ++t) pool.Schedule([drain]() { drain(); });
  drain();
  while (work->active.load(std::memory_order_acquire) > 0) _mm_pause();
}

// LiveRows(live, m_rows, n_dim, y) -> the rows of x a product computes, where the rows from
// `live` on are padding (a prefill's last chunk, which its prompt does not fill): live clamped to
// [0, m_rows]. The padding's outputs, y[live:m_rows, 0:n_dim], are set to 0 and not computed; a
// computed row's bits do not depend on how many rows the call computes.
inline int64_t LiveRows(int32_t live, int64_t m_rows, int64_t n_dim, float* y) {
  const int64_t rows = std::clamp<int64_t>(live, 0, m_rows);
  std::memset(y + rows * n_dim, 0, (m_rows - rows) * n_dim * sizeof(float));
  return rows;
}

}  // namespace spec_jax

#endif  // SPEC_JAX_CPU_PARALLEL_H_
