// The current device's heuristics table (dispatch/heuristics.h), chosen once per device.
#include <cuda_runtime.h>

#include "dispatch/launchers.h"

namespace kbit {

const Heuristics& device_heuristics() {
  static const Heuristics* cached[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return kGenericHeuristics;
  if (cached[dev] == nullptr) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
      cudaGetLastError();
      return kGenericHeuristics;
    }
    DeviceFacts d;
    d.name = prop.name;
    d.major = prop.major;
    d.minor = prop.minor;
    d.num_sms = prop.multiProcessorCount;
    d.l2_bytes = prop.l2CacheSize;
    d.global_mem_bytes = (long long)prop.totalGlobalMem;
    cached[dev] = &choose_heuristics(d);
  }
  return *cached[dev];
}

}  // namespace kbit
