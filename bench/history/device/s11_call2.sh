#!/usr/bin/env bash
# Session 11, call 2 (nvidia-h100-x2 kind; one benchmark per GPU): the fused attention
# (kernels/attention, fusion/attention_quant) and the implicit-GEMM stem (kernels/stem) on the
# GPU, then whole models with them.
# GPU 0: their GPU tests and the kernel tests the epilogue diet touches; attention_ab, stem_ab.
# GPU 1: whole models graphed (BERT 32x128, MiniLM 32x128 / 1x128, BERT 8x512, resnet50/18).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 130 python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > $L/models_b32_log.txt 2>&1
  echo "== [gpu1] bert b32 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_b32_log.txt | head -8
  timeout $((240 - SECONDS)) python3 bench/bench_models.py --models minilm-l6 --batches 32,1 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_minilm.json" \
    > $L/models_minilm_log.txt 2>&1
  echo "== [gpu1] minilm exit $? at $((SECONDS - t0)) s"; grep "^| minilm\|Error" $L/models_minilm_log.txt | head -8
  timeout $((340 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 8 --seq 512 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b8_s512.json" \
    > $L/models_s512_log.txt 2>&1
  echo "== [gpu1] bert 8x512 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_s512_log.txt | head -8
  timeout $((580 - SECONDS)) python3 bench/conv_networks.py --nets resnet50,resnet18 --batches 32 \
    --dtypes int8,fp8 --profile-batch 32 --layers int8 --out "$OUT/conv_networks.json" \
    > $L/conv_log.txt 2>&1
  echo "== [gpu1] conv networks exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/conv_log.txt | tail -12
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py \
    tests/kernels/test_attention_compile.py tests/ops/test_attention_op.py \
    tests/fusion/test_attention_quant.py tests/kernels/test_stem.py tests/kernels/test_quantize.py \
    tests/kernels/test_fast_epilogue.py tests/kernels/test_activations.py \
    tests/ops/test_layernorm.py > $L/gpu_tests_new.txt 2>&1
  echo "== [gpu0] new-kernel tests exit $? at $((SECONDS - t0)) s"; grep -B3 -A12 "^___\|Error" $L/gpu_tests_new.txt | head -60; tail -3 $L/gpu_tests_new.txt
  timeout $((330 - SECONDS)) python3 bench/attention_ab.py --out "$OUT/attention_ab.json" > $L/attention_ab_log.txt 2>&1
  echo "== [gpu0] attention_ab exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/attention_ab_log.txt | tail -16
  timeout $((430 - SECONDS)) python3 bench/stem_ab.py --out "$OUT/stem_ab.json" > $L/stem_ab_log.txt 2>&1
  echo "== [gpu0] stem_ab exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/stem_ab_log.txt | tail -14
  timeout $((575 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_tma_gemm.py \
    tests/kernels/test_gated_epilogue.py tests/kernels/test_qgemm.py > $L/gpu_tests_gemm.txt 2>&1
  echo "== [gpu0] gemm tests exit $? at $((SECONDS - t0)) s"; grep -B3 -A12 "^___" $L/gpu_tests_gemm.txt | head -30; tail -2 $L/gpu_tests_gemm.txt
) &
wait
cp $L/gpu_tests_new.txt $L/gpu_tests_gemm.txt "$OUT/"
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
