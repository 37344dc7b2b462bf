// Orchestration of the routed-expert FFN (see expert_ffn.h): phases of independent tasks on the pool.
//
// Every phase splits work into (expert, block of grouped rows[, block of output columns]) tasks (kTokenBlock
// rows for the elementwise phases, KernelTuning::rows_per_task for the products), hands them out largest first
// from the pool's atomic counter, so a hot expert is spread over all threads instead of landing on one. Products
// against base weights go through PanelGemm (ISA-specific); the rank-r LoRA terms and elementwise steps are plain
// loops the compiler vectorises.
#include "expert_ffn.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "../pool/thread_pool.h"
#include "aligned_buffer.h"
#include "lora_products.h"
#include "swiglu.h"
#include "vector16.h"
#include "weight_packing.h"

namespace moecc::kernels {
namespace {

constexpr int64_t kTokenBlock = 64;       // rows per elementwise task
struct Task {
  int64_t expert, begin, end, col0, col1;
};

// Calls fn(sub) for the consecutive row blocks of `task` of at most `block` rows (0: one block), each a Task of
// the same expert and columns.
template <typename Fn>
void for_row_blocks(const Task& task, int64_t block, Fn&& fn) {
  const int64_t step = block > 0 ? block : task.end - task.begin;
  for (int64_t begin = task.begin; begin < task.end; begin += step) {
    fn(Task{task.expert, begin, std::min(task.end, begin + step), task.col0, task.col1});
  }
}

// (expert, row block, column block) tasks over `columns` outputs in steps of `step`, largest row blocks first.
std::vector<Task> make_tasks(const int64_t* offsets, int64_t experts, int64_t columns, int64_t step,
                             int64_t block_rows = kTokenBlock) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t begin = offsets[e]; begin < offsets[e + 1]; begin += block_rows) {
      const int64_t end = std::min(offsets[e + 1], begin + block_rows);
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

// Vector primitives for the elementwise steps, built with MOECC_VECTOR_CLONES (vector16.h): an AVX512 and a
// baseline copy of each, one picked at load time from the running CPU, so no code here assumes AVX512.

// y += bf16(x) * coef, the product rounded to float32 before the sum, as when the forward applied the routing
// weight per pair: GCC and clang contract C++ into FMAs by default (GCC did in the scalar tail), so contraction is off
// here (clang has no optimize attribute; its pragma does the same).
#if defined(__clang__)
#define MOECC_NO_FP_CONTRACT
#else
#define MOECC_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif
MOECC_NO_FP_CONTRACT MOECC_VECTOR_CLONES void axpy_bf16(float coef, const uint16_t* x, float* y, int64_t n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += bf16_to_float(x[i]) * coef;
}

MOECC_VECTOR_CLONES void to_bf16(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

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
void lora_inner(const LoraFactors& lora, int64_t expert, int64_t in_features, const Task& task, const uint16_t* rows,
                int64_t ld, float* inner) {
  rank_dots_rows(rows + task.begin * ld, ld, lora.a + expert * lora.rank * in_features, in_features, lora.rank,
                 in_features, 1.0f, inner + task.begin * lora.rank, lora.rank, task.end - task.begin);
}

// Row strides of the grouped activation buffers are padded K plus one cache line: rows a multiple of 4 KB apart
// map to the same L1 set, and a 16-row AMX tile load (or 8 broadcast streams) would then thrash it.
constexpr int64_t kRowPad = 32;

struct Dims {
  int64_t E, H, I, T, k, pairs, h_k, i_k, gu_size, down_size, ld_x, ld_act, ld_dy, ld_dgu;
  explicit Dims(const ExpertShapes& s)
      : E(s.experts), H(s.hidden), I(s.inter), T(s.tokens), k(s.top_k), pairs(s.tokens * s.top_k),
        h_k(padded_k(s.hidden)), i_k(padded_k(s.inter)), gu_size(2 * s.inter * s.hidden),
        down_size(s.hidden * s.inter), ld_x(h_k + kRowPad), ld_act(i_k + kRowPad),
        ld_dy(padded_k(s.hidden) + kRowPad), ld_dgu(padded_k(2 * s.inter) + kRowPad) {}
};

// dst[0, n) = src[0, n) and dst[n, padded) = 0 (bf16; dst 64-byte aligned, padded a multiple of 32), in whole
// cache lines of non-temporal stores; the partial line's masked load reads nothing past src[n), and no pointer past
// it is formed.
__attribute__((target("avx512f,avx512bw"))) void stream_row(const uint16_t* src, int64_t n, uint16_t* dst,
                                                           int64_t padded) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  }
  if (i < n) {
    const __mmask32 mask = (__mmask32{1} << (n - i)) - 1;
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_maskz_loadu_epi16(mask, src + i));
    i += 32;
  }
  for (; i < padded; i += 32) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_setzero_si512());
}

// Copies a row into its zero-padded grouped row (ld values), streamed when `stream` and the CPU has AVX512BW (then
// `streamed` is set and the caller fences before the phase ends).
inline void copy_row(const uint16_t* src, int64_t n, uint16_t* dst, int64_t ld, bool stream, bool& streamed) {
  static const bool avx512bw = __builtin_cpu_supports("avx512bw");
  if (avx512bw && stream) {
    stream_row(src, n, dst, ld);
    streamed = true;
    return;
  }
  std::copy(src, src + n, dst);
  std::fill(dst + n, dst + ld, uint16_t{0});
}

// Orders a task's non-temporal stores before what follows (the pool's hand-over to the next phase).
inline void fence_streamed(bool streamed) {
  if (streamed) _mm_sfence();
}

