// Portable variant of panel_gemm.h: plain C++ over the packed layout, for CPUs without AVX512-BF16, and the
// reference the vector variants are tested against. Also the dispatcher.
#include <algorithm>
#include <stdexcept>

#include "amx_self_check.h"
#include "cpu_features.h"
#include "panel_gemm.h"
#include "weight_packing.h"

namespace moecc::kernels {
namespace {

void forward(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed, int64_t k_padded, int64_t p0,
             int64_t p1, float* out, int64_t ldo, const GemmTuning&) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = packed + p * kPanelRows * k_padded;
      float acc[kPanelRows] = {};
      for (int64_t kp = 0; kp < k_padded / 2; ++kp) {
        const float x0 = bf16_to_float(x[t * ldx + 2 * kp]), x1 = bf16_to_float(x[t * ldx + 2 * kp + 1]);
        const uint16_t* row = panel + kp * 2 * kPanelRows;
        for (int64_t i = 0; i < kPanelRows; ++i) {
          acc[i] += x0 * bf16_to_float(row[2 * i]) + x1 * bf16_to_float(row[2 * i + 1]);
        }
      }
      for (int64_t i = 0; i < kPanelRows; ++i) out[t * ldo + (p - p0) * kPanelRows + i] = acc[i];
    }
  }
}

void pack_rows(const uint16_t* w, int64_t n, int64_t k, int64_t p0, int64_t p1, uint16_t* dst) {
  const int64_t k_padded = padded_k(k);
  std::fill(dst, dst + (p1 - p0) * kPanelRows * k_padded, uint16_t{0});
  for (int64_t row = p0 * kPanelRows; row < std::min(n, p1 * kPanelRows); ++row) {
    for (int64_t col = 0; col < k; ++col) {
      dst[packed_offset(row - p0 * kPanelRows, col, k_padded)] = w[row * k + col];
    }
  }
}

// The panels of W's transpose, element by element: what pack_columns_avx512 writes with vector shuffles.
void pack_columns(const uint16_t* w, int64_t n, int64_t k, int64_t k0, int64_t k1, uint16_t* dst, const GemmTuning&) {
  const int64_t n_tiles = padded_k(n);
  std::fill(dst, dst + column_panel_elements(n, k0, k1), uint16_t{0});
  for (int64_t col = k0; col < std::min(k1, k); ++col) {
    for (int64_t row = 0; row < n; ++row) dst[packed_offset(col - k0, row, n_tiles)] = w[row * k + col];
  }
}

void input_grad(const uint16_t* dy, int64_t ld_dy, int64_t tokens, const uint16_t* columns, int64_t n,
                int64_t chunks, float* dx, int64_t ld_dx, const GemmTuning& tuning) {
  forward(dy, ld_dy, tokens, columns, padded_k(n), 0, chunks, dx, ld_dx, tuning);
}

}  // namespace

const PanelGemm& panel_gemm_portable() {
  static const PanelGemm gemm{pack_rows, forward, pack_columns, input_grad};
  return gemm;
}

const PanelGemm& panel_gemm(Isa isa) {
  const CpuFeatures& cpu = cpu_features();
  switch (isa) {
    case Isa::kPortable:
      return panel_gemm_portable();
    case Isa::kAvx512Bf16:
      if (!(cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.avx512_bf16 && cpu.os_avx512)) {
        throw std::invalid_argument("this CPU cannot run the AVX512-BF16 kernels (needs AVX512F/BW and AVX512_BF16: "
                                    "Intel Cooper Lake, Sapphire Rapids or later, AMD Zen 4 or later)");
      }
      return panel_gemm_avx512bf16();
    case Isa::kAmx:
      if (!(cpu.amx_tile && cpu.amx_bf16 && cpu.os_amx)) {
        throw std::invalid_argument("this CPU (or its kernel) offers no AMX-BF16 tiles (needs Intel Sapphire Rapids or "
                                    "later and Linux 5.16+); use MOECC_ISA=avx512_bf16 or portable");
      }
      if (!(cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.avx512_bf16 && cpu.os_avx512)) {
        throw std::invalid_argument("the AMX expert kernels also need AVX512-BF16, which this CPU lacks");
      }
      if (const AmxCheck check = amx_self_check(); !check.ok) {
        throw std::invalid_argument("the AMX self-check failed on this machine: " + check.reason +
                                    "; use MOECC_ISA=avx512_bf16 (or isa='auto', which falls back by itself)");
      }
      return panel_gemm_amx();
  }
  throw std::invalid_argument("unknown ISA");
}

}  // namespace moecc::kernels
