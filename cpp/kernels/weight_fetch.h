// Background fetch of a later task's weights (set_weight_fetch in expert_ffn.h). The products pack each task's
// weight slice from the model's own bf16 matrices, read from DRAM: 2.4 GB per forward and backward at 8192 tokens
// for Qwen3-30B-A3B, about 14% of the products' thread time on the AMX host (2026-11-30), while DRAM idles under
// the tile products. With a fetch started, the products' inner loops ask for a few lines per step of the slice a
// task further down the list will pack, into this core's L2. That task usually runs on another core, which then
// gets the lines from this core's L2 (or from L3, where evicted lines may land) instead of from DRAM; with T
// threads taking tasks in order, it starts about distance / T task-lengths later, so a distance below T leaves
// most of its fetch unfinished when it starts.
#pragma once

#include <xmmintrin.h>  // _mm_prefetch (SSE: every x86-64 CPU)

#include <cstdint>

namespace moecc::kernels {

// `rows_left` rows of `row_bytes` bytes, `stride` bytes apart, from address `row`: every cache line that holds a
// byte of them, lines_per_step lines per step(). Addresses are integers, so a line that starts before the first
// row (a row not 64-byte aligned) forms no pointer before the object; a prefetch never faults.
struct WeightFetch {
  std::uintptr_t row = 0;
  int64_t row_bytes = 0, stride = 0, rows_left = 0, lines_per_step = 0;
  int64_t offset = 0;  // of the next line from `row`: from -(row % 64), in steps of 64, while below row_bytes
  int64_t issued = 0;  // lines asked for since started (tests and benchmarks read the sum per call)
  std::uintptr_t last_line = 0;  // the latest line asked for (tests)

  WeightFetch() = default;
  WeightFetch(const void* first, int64_t rows, int64_t bytes, int64_t row_stride, int64_t per_step)
      : row(reinterpret_cast<std::uintptr_t>(first)), row_bytes(bytes), stride(row_stride),
        rows_left(bytes > 0 && per_step > 0 ? rows : 0), lines_per_step(per_step),
        offset(-static_cast<int64_t>(row % 64)) {}

  bool active() const { return rows_left > 0; }
  void step() {
    for (int64_t i = 0; i < lines_per_step && rows_left > 0; ++i) {
      last_line = row + offset;
      _mm_prefetch(reinterpret_cast<const char*>(last_line), _MM_HINT_T1);
      ++issued;
      offset += 64;
      if (offset >= row_bytes && --rows_left > 0) {
        row += stride;
        offset = -static_cast<int64_t>(row % 64);
      }
    }
  }
};

// The lines WeightFetch asks for in `rows` rows of `bytes` bytes, `stride` apart, from `first`.
inline int64_t weight_fetch_lines(std::uintptr_t first, int64_t rows, int64_t bytes, int64_t stride) {
  int64_t lines = 0;
  for (int64_t r = 0; r < rows && bytes > 0; ++r) {
    const std::uintptr_t start = first + r * stride;
    lines += static_cast<int64_t>((start + bytes + 63) / 64 - start / 64);
  }
  return lines;
}

// The calling thread's fetch. expert_ffn.cpp starts it before a task's products and stops it after.
WeightFetch& thread_weight_fetch();

// What the kernels step: the thread's fetch while it has lines left, else null (one look per kernel call).
inline WeightFetch* active_weight_fetch() {
  WeightFetch& fetch = thread_weight_fetch();
  return fetch.active() ? &fetch : nullptr;
}

}  // namespace moecc::kernels
