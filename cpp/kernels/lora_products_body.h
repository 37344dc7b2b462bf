// The generic body of the rank-r LoRA products (lora_products.h) in 16-lane vectors (vector16.h), and the table of
// entry points each build of it exports. Built once per ISA, each translation unit with its own flags (setup.py):
// lora_products.cpp for the baseline ISA (the vectors split into SSE registers), isa/lora_products_avx512.cpp
// (one zmm register a vector) and isa/lora_products_avx512bf16.cpp (bf16 outputs rounded by VCVTNEPS2BF16).
// Everything here has internal linkage, so no build's copy of a function can stand in for another's at link time.
// Ranks are taken in groups of up to 8 so the accumulators stay in registers whatever r is.
#pragma once

#include <cstdint>

#include "panel_gemm.h"  // float_to_bf16
#include "vector16.h"

namespace moecc::kernels {

// One build's entry points; the dispatcher (lora_products.cpp) picks a build once. Rows of count <= kCombineRows.
struct LoraKernels {
  void (*dots_rows_f32)(const float* rows, int64_t rows_ld, const float* factors, int64_t ld, int64_t rank,
                        int64_t n, float scale, float* out, int64_t out_ld, int count);
  void (*dots_rows_bf16)(const uint16_t* rows, int64_t rows_ld, const float* factors, int64_t ld, int64_t rank,
                         int64_t n, float scale, float* out, int64_t out_ld, int count);
  void (*combine_rows_f32)(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld,
                           int64_t rank, int64_t n, float* rows, int64_t rows_ld, int count);
  void (*combine_rows_bf16)(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld,
                            int64_t rank, int64_t n, const float* rows, int64_t rows_ld, uint16_t* const* outs,
                            int count, bool stream);
  void (*dots_bf16)(const uint16_t* row, const float* factors, int64_t ld, int64_t rank, int64_t n, float scale,
                    float* out);
  void (*dots_f32)(const float* row, const float* factors, int64_t ld, int64_t rank, int64_t n, float scale,
                   float* out);
  void (*outer_bf16)(const float* coef, const float* row_scale, float scale, const uint16_t* rows, int64_t ld,
                     int64_t count, int64_t rank, int64_t c0, int64_t c1, float* out, int64_t out_ld);
  void (*outer_bf16_gathered)(const float* coef, const float* row_scale, float scale, const uint16_t* rows,
                              int64_t ld, const int64_t* order, int64_t divisor, int64_t count, int64_t rank,
                              int64_t c0, int64_t c1, float* out, int64_t out_ld);
};

const LoraKernels& lora_products_baseline();  // lora_products.cpp
const LoraKernels& lora_products_avx512();    // isa/lora_products_avx512.cpp
// combine_rows_bf16 rounding with AVX512-BF16's instruction (isa/lora_products_avx512bf16.cpp).
decltype(LoraKernels::combine_rows_bf16) lora_combine_bf16_rows_avx512bf16();

constexpr int kCombineRows = 4;

namespace {

using namespace v16;

constexpr int kGroup = 8;

MOECC_INLINE void put(float* p, float v) { *p = v; }
MOECC_INLINE void put(uint16_t* p, float v) { *p = float_to_bf16(v); }
MOECC_INLINE float widen(float v) { return v; }
MOECC_INLINE float widen(uint16_t bits) { return bf16_to_float(bits); }

// Rows in chunks of kRowChunk, and within a chunk columns in steps of 2 x 16 (2G accumulators), then 16, then
// one at a time. A chunk's factors are computed once, and its rows (at most 32 x 256 bf16 = 16 KB for the
// 256-column tasks of expert_ffn_backward.cpp) stay in L1 while every column step reads them; the next chunk's rows are
// prefetched meanwhile. Walking all of an expert's rows per column step instead (the first version) touched one
// cache line per row at the row stride, which the hardware prefetchers do not follow, and recomputed each factor
// once per column step.
constexpr int64_t kRowChunk = 32;

template <int G, typename Rows>
MOECC_INLINE void outer_group(const float* coef, int64_t rank, const float* row_scale, float scale, const Rows& rows,
                              int64_t count, int64_t c0, int64_t c1, float* out, int64_t out_ld) {
  float factors[kRowChunk * G];
  for (int64_t g0 = 0; g0 < count; g0 += kRowChunk) {
    const int64_t n = count - g0 < kRowChunk ? count - g0 : kRowChunk;
    for (int64_t g = 0; g < n; ++g) {
      const float row_factor = scale * (row_scale ? row_scale[g0 + g] : 1.0f);
      for (int j = 0; j < G; ++j) factors[g * G + j] = coef[(g0 + g) * rank + j] * row_factor;
    }
    // The next chunk's rows, each line of them asked for beside the same line of this chunk's row: spread over
    // the column steps, where asking for all of a chunk at once (256 lines) stalled on the core's few line-fill
    // buffers. Columns past the first 2 x 16-column steps are not prefetched (short tails).
    const int64_t next_rows = count - g0 - n < kRowChunk ? count - g0 - n : kRowChunk;
    int64_t c = c0;
    for (; c + 2 * kLanes <= c1; c += 2 * kLanes) {
      vf lo[G], hi[G];
      for (int j = 0; j < G; ++j) {
        lo[j] = load16(out + j * out_ld + c);
        hi[j] = load16(out + j * out_ld + c + kLanes);
      }
      for (int64_t g = 0; g < n; ++g) {
        if (g < next_rows) __builtin_prefetch(rows(g0 + n + g) + c);
        const uint16_t* row = rows(g0 + g);
        const vf x0 = load16(row + c), x1 = load16(row + c + kLanes);
        for (int j = 0; j < G; ++j) {
          const float f = factors[g * G + j];
          lo[j] += f * x0;
          hi[j] += f * x1;
        }
      }
      for (int j = 0; j < G; ++j) {
        store16(out + j * out_ld + c, lo[j]);
        store16(out + j * out_ld + c + kLanes, hi[j]);
      }
    }
    for (; c + kLanes <= c1; c += kLanes) {
      vf acc[G];
      for (int j = 0; j < G; ++j) acc[j] = load16(out + j * out_ld + c);
      for (int64_t g = 0; g < n; ++g) {
        const vf x = load16(rows(g0 + g) + c);
        for (int j = 0; j < G; ++j) acc[j] += factors[g * G + j] * x;
      }
      for (int j = 0; j < G; ++j) store16(out + j * out_ld + c, acc[j]);
    }
    for (; c < c1; ++c) {
      for (int j = 0; j < G; ++j) {
        float sum = 0.0f;
        for (int64_t g = 0; g < n; ++g) sum += factors[g * G + j] * widen(rows(g0 + g)[c]);
        out[j * out_ld + c] += sum;
      }
    }
  }
}

template <typename Rows>
MOECC_INLINE void outer(const float* coef, const float* row_scale, float scale, const Rows& rows, int64_t count,
                        int64_t rank, int64_t c0, int64_t c1, float* out, int64_t out_ld) {
  for (int64_t j0 = 0; j0 < rank; j0 += kGroup) {
    const float* k = coef + j0;
    float* o = out + j0 * out_ld;
    switch (rank - j0 < kGroup ? rank - j0 : kGroup) {
      case 8: outer_group<8>(k, rank, row_scale, scale, rows, count, c0, c1, o, out_ld); break;
      case 7: outer_group<7>(k, rank, row_scale, scale, rows, count, c0, c1, o, out_ld); break;
      case 6: outer_group<6>(k, rank, row_scale, scale, rows, count, c0, c1, o, out_ld); break;
      case 5: outer_group<5>(k, rank, row_scale, scale, rows, count, c0, c1, o, out_ld); break;
      case 4: outer_group<4>(k, rank, row_scale, scale, rows, count, c0, c1, o, out_ld); break;
      case 3: outer_group<3>(k, rank, row_scale, scale, rows, count, c0, c1, o, out_ld); break;
      case 2: outer_group<2>(k, rank, row_scale, scale, rows, count, c0, c1, o, out_ld); break;
      default: outer_group<1>(k, rank, row_scale, scale, rows, count, c0, c1, o, out_ld); break;
    }
  }
}

// outs[r][c] = rows[r][c] + sum_j (scale * coef[r][j]) * factors[j * ld + c] for R rows at once (row r's
// coefficients at coef + r * coef_ld, its row at rows + r * rows_ld): each factor vector loaded once for the R rows.
// Out float (an output may be its row) or bf16 bits (rounded by Bf16 in whole vectors; the last n % 16 columns by
// float_to_bf16, which differs only on float32 denormals). kStream (bf16 out, 16-byte aligned): whole vectors leave
// with non-temporal stores.
template <typename Bf16, typename Out, bool kStream, int R>
MOECC_INLINE void combine_rows(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld,
                               int64_t rank, int64_t n, const float* rows, int64_t rows_ld, Out* const* outs) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = load16(rows + r * rows_ld + c);
    for (int64_t j = 0; j < rank; ++j) {
      const vf f = load16(factors + j * ld + c);
      for (int r = 0; r < R; ++r) acc[r] += (scale * coef[r * coef_ld + j]) * f;
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (sizeof(Out) == sizeof(float)) {
        store16(outs[r] + c, acc[r]);
      } else {
        put16<Bf16, kStream>(outs[r] + c, acc[r]);
      }
    }
  }
  for (; c < n; ++c) {
    for (int r = 0; r < R; ++r) {
      float acc = rows[r * rows_ld + c];
      for (int64_t j = 0; j < rank; ++j) acc += (scale * coef[r * coef_ld + j]) * factors[j * ld + c];
      put(outs[r] + c, acc);
    }
  }
}