// Grouped hidden rows (zero-padded) and their gate/up LoRA inner product (from the token row, as the copy may have
// bypassed the cache); with `hidden_copy`, each token's row is also copied there once (by its slot-0 pair), in
// parallel and while the row is in cache.
void gather_hidden(const Dims& d, const Routing& routing, const uint16_t* hidden, const LoraFactors& lora,
                   const std::vector<Task>& rows, uint16_t* xg, float* inner, bool stream,
                   moecc::pool::ThreadPool& pool, uint16_t* hidden_copy = nullptr) {
  run_tasks(pool, rows, [&](const Task& task) {
    bool streamed = false;
    for (int64_t g = task.begin; g < task.end; ++g) {
      const int64_t token = routing.order[g] / d.k;
      const uint16_t* src = hidden + token * d.H;
      copy_row(src, d.H, xg + g * d.ld_x, d.ld_x, stream, streamed);
      if (hidden_copy && routing.order[g] % d.k == 0) std::copy(src, src + d.H, hidden_copy + token * d.H);
    }
    if (lora.a) {
      lora_inner(lora, task.expert, d.H, task, [&](int64_t g) { return hidden + routing.order[g] / d.k * d.H; },
                 inner);
    }
    fence_streamed(streamed);
  });
}

// act = round(round(silu(gate)) * up) in bf16, as a bf16 pipeline computes it, plus its down LoRA inner product.
// With `stream` (KernelTuning::streaming_outputs bit 4) each row is computed into a cached thread-local row, its
// LoRA inner product taken from there, and the row streamed out (the same values).
void activate(const Dims& d, const uint16_t* gate_up_out, const LoraFactors& lora, const std::vector<Task>& rows,
              uint16_t* act, float* inner, bool stream, moecc::pool::ThreadPool& pool) {
  run_tasks(pool, rows, [&](const Task& task) {
    if (stream) {
      thread_local AlignedBuffer<uint16_t> staged;
      uint16_t* const row = staged.get(d.I);
      const float* a = lora.a ? lora.a + task.expert * lora.rank * d.I : nullptr;
      bool streamed = false;
      for (int64_t g = task.begin; g < task.end; ++g) {
        const uint16_t* gu = gate_up_out + g * 2 * d.I;
        swiglu_forward_row(gu, gu + d.I, row, d.I);
        if (a) rank_dots(row, a, lora.rank, d.I, 1.0f, inner + g * lora.rank);
        copy_row(row, d.I, act + g * d.ld_act, d.ld_act, true, streamed);
      }
      fence_streamed(streamed);
      return;
    }
    for (int64_t g = task.begin; g < task.end; ++g) {
      const uint16_t* gu = gate_up_out + g * 2 * d.I;
      swiglu_forward_row(gu, gu + d.I, act + g * d.ld_act, d.I);
      std::fill(act + g * d.ld_act + d.I, act + (g + 1) * d.ld_act, uint16_t{0});
    }
    if (lora.a) {
      lora_inner(lora, task.expert, d.I, task, act, d.ld_act, inner);
    }
  });
}

// out[t] = sum over the token's k slots (in slot order) of per_pair[t*k + j] (bf16) times its routing weight
// (1 without `weights`), into float32 `out` or, when it is null, rounded once into bf16 `out_bf16` (the model's
// dtype: no float32 copy for the caller to convert). The per-pair rows are bf16, as a bf16 pipeline rounds each
// expert's product, which halves the traffic of the largest buffer of a call (per pair a whole hidden row: 0.5 GB
// in float32 at 8192 tokens for Qwen3-30B-A3B); the forward's weighting here is the same float32 product it was
// when applied per pair.
// The rows are added one at a time into a float32 row (in L1), each read in order: k streams at once in registers
// were slower (benchmarks/results/README.md, local measurements).
void sum_slots(const Dims& d, const uint16_t* per_pair, const float* weights, float* out, uint16_t* out_bf16,
               moecc::pool::ThreadPool& pool) {
  const int64_t chunk = 16;
  pool.run((d.T + chunk - 1) / chunk, [&](int64_t c, int) {
    thread_local AlignedBuffer<float> row;
    float* const sum = out ? nullptr : row.get(d.H);
    for (int64_t t = c * chunk; t < std::min(d.T, (c + 1) * chunk); ++t) {
      float* dst = out ? out + t * d.H : sum;
      std::fill(dst, dst + d.H, 0.0f);
      for (int64_t j = 0; j < d.k; ++j) {
        const int64_t pair = t * d.k + j;
        axpy_bf16(weights ? weights[pair] : 1.0f, per_pair + pair * d.H, dst, d.H);
      }
      if (!out) to_bf16(sum, out_bf16 + t * d.H, d.H);
    }
  });
}

// PEFT's B [out, r*E] (column j*E + e) <-> B^T [E, r, out]. Tasks are blocks of kRelayoutRows output rows; within
// one, tiles of kRelayoutExperts experts: a tile's reads and writes (kRelayoutRows x kRelayoutExperts values, 4 KB)
// stay in L1 while it is transposed; walking all E experts per output row touched E x r lines of B^T per row,
// more than L1 holds (benchmarks/results/README.md, local measurements).
constexpr int64_t kRelayoutRows = 64;
constexpr int64_t kRelayoutExperts = 16;

// Copies `from` into `to`, one layout into the other: kToRows, B -> B^T; else B^T -> B.
template <bool kToRows>
void relayout_b(const float* from, int64_t out, int64_t rank, int64_t experts, float* to,
                moecc::pool::ThreadPool& pool) {
  const int64_t columns = rank * experts;
  pool.run((out + kRelayoutRows - 1) / kRelayoutRows, [&](int64_t block, int) {
    const int64_t o0 = block * kRelayoutRows, o1 = std::min(out, o0 + kRelayoutRows);
    for (int64_t j = 0; j < rank; ++j) {
      for (int64_t e0 = 0; e0 < experts; e0 += kRelayoutExperts) {
        const int64_t e1 = std::min(experts, e0 + kRelayoutExperts);
        if (kToRows) {  // contiguous runs of B^T rows written, 64-byte runs of B rows read
          for (int64_t e = e0; e < e1; ++e) {
            float* dst = to + (e * rank + j) * out;
            for (int64_t o = o0; o < o1; ++o) dst[o] = from[o * columns + j * experts + e];
          }
        } else {  // 64-byte runs of B rows written, the tile's B^T rows read
          for (int64_t o = o0; o < o1; ++o) {
            float* dst = to + o * columns + j * experts;
            for (int64_t e = e0; e < e1; ++e) dst[e] = from[(e * rank + j) * out + o];
          }
        }
      }
    }
  });
}

