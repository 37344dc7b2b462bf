// What the forward and the backward of the routed-expert FFN share besides the products (expert_ffn_common.h):
// the scratch buffers, the grouped row copies, the activation, the sums over a token's slots and the re-layout of
// LoRA B.
#include "expert_ffn_common.h"

#include <immintrin.h>

#include <algorithm>

#include "lora_products.h"
#include "swiglu.h"
#include "vector16.h"

namespace moecc::kernels::ffn {
namespace {

// Vector primitives for the elementwise steps, built with MOECC_VECTOR_CLONES (vector16.h): an AVX512 and a
// baseline copy of each, one picked at load time from the running CPU, so no code here assumes AVX512. Internal to
// this file (target clones of a function with external linkage differ between compilers).

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

}  // namespace

void round_to_bf16(const float* src, uint16_t* dst, int64_t n) { to_bf16(src, dst, n); }

Scratch& shared_scratch() {
  static Scratch scratch;
  return scratch;
}

void copy_row(const uint16_t* src, int64_t n, uint16_t* dst, int64_t ld, bool stream, bool& streamed) {
  static const bool avx512bw = __builtin_cpu_supports("avx512bw");
  if (avx512bw && stream) {
    stream_row(src, n, dst, ld);
    streamed = true;
    return;
  }
  std::copy(src, src + n, dst);
  std::fill(dst + n, dst + ld, uint16_t{0});
}


// Grouped hidden rows (zero-padded) and their gate/up LoRA inner product (from the token row, as the copy may have
// bypassed the cache); with `hidden_copy`, each token's row is also copied there once (by its slot-0 pair), in
// parallel and while the row is in cache.
void gather_hidden(const Dims& d, const Routing& routing, const uint16_t* hidden, const LoraFactors& lora,
                   const std::vector<Task>& rows, uint16_t* xg, float* inner, bool stream,
                   moecc::pool::ThreadPool& pool, uint16_t* hidden_copy) {
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
// were slower.
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
// more than L1 holds.
constexpr int64_t kRelayoutRows = 64;
constexpr int64_t kRelayoutExperts = 16;

// Copies `from` into `to`, one layout into the other: kToRows, B -> B^T; else B^T -> B. Only the experts with
// routed rows (offsets) are read: B^T rows of the others are never used (skipped), and their B columns of a
// gradient are zero (written as such), so a call on a few experts does not pay for all E of them.
namespace {

inline bool has_rows(const int64_t* offsets, int64_t e) { return offsets[e + 1] > offsets[e]; }

template <bool kToRows>
void relayout_b(const float* from, int64_t out, int64_t rank, int64_t experts, const int64_t* offsets, float* to,
                moecc::pool::ThreadPool& pool) {
  const int64_t columns = rank * experts;
  pool.run((out + kRelayoutRows - 1) / kRelayoutRows, [&](int64_t block, int) {
    const int64_t o0 = block * kRelayoutRows, o1 = std::min(out, o0 + kRelayoutRows);
    for (int64_t j = 0; j < rank; ++j) {
      for (int64_t e0 = 0; e0 < experts; e0 += kRelayoutExperts) {
        const int64_t e1 = std::min(experts, e0 + kRelayoutExperts);
        if (kToRows) {  // contiguous runs of B^T rows written, 64-byte runs of B rows read
          for (int64_t e = e0; e < e1; ++e) {
            if (!has_rows(offsets, e)) continue;
            float* dst = to + (e * rank + j) * out;
            for (int64_t o = o0; o < o1; ++o) dst[o] = from[o * columns + j * experts + e];
          }
        } else {  // 64-byte runs of B rows written, the tile's B^T rows read
          for (int64_t o = o0; o < o1; ++o) {
            float* dst = to + o * columns + j * experts;
            for (int64_t e = e0; e < e1; ++e) dst[e] = has_rows(offsets, e) ? from[(e * rank + j) * out + o] : 0.0f;
          }
        }
      }
    }
  });
}

}  // namespace

void rows_to_peft_b(const float* b_t, int64_t out, int64_t rank, int64_t experts, const int64_t* offsets, float* b,
                    moecc::pool::ThreadPool& pool, const int64_t* slots, int64_t blocks) {
  if (slots == nullptr) {
    relayout_b<false>(b_t, out, rank, experts, offsets, b, pool);
    return;
  }
  const int64_t columns = rank * blocks;
  pool.run((out + kRelayoutRows - 1) / kRelayoutRows, [&](int64_t block, int) {
    const int64_t o0 = block * kRelayoutRows, o1 = std::min(out, o0 + kRelayoutRows);
    std::fill(b + o0 * columns, b + o1 * columns, 0.0f);
    for (int64_t j = 0; j < rank; ++j) {
      for (int64_t e = 0; e < experts; ++e) {
        if (!has_rows(offsets, e)) continue;
        const float* src = b_t + (e * rank + j) * out;
        float* dst = b + j * blocks + slots[e];
        for (int64_t o = o0; o < o1; ++o) dst[o * columns] = src[o];
      }
    }
  });
}

LoraFactors with_rows_of_b(const LoraFactors& lora, int64_t out, int64_t experts, const int64_t* offsets,
                           AlignedBuffer<float>& b_t, moecc::pool::ThreadPool& pool) {
  if (lora.a == nullptr) return lora;
  LoraFactors relaid = lora;
  float* rows = b_t.get(experts * lora.rank * out);
  relayout_b<true>(lora.b, out, lora.rank, experts, offsets, rows, pool);
  relaid.b = rows;
  return relaid;
}

}  // namespace moecc::kernels::ffn
