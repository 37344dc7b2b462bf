// moecc._C.testing (testing_bindings.h): test hooks over raw addresses, called by tests/ through moecc._ops or
// directly; the tensors behind the addresses are the tests' own.
#include "testing_bindings.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/amx_self_check.h"
#include "kernels/bf16_rounding.h"
#include "kernels/dequantize.h"
#include "kernels/lora_products.h"
#include "kernels/vector16.h"
#include "pool/thread_pool.h"

namespace py = pybind11;

namespace moecc::bindings {
namespace {

// Fills out[i] = i * 2 + 1 on the pool, one task per element; a test of scheduling and coverage.
void pool_fill_test(std::uintptr_t out_address, int64_t n) {
  int64_t* out = as_pointer<int64_t>(out_address);
  moecc::pool::global_pool()->run(n, [out](int64_t task, int) { out[task] = task * 2 + 1; });
}

// Runs n tasks of which task `failing_task` throws; the error must reach Python and the pool must survive.
void pool_raise_test(int64_t n, int64_t failing_task) {
  moecc::pool::global_pool()->run(n, [failing_task](int64_t task, int) {
    if (task == failing_task) throw std::runtime_error("task " + std::to_string(task) + " failed on purpose");
  });
}

// Rounds n (a multiple of 16) floats to bf16 with the epilogues' 16-lane rounding, integer (native false) or
// AVX512-BF16's instruction; a test of the two against each other and torch.
void round_bf16_test(std::uintptr_t src_address, std::uintptr_t dst_address, int64_t n, bool native) {
  using namespace moecc::kernels::v16;
  if (n % kLanes != 0) throw std::invalid_argument("testing.round_bf16: n must be a multiple of 16");
  const float* src = as_pointer<const float>(src_address);
  uint16_t* dst = as_pointer<uint16_t>(dst_address);
  if (native) {
    if (!native_bf16()) throw std::invalid_argument("testing.round_bf16: this CPU has no AVX512-BF16");
    moecc::kernels::round_bf16_native(src, dst, n);
  } else {
    for (int64_t i = 0; i < n; i += kLanes) store16<PortableBf16>(dst + i, load16(src + i));
  }
}

// Test hook: the rank-r LoRA terms of `count` rows through the grouped-row functions (lora_products.h), one
// call a row (grouped = false) or all rows in one call, so tests can compare the two. op: "combine_bf16" (float
// rows -> bf16 out), "combine_f32" (float rows, in place), "dots" (float rows -> float out) or "dots_bf16" (bf16
// rows -> float out).
void lora_rows_test(const std::string& op, std::uintptr_t coef_address, int64_t coef_ld, float scale,
                    std::uintptr_t factors_address, int64_t ld, int64_t rank, int64_t n, std::uintptr_t rows_address,
                    int64_t rows_ld, std::uintptr_t out_address, int64_t out_ld, int64_t count, bool grouped) {
  using namespace moecc::kernels;
  const float* coef = as_pointer<const float>(coef_address);
  const float* factors = as_pointer<const float>(factors_address);
  float* rows = as_pointer<float>(rows_address);
  if (op == "combine_bf16") {
    uint16_t* out = as_pointer<uint16_t>(out_address);
    std::vector<uint16_t*> outs;
    for (int64_t r = 0; r < count; ++r) outs.push_back(out + r * out_ld);
    if (grouped) {
      rank_combine_bf16_rows(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld, outs.data(), count);
    } else {
      for (int64_t r = 0; r < count; ++r) {
        rank_combine_bf16_rows(coef + r * coef_ld, coef_ld, scale, factors, ld, rank, n, rows + r * rows_ld, rows_ld,
                               &outs[r], 1);
      }
    }
  } else if (op == "combine_f32") {
    if (grouped) {
      rank_combine_rows(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld, count);
    } else {
      for (int64_t r = 0; r < count; ++r) {
        rank_combine_rows(coef + r * coef_ld, coef_ld, scale, factors, ld, rank, n, rows + r * rows_ld, rows_ld, 1);
      }
    }
  } else if (op == "dots" || op == "dots_bf16") {  // dots_bf16: rows are bf16 bits
    float* out = as_pointer<float>(out_address);
    const auto dots = [&](const auto* typed_rows) {
      if (grouped) {
        rank_dots_rows(typed_rows, rows_ld, factors, ld, rank, n, scale, out, out_ld, count);
      } else {
        for (int64_t r = 0; r < count; ++r) {
          rank_dots(typed_rows + r * rows_ld, factors, ld, rank, n, scale, out + r * out_ld);
        }
      }
    };
    if (op == "dots") {
      dots(static_cast<const float*>(rows));
    } else {
      dots(as_pointer<const uint16_t>(rows_address));
    }
  } else {
    throw std::invalid_argument("testing.lora_rows: op must be combine_bf16, combine_f32, dots or dots_bf16");
  }
}

// Rows [r0, r1) x columns [k0, k1) of one expert of `weights` dequantized into dst (bf16, row-major) as the product
// tasks do; a test of each format against moecc/experts/formats.py.
void dequantize_block_test(const moecc::kernels::QuantizedWeights& weights, int64_t experts, int64_t expert,
                           int64_t r0, int64_t r1, int64_t k0, int64_t k1, std::uintptr_t dst_address) {
  moecc::kernels::check_quantized(weights, "testing.dequantize_block", experts, weights.rows, weights.cols);
  if (expert < 0 || expert >= experts || r0 < 0 || r0 > r1 || r1 > weights.rows || k0 < 0 || k0 > k1 ||
      k1 > weights.cols) {
    throw std::invalid_argument("testing.dequantize_block: expert or block out of range");
  }
  moecc::kernels::dequantize_block(weights, expert, r0, r1, k0, k1, as_pointer<uint16_t>(dst_address));
}

}  // namespace

void bind_testing(py::module_& testing) {
  testing.def("pool_fill", &pool_fill_test, py::arg("out"), py::arg("n"), py::call_guard<py::gil_scoped_release>(),
              "Fills int64 out[i] = 2i + 1 on the pool, one task per element.");
  testing.def("pool_raise", &pool_raise_test, py::arg("n"), py::arg("failing_task"),
              py::call_guard<py::gil_scoped_release>(), "Runs n pool tasks of which failing_task throws.");
  testing.def("round_bf16", &round_bf16_test, py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("native"),
              "Rounds n floats to bf16 with the epilogues' 16-lane rounding, integer or (native) AVX512-BF16's.");
  testing.def("lora_rows", &lora_rows_test, py::arg("op"), py::arg("coef"), py::arg("coef_ld"), py::arg("scale"),
              py::arg("factors"), py::arg("ld"), py::arg("rank"), py::arg("n"), py::arg("rows"), py::arg("rows_ld"),
              py::arg("out"), py::arg("out_ld"), py::arg("count"), py::arg("grouped"),
              "The grouped-row LoRA terms (lora_products.h), one call a row or all rows in one call.");
  testing.def("dequantize_block", &dequantize_block_test, py::arg("weights"), py::arg("experts"), py::arg("expert"),
              py::arg("r0"), py::arg("r1"), py::arg("k0"), py::arg("k1"), py::arg("dst"),
              py::call_guard<py::gil_scoped_release>(),
              "A block of one expert's quantized matrix in bf16, as the product tasks dequantize it (dequantize.h).");
  testing.def("reset_amx_self_check", &moecc::kernels::reset_amx_self_check, py::arg("fault"),
              "Forgets the AMX self-check's result and injects `fault` (0 none, 1 readback, 2 product) next time.");
}

}  // namespace moecc::bindings
