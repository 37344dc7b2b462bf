// Background fetch of a later task's weights (set_weight_fetch in expert_ffn.h). The products pack each task's
// weight slice from the model's own bf16 matrices, read from DRAM: 2.4 GB per forward and backward at 8192 tokens
// for Qwen3-30B-A3B, about 14% of the products' thread time on the AMX host (2026-11-30), while DRAM idles under
// the tile products. With a fetch started, the products' inner loops ask for a few lines per step of the slice a
// task further down the list will pack, into this core's L2; the thread that packs it later finds the lines
// there or, evicted, in the shared L3.
#pragma once

#include <xmmintrin.h>  // _mm_prefetch (SSE: every x86-64 CPU)

#include <cstdint>

namespace moecc::kernels {

// `rows` rows of `row_bytes` bytes, `stride` bytes apart, from `row`; lines_per_step lines asked for per step().
struct WeightFetch {
  const char* row = nullptr;
  int64_t row_bytes = 0, stride = 0, rows_left = 0, offset = 0, lines_per_step = 0;
  int64_t issued = 0;  // lines asked for since started (tests and benchmarks read the sum per call)

  bool active() const { return rows_left > 0; }
  void step() {
    for (int64_t i = 0; i < lines_per_step && rows_left > 0; ++i) {
      _mm_prefetch(row + offset, _MM_HINT_T1);
      ++issued;
      offset += 64;
      if (offset >= row_bytes) {
        offset = 0;
        if (--rows_left > 0) row += stride;  // never a pointer past the last row
      }
    }
  }
};

// The calling thread's fetch. expert_ffn.cpp starts it before a task's products and stops it after.
WeightFetch& thread_weight_fetch();

// What the kernels step: the thread's fetch while it has lines left, else null (one look per kernel call).
inline WeightFetch* active_weight_fetch() {
  WeightFetch& fetch = thread_weight_fetch();
  return fetch.active() ? &fetch : nullptr;
}

}  // namespace moecc::kernels
