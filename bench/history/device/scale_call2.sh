#!/usr/bin/env bash
# Device call on nvidia-h100-x2 (#26), after torch 2.11 fixes: 7B-shape sequential calibrate +
# GPTQ on GPU 0 (stage log as it goes), QAT DDP over NCCL on both GPUs, the sequential GPU test.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 QFUSE_CACHE_DIR=/tmp/qc
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
t0=$SECONDS
(CUDA_VISIBLE_DEVICES=0 timeout 320 python3 bench/calib_large.py --mode sequential \
   > "$OUT/calib_7b_log.txt" 2>&1; echo "== 7B sequential exit $? at $((SECONDS - t0)) s" >> "$OUT/calib_7b_log.txt") &
A=$!
timeout 100 torchrun --nproc_per_node 2 bench/qat_ddp_nccl.py > "$OUT/qat_ddp_nccl_log.txt" 2>&1
echo "== qat ddp nccl exit $? at $((SECONDS - t0)) s"; tail -6 "$OUT/qat_ddp_nccl_log.txt"
CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/calibrate/test_sequential_gpu.py > "$OUT/gpu_tests_calibrate.txt" 2>&1
echo "== calibrate gpu test exit $? at $((SECONDS - t0)) s"; tail -2 "$OUT/gpu_tests_calibrate.txt"
wait $A; grep -v Warn "$OUT/calib_7b_log.txt" | tail -14
ls "$OUT"
