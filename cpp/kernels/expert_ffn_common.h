// What the forward and the backward of the routed-expert FFN share besides the products: the scratch buffers (one
// set for both), the grouped row copies (bf16 rows of padded stride, Dims), the activation, the sums over a
// token's k slots and the re-layout of LoRA B between PEFT's [out, r*E] and the rows B^T [E, r, out] the loops read.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "aligned_buffer.h"
#include "expert_ffn.h"
#include "expert_ffn_tasks.h"
#include "lora_products.h"

namespace moecc::kernels::ffn {

// One set of buffers for forward and backward: the engine runs one layer call at a time, so the buffers both
// need (gathered rows, activations, gradients, per-pair outputs: about 17.5 KB per routed pair for Qwen3-30B-A3B,
// plus the LoRA re-layouts) are held once; the mutex keeps concurrent callers correct anyway.
struct Scratch {
  std::mutex mutex;
  AlignedBuffer<uint16_t> xg, act, dy_bf16, grad_gu_bf16, per_pair;
  AlignedBuffer<float> inner_gu, inner_down, grad_inner_gu, grad_inner_down, routing_parts, inner_gu_parts,
      row_weight, b_gu, b_down, grad_b_gu, grad_b_down;
};

Scratch& shared_scratch();

// inner[g][r] = sum_c row_of(g)[c] * a[r][c] for the task's grouped rows g (bf16 rows).
template <typename RowOf>
void lora_inner(const LoraFactors& lora, int64_t expert, int64_t in_features, const Task& task, RowOf row_of,
                float* inner) {
  const float* a = lora.a + expert * lora.rank * in_features;
  for (int64_t g = task.begin; g < task.end; ++g) {
    rank_dots(row_of(g), a, lora.rank, in_features, 1.0f, inner + g * lora.rank);
  }
}
// ... from rows with leading dimension ld (a gathered copy), several rows sharing each factor load.
inline void lora_inner(const LoraFactors& lora, int64_t expert, int64_t in_features, const Task& task,
                       const uint16_t* rows, int64_t ld, float* inner) {
  rank_dots_rows(rows + task.begin * ld, ld, lora.a + expert * lora.rank * in_features, in_features, lora.rank,
                 in_features, 1.0f, inner + task.begin * lora.rank, lora.rank, task.end - task.begin);
}

// Copies a row into its zero-padded grouped row (ld values), streamed when `stream` and the CPU has AVX512BW (then
// `streamed` is set and the caller fences before the phase ends).
void copy_row(const uint16_t* src, int64_t n, uint16_t* dst, int64_t ld, bool stream, bool& streamed);

// Orders a task's non-temporal stores before what follows (the pool's hand-over to the next phase).
inline void fence_streamed(bool streamed) {
  if (streamed) _mm_sfence();
}

// dst[i] = bf16(src[i]) for i < n, rounded to nearest even.
void round_to_bf16(const float* src, uint16_t* dst, int64_t n);

// Grouped hidden rows (zero-padded) and their gate/up LoRA inner product (from the token row, as the copy may have
// bypassed the cache); with `hidden_copy`, each token's row is also copied there once (by its slot-0 pair).
void gather_hidden(const Dims& d, const Routing& routing, const uint16_t* hidden, const LoraFactors& lora,
                   const std::vector<Task>& rows, uint16_t* xg, float* inner, bool stream,
                   moecc::pool::ThreadPool& pool, uint16_t* hidden_copy = nullptr);

// act = round(round(silu(gate)) * up) in bf16 rows of stride d.ld_act, and act A_down into inner [g][r].
void activate(const Dims& d, const uint16_t* gate_up_out, const LoraFactors& lora, const std::vector<Task>& rows,
              uint16_t* act, float* inner, bool stream, moecc::pool::ThreadPool& pool);

// out[t] (float32, or bf16 into out_bf16 when out is null) = sum over the token's k slots of per_pair rows times
// their routing weight (1 without `weights`).
void sum_slots(const Dims& d, const uint16_t* per_pair, const float* weights, float* out, uint16_t* out_bf16,
               moecc::pool::ThreadPool& pool);

// B^T [E, r, out] -> PEFT's B [out, r*E]; the columns of experts without routed rows (offsets [E+1]) are zero
// and their B^T rows are not read. With `slots` ([E], BackwardIo::lora_grad_slots): B [out, r*n] of n = `blocks`
// experts, expert e in column j*n + slots[e]; columns no routed expert fills are zero.
void rows_to_peft_b(const float* b_t, int64_t out, int64_t rank, int64_t experts, const int64_t* offsets, float* b,
                    moecc::pool::ThreadPool& pool, const int64_t* slots = nullptr, int64_t blocks = 0);

// The factors with B re-laid into `b_t` (scratch) as rows of B^T, as the products' loops read them; only the
// rows of experts with routed rows (offsets [E+1]) are written.
LoraFactors with_rows_of_b(const LoraFactors& lora, int64_t out, int64_t experts, const int64_t* offsets,
                           AlignedBuffer<float>& b_t, moecc::pool::ThreadPool& pool);

}  // namespace moecc::kernels::ffn
