// The Python/C++ boundary: plain functions over raw addresses and shapes. moecc/_ops.py is the only caller;
// it checks dtype, device, contiguity and sizes before an address crosses, and owns every buffer.
// Long-running calls release the GIL; C++ exceptions surface as Python exceptions through pybind11.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/aligned_buffer.h"
#include "kernels/amx_self_check.h"
#include "kernels/bf16_rounding.h"
#include "kernels/cpu_features.h"
#include "kernels/expert_ffn.h"
#include "kernels/lora_products.h"
#include "kernels/peak_rate.h"
#include "kernels/token_grouping.h"
#include "kernels/vector16.h"
#include "kernels/weight_packing.h"
#include "pool/thread_pool.h"

namespace py = pybind11;

namespace {

template <typename T>
T* as_pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

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
  if (n % kLanes != 0) throw std::invalid_argument("_round_bf16_test: n must be a multiple of 16");
  const float* src = as_pointer<const float>(src_address);
  uint16_t* dst = as_pointer<uint16_t>(dst_address);
  if (native) {
    if (!native_bf16()) throw std::invalid_argument("_round_bf16_test: this CPU has no AVX512-BF16");
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
    throw std::invalid_argument("_lora_rows_test: op must be combine_bf16, combine_f32, dots or dots_bf16");
  }
}

using moecc::kernels::Isa;
using moecc::kernels::LoraFactors;

LoraFactors lora_factors(std::uintptr_t a, std::uintptr_t b, int64_t rank, float scaling) {
  LoraFactors lora;
  if (a != 0) lora = {as_pointer<const float>(a), as_pointer<const float>(b), rank, scaling};
  return lora;
}

