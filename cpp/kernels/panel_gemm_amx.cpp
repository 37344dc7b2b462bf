// AMX-BF16 variant of panel_gemm.h (Sapphire Rapids and later). Compiled for the baseline ISA with per-function
// target attributes; reached only after dispatch has seen AMX in cpuid, the tile state in XCR0 and the kernel's
// grant of tile data to this process (cpu_features.cpp).
//
// The panel layout (weight_packing.h; each task packs its weight slice into it) is the AMX B operand: 16
// consecutive 64-byte rows of a panel (32 values of K, 16 outputs, bf16 pairs) are one B tile, loaded with a
// 64-byte stride and no further re-layout. A tiles (16 tokens x 32
// K) come straight from the row-major activations. Each step holds a 2 x 2 block of C tiles (32 tokens x 32
// outputs): 4 tile loads feed 4 tile products, the most reuse 8 tile registers allow.
#include <immintrin.h>

#include <stdexcept>

#include "amx_tiles.h"
#include "panel_gemm.h"
#include "weight_fetch.h"
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

// Tuning knobs, set once before use (benchmarks sweep them through moecc._C.set_amx_tuning).
// k_block: K values per pass over a task's tokens (0: all of K in one pass). One pass keeps each 2 x 2 block's C
// tiles in registers from the first K step to the last, so they never go to memory and back; both operands then
// stream from L2. Passes of 256 hold the 32 tokens' A rows in L1 (16 KB) while the task's panels go by, but store
// and reload every C tile once per pass. On the host (16 threads, PASSIVE, Zipf, interleaved in one process, best
// of 6; 2026-11-29) one pass with token groups of 32 against passes of 256 over all tokens: forward + backward
// 78.1 vs 83.7 ms at 1024 tokens, 199 vs 225 at 4096, 370 vs 404 at 8192 (a second sweep: 77 vs 76, 191 vs
// 199, 347 vs 389). Earlier, passes of 256 had beaten 1024 (8192-token forward 131 vs 145 ms).
// k_block_input_grad: the same for the input gradients (K = the product's output width; 1536 for gate/up). One
// pass since the next-block prefetch (prefetch_next) keeps the next rows in L2: against passes of 1024 it scored
// 0.956 and 0.950 in two interleaved sweeps on the host (2026-11-29, Zipf, 256-8192 tokens).
// token_group: tokens finished over all of K before the next start (0: each pass walks all of a task's tokens).
// With passes, groups of 32 keep a block's C rows in L1 between passes (32 x 256 floats, 32 KB, for a 16-panel
// forward task or a 256-column input-gradient task); with one pass it changes nothing.
int64_t k_block = 0;
int64_t k_block_input_grad = 0;
int64_t token_group = 32;
// prefetch: K values ahead at which each A row is prefetched into L1 (0: none): the 32 rows of a step are 32
// separate streams, more than the hardware prefetchers follow. Off since prefetch_next keeps the rows in L2 (below):
// in the host's interleaved sweeps 64 with the next-block prefetch scored 1.029 of none (0.981 vs 0.952; with
// neither, 0 vs 64 had scored 1.053).
int64_t prefetch_ahead = 0;
// prefetch_b: K values ahead at which the weight tiles are prefetched (0: none). When few tokens reach an expert
// the products are bound by streaming weights from DRAM, and more requests in flight per core may help; it is a
// knob until the host has measured it.
int64_t prefetch_b_ahead = 0;
// prefetch_next: nonzero brings the next token block's A rows into L2 while the current block's products run,
// spread over its panel pairs (4 lines per K step in each pair of an 8-pair, 16-panel task). In one thread on an
// L2-resident problem the products reached 70% of the register-only peak with no A prefetch and 57% with it at
// 64 (host, 2026-11-29, a standalone micro-benchmark), so prefetching into L1 what L2 already holds costs; what
// it buys in the layer is the first pass over rows that come from L3 or DRAM, which the next-block prefetch
// covers instead. In the layer at 8192 tokens (16 threads) the products' rate per thread went from 0.38-0.41 to
// 0.41-0.49 TFLOP/s (last_product_parts), and the interleaved sweep scored it with no L1 prefetch 0.952 of the
// old setting.
int64_t prefetch_next = 1;

