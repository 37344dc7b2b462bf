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

// The 16 4-bit codes of 8 bytes, in column order, as int32 lanes 0..15: little-endian, code j sits at bits 4j of
// the bytes. Each lane's code is shifted to the top by a multiplication (the baseline ISA has no per-lane shift).
MOECC_INLINE vi nibbles16(const uint8_t* bytes) {
  uint32_t low, high;
  std::memcpy(&low, bytes, sizeof(low));
  std::memcpy(&high, bytes + 4, sizeof(high));
  const vu halves = {low, low, low, low, low, low, low, low, high, high, high, high, high, high, high, high};
  const vu to_top = {1u << 28, 1u << 24, 1u << 20, 1u << 16, 1u << 12, 1u << 8, 1u << 4, 1u,
                     1u << 28, 1u << 24, 1u << 20, 1u << 16, 1u << 12, 1u << 8, 1u << 4, 1u};
  return __builtin_convertvector((halves * to_top) >> 28, vi);
}

// The decoded values (before their scale) of the 16 columns whose codes start at `codes`. Lanes are int32 where they
// are converted to float or compared: SSE2 has signed forms of those only.
template <WeightFormat F>
MOECC_INLINE vf decode16(const uint8_t* codes) {
  if constexpr (F == WeightFormat::kInt8) {
    vs8 v;
    std::memcpy(&v, codes, sizeof(v));
    return __builtin_convertvector(v, vf);
  } else if constexpr (F == WeightFormat::kInt4) {
    return __builtin_convertvector((nibbles16(codes) ^ 8) - 8, vf);  // two's complement
  } else if constexpr (F == WeightFormat::kFp8) {  // e4m3fn: bias 7, no infinities, S.1111.111 NaN
    vu8 v;
    std::memcpy(&v, codes, sizeof(v));
    const vi x = __builtin_convertvector(v, vi);
    const vi exponent = (x >> 3) & 0xF, mantissa = x & 7;
    const vi normal = ((exponent + 120) << 23) | (mantissa << 20);
    const vi subnormal = __builtin_convertvector(float_to_bits(__builtin_convertvector(mantissa, vf) * 0x1p-9f), vi);
    vi magnitude = exponent == 0 ? subnormal : normal;  // subnormals: m * 2^-9, exact
    magnitude = (x & 0x7F) == 0x7F ? vi{} + 0x7FC00000 : magnitude;
    return bits_to_float(__builtin_convertvector(magnitude, vu) | (__builtin_convertvector(x & 0x80, vu) << 24));
  } else {  // e2m1: code 1 is 0.5; codes 2..7 are 2^(e-1) * (1 + m/2), float bits (code + 252) << 22
    const vi nibbles = nibbles16(codes), code = nibbles & 7;
    const vi magnitude = code >= 2 ? (code + 252) << 22 : (code == 1 ? vi{} + (126 << 23) : vi{});
    // the sign bit, -0 included
    return bits_to_float(__builtin_convertvector(magnitude, vu) | (__builtin_convertvector(nibbles & 8, vu) << 28));
  }
}

// e8m0 2^(s - 127) from its bits: s = 0 is the one subnormal, 255 NaN.
MOECC_INLINE float e8m0_value(uint8_t s) {
  const uint32_t bits = s == 0 ? 0x00400000u : s == 255 ? 0x7FC00000u : uint32_t{s} << 23;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Where the scales of an expert's rows are: `per_row` scales a row (fp8: a block row of `group` rows) and 2^shift
// columns a scale (every group but int8's, whose scale is its row's, is a power of two).
struct ScaleIndex {
  int64_t per_row;
  int shift;
};

template <WeightFormat F>
ScaleIndex scale_index(const QuantizedWeights& w) {
  if constexpr (F == WeightFormat::kInt8) return {1, 0};
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(w.group));
  if constexpr (F == WeightFormat::kFp8) return {(w.cols + w.group - 1) >> shift, shift};
  return {w.cols >> shift, shift};
}

// The scale of row `row`'s columns [c, c + 16), from the expert's scales.
template <WeightFormat F>
MOECC_INLINE float scale_of(const void* scales, const ScaleIndex& index, int64_t row, int64_t c) {
  if constexpr (F == WeightFormat::kInt8) return static_cast<const float*>(scales)[row];
  const int64_t scale_row = F == WeightFormat::kFp8 ? row >> index.shift : row;
  const int64_t at = scale_row * index.per_row + (c >> index.shift);
  if constexpr (F == WeightFormat::kMxfp4) return e8m0_value(static_cast<const uint8_t*>(scales)[at]);
  return static_cast<const float*>(scales)[at];
}

template <WeightFormat F>
void block_of(const QuantizedWeights& w, int64_t expert, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
              uint16_t* dst) {
  constexpr int64_t kHalves = is_nibbles(F) ? 2 : 1;  // columns a byte holds
  const int64_t k = w.cols, row_bytes = k / kHalves, width = k1 - k0;
  const uint8_t* const data = w.data + expert * w.data_stride;
  const int64_t scale_bytes = F == WeightFormat::kMxfp4 ? 1 : sizeof(float);
  const void* const scales = static_cast<const char*>(w.scales) + expert * w.scale_stride * scale_bytes;
  const ScaleIndex index = scale_index<F>(w);
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
      const vh bits = PortableBf16::narrow(decode16<F>(codes) * scale_of<F>(scales, index, r, c));
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