void peft_b_to_rows(const float* b, int64_t out, int64_t rank, int64_t experts, float* b_t,
                    moecc::pool::ThreadPool& pool) {
  relayout_b<true>(b, out, rank, experts, b_t, pool);
}

void rows_to_peft_b(const float* b_t, int64_t out, int64_t rank, int64_t experts, float* b,
                    moecc::pool::ThreadPool& pool) {
  relayout_b<false>(b_t, out, rank, experts, b, pool);
}

// The factors with B re-laid into `b_t` (scratch), as the loops below read them.
LoraFactors with_rows_of_b(const LoraFactors& lora, int64_t out, int64_t experts, AlignedBuffer<float>& b_t,
                           moecc::pool::ThreadPool& pool) {
  if (lora.a == nullptr) return lora;
  LoraFactors relaid = lora;
  float* rows = b_t.get(experts * lora.rank * out);
  peft_b_to_rows(lora.b, out, lora.rank, experts, rows, pool);
  relaid.b = rows;
  return relaid;
}

// Seconds per phase of the latest call, for benchmarks to show where the time goes. The lists are read by
// last_phase_times from any thread, also while a call on another thread (GIL released) is writing them.
std::mutex phase_times_mutex;

class PhaseClock {
 public:
  // Clears `times` and `parts` (the product phases' per-part thread times) together, so a reader never sees one
  // call's phases beside another's parts.
  PhaseClock(PhaseTimes& times, std::vector<ProductParts>& parts)
      : times_(times), last_(std::chrono::steady_clock::now()) {
    std::lock_guard<std::mutex> lock(phase_times_mutex);
    times_.clear();
    parts.clear();
  }
  void mark(const char* phase) {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(phase_times_mutex);
    times_.emplace_back(phase, std::chrono::duration<double>(now - last_).count());
    last_ = now;
  }

 private:
  PhaseTimes& times_;
  std::chrono::steady_clock::time_point last_;
};

PhaseTimes forward_times, backward_times;
std::vector<ProductParts> forward_parts, backward_parts;

// Nanoseconds the threads of one product phase spent in each part of its tasks.
struct PartClocks {
  std::atomic<int64_t> pack{0}, gemm{0}, epilogue{0};
};

// Runs fn() and adds the nanoseconds it took to `total`.
template <typename Fn>
void timed(std::atomic<int64_t>& total, Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  total += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

void record_parts(std::vector<ProductParts>& list, const char* phase, const PartClocks& clocks) {
  std::lock_guard<std::mutex> lock(phase_times_mutex);
  list.push_back({phase, clocks.pack.load() * 1e-9, clocks.gemm.load() * 1e-9, clocks.epilogue.load() * 1e-9});
}

}  // namespace

PhaseTimes last_phase_times(bool backward) {
  std::lock_guard<std::mutex> lock(phase_times_mutex);
  return backward ? backward_times : forward_times;
}

std::vector<ProductParts> last_product_parts(bool backward) {
  std::lock_guard<std::mutex> lock(phase_times_mutex);
  return backward ? backward_parts : forward_parts;
}

