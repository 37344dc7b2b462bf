// Profiling of the routed-expert FFN (last_phase_times, last_product_parts in expert_ffn.h): wall seconds per
// phase of the latest forward and backward call, and per product phase the thread-seconds spent packing weights,
// in the panel products and in the epilogues.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "expert_ffn.h"

namespace moecc::kernels::ffn {

// Times the phases of one call. Constructing it clears that direction's phase list and product parts together,
// so a reader never sees one call's phases beside another's parts; mark(phase) appends the seconds since the last
// mark (or construction).
class PhaseClock {
 public:
  explicit PhaseClock(bool backward);
  void mark(const char* phase);

 private:
  bool backward_;
  std::chrono::steady_clock::time_point last_;
};

// Nanoseconds the threads of one product phase spent in each part of its tasks.
struct PartClocks {
  std::atomic<int64_t> pack{0}, gemm{0}, epilogue{0};
};

// Runs fn() and adds the nanoseconds it took to `total`.
template <typename Fn>
void timed(std::atomic<int64_t>& total, Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  total += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// Appends a product phase's part times to the forward's or the backward's list.
void record_parts(bool backward, const char* phase, const PartClocks& clocks);

}  // namespace moecc::kernels::ffn
