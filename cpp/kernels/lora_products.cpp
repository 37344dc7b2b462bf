// Rank-r LoRA products (lora_products.h): the dispatcher, which picks a build of lora_products_body.h once from the
// running CPU, and the baseline build (this file has the baseline ISA's flags, as everything that runs before the
// choice must).
#include "lora_products.h"

#include <algorithm>

#include "lora_products_body.h"

namespace moecc::kernels {

const LoraKernels& lora_products_baseline() { return LoraBuild<v16::PortableBf16>::kernels; }

namespace {

// The AVX512 build where the CPU (and OS) runs AVX512F, else the baseline one; bf16 outputs rounded by
// AVX512-BF16's instruction where native_bf16() (vector16.h) says so.
struct Dispatch {
  const LoraKernels& kernels = __builtin_cpu_supports("avx512f") ? lora_products_avx512() : lora_products_baseline();
  decltype(LoraKernels::combine_rows_bf16) combine_rows_bf16 =
      v16::native_bf16() ? lora_combine_bf16_rows_avx512bf16() : kernels.combine_rows_bf16;
};
const Dispatch& dispatch() {
  static const Dispatch chosen;
  return chosen;
}

// fn(r0, group) for the groups of at most kCombineRows rows that the grouped-row entry points take a call each.
template <typename Fn>
void for_row_groups(int64_t count, Fn&& fn) {
  for (int64_t r0 = 0; r0 < count; r0 += kCombineRows) {
    fn(r0, static_cast<int>(std::min<int64_t>(kCombineRows, count - r0)));
  }
}

}  // namespace

void rank_dots(const uint16_t* row, const float* factors, int64_t rank, int64_t n, float scale, float* out) {
  dispatch().kernels.dots_bf16(row, factors, n, rank, n, scale, out);
}
void rank_dots(const float* row, const float* factors, int64_t rank, int64_t n, float scale, float* out) {
  dispatch().kernels.dots_f32(row, factors, n, rank, n, scale, out);
}
void rank_dots(const float* row, const float* factors, int64_t factor_ld, int64_t rank, int64_t n, float scale,
               float* out) {
  dispatch().kernels.dots_f32(row, factors, factor_ld, rank, n, scale, out);
}
void rank_dots(const uint16_t* row, const float* factors, int64_t factor_ld, int64_t rank, int64_t n, float scale,
               float* out) {
  dispatch().kernels.dots_bf16(row, factors, factor_ld, rank, n, scale, out);
}
void rank_combine_bf16_rows(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld,
                            int64_t rank, int64_t n, const float* rows, int64_t rows_ld, uint16_t* const* outs,
                            int64_t count, bool stream) {
  const auto combine = dispatch().combine_rows_bf16;
  for_row_groups(count, [&](int64_t r0, int group) {
    bool aligned = true;
    for (int r = 0; r < group; ++r) aligned = aligned && reinterpret_cast<std::uintptr_t>(outs[r0 + r]) % 16 == 0;
    combine(rank > 0 ? coef + r0 * coef_ld : coef, coef_ld, scale, factors, ld, rank, n, rows + r0 * rows_ld, rows_ld,
            outs + r0, group, stream && aligned);
  });
}
void rank_combine_rows(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld, int64_t rank,
                       int64_t n, float* rows, int64_t rows_ld, int64_t count) {
  for_row_groups(count, [&](int64_t r0, int group) {
    dispatch().kernels.combine_rows_f32(rank > 0 ? coef + r0 * coef_ld : coef, coef_ld, scale, factors, ld, rank, n,
                                        rows + r0 * rows_ld, rows_ld, group);
  });
}
void rank_dots_rows(const float* rows, int64_t rows_ld, const float* factors, int64_t factor_ld, int64_t rank,
                    int64_t n, float scale, float* out, int64_t out_ld, int64_t count) {
  if (rank <= 0) return;  // no dots (and out may be null)
  for_row_groups(count, [&](int64_t r0, int group) {
    dispatch().kernels.dots_rows_f32(rows + r0 * rows_ld, rows_ld, factors, factor_ld, rank, n, scale,
                                     out + r0 * out_ld, out_ld, group);
  });
}
void rank_dots_rows(const uint16_t* rows, int64_t rows_ld, const float* factors, int64_t factor_ld, int64_t rank,
                    int64_t n, float scale, float* out, int64_t out_ld, int64_t count) {
  if (rank <= 0) return;
  for_row_groups(count, [&](int64_t r0, int group) {
    dispatch().kernels.dots_rows_bf16(rows + r0 * rows_ld, rows_ld, factors, factor_ld, rank, n, scale,
                                      out + r0 * out_ld, out_ld, group);
  });
}
void rank_outer_accumulate(const float* coef, const float* row_scale, float scale, const uint16_t* rows, int64_t ld,
                           int64_t count, int64_t rank, int64_t c0, int64_t c1, float* out, int64_t out_ld) {
  dispatch().kernels.outer_bf16(coef, row_scale, scale, rows, ld, count, rank, c0, c1, out, out_ld);
}

void rank_outer_accumulate_gathered(const float* coef, const float* row_scale, float scale, const uint16_t* rows,
                                    int64_t ld, const int64_t* order, int64_t divisor, int64_t count, int64_t rank,
                                    int64_t c0, int64_t c1, float* out, int64_t out_ld) {
  dispatch().kernels.outer_bf16_gathered(coef, row_scale, scale, rows, ld, order, divisor, count, rank, c0, c1, out,
                                         out_ld);
}

}  // namespace moecc::kernels
