// Host-side facts about the activation dtype and the current device, shared by the launchers.
// Torch-free.
#pragma once
#include <cuda_runtime.h>

namespace kbit {

// kE4m3: only an output of the dequantize kernel (the FP8 path's large-M weights).
enum class DType { kHalf, kBFloat16, kFloat32, kE4m3 };

// Attribute A of the current device, queried once per device (the launch paths ask on every
// call); -1 where there is no current device.
template <cudaDeviceAttr A> inline int device_attribute() {
  static int cached[64];  // per device: value + 1, 0 = not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return -1;
  if (cached[dev] == 0) {
    int v = 0;
    cudaDeviceGetAttribute(&v, A, dev);
    cached[dev] = v + 1;
  }
  return cached[dev] - 1;
}

// Compute capability >= 9.0 on the current device: thread-block clusters and programmatic
// dependent launch.
inline bool device_is_sm90_or_newer() { return device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9; }

}  // namespace kbit
