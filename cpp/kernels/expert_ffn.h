// Routed-expert SwiGLU FFN with LoRA on the CPU, forward and backward, over packed bf16 weights (packed from the
// model's bf16 weights or from a quantized copy, a slice at a time).
//
// Shapes: T tokens, k experts per token, E experts, hidden H, intermediate I. Pairs (token t, slot j) have id
// p = t*k + j; `order` lists pair ids grouped by expert (token_grouping.h), grouped position g = index in
// `order`. Base weights are the model's own, per expert gate_up [2I, H] (gate rows, then up rows) and
// down [H, I], row-major; each product task packs the slice it needs (weight_packing.h) into per-thread
// scratch, so host memory holds the experts once. LoRA factors are fp32 in PEFT's layout: A [E*r, in]
// expert-major (= [E, r, in]) and B [out, r*E] rank-major (expert e's column j is j*E + e);
// y = x W^T + s (x A_e^T) B_e^T. B is re-laid internally as B^T [E, r, out] (rows the loops read contiguously)
// and its gradient laid back.
// Products take bf16 inputs and accumulate in fp32; gate/up outputs are kept in bf16 for backward.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dequantize.h"
#include "panel_gemm.h"

namespace moecc::pool {
class ThreadPool;
}

namespace moecc::kernels {

// The argument structs of the kernel calls: every pointer null and every size 0 until set (moecc/_ops.py sets
// them after checking each tensor; they are bound once in cpp/bindings.cpp).
struct ExpertShapes {
  int64_t experts = 0, hidden = 0, inter = 0, tokens = 0, top_k = 0;
};

struct ExpertMatrices {  // the model's own bf16 weights, row-major, read in place
  const uint16_t* gate_up = nullptr;  // [E, 2I, H]
  const uint16_t* down = nullptr;     // [E, H, I]
  // Or a projection held quantized (format other than kBf16; its bf16 pointer above is then null): each product
  // task dequantizes the slice it packs (dequantize.h), so host memory holds the quantized copy alone.
  QuantizedWeights quantized_gate_up;
  QuantizedWeights quantized_down;
  // Optional copies already in the panel layout (weight_packing.h), E matrices of packed_elements(N, K) each
  // (MoeccConfig.prepack_weights, which doubles the experts' host memory): forward products read their panels
  // instead of packing their slice per task; backward always packs per task.
  const uint16_t* packed_gate_up = nullptr;
  const uint16_t* packed_down = nullptr;
};

struct LoraFactors {  // a == nullptr: no LoRA on this projection
  const float* a = nullptr;  // [E, r, in]
  const float* b = nullptr;  // [out, r*E], PEFT's layout
  int64_t rank = 0;
  float scaling = 0.0f;
};

struct Routing {
  const int64_t* offsets = nullptr;  // [E+1]
  const int64_t* order = nullptr;    // [T*k] pair ids grouped by expert
  const float* weights = nullptr;    // [T*k] routing weight per pair id
};

// Token-major inputs and outputs come in float32 or bf16: exactly one of each pair is non-null.
struct ForwardIo {
  const uint16_t* hidden = nullptr;  // [T, H] bf16
  uint16_t* gate_up_out = nullptr;   // [T*k, 2I] bf16, grouped order: saved for backward
  float* out = nullptr;              // [T, H]
  uint16_t* out_bf16 = nullptr;      // [T, H]
  uint16_t* hidden_copy = nullptr;   // [T, H] or null: receives a copy of `hidden` (a caller saving it for backward)
  // [T*k, r] each, grouped order, or null: receive the LoRA inner products x A_gu and act A_down (a caller saving
  // them for backward, which then skips recomputing them: 512 bytes per token at r = 8, k = 8)
  float* inner_gate_up = nullptr;
  float* inner_down = nullptr;
};

struct BackwardIo {
  const uint16_t* hidden = nullptr;         // [T, H] bf16
  const uint16_t* gate_up_out = nullptr;    // [T*k, 2I] bf16 from forward
  const float* grad_out = nullptr;          // [T, H]
  const uint16_t* grad_out_bf16 = nullptr;  // [T, H]
  float* grad_hidden = nullptr;             // [T, H]
  uint16_t* grad_hidden_bf16 = nullptr;     // [T, H]
  float* grad_routing = nullptr;            // [T*k] per pair id
  float* grad_gate_up_a = nullptr;          // [E, r, H] or null; accumulated into
  float* grad_gate_up_b = nullptr;          // [2I, r*E] (PEFT's layout) or null; written
  float* grad_down_a = nullptr;             // [E, r, I] or null; accumulated into
  float* grad_down_b = nullptr;             // [H, r*E] (PEFT's layout) or null; written
  const float* inner_gate_up = nullptr;     // ForwardIo's, when the caller saved them; null: recomputed
  const float* inner_down = nullptr;
  // [E] or null: the LoRA gradients hold blocks of lora_grad_experts experts only (A [n, r, in], B [out, r*n]),
  // expert e's in block lora_grad_slots[e] (-1: none, for experts without routed rows), so a caller
  // differentiating a few experts gets their blocks without writing and then selecting all E.
  const int64_t* lora_grad_slots = nullptr;
  int64_t lora_grad_experts = 0;
};

// Shape of the product tasks and which outputs leave with non-temporal stores, passed in with every call. The
// defaults are what the engine runs; benchmarks (benchmarks/sweep_cpu_experts.py) and tests set the rest. No
// setting changes a result bit, except grad_columns_per_task (below).
struct KernelTuning {
  // Forward output panels (of 16 columns) per product task. Wider tasks re-read each block of rows fewer times
  // but hold a larger weight slice in L2 and make fewer tasks.
  int64_t panels_per_task = 16;
  // Input-gradient columns per task, a multiple of 16. Also the chunks whose parts the backward's row sums add,
  // so it moves the routing and gate/up A gradients in their last bits.
  int64_t grad_columns_per_task = 256;
  // Rows per product task: a task's weight slice stays in L2 while its rows stream past, so the weights cross
  // the memory bus once per this many rows of an expert; taller tasks split a hot expert over fewer threads.
  int64_t rows_per_task = 1024;
  // Rows per product call within a task, its epilogue (LoRA term, bf16 rounding) run on each block while the
  // block is in cache; 0: the whole task at once.
  int64_t block_rows = 0;
  // Whether the grouped copies of token rows (the forward's hidden rows, the backward's bf16 output gradients)
  // use non-temporal stores where the CPU has AVX512BW.
  bool streaming_copies = true;
  // Which bf16 outputs leave with non-temporal stores, a mask of 1 (the per-pair rows of the forward's down
  // product and of the gate/up input gradient), 2 (the forward's gate/up output), 4 (the activation rows) and 8
  // (the down input gradient's act and d gate / d up rows).
  int64_t streaming_outputs = 13;
  GemmTuning gemm;
};

// Throws std::invalid_argument naming the field and its value when `tuning` is out of range.
void check_tuning(const KernelTuning& tuning);

// Throws std::invalid_argument when a projection has neither bf16 weights nor a quantized copy of the layer's shape,
// or is quantized and prepacked at once.
void check_matrices(const ExpertShapes& shapes, const ExpertMatrices& weights);

// @param isa      the product kernels (panel_gemm.h); the caller has checked that the CPU runs them.
// @param shapes   T, k, E, H, I; T may be 0.
// @param weights  the experts' bf16 matrices, read in place (optionally also a packed copy), or quantized copies.
// @param routing  the grouping of token_grouping.h and the routing weight of each pair id.
// @param io       token rows in and out (ForwardIo: exactly one of out / out_bf16 set).
// @param tuning   checked with check_tuning first.
// Runs on `pool`; the caller releases the GIL.
void expert_ffn_forward(Isa isa, const ExpertShapes& shapes, const ExpertMatrices& weights,
                        const LoraFactors& gate_up_lora, const LoraFactors& down_lora, const Routing& routing,
                        const ForwardIo& io, const KernelTuning& tuning, moecc::pool::ThreadPool& pool);

// The backward of expert_ffn_forward with the same problem, given the forward's gate/up output (and optionally
// its LoRA inner products); A gradients accumulate into io, B gradients are written.
void expert_ffn_backward(Isa isa, const ExpertShapes& shapes, const ExpertMatrices& weights,
                         const LoraFactors& gate_up_lora, const LoraFactors& down_lora, const Routing& routing,
                         const BackwardIo& io, const KernelTuning& tuning, moecc::pool::ThreadPool& pool);

// (phase, seconds) of the latest forward or backward call, in order.
using PhaseTimes = std::vector<std::pair<std::string, double>>;
PhaseTimes last_phase_times(bool backward);
// Per product phase of the latest forward or backward call: thread-seconds summed over the pool's threads spent
// packing weights, in the panel products, and in the epilogues (LoRA terms, rounding, SwiGLU backward). With the
// phase's wall time x threads they say how much of it the threads spent waiting.
struct ProductParts {
  std::string phase;
  double pack, gemm, epilogue;
};
std::vector<ProductParts> last_product_parts(bool backward);

}  // namespace moecc::kernels
