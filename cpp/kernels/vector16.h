// 16-lane float vectors in GCC's vector extension, for code compiled by target_clones for AVX512 (one zmm
// register) and for the baseline ISA (the same operations split into SSE registers): loads and stores of float
// and bf16 lanes, bf16 rounding, a lane sum. The helpers are always inlined; the functions that call them are built
// with MOECC_VECTOR_CLONES (or, for NativeBf16, MOECC_BF16_TARGET), and the running CPU picks the copy.
#pragma once

#include <immintrin.h>  // __m512

#include <cstdint>
#include <cstdlib>
#include <cstring>

// 64-byte vector types passed between always-inline helpers: GCC warns that their ABI differs with and without
// AVX512, which cannot matter for calls that are always inlined.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moecc::kernels::v16 {

#define MOECC_INLINE __attribute__((always_inline)) inline
#ifndef MOECC_VECTOR_CLONES  // a build may pick other clones (-D), e.g. to time 256-bit code
#define MOECC_VECTOR_CLONES __attribute__((target_clones("avx512f", "default")))
#endif

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;

MOECC_INLINE vf bits_to_float(vu bits) {
  vf v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
MOECC_INLINE vu float_to_bits(vf v) {
  vu bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}
MOECC_INLINE vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
MOECC_INLINE void store16(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
// float_to_bf16 (panel_gemm.h) on 16 lanes, as the 16 low halves of 32-bit lanes.
MOECC_INLINE vu bf16_bits(vf v) {
  const vu bits = float_to_bits(v);
  const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vu quiet_nan = (bits >> 16) | 0x40u;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded;
}
MOECC_INLINE vf widen16(vh h) { return bits_to_float(__builtin_convertvector(h, vu) << 16); }
MOECC_INLINE vf load16(const uint16_t* p) {  // bf16 -> float: the bits are the top half of a float
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return widen16(h);
}

// Rounding 16 floats to bf16, two ways. PortableBf16: integer operations any ISA has (about 10 vector operations).
// NativeBf16: AVX512-BF16's VCVTNEPS2BF16, one instruction, the same results except that it flushes float32
// denormals (magnitudes below 1.2e-38) to zero where PortableBf16 rounds them; usable only in functions built
// with MOECC_BF16_TARGET, on CPUs that have it. The epilogues round every output element (the SwiGLU backward
// four times), and the AMX host's cores run vector code slowly (AVX512-BF16 dot products at 0.08 TFLOP/s a core
// against 0.53 on a Zen 4, register-only): there the integer rounding was much of the epilogues' time.
#define MOECC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
struct PortableBf16 {
  static MOECC_INLINE vh narrow(vf v) { return __builtin_convertvector(bf16_bits(v), vh); }
};
struct NativeBf16 {
  // The builtin behind _mm512_cvtneps_pbh, which as an always-inline function with its own target could not be
  // inlined through these helpers (they have none); the builtin is checked where it lands, in the targeted caller.
  static MOECC_INLINE vh narrow(vf v) {
    __m512 x;
    std::memcpy(&x, &v, sizeof(x));
    const auto h = __builtin_ia32_cvtneps2bf16_v16sf(x);
    vh out;
    static_assert(sizeof(h) == sizeof(out), "16 bf16 lanes");
    std::memcpy(&out, &h, sizeof(out));
    return out;
  }
};

// Whether the kernels that round with NativeBf16 use that build: this CPU (and OS) runs AVX512-BF16, and
// MOECC_NATIVE_BF16 is not 0 (which tests use to run the PortableBf16 builds on such CPUs). Checked once.
inline bool native_bf16() {
  static const bool use = [] {
    const char* setting = std::getenv("MOECC_NATIVE_BF16");
    return __builtin_cpu_supports("avx512bf16") && !(setting != nullptr && std::strcmp(setting, "0") == 0);
  }();
  return use;
}

template <typename Bf16 = PortableBf16>
MOECC_INLINE void store16(uint16_t* p, vf v) {
  const vh h = Bf16::narrow(v);
  std::memcpy(p, &h, sizeof(h));
}
// store16 with a non-temporal store when kStream (p 16-byte aligned; the caller fences): two 16-byte halves, as
// SSE2's is the widest non-temporal store every build has.
template <typename Bf16, bool kStream>
MOECC_INLINE void put16(uint16_t* p, vf v) {
  if constexpr (kStream) {
    const vh h = Bf16::narrow(v);
    __m128i halves[2];
    std::memcpy(halves, &h, sizeof(h));
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), halves[0]);
    _mm_stream_si128(reinterpret_cast<__m128i*>(p + 8), halves[1]);
  } else {
    store16<Bf16>(p, v);
  }
}
template <typename Bf16 = PortableBf16>
MOECC_INLINE vf round16(vf v) {  // to the nearest bf16 value
  return widen16(Bf16::narrow(v));
}

// The 16 lanes summed as a tree of halves: 8 vector operations. Adding them one by one, in order (no reassociation
// without -ffast-math), is 16 dependent additions, which in the 256-column epilogues (16 accumulators a row for
// the SwiGLU backward's s dG B) cost as much as the dot products themselves.
MOECC_INLINE float lane_sum(vf v) {
  const vf8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

}  // namespace moecc::kernels::v16
