// Dequantization of expert weights (dequantize.h): the checks, the dispatcher, which picks a build of
// dequantize_body.h once from the running CPU, and the baseline build (this file has the baseline ISA's flags, as
// everything that runs before the choice must).
#include "dequantize.h"

#include <stdexcept>
#include <string>

#include "dequantize_body.h"

namespace moecc::kernels {

const DequantizeKernels& dequantize_baseline() { return DequantizeBuild::kernels; }

namespace {

const DequantizeKernels& kernels() {
  static const DequantizeKernels& chosen =
      __builtin_cpu_supports("avx512f") ? dequantize_avx512() : dequantize_baseline();
  return chosen;
}

// Codes and scales one expert's matrices take (dequantize.h's layouts).
struct ExpertSizes {
  int64_t code_bytes, scales;
};

ExpertSizes expert_sizes(const QuantizedWeights& w) {
  const int64_t n = w.rows, k = w.cols;
  switch (w.format) {
    case WeightFormat::kInt8: return {n * k, n};
    case WeightFormat::kInt4: return {n * k / 2, n * (k / w.group)};
    case WeightFormat::kFp8: return {n * k, ((n + w.group - 1) / w.group) * ((k + w.group - 1) / w.group)};
    case WeightFormat::kMxfp4: return {n * k / 2, n * (k / w.group)};
    case WeightFormat::kBf16: break;
  }
  return {0, 0};
}

}  // namespace

void dequantize_block(const QuantizedWeights& w, int64_t expert, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
                      uint16_t* dst) {
  kernels().block(w, expert, r0, r1, k0, k1, dst);
}

void check_quantized(const QuantizedWeights& w, const char* name, int64_t experts, int64_t rows, int64_t cols) {
  const std::string what = std::string(name) + ": ";
  const auto refuse = [&](const std::string& message) { throw std::invalid_argument(what + message); };
  const int format = static_cast<int>(w.format);
  if (format < 1 || format > 4) refuse("unknown weight format " + std::to_string(format));
  if (w.rows != rows || w.cols != cols) {
    refuse("quantized matrices are [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) + "], the layer's [" +
           std::to_string(rows) + ", " + std::to_string(cols) + "]");
  }
  const bool group_fits = w.format == WeightFormat::kInt8    ? w.group == cols
                          : w.format == WeightFormat::kInt4  ? (w.group == 32 || w.group == 64 || w.group == 128) &&
                                                                  cols % w.group == 0
                          : w.format == WeightFormat::kFp8   ? w.group == 128
                                                             : w.group == 32 && cols % 32 == 0;
  if (!group_fits) refuse("scale group " + std::to_string(w.group) + " does not fit the format and K=" +
                          std::to_string(cols));
  if (experts > 0 && (w.data == nullptr || w.scales == nullptr)) refuse("codes or scales missing (null)");
  const ExpertSizes sizes = expert_sizes(w);
  if (w.data_stride < sizes.code_bytes || w.scale_stride < sizes.scales) {
    refuse("per-expert strides " + std::to_string(w.data_stride) + " / " + std::to_string(w.scale_stride) +
           " are shorter than an expert's " + std::to_string(sizes.code_bytes) + " code bytes / " +
           std::to_string(sizes.scales) + " scales");
  }
}

}  // namespace moecc::kernels