// out[t][j] (+)= x[t][k0:k1] . W[j][k0:k1] for TWO_A ? 32 : rows0 tokens and TWO_B ? 32 : 16 outputs; `rows`
// (the block's real token count) bounds the A prefetches, so none points past the activations.
// When `next` is set, rows stripe, stripe + stripes, ... (below next_rows) of the next block (leading dimension ldx)
// are prefetched into L2 over [k0, k1), one line per row per K step. `fetch` (or null): the thread's weight fetch,
// stepped once per K step.
template <bool TWO_A, bool TWO_B>
MOECC_AMX void block(const uint16_t* x, int64_t ldx, int rows, const uint16_t* panel0, int64_t k_padded, int64_t k0,
                     int64_t k1, bool accumulate, float* out, int64_t ldo, const uint16_t* next, int next_rows,
                     int stripe, int stripes, WeightFetch* fetch) {
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t out_stride = ldo * static_cast<int64_t>(sizeof(float));
  const uint16_t* panel1 = panel0 + kPanelRows * k_padded;
  const uint16_t* x1 = x + 16 * ldx;
  if (accumulate) {
    _tile_loadd(0, out, out_stride);
    if (TWO_B) _tile_loadd(1, out + kPanelRows, out_stride);
    if (TWO_A) _tile_loadd(2, out + 16 * ldo, out_stride);
    if (TWO_A && TWO_B) _tile_loadd(3, out + 16 * ldo + kPanelRows, out_stride);
  } else {
    _tile_zero(0);
    if (TWO_B) _tile_zero(1);
    if (TWO_A) _tile_zero(2);
    if (TWO_A && TWO_B) _tile_zero(3);
  }
  const int64_t ahead = prefetch_ahead, b_ahead = prefetch_b_ahead;
  for (int64_t k = k0; k < k1; k += kKAlign) {
    if (ahead > 0 && k + ahead < k1) {
      for (int r = 0; r < rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(x + r * ldx + k + ahead), _MM_HINT_T0);
    }
    if (b_ahead > 0 && k + b_ahead < k1) {  // one B tile is 16 cache lines, contiguous
      const char* b_line = reinterpret_cast<const char*>(panel0 + (k + b_ahead) * kPanelRows);
      for (int line = 0; line < 16; ++line) _mm_prefetch(b_line + line * 64, _MM_HINT_T0);
      if (TWO_B) {
        b_line = reinterpret_cast<const char*>(panel1 + (k + b_ahead) * kPanelRows);
        for (int line = 0; line < 16; ++line) _mm_prefetch(b_line + line * 64, _MM_HINT_T0);
      }
    }
    if (next != nullptr) {
      for (int r = stripe; r < next_rows; r += stripes) {
        _mm_prefetch(reinterpret_cast<const char*>(next + r * ldx + k), _MM_HINT_T1);
      }
    }
    if (fetch) fetch->step();
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

// One token block (TWO_A: 32 rows, else rows0) against panels [p0, p1), K in [k0, k1); `next` (or null): the
// next block's first row and its row count, its rows striped over the panel pairs for prefetch_next.
MOECC_AMX void block_row(const uint16_t* xt, int64_t ldx, int rows0, int rows1, const uint16_t* packed,
                         int64_t k_padded, int64_t p0, int64_t p1, int64_t k0, int64_t k1, float* out, int64_t ldo,
                         const uint16_t* next, int next_rows, WeightFetch* fetch) {
  const int stripes = static_cast<int>((p1 - p0 + 1) / 2);
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two_b = p + 1 < p1;
    const auto kernel = rows1 > 0 ? (two_b ? block<true, true> : block<true, false>)
                                  : (two_b ? block<false, true> : block<false, false>);
    kernel(xt, ldx, rows0 + rows1, packed + p * kPanelRows * k_padded, k_padded, k0, k1, k0 > 0,
           out + (p - p0) * kPanelRows, ldo, next, next_rows, static_cast<int>((p - p0) / 2), stripes, fetch);
  }
}

// Real row counts of the two 16-row halves of the 32-token block at t0.
inline void block_rows(int64_t tokens, int64_t t0, int& rows0, int& rows1) {
  rows0 = static_cast<int>(tokens - t0 < 16 ? tokens - t0 : 16);
  const int64_t rest = tokens - t0 - 16;
  rows1 = static_cast<int>(rest <= 0 ? 0 : (rest < 16 ? rest : 16));
}

// Loop order (token_group): 0 walks each K pass over all the task's tokens, so a 32-token block's C tiles go
// to `out` and back once per pass (the whole task's rows x width floats, in L2); > 0 finishes groups of that many
// tokens over all of K first, so a group's C rows (32 x 256 floats, 32 KB, for one block of a 16-panel task)
// stay in L1 between passes, at the cost of streaming the task's weight slice from L2 once per group instead of
// once per pass.
MOECC_AMX void forward_in_passes(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed,
                                 int64_t k_padded, int64_t p0, int64_t p1, float* out, int64_t ldo, int64_t pass,
                                 int64_t group) {
  int configured0 = -1, configured1 = -1;
  // The tile configuration is per thread and other code on this thread (oneDNN) may change it between calls,
  // so it is loaded on every call and again only when the row counts change.
  auto configure_for = [&](int rows0, int rows1) {
    if (rows0 != configured0 || rows1 != configured1) {
      configure(rows0, rows1);
      configured0 = rows0;
      configured1 = rows1;
    }
  };
  WeightFetch* const fetch = active_weight_fetch();
  const int64_t step = pass > 0 ? round_up(pass, kKAlign) : k_padded;
  const int64_t group_rows = group > 0 ? round_up(group, 32) : round_up(tokens, 32);
  for (int64_t g0 = 0; g0 < tokens; g0 += group_rows) {
    const int64_t g1 = g0 + group_rows < tokens ? g0 + group_rows : tokens;
    for (int64_t k0 = 0; k0 < k_padded; k0 += step) {
      const int64_t k1 = k0 + step < k_padded ? k0 + step : k_padded;
      for (int64_t t0 = g0; t0 < g1; t0 += 32) {
        int rows0, rows1;
        block_rows(tokens, t0, rows0, rows1);
        configure_for(rows0, rows1);
        // The rows after this block's: the next block in loop order with one K pass (the default) or with groups of
        // 32. With several passes and larger groups (or group 0) a group's last block prefetches rows that wait a
        // pass, and the first block of the next pass is not prefetched: a miss, not an error.
        const int64_t n0 = t0 + 32;
        const bool fetch_next = prefetch_next != 0 && n0 < tokens;
        const int next_rows = fetch_next ? static_cast<int>(tokens - n0 < 32 ? tokens - n0 : 32) : 0;
        block_row(x + t0 * ldx, ldx, rows0, rows1, packed, k_padded, p0, p1, k0, k1, out + t0 * ldo, ldo,
                  fetch_next ? x + n0 * ldx : nullptr, next_rows, fetch);
      }
    }
  }
}

MOECC_AMX void forward(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed, int64_t k_padded,
                       int64_t p0, int64_t p1, float* out, int64_t ldo) {
  forward_in_passes(x, ldx, tokens, packed, k_padded, p0, p1, out, ldo, k_block, token_group);
}

MOECC_AMX void forward_for_input_grad(const uint16_t* x, int64_t ldx, int64_t tokens, const uint16_t* packed,
                                      int64_t k_padded, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  forward_in_passes(x, ldx, tokens, packed, k_padded, p0, p1, out, ldo, k_block_input_grad, token_group);
}

MOECC_AMX void pack_rows(const uint16_t* w, int64_t n, int64_t k, int64_t p0, int64_t p1, uint16_t* dst) {
  pack_rows_avx512(w, n, k, p0, p1, dst);
}

MOECC_AMX void pack_columns(const uint16_t* w, int64_t n, int64_t k, int64_t k0, int64_t k1, uint16_t* dst) {
  pack_columns_avx512(w, n, k, k0, column_chunks(k0, k1), padded_k(n), dst);
}

MOECC_AMX void input_grad(const uint16_t* dy, int64_t ld_dy, int64_t tokens, const uint16_t* columns, int64_t n,
                          int64_t chunks, float* dx, int64_t ld_dx) {
  forward_for_input_grad(dy, ld_dy, tokens, columns, padded_k(n), 0, chunks, dx, ld_dx);
}

// Steps the thread's weight fetch once per K step of each 32-token block and panel pair.
int64_t fetch_steps(int64_t tokens, int64_t panels, int64_t k_padded) {
  return (tokens + 31) / 32 * ((panels + 1) / 2) * (k_padded / kKAlign);
}

}  // namespace