namespace {

// One set of buffers for forward and backward: the engine runs one layer call at a time, so the buffers both
// need (gathered rows, activations, gradients, per-pair outputs: about 17.5 KB per routed pair for Qwen3-30B-A3B,
// plus the LoRA re-layouts) are held once; the mutex keeps concurrent callers correct anyway.
struct Scratch {
  std::mutex mutex;
  AlignedBuffer<uint16_t> xg, act, dy_bf16, grad_gu_bf16, per_pair;
  AlignedBuffer<float> inner_gu, inner_down, grad_inner_gu, grad_inner_down, routing_parts, inner_gu_parts,
      row_weight, b_gu, b_down, grad_b_gu, grad_b_down;
};

Scratch& shared_scratch() {
  static Scratch scratch;
  return scratch;
}

// The panels [task.col0, task.col1) of the task's expert's W [n, k] (row-major at `w`) that a forward product
// reads: in the packed copy of all experts when there is one (ExpertMatrices), else packed now into `scratch`.
const uint16_t* weight_slice(const PanelGemm& gemm, const uint16_t* w, const uint16_t* packed, const Task& task,
                             int64_t n, int64_t k, AlignedBuffer<uint16_t>& scratch) {
  const int64_t k_padded = padded_k(k);
  if (packed) return packed + task.expert * packed_elements(n, k) + task.col0 * kPanelRows * k_padded;
  uint16_t* const slice = scratch.get((task.col1 - task.col0) * kPanelRows * k_padded);
  gemm.pack_rows(w, n, k, task.col0, task.col1, slice);
  return slice;
}

// The LoRA term and bf16 rounding of a block's tile rows (rows_ld apart) into out(g) for its grouped rows g, a few
// rows a call (rank_combine_bf16_rows: the factors loaded once for them). coef: the inner products [g][coef_ld].
template <typename OutOf>
void combine_rows(const Task& rows_block, const float* coef, int64_t coef_ld, float scale, const float* factors,
                  int64_t ld, int64_t rank, int64_t n, const float* tile, int64_t rows_ld, OutOf out_of, bool stream) {
  constexpr int64_t kRows = 16;
  uint16_t* outs[kRows];
  for (int64_t g0 = rows_block.begin; g0 < rows_block.end; g0 += kRows) {
    const int64_t count = std::min(kRows, rows_block.end - g0);
    for (int64_t r = 0; r < count; ++r) outs[r] = out_of(g0 + r);
    rank_combine_bf16_rows(coef ? coef + g0 * coef_ld : nullptr, coef_ld, scale, factors, ld, rank, n,
                           tile + (g0 - rows_block.begin) * rows_ld, rows_ld, outs, count, stream);
  }
}

// A forward product task: the task's panels of W [n, k] (from `packed`, or packed now) against the grouped rows
// x by row blocks (KernelTuning::block_rows), each block's tile getting its LoRA term and leaving in bf16 at
// out_row(g) + the task's first column.
template <typename OutRow>
void forward_product(const PanelGemm& gemm, const Task& task, int64_t block_rows, const uint16_t* x, int64_t ld_x,
                     const uint16_t* w, const uint16_t* packed, int64_t n, int64_t k, const LoraFactors& lora,
                     const float* inner, bool stream, const GemmTuning& tuning, PartClocks& clocks, OutRow out_row) {
  thread_local AlignedBuffer<float> block;
  thread_local AlignedBuffer<uint16_t> panels;
  const int64_t width = (task.col1 - task.col0) * kPanelRows;
  const int64_t col0 = task.col0 * kPanelRows, col1 = std::min(n, task.col1 * kPanelRows);
  const uint16_t* slice = nullptr;
  timed(clocks.pack, [&] { slice = weight_slice(gemm, w, packed, task, n, k, panels); });
  // The LoRA term s (x A) B^T, added in the same pass over each row as the bf16 rounding.
  const float* const b_t = lora.a ? lora.b + task.expert * lora.rank * n + col0 : nullptr;
  for_row_blocks(task, block_rows, [&](const Task& rows_block) {
    const int64_t rows = rows_block.end - rows_block.begin;
    float* const tile = block.get(rows * width);
    timed(clocks.gemm, [&] {
      gemm.forward(x + rows_block.begin * ld_x, ld_x, rows, slice, padded_k(k), 0, task.col1 - task.col0, tile,
                   width, tuning);
    });
    timed(clocks.epilogue, [&] {
      combine_rows(rows_block, b_t ? inner : nullptr, lora.rank, lora.scaling, b_t, n, b_t ? lora.rank : 0,
                   col1 - col0, tile, width, [&](int64_t g) { return out_row(g) + col0; }, stream);
    });
  });
  fence_streamed(stream);
}

// An input-gradient task: W's [n, k] columns [task.col0, task.col1) packed once, then dx = dy W for them by row
// blocks, each block's tile (rows x ld floats, ld the columns rounded up to 16; column 0 = W's column col0) handed
// to epilogue(rows_block, tile, ld).
template <typename Epilogue>
void input_grad_product(const PanelGemm& gemm, const Task& task, int64_t block_rows, const uint16_t* dy,
                        int64_t ld_dy, const uint16_t* w, int64_t n, int64_t k, const GemmTuning& tuning,
                        PartClocks& clocks, Epilogue&& epilogue) {
  thread_local AlignedBuffer<float> block;
  thread_local AlignedBuffer<uint16_t> columns;
  const int64_t chunks = column_chunks(task.col0, task.col1), ld = chunks * kPanelRows;
  uint16_t* const packed = columns.get(column_panel_elements(n, task.col0, task.col1));
  timed(clocks.pack, [&] { gemm.pack_columns(w, n, k, task.col0, task.col1, packed, tuning); });
  for_row_blocks(task, block_rows, [&](const Task& rows_block) {
    const int64_t rows = rows_block.end - rows_block.begin;
    float* const tile = block.get(rows * ld);
    timed(clocks.gemm,
          [&] { gemm.input_grad(dy + rows_block.begin * ld_dy, ld_dy, rows, packed, n, chunks, tile, ld, tuning); });
    timed(clocks.epilogue, [&] { epilogue(rows_block, tile, ld); });
  });
}

}  // namespace

void expert_ffn_forward(Isa isa, const ExpertShapes& shapes, const ExpertMatrices& weights,
                        const LoraFactors& gate_up_peft, const LoraFactors& down_peft, const Routing& routing,
                        const ForwardIo& io, const KernelTuning& tuning, moecc::pool::ThreadPool& pool) {
  check_tuning(tuning);
  Scratch& scratch = shared_scratch();
  std::lock_guard<std::mutex> lock(scratch.mutex);
  PhaseClock clock(forward_times, forward_parts);
  const PanelGemm& gemm = panel_gemm(isa);
  const Dims d(shapes);
  const int64_t task_rows = tuning.rows_per_task, block_rows = tuning.block_rows;
  const int64_t stream_outputs = tuning.streaming_outputs;
  const LoraFactors gate_up_lora = with_rows_of_b(gate_up_peft, 2 * d.I, d.E, scratch.b_gu, pool);
  const LoraFactors down_lora = with_rows_of_b(down_peft, d.H, d.E, scratch.b_down, pool);
  const std::vector<Task> rows = make_tasks(routing.offsets, d.E, 1, 1);
  uint16_t* xg = scratch.xg.get(d.pairs * d.ld_x);
  uint16_t* act = scratch.act.get(d.pairs * d.ld_act);
  float* inner_gu = io.inner_gate_up ? io.inner_gate_up
                                     : scratch.inner_gu.get(d.pairs * std::max<int64_t>(gate_up_lora.rank, 1));
  float* inner_down = io.inner_down ? io.inner_down
                                    : scratch.inner_down.get(d.pairs * std::max<int64_t>(down_lora.rank, 1));
  uint16_t* per_pair = scratch.per_pair.get(d.pairs * d.H);

  gather_hidden(d, routing, io.hidden, gate_up_lora, rows, xg, inner_gu, tuning.streaming_copies, pool,
                io.hidden_copy);
  clock.mark("gather");

  const int64_t gu_panels = padded_rows(2 * d.I) / kPanelRows;
  const std::vector<Task> gu_tasks = make_tasks(routing.offsets, d.E, gu_panels, tuning.panels_per_task, task_rows);
  PartClocks gu_clocks;
  run_tasks(pool, gu_tasks, [&](const Task& task) {
    forward_product(gemm, task, block_rows, xg, d.ld_x, weights.gate_up + task.expert * d.gu_size,
                    weights.packed_gate_up, 2 * d.I, d.H, gate_up_lora, inner_gu, (stream_outputs & 2) != 0,
                    tuning.gemm, gu_clocks, [&](int64_t g) { return io.gate_up_out + g * 2 * d.I; });
  });
  record_parts(forward_parts, "gate_up", gu_clocks);

  clock.mark("gate_up");
  activate(d, io.gate_up_out, down_lora, rows, act, inner_down, (stream_outputs & 4) != 0, pool);
  clock.mark("activate");

  const int64_t down_panels = padded_rows(d.H) / kPanelRows;
  const std::vector<Task> down_tasks =
      make_tasks(routing.offsets, d.E, down_panels, tuning.panels_per_task, task_rows);
  PartClocks down_clocks;
  run_tasks(pool, down_tasks, [&](const Task& task) {
    forward_product(gemm, task, block_rows, act, d.ld_act, weights.down + task.expert * d.down_size,
                    weights.packed_down, d.H, d.I, down_lora, inner_down, (stream_outputs & 1) != 0, tuning.gemm,
                    down_clocks, [&](int64_t g) { return per_pair + routing.order[g] * d.H; });
  });
  record_parts(forward_parts, "down", down_clocks);

  clock.mark("down");
  sum_slots(d, per_pair, routing.weights, io.out, io.out_bf16, pool);
  clock.mark("sum_slots");
}

