// The generic body of dequantize.h in 16-lane vectors (vector16.h): 16 columns of a row are decoded from their codes,
// multiplied by their one scale (every scale group is a multiple of 16 columns, and chunks start at multiples of
// 16) and rounded to bf16 with integer operations. Built once per ISA, each translation unit with its own flags
// (setup.py): dequantize.cpp for the baseline ISA, isa/dequantize_avx512.cpp (one zmm register a vector).
// Everything here has internal linkage, so no build's copy of a function can stand in for another's at link time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dequantize.h"
#include "vector16.h"

namespace moecc::kernels {

// One build's entry point; the dispatcher (dequantize.cpp) picks a build once.
struct DequantizeKernels {
  void (*block)(const QuantizedWeights& w, int64_t expert, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
                uint16_t* dst);
};

const DequantizeKernels& dequantize_baseline();  // dequantize.cpp
const DequantizeKernels& dequantize_avx512();    // isa/dequantize_avx512.cpp

namespace {

using namespace v16;

typedef int8_t vs8 __attribute__((vector_size(16)));
typedef uint8_t vu8 __attribute__((vector_size(16)));

constexpr bool is_nibbles(WeightFormat format) {
  return format == WeightFormat::kInt4 || format == WeightFormat::kMxfp4;
}

// The 16 4-bit codes of 8 bytes, in column order: little-endian, code j sits at bits 4j of the bytes.
MOECC_INLINE vu nibbles16(const uint8_t* bytes) {
  uint32_t low, high;
  std::memcpy(&low, bytes, sizeof(low));
  std::memcpy(&high, bytes + 4, sizeof(high));
  const vu lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vu words = lane < 8u ? vu{} + low : vu{} + high;
  return (words >> ((lane & 7u) * 4u)) & 0xFu;
}

// The decoded values (before their scale) of the 16 columns whose codes start at `codes`.
template <WeightFormat F>
MOECC_INLINE vf decode16(const uint8_t* codes) {
  if constexpr (F == WeightFormat::kInt8) {
    vs8 v;
    std::memcpy(&v, codes, sizeof(v));
    return __builtin_convertvector(v, vf);
  } else if constexpr (F == WeightFormat::kInt4) {
    return __builtin_convertvector(__builtin_convertvector(nibbles16(codes) ^ 8u, vi) - 8, vf);
  } else if constexpr (F == WeightFormat::kFp8) {  // e4m3fn: bias 7, no infinities, S.1111.111 NaN
    vu8 v;
    std::memcpy(&v, codes, sizeof(v));
    const vu x = __builtin_convertvector(v, vu);
    const vu exponent = (x >> 3) & 0xFu, mantissa = x & 7u;
    const vu normal = ((exponent + 120u) << 23) | (mantissa << 20);
    const vu subnormal = float_to_bits(__builtin_convertvector(mantissa, vf) * 0x1p-9f);  // m * 2^-9, exact
    vu bits = exponent == 0u ? subnormal : normal;
    bits = (x & 0x7Fu) == 0x7Fu ? vu{} + 0x7FC00000u : bits;
    return bits_to_float(bits | ((x & 0x80u) << 24));
  } else {  // e2m1: code 1 is 0.5; codes 2..7 are 2^(e-1) * (1 + m/2), float bits (code + 252) << 22
    const vu nibbles = nibbles16(codes), code = nibbles & 7u;
    const vu magnitude = code >= 2u ? (code + 252u) << 22 : (code == 1u ? vu{} + (126u << 23) : vu{});
    return bits_to_float(magnitude | ((nibbles & 8u) << 28));  // the sign bit: -0 included
  }
}

// e8m0 2^(s - 127) from its bits: s = 0 is the one subnormal, 255 NaN.
MOECC_INLINE float e8m0_value(uint8_t s) {
  const uint32_t bits = s == 0 ? 0x00400000u : s == 255 ? 0x7FC00000u : uint32_t{s} << 23;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// The scale of row `row`'s columns [c, c + 16) in expert `expert`.
template <WeightFormat F>
MOECC_INLINE float scale_of(const QuantizedWeights& w, int64_t expert, int64_t row, int64_t c) {
  if constexpr (F == WeightFormat::kMxfp4) {
    const uint8_t* scales = static_cast<const uint8_t*>(w.scales) + expert * w.scale_stride;
    return e8m0_value(scales[row * (w.cols / w.group) + c / w.group]);
  } else {
    const float* scales = static_cast<const float*>(w.scales) + expert * w.scale_stride;
    if constexpr (F == WeightFormat::kInt8) return scales[row];
    if constexpr (F == WeightFormat::kInt4) return scales[row * (w.cols / w.group) + c / w.group];
    const int64_t blocks = (w.cols + w.group - 1) / w.group;  // fp8: group x group blocks
    return scales[(row / w.group) * blocks + c / w.group];
  }
}

template <WeightFormat F>
void block_of(const QuantizedWeights& w, int64_t expert, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
              uint16_t* dst) {
  constexpr int64_t kHalves = is_nibbles(F) ? 2 : 1;  // columns a byte holds
  const int64_t k = w.cols, row_bytes = k / kHalves, width = k1 - k0;
  const uint8_t* const data = w.data + expert * w.data_stride;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* const row = data + r * row_bytes;
    uint16_t* const out = dst + (r - r0) * width;
    for (int64_t c = k0 / kLanes * kLanes; c < k1; c += kLanes) {
      // A chunk past the row's end (K % 16 != 0; only int8 and fp8 allow it) is decoded from a zero-padded copy.
      const int64_t inside = std::min(kLanes, k - c);
      uint8_t padded[kLanes] = {};
      const uint8_t* codes = row + c / kHalves;
      if (inside < kLanes) {
        std::memcpy(padded, codes, static_cast<size_t>((inside + kHalves - 1) / kHalves));
        codes = padded;
      }
      const vh bits = PortableBf16::narrow(decode16<F>(codes) * scale_of<F>(w, expert, r, c));
      const int64_t first = std::max(c, k0), last = std::min(c + kLanes, k1);
      if (first == c && last == c + kLanes) {
        store_bf16_bits(out + (c - k0), bits);
      } else {
        uint16_t lanes[kLanes];
        std::memcpy(lanes, &bits, sizeof(lanes));
        std::memcpy(out + (first - k0), lanes + (first - c), sizeof(uint16_t) * static_cast<size_t>(last - first));
      }
    }
  }
}

void block(const QuantizedWeights& w, int64_t expert, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
           uint16_t* dst) {
  switch (w.format) {
    case WeightFormat::kInt8: return block_of<WeightFormat::kInt8>(w, expert, r0, r1, k0, k1, dst);
    case WeightFormat::kInt4: return block_of<WeightFormat::kInt4>(w, expert, r0, r1, k0, k1, dst);
    case WeightFormat::kFp8: return block_of<WeightFormat::kFp8>(w, expert, r0, r1, k0, k1, dst);
    case WeightFormat::kMxfp4: return block_of<WeightFormat::kMxfp4>(w, expert, r0, r1, k0, k1, dst);
    case WeightFormat::kBf16: break;
  }
}

struct DequantizeBuild {
  static constexpr DequantizeKernels kernels{block};
};

}  // namespace
}  // namespace moecc::kernels
