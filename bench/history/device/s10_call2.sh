#!/usr/bin/env bash
# Session 10, call 2 (nvidia-h100-x2 kind; both GPUs). #26 first while both GPUs are idle: QAT
# DDP over NCCL, then 8 7B-shape layers calibrated + GPTQ'd sequentially on 2 GPUs (GPTQ now
# rounds every rank's layers at the same time) and on 1 GPU. Then #22 in parallel, one card
# each: GPU 1 whole encoders graphed (BERT-base 32x128 and 8x512, MiniLM-L6 32x128 and 1x128);
# GPU 0 resnet50 / resnet18 32x224^2 int8 and fp8 with per-layer profiles.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
QFUSE_CACHE_DIR=/tmp/qc0 timeout 100 torchrun --nproc_per_node 2 bench/qat_ddp_nccl.py \
  > $L/qat_ddp_nccl_log.txt 2>&1
echo "== qat ddp nccl exit $? at $((SECONDS - t0)) s"
grep -v "Warn\|^W1" $L/qat_ddp_nccl_log.txt | grep -B2 -A1 "Error\|error:" | head -12
grep -v "Warn\|^W1" $L/qat_ddp_nccl_log.txt | tail -5
QFUSE_CACHE_DIR=/tmp/qc0 timeout 120 torchrun --nproc_per_node 2 bench/calib_large.py \
  --mode sequential --layers 8 > $L/calib_2gpu_log.txt 2>&1
echo "== calib 2 GPUs exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/calib_2gpu_log.txt | tail -3
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout $((300 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > $L/models_b32_log.txt 2>&1
  echo "== [gpu1] bert b32 exit $? at $((SECONDS - t0)) s"; grep "^| bert" $L/models_b32_log.txt
  timeout $((430 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 8 --seq 512 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b8_s512.json" \
    > $L/models_s512_log.txt 2>&1
  echo "== [gpu1] bert 8x512 exit $? at $((SECONDS - t0)) s"; grep "^| bert" $L/models_s512_log.txt
  timeout $((575 - SECONDS)) python3 bench/bench_models.py --models minilm-l6 --batches 32,1 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_minilm.json" \
    > $L/models_minilm_log.txt 2>&1
  echo "== [gpu1] minilm exit $? at $((SECONDS - t0)) s"; grep "^| minilm" $L/models_minilm_log.txt
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 120 python3 bench/calib_large.py --mode sequential --layers 8 > $L/calib_1gpu_log.txt 2>&1
  echo "== [gpu0] calib 1 GPU exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/calib_1gpu_log.txt | tail -3
  timeout $((575 - SECONDS)) python3 bench/conv_networks.py --nets resnet50,resnet18 --batches 32 \
    --dtypes int8,fp8 --profile-batch 32 --layers int8 --out "$OUT/conv_networks.json" \
    > $L/conv_log.txt 2>&1
  echo "== [gpu0] conv exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/conv_log.txt | tail -34
) &
wait
tar czf "$OUT/logs.tgz" -C /tmp logs
ls "$OUT"
