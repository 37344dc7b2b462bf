// The AVX512-BF16 build of the LoRA products' bf16 combine (lora_products_body.h), rounding with VCVTNEPS2BF16;
// compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 (setup.py).
#include "../lora_products_body.h"

namespace moecc::kernels {

decltype(LoraKernels::combine_rows_bf16) lora_combine_bf16_rows_avx512bf16() {
  return LoraBuild<v16::NativeBf16>::combine_rows_bf16;
}

}  // namespace moecc::kernels
