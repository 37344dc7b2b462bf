#include "weight_fetch.h"

namespace moecc::kernels {

WeightFetch& thread_weight_fetch() {
  thread_local WeightFetch fetch;
  return fetch;
}

}  // namespace moecc::kernels
