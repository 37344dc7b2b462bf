// Orchestration of the routed-expert FFN (see expert_ffn.h): phases of independent tasks on the pool.
//
// Every phase splits work into (expert, block of up to kTokenBlock grouped rows[, block of output columns])
// tasks, hands them out largest first from the pool's atomic counter, so a hot expert is spread over all
// threads instead of landing on one. Products against base weights go through PanelGemm (ISA-specific);
// the rank-r LoRA terms and elementwise steps are plain loops the compiler vectorises.
#include "expert_ffn.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "../pool/thread_pool.h"
#include "weight_packing.h"

namespace moecc::kernels {
namespace {

constexpr int64_t kTokenBlock = 64;
constexpr int64_t kPanelsPerTask = 4;     // 64 output columns per forward product task
constexpr int64_t kGradColumnsPerTask = 64;

struct Task {
  int64_t expert, begin, end, col0, col1;
};

// (expert, row block, column block) tasks over `columns` outputs in steps of `step`, largest row blocks first.
std::vector<Task> make_tasks(const int64_t* offsets, int64_t experts, int64_t columns, int64_t step) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t begin = offsets[e]; begin < offsets[e + 1]; begin += kTokenBlock) {
      const int64_t end = std::min(offsets[e + 1], begin + kTokenBlock);
      for (int64_t c = 0; c < columns; c += step) tasks.push_back({e, begin, end, c, std::min(columns, c + step)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.end - a.begin > b.end - b.begin; });
  return tasks;
}

template <typename Fn>
void run_tasks(moecc::pool::ThreadPool& pool, const std::vector<Task>& tasks, Fn&& fn) {
  pool.run(static_cast<int64_t>(tasks.size()), [&](int64_t i, int) { fn(tasks[i]); });
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// inner[g][r] = sum_c in(g, c) * a[r][c] for rows of one task; `in` reads a row element as float.
template <typename Row>
void lora_inner(const LoraFactors& lora, int64_t expert, int64_t in_features, const Task& task, Row&& row,
                float* inner) {
  const float* a = lora.a + expert * lora.rank * in_features;
  for (int64_t g = task.begin; g < task.end; ++g) {
    for (int64_t r = 0; r < lora.rank; ++r) {
      float acc = 0.0f;
      const float* a_row = a + r * in_features;
      for (int64_t c = 0; c < in_features; ++c) acc += row(g, c) * a_row[c];
      inner[g * lora.rank + r] = acc;
    }
  }
}

// value + s * sum_r inner[g][r] * b[col][r], the LoRA term of one output.
inline float add_lora(const LoraFactors& lora, int64_t expert, int64_t out_features, const float* inner_row,
                      int64_t col, float value) {
  if (lora.a == nullptr) return value;
  const float* b = lora.b + (expert * out_features + col) * lora.rank;
  float acc = 0.0f;
  for (int64_t r = 0; r < lora.rank; ++r) acc += inner_row[r] * b[r];
  return value + lora.scaling * acc;
}

struct Dims {
  int64_t E, H, I, T, k, pairs, h_k, i_k, gu_packed, down_packed;
  explicit Dims(const ExpertShapes& s)
      : E(s.experts), H(s.hidden), I(s.inter), T(s.tokens), k(s.top_k), pairs(s.tokens * s.top_k),
        h_k(padded_k(s.hidden)), i_k(padded_k(s.inter)), gu_packed(packed_elements(2 * s.inter, s.hidden)),
        down_packed(packed_elements(s.hidden, s.inter)) {}
};

// Gathers each grouped row's hidden state (bf16, zero-padded to h_k) and its gate_up LoRA inner product.
void gather_hidden(const Dims& d, const Routing& routing, const uint16_t* hidden, const LoraFactors& lora,
                   const std::vector<Task>& rows, std::vector<uint16_t>& xg, std::vector<float>& inner,
                   moecc::pool::ThreadPool& pool) {
  run_tasks(pool, rows, [&](const Task& task) {
    for (int64_t g = task.begin; g < task.end; ++g) {
      const uint16_t* src = hidden + (routing.order[g] / d.k) * d.H;
      std::copy(src, src + d.H, xg.data() + g * d.h_k);
    }
    if (lora.a) {
      lora_inner(lora, task.expert, d.H, task, [&](int64_t g, int64_t c) { return bf16_to_float(xg[g * d.h_k + c]); },
                 inner.data());
    }
  });
}

// act = round(round(silu(gate)) * up) in bf16, as a bf16 pipeline computes it, plus its down LoRA inner product.
void activate(const Dims& d, const uint16_t* gate_up_out, const LoraFactors& lora, const std::vector<Task>& rows,
              std::vector<uint16_t>& act, std::vector<float>& inner, moecc::pool::ThreadPool& pool) {
  run_tasks(pool, rows, [&](const Task& task) {
    for (int64_t g = task.begin; g < task.end; ++g) {
      const uint16_t* gu = gate_up_out + g * 2 * d.I;
      for (int64_t i = 0; i < d.I; ++i) {
        const float gate = bf16_to_float(gu[i]), up = bf16_to_float(gu[d.I + i]);
        act[g * d.i_k + i] = float_to_bf16(round_bf16(silu(gate)) * up);
      }
    }
    if (lora.a) {
      lora_inner(lora, task.expert, d.I, task, [&](int64_t g, int64_t c) { return bf16_to_float(act[g * d.i_k + c]); },
                 inner.data());
    }
  });
}

// out[t] = sum over the token's k slots (in slot order) of per_pair[t*k + j].
void sum_slots(const Dims& d, const std::vector<float>& per_pair, float* out, moecc::pool::ThreadPool& pool) {
  const int64_t chunk = 16;
  pool.run((d.T + chunk - 1) / chunk, [&](int64_t c, int) {
    for (int64_t t = c * chunk; t < std::min(d.T, (c + 1) * chunk); ++t) {
      float* dst = out + t * d.H;
      std::fill(dst, dst + d.H, 0.0f);
      for (int64_t j = 0; j < d.k; ++j) {
        const float* src = per_pair.data() + (t * d.k + j) * d.H;
        for (int64_t h = 0; h < d.H; ++h) dst[h] += src[h];
      }
    }
  });
}

}  // namespace

void expert_ffn_forward(Isa isa, const ExpertShapes& shapes, const PackedExperts& weights,
                        const LoraFactors& gate_up_lora, const LoraFactors& down_lora, const Routing& routing,
                        const ForwardIo& io, moecc::pool::ThreadPool& pool) {
  const PanelGemm& gemm = panel_gemm(isa);
  const Dims d(shapes);
  const std::vector<Task> rows = make_tasks(routing.offsets, d.E, 1, 1);
  std::vector<uint16_t> xg(d.pairs * d.h_k, 0), act(d.pairs * d.i_k, 0);
  std::vector<float> inner_gu(d.pairs * std::max<int64_t>(gate_up_lora.rank, 1));
  std::vector<float> inner_down(d.pairs * std::max<int64_t>(down_lora.rank, 1));
  std::vector<float> per_pair(d.pairs * d.H);

  gather_hidden(d, routing, io.hidden, gate_up_lora, rows, xg, inner_gu, pool);

  const int64_t gu_panels = padded_rows(2 * d.I) / kPanelRows;
  run_tasks(pool, make_tasks(routing.offsets, d.E, gu_panels, kPanelsPerTask), [&](const Task& task) {
    thread_local std::vector<float> block;
    const int64_t n = task.end - task.begin, width = (task.col1 - task.col0) * kPanelRows;
    block.resize(n * width);
    gemm.forward(xg.data() + task.begin * d.h_k, d.h_k, n, weights.gate_up + task.expert * d.gu_packed, d.h_k,
                 task.col0, task.col1, block.data(), width);
    for (int64_t g = task.begin; g < task.end; ++g) {
      for (int64_t col = task.col0 * kPanelRows; col < std::min(2 * d.I, task.col1 * kPanelRows); ++col) {
        const float value = add_lora(gate_up_lora, task.expert, 2 * d.I, inner_gu.data() + g * gate_up_lora.rank,
                                     col, block[(g - task.begin) * width + col - task.col0 * kPanelRows]);
        io.gate_up_out[g * 2 * d.I + col] = float_to_bf16(value);
      }
    }
  });

  activate(d, io.gate_up_out, down_lora, rows, act, inner_down, pool);

  const int64_t down_panels = padded_rows(d.H) / kPanelRows;
  run_tasks(pool, make_tasks(routing.offsets, d.E, down_panels, kPanelsPerTask), [&](const Task& task) {
    thread_local std::vector<float> block;
    const int64_t n = task.end - task.begin, width = (task.col1 - task.col0) * kPanelRows;
    block.resize(n * width);
    gemm.forward(act.data() + task.begin * d.i_k, d.i_k, n, weights.down + task.expert * d.down_packed, d.i_k,
                 task.col0, task.col1, block.data(), width);
    for (int64_t g = task.begin; g < task.end; ++g) {
      const int64_t pair = routing.order[g];
      for (int64_t col = task.col0 * kPanelRows; col < std::min(d.H, task.col1 * kPanelRows); ++col) {
        const float y = add_lora(down_lora, task.expert, d.H, inner_down.data() + g * down_lora.rank, col,
                                 block[(g - task.begin) * width + col - task.col0 * kPanelRows]);
        per_pair[pair * d.H + col] = round_bf16(y) * routing.weights[pair];
      }
    }
  });

  sum_slots(d, per_pair, io.out, pool);
}

void expert_ffn_backward(Isa isa, const ExpertShapes& shapes, const PackedExperts& weights,
                         const LoraFactors& gate_up_lora, const LoraFactors& down_lora, const Routing& routing,
                         const BackwardIo& io, moecc::pool::ThreadPool& pool) {
  const PanelGemm& gemm = panel_gemm(isa);
  const Dims d(shapes);
  const int64_t h_rows = padded_rows(d.H), gu_rows = padded_rows(2 * d.I);
  const int64_t r_gu = std::max<int64_t>(gate_up_lora.rank, 1), r_d = std::max<int64_t>(down_lora.rank, 1);
  const std::vector<Task> rows = make_tasks(routing.offsets, d.E, 1, 1);
  std::vector<uint16_t> xg(d.pairs * d.h_k, 0), act(d.pairs * d.i_k, 0);
  std::vector<float> inner_gu(d.pairs * r_gu), inner_down(d.pairs * r_d), grad_inner_down(d.pairs * r_d);
  std::vector<float> grad_inner_gu(d.pairs * r_gu);
  std::vector<float> dy(d.pairs * h_rows, 0.0f), grad_act(d.pairs * d.i_k, 0.0f), grad_gu(d.pairs * gu_rows, 0.0f);
  std::vector<float> per_pair(d.pairs * d.H);

  gather_hidden(d, routing, io.hidden, gate_up_lora, rows, xg, inner_gu, pool);
  activate(d, io.gate_up_out, down_lora, rows, act, inner_down, pool);
  // Unweighted output gradient per grouped row, and its down-LoRA inner product s * dy B.
  run_tasks(pool, rows, [&](const Task& task) {
    for (int64_t g = task.begin; g < task.end; ++g) {
      const float* src = io.grad_out + (routing.order[g] / d.k) * d.H;
      std::copy(src, src + d.H, dy.data() + g * h_rows);
      if (!down_lora.a) continue;
      const float* b = down_lora.b + task.expert * d.H * down_lora.rank;
      for (int64_t r = 0; r < down_lora.rank; ++r) {
        float acc = 0.0f;
        for (int64_t h = 0; h < d.H; ++h) acc += dy[g * h_rows + h] * b[h * down_lora.rank + r];
        grad_inner_down[g * down_lora.rank + r] = down_lora.scaling * acc;
      }
    }
  });

  // d act (unweighted) = dy W_down + (s dy B) A.
  run_tasks(pool, make_tasks(routing.offsets, d.E, d.I, kGradColumnsPerTask), [&](const Task& task) {
    const int64_t n = task.end - task.begin, k1 = std::min(d.i_k, (task.col1 + 1) / 2 * 2);
    gemm.input_grad(dy.data() + task.begin * h_rows, h_rows, n, weights.down + task.expert * d.down_packed, h_rows,
                    d.i_k, task.col0, k1, grad_act.data() + task.begin * d.i_k, d.i_k);
    if (!down_lora.a) return;
    const float* a = down_lora.a + task.expert * down_lora.rank * d.I;
    for (int64_t g = task.begin; g < task.end; ++g) {
      for (int64_t i = task.col0; i < task.col1; ++i) {
        float acc = 0.0f;
        for (int64_t r = 0; r < down_lora.rank; ++r) acc += grad_inner_down[g * down_lora.rank + r] * a[r * d.I + i];
        grad_act[g * d.i_k + i] += acc;
      }
    }
  });

  // Routing-weight gradient, then d gate_up through the SwiGLU, and its gate_up-LoRA inner product s dG B.
  run_tasks(pool, rows, [&](const Task& task) {
    for (int64_t g = task.begin; g < task.end; ++g) {
      const int64_t pair = routing.order[g];
      const float w = routing.weights[pair];
      float dot = 0.0f;
      for (int64_t i = 0; i < d.I; ++i) dot += grad_act[g * d.i_k + i] * bf16_to_float(act[g * d.i_k + i]);
      io.grad_routing[pair] = dot;
      const uint16_t* gu = io.gate_up_out + g * 2 * d.I;
      for (int64_t i = 0; i < d.I; ++i) {
        const float gate = bf16_to_float(gu[i]), up = bf16_to_float(gu[d.I + i]), ga = grad_act[g * d.i_k + i] * w;
        const float sig = 1.0f / (1.0f + std::exp(-gate));
        grad_gu[g * gu_rows + i] = ga * up * sig * (1.0f + gate * (1.0f - sig));
        grad_gu[g * gu_rows + d.I + i] = ga * gate * sig;
      }
      if (!gate_up_lora.a) continue;
      const float* b = gate_up_lora.b + task.expert * 2 * d.I * gate_up_lora.rank;
      for (int64_t r = 0; r < gate_up_lora.rank; ++r) {
        float acc = 0.0f;
        for (int64_t c = 0; c < 2 * d.I; ++c) acc += grad_gu[g * gu_rows + c] * b[c * gate_up_lora.rank + r];
        grad_inner_gu[g * gate_up_lora.rank + r] = gate_up_lora.scaling * acc;
      }
    }
  });

  // d hidden per pair = dG W_gate_up + (s dG B) A.
  run_tasks(pool, make_tasks(routing.offsets, d.E, d.H, kGradColumnsPerTask), [&](const Task& task) {
    thread_local std::vector<float> block;
    const int64_t n = task.end - task.begin, width = task.col1 - task.col0;
    block.assign(n * d.h_k, 0.0f);
    gemm.input_grad(grad_gu.data() + task.begin * gu_rows, gu_rows, n, weights.gate_up + task.expert * d.gu_packed,
                    gu_rows, d.h_k, task.col0, task.col0 + (width + 1) / 2 * 2, block.data(), d.h_k);
    const float* a = gate_up_lora.a ? gate_up_lora.a + task.expert * gate_up_lora.rank * d.H : nullptr;
    for (int64_t g = task.begin; g < task.end; ++g) {
      const int64_t pair = routing.order[g];
      for (int64_t h = task.col0; h < task.col1; ++h) {
        float value = block[(g - task.begin) * d.h_k + h];
        if (a) {
          for (int64_t r = 0; r < gate_up_lora.rank; ++r) value += grad_inner_gu[g * gate_up_lora.rank + r] * a[r * d.H + h];
        }
        per_pair[pair * d.H + h] = value;
      }
    }
  });

  // LoRA factor gradients, one task per (expert, factor): sums over the expert's rows.
  if (gate_up_lora.a || down_lora.a) {
    pool.run(d.E * 4, [&](int64_t id, int) {
      const int64_t e = id / 4, which = id % 4, begin = routing.offsets[e], end = routing.offsets[e + 1];
      if (begin == end) return;
      if (which == 0 && down_lora.a) {  // dA_down[r][i] = sum_g w * (s dy B)[g][r] * act[g][i]
        float* out = io.grad_down_a + e * down_lora.rank * d.I;
        for (int64_t g = begin; g < end; ++g) {
          const float w = routing.weights[routing.order[g]];
          for (int64_t r = 0; r < down_lora.rank; ++r) {
            const float coef = w * grad_inner_down[g * down_lora.rank + r];
            for (int64_t i = 0; i < d.I; ++i) out[r * d.I + i] += coef * bf16_to_float(act[g * d.i_k + i]);
          }
        }
      } else if (which == 1 && down_lora.a) {  // dB_down[h][r] = s sum_g w * dy[g][h] * (act A)[g][r]
        float* out = io.grad_down_b + e * d.H * down_lora.rank;
        for (int64_t g = begin; g < end; ++g) {
          const float w = routing.weights[routing.order[g]] * down_lora.scaling;
          for (int64_t h = 0; h < d.H; ++h) {
            const float coef = w * dy[g * h_rows + h];
            for (int64_t r = 0; r < down_lora.rank; ++r) out[h * down_lora.rank + r] += coef * inner_down[g * down_lora.rank + r];
          }
        }
      } else if (which == 2 && gate_up_lora.a) {  // dA_gu[r][h] = sum_g (s dG B)[g][r] * x[g][h]
        float* out = io.grad_gate_up_a + e * gate_up_lora.rank * d.H;
        for (int64_t g = begin; g < end; ++g) {
          for (int64_t r = 0; r < gate_up_lora.rank; ++r) {
            const float coef = grad_inner_gu[g * gate_up_lora.rank + r];
            for (int64_t h = 0; h < d.H; ++h) out[r * d.H + h] += coef * bf16_to_float(xg[g * d.h_k + h]);
          }
        }
      } else if (which == 3 && gate_up_lora.a) {  // dB_gu[c][r] = s sum_g dG[g][c] * (x A)[g][r]
        float* out = io.grad_gate_up_b + e * 2 * d.I * gate_up_lora.rank;
        for (int64_t g = begin; g < end; ++g) {
          for (int64_t c = 0; c < 2 * d.I; ++c) {
            const float coef = gate_up_lora.scaling * grad_gu[g * gu_rows + c];
            for (int64_t r = 0; r < gate_up_lora.rank; ++r) out[c * gate_up_lora.rank + r] += coef * inner_gu[g * gate_up_lora.rank + r];
          }
        }
      }
    });
  }

  sum_slots(d, per_pair, io.grad_hidden, pool);
}

}  // namespace moecc::kernels