// dots for R rows and G ranks at once (row r at rows + r * rows_ld, its dots at out + r * out_ld): each factor
// vector loaded once for the R rows. Each (row, rank) sum runs over the columns in order in 16 lanes, a tree lane
// sum, then the scalar tail, whatever the grouping of rows and ranks (lora_products.h says where the bits may still
// differ between groupings).
template <int R, int G, typename T>
MOECC_INLINE void dots_rows_group(const T* rows, int64_t rows_ld, const float* factors, int64_t ld, int64_t n,
                                  float scale, float* out, int64_t out_ld) {
  vf acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) acc[r][j] = vf{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vf x[R];
    for (int r = 0; r < R; ++r) x[r] = load16(rows + r * rows_ld + i);
    for (int j = 0; j < G; ++j) {
      const vf f = load16(factors + j * ld + i);
      for (int r = 0; r < R; ++r) acc[r][j] += x[r] * f;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < G; ++j) {
      float s = lane_sum(acc[r][j]);
      for (int64_t t = i; t < n; ++t) s += widen(rows[r * rows_ld + t]) * factors[j * ld + t];
      out[r * out_ld + j] = scale * s;
    }
  }
}

// Ranks in groups of kRanks: R x kRanks accumulators, 16 registers for 4 rows, 8 for one row (whose row vector is
// then loaded once for 8 ranks).
template <int R, typename T>
MOECC_INLINE void dots_rows(const T* rows, int64_t rows_ld, const float* factors, int64_t ld, int64_t rank,
                            int64_t n, float scale, float* out, int64_t out_ld) {
  constexpr int kRanks = R == 1 ? kGroup : 4;
  for (int64_t j0 = 0; j0 < rank; j0 += kRanks) {
    const float* f = factors + j0 * ld;
    float* o = out + j0;
    switch (rank - j0 < kRanks ? rank - j0 : kRanks) {
      case 8: if constexpr (kRanks >= 8) dots_rows_group<R, 8>(rows, rows_ld, f, ld, n, scale, o, out_ld); break;
      case 7: if constexpr (kRanks >= 7) dots_rows_group<R, 7>(rows, rows_ld, f, ld, n, scale, o, out_ld); break;
      case 6: if constexpr (kRanks >= 6) dots_rows_group<R, 6>(rows, rows_ld, f, ld, n, scale, o, out_ld); break;
      case 5: if constexpr (kRanks >= 5) dots_rows_group<R, 5>(rows, rows_ld, f, ld, n, scale, o, out_ld); break;
      case 4: dots_rows_group<R, 4>(rows, rows_ld, f, ld, n, scale, o, out_ld); break;
      case 3: dots_rows_group<R, 3>(rows, rows_ld, f, ld, n, scale, o, out_ld); break;
      case 2: dots_rows_group<R, 2>(rows, rows_ld, f, ld, n, scale, o, out_ld); break;
      default: dots_rows_group<R, 1>(rows, rows_ld, f, ld, n, scale, o, out_ld); break;
    }
  }
}