// Accumulates the four LoRA factor gradients, each a sum over an expert's rows of rank-r outer products. Tasks
// are (expert, factor, block of columns), largest experts first, so a hot expert is spread over threads.
// The output-side rows are the bf16 copies the input-gradient products read (dy, dG): the model's gradients
// are bf16 to begin with, and they take half the memory traffic of float32 rows.
struct LoraGradInputs {
  const float *inner_gu, *inner_down, *grad_inner_gu, *grad_inner_down, *row_weight;
  const uint16_t *hidden, *act, *dy_bf16, *grad_gu_bf16;  // hidden: the token rows [T, H], read in place
  const uint16_t* grad_out_bf16;  // the token rows of a bf16 output gradient [T, H], or null (float32 given)
  int64_t ld_act, ld_dy, ld_dgu;
};

constexpr int64_t kGradFactorColumns = 256;

// The four LoRA factor gradients' tasks, largest experts first, and run(i), which runs task i. Each task sums all
// of its expert's rows for its columns of one factor, in row order: the results do not depend on which thread runs
// which task, or on what runs beside it.
class LoraFactorGrads {
 public:
  LoraFactorGrads(const Dims& d, const LoraFactors& gate_up_lora, const LoraFactors& down_lora,
                  const Routing& routing, const LoraGradInputs& in, const BackwardIo& io)
      : d_(d), gate_up_lora_(gate_up_lora), down_lora_(down_lora), routing_(routing), in_(in), io_(io) {
    const int64_t widths[4] = {d.I, d.H, d.H, 2 * d.I};  // dA_down, dB_down^T, dA_gu, dB_gu^T
    const bool present[4] = {down_lora.a != nullptr, down_lora.a != nullptr, gate_up_lora.a != nullptr,
                             gate_up_lora.a != nullptr};
    for (int64_t e = 0; e < d.E; ++e) {
      if (routing.offsets[e] == routing.offsets[e + 1]) continue;
      for (int64_t which = 0; which < 4; ++which) {
        if (!present[which]) continue;
        for (int64_t c = 0; c < widths[which]; c += kGradFactorColumns) {
          tasks_.push_back({e, which, c, std::min(widths[which], c + kGradFactorColumns)});
        }
      }
    }
    std::stable_sort(tasks_.begin(), tasks_.end(), [&](const FactorTask& a, const FactorTask& b) {
      return routing.offsets[a.expert + 1] - routing.offsets[a.expert] >
             routing.offsets[b.expert + 1] - routing.offsets[b.expert];
    });
  }

  int64_t size() const { return static_cast<int64_t>(tasks_.size()); }

  void run(int64_t id) const {
    const Dims& d = d_;
    const LoraGradInputs& in = in_;
    const BackwardIo& io = io_;
    const FactorTask& t = tasks_[static_cast<size_t>(id)];
    const int64_t e = t.expert, begin = routing_.offsets[e], count = routing_.offsets[e + 1] - begin;
    if (t.which == 0) {  // dA_down[r][i] = sum_g w (s dy B)[g][r] act[g][i]
      const int64_t r = down_lora_.rank;
      rank_outer_accumulate(in.grad_inner_down + begin * r, in.row_weight + begin, 1.0f, in.act + begin * in.ld_act,
                            in.ld_act, count, r, t.c0, t.c1, io.grad_down_a + e * r * d.I, d.I);
    } else if (t.which == 1) {  // dB_down^T[r][h] = s sum_g w (act A)[g][r] dy[g][h]
      // dy from the token rows when they are bf16 (the same values as the grouped copy): k pairs share each, so
      // they are read from cache, where the grouped copy (a row per pair, 268 MB at 8192 tokens) comes from DRAM.
      const int64_t r = down_lora_.rank;
      if (in.grad_out_bf16) {
        rank_outer_accumulate_gathered(in.inner_down + begin * r, in.row_weight + begin, down_lora_.scaling,
                                       in.grad_out_bf16, d.H, routing_.order + begin, d.k, count, r, t.c0, t.c1,
                                       io.grad_down_b + e * r * d.H, d.H);
      } else {
        rank_outer_accumulate(in.inner_down + begin * r, in.row_weight + begin, down_lora_.scaling,
                              in.dy_bf16 + begin * in.ld_dy, in.ld_dy, count, r, t.c0, t.c1,
                              io.grad_down_b + e * r * d.H, d.H);
      }
    } else if (t.which == 2) {  // dA_gu[r][h] = sum_g (s dG B)[g][r] x[g][h]
      const int64_t r = gate_up_lora_.rank;
      rank_outer_accumulate_gathered(in.grad_inner_gu + begin * r, nullptr, 1.0f, in.hidden, d.H,
                                     routing_.order + begin, d.k, count, r, t.c0, t.c1,
                                     io.grad_gate_up_a + e * r * d.H, d.H);
    } else {  // dB_gu^T[r][c] = s sum_g (x A)[g][r] dG[g][c]
      const int64_t r = gate_up_lora_.rank;
      rank_outer_accumulate(in.inner_gu + begin * r, nullptr, gate_up_lora_.scaling,
                            in.grad_gu_bf16 + begin * in.ld_dgu, in.ld_dgu, count, r, t.c0, t.c1,
                            io.grad_gate_up_b + e * r * 2 * d.I, 2 * d.I);
    }
  }

