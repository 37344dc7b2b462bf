// The rank-r products of factorised LoRA: r dot products of one row (x A^T), and the factor gradients, which are
// sums of rank-r outer products over an expert's rows. Both are memory-light but were the slowest non-matrix
// steps when written as r separate passes over each row; these do one pass with r accumulators.
// Built for AVX512 and for the baseline ISA; the copy for the running CPU is picked at load time.
#pragma once

#include <cstdint>

namespace moecc::kernels {

// out[j] = scale * sum_i row[i] * factors[j * n + i] for j < rank. row: bf16 bits or float.
void rank_dots(const uint16_t* row, const float* factors, int64_t rank, int64_t n, float scale, float* out);
void rank_dots(const float* row, const float* factors, int64_t rank, int64_t n, float scale, float* out);
// The same over n columns of factors whose rows are factor_ld apart (a column range of wider factors).
void rank_dots(const float* row, const float* factors, int64_t factor_ld, int64_t rank, int64_t n, float scale,
               float* out);
void rank_dots(const uint16_t* row, const float* factors, int64_t factor_ld, int64_t rank, int64_t n, float scale,
               float* out);

// For `count` rows, row r's coefficients at coef + r * coef_ld and its float row at rows + r * rows_ld, the LoRA term
// of a product's output row (rank-major factors): row[c] + sum_{j < rank} (scale * coef[r][j]) * factors[j * ld + c]
// for c < n, in one pass over each row, each term added in j order as r separate passes did, with a fused
// multiply-add in every column (the passes' AVX512 build left their last 8 columns unfused); the factors are loaded
// once for several rows. Grouping rows does the same operations per element in the same order as a call per row:
// the same bits on whole 16-column vectors as long as the compiler fuses the multiply-adds of both alike (setup.py
// turns GCC 13's FMA-chain heuristic off for that: with it GCC 13 fused the grouped rows and not a lone row); a
// scalar tail (n % 16 columns) may still differ in the last bit.
// Into bf16 at outs[r]: rounded to nearest even (NaN kept quiet); the rows are not written; rank 0 rounds only. One
// pass instead of r passes and a rounding pass. With `stream`, whole 16-column vectors leave with non-temporal
// stores (the caller fences), for a group of rows only where all of its outputs are 16-byte aligned.
void rank_combine_bf16_rows(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld,
                            int64_t rank, int64_t n, const float* rows, int64_t rows_ld, uint16_t* const* outs,
                            int64_t count, bool stream = false);
// The same in place on the float rows.
void rank_combine_rows(const float* coef, int64_t coef_ld, float scale, const float* factors, int64_t ld, int64_t rank,
                       int64_t n, float* rows, int64_t rows_ld, int64_t count);

// rank_dots (float or bf16 rows, factor_ld) for `count` rows, rows_ld apart (their dots out_ld apart), the factors
// loaded once for several rows; results as with rank_combine_bf16_rows against a call per row.
void rank_dots_rows(const float* rows, int64_t rows_ld, const float* factors, int64_t factor_ld, int64_t rank,
                    int64_t n, float scale, float* out, int64_t out_ld, int64_t count);
void rank_dots_rows(const uint16_t* rows, int64_t rows_ld, const float* factors, int64_t factor_ld, int64_t rank,
                    int64_t n, float scale, float* out, int64_t out_ld, int64_t count);

// out[j * out_ld + c] += scale * sum_{g < count} coef[g * rank + j] * row_scale[g] * rows[g * ld + c] for
// j < rank and c0 <= c < c1; row_scale may be null (all 1). rows: bf16 bits (every factor gradient reads the
// bf16 rows the matrix products use).
void rank_outer_accumulate(const float* coef, const float* row_scale, float scale, const uint16_t* rows, int64_t ld,
                           int64_t count, int64_t rank, int64_t c0, int64_t c1, float* out, int64_t out_ld);
// The same with row g at rows + (order[g] / divisor) * ld: an expert's rows read in place from the token rows
// (order: grouped pair ids, divisor: top-k) instead of from a gathered copy.
void rank_outer_accumulate_gathered(const float* coef, const float* row_scale, float scale, const uint16_t* rows,
                                    int64_t ld, const int64_t* order, int64_t divisor, int64_t count, int64_t rank,
                                    int64_t c0, int64_t c1, float* out, int64_t out_ld);

}  // namespace moecc::kernels