// A rate measured by `one` on one thread (threads <= 1), or summed over as many concurrent runs as the pool has
// threads (handed out like any pool job, so a thread may take two when another is slow to start).
template <typename Fn>
double rate(int threads, Fn&& one) {
  if (threads <= 1) return one();
  auto pool = moecc::pool::global_pool();
  std::vector<double> rates(static_cast<size_t>(pool->num_threads()), 0.0);
  pool->run(pool->num_threads(), [&](int64_t task, int) { rates[static_cast<size_t>(task)] = one(); });
  double total = 0.0;
  for (double r : rates) total += r;
  return total;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moecc native kernels and thread pool (raw-pointer interface; use moecc._ops)";

  m.def("available_cpus", &moecc::pool::available_cpus, "CPUs in this process's affinity mask.");
  m.def("num_threads", [] { return moecc::pool::global_pool()->num_threads(); },
        "Threads of the global pool, the caller included.");
  m.def("pool_pinned", [] { return moecc::pool::global_pool()->pinned(); },
        "Whether the global pool's workers are pinned to CPUs.");
  m.def("set_num_threads", &moecc::pool::reset_global_pool, py::arg("num_threads"), py::arg("pin_threads") = true,
        py::call_guard<py::gil_scoped_release>(), "Restart the global pool with this many threads (<1: all CPUs).");
  m.def("shutdown", &moecc::pool::shutdown_global_pool, py::call_guard<py::gil_scoped_release>(),
        "Join the global pool's threads.");

  m.def(
      "group_tokens_by_expert",
      [](std::uintptr_t top_k_index, int64_t num_tokens, int64_t top_k, int64_t num_experts, std::uintptr_t offsets,
         std::uintptr_t order) {
        moecc::kernels::group_tokens_by_expert(as_pointer<const int64_t>(top_k_index), num_tokens, top_k,
                                               num_experts, as_pointer<int64_t>(offsets), as_pointer<int64_t>(order),
                                               *moecc::pool::global_pool());
      },
      py::arg("top_k_index"), py::arg("num_tokens"), py::arg("top_k"), py::arg("num_experts"), py::arg("offsets"),
      py::arg("order"), py::call_guard<py::gil_scoped_release>(),
      "Stable counting sort of [num_tokens, top_k] int64 expert ids; writes offsets [E+1] and order [T*k].");

  m.def("cpu_features", [] {
    const auto& f = moecc::kernels::cpu_features();
    py::dict d;
    d["avx512f"] = f.avx512f;
    d["avx512bw"] = f.avx512bw;
    d["avx512vl"] = f.avx512vl;
    d["avx512_bf16"] = f.avx512_bf16;
    d["amx_tile"] = f.amx_tile;
    d["amx_bf16"] = f.amx_bf16;
    d["os_avx512"] = f.os_avx512;
    d["os_amx"] = f.os_amx;
    d["brand"] = f.brand;
    return d;
  }, "CPU features detected with cpuid/xgetbv (AMX also needs the kernel's permission, requested here).");

  m.def("check_isa", [](int isa) { moecc::kernels::panel_gemm(static_cast<Isa>(isa)); }, py::arg("isa"),
        "Raises ValueError if the kernels for `isa` (0 portable, 1 avx512_bf16, 2 amx) cannot run here.");

  m.def("amx_self_check", [] {
    moecc::kernels::AmxCheck check;
    {
      py::gil_scoped_release release;  // the first call runs the check
      check = moecc::kernels::amx_self_check();
    }
    py::dict d;
    d["ran"] = check.ran;
    d["ok"] = check.ok;
    d["reason"] = check.reason;
    return d;
  }, "Whether the AMX kernels work in this process (amx_self_check.h): {ran, ok, reason}; cached after the first call.");
  m.def("_reset_amx_self_check", &moecc::kernels::reset_amx_self_check, py::arg("fault"),
        "Test hook: forget the AMX self-check's result and inject `fault` (0 none, 1 readback, 2 product) next time.");

  m.def("packed_elements", &moecc::kernels::packed_elements, py::arg("rows"), py::arg("cols"));
  m.def(
      "pack_experts",
      [](std::uintptr_t src, int64_t experts, int64_t rows, int64_t cols, std::uintptr_t dst) {
        moecc::kernels::pack_experts(as_pointer<const uint16_t>(src), experts, rows, cols, as_pointer<uint16_t>(dst),
                                     *moecc::pool::global_pool());
      },
      py::arg("src"), py::arg("experts"), py::arg("rows"), py::arg("cols"), py::arg("dst"),
      py::call_guard<py::gil_scoped_release>(),
      "Packs [experts, rows, cols] bf16 weights into the panel layout (weight_packing.h).");

  m.def(
      "pack_rows",
      [](int isa, std::uintptr_t src, int64_t rows, int64_t cols, int64_t p0, int64_t p1, std::uintptr_t dst) {
        moecc::kernels::panel_gemm(static_cast<Isa>(isa))
            .pack_rows(as_pointer<const uint16_t>(src), rows, cols, p0, p1, as_pointer<uint16_t>(dst));
      },
      py::arg("isa"), py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("p0"), py::arg("p1"), py::arg("dst"),
      py::call_guard<py::gil_scoped_release>(),
      "Packs panels [p0, p1) of one row-major bf16 matrix with the `isa` variant's packer (tests, prepacking).");

  m.def(
      "expert_ffn_forward",
      [](int isa, int64_t experts, int64_t hidden_size, int64_t inter, int64_t tokens, int64_t top_k,
         std::uintptr_t gate_up, std::uintptr_t down, std::uintptr_t gate_up_a, std::uintptr_t gate_up_b,
         int64_t gate_up_rank, float gate_up_scaling, std::uintptr_t down_a, std::uintptr_t down_b, int64_t down_rank,
         float down_scaling, std::uintptr_t offsets, std::uintptr_t order, std::uintptr_t routing_weights,
         std::uintptr_t hidden, std::uintptr_t gate_up_out, std::uintptr_t out, bool out_bf16,
         std::uintptr_t hidden_copy, std::uintptr_t packed_gate_up, std::uintptr_t packed_down,
         std::uintptr_t inner_gate_up, std::uintptr_t inner_down, const moecc::kernels::KernelTuning& tuning) {
        moecc::kernels::expert_ffn_forward(
            static_cast<Isa>(isa), {experts, hidden_size, inter, tokens, top_k},
            {as_pointer<const uint16_t>(gate_up), as_pointer<const uint16_t>(down),
             as_pointer<const uint16_t>(packed_gate_up), as_pointer<const uint16_t>(packed_down)},
            lora_factors(gate_up_a, gate_up_b, gate_up_rank, gate_up_scaling),
            lora_factors(down_a, down_b, down_rank, down_scaling),
            {as_pointer<const int64_t>(offsets), as_pointer<const int64_t>(order),
             as_pointer<const float>(routing_weights)},
            {as_pointer<const uint16_t>(hidden), as_pointer<uint16_t>(gate_up_out),
             out_bf16 ? nullptr : as_pointer<float>(out), out_bf16 ? as_pointer<uint16_t>(out) : nullptr,
             as_pointer<uint16_t>(hidden_copy), as_pointer<float>(inner_gate_up), as_pointer<float>(inner_down)},
            tuning, *moecc::pool::global_pool());
      },
      py::kw_only(), py::arg("isa"), py::arg("experts"), py::arg("hidden_size"), py::arg("inter"), py::arg("tokens"),
      py::arg("top_k"), py::arg("gate_up"), py::arg("down"), py::arg("gate_up_a"), py::arg("gate_up_b"),
      py::arg("gate_up_rank"), py::arg("gate_up_scaling"), py::arg("down_a"), py::arg("down_b"), py::arg("down_rank"),
      py::arg("down_scaling"), py::arg("offsets"), py::arg("order"), py::arg("routing_weights"), py::arg("hidden"),
      py::arg("gate_up_out"), py::arg("out"), py::arg("out_bf16"), py::arg("hidden_copy"),
      py::arg("packed_gate_up") = 0, py::arg("packed_down") = 0, py::arg("inner_gate_up") = 0,
      py::arg("inner_down") = 0, py::arg("tuning"),
      py::call_guard<py::gil_scoped_release>(),
      "Routed-expert SwiGLU forward with LoRA (expert_ffn.h); addresses of tensors checked by moecc._ops; out is "
      "bf16 when out_bf16, else float32.");

  m.def(
      "expert_ffn_backward",
      [](int isa, int64_t experts, int64_t hidden_size, int64_t inter, int64_t tokens, int64_t top_k,
         std::uintptr_t gate_up, std::uintptr_t down, std::uintptr_t gate_up_a, std::uintptr_t gate_up_b,
         int64_t gate_up_rank, float gate_up_scaling, std::uintptr_t down_a, std::uintptr_t down_b, int64_t down_rank,
         float down_scaling, std::uintptr_t offsets, std::uintptr_t order, std::uintptr_t routing_weights,
         std::uintptr_t hidden, std::uintptr_t gate_up_out, std::uintptr_t grad_out, std::uintptr_t grad_hidden,
         std::uintptr_t grad_routing, std::uintptr_t grad_gate_up_a, std::uintptr_t grad_gate_up_b,
         std::uintptr_t grad_down_a, std::uintptr_t grad_down_b, bool grad_out_bf16, bool grad_hidden_bf16,
         std::uintptr_t inner_gate_up, std::uintptr_t inner_down, const moecc::kernels::KernelTuning& tuning) {
        moecc::kernels::expert_ffn_backward(
            static_cast<Isa>(isa), {experts, hidden_size, inter, tokens, top_k},
            {as_pointer<const uint16_t>(gate_up), as_pointer<const uint16_t>(down)},
            lora_factors(gate_up_a, gate_up_b, gate_up_rank, gate_up_scaling),
            lora_factors(down_a, down_b, down_rank, down_scaling),
            {as_pointer<const int64_t>(offsets), as_pointer<const int64_t>(order),
             as_pointer<const float>(routing_weights)},
            {as_pointer<const uint16_t>(hidden), as_pointer<const uint16_t>(gate_up_out),
             grad_out_bf16 ? nullptr : as_pointer<const float>(grad_out),
             grad_out_bf16 ? as_pointer<const uint16_t>(grad_out) : nullptr,
             grad_hidden_bf16 ? nullptr : as_pointer<float>(grad_hidden),
             grad_hidden_bf16 ? as_pointer<uint16_t>(grad_hidden) : nullptr,
             as_pointer<float>(grad_routing), as_pointer<float>(grad_gate_up_a),
             as_pointer<float>(grad_gate_up_b), as_pointer<float>(grad_down_a), as_pointer<float>(grad_down_b),
             as_pointer<const float>(inner_gate_up), as_pointer<const float>(inner_down)},
            tuning, *moecc::pool::global_pool());
      },
      py::kw_only(), py::arg("isa"), py::arg("experts"), py::arg("hidden_size"), py::arg("inter"), py::arg("tokens"),
      py::arg("top_k"), py::arg("gate_up"), py::arg("down"), py::arg("gate_up_a"), py::arg("gate_up_b"),
      py::arg("gate_up_rank"), py::arg("gate_up_scaling"), py::arg("down_a"), py::arg("down_b"), py::arg("down_rank"),
      py::arg("down_scaling"), py::arg("offsets"), py::arg("order"), py::arg("routing_weights"), py::arg("hidden"),
      py::arg("gate_up_out"), py::arg("grad_out"), py::arg("grad_hidden"), py::arg("grad_routing"),
      py::arg("grad_gate_up_a"), py::arg("grad_gate_up_b"), py::arg("grad_down_a"), py::arg("grad_down_b"),
      py::arg("grad_out_bf16"), py::arg("grad_hidden_bf16"), py::arg("inner_gate_up") = 0, py::arg("inner_down") = 0,
      py::arg("tuning"), py::call_guard<py::gil_scoped_release>(),
      "Backward of expert_ffn_forward; LoRA gradients accumulate. The *_bf16 flags say grad_out / grad_hidden "
      "are bf16 instead of float32.");

  using moecc::kernels::GemmTuning;
  using moecc::kernels::KernelTuning;
  py::class_<GemmTuning>(m, "GemmTuning", "Prefetch settings of the panel products (panel_gemm.h).")
      .def(py::init<>())
      .def_readwrite("pack_prefetch_rows", &GemmTuning::pack_prefetch_rows)
      .def_readwrite("pack_prefetch_l2", &GemmTuning::pack_prefetch_l2)
      .def_readwrite("amx_prefetch_next", &GemmTuning::amx_prefetch_next);
  py::class_<KernelTuning>(m, "KernelTuning",
                           "Task shape and non-temporal stores of the expert kernels (expert_ffn.h); built with the "
                           "defaults the engine runs.")
      .def(py::init<>())
      .def_readwrite("panels_per_task", &KernelTuning::panels_per_task)
      .def_readwrite("grad_columns_per_task", &KernelTuning::grad_columns_per_task)
      .def_readwrite("rows_per_task", &KernelTuning::rows_per_task)
      .def_readwrite("block_rows", &KernelTuning::block_rows)
      .def_readwrite("streaming_copies", &KernelTuning::streaming_copies)
      .def_readwrite("streaming_outputs", &KernelTuning::streaming_outputs)
      .def_readwrite("gemm", &KernelTuning::gemm)
      .def("check", &moecc::kernels::check_tuning, "Raises ValueError naming a field that is out of range.");
  m.def("last_phase_times", &moecc::kernels::last_phase_times, py::arg("backward"),
        "[(phase, seconds)] of the latest expert_ffn_forward (backward=False) or expert_ffn_backward call.");

  m.def(
      "last_product_parts",
      [](bool backward) {
        std::vector<std::tuple<std::string, double, double, double>> parts;
        for (const auto& p : moecc::kernels::last_product_parts(backward)) {
          parts.emplace_back(p.phase, p.pack, p.gemm, p.epilogue);
        }
        return parts;
      },
      py::arg("backward"),
      "[(phase, pack, gemm, epilogue)] thread-seconds per product phase of the latest expert_ffn_forward "
      "(backward=False) or expert_ffn_backward call, summed over the pool's threads.");

  m.def(
      "peak_flops",
      [](const std::string& isa, int64_t iterations, int threads) {
        double (*one)(int64_t) = isa == "amx"           ? moecc::kernels::peak_flops_amx
                                 : isa == "avx512_bf16" ? moecc::kernels::peak_flops_avx512bf16
                                 : isa == "avx512_fma"  ? moecc::kernels::peak_flops_avx512fma
                                                        : nullptr;
        if (one == nullptr) {
          throw std::invalid_argument("peak_flops: unknown unit '" + isa + "' (amx, avx512_bf16 or avx512_fma)");
        }
        return rate(threads, [&]() { return one(iterations); });
      },
      py::arg("isa"), py::arg("iterations"), py::arg("threads") = 1, py::call_guard<py::gil_scoped_release>(),
      "Register-only FLOP/s of one thread (threads=1) or the sum over the pool's threads: bf16 for 'amx' and "
      "'avx512_bf16', float32 FMA for 'avx512_fma'; ValueError if the CPU cannot run it or the unit is unknown.");

  m.def(
      "panel_gemm_flops",
      [](int isa, int64_t tokens, int64_t n, int64_t k, int64_t reps, int threads) {
        return rate(threads, [&]() {
          return moecc::kernels::panel_gemm_flops(static_cast<Isa>(isa), tokens, n, k, reps);
        });
      },
      py::arg("isa"), py::arg("tokens"), py::arg("n"), py::arg("k"), py::arg("reps"), py::arg("threads") = 1,
      py::call_guard<py::gil_scoped_release>(),
      "FLOP/s of the panel kernel of `isa` on one cache-resident problem, one thread or summed over the pool.");
  m.def("_round_bf16_test", &round_bf16_test, py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("native"));
  m.def("_lora_rows_test", &lora_rows_test, py::arg("op"), py::arg("coef"), py::arg("coef_ld"), py::arg("scale"),
        py::arg("factors"), py::arg("ld"), py::arg("rank"), py::arg("n"), py::arg("rows"), py::arg("rows_ld"),
        py::arg("out"), py::arg("out_ld"), py::arg("count"), py::arg("grouped"));
  m.def("native_bf16", &moecc::kernels::v16::native_bf16,
        "Whether the epilogues round to bf16 with AVX512-BF16's instruction (the CPU has it and it is allowed).");
  m.def("set_native_bf16", &moecc::kernels::v16::set_native_bf16, py::arg("allowed"),
        "Allows (or not) AVX512-BF16's rounding where the CPU has it (MOECC_NATIVE_BF16, read by moecc/config.py); "
        "the kernels read it at their first call.");
  m.def("_pool_fill_test", &pool_fill_test, py::call_guard<py::gil_scoped_release>());
  m.def("_pool_raise_test", &pool_raise_test, py::call_guard<py::gil_scoped_release>());
}
