// Parallel stable counting sort of routed pairs by expert (see token_grouping.h for the layout).
//
// Pairs are cut into one contiguous chunk per thread; each chunk counts its experts, a serial prefix over
// (expert, chunk) gives every chunk its write position per expert, and each chunk scatters its pairs. Chunks
// are in pair order, so the sort is stable without atomics.
#include "token_grouping.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "../pool/thread_pool.h"

namespace moecc::kernels {
namespace {
// Below this many pairs one thread is faster than waking the pool.
constexpr int64_t kPairsPerChunk = 16384;
}  // namespace

int64_t group_tokens_by_expert(const int64_t* top_k_index, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                               int64_t* offsets, int64_t* order, moecc::pool::ThreadPool& pool, const uint8_t* keep) {
  const int64_t num_pairs = num_tokens * top_k;
  const int64_t num_chunks =
      std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), (num_pairs + kPairsPerChunk - 1) / kPairsPerChunk));
  const int64_t chunk_size = (num_pairs + num_chunks - 1) / num_chunks;
  // counts[chunk * num_experts + expert], then turned into write positions in place.
  std::vector<int64_t> counts(static_cast<size_t>(num_chunks * num_experts), 0);

  pool.run(num_chunks, [&](int64_t chunk, int) {
    const int64_t begin = chunk * chunk_size, end = std::min(num_pairs, begin + chunk_size);
    int64_t* chunk_counts = counts.data() + chunk * num_experts;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t expert = top_k_index[pair];
      if (expert < 0 || expert >= num_experts) {
        throw std::out_of_range("top_k_index[" + std::to_string(pair / top_k) + ", " + std::to_string(pair % top_k) +
                                "] = " + std::to_string(expert) + " is not an expert id in [0, " +
                                std::to_string(num_experts) + ")");
      }
      if (keep == nullptr || keep[expert]) ++chunk_counts[expert];
    }
  });

  int64_t running = 0;
  for (int64_t expert = 0; expert < num_experts; ++expert) {
    offsets[expert] = running;
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      int64_t& slot = counts[chunk * num_experts + expert];
      const int64_t count = slot;
      slot = running;
      running += count;
    }
  }
  offsets[num_experts] = running;

  pool.run(num_chunks, [&](int64_t chunk, int) {
    const int64_t begin = chunk * chunk_size, end = std::min(num_pairs, begin + chunk_size);
    int64_t* positions = counts.data() + chunk * num_experts;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t expert = top_k_index[pair];
      if (keep == nullptr || keep[expert]) order[positions[expert]++] = pair;
    }
  });
  return running;
}

}  // namespace moecc::kernels
