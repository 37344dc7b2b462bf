// Growable scratch memory aligned to 64 bytes (a cache line, one zmm register, an AMX tile row), reused across
// calls: a fresh allocation of hundreds of MB would page-fault on every call.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace moecc::kernels {

template <typename T>
class AlignedBuffer {
 public:
  // At least `n` elements. Growing drops the old contents and zero-fills the new memory.
  T* get(int64_t n) {
    if (n > capacity_) {
      const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
      void* memory = std::aligned_alloc(64, bytes);
      if (memory == nullptr) throw std::bad_alloc();
      std::memset(memory, 0, bytes);
      data_.reset(static_cast<T*>(memory));
      capacity_ = n;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  int64_t capacity_ = 0;
};

}  // namespace moecc::kernels
