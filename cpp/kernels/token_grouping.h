// Token grouping: a stable counting sort of routed (token, slot) pairs by expert.
//
// Input layout: top_k_index is row-major [num_tokens, top_k] int64; pair p = token * top_k + slot.
// Output: offsets [num_experts + 1] (expert e owns order[offsets[e] .. offsets[e+1])) and
// order [num_tokens * top_k], the pair ids grouped by expert, ascending within each expert.
#pragma once

#include <cstdint>

namespace moecc::pool {
class ThreadPool;
}

namespace moecc::kernels {

// @param top_k_index [num_tokens, top_k] int64 expert ids, row-major.
// @param offsets     out: [num_experts + 1] int64 start of each expert's run in `order`.
// @param order       out: [num_tokens * top_k] int64 pair ids grouped by expert, ascending within an expert.
// @param pool        threads to run on (chunks of pairs; below ~16k pairs one thread).
// @param keep        null, or [num_experts] flags: only the pairs of experts whose flag is nonzero are grouped
//                    (the others own empty runs), so `order` is written up to the kept pairs' count.
// @return            the pairs grouped (num_tokens * top_k without `keep`).
// Throws std::out_of_range naming the first pair whose expert id is outside [0, num_experts).
int64_t group_tokens_by_expert(const int64_t* top_k_index, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                               int64_t* offsets, int64_t* order, moecc::pool::ThreadPool& pool,
                               const uint8_t* keep = nullptr);

}  // namespace moecc::kernels
