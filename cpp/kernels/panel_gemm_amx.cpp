// AMX-BF16 variant of panel_gemm.h (Sapphire Rapids and later). Compiled for the baseline ISA with per-function
// target attributes; reached only after dispatch has seen AMX in cpuid, the tile state in XCR0, the kernel's
// grant of tile data to this process (cpu_features.cpp) and a passing self-check (amx_self_check.h).
//
// The panel layout (weight_packing.h; each task packs its weight slice into it) is the AMX B operand: 16
// consecutive 64-byte rows of a panel (32 values of K, 16 outputs, bf16 pairs) are one B tile, loaded with a
// 64-byte stride and no further re-layout. A tiles (16 tokens x 32 K) come straight from the row-major
// activations. Each step holds a 2 x 2 block of C tiles (32 tokens x 32 outputs): 4 tile loads feed 4 tile
// products, the most reuse 8 tile registers allow. All of K runs in one pass, so the C tiles stay in registers
// from the first K step to the last (passes over K were slower: each pass stores and reloads the C tiles).
#include <immintrin.h>

#include "amx_self_check.h"
#include "amx_tiles.h"
#include "panel_gemm.h"
#include "weight_packing.h"

#define MOECC_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace moecc::kernels {
namespace {

// Tiles 0-3: C (a, b) = (0,0) (0,1) (1,0) (1,1); 4, 5: A rows 0-15 and 16-31; 6, 7: B panels 0 and 1.
// A-side tiles take the block's real row counts, so short blocks never read past the activations.
TileConfig tile_config(int rows0, int rows1) {
  TileConfig config;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows[t]);
    config.colsb[t] = rows[t] ? 64 : 0;  // a tile of 0 rows stays unconfigured and is never touched
  }
  return config;
}

void configure(int rows0, int rows1) { load_tile_config(tile_config(rows0, rows1)); }

