// wgmma instantiation for K = 2 bits (one small file per bit width, so they compile in parallel).
#include "wgmma/wgmma_kernel.cuh"

namespace kbit {
namespace wg {
template cudaError_t launch_bits<2>(DType, const Params&, int, int, cudaStream_t, int*);
}  // namespace wg
}  // namespace kbit
