// AVX512-BF16 variant of panel_gemm.h (Cooper Lake, Sapphire Rapids+, Zen 4+). Compiled for the baseline ISA
// with per-function target attributes, so the module loads everywhere and these run only after dispatch.
//
// forward: per (token block, 2 panels) 2x8 fp32 accumulators; each 64-byte panel row is one VDPBF16PS operand,
// each bf16 pair of x a 32-bit broadcast. input_grad: the 16 outputs of a panel row are the reduction lanes;
// the row's bf16 pairs split into two fp32 vectors (k even / k odd) by shift and mask.
#include <immintrin.h>

#include "panel_gemm.h"
#include "weight_packing.h"

#define MOECC_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace moecc::kernels {
namespace {

constexpr int kTokenBlock = 8;

MOECC_AVX512BF16 inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

MOECC_AVX512BF16 void forward_block(const uint16_t* x, int64_t ldx, int tokens, const uint16_t* panel0,
                                    const uint16_t* panel1, int64_t k_padded, float* out, int64_t ldo) {
  __m512 acc0[kTokenBlock], acc1[kTokenBlock];
  for (int t = 0; t < kTokenBlock; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_padded / 2; ++kp) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(panel0 + kp * 32));
    const __m512bh w1 = panel1 ? as_bh(_mm512_loadu_si512(panel1 + kp * 32)) : w0;
    for (int t = 0; t < tokens; ++t) {
      int32_t pair;
      __builtin_memcpy(&pair, x + t * ldx + 2 * kp, sizeof(pair));
      const __m512bh a = as_bh(_mm512_set1_epi32(pair));
      acc0[t] = _mm512_dpbf16_ps(acc0[t], a, w0);
      if (panel1) acc1[t] = _mm512_dpbf16_ps(acc1[t], a, w1);
    }
  }
  for (int t = 0; t < tokens; ++t) {
    _mm512_storeu_ps(out + t * ldo, acc0[t]);
    if (panel1) _mm512_storeu_ps(out + t * ldo + 16, acc1[t]);
  }
}

MOECC_AVX512BF16 void forward(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed,
                              int64_t k_padded, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokenBlock) {
    const int block = static_cast<int>(tokens - t0 < kTokenBlock ? tokens - t0 : kTokenBlock);
    for (int64_t p = p0; p < p1; p += 2) {
      const uint16_t* panel0 = packed + p * kPanelRows * k_padded;
      const uint16_t* panel1 = p + 1 < p1 ? panel0 + kPanelRows * k_padded : nullptr;
      forward_block(x + t0 * ldx, ldx, block, panel0, panel1, k_padded, out + t0 * ldo + (p - p0) * kPanelRows,
                    ldo);
    }
  }
}

constexpr int kGradTokenBlock = 4;

MOECC_AVX512BF16 void input_grad(const float* dy, int64_t ld_dy, int64_t tokens, const uint16_t* packed,
                                 int64_t n_padded, int64_t k_padded, int64_t k0, int64_t k1, float* dx,
                                 int64_t ld_dx) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int64_t panels = n_padded / kPanelRows, panel_stride = kPanelRows * k_padded;
  for (int64_t t0 = 0; t0 < tokens; t0 += kGradTokenBlock) {
    const int block = static_cast<int>(tokens - t0 < kGradTokenBlock ? tokens - t0 : kGradTokenBlock);
    for (int64_t kp = k0 / 2; kp < k1 / 2; ++kp) {
      __m512 even[kGradTokenBlock], odd[kGradTokenBlock];
      for (int t = 0; t < kGradTokenBlock; ++t) even[t] = odd[t] = _mm512_setzero_ps();
      const uint16_t* row = packed + kp * 2 * kPanelRows;
      for (int64_t p = 0; p < panels; ++p, row += panel_stride) {
        const __m512i w = _mm512_loadu_si512(row);
        const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, high_half));
        for (int t = 0; t < block; ++t) {
          const __m512 d = _mm512_loadu_ps(dy + (t0 + t) * ld_dy + p * kPanelRows);
          even[t] = _mm512_fmadd_ps(d, w_even, even[t]);
          odd[t] = _mm512_fmadd_ps(d, w_odd, odd[t]);
        }
      }
      for (int t = 0; t < block; ++t) {
        dx[(t0 + t) * ld_dx + 2 * kp] = _mm512_reduce_add_ps(even[t]);
        dx[(t0 + t) * ld_dx + 2 * kp + 1] = _mm512_reduce_add_ps(odd[t]);
      }
    }
  }
}

}  // namespace

const PanelGemm& panel_gemm_avx512bf16() {
  static const PanelGemm gemm{forward, input_grad};
  return gemm;
}

}  // namespace moecc::kernels
