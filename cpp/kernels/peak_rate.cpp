// Register-only matrix-unit rate micro-benchmarks (see peak_rate.h); per-ISA code behind target attributes,
// reached only after cpu_features() says the instructions may run.
#include "peak_rate.h"

#include <immintrin.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "amx_self_check.h"
#include "cpu_features.h"
#include "panel_gemm.h"
#include "weight_packing.h"

namespace moecc::kernels {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Uses the sum of a register loop's 16 accumulators, so the loop is not optimised away.
__attribute__((target("avx512f"))) void keep_accumulators(const __m512* acc) {
  float sink = 0.0f;
  for (int i = 0; i < 16; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  volatile float keep = sink;
  (void)keep;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) double avx512bf16_loop(int64_t iterations) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512i a_bits = _mm512_set1_epi32(0x3F803F80), b_bits = _mm512_set1_epi32(0x3F003F00);  // 1.0, 0.5 pairs
  const __m512bh a = reinterpret_cast<__m512bh&>(a_bits), b = reinterpret_cast<__m512bh&>(b_bits);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  const double elapsed = seconds_since(start);
  keep_accumulators(acc);
  return static_cast<double>(iterations) * 16 * 16 * 2 * 2 / elapsed;  // 16 lanes x 2 pairs-products x 2 flops
}

// fp32 FMA in 16 independent zmm accumulators: the rate the epilogues' float32 arithmetic is bound by. Beside the
// VDPBF16PS loop it tells a core whose AVX512 runs slowly from one where only VDPBF16PS does (some Xeons run
// VDPBF16PS at half the FMA rate).
__attribute__((target("avx512f"))) double avx512fma_loop(int64_t iterations) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  const double elapsed = seconds_since(start);
  keep_accumulators(acc);
  return static_cast<double>(iterations) * 16 * 16 * 2 / elapsed;  // 16 registers x 16 lanes x 2 flops
}

__attribute__((target("amx-tile,amx-bf16"))) double amx_loop(int64_t iterations) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  alignas(64) uint16_t operand[16 * 32];  // per call: threads run this loop at once
  for (auto& v : operand) v = 0x3F80;  // 1.0
  alignas(64) float result[16 * 16];
  load_tile_config(config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const double elapsed = seconds_since(start);
  _tile_stored(0, result, 64);
  release_tiles();
  volatile float keep = result[0];
  (void)keep;
  return static_cast<double>(iterations) * 4 * 16 * 16 * 32 * 2 / elapsed;  // 16x16 outputs, K = 32 per tile op
}

}  // namespace

double peak_flops_avx512bf16(int64_t iterations) {
  const CpuFeatures& cpu = cpu_features();
  if (!(cpu.avx512f && cpu.avx512vl && cpu.avx512_bf16 && cpu.os_avx512)) {
    throw std::invalid_argument("this CPU has no usable AVX512-BF16");
  }
  return avx512bf16_loop(iterations);
}

double peak_flops_avx512fma(int64_t iterations) {
  const CpuFeatures& cpu = cpu_features();
  if (!(cpu.avx512f && cpu.os_avx512)) throw std::invalid_argument("this CPU has no usable AVX512F");
  return avx512fma_loop(iterations);
}

double peak_flops_amx(int64_t iterations) {
  const CpuFeatures& cpu = cpu_features();
  if (!(cpu.amx_tile && cpu.amx_bf16 && cpu.os_amx)) {
    throw std::invalid_argument("this CPU (or kernel) offers no AMX-BF16 tiles");
  }
  if (const AmxCheck check = amx_self_check(); !check.ok) {
    throw std::invalid_argument("the AMX self-check failed on this machine: " + check.reason);
  }
  return amx_loop(iterations);
}

double panel_gemm_flops(Isa isa, int64_t tokens, int64_t n, int64_t k, int64_t reps) {
  const PanelGemm& gemm = panel_gemm(isa);
  const int64_t k_padded = padded_k(k), ldx = k_padded + 32, panels = padded_rows(n) / kPanelRows;
  // Small exactly representable values (multiples of 1/64 in [-1, 1]) so no NaN or overflow shows up.
  std::vector<uint16_t> x(static_cast<size_t>(tokens * ldx)), w(static_cast<size_t>(packed_elements(n, k)));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(static_cast<float>(static_cast<int>(i % 129) - 64) / 64);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float_to_bf16(static_cast<float>(static_cast<int>(i % 127) - 63) / 64);
  std::vector<float> out(static_cast<size_t>(tokens * panels * kPanelRows));
  gemm.forward(x.data(), ldx, tokens, w.data(), k_padded, 0, panels, out.data(), panels * kPanelRows, {});  // warm
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) {
    gemm.forward(x.data(), ldx, tokens, w.data(), k_padded, 0, panels, out.data(), panels * kPanelRows, {});
  }
  const double elapsed = seconds_since(start);
  volatile float keep = out[0];
  (void)keep;
  return 2.0 * static_cast<double>(tokens) * static_cast<double>(n) * static_cast<double>(k) * reps / elapsed;
}

}  // namespace moecc::kernels
