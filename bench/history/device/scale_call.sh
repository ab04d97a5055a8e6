#!/usr/bin/env bash
# Device call on nvidia-h100-x2 (issue #26 and the GPU halves of #23): the 7B-shape Llama
# calibrated + GPTQ'd sequentially on GPU 0 while GPU 1 runs the GPU tests and QAT DDP over NCCL
# (both GPUs); then 1 GPU against 2 GPUs at 4 layers with both GPUs free.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 QFUSE_CACHE_DIR=/tmp/qfuse_cache
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
t0=$SECONDS
(CUDA_VISIBLE_DEVICES=0 timeout 450 python3 bench/calib_large.py --mode sequential \
   > "$OUT/calib_7b_log.txt" 2>&1; echo "== 7B sequential exit $? at $((SECONDS - t0)) s" >> "$OUT/calib_7b_log.txt") &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/integrations/test_transformers.py tests/export/test_torchscript.py \
  tests/calibrate/test_sequential_gpu.py > "$OUT/gpu_tests_s9.txt" 2>&1
echo "== gpu tests exit $? at $((SECONDS - t0)) s"; tail -2 "$OUT/gpu_tests_s9.txt"
timeout 120 torchrun --nproc_per_node 2 bench/qat_ddp_nccl.py > "$OUT/scale_log.txt" 2>&1
echo "== qat ddp nccl exit $? at $((SECONDS - t0)) s"; tail -4 "$OUT/scale_log.txt"
wait $A; tail -12 "$OUT/calib_7b_log.txt"
left=$((575 - SECONDS))
if [ $left -gt 60 ]; then
  timeout $((left / 2)) python3 bench/calib_large.py --mode sequential --layers 4 >> "$OUT/scale_log.txt" 2>&1
  echo "== 4 layers 1 GPU exit $? at $((SECONDS - t0)) s"; tail -4 "$OUT/scale_log.txt"
  timeout $((575 - SECONDS)) torchrun --nproc_per_node 2 bench/calib_large.py --mode sequential --layers 4 \
    >> "$OUT/scale_log.txt" 2>&1
  echo "== 4 layers 2 GPUs exit $? at $((SECONDS - t0)) s"; tail -4 "$OUT/scale_log.txt"
fi
ls "$OUT"
