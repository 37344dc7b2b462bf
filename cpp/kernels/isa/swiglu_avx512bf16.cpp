// The AVX512-BF16 build of the SwiGLU rows (swiglu_body.h), rounding with VCVTNEPS2BF16; compiled with -mavx512f
// -mavx512bw -mavx512vl -mavx512bf16 (setup.py).
#include "../swiglu_body.h"

namespace moecc::kernels {

const SwigluKernels& swiglu_avx512bf16() { return SwigluBuild<v16::NativeBf16>::kernels; }

}  // namespace moecc::kernels
