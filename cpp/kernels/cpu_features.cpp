// cpuid leaf 7 for the ISA bits, xgetbv for what the OS saves on context switch, and arch_prctl for AMX:
// Linux hands out the (8 KB) tile-data state only to processes that ask, and an AMX instruction before that
// raises SIGILL, so availability means "the CPU has it, XCR0 allows it and the request succeeded".
#include "cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace moecc::kernels {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtileData = 18;

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = (ecx >> 27) & 1;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    f.avx512f = (ebx >> 16) & 1;
    f.avx512bw = (ebx >> 30) & 1;
    f.avx512vl = (ebx >> 31) & 1;
    f.amx_bf16 = (edx >> 22) & 1;
    f.amx_tile = (edx >> 24) & 1;
  }
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) f.avx512_bf16 = (eax >> 5) & 1;
  if (osxsave) {
    const uint64_t xcr0 = read_xcr0();
    f.os_avx512 = (xcr0 & 0xE6) == 0xE6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
    const bool tile_state = ((xcr0 >> 17) & 3) == 3;
    if (tile_state && f.amx_tile) {
      f.os_amx = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
    }
  }
  char brand[49] = {0};
  unsigned regs[4];
  for (unsigned i = 0; i < 3; ++i) {
    if (!__get_cpuid(0x80000002 + i, &regs[0], &regs[1], &regs[2], &regs[3])) break;
    std::memcpy(brand + 16 * i, regs, 16);
  }
  f.brand = brand;
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace moecc::kernels
