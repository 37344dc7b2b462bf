// The generic body of the SwiGLU rows (swiglu.h) in 16-lane vectors (vector16.h), and the entry points each build
// of it exports. One pass per 16 columns does everything an element needs while it is in registers: as plain loops
// GCC vectorised itself the backward took six passes over the row and two divisions.
// Built once per ISA, each translation unit with its own flags (setup.py): swiglu.cpp for the baseline ISA,
// isa/swiglu_avx512.cpp (one zmm register a vector) and isa/swiglu_avx512bf16.cpp (bf16 rounded by VCVTNEPS2BF16).
// Everything here has internal linkage, so no build's copy of a function can stand in for another's at link time.
#pragma once

#include <cstdint>
#include <cstring>

#include "vector16.h"

namespace moecc::kernels {

// One build's entry points (swiglu.h's two functions, after the dispatcher's checks); swiglu.cpp picks a build once.
struct SwigluKernels {
  void (*forward)(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n);
  float (*backward)(const uint16_t* gate, const uint16_t* up, const float* grad_act, float w, bool write_act,
                    uint16_t* act, float* dg, float* du, uint16_t* dg_bf16, uint16_t* du_bf16, int64_t n, bool stream);
};

const SwigluKernels& swiglu_baseline();    // swiglu.cpp
const SwigluKernels& swiglu_avx512();      // isa/swiglu_avx512.cpp
const SwigluKernels& swiglu_avx512bf16();  // isa/swiglu_avx512bf16.cpp

namespace {

using namespace v16;

// exp(x) to ~2 ulp in operations every vector ISA has (glibc's expf is a call per element). Range reduction
// x = n ln2 + r, |r| <= ln2/2, a degree-6 Taylor polynomial for e^r, and 2^n built in the exponent bits; inputs
// clamp to the finite float range, NaN to the low end (the callers' results still come out NaN, through their x).
MOECC_INLINE vf exp16(vf x) {
  const vf low = vf{} - 87.0f, high = vf{} + 88.0f;
  x = x > low ? (x < high ? x : high) : low;
  // Round to nearest by adding and removing 1.5 * 2^23 (no rounding instruction in the baseline ISA).
  const vf shifter = vf{} + 12582912.0f;
  const vf n = (x * 1.44269504088896341f + shifter) - shifter;
  const vf r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;  // ln2 split in two parts
  vf p = vf{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi exponent = (__builtin_convertvector(n, vi) + 127) << 23;  // n in [-126, 127]: positive
  return p * bits_to_float(__builtin_convertvector(exponent, vu));
}

// sigmoid(g) with one division (a vector division costs about as much as the exp).
MOECC_INLINE vf sigmoid16(vf g) { return 1.0f / (1.0f + exp16(-g)); }

template <typename Bf16>
MOECC_INLINE vf act16(vf g, vf u, vf s) {
  return round16<Bf16>(round16<Bf16>(g * s) * u);
}

// One vector of the backward; returns act . grad_act's 16 lane products.
template <typename Bf16, bool kWriteAct, bool kStream = false>
MOECC_INLINE vf backward16(const uint16_t* gate, const uint16_t* up, const float* grad_act, float w, uint16_t* act,
                           float* dg, float* du, uint16_t* dg_bf16, uint16_t* du_bf16) {
  const vf g = load16(gate), u = load16(up), s = sigmoid16(g), grad = load16(grad_act);
  vf a;
  if (kWriteAct) {
    a = act16<Bf16>(g, u, s);
    put16<Bf16, kStream>(act, a);
  } else {
    a = load16(act);
  }
  const vf ga = grad * w;
  const vf d_gate = ga * u * s * (1.0f + g * (1.0f - s)), d_up = ga * g * s;
  store16(dg, d_gate);
  store16(du, d_up);
  put16<Bf16, kStream>(dg_bf16, d_gate);
  put16<Bf16, kStream>(du_bf16, d_up);
  return a * grad;
}

template <typename Bf16, bool kWriteAct, bool kStream>
MOECC_INLINE float backward_row(const uint16_t* gate, const uint16_t* up, const float* grad_act, float w,
                                uint16_t* act, float* dg, float* du, uint16_t* dg_bf16, uint16_t* du_bf16,
                                int64_t n) {
  vf dot{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    dot += backward16<Bf16, kWriteAct, kStream>(gate + i, up + i, grad_act + i, w, act + i, dg + i, du + i,
                                                dg_bf16 + i, du_bf16 + i);
  }
  if (i < n) {  // the last columns through the same code, zero-padded (they add 0 to the dot)
    const int64_t rest = n - i;
    uint16_t g[kLanes] = {}, u[kLanes] = {}, a[kLanes] = {}, dgh[kLanes], duh[kLanes];
    float grad[kLanes] = {}, dgf[kLanes], duf[kLanes];
    std::memcpy(g, gate + i, rest * sizeof(uint16_t));
    std::memcpy(u, up + i, rest * sizeof(uint16_t));
    std::memcpy(grad, grad_act + i, rest * sizeof(float));
    if (!kWriteAct) std::memcpy(a, act + i, rest * sizeof(uint16_t));
    dot += backward16<Bf16, kWriteAct>(g, u, grad, w, a, dgf, duf, dgh, duh);
    if (kWriteAct) std::memcpy(act + i, a, rest * sizeof(uint16_t));
    std::memcpy(dg + i, dgf, rest * sizeof(float));
    std::memcpy(du + i, duf, rest * sizeof(float));
    std::memcpy(dg_bf16 + i, dgh, rest * sizeof(uint16_t));
    std::memcpy(du_bf16 + i, duh, rest * sizeof(uint16_t));
  }
  return lane_sum(dot);
}

template <typename Bf16>
MOECC_INLINE void forward_row(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf g = load16(gate + i);
    store16<Bf16>(act + i, act16<Bf16>(g, load16(up + i), sigmoid16(g)));
  }
  if (i < n) {
    const int64_t rest = n - i;
    uint16_t g[kLanes] = {}, u[kLanes] = {}, a[kLanes];
    std::memcpy(g, gate + i, rest * sizeof(uint16_t));
    std::memcpy(u, up + i, rest * sizeof(uint16_t));
    const vf gv = load16(g);
    store16<Bf16>(a, act16<Bf16>(gv, load16(u), sigmoid16(gv)));
    std::memcpy(act + i, a, rest * sizeof(uint16_t));
  }
}

template <typename Bf16>
MOECC_INLINE float backward_any(const uint16_t* gate, const uint16_t* up, const float* grad_act, float w,
                                bool write_act, uint16_t* act, float* dg, float* du, uint16_t* dg_bf16,
                                uint16_t* du_bf16, int64_t n, bool stream) {
  if (stream) {
    return write_act ? backward_row<Bf16, true, true>(gate, up, grad_act, w, act, dg, du, dg_bf16, du_bf16, n)
                     : backward_row<Bf16, false, true>(gate, up, grad_act, w, act, dg, du, dg_bf16, du_bf16, n);
  }
  return write_act ? backward_row<Bf16, true, false>(gate, up, grad_act, w, act, dg, du, dg_bf16, du_bf16, n)
                   : backward_row<Bf16, false, false>(gate, up, grad_act, w, act, dg, du, dg_bf16, du_bf16, n);
}

// The entry points of a build rounding with Bf16.
template <typename Bf16>
struct SwigluBuild {
  static void forward(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n) {
    forward_row<Bf16>(gate, up, act, n);
  }
  static float backward(const uint16_t* gate, const uint16_t* up, const float* grad_act, float w, bool write_act,
                        uint16_t* act, float* dg, float* du, uint16_t* dg_bf16, uint16_t* du_bf16, int64_t n,
                        bool stream) {
    return backward_any<Bf16>(gate, up, grad_act, w, write_act, act, dg, du, dg_bf16, du_bf16, n, stream);
  }
  static constexpr SwigluKernels kernels{forward, backward};
};

}  // namespace
}  // namespace moecc::kernels
