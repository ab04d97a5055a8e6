#!/usr/bin/env bash
# Session 12, call 4 (nvidia-h100-x2 kind; one benchmark per GPU): 1x1 stride-1 convs through the
# TMA GEMM with split-K (kernels/conv_tma.py, merged from the conv1x1 branch).
# GPU 0: the conv GPU tests (new TMA path at resnet50 shapes, torch.compile route; the old conv
# tests, whose 1x1 shape now routes through TMA); every resnet50 1x1 conv: implicit GEMM vs TMA
# (each candidate) vs cuDNN bf16.
# GPU 1: resnet50/18 32x224 with the TMA route (profiled), then resnet50 with every 1x1 conv kept
# on the implicit GEMM (QFUSE_CONV1X1_PATH=mma): the network A/B in one run on one card.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 260 python3 bench/conv_networks.py --nets resnet50,resnet18 --batches 32 \
    --dtypes int8,fp8 --profile-batch 32 --layers int8 --out "$OUT/conv_networks.json" \
    > $L/conv_log.txt 2>&1
  echo "== [gpu1] conv networks exit $? at $((SECONDS - t0)) s"; grep "qfuse.*compile/b32\|bf16_compile/b32\|Error" $L/conv_log.txt | head -10
  QFUSE_CONV1X1_PATH=mma timeout $((430 - SECONDS)) python3 bench/conv_networks.py --nets resnet50 \
    --batches 32 --dtypes int8,fp8 --profile-batch 0 --layers '' --out $L/conv_networks_mma.json \
    > $L/conv_mma_log.txt 2>&1
  echo "== [gpu1] resnet50 1x1 on the implicit GEMM exit $? at $((SECONDS - t0)) s"; grep "qfuse.*compile/b32\|bf16_compile/b32\|Error" $L/conv_mma_log.txt | head -6
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_conv_tma.py \
    tests/kernels/test_conv.py > $L/gpu_tests_conv.txt 2>&1
  echo "== [gpu0] conv gpu tests exit $? at $((SECONDS - t0)) s"; grep -B2 -A14 "^___" $L/gpu_tests_conv.txt | head -30; tail -2 $L/gpu_tests_conv.txt
  timeout $((430 - SECONDS)) python3 bench/conv1x1_ab.py --out "$OUT/conv1x1_ab.json" > $L/conv1x1_ab_log.txt 2>&1
  echo "== [gpu0] conv1x1 A/B exit $? at $((SECONDS - t0)) s"; grep -v "^ \|Warn" $L/conv1x1_ab_log.txt | tail -40
) &
wait
cp $L/gpu_tests_conv.txt "$OUT/"
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
