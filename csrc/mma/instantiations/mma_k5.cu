// Tensor-core kbit GEMM, bits = 5, fp16 + bf16 (3 tile configs each). One file per bit width
// so the four compile in parallel; the kernel itself lives in csrc/kbit_mma.cuh.
#include "mma/mma_kernel.cuh"

namespace kbit {
namespace mma {
KBIT_MMA_DECLARE_BITS(5);
}  // namespace mma
}  // namespace kbit
