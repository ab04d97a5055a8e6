#!/usr/bin/env bash
# Session 12, call 5 (nvidia-h100-x2 kind; one benchmark per GPU), after call 4's measurements
# set the 1x1 TMA conv's residual schedule and its fp8 promotion cap:
# GPU 0: the conv GPU tests (test_conv_tma, test_conv) and the TMA GEMM tests on the GPU; every
# resnet50 1x1 conv again (implicit GEMM vs TMA pick vs each candidate vs cuDNN bf16).
# GPU 1: resnet50/18 32x224 graphed, compiled (profiled).
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
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_conv_tma.py \
    tests/kernels/test_conv.py > $L/gpu_tests_conv.txt 2>&1
  echo "== [gpu0] conv gpu tests exit $? at $((SECONDS - t0)) s"; grep -B2 -A14 "^___" $L/gpu_tests_conv.txt | head -30; tail -2 $L/gpu_tests_conv.txt
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tma_gemm.py \
    > $L/gpu_tests_tma.txt 2>&1
  echo "== [gpu0] tma gemm tests exit $? at $((SECONDS - t0)) s"; grep -B2 -A14 "^___" $L/gpu_tests_tma.txt | head -30; tail -2 $L/gpu_tests_tma.txt
  timeout $((270 - SECONDS)) python3 bench/conv1x1_ab.py --out "$OUT/conv1x1_ab.json" > $L/conv1x1_ab_log.txt 2>&1
  echo "== [gpu0] conv1x1 A/B exit $? at $((SECONDS - t0)) s"; grep "^net" $L/conv1x1_ab_log.txt
) &
wait
cp $L/gpu_tests_conv.txt $L/gpu_tests_tma.txt "$OUT/"
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
