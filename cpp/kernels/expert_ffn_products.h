// The product tasks of the routed-expert FFN: a forward task (a task's panels of a weight against its grouped
// rows, the LoRA term and bf16 rounding as its epilogue) and an input-gradient task (a task's weight columns
// packed once, dx = dy W by row blocks, the caller's epilogue on each block's float32 tile). Both run on any
// PanelGemm variant, pack from bf16 or quantized weights (dequantize.h) and time their parts (expert_ffn_profile.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "aligned_buffer.h"
#include "dequantize.h"
#include "expert_ffn.h"
#include "expert_ffn_common.h"
#include "expert_ffn_profile.h"
#include "expert_ffn_tasks.h"
#include "lora_products.h"
#include "panel_gemm.h"

namespace moecc::kernels::ffn {

// One expert's W [n, k] as a product task reads it: its bf16 rows in place, or the projection's quantized copy, of
// which the task dequantizes the slice it packs.
struct ExpertWeight {
  const uint16_t* bf16;               // the expert's matrix; null when quantized
  const QuantizedWeights* quantized;  // null when bf16
  int64_t expert;
};

inline ExpertWeight expert_weight(const uint16_t* matrices, const QuantizedWeights& quantized, int64_t expert,
                                  int64_t elements) {
  if (quantized.format != WeightFormat::kBf16) return {nullptr, &quantized, expert};
  return {matrices + expert * elements, nullptr, expert};
}
inline ExpertWeight gate_up_weight(const ExpertMatrices& weights, const Dims& d, int64_t expert) {
  return expert_weight(weights.gate_up, weights.quantized_gate_up, expert, d.gu_size);
}
inline ExpertWeight down_weight(const ExpertMatrices& weights, const Dims& d, int64_t expert) {
  return expert_weight(weights.down, weights.quantized_down, expert, d.down_size);
}

// The panels [task.col0, task.col1) of the task's expert's W [n, k] that a forward product reads: in the packed copy
// of all experts when there is one (ExpertMatrices), else packed now into `scratch`. Quantized weights are
// dequantized a panel (16 rows x k) at a time into a second scratch, which stays in cache while it is packed.
inline const uint16_t* weight_slice(const PanelGemm& gemm, const ExpertWeight& w, const uint16_t* packed,
                                    const Task& task, int64_t n, int64_t k, AlignedBuffer<uint16_t>& scratch) {
  const int64_t k_padded = padded_k(k);
  if (packed) return packed + task.expert * packed_elements(n, k) + task.col0 * kPanelRows * k_padded;
  uint16_t* const slice = scratch.get((task.col1 - task.col0) * kPanelRows * k_padded);
  if (w.quantized == nullptr) {
    gemm.pack_rows(w.bf16, n, k, task.col0, task.col1, slice);
    return slice;
  }
  thread_local AlignedBuffer<uint16_t> dequantized;
  uint16_t* const rows = dequantized.get(kPanelRows * k);  // [16, k]
  for (int64_t p = task.col0; p < task.col1; ++p) {
    const int64_t r0 = p * kPanelRows, r1 = std::min(n, r0 + kPanelRows);
    dequantize_rows(*w.quantized, w.expert, r0, r1, rows);
    gemm.pack_rows(rows, r1 - r0, k, 0, 1, slice + (p - task.col0) * kPanelRows * k_padded);
  }
  return slice;
}

// W's [n, k] columns [k0, k1) laid out for an input-gradient product (PanelGemm::pack_columns) into `dst`.
// Quantized weights are dequantized 32 columns of all n rows at a time (two chunks, one pass of the vector packers)
// into a scratch that stays in cache while it is packed.
inline void weight_columns(const PanelGemm& gemm, const ExpertWeight& w, int64_t n, int64_t k, int64_t k0,
                           int64_t k1, uint16_t* dst, const GemmTuning& tuning) {
  if (w.quantized == nullptr) {
    gemm.pack_columns(w.bf16, n, k, k0, k1, dst, tuning);
    return;
  }
  constexpr int64_t kStep = 2 * kPanelRows;
  thread_local AlignedBuffer<uint16_t> dequantized;
  uint16_t* const columns = dequantized.get(n * kStep);  // [n, up to 32]
  for (int64_t c0 = k0; c0 < k1; c0 += kStep) {
    const int64_t c1 = std::min(k1, c0 + kStep);
    dequantize_columns(*w.quantized, w.expert, c0, c1, columns);
    gemm.pack_columns(columns, n, c1 - c0, 0, c1 - c0, dst + (c0 - k0) * padded_k(n), tuning);
  }
}

// The LoRA term and bf16 rounding of a block's tile rows (rows_ld apart) into out(g) for its grouped rows g, a few
// rows a call (rank_combine_bf16_rows: the factors loaded once for them). coef: the inner products [g][coef_ld].
template <typename OutOf>
void combine_rows(const Task& rows_block, const float* coef, int64_t coef_ld, float scale, const float* factors,
                  int64_t ld, int64_t rank, int64_t n, const float* tile, int64_t rows_ld, OutOf out_of, bool stream) {
  constexpr int64_t kRows = 16;
  uint16_t* outs[kRows];
  for (int64_t g0 = rows_block.begin; g0 < rows_block.end; g0 += kRows) {
    const int64_t count = std::min(kRows, rows_block.end - g0);
    for (int64_t r = 0; r < count; ++r) outs[r] = out_of(g0 + r);
    rank_combine_bf16_rows(coef ? coef + g0 * coef_ld : nullptr, coef_ld, scale, factors, ld, rank, n,
                           tile + (g0 - rows_block.begin) * rows_ld, rows_ld, outs, count, stream);
  }
}

// A forward product task: the task's panels of W [n, k] (from `packed`, or packed now) against the grouped rows
// x by row blocks (KernelTuning::block_rows), each block's tile getting its LoRA term and leaving in bf16 at
// out_row(g) + the task's first column.
template <typename OutRow>
void forward_product(const PanelGemm& gemm, const Task& task, int64_t block_rows, const uint16_t* x, int64_t ld_x,
                     const ExpertWeight& w, const uint16_t* packed, int64_t n, int64_t k, const LoraFactors& lora,
                     const float* inner, bool stream, const GemmTuning& tuning, PartClocks& clocks, OutRow out_row) {
  thread_local AlignedBuffer<float> block;
  thread_local AlignedBuffer<uint16_t> panels;
  const int64_t width = (task.col1 - task.col0) * kPanelRows;
  const int64_t col0 = task.col0 * kPanelRows, col1 = std::min(n, task.col1 * kPanelRows);
  const uint16_t* slice = nullptr;
  timed(clocks.pack, [&] { slice = weight_slice(gemm, w, packed, task, n, k, panels); });
  // The LoRA term s (x A) B^T, added in the same pass over each row as the bf16 rounding.
  const float* const b_t = lora.a ? lora.b + task.expert * lora.rank * n + col0 : nullptr;
  for_row_blocks(task, block_rows, [&](const Task& rows_block) {
    const int64_t rows = rows_block.end - rows_block.begin;
    float* const tile = block.get(rows * width);
    timed(clocks.gemm, [&] {
      gemm.forward(x + rows_block.begin * ld_x, ld_x, rows, slice, padded_k(k), 0, task.col1 - task.col0, tile,
                   width, tuning);
    });
    timed(clocks.epilogue, [&] {
      combine_rows(rows_block, b_t ? inner : nullptr, lora.rank, lora.scaling, b_t, n, b_t ? lora.rank : 0,
                   col1 - col0, tile, width, [&](int64_t g) { return out_row(g) + col0; }, stream);
    });
  });
  fence_streamed(stream);
}

// An input-gradient task: W's [n, k] columns [task.col0, task.col1) packed once, then dx = dy W for them by row
// blocks, each block's tile (rows x ld floats, ld the columns rounded up to 16; column 0 = W's column col0) handed
// to epilogue(rows_block, tile, ld).
template <typename Epilogue>
void input_grad_product(const PanelGemm& gemm, const Task& task, int64_t block_rows, const uint16_t* dy,
                        int64_t ld_dy, const ExpertWeight& w, int64_t n, int64_t k, const GemmTuning& tuning,
                        PartClocks& clocks, Epilogue&& epilogue) {
  thread_local AlignedBuffer<float> block;
  thread_local AlignedBuffer<uint16_t> columns;
  const int64_t chunks = column_chunks(task.col0, task.col1), ld = chunks * kPanelRows;
  uint16_t* const packed = columns.get(column_panel_elements(n, task.col0, task.col1));
  timed(clocks.pack, [&] { weight_columns(gemm, w, n, k, task.col0, task.col1, packed, tuning); });
  for_row_blocks(task, block_rows, [&](const Task& rows_block) {
    const int64_t rows = rows_block.end - rows_block.begin;
    float* const tile = block.get(rows * ld);
    timed(clocks.gemm,
          [&] { gemm.input_grad(dy + rows_block.begin * ld_dy, ld_dy, rows, packed, n, chunks, tile, ld, tuning); });
    timed(clocks.epilogue, [&] { epilogue(rows_block, tile, ld); });
  });
}

}  // namespace moecc::kernels::ffn
