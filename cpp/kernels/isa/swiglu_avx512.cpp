// The AVX512F build of the SwiGLU rows (swiglu_body.h), integer bf16 rounding; compiled with -mavx512f (setup.py).
#include "../swiglu_body.h"

namespace moecc::kernels {

const SwigluKernels& swiglu_avx512() { return SwigluBuild<v16::PortableBf16>::kernels; }

}  // namespace moecc::kernels
