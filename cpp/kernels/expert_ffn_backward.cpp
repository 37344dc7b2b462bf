// The backward of the routed-expert FFN (expert_ffn.h), in named phases run in order on the pool (the names are
// those last_phase_times reports):
//   activate            the forward's LoRA inner products again, where the caller did not keep them
//   grad_out            the output gradient as a bf16 row per grouped pair, and its down-LoRA inner product
//   down_input_grad     d act = dy W_down + LoRA term, with the SwiGLU backward of each chunk fused in
//   row_sums            the routing-weight gradient and s dG B from their per-chunk parts
//   gate_up_input_grad  d hidden per pair = dG W_gate_up + LoRA term
//   lora_grads          the four LoRA factor gradients
//   lora_b_layout       the B gradients from rows of B^T back into PEFT's layout
//   sum_slots           d hidden per token, the sum over its slots
// Grouped rows and their padded strides as in the forward (expert_ffn_tasks.h: Dims); buffers are the shared
// scratch (expert_ffn_common.h).
#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "aligned_buffer.h"
#include "expert_ffn.h"
#include "expert_ffn_common.h"
#include "expert_ffn_products.h"
#include "expert_ffn_profile.h"
#include "expert_ffn_tasks.h"
#include "lora_products.h"
#include "swiglu.h"

namespace moecc::kernels {
namespace {

using namespace ffn;

// Columns per task of the LoRA factor gradients.
constexpr int64_t kGradFactorColumns = 256;

// Rows per group in the down input gradient's epilogue: the LoRA terms of a group (the A side before the SwiGLU
// backward, the B-side dots after it) load each factor vector once for its rows.
constexpr int64_t kGroup = 4;

// One LoRA factor gradient task: columns [c0, c1) of factor `which` (0 dA_down, 1 dB_down^T, 2 dA_gu, 3 dB_gu^T)
// of one expert.
struct FactorTask {
  int64_t expert, which, c0, c1;
};

// One backward call: the problem, the LoRA factors with B as rows of B^T, and the buffers the phases write and
// read, all set up by the constructor (B re-laid, B gradients zeroed). Each phase is one member function.
class Backward {
 public:
  Backward(Isa isa, const ExpertShapes& shapes, const ExpertMatrices& weights, const LoraFactors& gate_up_peft,
           const LoraFactors& down_peft, const Routing& routing, const BackwardIo& io_peft,
           const KernelTuning& tuning, Scratch& scratch, moecc::pool::ThreadPool& pool);

  void recompute_inner_products() const;
  void output_grad_rows() const;
  void down_input_grad() const;
  void row_sums() const;
  void gate_up_input_grad() const;
  void lora_factor_grads() const;
  void lay_back_lora_b() const;
  void sum_slots_per_token() const;
  // Expert e's block of the LoRA gradients (BackwardIo::lora_grad_slots).
  int64_t block(int64_t e) const { return io_.lora_grad_slots ? io_.lora_grad_slots[e] : e; }

 private:
  void swiglu_backward_group(const Task& task, int64_t g0, int64_t count, float* grad_act, int64_t ld,
                             float* dg) const;
  std::vector<FactorTask> factor_tasks() const;
  void factor_grad(const FactorTask& t) const;

