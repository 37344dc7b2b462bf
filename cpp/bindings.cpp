// The Python/C++ boundary: plain functions over raw addresses and shapes. moecc/_ops.py is the only caller;
// it checks dtype, device, contiguity and sizes before an address crosses, and owns every buffer.
// Long-running calls release the GIL; C++ exceptions surface as Python exceptions through pybind11.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "kernels/token_grouping.h"
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

  m.def("_pool_fill_test", &pool_fill_test, py::call_guard<py::gil_scoped_release>());
  m.def("_pool_raise_test", &pool_raise_test, py::call_guard<py::gil_scoped_release>());
}
