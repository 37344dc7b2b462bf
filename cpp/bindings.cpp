// The Python/C++ boundary: plain functions over raw addresses and shapes, and the kernels' argument structs, each
// bound once here (pointer fields as integer addresses, 0 for null). moecc/_ops.py is the only caller; it checks
// dtype, device, contiguity and sizes before an address crosses, and owns every buffer. Long-running calls release
// the GIL; C++ exceptions surface as Python exceptions through pybind11. Test hooks are in moecc._C.testing
// (testing_bindings.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/amx_self_check.h"
#include "kernels/cpu_features.h"
#include "kernels/expert_ffn.h"
#include "kernels/peak_rate.h"
#include "kernels/token_grouping.h"
#include "kernels/vector16.h"
#include "kernels/weight_packing.h"
#include "pool/thread_pool.h"
#include "testing_bindings.h"

namespace py = pybind11;

namespace {

using moecc::bindings::as_pointer;
using moecc::kernels::Isa;

// A pointer field of an argument struct as a read-write integer address (0: null).
template <typename Class, typename T>
void address(py::class_<Class>& cls, const char* name, T* Class::*field) {
  cls.def_property(
      name, [field](const Class& self) { return reinterpret_cast<std::uintptr_t>(self.*field); },
      [field](Class& self, std::uintptr_t value) { self.*field = reinterpret_cast<T*>(value); });
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

// The argument structs of expert_ffn.h and the tuning of expert_ffn.h / panel_gemm.h.
void bind_kernel_arguments(py::module_& m) {
  using namespace moecc::kernels;
  py::class_<ExpertShapes>(m, "ExpertShapes", "T, k, E, H, I of one expert_ffn call (expert_ffn.h).")
      .def(py::init<>())
      .def_readwrite("experts", &ExpertShapes::experts)
      .def_readwrite("hidden", &ExpertShapes::hidden)
      .def_readwrite("inter", &ExpertShapes::inter)
      .def_readwrite("tokens", &ExpertShapes::tokens)
      .def_readwrite("top_k", &ExpertShapes::top_k);

  py::class_<QuantizedWeights> quantized(m, "QuantizedWeights",
                                         "One projection's experts in a quantized format (dequantize.h).");
  quantized.def(py::init<>())
      .def_property(
          "format", [](const QuantizedWeights& self) { return static_cast<int>(self.format); },
          [](QuantizedWeights& self, int format) {
            if (format < 0 || format > 4) {
              throw std::invalid_argument("weight format " + std::to_string(format) +
                                          " is none of 0 bf16, 1 int8, 2 int4, 3 fp8, 4 mxfp4");
            }
            self.format = static_cast<WeightFormat>(format);
          })
      .def_readwrite("rows", &QuantizedWeights::rows)
      .def_readwrite("cols", &QuantizedWeights::cols)
      .def_readwrite("group", &QuantizedWeights::group)
      .def_readwrite("data_stride", &QuantizedWeights::data_stride)
      .def_readwrite("scale_stride", &QuantizedWeights::scale_stride);
  address(quantized, "data", &QuantizedWeights::data);
  address(quantized, "scales", &QuantizedWeights::scales);

  py::class_<ExpertMatrices> matrices(m, "ExpertMatrices",
                                      "The experts' bf16 weights (and packed copies) or quantized copies.");
  matrices.def(py::init<>())
      .def_readwrite("quantized_gate_up", &ExpertMatrices::quantized_gate_up)
      .def_readwrite("quantized_down", &ExpertMatrices::quantized_down);
  address(matrices, "gate_up", &ExpertMatrices::gate_up);
  address(matrices, "down", &ExpertMatrices::down);
  address(matrices, "packed_gate_up", &ExpertMatrices::packed_gate_up);
  address(matrices, "packed_down", &ExpertMatrices::packed_down);

  py::class_<LoraFactors> lora(m, "LoraFactors", "One projection's LoRA factors; a = 0: none.");
  lora.def(py::init<>()).def_readwrite("rank", &LoraFactors::rank).def_readwrite("scaling", &LoraFactors::scaling);
  address(lora, "a", &LoraFactors::a);
  address(lora, "b", &LoraFactors::b);

  py::class_<Routing> routing(m, "Routing", "The grouping of token_grouping.h and the routing weight per pair.");
  routing.def(py::init<>());
  address(routing, "offsets", &Routing::offsets);
  address(routing, "order", &Routing::order);
  address(routing, "weights", &Routing::weights);

  py::class_<ForwardIo> forward(m, "ForwardIo", "The forward's token rows in and out (expert_ffn.h).");
  forward.def(py::init<>());
  address(forward, "hidden", &ForwardIo::hidden);
  address(forward, "gate_up_out", &ForwardIo::gate_up_out);
  address(forward, "out", &ForwardIo::out);
  address(forward, "out_bf16", &ForwardIo::out_bf16);
  address(forward, "hidden_copy", &ForwardIo::hidden_copy);
  address(forward, "inner_gate_up", &ForwardIo::inner_gate_up);
  address(forward, "inner_down", &ForwardIo::inner_down);

  py::class_<BackwardIo> backward(m, "BackwardIo", "The backward's token rows and gradients (expert_ffn.h).");
  backward.def(py::init<>());
  address(backward, "hidden", &BackwardIo::hidden);
  address(backward, "gate_up_out", &BackwardIo::gate_up_out);
  address(backward, "grad_out", &BackwardIo::grad_out);
  address(backward, "grad_out_bf16", &BackwardIo::grad_out_bf16);
  address(backward, "grad_hidden", &BackwardIo::grad_hidden);
  address(backward, "grad_hidden_bf16", &BackwardIo::grad_hidden_bf16);
  address(backward, "grad_routing", &BackwardIo::grad_routing);
  address(backward, "grad_gate_up_a", &BackwardIo::grad_gate_up_a);
  address(backward, "grad_gate_up_b", &BackwardIo::grad_gate_up_b);
  address(backward, "grad_down_a", &BackwardIo::grad_down_a);
  address(backward, "grad_down_b", &BackwardIo::grad_down_b);
  address(backward, "inner_gate_up", &BackwardIo::inner_gate_up);
  address(backward, "inner_down", &BackwardIo::inner_down);
  address(backward, "lora_grad_slots", &BackwardIo::lora_grad_slots);
  backward.def_readwrite("lora_grad_experts", &BackwardIo::lora_grad_experts);

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
      .def("check", &check_tuning, "Raises ValueError naming a field that is out of range.");
}

// The kernels index with the routing: its offsets must bound a partition of [0, T*k) and its order be a
// permutation of the pair ids. Checked here, with the GIL released, rather than by a dozen torch ops in _ops.
void check_routing(const moecc::kernels::ExpertShapes& shapes, const moecc::kernels::Routing& routing) {
  const int64_t pairs = shapes.tokens * shapes.top_k;
  const int64_t* offsets = routing.offsets;
  bool rising = offsets[0] == 0 && offsets[shapes.experts] == pairs;
  for (int64_t e = 0; rising && e < shapes.experts; ++e) rising = offsets[e] <= offsets[e + 1];
  if (!rising) {
    throw std::invalid_argument("offsets must rise from 0 to " + std::to_string(pairs) +
                                " (the number of routed pairs)");
  }
  std::vector<uint8_t> seen(static_cast<size_t>(pairs), 0);
  for (int64_t g = 0; g < pairs; ++g) {
    const int64_t pair = routing.order[g];
    if (pair < 0 || pair >= pairs || seen[static_cast<size_t>(pair)]) {
      throw std::invalid_argument("order must be a permutation of the " + std::to_string(pairs) + " pair ids");
    }
    seen[static_cast<size_t>(pair)] = 1;
  }
}

void bind_expert_ffn(py::module_& m) {
  using namespace moecc::kernels;
  m.def(
      "expert_ffn_forward",
      [](int isa, const ExpertShapes& shapes, const ExpertMatrices& weights, const LoraFactors& gate_up_lora,
         const LoraFactors& down_lora, const Routing& routing, const ForwardIo& io, const KernelTuning& tuning) {
        check_routing(shapes, routing);
        expert_ffn_forward(static_cast<Isa>(isa), shapes, weights, gate_up_lora, down_lora, routing, io, tuning,
                           *moecc::pool::global_pool());
      },
      py::arg("isa"), py::arg("shapes"), py::arg("weights"), py::arg("gate_up_lora"), py::arg("down_lora"),
      py::arg("routing"), py::arg("io"), py::arg("tuning"), py::call_guard<py::gil_scoped_release>(),
      "Routed-expert SwiGLU forward with LoRA (expert_ffn.h); every address checked by moecc._ops.");
  m.def(
      "expert_ffn_backward",
      [](int isa, const ExpertShapes& shapes, const ExpertMatrices& weights, const LoraFactors& gate_up_lora,
         const LoraFactors& down_lora, const Routing& routing, const BackwardIo& io, const KernelTuning& tuning) {
        check_routing(shapes, routing);
        expert_ffn_backward(static_cast<Isa>(isa), shapes, weights, gate_up_lora, down_lora, routing, io, tuning,
                            *moecc::pool::global_pool());
      },
      py::arg("isa"), py::arg("shapes"), py::arg("weights"), py::arg("gate_up_lora"), py::arg("down_lora"),
      py::arg("routing"), py::arg("io"), py::arg("tuning"), py::call_guard<py::gil_scoped_release>(),
      "Backward of expert_ffn_forward; LoRA A gradients accumulate, B gradients are written.");
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
}

// Register-only peaks and the panel kernel's rate (peak_rate.h), for the benchmarks.
void bind_rates(py::module_& m) {
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
         std::uintptr_t order, std::uintptr_t keep) {
        return moecc::kernels::group_tokens_by_expert(
            as_pointer<const int64_t>(top_k_index), num_tokens, top_k, num_experts, as_pointer<int64_t>(offsets),
            as_pointer<int64_t>(order), *moecc::pool::global_pool(), as_pointer<const uint8_t>(keep));
      },
      py::arg("top_k_index"), py::arg("num_tokens"), py::arg("top_k"), py::arg("num_experts"), py::arg("offsets"),
      py::arg("order"), py::arg("keep") = 0, py::call_guard<py::gil_scoped_release>(),
      "Stable counting sort of [num_tokens, top_k] int64 expert ids; writes offsets [E+1] and order [T*k] (of the "
      "experts flagged in keep [E] uint8 alone, where given); returns the pairs grouped.");

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

  m.def("native_bf16", &moecc::kernels::v16::native_bf16,
        "Whether the epilogues round to bf16 with AVX512-BF16's instruction (the CPU has it and it is allowed).");
  m.def("set_native_bf16", &moecc::kernels::v16::set_native_bf16, py::arg("allowed"),
        "Allows (or not) AVX512-BF16's rounding where the CPU has it (MOECC_NATIVE_BF16, read by moecc/config.py); "
        "the kernels read it at their first call.");
  bind_kernel_arguments(m);
  bind_expert_ffn(m);
  bind_rates(m);
  py::module_ testing = m.def_submodule("testing", "Test hooks (tests only; not part of moecc's API).");
  moecc::bindings::bind_testing(testing);
}
