#!/usr/bin/env bash
# Session 10, call 1 (nvidia-h100-x2 kind; both GPUs): #26 first while both GPUs are idle —
# QAT DDP over NCCL, 2-GPU sequential calibrate+GPTQ of 8 7B-shape layers — then in parallel:
# GPU 0 the same 8 layers on one GPU (sequential, then at once), the sequential GPU test and the
# GEMM kernels' tests on the GPU;
# GPU 1 the GEMM kernels (#22): encoder GEMMs (int8 sym/asym, fp8) at M=4096,
# and BERT-base 32x128 whole model, graphed.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
t0=$SECONDS
QFUSE_CACHE_DIR=/tmp/qc0 timeout 100 torchrun --nproc_per_node 2 bench/qat_ddp_nccl.py \
  > "$OUT/qat_ddp_nccl_log.txt" 2>&1
echo "== qat ddp nccl exit $? at $((SECONDS - t0)) s"; grep -v Warn "$OUT/qat_ddp_nccl_log.txt" | tail -8
QFUSE_CACHE_DIR=/tmp/qc0 timeout 150 torchrun --nproc_per_node 2 bench/calib_large.py \
  --mode sequential --layers 8 > "$OUT/calib_2gpu_log.txt" 2>&1
echo "== calib 2 GPUs exit $? at $((SECONDS - t0)) s"; grep -v Warn "$OUT/calib_2gpu_log.txt" | tail -4
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout $((420 - SECONDS)) python3 bench/encoder_gemms.py --M 4096 --models bert-base,minilm \
    --out "$OUT/encoder_gemms_m4096.json" > "$OUT/encoder_gemms_log.txt" 2>&1
  echo "== [gpu1] encoder gemms exit $? at $((SECONDS - t0)) s"; grep -v Warn "$OUT/encoder_gemms_log.txt" | tail -12
  timeout $((575 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > "$OUT/models_log.txt" 2>&1
  echo "== [gpu1] models exit $? at $((SECONDS - t0)) s"; grep -v Warn "$OUT/models_log.txt" | tail -6
) &
K=$!
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 300 python3 bench/calib_large.py --mode both --layers 8 > "$OUT/calib_1gpu_log.txt" 2>&1
  echo "== [gpu0] calib 1 GPU exit $? at $((SECONDS - t0)) s"; grep -v Warn "$OUT/calib_1gpu_log.txt" | tail -5
  timeout $((560 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/calibrate/test_sequential_gpu.py > "$OUT/gpu_tests_calibrate.txt" 2>&1
  echo "== [gpu0] calibrate gpu test exit $? at $((SECONDS - t0)) s"; tail -2 "$OUT/gpu_tests_calibrate.txt"
  QFUSE_CACHE_DIR=/tmp/qc2 timeout $((585 - SECONDS)) python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_qgemm.py tests/kernels/test_tma_gemm.py > "$OUT/gpu_kernel_tests.txt" 2>&1
  echo "== [gpu0] kernel tests exit $? at $((SECONDS - t0)) s"; tail -2 "$OUT/gpu_kernel_tests.txt"
) &
wait
ls "$OUT"