// out[t][j] = x[t][0:k_padded] . W[j][0:k_padded] for TWO_A ? 32 : rows0 tokens and TWO_B ? 32 : 16 outputs.
// When `next` is set, rows stripe, stripe + stripes, ... (below next_rows) of the next block (leading dimension
// ldx) are prefetched into L2, one line per row per K step: the next block's first K steps then find A in L2
// rather than L3 or DRAM, which the hardware prefetchers do not cover for 32 separate row streams.
template <bool TWO_A, bool TWO_B>
MOECC_AMX void block(const uint16_t* x, int64_t ldx, const uint16_t* panel0, int64_t k_padded, float* out,
                     int64_t ldo, const uint16_t* next, int next_rows, int stripe, int stripes) {
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t out_stride = ldo * static_cast<int64_t>(sizeof(float));
  const uint16_t* panel1 = panel0 + kPanelRows * k_padded;
  const uint16_t* x1 = x + 16 * ldx;
  _tile_zero(0);
  if (TWO_B) _tile_zero(1);
  if (TWO_A) _tile_zero(2);
  if (TWO_A && TWO_B) _tile_zero(3);
  for (int64_t k = 0; k < k_padded; k += kKAlign) {
    if (next != nullptr) {
      for (int r = stripe; r < next_rows; r += stripes) {
        _mm_prefetch(reinterpret_cast<const char*>(next + r * ldx + k), _MM_HINT_T1);
      }
    }
    const int64_t b_offset = k * kPanelRows;  // 16 pair rows of 32 bf16 per 32 values of K
    _tile_loadd(4, x + k, x_stride);
    _tile_loadd(6, panel0 + b_offset, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO_B) {
      _tile_loadd(7, panel1 + b_offset, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (TWO_A) {
      _tile_loadd(5, x1 + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (TWO_B) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, out_stride);
  if (TWO_B) _tile_stored(1, out + kPanelRows, out_stride);
  if (TWO_A) _tile_stored(2, out + 16 * ldo, out_stride);
  if (TWO_A && TWO_B) _tile_stored(3, out + 16 * ldo + kPanelRows, out_stride);
}

// One token block (rows1 > 0: 32 rows, else rows0) against panels [p0, p1); `next` (or null): the next block's
// first row and its row count, its rows striped over the panel pairs.
MOECC_AMX void block_row(const uint16_t* xt, int64_t ldx, int rows1, const uint16_t* packed, int64_t k_padded,
                         int64_t p0, int64_t p1, float* out, int64_t ldo, const uint16_t* next, int next_rows) {
  const int stripes = static_cast<int>((p1 - p0 + 1) / 2);
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two_b = p + 1 < p1;
    const auto kernel = rows1 > 0 ? (two_b ? block<true, true> : block<true, false>)
                                  : (two_b ? block<false, true> : block<false, false>);
    kernel(xt, ldx, packed + p * kPanelRows * k_padded, k_padded, out + (p - p0) * kPanelRows, ldo, next, next_rows,
           static_cast<int>((p - p0) / 2), stripes);
  }
}

// Real row counts of the two 16-row halves of the 32-token block at t0.
inline void block_rows(int64_t tokens, int64_t t0, int& rows0, int& rows1) {
  rows0 = static_cast<int>(tokens - t0 < 16 ? tokens - t0 : 16);
  const int64_t rest = tokens - t0 - 16;
  rows1 = static_cast<int>(rest <= 0 ? 0 : (rest < 16 ? rest : 16));
}

MOECC_AMX void forward(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed, int64_t k_padded,
                       int64_t p0, int64_t p1, float* out, int64_t ldo, const GemmTuning& tuning) {
  // The tile configuration is per thread and other code on this thread (oneDNN) may change it between calls,
  // so it is loaded on every call and again only when the row counts change.
  int configured0 = -1, configured1 = -1;
  for (int64_t t0 = 0; t0 < tokens; t0 += 32) {
    int rows0, rows1;
    block_rows(tokens, t0, rows0, rows1);
    if (rows0 != configured0 || rows1 != configured1) {
      configure(rows0, rows1);
      configured0 = rows0;
      configured1 = rows1;
    }
    const int64_t n0 = t0 + 32;
    const bool fetch_next = tuning.amx_prefetch_next && n0 < tokens;
    const int next_rows = fetch_next ? static_cast<int>(tokens - n0 < 32 ? tokens - n0 : 32) : 0;
    block_row(x + t0 * ldx, ldx, rows1, packed, k_padded, p0, p1, out + t0 * ldo, ldo,
              fetch_next ? x + n0 * ldx : nullptr, next_rows);
  }
}

MOECC_AMX void pack_rows(const uint16_t* w, int64_t n, int64_t k, int64_t p0, int64_t p1, uint16_t* dst) {
  pack_rows_avx512(w, n, k, p0, p1, dst);
}

MOECC_AMX void pack_columns(const uint16_t* w, int64_t n, int64_t k, int64_t k0, int64_t k1, uint16_t* dst,
                            const GemmTuning& tuning) {
  pack_columns_avx512(w, n, k, k0, column_chunks(k0, k1), padded_k(n), dst, tuning);
}

MOECC_AMX void input_grad(const uint16_t* dy, int64_t ld_dy, int64_t tokens, const uint16_t* columns, int64_t n,
                          int64_t chunks, float* dx, int64_t ld_dx, const GemmTuning& tuning) {
  forward(dy, ld_dy, tokens, columns, padded_k(n), 0, chunks, dx, ld_dx, tuning);
}

}  // namespace

std::array<TileConfig, 2> amx_config_roundtrip(int rows0, int rows1) {
  std::array<TileConfig, 2> configs{tile_config(rows0, rows1), TileConfig{}};
  configure(rows0, rows1);
  store_tile_config(configs[1]);
  release_tiles();
  return configs;
}

const PanelGemm& panel_gemm_amx() {
  static const PanelGemm gemm{pack_rows, forward, pack_columns, input_grad};
  return gemm;
}

}  // namespace moecc::kernels
