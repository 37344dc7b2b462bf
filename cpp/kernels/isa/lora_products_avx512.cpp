// The AVX512F build of the LoRA products (lora_products_body.h): setup.py compiles every file in this directory
// with the flags of the ISA its name ends with, here -mavx512f, so the vector helpers are one zmm register a vector.
#include "../lora_products_body.h"

namespace moecc::kernels {

const LoraKernels& lora_products_avx512() { return LoraBuild<v16::PortableBf16>::kernels; }

}  // namespace moecc::kernels
