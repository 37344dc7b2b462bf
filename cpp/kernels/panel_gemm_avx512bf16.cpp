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
constexpr int kGradTokenBlock = 4;

MOECC_AVX512BF16 inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// One block of TOKENS rows x (16 or 32) outputs; TOKENS and PANELS are compile-time so the accumulators stay
// in registers (2 x 8 zmm at most).
template <int TOKENS, int PANELS>
MOECC_AVX512BF16 void forward_block(const uint16_t* x, int64_t ldx, const uint16_t* panel0, int64_t k_padded,
                                    float* out, int64_t ldo) {
  __m512 acc[TOKENS][PANELS];
  for (int t = 0; t < TOKENS; ++t)
    for (int p = 0; p < PANELS; ++p) acc[t][p] = _mm512_setzero_ps();
  const int64_t panel_stride = kPanelRows * k_padded;
  for (int64_t kp = 0; kp < k_padded / 2; ++kp) {
    __m512bh w[PANELS];
    for (int p = 0; p < PANELS; ++p) w[p] = as_bh(_mm512_loadu_si512(panel0 + p * panel_stride + kp * 32));
    for (int t = 0; t < TOKENS; ++t) {
      int32_t pair;
      __builtin_memcpy(&pair, x + t * ldx + 2 * kp, sizeof(pair));
      const __m512bh a = as_bh(_mm512_set1_epi32(pair));
      for (int p = 0; p < PANELS; ++p) acc[t][p] = _mm512_dpbf16_ps(acc[t][p], a, w[p]);
    }
  }
  for (int t = 0; t < TOKENS; ++t)
    for (int p = 0; p < PANELS; ++p) _mm512_storeu_ps(out + t * ldo + p * kPanelRows, acc[t][p]);
}

template <int PANELS>
MOECC_AVX512BF16 void forward_rows(const uint16_t* x, int64_t ldx, int tokens, const uint16_t* panel0,
                                   int64_t k_padded, float* out, int64_t ldo) {
  switch (tokens) {
    case 8: return forward_block<8, PANELS>(x, ldx, panel0, k_padded, out, ldo);
    case 7: return forward_block<7, PANELS>(x, ldx, panel0, k_padded, out, ldo);
    case 6: return forward_block<6, PANELS>(x, ldx, panel0, k_padded, out, ldo);
    case 5: return forward_block<5, PANELS>(x, ldx, panel0, k_padded, out, ldo);
    case 4: return forward_block<4, PANELS>(x, ldx, panel0, k_padded, out, ldo);
    case 3: return forward_block<3, PANELS>(x, ldx, panel0, k_padded, out, ldo);
    case 2: return forward_block<2, PANELS>(x, ldx, panel0, k_padded, out, ldo);
    default: return forward_block<1, PANELS>(x, ldx, panel0, k_padded, out, ldo);
  }
}

MOECC_AVX512BF16 void forward(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed,
                              int64_t k_padded, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokenBlock) {
    const int block = static_cast<int>(tokens - t0 < kTokenBlock ? tokens - t0 : kTokenBlock);
    for (int64_t p = p0; p < p1; p += 2) {
      const uint16_t* panel0 = packed + p * kPanelRows * k_padded;
      float* dst = out + t0 * ldo + (p - p0) * kPanelRows;
      if (p + 1 < p1) {
        forward_rows<2>(x + t0 * ldx, ldx, block, panel0, k_padded, dst, ldo);
      } else {
        forward_rows<1>(x + t0 * ldx, ldx, block, panel0, k_padded, dst, ldo);
      }
    }
  }
}

// dx for TOKENS rows and one pair of k columns: the 16 outputs of each panel row are the reduction lanes.
template <int TOKENS>
MOECC_AVX512BF16 void input_grad_pair(const float* dy, int64_t ld_dy, const uint16_t* row, int64_t panels,
                                      int64_t panel_stride, float* dx_even, float* dx_odd, int64_t ld_dx) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 even[TOKENS], odd[TOKENS];
  for (int t = 0; t < TOKENS; ++t) even[t] = odd[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < panels; ++p, row += panel_stride) {
    const __m512i w = _mm512_loadu_si512(row);
    const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, high_half));
    for (int t = 0; t < TOKENS; ++t) {
      const __m512 d = _mm512_loadu_ps(dy + t * ld_dy + p * kPanelRows);
      even[t] = _mm512_fmadd_ps(d, w_even, even[t]);
      odd[t] = _mm512_fmadd_ps(d, w_odd, odd[t]);
    }
  }
  for (int t = 0; t < TOKENS; ++t) {
    dx_even[t * ld_dx] = _mm512_reduce_add_ps(even[t]);
    dx_odd[t * ld_dx] = _mm512_reduce_add_ps(odd[t]);
  }
}

MOECC_AVX512BF16 void input_grad(const float* dy, int64_t ld_dy, int64_t tokens, const uint16_t* packed,
                                 int64_t n_padded, int64_t k_padded, int64_t k0, int64_t k1, float* dx,
                                 int64_t ld_dx) {
  const int64_t panels = n_padded / kPanelRows, panel_stride = kPanelRows * k_padded;
  for (int64_t t0 = 0; t0 < tokens; t0 += kGradTokenBlock) {
    const int block = static_cast<int>(tokens - t0 < kGradTokenBlock ? tokens - t0 : kGradTokenBlock);
    const float* d = dy + t0 * ld_dy;
    for (int64_t kp = k0 / 2; kp < k1 / 2; ++kp) {
      const uint16_t* row = packed + kp * 2 * kPanelRows;
      float* even = dx + t0 * ld_dx + 2 * kp;
      switch (block) {
        case 4: input_grad_pair<4>(d, ld_dy, row, panels, panel_stride, even, even + 1, ld_dx); break;
        case 3: input_grad_pair<3>(d, ld_dy, row, panels, panel_stride, even, even + 1, ld_dx); break;
        case 2: input_grad_pair<2>(d, ld_dy, row, panels, panel_stride, even, even + 1, ld_dx); break;
        default: input_grad_pair<1>(d, ld_dy, row, panels, panel_stride, even, even + 1, ld_dx); break;
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