// One row of dots_rows.
template <typename T>
MOECC_INLINE void dots(const T* row, const float* factors, int64_t ld, int64_t rank, int64_t n, float scale,
                       float* out) {
  dots_rows<1>(row, 0, factors, ld, rank, n, scale, out, 0);
}

template <typename T>
MOECC_INLINE void dots_rows_any(const T* rows, int64_t rows_ld, const float* factors, int64_t ld, int64_t rank,
                                int64_t n, float scale, float* out, int64_t out_ld, int count) {
  switch (count) {
    case 4: return dots_rows<4>(rows, rows_ld, factors, ld, rank, n, scale, out, out_ld);
    case 3: return dots_rows<3>(rows, rows_ld, factors, ld, rank, n, scale, out, out_ld);
    case 2: return dots_rows<2>(rows, rows_ld, factors, ld, rank, n, scale, out, out_ld);
    default: return dots_rows<1>(rows, rows_ld, factors, ld, rank, n, scale, out, out_ld);
  }
}

// combine_rows for count <= kCombineRows rows, R picked at run time.
template <typename Bf16, typename Out, bool kStream>
MOECC_INLINE void combine_rows_any(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld,
                                   int64_t rank, int64_t n, const float* rows, int64_t rows_ld, Out* const* outs,
                                   int count) {
  // Calls, not pointers to the always-inline instances: those must be inlined into their targeted callers.
  switch (count) {
    case 4: return combine_rows<Bf16, Out, kStream, 4>(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld, outs);
    case 3: return combine_rows<Bf16, Out, kStream, 3>(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld, outs);
    case 2: return combine_rows<Bf16, Out, kStream, 2>(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld, outs);
    default: return combine_rows<Bf16, Out, kStream, 1>(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld,
                                                        outs);
  }
}

