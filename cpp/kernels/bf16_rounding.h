// AVX512-BF16's 16-lane bf16 rounding (vector16.h's NativeBf16) over a buffer, for the test that compares it with
// the integer rounding and torch (bindings.cpp, _round_bf16_test).
#pragma once

#include <cstdint>

namespace moecc::kernels {

// dst[i] = bf16(src[i]) for i < n (a multiple of 16) by VCVTNEPS2BF16; only where v16::native_bf16().
void round_bf16_native(const float* src, uint16_t* dst, int64_t n);

}  // namespace moecc::kernels
