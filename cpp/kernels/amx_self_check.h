// Whether the AMX kernels really work in this process, checked once before dispatch hands them out: the tile
// configuration the kernels load must read back unchanged through STTILECFG, and a small product must match the
// portable variant bit for bit. cpuid alone cannot catch a build that configures tiles wrongly (a #UD, i.e.
// SIGILL, at the first tile instruction), so dispatch trusts this check rather than the feature bits.
#pragma once

#include <array>
#include <string>

#include "amx_tiles.h"

namespace moecc::kernels {

struct AmxCheck {
  bool ran = false;  // false: the CPU or kernel offers no AMX, so nothing was executed
  bool ok = false;
  std::string reason;  // why it failed, or why it did not run; empty when ok
};

// The result for this process, computed on first use (thread-safe). Executes AMX instructions only where
// cpu_features() reports usable tiles, and the product only after the configuration read back right.
AmxCheck amx_self_check();

// Test hook: forget the cached result; the next check injects `fault` (0 none, 1 a configuration that reads back
// wrong, 2 a wrong product) into what it compares, so its failure path runs on any AMX machine.
void reset_amx_self_check(int fault);

// What the kernels load for a block of rows0 + rows1 tokens, and what STTILECFG reads back after loading it
// (panel_gemm_amx.cpp). Call only where cpu_features() reports usable AMX tiles.
std::array<TileConfig, 2> amx_config_roundtrip(int rows0, int rows1);

}  // namespace moecc::kernels