 private:
  struct FactorTask {
    int64_t expert, which, c0, c1;
  };
  // Copies (pointers and sizes), so a braced temporary passed in cannot dangle.
  const Dims d_;
  const LoraFactors gate_up_lora_, down_lora_;
  const Routing routing_;
  const LoraGradInputs in_;
  const BackwardIo io_;
  std::vector<FactorTask> tasks_;
};

// inner[g][r] = s * sum_c grad[g][c] B^T[r][c]: the LoRA-B side of an input gradient.
template <typename Row>  // float, or bf16 bits
void lora_grad_inner(const LoraFactors& lora, int64_t expert, int64_t out_features, const Row* grad_row, int64_t g,
                     float* inner) {
  const float* b_t = lora.b + expert * lora.rank * out_features;
  rank_dots(grad_row, b_t, lora.rank, out_features, lora.scaling, inner + g * lora.rank);
}

void expert_ffn_backward(Isa isa, const ExpertShapes& shapes, const ExpertMatrices& weights,
                         const LoraFactors& gate_up_peft, const LoraFactors& down_peft, const Routing& routing,
                         const BackwardIo& io_peft, const KernelTuning& tuning, moecc::pool::ThreadPool& pool) {
  check_tuning(tuning);
  Scratch& scratch = shared_scratch();
  std::lock_guard<std::mutex> lock(scratch.mutex);
  PhaseClock clock(backward_times, backward_parts);
  const PanelGemm& gemm = panel_gemm(isa);
  const Dims d(shapes);
  const int64_t task_rows = tuning.rows_per_task, block_rows = tuning.block_rows;
  const LoraFactors gate_up_lora = with_rows_of_b(gate_up_peft, 2 * d.I, d.E, scratch.b_gu, pool);
  const LoraFactors down_lora = with_rows_of_b(down_peft, d.H, d.E, scratch.b_down, pool);
  // B gradients accumulate as rows of B^T (zeroed here) and are laid back into PEFT's layout at the end.
  BackwardIo io = io_peft;
  const auto zeroed = [&](AlignedBuffer<float>& buffer, int64_t n) {
    float* data = buffer.get(n);
    pool.run((n + (1 << 16) - 1) >> 16, [&](int64_t c, int) {
      std::fill(data + (c << 16), data + std::min(n, (c + 1) << 16), 0.0f);
    });
    return data;
  };
  if (io_peft.grad_gate_up_b) io.grad_gate_up_b = zeroed(scratch.grad_b_gu, d.E * gate_up_lora.rank * 2 * d.I);
  if (io_peft.grad_down_b) io.grad_down_b = zeroed(scratch.grad_b_down, d.E * down_lora.rank * d.H);
  const int64_t r_gu = std::max<int64_t>(gate_up_lora.rank, 1), r_d = std::max<int64_t>(down_lora.rank, 1);
  const std::vector<Task> rows = make_tasks(routing.offsets, d.E, 1, 1);
  uint16_t* act = scratch.act.get(d.pairs * d.ld_act);
  // The forward's LoRA inner products when the caller kept them, else recomputed here.
  const bool recompute_gu = gate_up_lora.a && !io.inner_gate_up, recompute_down = down_lora.a && !io.inner_down;
  float* const inner_gu_scratch = recompute_gu ? scratch.inner_gu.get(d.pairs * r_gu) : nullptr;
  float* const inner_down_scratch = recompute_down ? scratch.inner_down.get(d.pairs * r_d) : nullptr;
  const float* const inner_gu = recompute_gu ? inner_gu_scratch : io.inner_gate_up;
  const float* const inner_down = recompute_down ? inner_down_scratch : io.inner_down;
  float* grad_inner_gu = scratch.grad_inner_gu.get(d.pairs * r_gu);
  float* grad_inner_down = scratch.grad_inner_down.get(d.pairs * r_d);
  uint16_t* dy_bf16 = scratch.dy_bf16.get(d.pairs * d.ld_dy);
  uint16_t* grad_gu_bf16 = scratch.grad_gu_bf16.get(d.pairs * d.ld_dgu);
  uint16_t* per_pair = scratch.per_pair.get(d.pairs * d.H);
  float* row_weight = scratch.row_weight.get(std::max<int64_t>(d.pairs, 1));  // routing weight per grouped row

  // Backward reads the token rows in place: only the LoRA terms use them (x A for dB, x for dA), so the gathered
  // copy the forward's products need (a hidden row per pair: 268 MB at 8192 tokens) is not written again.
  if (recompute_gu) {
    run_tasks(pool, rows, [&](const Task& task) {
      lora_inner(gate_up_lora, task.expert, d.H, task,
                 [&](int64_t g) { return io.hidden + routing.order[g] / d.k * d.H; }, inner_gu_scratch);
    });
  }
  // The activation again as whole rows only where the forward did not keep act A_down (it needs all of I); else
  // the fused input-gradient tasks below write act chunk by chunk.
  if (recompute_down) {
    activate(d, io.gate_up_out, down_lora, rows, act, inner_down_scratch, (tuning.streaming_outputs & 4) != 0, pool);
  }
  clock.mark("activate");
  // Unweighted output gradient per grouped row in bf16 (zero-padded), and its down-LoRA inner product s dy B
  // from the token's own row (float32 as given, or the bf16 row read as it is).
  const bool stream_dy = tuning.streaming_copies;
  run_tasks(pool, rows, [&](const Task& task) {
    bool streamed = false;
    for (int64_t g = task.begin; g < task.end; ++g) {
      const int64_t token = routing.order[g] / d.k;
      if (io.grad_out) {
        const float* src = io.grad_out + token * d.H;
        to_bf16(src, dy_bf16 + g * d.ld_dy, d.H);
        if (down_lora.a) lora_grad_inner(down_lora, task.expert, d.H, src, g, grad_inner_down);
        std::fill(dy_bf16 + g * d.ld_dy + d.H, dy_bf16 + (g + 1) * d.ld_dy, uint16_t{0});
      } else {
        const uint16_t* src = io.grad_out_bf16 + token * d.H;
        copy_row(src, d.H, dy_bf16 + g * d.ld_dy, d.ld_dy, stream_dy, streamed);
        if (down_lora.a) lora_grad_inner(down_lora, task.expert, d.H, src, g, grad_inner_down);
      }
    }
    fence_streamed(streamed);
  });

  clock.mark("grad_out");
  // d act (unweighted) = dy W_down + (s dy B) A, by (rows, chunk of I's columns) tasks, each running the SwiGLU
  // backward of its chunk while the chunk is in cache: act again (bf16, rounded as the forward did), d gate and
  // d up (bf16, into grad_gu_bf16), and the chunk's parts of the two row sums that need all of I: act . d act (the
  // routing-weight gradient) and s dG B. Parts are kept per chunk and added in chunk order after the phase, so
  // results do not depend on which thread ran what (they do, in the last bits, on the chunk width,
  // KernelTuning::grad_columns_per_task, which fixes how swiglu_backward_row's 16 lanes split act . d act). Done
  // as separate passes (act, d act in float32, then the SwiGLU backward), d act alone was a float32 row per pair
  // written and read back: 200 MB at 8192 tokens.
  const int64_t chunk_columns = tuning.grad_columns_per_task;
  const int64_t chunks = (d.I + chunk_columns - 1) / chunk_columns;
  float* const routing_parts = scratch.routing_parts.get(d.pairs * chunks);
  float* const inner_gu_parts =  // gate, up halves
      gate_up_lora.a ? scratch.inner_gu_parts.get(d.pairs * chunks * 2 * gate_up_lora.rank) : nullptr;
  PartClocks down_grad_clocks;
  const bool stream_rows = (tuning.streaming_outputs & 8) != 0;
  run_tasks(pool, make_tasks(routing.offsets, d.E, d.I, chunk_columns, task_rows), [&](const Task& task) {
    // Rows go in groups of kGroup: the LoRA terms of a group (the A side before the SwiGLU backward, the B-side
    // dots after it) load each factor vector once for its rows (rank_combine_rows, rank_dots_rows).
    constexpr int64_t kGroup = 4;
    thread_local AlignedBuffer<float> dg_rows;
    const int64_t width = task.col1 - task.col0, chunk = task.col0 / chunk_columns;
    const bool last = task.col1 == d.I;               // writes the rows' zero padding
    float* const dg = dg_rows.get(kGroup * 2 * width);  // the group's d gate, d up for the chunk, a row each
    const float* a = down_lora.a ? down_lora.a + task.expert * down_lora.rank * d.I + task.col0 : nullptr;
    const float* b_t = gate_up_lora.a ? gate_up_lora.b + task.expert * gate_up_lora.rank * 2 * d.I : nullptr;
    input_grad_product(gemm, task, block_rows, dy_bf16, d.ld_dy, weights.down + task.expert * d.down_size, d.H, d.I,
                       tuning.gemm, down_grad_clocks, [&](const Task& rows_block, float* tile, int64_t ld) {
      for (int64_t g0 = rows_block.begin; g0 < rows_block.end; g0 += kGroup) {
        const int64_t count = std::min(kGroup, rows_block.end - g0);
        float* const grad_act = tile + (g0 - rows_block.begin) * ld;
        if (a) {
          rank_combine_rows(grad_inner_down + g0 * down_lora.rank, down_lora.rank, 1.0f, a, d.I, down_lora.rank,
                            width, grad_act, ld, count);
        }
        for (int64_t r = 0; r < count; ++r) {
          const int64_t g = g0 + r;
          const uint16_t* gate = io.gate_up_out + g * 2 * d.I + task.col0;
          const uint16_t* up = gate + d.I;
          uint16_t* const act_row = act + g * d.ld_act;
          uint16_t* const dg_row = grad_gu_bf16 + g * d.ld_dgu;
          float* const dg_r = dg + r * 2 * width;
          // act is written here unless activate wrote the whole rows
          routing_parts[g * chunks + chunk] =
              swiglu_backward_row(gate, up, grad_act + r * ld, routing.weights[routing.order[g]], !recompute_down,
                                  act_row + task.col0, dg_r, dg_r + width, dg_row + task.col0,
                                  dg_row + d.I + task.col0, width, stream_rows);
          if (last && !recompute_down) std::fill(act_row + d.I, act_row + d.ld_act, uint16_t{0});
          if (last) std::fill(dg_row + 2 * d.I, dg_row + d.ld_dgu, uint16_t{0});
        }
        if (b_t) {
          const int64_t rank = gate_up_lora.rank, out_ld = chunks * 2 * rank;
          float* const parts = inner_gu_parts + (g0 * chunks + chunk) * 2 * rank;
          rank_dots_rows(dg, 2 * width, b_t + task.col0, 2 * d.I, rank, width, gate_up_lora.scaling, parts, out_ld,
                         count);
          rank_dots_rows(dg + width, 2 * width, b_t + d.I + task.col0, 2 * d.I, rank, width, gate_up_lora.scaling,
                         parts + rank, out_ld, count);
        }
      }
    });
    fence_streamed(stream_rows);
  });

  record_parts(backward_parts, "down_input_grad", down_grad_clocks);
  clock.mark("down_input_grad");
  // The row sums from their chunk parts, in chunk order (gate half before up half).
  run_tasks(pool, rows, [&](const Task& task) {
    for (int64_t g = task.begin; g < task.end; ++g) {
      const int64_t pair = routing.order[g];
      row_weight[g] = routing.weights[pair];
      float sum = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) sum += routing_parts[g * chunks + c];
      io.grad_routing[pair] = sum;
      if (!gate_up_lora.a) continue;
      const int64_t rank = gate_up_lora.rank;
      for (int64_t r = 0; r < rank; ++r) {
        float inner = 0.0f;
        for (int64_t part = 0; part < 2 * chunks; ++part) inner += inner_gu_parts[(g * 2 * chunks + part) * rank + r];
        grad_inner_gu[g * rank + r] = inner;
      }
    }
  });
  clock.mark("row_sums");
  // d hidden per pair = dG W_gate_up + (s dG B) A.
  const std::vector<Task> hidden_tasks =
      make_tasks(routing.offsets, d.E, d.H, tuning.grad_columns_per_task, task_rows);
  PartClocks hidden_clocks;
  const bool stream_hidden = (tuning.streaming_outputs & 1) != 0;
  const LoraGradInputs grad_inputs{inner_gu, inner_down, grad_inner_gu, grad_inner_down, row_weight, io.hidden, act,
                                   dy_bf16, grad_gu_bf16, io.grad_out ? nullptr : io.grad_out_bf16, d.ld_act,
                                   d.ld_dy, d.ld_dgu};
  const LoraFactorGrads factor_grads(d, gate_up_lora, down_lora, routing, grad_inputs, io);
  run_tasks(pool, hidden_tasks, [&](const Task& task) {
    const int64_t width = task.col1 - task.col0;
    const float* a = gate_up_lora.a ? gate_up_lora.a + task.expert * gate_up_lora.rank * d.H : nullptr;
    input_grad_product(gemm, task, block_rows, grad_gu_bf16, d.ld_dgu, weights.gate_up + task.expert * d.gu_size,
                       2 * d.I, d.H, tuning.gemm, hidden_clocks, [&](const Task& rows_block, float* tile, int64_t ld) {
      combine_rows(rows_block, a ? grad_inner_gu : nullptr, gate_up_lora.rank, 1.0f, a ? a + task.col0 : nullptr, d.H,
                   a ? gate_up_lora.rank : 0, width, tile, ld,
                   [&](int64_t g) { return per_pair + routing.order[g] * d.H + task.col0; }, stream_hidden);
    });
    fence_streamed(stream_hidden);
  });
  record_parts(backward_parts, "gate_up_input_grad", hidden_clocks);
  clock.mark("gate_up_input_grad");
  pool.run(factor_grads.size(), [&](int64_t i, int) { factor_grads.run(i); });
  clock.mark("lora_grads");
  if (io_peft.grad_gate_up_b) {
    rows_to_peft_b(io.grad_gate_up_b, 2 * d.I, gate_up_lora.rank, d.E, io_peft.grad_gate_up_b, pool);
  }
  if (io_peft.grad_down_b) rows_to_peft_b(io.grad_down_b, d.H, down_lora.rank, d.E, io_peft.grad_down_b, pool);
  clock.mark("lora_b_layout");
  sum_slots(d, per_pair, nullptr, io.grad_hidden, io.grad_hidden_bf16, pool);
  clock.mark("sum_slots");
}

