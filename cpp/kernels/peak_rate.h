// Register-only micro-benchmarks of the matrix units one core can drive: the ceilings kernel efficiency is
// reported against. No memory traffic: operands live in registers (AVX512-BF16) or tiles (AMX).
#pragma once

#include <cstdint>

#include "panel_gemm.h"

namespace moecc::kernels {

// bf16 FLOP/s of one thread running `iterations` rounds of independent VDPBF16PS (16 accumulators).
double peak_flops_avx512bf16(int64_t iterations);
// fp32 FLOP/s of one thread running `iterations` rounds of independent 512-bit FMAs (16 accumulators): not a
// matrix unit, the ceiling of the epilogues' vector arithmetic. Throws std::invalid_argument without AVX512F.
double peak_flops_avx512fma(int64_t iterations);
// bf16 FLOP/s of one thread running `iterations` rounds of TDPBF16PS on 4 accumulator tiles.
// Throws std::invalid_argument if AMX is unavailable (see cpu_features()).
double peak_flops_amx(int64_t iterations);

// bf16 FLOP/s of one thread running panel_gemm(isa).forward `reps` times on one [tokens, k] x [k, n] problem
// held in memory it has just touched (so in whichever cache level its size fits): the kernel's ceiling.
double panel_gemm_flops(Isa isa, int64_t tokens, int64_t n, int64_t k, int64_t reps);

}  // namespace moecc::kernels
