// The phase and part times of expert_ffn_profile.h. The lists are read by last_phase_times / last_product_parts
// from any thread, also while a call on another thread (GIL released) is writing them, hence the mutex.
#include "expert_ffn_profile.h"

#include <mutex>

namespace moecc::kernels {
namespace {

std::mutex phase_times_mutex;
PhaseTimes forward_times, backward_times;
std::vector<ProductParts> forward_parts, backward_parts;

}  // namespace

namespace ffn {

PhaseClock::PhaseClock(bool backward) : backward_(backward), last_(std::chrono::steady_clock::now()) {
  std::lock_guard<std::mutex> lock(phase_times_mutex);
  (backward ? backward_times : forward_times).clear();
  (backward ? backward_parts : forward_parts).clear();
}

void PhaseClock::mark(const char* phase) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(phase_times_mutex);
  (backward_ ? backward_times : forward_times).emplace_back(phase, std::chrono::duration<double>(now - last_).count());
  last_ = now;
}

void record_parts(bool backward, const char* phase, const PartClocks& clocks) {
  std::lock_guard<std::mutex> lock(phase_times_mutex);
  (backward ? backward_parts : forward_parts)
      .push_back({phase, clocks.pack.load() * 1e-9, clocks.gemm.load() * 1e-9, clocks.epilogue.load() * 1e-9});
}

}  // namespace ffn

PhaseTimes last_phase_times(bool backward) {
  std::lock_guard<std::mutex> lock(phase_times_mutex);
  return backward ? backward_times : forward_times;
}

std::vector<ProductParts> last_product_parts(bool backward) {
  std::lock_guard<std::mutex> lock(phase_times_mutex);
  return backward ? backward_parts : forward_parts;
}

}  // namespace moecc::kernels
