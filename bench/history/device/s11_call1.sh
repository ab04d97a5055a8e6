#!/usr/bin/env bash
# Session 11, call 1 (nvidia-h100-x2 kind; one benchmark per GPU): the epilogue diet (quantize by
# cvt.rni.sat, fp8 without clamps, GELU/SiLU on rcp/ex2.approx, LayerNorm's GPU rounding).
# GPU 0: the kernels' tests on the GPU (bit-exactness of the new int8 path), the LayerNorm
# schedules, encoder GEMMs at M=16384. GPU 1: encoder GEMMs at M=4096, BERT-base 32x128 graphed.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 330 python3 bench/encoder_gemms.py --M 4096 --models bert-base,minilm \
    --out "$OUT/encoder_gemms_m4096.json" > $L/encoder_gemms_log.txt 2>&1
  echo "== [gpu1] encoder gemms 4096 exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/encoder_gemms_log.txt | tail -14
  timeout $((560 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > $L/models_log.txt 2>&1
  echo "== [gpu1] bert b32 exit $? at $((SECONDS - t0)) s"; grep "^| bert" $L/models_log.txt
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 240 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_qgemm.py \
    tests/kernels/test_tma_gemm.py tests/kernels/test_fast_epilogue.py \
    tests/kernels/test_activations.py tests/kernels/test_quantize.py \
    tests/kernels/test_gated_epilogue.py tests/kernels/test_decode_gemm.py \
    tests/ops/test_layernorm.py tests/kernels/test_conv.py > $L/gpu_kernel_tests.txt 2>&1
  echo "== [gpu0] kernel tests exit $? at $((SECONDS - t0)) s"; grep -B5 "Error\|assert" $L/gpu_kernel_tests.txt | head -30; tail -2 $L/gpu_kernel_tests.txt
  timeout 60 python3 bench/bench_layernorm.py --out "$OUT/layernorm.json" > $L/layernorm_log.txt 2>&1
  echo "== [gpu0] layernorm exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/layernorm_log.txt | tail -12
  timeout $((570 - SECONDS)) python3 bench/encoder_gemms.py --M 16384 --models bert-base,minilm \
    --out "$OUT/encoder_gemms_m16384.json" > $L/encoder_gemms16k_log.txt 2>&1
  echo "== [gpu0] encoder gemms 16384 exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/encoder_gemms16k_log.txt | tail -14
) &
wait
cp $L/gpu_kernel_tests.txt "$OUT/"
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
