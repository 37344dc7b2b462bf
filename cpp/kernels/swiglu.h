// The SwiGLU activation of the expert FFN on bf16 rows, forward and backward, as a bf16 pipeline rounds it:
// act = round(round(silu(gate)) * up). Built for AVX512 and for the baseline ISA; the copy for the running CPU is
// picked at load time. Every element goes through the same 16-lane code (a row's last partial vector is padded),
// so the backward's act is bit for bit the forward's whatever columns a task starts at.
#pragma once

#include <cstdint>

namespace moecc::kernels {

// act[i] = round(round(silu(gate[i])) * up[i]) for i < n (bf16 bits).
void swiglu_forward_row(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n);

// The SwiGLU backward of n columns for the weighted act gradient w * grad_act: act again into `act` when
// write_act (as the forward rounds it), else read from it; d gate and d up into dg, du (float32) and their bf16
// copies dg_bf16, du_bf16. Returns act . grad_act (unweighted), the routing weight's gradient. With `stream`, and
// the bf16 rows 16-byte aligned, their whole 16-column vectors leave with non-temporal stores (the caller fences).
float swiglu_backward_row(const uint16_t* gate, const uint16_t* up, const float* grad_act, float w, bool write_act,
                          uint16_t* act, float* dg, float* du, uint16_t* dg_bf16, uint16_t* du_bf16, int64_t n,
                          bool stream = false);

}  // namespace moecc::kernels
