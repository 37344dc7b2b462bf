// Run-time CPU feature detection (cpuid + xgetbv) and the Linux permission request for AMX tile data.
#pragma once

#include <string>

namespace moecc::kernels {

struct CpuFeatures {
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool amx_tile = false;
  bool amx_bf16 = false;
  bool os_avx512 = false;   // XCR0 enables the opmask and ZMM state
  bool os_amx = false;      // XCR0 enables the tile state and the kernel granted XTILEDATA to this process
  std::string brand;
};

// Detected once per process; also asks the kernel for AMX tile data the first time.
const CpuFeatures& cpu_features();

}  // namespace moecc::kernels
