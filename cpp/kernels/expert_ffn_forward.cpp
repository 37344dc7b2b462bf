// The forward of the routed-expert FFN (expert_ffn.h), in phases of independent tasks on the pool: gather the
// grouped hidden rows, the gate/up product, the activation, the down product (a bf16 row per pair), the sums over
// each token's slots. Buffers are the shared scratch (expert_ffn_common.h); the gate/up output goes to the caller,
// which keeps it for backward.
#include <algorithm>
#include <mutex>
#include <vector>

#include "expert_ffn.h"
#include "expert_ffn_common.h"
#include "expert_ffn_products.h"
#include "expert_ffn_profile.h"
#include "expert_ffn_tasks.h"

namespace moecc::kernels {

using namespace ffn;

void expert_ffn_forward(Isa isa, const ExpertShapes& shapes, const ExpertMatrices& weights,
                        const LoraFactors& gate_up_peft, const LoraFactors& down_peft, const Routing& routing,
                        const ForwardIo& io, const KernelTuning& tuning, moecc::pool::ThreadPool& pool) {
  check_tuning(tuning);
  check_matrices(shapes, weights);
  Scratch& scratch = shared_scratch();
  std::lock_guard<std::mutex> lock(scratch.mutex);
  PhaseClock clock(/*backward=*/false);
  const PanelGemm& gemm = panel_gemm(isa);
  const Dims d(shapes);
  const int64_t task_rows = tuning.rows_per_task, block_rows = tuning.block_rows;
  const int64_t stream_outputs = tuning.streaming_outputs;
  const LoraFactors gate_up_lora = with_rows_of_b(gate_up_peft, 2 * d.I, d.E, routing.offsets, scratch.b_gu, pool);
  const LoraFactors down_lora = with_rows_of_b(down_peft, d.H, d.E, routing.offsets, scratch.b_down, pool);
  clock.mark("relayout");
  const std::vector<Task> rows = make_tasks(routing.offsets, d.E, 1, 1);
  uint16_t* xg = scratch.xg.get(d.pairs * d.ld_x);        // [pairs, ld_x] grouped hidden rows
  uint16_t* act = scratch.act.get(d.pairs * d.ld_act);    // [pairs, ld_act]
  float* inner_gu = io.inner_gate_up ? io.inner_gate_up    // [pairs, r_gu]
                                     : scratch.inner_gu.get(d.pairs * std::max<int64_t>(gate_up_lora.rank, 1));
  float* inner_down = io.inner_down ? io.inner_down        // [pairs, r_down]
                                    : scratch.inner_down.get(d.pairs * std::max<int64_t>(down_lora.rank, 1));
  uint16_t* per_pair = scratch.per_pair.get(d.pairs * d.H);  // [T*k, H] by pair id

  gather_hidden(d, routing, io.hidden, gate_up_lora, rows, xg, inner_gu, tuning.streaming_copies, pool,
                io.hidden_copy);
  clock.mark("gather");

  const int64_t gu_panels = padded_rows(2 * d.I) / kPanelRows;
  const std::vector<Task> gu_tasks = make_tasks(routing.offsets, d.E, gu_panels, tuning.panels_per_task, task_rows);
  PartClocks gu_clocks;
  run_tasks(pool, gu_tasks, [&](const Task& task) {
    forward_product(gemm, task, block_rows, xg, d.ld_x, gate_up_weight(weights, d, task.expert),
                    weights.packed_gate_up, 2 * d.I, d.H, gate_up_lora, inner_gu, (stream_outputs & 2) != 0,
                    tuning.gemm, gu_clocks, [&](int64_t g) { return io.gate_up_out + g * 2 * d.I; });
  });
  record_parts(/*backward=*/false, "gate_up", gu_clocks);
  clock.mark("gate_up");

  activate(d, io.gate_up_out, down_lora, rows, act, inner_down, (stream_outputs & 4) != 0, pool);
  clock.mark("activate");

  const int64_t down_panels = padded_rows(d.H) / kPanelRows;
  const std::vector<Task> down_tasks =
      make_tasks(routing.offsets, d.E, down_panels, tuning.panels_per_task, task_rows);
  PartClocks down_clocks;
  run_tasks(pool, down_tasks, [&](const Task& task) {
    forward_product(gemm, task, block_rows, act, d.ld_act, down_weight(weights, d, task.expert),
                    weights.packed_down, d.H, d.I, down_lora, inner_down, (stream_outputs & 1) != 0, tuning.gemm,
                    down_clocks, [&](int64_t g) { return per_pair + routing.order[g] * d.H; });
  });
  record_parts(/*backward=*/false, "down", down_clocks);
  clock.mark("down");

  sum_slots(d, per_pair, routing.weights, io.out, io.out_bf16, pool);
  clock.mark("sum_slots");
}

}  // namespace moecc::kernels
