// Growable scratch memory aligned to 64 bytes (a cache line, one zmm register, an AMX tile row), reused across
// calls: a fresh allocation of hundreds of MB would page-fault on every call. Buffers of 2 MB and more are aligned
// to 2 MB and advised to transparent huge pages (see advise_huge_pages).
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace moecc::kernels {

// Transparent huge pages for large buffers, on unless MOECC_HUGE_PAGES=0 (read once). The kernels read their
// activations by rows a few KB apart (an AMX tile load touches 16 rows, a SwiGLU row its gate and up halves), so
// with 4 KB pages a task's rows span more pages than the first-level TLB holds; 2 MB pages cover them.
inline bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("MOECC_HUGE_PAGES");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

constexpr size_t kHugePage = size_t{2} << 20;

// Asks for huge pages on the whole 2 MB pages inside [address, address + bytes) (none when it holds none, or when
// they are off). Advice only: memory already touched keeps its pages until the kernel collapses them, and a kernel
// without THP (or with it set to never) refuses, which costs speed, not correctness. True when advice was given.
inline bool advise_huge_pages(void* address, size_t bytes) {
  if (!huge_pages_enabled()) return false;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(address) + kHugePage - 1) / kHugePage * kHugePage;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(address) + bytes) / kHugePage * kHugePage;
  if (end <= begin) return false;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
}

template <typename T>
class AlignedBuffer {
 public:
  // At least `n` elements. Growing drops the old contents and zero-fills the new memory.
  T* get(int64_t n) {
    if (n > capacity_) {
      const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
      const size_t align = bytes >= kHugePage && huge_pages_enabled() ? kHugePage : 64;
      const size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc wants a multiple
      void* memory = std::aligned_alloc(align, rounded);
      if (memory == nullptr) throw std::bad_alloc();
      advise_huge_pages(memory, rounded);  // before the memset touches the pages
      std::memset(memory, 0, rounded);
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