  const Dims d_;
  const PanelGemm& gemm_;
  const KernelTuning& tuning_;
  const ExpertMatrices& weights_;
  const Routing& routing_;
  const BackwardIo& io_peft_;  // the caller's: B gradients in PEFT's layout
  BackwardIo io_;              // the same, but B gradients accumulated as rows of B^T in scratch
  LoraFactors gate_up_lora_, down_lora_;  // B as rows of B^T [E, r, out]
  moecc::pool::ThreadPool& pool_;
  std::vector<Task> rows_;  // (expert, block of kTokenBlock grouped rows)
  bool recompute_gu_, recompute_down_;  // the forward's inner products were not kept
  int64_t chunk_columns_, chunks_;      // the down input gradient's column chunks (I split)
  uint16_t* act_;                       // [pairs, ld_act] bf16
  float *inner_gu_scratch_, *inner_down_scratch_;  // [pairs, r]: x A_gu, act A_down where recomputed, else null
  const float *inner_gu_, *inner_down_;  // the forward's kept ones, or the scratch above
  float *grad_inner_gu_, *grad_inner_down_;  // [pairs, r]: s dG B_gu, s dy B_down
  uint16_t *dy_bf16_, *grad_gu_bf16_;   // [pairs, ld_dy], [pairs, ld_dgu] bf16
  uint16_t* per_pair_;                  // [T*k, H] bf16 by pair id: d hidden per pair
  float* row_weight_;                   // [pairs] routing weight per grouped row
  float *routing_parts_, *inner_gu_parts_;  // [pairs, chunks], [pairs, chunks, 2, r_gu]
};

Backward::Backward(Isa isa, const ExpertShapes& shapes, const ExpertMatrices& weights,
                   const LoraFactors& gate_up_peft, const LoraFactors& down_peft, const Routing& routing,
                   const BackwardIo& io_peft, const KernelTuning& tuning, Scratch& scratch,
                   moecc::pool::ThreadPool& pool)
    : d_(shapes), gemm_(panel_gemm(isa)), tuning_(tuning), weights_(weights), routing_(routing), io_peft_(io_peft),
      io_(io_peft), pool_(pool) {
  const Dims& d = d_;
  gate_up_lora_ = with_rows_of_b(gate_up_peft, 2 * d.I, d.E, routing.offsets, scratch.b_gu, pool);
  down_lora_ = with_rows_of_b(down_peft, d.H, d.E, routing.offsets, scratch.b_down, pool);
  // The B gradients' rows [E, r, out], zeroed for the experts with routed rows only: lay_back_lora_b reads no others.
  const auto zeroed = [&](AlignedBuffer<float>& buffer, int64_t rank, int64_t out) {
    float* data = buffer.get(d.E * rank * out);
    pool.run(d.E, [&](int64_t e, int) {
      if (routing.offsets[e + 1] > routing.offsets[e]) std::fill(data + e * rank * out, data + (e + 1) * rank * out, 0.0f);
    });
    return data;
  };
  if (io_peft.grad_gate_up_b) io_.grad_gate_up_b = zeroed(scratch.grad_b_gu, gate_up_lora_.rank, 2 * d.I);
  if (io_peft.grad_down_b) io_.grad_down_b = zeroed(scratch.grad_b_down, down_lora_.rank, d.H);
  const int64_t r_gu = std::max<int64_t>(gate_up_lora_.rank, 1), r_d = std::max<int64_t>(down_lora_.rank, 1);
  rows_ = make_tasks(routing.offsets, d.E, 1, 1);
  recompute_gu_ = gate_up_lora_.a && !io_.inner_gate_up;
  recompute_down_ = down_lora_.a && !io_.inner_down;
  act_ = scratch.act.get(d.pairs * d.ld_act);
  inner_gu_scratch_ = recompute_gu_ ? scratch.inner_gu.get(d.pairs * r_gu) : nullptr;
  inner_down_scratch_ = recompute_down_ ? scratch.inner_down.get(d.pairs * r_d) : nullptr;
  inner_gu_ = recompute_gu_ ? inner_gu_scratch_ : io_.inner_gate_up;
  inner_down_ = recompute_down_ ? inner_down_scratch_ : io_.inner_down;
  grad_inner_gu_ = scratch.grad_inner_gu.get(d.pairs * r_gu);
  grad_inner_down_ = scratch.grad_inner_down.get(d.pairs * r_d);
  dy_bf16_ = scratch.dy_bf16.get(d.pairs * d.ld_dy);
  grad_gu_bf16_ = scratch.grad_gu_bf16.get(d.pairs * d.ld_dgu);
  per_pair_ = scratch.per_pair.get(d.pairs * d.H);
  row_weight_ = scratch.row_weight.get(std::max<int64_t>(d.pairs, 1));
  chunk_columns_ = tuning.grad_columns_per_task;
  chunks_ = (d.I + chunk_columns_ - 1) / chunk_columns_;
  routing_parts_ = scratch.routing_parts.get(d.pairs * chunks_);
  inner_gu_parts_ = gate_up_lora_.a ? scratch.inner_gu_parts.get(d.pairs * chunks_ * 2 * gate_up_lora_.rank) : nullptr;
}

// Backward reads the token rows in place: only the LoRA terms use them (x A for dB, x for dA), so the gathered
// copy the forward's products need (a hidden row per pair) is not written again. The activation is recomputed as
// whole rows only where the forward did not keep act A_down (it needs all of I); else the down input gradient's
// tasks write act chunk by chunk.
void Backward::recompute_inner_products() const {
  const Dims& d = d_;
  if (recompute_gu_) {
    run_tasks(pool_, rows_, [&](const Task& task) {
      lora_inner(gate_up_lora_, task.expert, d.H, task,
                 [&](int64_t g) { return io_.hidden + routing_.order[g] / d.k * d.H; }, inner_gu_scratch_);
    });
  }
  if (recompute_down_) {
    activate(d, io_.gate_up_out, down_lora_, rows_, act_, inner_down_scratch_, (tuning_.streaming_outputs & 4) != 0,
             pool_);
  }
}

// inner[g][r] = s * sum_c grad[g][c] B^T[r][c]: the LoRA-B side of an input gradient.
template <typename Row>  // float, or bf16 bits
void lora_grad_inner(const LoraFactors& lora, int64_t expert, int64_t out_features, const Row* grad_row, int64_t g,
                     float* inner) {
  const float* b_t = lora.b + expert * lora.rank * out_features;
  rank_dots(grad_row, b_t, lora.rank, out_features, lora.scaling, inner + g * lora.rank);
}

// The unweighted output gradient per grouped row in bf16 (zero-padded), and its down-LoRA inner product s dy B
// from the token's own row (float32 as given, or the bf16 row read as it is).
void Backward::output_grad_rows() const {
  const Dims& d = d_;
  const bool stream = tuning_.streaming_copies;
  run_tasks(pool_, rows_, [&](const Task& task) {
    bool streamed = false;
    for (int64_t g = task.begin; g < task.end; ++g) {
      const int64_t token = routing_.order[g] / d.k;
      uint16_t* const dst = dy_bf16_ + g * d.ld_dy;
      if (io_.grad_out) {
        const float* src = io_.grad_out + token * d.H;
        round_to_bf16(src, dst, d.H);
        if (down_lora_.a) lora_grad_inner(down_lora_, task.expert, d.H, src, g, grad_inner_down_);
        std::fill(dst + d.H, dst + d.ld_dy, uint16_t{0});
      } else {
        const uint16_t* src = io_.grad_out_bf16 + token * d.H;
        copy_row(src, d.H, dst, d.ld_dy, stream, streamed);
        if (down_lora_.a) lora_grad_inner(down_lora_, task.expert, d.H, src, g, grad_inner_down_);
      }
    }
    fence_streamed(streamed);
  });
}

// d act (unweighted) = dy W_down + (s dy B) A, by (rows, chunk of I's columns) tasks, each running the SwiGLU
// backward of its chunk while the chunk is in cache: act again (bf16, rounded as the forward did), d gate and d up
// (bf16, into grad_gu_bf16), and the chunk's parts of the two row sums that need all of I: act . d act (the
// routing-weight gradient) and s dG B. Parts are kept per chunk and added in chunk order by row_sums, so results
// do not depend on which thread ran what (they do, in the last bits, on the chunk width,
// KernelTuning::grad_columns_per_task, which fixes how swiglu_backward_row's 16 lanes split act . d act). Fusing
// it saves writing and reading back d act as a float32 row per pair.
void Backward::down_input_grad() const {
  const Dims& d = d_;
  PartClocks clocks;
  const bool stream_rows = (tuning_.streaming_outputs & 8) != 0;
  run_tasks(pool_, make_tasks(routing_.offsets, d.E, d.I, chunk_columns_, tuning_.rows_per_task),
            [&](const Task& task) {
    thread_local AlignedBuffer<float> dg_rows;
    float* const dg = dg_rows.get(kGroup * 2 * (task.col1 - task.col0));  // a group's d gate, d up, a row each
    input_grad_product(gemm_, task, tuning_.block_rows, dy_bf16_, d.ld_dy, down_weight(weights_, d, task.expert),
                       d.H, d.I, tuning_.gemm, clocks, [&](const Task& rows_block, float* tile, int64_t ld) {
      for (int64_t g0 = rows_block.begin; g0 < rows_block.end; g0 += kGroup) {
        swiglu_backward_group(task, g0, std::min(kGroup, rows_block.end - g0),
                              tile + (g0 - rows_block.begin) * ld, ld, dg);
      }
    });
    fence_streamed(stream_rows);
  });
  record_parts(/*backward=*/true, "down_input_grad", clocks);
}

// The epilogue of down_input_grad for `count` grouped rows from g0 of a task's chunk: grad_act (rows ld apart) is
// dy W_down for them; dg holds the group's d gate and d up rows (kGroup x 2 x width floats).
void Backward::swiglu_backward_group(const Task& task, int64_t g0, int64_t count, float* grad_act, int64_t ld,
                                     float* dg) const {
  const Dims& d = d_;
  const int64_t width = task.col1 - task.col0, chunk = task.col0 / chunk_columns_;
  const bool last = task.col1 == d.I;  // writes the rows' zero padding
  const bool stream_rows = (tuning_.streaming_outputs & 8) != 0;
  if (down_lora_.a) {
    const float* a = down_lora_.a + task.expert * down_lora_.rank * d.I + task.col0;
    rank_combine_rows(grad_inner_down_ + g0 * down_lora_.rank, down_lora_.rank, 1.0f, a, d.I, down_lora_.rank, width,
                      grad_act, ld, count);
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t g = g0 + r;
    const uint16_t* gate = io_.gate_up_out + g * 2 * d.I + task.col0;
    const uint16_t* up = gate + d.I;
    uint16_t* const act_row = act_ + g * d.ld_act;
    uint16_t* const dg_row = grad_gu_bf16_ + g * d.ld_dgu;
    float* const dg_r = dg + r * 2 * width;
    // act is written here unless recompute_inner_products wrote the whole rows
    routing_parts_[g * chunks_ + chunk] =
        swiglu_backward_row(gate, up, grad_act + r * ld, routing_.weights[routing_.order[g]], !recompute_down_,
                            act_row + task.col0, dg_r, dg_r + width, dg_row + task.col0, dg_row + d.I + task.col0,
                            width, stream_rows);
    if (last && !recompute_down_) std::fill(act_row + d.I, act_row + d.ld_act, uint16_t{0});
    if (last) std::fill(dg_row + 2 * d.I, dg_row + d.ld_dgu, uint16_t{0});
  }
  if (gate_up_lora_.a) {
    const float* b_t = gate_up_lora_.b + task.expert * gate_up_lora_.rank * 2 * d.I;
    const int64_t rank = gate_up_lora_.rank, out_ld = chunks_ * 2 * rank;
    float* const parts = inner_gu_parts_ + (g0 * chunks_ + chunk) * 2 * rank;
    rank_dots_rows(dg, 2 * width, b_t + task.col0, 2 * d.I, rank, width, gate_up_lora_.scaling, parts, out_ld,
                   count);
    rank_dots_rows(dg + width, 2 * width, b_t + d.I + task.col0, 2 * d.I, rank, width, gate_up_lora_.scaling,
                   parts + rank, out_ld, count);
  }
}

// The routing-weight gradient and s dG B per grouped row from their chunk parts, in chunk order (gate half
// before up half); also each row's routing weight, for the factor gradients.
void Backward::row_sums() const {
  const int64_t chunks = chunks_;
  run_tasks(pool_, rows_, [&](const Task& task) {
    for (int64_t g = task.begin; g < task.end; ++g) {
      const int64_t pair = routing_.order[g];
      row_weight_[g] = routing_.weights[pair];
      float sum = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) sum += routing_parts_[g * chunks + c];
      io_.grad_routing[pair] = sum;
      if (!gate_up_lora_.a) continue;
      const int64_t rank = gate_up_lora_.rank;
      for (int64_t r = 0; r < rank; ++r) {
        float inner = 0.0f;
        for (int64_t part = 0; part < 2 * chunks; ++part) inner += inner_gu_parts_[(g * 2 * chunks + part) * rank + r];
        grad_inner_gu_[g * rank + r] = inner;
      }
    }
  });
}

// d hidden per pair = dG W_gate_up + (s dG B) A, a bf16 row per pair id.
void Backward::gate_up_input_grad() const {
  const Dims& d = d_;
  PartClocks clocks;
  const bool stream = (tuning_.streaming_outputs & 1) != 0;
  const LoraFactors& lora = gate_up_lora_;
  run_tasks(pool_, make_tasks(routing_.offsets, d.E, d.H, tuning_.grad_columns_per_task, tuning_.rows_per_task),
            [&](const Task& task) {
    const int64_t width = task.col1 - task.col0;
    const float* a = lora.a ? lora.a + task.expert * lora.rank * d.H + task.col0 : nullptr;
    input_grad_product(gemm_, task, tuning_.block_rows, grad_gu_bf16_, d.ld_dgu,
                       gate_up_weight(weights_, d, task.expert), 2 * d.I, d.H, tuning_.gemm, clocks,
                       [&](const Task& rows_block, float* tile, int64_t ld) {
      combine_rows(rows_block, a ? grad_inner_gu_ : nullptr, lora.rank, 1.0f, a, d.H, a ? lora.rank : 0, width, tile,
                   ld, [&](int64_t g) { return per_pair_ + routing_.order[g] * d.H + task.col0; }, stream);
    });
    fence_streamed(stream);
  });
  record_parts(/*backward=*/true, "gate_up_input_grad", clocks);
}

// The four LoRA factor gradients, each a sum over an expert's rows of rank-r outer products, by (expert, factor,
// block of columns) tasks, largest experts first, so a hot expert is spread over threads. Each task sums all of
// its expert's rows for its columns in row order: the results do not depend on which thread runs which task.
void Backward::lora_factor_grads() const {
  const std::vector<FactorTask> tasks = factor_tasks();
  pool_.run(static_cast<int64_t>(tasks.size()), [&](int64_t i, int) { factor_grad(tasks[static_cast<size_t>(i)]); });
}

std::vector<FactorTask> Backward::factor_tasks() const {
  const Dims& d = d_;
  const int64_t* offsets = routing_.offsets;
  const int64_t widths[4] = {d.I, d.H, d.H, 2 * d.I};  // dA_down, dB_down^T, dA_gu, dB_gu^T
  const bool present[4] = {down_lora_.a != nullptr, down_lora_.a != nullptr, gate_up_lora_.a != nullptr,
                           gate_up_lora_.a != nullptr};
  std::vector<FactorTask> tasks;
  for (int64_t e = 0; e < d.E; ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    for (int64_t which = 0; which < 4; ++which) {
      if (!present[which]) continue;
      for (int64_t c = 0; c < widths[which]; c += kGradFactorColumns) {
        tasks.push_back({e, which, c, std::min(widths[which], c + kGradFactorColumns)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [&](const FactorTask& a, const FactorTask& b) {
    return offsets[a.expert + 1] - offsets[a.expert] > offsets[b.expert + 1] - offsets[b.expert];
  });
  return tasks;
}

// The output-side rows are the bf16 copies the input-gradient products read (dy, dG): the model's gradients are
// bf16 to begin with, and they take half the memory traffic of float32 rows.
void Backward::factor_grad(const FactorTask& t) const {
  const Dims& d = d_;
  const int64_t e = t.expert, begin = routing_.offsets[e], count = routing_.offsets[e + 1] - begin;
  const int64_t* order = routing_.order + begin;
  if (t.which == 0) {  // dA_down[r][i] = sum_g w (s dy B)[g][r] act[g][i]
    const int64_t r = down_lora_.rank;
    rank_outer_accumulate(grad_inner_down_ + begin * r, row_weight_ + begin, 1.0f, act_ + begin * d.ld_act, d.ld_act,
                          count, r, t.c0, t.c1, io_.grad_down_a + block(e) * r * d.I, d.I);
  } else if (t.which == 1) {  // dB_down^T[r][h] = s sum_g w (act A)[g][r] dy[g][h]
    // dy from the token rows when they are bf16 (the same values as the grouped copy): k pairs share each, so
    // they are read from cache, where the grouped copy (a row per pair) comes from DRAM.
    const int64_t r = down_lora_.rank;
    float* const grad = io_.grad_down_b + e * r * d.H;
    const uint16_t* const grad_out_bf16 = io_.grad_out ? nullptr : io_.grad_out_bf16;
    if (grad_out_bf16) {
      rank_outer_accumulate_gathered(inner_down_ + begin * r, row_weight_ + begin, down_lora_.scaling, grad_out_bf16,
                                     d.H, order, d.k, count, r, t.c0, t.c1, grad, d.H);
    } else {
      rank_outer_accumulate(inner_down_ + begin * r, row_weight_ + begin, down_lora_.scaling,
                            dy_bf16_ + begin * d.ld_dy, d.ld_dy, count, r, t.c0, t.c1, grad, d.H);
    }
  } else if (t.which == 2) {  // dA_gu[r][h] = sum_g (s dG B)[g][r] x[g][h]
    const int64_t r = gate_up_lora_.rank;
    rank_outer_accumulate_gathered(grad_inner_gu_ + begin * r, nullptr, 1.0f, io_.hidden, d.H, order, d.k, count, r,
                                   t.c0, t.c1, io_.grad_gate_up_a + block(e) * r * d.H, d.H);
  } else {  // dB_gu^T[r][c] = s sum_g (x A)[g][r] dG[g][c]
    const int64_t r = gate_up_lora_.rank;
    rank_outer_accumulate(inner_gu_ + begin * r, nullptr, gate_up_lora_.scaling, grad_gu_bf16_ + begin * d.ld_dgu,
                          d.ld_dgu, count, r, t.c0, t.c1, io_.grad_gate_up_b + e * r * 2 * d.I, 2 * d.I);
  }
}

void Backward::lay_back_lora_b() const {
  const Dims& d = d_;
  if (io_peft_.grad_gate_up_b) {
    rows_to_peft_b(io_.grad_gate_up_b, 2 * d.I, gate_up_lora_.rank, d.E, routing_.offsets, io_peft_.grad_gate_up_b,
                   pool_, io_.lora_grad_slots, io_.lora_grad_experts);
  }
  if (io_peft_.grad_down_b) {
    rows_to_peft_b(io_.grad_down_b, d.H, down_lora_.rank, d.E, routing_.offsets, io_peft_.grad_down_b, pool_,
                   io_.lora_grad_slots, io_.lora_grad_experts);
  }
}

void Backward::sum_slots_per_token() const {
  sum_slots(d_, per_pair_, nullptr, io_.grad_hidden, io_.grad_hidden_bf16, pool_);
}

// Every expert with routed rows has a block of its own among the lora_grad_experts: a shared or missing one would
// race two experts' accumulations, or write past the caller's buffers.
void check_lora_grad_slots(const ExpertShapes& shapes, const Routing& routing, const BackwardIo& io) {
  if (io.lora_grad_slots == nullptr) return;
  std::vector<char> taken(static_cast<size_t>(std::max<int64_t>(io.lora_grad_experts, 0)), 0);
  for (int64_t e = 0; e < shapes.experts; ++e) {
    if (routing.offsets[e + 1] == routing.offsets[e]) continue;
    const int64_t slot = io.lora_grad_slots[e];
    if (slot < 0 || slot >= io.lora_grad_experts || taken[static_cast<size_t>(slot)]) {
      throw std::invalid_argument("LoRA gradient blocks: routed expert " + std::to_string(e) + " has block " +
                                  std::to_string(slot) + " of " + std::to_string(io.lora_grad_experts) +
                                  " (each routed expert needs a distinct block in range)");
    }
    taken[static_cast<size_t>(slot)] = 1;
  }
}

}  // namespace

void expert_ffn_backward(Isa isa, const ExpertShapes& shapes, const ExpertMatrices& weights,
                         const LoraFactors& gate_up_peft, const LoraFactors& down_peft, const Routing& routing,
                         const BackwardIo& io, const KernelTuning& tuning, moecc::pool::ThreadPool& pool) {
  check_tuning(tuning);
  check_matrices(shapes, weights);
  check_lora_grad_slots(shapes, routing, io);
  Scratch& scratch = shared_scratch();
  std::lock_guard<std::mutex> lock(scratch.mutex);
  PhaseClock clock(/*backward=*/true);
  const Backward backward(isa, shapes, weights, gate_up_peft, down_peft, routing, io, tuning, scratch, pool);
  clock.mark("relayout");
  backward.recompute_inner_products();
  clock.mark("activate");
  backward.output_grad_rows();
  clock.mark("grad_out");
  backward.down_input_grad();
  clock.mark("down_input_grad");
  backward.row_sums();
  clock.mark("row_sums");
  backward.gate_up_input_grad();
  clock.mark("gate_up_input_grad");
  backward.lora_factor_grads();
  clock.mark("lora_grads");
  backward.lay_back_lora_b();
  clock.mark("lora_b_layout");
  backward.sum_slots_per_token();
  clock.mark("sum_slots");
}

}  // namespace moecc::kernels
