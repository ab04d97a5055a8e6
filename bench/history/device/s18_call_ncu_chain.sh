#!/usr/bin/env bash
# First of three calls: park the GGUF's first part, install the snapshot, read the W4 and int8
# decode kernels' hardware counters (ncu) and their profiler times.
set -uo pipefail
W=$(pwd)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
mkdir -p /tmp/g && cp $W/.gpu/x1/sp00 /tmp/g/
mkdir -p /tmp/src && tar -xJf $W/.gpu/x1/src.tar.xz -C /tmp/src && cd /tmp/src
python3 -m pip install -q --no-index --no-deps --target /tmp/site $W/.whl/*.whl
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . > /tmp/inst.txt 2>&1 || tail -3 /tmp/inst.txt
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 QFUSE_COMMIT=$(cat .commit) QFUSE_CACHE_DIR=/tmp/qc HF_HUB_OFFLINE=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
which ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1
NCU=$(which ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for impl in w4a16 int8; do
  timeout 100 $NCU --clock-control none --nvtx --nvtx-include "w4profile/" -k regex:"_w4_kernel|_qlinear" --launch-count 1 $SEC \
    python3 -m bench.kernels.w4_profile --role gate_up --impl $impl --ncu > $OUT/ncu_gate_up_$impl.txt 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Ipc|No Eligible|Warp Cycles Per Issued|Block Limit|Grid Size|L1/TEX Hit|Mem Busy|Max Bandwidth" $OUT/ncu_gate_up_$impl.txt | head -30; el
done
timeout 60 python3 -m bench.kernels.w4_profile --role gate_up --impl both > $OUT/prof_gate_up.txt 2>&1; tail -2 $OUT/prof_gate_up.txt | cut -c1-600; el
timeout 200 python3 -m bench.kernels.w4_chain --a8 --ms 1,16 --out $OUT/w4_chain.json > $OUT/w4_chain.log 2>&1; grep -v "^{" $OUT/w4_chain.log | grep -v -i warn | tail -6; el
