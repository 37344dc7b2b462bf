// The AVX512F build of the dequantization (dequantize_body.h); compiled with -mavx512f (setup.py).
#include "../dequantize_body.h"

namespace moecc::kernels {

const DequantizeKernels& dequantize_avx512() { return DequantizeBuild::kernels; }

}  // namespace moecc::kernels
