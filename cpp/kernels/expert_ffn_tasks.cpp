// Task lists of the routed-expert FFN (expert_ffn_tasks.h), the check of the settings that shape them and of the
// weights' descriptions.
#include "expert_ffn_tasks.h"

#include <stdexcept>
#include <string>

namespace moecc::kernels {
namespace ffn {

std::vector<Task> make_tasks(const int64_t* offsets, int64_t experts, int64_t columns, int64_t step,
                             int64_t block_rows) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t begin = offsets[e]; begin < offsets[e + 1]; begin += block_rows) {
      const int64_t end = std::min(offsets[e + 1], begin + block_rows);
      for (int64_t c = 0; c < columns; c += step) tasks.push_back({e, begin, end, c, std::min(columns, c + step)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.end - a.begin > b.end - b.begin; });
  return tasks;
}

}  // namespace ffn

void check_tuning(const KernelTuning& tuning) {
  constexpr int64_t kMax = int64_t{1} << 30;
  const auto refuse = [](const std::string& what, int64_t value) {
    throw std::invalid_argument("kernel tuning: " + what + ", got " + std::to_string(value));
  };
  if (tuning.panels_per_task < 1 || tuning.panels_per_task > kMax) {
    refuse("panels_per_task must be in [1, 2^30]", tuning.panels_per_task);
  }
  if (tuning.grad_columns_per_task < kPanelRows || tuning.grad_columns_per_task % kPanelRows != 0 ||
      tuning.grad_columns_per_task > kMax) {
    refuse("grad_columns_per_task must be a positive multiple of " + std::to_string(kPanelRows) + ", at most 2^30",
           tuning.grad_columns_per_task);
  }
  if (tuning.rows_per_task < 1 || tuning.rows_per_task > kMax) {
    refuse("rows_per_task must be in [1, 2^30]", tuning.rows_per_task);
  }
  if (tuning.block_rows < 0 || tuning.block_rows > kMax) {
    refuse("block_rows must be in [0, 2^30] (0: the whole task)", tuning.block_rows);
  }
  if (tuning.streaming_outputs < 0 || tuning.streaming_outputs > 15) {
    refuse("streaming_outputs is a mask of 1 (per-pair rows), 2 (gate/up output), 4 (activation rows) and 8 (the "
           "down input gradient's rows), 0-15", tuning.streaming_outputs);
  }
  if (tuning.gemm.pack_prefetch_rows < 0 || tuning.gemm.pack_prefetch_rows > 4096) {
    refuse("gemm.pack_prefetch_rows must be in [0, 4096] (0: none)", tuning.gemm.pack_prefetch_rows);
  }
}

void check_matrices(const ExpertShapes& shapes, const ExpertMatrices& weights) {
  const auto check = [&](const char* name, const uint16_t* bf16, const QuantizedWeights& quantized,
                         const uint16_t* packed, int64_t rows, int64_t cols) {
    if (quantized.format == WeightFormat::kBf16) {
      if (bf16 == nullptr && shapes.experts > 0) {
        throw std::invalid_argument(std::string(name) + " weights: neither bf16 weights nor a quantized copy given");
      }
      return;
    }
    check_quantized(quantized, name, shapes.experts, rows, cols);
    if (packed != nullptr) {
      throw std::invalid_argument(std::string(name) + " weights: a packed bf16 copy of quantized weights is refused "
                                  "(it holds the experts twice); pass one or the other");
    }
  };
  check("gate_up", weights.gate_up, weights.quantized_gate_up, weights.packed_gate_up, 2 * shapes.inter,
        shapes.hidden);
  check("down", weights.down, weights.quantized_down, weights.packed_down, shapes.hidden, shapes.inter);
}

}  // namespace moecc::kernels