std::array<int64_t, 4> set_amx_tuning(int64_t k_block_values, int64_t prefetch_values, int64_t prefetch_b_values,
                                      int64_t k_block_input_grad_values) {
  const std::array<int64_t, 4> previous{k_block, prefetch_ahead, prefetch_b_ahead, k_block_input_grad};
  k_block = k_block_values;
  k_block_input_grad = k_block_input_grad_values < 0 ? k_block_values : k_block_input_grad_values;
  prefetch_ahead = prefetch_values;
  prefetch_b_ahead = prefetch_b_values;
  return previous;
}

int64_t set_amx_prefetch_next(int64_t on) {
  const int64_t previous = prefetch_next;
  prefetch_next = on;
  return previous;
}

int64_t set_amx_token_group(int64_t rows) {
  if (rows < 0 || rows > (int64_t{1} << 30)) {
    throw std::invalid_argument("AMX token group: rows must be 0 (passes over all tokens) or a positive count "
                                "(rounded up to 32), at most 2^30");
  }
  const int64_t previous = token_group;
  token_group = rows;
  return previous;
}

std::array<TileConfig, 2> amx_config_roundtrip(int rows0, int rows1) {
  std::array<TileConfig, 2> configs{tile_config(rows0, rows1), TileConfig{}};
  configure(rows0, rows1);
  store_tile_config(configs[1]);
  release_tiles();
  return configs;
}

const PanelGemm& panel_gemm_amx() {
  static const PanelGemm gemm{pack_rows, forward, pack_columns, input_grad, fetch_steps};
  return gemm;
}

}  // namespace moecc::kernels
