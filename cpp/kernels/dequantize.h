// Quantized expert weights (moecc/experts/formats.py) turned back into bf16 a block at a time, so a product task can
// pack the slice it needs (panel_gemm.h) from the one quantized copy in host memory. Each weight's value is
// bf16(float32(decoded) * float32(scale)): one float32 product, rounded to nearest even by integer operations
// (float_to_bf16), denormals kept. Layouts, E matrices W [N, K] in the kernels' orientation:
//   int8   codes int8 [E, N, K],                       scales float32 [E, N]
//   int4   codes uint8 [E, N, K/2] (low nibble = even k, two's complement),  scales float32 [E, N, K/group]
//   fp8    codes uint8 [E, N, K] (float8_e4m3fn bits), scales float32 [E, ceil(N/128), ceil(K/128)]
//   mxfp4  codes uint8 [E, N, K/2] (e2m1, low nibble = even k),              scales uint8 e8m0 [E, N, K/32]
#pragma once

#include <cstdint>

namespace moecc::kernels {

// The values moecc/_ops.py passes for each format (WEIGHT_FORMATS there).
enum class WeightFormat : int32_t { kBf16 = 0, kInt8 = 1, kInt4 = 2, kFp8 = 3, kMxfp4 = 4 };

// One projection's experts in a quantized format; format kBf16 (the default): not quantized.
struct QuantizedWeights {
  WeightFormat format = WeightFormat::kBf16;
  const uint8_t* data = nullptr;  // the codes; expert e's begin data_stride * e bytes in
  const void* scales = nullptr;   // float32, or e8m0 bytes for mxfp4; expert e's begin scale_stride * e scales in
  int64_t rows = 0, cols = 0;     // N outputs, K inputs
  int64_t group = 0;              // inputs one scale covers along K (int8: K; fp8: 128, also along N)
  int64_t data_stride = 0, scale_stride = 0;
};

// Rows [r0, r1) x columns [k0, k1) of expert `expert`'s W as bf16 bits into dst, row-major with k1 - k0 columns.
// 0 <= r0 <= r1 <= N and 0 <= k0 <= k1 <= K; `w` passed check_quantized.
void dequantize_block(const QuantizedWeights& w, int64_t expert, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
                      uint16_t* dst);

// A forward task's rows (all K columns) and an input-gradient task's columns (all N rows).
inline void dequantize_rows(const QuantizedWeights& w, int64_t expert, int64_t r0, int64_t r1, uint16_t* dst) {
  dequantize_block(w, expert, r0, r1, 0, w.cols, dst);
}
inline void dequantize_columns(const QuantizedWeights& w, int64_t expert, int64_t k0, int64_t k1, uint16_t* dst) {
  dequantize_block(w, expert, 0, w.rows, k0, k1, dst);
}

// Throws std::invalid_argument naming `name` and what does not fit when `w` (quantized) is not `experts` matrices
// [rows, cols] of its format: shape, group, null pointers, strides shorter than an expert's codes or scales.
void check_quantized(const QuantizedWeights& w, const char* name, int64_t experts, int64_t rows, int64_t cols);

}  // namespace moecc::kernels
