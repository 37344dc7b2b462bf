// The AMX self-check of amx_self_check.h: configuration readback, then one small product against the portable
// variant on values whose products and sums are exact in fp32, so any difference is a fault, not rounding.
#include "amx_self_check.h"

#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include "cpu_features.h"
#include "panel_gemm.h"
#include "weight_packing.h"

namespace moecc::kernels {
namespace {

std::mutex check_mutex;
std::optional<AmxCheck> cached;
int injected_fault = 0;

std::string describe(const TileConfig& config) {
  std::string text = "palette " + std::to_string(config.palette) + ", rows/colsb";
  for (int t = 0; t < 8; ++t) {
    text += " " + std::to_string(config.rows[t]) + "/" + std::to_string(config.colsb[t]);
  }
  return text;
}

// Both row counts of a ragged 21-token block (16 + 5) and of a full 32-token one.
std::string check_readback(int fault) {
  for (const auto& rows : {std::array<int, 2>{16, 5}, std::array<int, 2>{16, 16}}) {
    std::array<TileConfig, 2> configs = amx_config_roundtrip(rows[0], rows[1]);
    if (fault == 1) configs[1].rows[0] ^= 1;
    if (std::memcmp(&configs[0], &configs[1], sizeof(TileConfig)) != 0) {
      return "the tile configuration read back wrong (loaded " + describe(configs[0]) + "; read back " +
             describe(configs[1]) + "): this build's compiler dropped or reordered the configuration";
    }
  }
  return {};
}

// 21 tokens (a ragged second A tile) x 40 outputs (an odd panel count) x K = 96, values multiples of 1/8 in [-1, 1].
std::string check_product(int fault) {
  constexpr int64_t tokens = 21, n = 40, k = 96;
  const int64_t k_padded = padded_k(k), panels = padded_rows(n) / kPanelRows, width = panels * kPanelRows;
  std::vector<uint16_t> x(tokens * k_padded), w(n * k), packed_amx(packed_elements(n, k)), packed_ref(packed_amx.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(static_cast<float>(static_cast<int>(i * 7 % 17) - 8) / 8);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float_to_bf16(static_cast<float>(static_cast<int>(i * 5 % 13) - 6) / 8);
  std::vector<float> out_amx(tokens * width, -1.0f), out_ref(tokens * width, -2.0f);
  const PanelGemm &amx = panel_gemm_amx(), &portable = panel_gemm_portable();
  amx.pack_rows(w.data(), n, k, 0, panels, packed_amx.data());
  portable.pack_rows(w.data(), n, k, 0, panels, packed_ref.data());
  amx.forward(x.data(), k_padded, tokens, packed_amx.data(), k_padded, 0, panels, out_amx.data(), width, {});
  portable.forward(x.data(), k_padded, tokens, packed_ref.data(), k_padded, 0, panels, out_ref.data(), width,
                   {});
  if (fault == 2) out_amx[5] += 1.0f;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < n; ++j) {
      if (out_amx[t * width + j] != out_ref[t * width + j]) {
        return "a 21 x 40 x 96 tile product differs from the portable kernels at token " + std::to_string(t) +
               ", output " + std::to_string(j) + " (" + std::to_string(out_amx[t * width + j]) + " vs " +
               std::to_string(out_ref[t * width + j]) + ")";
      }
    }
  }
  return {};
}

AmxCheck run_check(int fault) {
  AmxCheck check;
  const CpuFeatures& cpu = cpu_features();
  if (!(cpu.amx_tile && cpu.amx_bf16 && cpu.os_amx)) {
    check.reason = "this CPU (or its kernel) offers no AMX-BF16 tiles";
    return check;
  }
  if (!(cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.avx512_bf16 && cpu.os_avx512)) {
    check.reason = "the AMX kernels also need AVX512-BF16, which this CPU lacks";
    return check;
  }
  check.ran = true;
  check.reason = check_readback(fault);
  if (check.reason.empty()) check.reason = check_product(fault);
  check.ok = check.reason.empty();
  return check;
}

}  // namespace

AmxCheck amx_self_check() {
  std::lock_guard<std::mutex> lock(check_mutex);
  if (!cached) cached = run_check(injected_fault);
  return *cached;
}

void reset_amx_self_check(int fault) {
  std::lock_guard<std::mutex> lock(check_mutex);
  cached.reset();
  injected_fault = fault;
}

}  // namespace moecc::kernels
