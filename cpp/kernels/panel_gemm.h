// Matrix products against packed expert weights (weight_packing.h), one ISA variant per source file:
// panel_gemm_portable.cpp (any x86-64 / C++ compiler; also the dispatcher), panel_gemm_avx512bf16.cpp
// (AVX512-BF16) and panel_gemm_amx.cpp (AMX-BF16).
// Kernels compute a slice of the output and never own threads; the caller splits work into tasks.
#pragma once

#include <cstdint>

#include "weight_packing.h"

namespace moecc::kernels {

enum class Isa { kPortable = 0, kAvx512Bf16 = 1, kAmx = 2 };

// Prefetch settings of the products, passed in with every call (the defaults are what the kernels run; benchmarks
// sweep the rest).
struct GemmTuning {
  // pack_columns_avx512 (every AVX512 and AMX input gradient): rows ahead of the one being packed that it asks
  // for (0: none, at most 4096), into L2 (else L1).
  int64_t pack_prefetch_rows = 8;
  bool pack_prefetch_l2 = true;
  // AMX: the next 32 rows' A operand is brought into L2 while the current rows' products run.
  bool amx_prefetch_next = true;
};

struct PanelGemm {
  // Packs panels [p0, p1) (output rows 16*p0 .. 16*p1) of a row-major bf16 matrix W [n, k] into `dst` in the
  // panel layout (weight_packing.h): (p1 - p0) * 16 * padded_k(k) elements, rows past n and columns past k zero.
  // The products pack the slice of the model's own weights they need into per-thread scratch, so no packed
  // copy of the experts is kept.
  void (*pack_rows)(const uint16_t* w, int64_t n, int64_t k, int64_t p0, int64_t p1, uint16_t* dst);
  // out[t][j] = sum_k x[t][k] * W[16*p0 + j][k] for t < tokens, panels p0 <= p < p1 (j < 16*(p1-p0)).
  // @param x      bf16 [tokens, ldx], ldx >= padded K, columns K..padded K zero.
  // @param packed panels in the layout pack_rows writes; k_padded their padded K.
  // @param out    fp32 [tokens, ldo]; written, not accumulated.
  void (*forward)(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed, int64_t k_padded,
                  int64_t p0, int64_t p1, float* out, int64_t ldo, const GemmTuning& tuning);
  // Lays columns [k0, k1) of a row-major bf16 W [n, k] out as the panels of its transpose (output j = column
  // k0 + j, K = the n rows, padded to padded_k(n)) into `dst`: column_panel_elements(n, k0, k1) elements, rows
  // past n and columns past k zero. Input-gradient tasks pack once and run input_grad on row blocks.
  void (*pack_columns)(const uint16_t* w, int64_t n, int64_t k, int64_t k0, int64_t k1, uint16_t* dst,
                       const GemmTuning& tuning);
  // dx[t][j] = sum_r dy[t][r] * W[r][k0 + j] for t < tokens, j < 16 * chunks, from pack_columns' panels of W's
  // columns [k0, k1) (chunks = (k1 - k0 + 15) / 16); columns past k1 - k0 of dx hold zeros or padding.
  // @param dy     bf16 [tokens, ld_dy], ld_dy >= padded_k(n) (a multiple of 32, not just of 16), columns
  //               n..padded_k(n) zero.
  // @param dx     fp32 [tokens, ld_dx], ld_dx >= 16 * chunks; written, not accumulated.
  void (*input_grad)(const uint16_t* dy, int64_t ld_dy, int64_t tokens, const uint16_t* columns, int64_t n,
                     int64_t chunks, float* dx, int64_t ld_dx, const GemmTuning& tuning);
};

const PanelGemm& panel_gemm_portable();
const PanelGemm& panel_gemm_avx512bf16();
const PanelGemm& panel_gemm_amx();

// The AVX512 packing routines, shared with the AMX variant (every AMX CPU has AVX512-BF16):
// pack_rows_avx512 is PanelGemm::pack_rows; pack_columns_avx512 lays columns [k0, k0 + 16*chunks) of a
// row-major W [n, k] out as panels of its transpose (chunk c: n_tiles/2 rows of the 16 pairs
// (W[2r][col], W[2r+1][col]), rows past n zero, n_tiles a multiple of 32 >= n), so input gradients run on a
// forward kernel.
void pack_rows_avx512(const uint16_t* w, int64_t n, int64_t k, int64_t p0, int64_t p1, uint16_t* dst);
void pack_columns_avx512(const uint16_t* w, int64_t n, int64_t k, int64_t k0, int64_t chunks, int64_t n_tiles,
                         uint16_t* dst, const GemmTuning& tuning);

// The 16-column chunks (panels) pack_columns lays out for columns [k0, k1), and the elements it writes for a
// matrix with n rows.
inline int64_t column_chunks(int64_t k0, int64_t k1) { return (k1 - k0 + kPanelRows - 1) / kPanelRows; }
inline int64_t column_panel_elements(int64_t n, int64_t k0, int64_t k1) {
  return column_chunks(k0, k1) * kPanelRows * padded_k(n);
}

// The variant for `isa`; throws std::invalid_argument if this build or CPU cannot run it.
const PanelGemm& panel_gemm(Isa isa);

// bf16 <-> fp32 helpers shared by all variants (round to nearest even, NaN kept quiet).
inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  __builtin_memcpy(&value, &widened, sizeof(value));
  return value;
}
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);  // a select: vectorises
}

}  // namespace moecc::kernels
