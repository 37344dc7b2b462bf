// The panel layout every CPU expert product reads: each task packs the slice of the model's own weights it
// needs into per-thread scratch (PanelGemm::pack_rows; input gradients lay out column slices of the transpose,
// pack_columns), so by default no second copy of the experts lives in host memory. With
// MoeccConfig.prepack_weights the forward products read a whole packed copy instead (ExpertMatrices).
//
// A weight W [N outputs, K inputs] (bf16, row-major) is cut into panels of 16 output rows; K is padded to a
// multiple of 32 with zeros, N to a multiple of 16. Panel p holds rows n = 16p .. 16p+15 as K/2 rows of 64
// bytes, row kp = { W[16p+i][2kp], W[16p+i][2kp+1] : i = 0..15 } -- bf16 pairs along K, 16 outputs across.
// That is the VNNI operand layout of AVX512-BF16's dot product and of an AMX B tile (16 rows x 64 bytes per
// 32-wide K step), and for backward (dX = dY W) the 16 outputs of a row are the reduction lanes.
#pragma once

#include <cstdint>

namespace moecc::pool {
class ThreadPool;
}

namespace moecc::kernels {

constexpr int64_t kPanelRows = 16;
constexpr int64_t kKAlign = 32;

inline int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }
inline int64_t padded_rows(int64_t n) { return round_up(n, kPanelRows); }
inline int64_t padded_k(int64_t k) { return round_up(k, kKAlign); }
inline int64_t packed_elements(int64_t n, int64_t k) { return padded_rows(n) * padded_k(k); }

// Offset of W[n][k] in the packed matrix.
inline int64_t packed_offset(int64_t n, int64_t k, int64_t k_padded) {
  return (n / kPanelRows) * kPanelRows * k_padded + (k / 2) * (2 * kPanelRows) + (n % kPanelRows) * 2 + (k % 2);
}

// Packs `experts` matrices [N, K] (bf16 bits, row-major, consecutive) into `dst`
// (experts * packed_elements(N, K) elements, 64-byte aligned), one task per expert, element by element: the
// reference layout for tests. The products pack only the slice a task needs (PanelGemm::pack_rows), unless
// given a packed copy.
void pack_experts(const uint16_t* src, int64_t experts, int64_t n, int64_t k, uint16_t* dst,
                  moecc::pool::ThreadPool& pool);

}  // namespace moecc::kernels