void check_tuning(const KernelTuning& tuning) {
  constexpr int64_t kMax = int64_t{1} << 30;
  const auto refuse = [](const std::string& what, int64_t value) {
    throw std::invalid_argument("kernel tuning: " + what + ", got " + std::to_string(value));
  };
  if (tuning.panels_per_task < 1 || tuning.panels_per_task > kMax) {
    refuse("panels_per_task must be in [1, 2^30]", tuning.panels_per_task);
  }
  if (tuning.grad_columns_per_task < kPanelRows || tuning.grad_columns_per_task % kPanelRows != 0 ||
      tuning.grad_columns_per_task > kMax) {
    refuse("grad_columns_per_task must be a positive multiple of " + std::to_string(kPanelRows) + ", at most 2^30",
           tuning.grad_columns_per_task);
  }
  if (tuning.rows_per_task < 1 || tuning.rows_per_task > kMax) {
    refuse("rows_per_task must be in [1, 2^30]", tuning.rows_per_task);
  }
  if (tuning.block_rows < 0 || tuning.block_rows > kMax) {
    refuse("block_rows must be in [0, 2^30] (0: the whole task)", tuning.block_rows);
  }
  if (tuning.streaming_outputs < 0 || tuning.streaming_outputs > 15) {
    refuse("streaming_outputs is a mask of 1 (per-pair rows), 2 (gate/up output), 4 (activation rows) and 8 (the "
           "down input gradient's rows), 0-15", tuning.streaming_outputs);
  }
  if (tuning.gemm.pack_prefetch_rows < 0 || tuning.gemm.pack_prefetch_rows > 4096) {
    refuse("gemm.pack_prefetch_rows must be in [0, 4096] (0: none)", tuning.gemm.pack_prefetch_rows);
  }
}

}  // namespace moecc::kernels
