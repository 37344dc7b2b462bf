// The test-only submodule moecc._C.testing (testing_bindings.cpp): hooks the tests call to reach pieces of the
// kernels and the pool that the API does not expose. Nothing in moecc uses them but its test wrappers in _ops.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace moecc::bindings {

// Defines the test hooks on `testing`, the submodule bindings.cpp creates.
void bind_testing(pybind11::module_& testing);

// The address Python passes (a tensor's data_ptr()) as a typed pointer.
template <typename T>
T* as_pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace moecc::bindings