// The entry points, for Bf16 rounding: a build instantiates (and so compiles, with its flags) only those it takes.
template <typename Bf16>
struct LoraBuild {
  static void dots_rows_f32(const float* rows, int64_t rows_ld, const float* factors, int64_t ld, int64_t rank,
                            int64_t n, float scale, float* out, int64_t out_ld, int count) {
    dots_rows_any(rows, rows_ld, factors, ld, rank, n, scale, out, out_ld, count);
  }
  static void dots_rows_bf16(const uint16_t* rows, int64_t rows_ld, const float* factors, int64_t ld, int64_t rank,
                             int64_t n, float scale, float* out, int64_t out_ld, int count) {
    dots_rows_any(rows, rows_ld, factors, ld, rank, n, scale, out, out_ld, count);
  }
  // combine_rows in place on float rows.
  static void combine_rows_f32(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld,
                               int64_t rank, int64_t n, float* rows, int64_t rows_ld, int count) {
    float* outs[kCombineRows];
    for (int r = 0; r < count; ++r) outs[r] = rows + r * rows_ld;
    combine_rows_any<Bf16, float, false>(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld, outs, count);
  }
  static void combine_rows_bf16(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld,
                                int64_t rank, int64_t n, const float* rows, int64_t rows_ld, uint16_t* const* outs,
                                int count, bool stream) {
    if (stream) {
      combine_rows_any<Bf16, uint16_t, true>(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld, outs, count);
    } else {
      combine_rows_any<Bf16, uint16_t, false>(coef, coef_ld, scale, factors, ld, rank, n, rows, rows_ld, outs, count);
    }
  }
  static void dots_bf16(const uint16_t* row, const float* factors, int64_t ld, int64_t rank, int64_t n, float scale,
                        float* out) {
    dots(row, factors, ld, rank, n, scale, out);
  }
  static void dots_f32(const float* row, const float* factors, int64_t ld, int64_t rank, int64_t n, float scale,
                       float* out) {
    dots(row, factors, ld, rank, n, scale, out);
  }
  static void outer_bf16(const float* coef, const float* row_scale, float scale, const uint16_t* rows, int64_t ld,
                         int64_t count, int64_t rank, int64_t c0, int64_t c1, float* out, int64_t out_ld) {
    outer(coef, row_scale, scale, [=](int64_t g) { return rows + g * ld; }, count, rank, c0, c1, out, out_ld);
  }
  static void outer_bf16_gathered(const float* coef, const float* row_scale, float scale, const uint16_t* rows,
                                  int64_t ld, const int64_t* order, int64_t divisor, int64_t count, int64_t rank,
                                  int64_t c0, int64_t c1, float* out, int64_t out_ld) {
    outer(coef, row_scale, scale, [=](int64_t g) { return rows + order[g] / divisor * ld; }, count, rank, c0, c1,
          out, out_ld);
  }
  static constexpr LoraKernels kernels{dots_rows_f32, dots_rows_bf16, combine_rows_f32, combine_rows_bf16,
                                       dots_bf16,     dots_f32,       outer_bf16,       outer_bf16_gathered};
};

}  // namespace
}  // namespace moecc::kernels
