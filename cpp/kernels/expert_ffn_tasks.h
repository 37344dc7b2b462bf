// Task building for the routed-expert FFN (expert_ffn.h): every phase splits its work into (expert, block of
// grouped rows[, block of output columns]) tasks and hands them out largest first from the pool's counter, so a hot
// expert is spread over all threads instead of landing on one. Also the call's derived sizes (Dims).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../pool/thread_pool.h"
#include "expert_ffn.h"
#include "weight_packing.h"

namespace moecc::kernels::ffn {

constexpr int64_t kTokenBlock = 64;  // rows per elementwise task

// Grouped rows [begin, end) of one expert, and a column range (units as the phase defines them: panels of 16 for
// the forward products, columns for the input gradients).
struct Task {
  int64_t expert, begin, end, col0, col1;
};

// (expert, row block, column block) tasks over `columns` outputs in steps of `step`, largest row blocks first
// (a stable sort: equal blocks keep expert order).
std::vector<Task> make_tasks(const int64_t* offsets, int64_t experts, int64_t columns, int64_t step,
                             int64_t block_rows = kTokenBlock);

template <typename Fn>
void run_tasks(moecc::pool::ThreadPool& pool, const std::vector<Task>& tasks, Fn&& fn) {
  pool.run(static_cast<int64_t>(tasks.size()), [&](int64_t i, int) { fn(tasks[i]); });
}

// Calls fn(sub) for the consecutive row blocks of `task` of at most `block` rows (0: one block), each a Task of
// the same expert and columns.
template <typename Fn>
void for_row_blocks(const Task& task, int64_t block, Fn&& fn) {
  const int64_t step = block > 0 ? block : task.end - task.begin;
  for (int64_t begin = task.begin; begin < task.end; begin += step) {
    fn(Task{task.expert, begin, std::min(task.end, begin + step), task.col0, task.col1});
  }
}

// Row strides of the grouped activation buffers are padded K plus one cache line: rows a multiple of 4 KB apart
// map to the same L1 set, and a 16-row AMX tile load (or 8 broadcast streams) would then thrash it.
constexpr int64_t kRowPad = 32;

// The call's sizes: pairs = T*k; *_size the elements of one expert's matrix; ld_* the padded row strides (bf16
// values) of the grouped hidden rows (x), activations, output-gradient rows (dy) and gate/up gradients (dG).
struct Dims {
  int64_t E, H, I, T, k, pairs, h_k, i_k, gu_size, down_size, ld_x, ld_act, ld_dy, ld_dgu;
  explicit Dims(const ExpertShapes& s)
      : E(s.experts), H(s.hidden), I(s.inter), T(s.tokens), k(s.top_k), pairs(s.tokens * s.top_k),
        h_k(padded_k(s.hidden)), i_k(padded_k(s.inter)), gu_size(2 * s.inter * s.hidden),
        down_size(s.hidden * s.inter), ld_x(h_k + kRowPad), ld_act(i_k + kRowPad),
        ld_dy(padded_k(s.hidden) + kRowPad), ld_dgu(padded_k(2 * s.inter) + kRowPad) {}
};

}  // namespace moecc::kernels::ffn
