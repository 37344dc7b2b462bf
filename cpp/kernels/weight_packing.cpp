// Packing into the panel layout described in weight_packing.h.
#include "weight_packing.h"

#include <cstring>

#include "../pool/thread_pool.h"

namespace moecc::kernels {

void pack_experts(const uint16_t* src, int64_t experts, int64_t n, int64_t k, uint16_t* dst,
                  moecc::pool::ThreadPool& pool) {
  const int64_t kp = padded_k(k), per_expert = packed_elements(n, k);
  pool.run(experts, [&](int64_t e, int) {
    const uint16_t* w = src + e * n * k;
    uint16_t* out = dst + e * per_expert;
    std::memset(out, 0, sizeof(uint16_t) * per_expert);
    for (int64_t row = 0; row < n; ++row) {
      for (int64_t col = 0; col < k; ++col) out[packed_offset(row, col, kp)] = w[row * k + col];
    }
  });
}

}  // namespace moecc::kernels
