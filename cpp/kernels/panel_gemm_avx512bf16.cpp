// AVX512-BF16 variant of panel_gemm.h (Cooper Lake, Sapphire Rapids+, Zen 4+). Compiled for the baseline ISA
// with per-function target attributes, so the module loads everywhere and these run only after dispatch.
//
// forward: per (token block, 2 panels) 2x8 fp32 accumulators; each 64-byte panel row is one VDPBF16PS operand,
// each bf16 pair of x a 32-bit broadcast. input_grad: the 16 outputs of a panel row are the reduction lanes;
// the row's bf16 pairs split into two fp32 vectors (k even / k odd) by shift and mask.
#include <immintrin.h>

#include <algorithm>

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
                              int64_t k_padded, int64_t p0, int64_t p1, float* out, int64_t ldo, const GemmTuning&) {
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

// Panel p, 32 values of K (16 pairs): each of the panel's 16 rows gives 16 dwords (one bf16 pair each) and the
// panel wants them the other way round, 16 rows of pairs with one dword per output row: a 16 x 16 dword
// transpose, done as two 8 x 8 qword transposes (rows 0-7, rows 8-15) and a split of every qword's two
// dwords (pairs 2q and 2q+1) into output rows 2q and 2q+1. Masked loads zero rows past n and columns past k
// without touching memory there.
MOECC_AVX512BF16 void pack_rows_avx512(const uint16_t* w, int64_t n, int64_t k, int64_t p0, int64_t p1,
                                       uint16_t* dst) {
  const int64_t k_padded = padded_k(k);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t p = p0; p < p1; ++p) {
    uint16_t* panel = dst + (p - p0) * kPanelRows * k_padded;
    // The next panel's rows are one contiguous block (16 rows of W): ask for it in memory order, 16 lines per
    // step, while this panel is read 16 strided lines at a time.
    // Byte offsets, so no pointer is formed past the matrix (p + 1 < p1 keeps the next panel's rows inside it).
    int64_t next = (p + 1) * kPanelRows * k * 2;
    const int64_t next_end = p + 1 < p1 ? std::min(n, (p + 2) * kPanelRows) * k * 2 : next;
    const char* base = reinterpret_cast<const char*>(w);
    for (int64_t k0 = 0; k0 < k_padded; k0 += kKAlign) {
      for (int line = 0; line < 16 && next < next_end; ++line, next += 64) _mm_prefetch(base + next, _MM_HINT_T1);
      const __mmask32 mask = k0 + kKAlign <= k ? ~__mmask32{0} : (k0 >= k ? 0 : (__mmask32{1} << (k - k0)) - 1);
      __m512i lo[8], hi[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t row_lo = p * kPanelRows + i, row_hi = row_lo + 8;
        lo[i] = row_lo < n ? _mm512_maskz_loadu_epi16(mask, w + row_lo * k + k0) : _mm512_setzero_si512();
        hi[i] = row_hi < n ? _mm512_maskz_loadu_epi16(mask, w + row_hi * k + k0) : _mm512_setzero_si512();
      }
      transpose_8x8_qwords(lo);
      transpose_8x8_qwords(hi);
      uint16_t* rows = panel + (k0 / 2) * 2 * kPanelRows;
      for (int q = 0; q < 8; ++q) {
        _mm512_storeu_si512(rows + (2 * q) * 32, _mm512_permutex2var_epi32(lo[q], even, hi[q]));
        _mm512_storeu_si512(rows + (2 * q + 1) * 32, _mm512_permutex2var_epi32(lo[q], odd, hi[q]));
      }
    }
  }
}

// Chunk c, pair row r: the 16 pairs (W[2r][col], W[2r+1][col]) for col = k0 + 16c + i, each a dword whose low
// half is W[2r][col]. Per pair of rows and 32 columns (two chunks): two full cache lines in, a 16-bit
// interleave (per 128-bit lane) and a qword permute to put the lanes in column order, two lines out. Rows are
// the outer loop, so each row's slice is read once, contiguously.
// Each row's slice starts a new page, where the hardware prefetchers stop, so rows further down are asked for
// (GemmTuning: how many rows, and into L1 or L2).
MOECC_AVX512BF16 void pack_columns_avx512(const uint16_t* w, int64_t n, int64_t k, int64_t k0, int64_t chunks,
                                          int64_t n_tiles, uint16_t* dst, const GemmTuning& tuning) {
  const __m512i first_half = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second_half = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const int64_t chunk_stride = n_tiles * kPanelRows;
  const int64_t slice_end = std::min(k, k0 + 16 * chunks);
  const int64_t rows_ahead = tuning.pack_prefetch_rows;
  const bool to_l2 = tuning.pack_prefetch_l2;
  for (int64_t r = 0; r < n_tiles / 2; ++r) {
    const int64_t a = 2 * r, b = 2 * r + 1;
    for (int64_t ahead = a + rows_ahead; rows_ahead > 0 && ahead < std::min(n, a + rows_ahead + 2); ++ahead) {
      for (int64_t col = k0; col < slice_end; col += 32) {
        const char* line = reinterpret_cast<const char*>(w + ahead * k + col);
        to_l2 ? _mm_prefetch(line, _MM_HINT_T1) : _mm_prefetch(line, _MM_HINT_T0);
      }
    }
    for (int64_t c = 0; c < chunks; c += 2) {
      const int64_t col = k0 + 16 * c;
      const __mmask32 mask = col + 32 <= k ? ~__mmask32{0} : (col >= k ? 0 : (__mmask32{1} << (k - col)) - 1);
      const __m512i top = a < n ? _mm512_maskz_loadu_epi16(mask, w + a * k + col) : _mm512_setzero_si512();
      const __m512i bottom = b < n ? _mm512_maskz_loadu_epi16(mask, w + b * k + col) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(top, bottom), hi = _mm512_unpackhi_epi16(top, bottom);
      uint16_t* out = dst + c * chunk_stride + r * 2 * kPanelRows;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi64(lo, first_half, hi));
      if (c + 1 < chunks) _mm512_storeu_si512(out + chunk_stride, _mm512_permutex2var_epi64(lo, second_half, hi));
    }
  }
}

namespace {

MOECC_AVX512BF16 void pack_rows(const uint16_t* w, int64_t n, int64_t k, int64_t p0, int64_t p1, uint16_t* dst) {
  pack_rows_avx512(w, n, k, p0, p1, dst);
}

// The transposed panels' K is n, padded to a multiple of 32 as AMX tiles need (dy has zero columns there).
MOECC_AVX512BF16 void pack_columns(const uint16_t* w, int64_t n, int64_t k, int64_t k0, int64_t k1, uint16_t* dst,
                                   const GemmTuning& tuning) {
  pack_columns_avx512(w, n, k, k0, column_chunks(k0, k1), padded_k(n), dst, tuning);
}

MOECC_AVX512BF16 void input_grad(const uint16_t* dy, int64_t ld_dy, int64_t tokens, const uint16_t* columns,
                                 int64_t n, int64_t chunks, float* dx, int64_t ld_dx, const GemmTuning& tuning) {
  forward(dy, ld_dy, tokens, columns, padded_k(n), 0, chunks, dx, ld_dx, tuning);
}

}  // namespace

const PanelGemm& panel_gemm_avx512bf16() {
  static const PanelGemm gemm{pack_rows, forward, pack_columns, input_grad};
  return gemm;
}

}  // namespace moecc::kernels
