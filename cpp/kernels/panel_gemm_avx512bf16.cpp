// AVX512-BF16 variant of panel_gemm.h (Cooper Lake, Sapphire Rapids+, Zen 4+). Compiled for the baseline ISA
// with per-function target attributes, so the module loads everywhere and these run only after dispatch.
//
// forward: per (token block, 2 panels) 2x8 fp32 accumulators; each 64-byte panel row is one VDPBF16PS operand,
// each bf16 pair of x a 32-bit broadcast. input_grad: the 16 outputs of a panel row are the reduction lanes;
// the row's bf16 pairs split into two fp32 vectors (k even / k odd) by shift and mask.
#include <immintrin.h>


#include "aligned_buffer.h"
#include "panel_gemm.h"
#include "weight_packing.h"

#define MOECC_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace moecc::kernels {
namespace {

constexpr int kTokenBlock = 8;

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

// Transposes an 8x8 matrix of qwords held in 8 registers (row i = r[i]); result column j lands in r[j].
MOECC_AVX512BF16 inline void transpose_8x8_qwords(__m512i r[8]) {
  __m512i lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {
    lo[i] = _mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]);  // lane l: (r2i[2l],   r2i+1[2l])
    hi[i] = _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]);  // lane l: (r2i[2l+1], r2i+1[2l+1])
  }
  for (int parity = 0; parity < 2; ++parity) {
    const __m512i* v = parity ? hi : lo;
    const __m512i x0 = _mm512_shuffle_i64x2(v[0], v[1], 0x88), y0 = _mm512_shuffle_i64x2(v[0], v[1], 0xDD);
    const __m512i x1 = _mm512_shuffle_i64x2(v[2], v[3], 0x88), y1 = _mm512_shuffle_i64x2(v[2], v[3], 0xDD);
    r[parity + 0] = _mm512_shuffle_i64x2(x0, x1, 0x88);
    r[parity + 4] = _mm512_shuffle_i64x2(x0, x1, 0xDD);
    r[parity + 2] = _mm512_shuffle_i64x2(y0, y1, 0x88);
    r[parity + 6] = _mm512_shuffle_i64x2(y0, y1, 0xDD);
  }
}

}  // namespace

// Re-lays columns [k0, k0 + 16*chunks) of a packed matrix as the packed matrix of its transpose: chunk c is a
// panel of 16 k-lanes whose row np holds the pairs (W[2np][k], W[2np+1][k]). Per panel, 8 consecutive 64-byte
// rows (16 k) are an 8x8 qword matrix whose qword j covers outputs 2j, 2j+1; transposing it gives one output
// row per j, and swapping the middle words of every qword, (a_k, a_k+1, b_k, b_k+1) -> (a_k, b_k, a_k+1, b_k+1),
// gives the pairs.
MOECC_AVX512BF16 void transpose_panel_columns_avx512(const uint16_t* packed, int64_t n_padded, int64_t k_padded,
                                                     int64_t k0, int64_t chunks, uint16_t* out) {
  const __m512i swap_middle = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
  const int64_t panels = n_padded / kPanelRows;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t kp0 = (k0 + 16 * c) / 2;
    uint16_t* dst = out + c * n_padded * kPanelRows;
    for (int64_t p = 0; p < panels; ++p) {
      const uint16_t* rows = packed + p * kPanelRows * k_padded + kp0 * 2 * kPanelRows;
      __m512i r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm512_loadu_si512(rows + i * 32);
      transpose_8x8_qwords(r);
      for (int j = 0; j < 8; ++j) _mm512_storeu_si512(dst + (p * 8 + j) * 32, _mm512_shuffle_epi8(r[j], swap_middle));
    }
  }
}

namespace {

// dx = dy W through the forward kernel on a transposed copy of the needed columns (kept per thread, L2-sized).
MOECC_AVX512BF16 void input_grad(const uint16_t* dy, int64_t ld_dy, int64_t tokens, const uint16_t* packed,
                                 int64_t n_padded, int64_t k_padded, int64_t k0, int64_t k1, float* dx,
                                 int64_t ld_dx) {
  thread_local AlignedBuffer<uint16_t> scratch;
  const int64_t chunks = (k1 - k0 + 15) / 16;
  uint16_t* const transposed = scratch.get(chunks * n_padded * kPanelRows);
  transpose_panel_columns_avx512(packed, n_padded, k_padded, k0, chunks, transposed);
  forward(dy, ld_dy, tokens, transposed, n_padded, 0, chunks, dx + k0, ld_dx);
}

}  // namespace

const PanelGemm& panel_gemm_avx512bf16() {
  static const PanelGemm gemm{forward, input_grad};
  return gemm;
}

}  // namespace moecc::kernels
