// GEMV instantiation for K = 3 bits (one small file per bit width, so they compile in parallel).
#include "gemv/gemv_kernel.cuh"

namespace kbit {
namespace gemv {
template cudaError_t launch_bits<3>(DType, const Params&, int, int, int, cudaStream_t);
}  // namespace gemv
}  // namespace kbit
