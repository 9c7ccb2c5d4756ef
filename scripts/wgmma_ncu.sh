#!/usr/bin/env bash
# ncu of one wgmma_dev.py probe build on one case (the 4th launch: after warm-up), on the device:
#   bash scripts/wgmma_ncu.sh VARIANT SHAPE:M [OUTFILE]   e.g. base 57344x8192:64
# Prints the lines that say what bounds the kernel (pipes, shared memory, stalls, occupancy).
set -euo pipefail
cd "$(dirname "$0")/.."
variant="$1"; case_="$2"; out="${3:-/tmp/ncu_${variant//[,=]/_}_${case_//[:x]/_}.txt}"
lib="$(python3 scripts/wgmma_dev.py --build "$variant" | tail -1)"
WGDEV_ONLY="$case_" timeout 300 ncu --clock-control none -k regex:wgmma_kernel -s 3 -c 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy \
  --print-details all \
  python3 scripts/wgmma_dev.py --one "$variant" "$lib" > "$out" 2>&1 || { tail -20 "$out"; exit 1; }
echo "== $variant $case_"
grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|DRAM Throughput|Executed Ipc A|Issue Slots Busy|Shared Memory +[A-Za-z]|Achieved Active Warps|No Eligible|Eligible Warps|Active Warps Per|Stall [A-Za-z ]+|Tensor|LSU|MIO|Shared|Mem Busy|Max Bandwidth|Mem Pipes Busy|Registers Per|Theoretical Occ|Block Limit" "$out" | sed -E 's/ +/ /g' | head -60
