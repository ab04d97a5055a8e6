#!/usr/bin/env bash
# Session 10, call 4 (nvidia-h100-x2 kind): 8 7B-shape layers on 2 GPUs and on 1 with GPTQ
# spread by K (its column loop), then in parallel: GPU 0 the calibrate GPU tests; GPU 1 where
# generate()'s per-token time goes (bench/diag_generate.py, bf16 and qfuse int8).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
t0=$SECONDS
QFUSE_CACHE_DIR=/tmp/qc0 timeout 75 torchrun --nproc_per_node 2 bench/calib_large.py \
  --mode sequential --layers 8 > $L/calib_2gpu_log.txt 2>&1
echo "== calib 2 GPUs exit $? at $((SECONDS - t0)) s"; grep -v "Warn\|^stage\|^W1" $L/calib_2gpu_log.txt | tail -3
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout $((190 - SECONDS)) python3 bench/diag_generate.py --tokens 32 --out "$OUT/diag_generate.json" \
    > $L/diag_generate_log.txt 2>&1
  echo "== [gpu1] diag generate exit $? at $((SECONDS - t0)) s"; grep "^{" $L/diag_generate_log.txt
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 85 python3 bench/calib_large.py --mode sequential --layers 8 > $L/calib_1gpu_log.txt 2>&1
  echo "== [gpu0] calib 1 GPU exit $? at $((SECONDS - t0)) s"; grep -v "Warn\|^stage" $L/calib_1gpu_log.txt | tail -3
  timeout $((188 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu tests/calibrate/test_sequential_gpu.py \
    > "$OUT/gpu_tests_calibrate.txt" 2>&1
  echo "== [gpu0] calibrate gpu tests exit $? at $((SECONDS - t0)) s"; tail -1 "$OUT/gpu_tests_calibrate.txt"
) &
wait
cp $L/calib_2gpu_log.txt "$OUT/" ; ls "$OUT"
