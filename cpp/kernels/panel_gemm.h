// Matrix products against packed expert weights (weight_packing.h), one ISA variant per source file:
// panel_gemm_portable.cpp (any x86-64 / C++ compiler) and panel_gemm_avx512bf16.cpp (AVX512-BF16).
// Kernels compute a slice of the output and never own threads; the caller splits work into tasks.
#pragma once

#include <cstdint>

namespace moecc::kernels {

enum class Isa { kPortable = 0, kAvx512Bf16 = 1, kAmx = 2 };

struct PanelGemm {
  // out[t][j] = sum_k x[t][k] * W[16*p0 + j][k] for t < tokens, panels p0 <= p < p1 (j < 16*(p1-p0)).
  // @param x      bf16 [tokens, ldx], ldx >= padded K, columns K..padded K zero.
  // @param packed one packed matrix; k_padded its padded K.
  // @param out    fp32 [tokens, ldo]; written, not accumulated.
  void (*forward)(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed, int64_t k_padded,
                  int64_t p0, int64_t p1, float* out, int64_t ldo);
  // dx[t][k] = sum_n dy[t][n] * W[n][k] for t < tokens and k0 <= k < k1; k0 a multiple of 16. Columns up to
  // the next multiple of 16 past k1 may be written too (they lie in dx's padding).
  // @param dy     bf16 [tokens, ld_dy], ld_dy >= padded_k(N) (a multiple of 32, not just of 16), columns
  //               N..padded_k(N) zero.
  // @param dx     fp32 [tokens, ld_dx], ld_dx >= padded K; written, not accumulated.
  void (*input_grad)(const uint16_t* dy, int64_t ld_dy, int64_t tokens, const uint16_t* packed, int64_t n_padded,
                     int64_t k_padded, int64_t k0, int64_t k1, float* dx, int64_t ld_dx);
};

const PanelGemm& panel_gemm_portable();
const PanelGemm& panel_gemm_avx512bf16();
const PanelGemm& panel_gemm_amx();
// AMX blocking knobs (panel_gemm_amx.cpp): K values per pass (0: all of K in one pass), A-row and weight-tile
// prefetch distances in K values (0: off). Not thread-safe against running kernels; for benchmarks.
void set_amx_tuning(int64_t k_block, int64_t prefetch_ahead, int64_t prefetch_b_ahead);

// Columns [k0, k0 + 16*chunks) of a packed [N, K] matrix re-laid as the packed matrix of their transpose
// ([16*chunks, N], chunk c = panel c), so input gradients run on a forward kernel. AVX512-BF16 CPUs only
// (every AMX CPU is one).
void transpose_panel_columns_avx512(const uint16_t* packed, int64_t n_padded, int64_t k_padded, int64_t k0,
                                    int64_t chunks, uint16_t* out);

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
