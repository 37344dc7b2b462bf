// SwiGLU rows (swiglu.h): the dispatcher, which picks a build of swiglu_body.h once from the running CPU, and the
// baseline build (this file has the baseline ISA's flags, as everything that runs before the choice must).
#include "swiglu.h"

#include <cstdint>

#include "swiglu_body.h"

namespace moecc::kernels {

const SwigluKernels& swiglu_baseline() { return SwigluBuild<v16::PortableBf16>::kernels; }

namespace {

// AVX512-BF16's rounding where native_bf16() (vector16.h) says so, else integer rounding in AVX512F or baseline code.
const SwigluKernels& kernels() {
  static const SwigluKernels& chosen = v16::native_bf16()                   ? swiglu_avx512bf16()
                                       : __builtin_cpu_supports("avx512f") ? swiglu_avx512()
                                                                           : swiglu_baseline();
  return chosen;
}

}  // namespace

void swiglu_forward_row(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n) {
  kernels().forward(gate, up, act, n);
}

float swiglu_backward_row(const uint16_t* gate, const uint16_t* up, const float* grad_act, float w, bool write_act,
                          uint16_t* act, float* dg, float* du, uint16_t* dg_bf16, uint16_t* du_bf16, int64_t n,
                          bool stream) {
  const auto aligned = [](const uint16_t* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  stream = stream && aligned(dg_bf16) && aligned(du_bf16) && (!write_act || aligned(act));
  return kernels().backward(gate, up, grad_act, w, write_act, act, dg, du, dg_bf16, du_bf16, n, stream);
}

}  // namespace moecc::kernels
