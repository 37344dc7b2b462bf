// 16-lane float vectors in GCC's vector extension (which clang shares): loads and stores of float and bf16 lanes,
// bf16 rounding, a lane sum. The helpers are always inlined and carry no target of their own: a kernel family's
// body is compiled once per ISA, each translation unit with that ISA's flags (setup.py; cpp/kernels/isa/), so the
// helpers take the ISA of the file they are inlined in: one zmm register a vector under -mavx512f, SSE registers in
// baseline files. (Helpers without a target inlined into targeted functions are an ABI error for clang.)
#pragma once

#include <immintrin.h>  // __m512

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// 64-byte vector types passed between always-inline helpers: GCC and clang warn in baseline files that their ABI
// differs with and without AVX512, which cannot matter for calls that are always inlined.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moecc::kernels::v16 {

#define MOECC_INLINE __attribute__((always_inline)) inline
// For plain loops outside the per-ISA files (expert_ffn_common.cpp), which GCC and clang vectorise themselves: an
// AVX512 and a baseline copy, the running CPU picks one at load time.
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
#if defined(__AVX512F__)
// Loads and stores as vectors of the element type (unaligned and aliasing, as immintrin.h's __m512_u): under
// -mavx512f, GCC turns memcpy into a vector into 512-bit integer moves (vmovdqu64), the typed access into float
// ones (vmovups). Baseline files keep memcpy, which GCC splits into the moves that ISA has.
typedef float vf_unaligned __attribute__((vector_size(64), aligned(1), may_alias));
typedef uint16_t vh_unaligned __attribute__((vector_size(32), aligned(1), may_alias));
MOECC_INLINE vf load16(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
MOECC_INLINE void store16(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }
MOECC_INLINE vh load_bf16_bits(const uint16_t* p) { return *reinterpret_cast<const vh_unaligned*>(p); }
MOECC_INLINE void store_bf16_bits(uint16_t* p, vh h) { *reinterpret_cast<vh_unaligned*>(p) = h; }
#else
MOECC_INLINE vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
MOECC_INLINE void store16(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
MOECC_INLINE vh load_bf16_bits(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return h;
}
MOECC_INLINE void store_bf16_bits(uint16_t* p, vh h) { std::memcpy(p, &h, sizeof(h)); }
#endif
// float_to_bf16 (panel_gemm.h) on 16 lanes, as the 16 low halves of 32-bit lanes.
MOECC_INLINE vu bf16_bits(vf v) {
  const vu bits = float_to_bits(v);
  const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vu quiet_nan = (bits >> 16) | 0x40u;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded;
}
MOECC_INLINE vf widen16(vh h) { return bits_to_float(__builtin_convertvector(h, vu) << 16); }
MOECC_INLINE vf load16(const uint16_t* p) {  // bf16 -> float: the bits are the top half of a float
  return widen16(load_bf16_bits(p));
}

// Rounding 16 floats to bf16, two ways. PortableBf16: integer operations any ISA has (about 10 vector operations).
// NativeBf16: AVX512-BF16's VCVTNEPS2BF16, one instruction, the same results except that it flushes float32
// denormals (magnitudes below 1.2e-38) to zero where PortableBf16 rounds them; defined only in files compiled with
// -mavx512bf16 (isa/*_avx512bf16.cpp), called only on CPUs that have it. The epilogues round every output element
// (the SwiGLU backward four times); on cores that run vector code slowly the integer rounding is much of the
// epilogues' time.
struct PortableBf16 {
  static MOECC_INLINE vh narrow(vf v) { return __builtin_convertvector(bf16_bits(v), vh); }
};
#if defined(__AVX512BF16__)
struct NativeBf16 {
  static MOECC_INLINE vh narrow(vf v) {
    __m512 x;
    std::memcpy(&x, &v, sizeof(x));
    const __m256bh h = _mm512_cvtneps_pbh(x);  // lanes of short (GCC < 13) or __bf16 (GCC 13, clang): bits alike
    vh out;
    static_assert(sizeof(h) == sizeof(out), "16 bf16 lanes");
    std::memcpy(&out, &h, sizeof(out));
    return out;
  }
};
#endif

// Whether native bf16 rounding is allowed: MOECC_NATIVE_BF16, read by moecc/config.py and set through
// set_native_bf16 when moecc._ops is imported (tests turn it off to run the PortableBf16 builds on CPUs that have
// AVX512-BF16). The dispatchers (swiglu.cpp, lora_products.cpp) read it once, at their first call.
inline std::atomic<bool>& native_bf16_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}
inline void set_native_bf16(bool allowed) { native_bf16_allowed().store(allowed); }

// Whether the kernels that round with NativeBf16 use that build: this CPU (and OS) runs AVX512-BF16, and it is
// allowed (above).
inline bool native_bf16() { return __builtin_cpu_supports("avx512bf16") && native_bf16_allowed().load(); }

template <typename Bf16 = PortableBf16>
MOECC_INLINE void store16(uint16_t* p, vf v) {
  store_bf16_bits(p, Bf16::narrow(v));
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
#if __has_builtin(__builtin_shufflevector)
  const vf8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
#else  // GCC 11 has no __builtin_shufflevector: the same halves through memory, which it keeps in registers
  vf8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof(lo8));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(lo8), sizeof(hi8));
  const vf8 h8 = lo8 + hi8;
  vf4 lo4, hi4;
  std::memcpy(&lo4, &h8, sizeof(lo4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&h8) + sizeof(lo4), sizeof(hi4));
  const vf4 h4 = lo4 + hi4;
#endif
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

}  // namespace moecc::kernels::v16
