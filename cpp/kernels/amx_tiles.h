// The AMX tile configuration (LDTILECFG's 64-byte operand, palette 1) and the instructions that load, read back
// and release it. They are inline asm with the struct as a memory operand: GCC 12's _tile_loadconfig builtin is
// not seen as reading its operand, so the stores that fill the struct were dropped as dead and the first tile
// instruction raised #UD. An asm "m" input cannot be optimised that way by any compiler.
#pragma once

#include <cstdint>

namespace moecc::kernels {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads exactly 64 bytes");

// Call only where cpu_features() reports usable AMX tiles.
inline void load_tile_config(const TileConfig& config) { __asm__ volatile("ldtilecfg %0" : : "m"(config) : "memory"); }
inline void store_tile_config(TileConfig& config) { __asm__ volatile("sttilecfg %0" : "=m"(config) : : "memory"); }
inline void release_tiles() { __asm__ volatile("tilerelease" : : : "memory"); }

}  // namespace moecc::kernels
