// bf16_rounding.h, compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 (setup.py).
#include "../bf16_rounding.h"

#include "../vector16.h"

namespace moecc::kernels {

void round_bf16_native(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += v16::kLanes) v16::store16<v16::NativeBf16>(dst + i, v16::load16(src + i));
}

}  // namespace moecc::kernels
