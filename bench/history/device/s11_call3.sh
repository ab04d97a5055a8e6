#!/usr/bin/env bash
# Session 11, call 3 (nvidia-h100-x2 kind; one benchmark per GPU), after the fused attention's
# boolean-mask fix and the merged stem kernel:
# GPU 0: the GPU tests of the new kernels (attention, stem, quantize, fast epilogue, LayerNorm);
# resnet50/18; encoder GEMMs at M=4096 (attention out reading the fused attention's int8/fp8)
# and at M=128 (MiniLM 1x128's shapes).
# GPU 1: whole encoders graphed (BERT 32x128, MiniLM 32x128 / 1x128, BERT 8x512); the digits
# main job (qfuse sweep, `best` timed by CUDA-graph replays).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 110 python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > $L/models_b32_log.txt 2>&1
  echo "== [gpu1] bert b32 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_b32_log.txt | head -6
  timeout $((220 - SECONDS)) python3 bench/bench_models.py --models minilm-l6 --batches 32,1 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_minilm.json" \
    > $L/models_minilm_log.txt 2>&1
  echo "== [gpu1] minilm exit $? at $((SECONDS - t0)) s"; grep "^| minilm\|Error" $L/models_minilm_log.txt | head -8
  timeout $((335 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 8 --seq 512 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b8_s512.json" \
    > $L/models_s512_log.txt 2>&1
  echo "== [gpu1] bert 8x512 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_s512_log.txt | head -6
  timeout $((540 - SECONDS)) python3 -m qfuse sweep --out $L/digits_h200 --quiet > $L/sweep_log.txt 2>&1
  echo "== [gpu1] digits sweep exit $? at $((SECONDS - t0)) s"; grep -A12 "^| config" $L/digits_h200/report.md | cut -c1-220
  grep "^Chosen\|vs float" $L/digits_h200/report.md | cut -c1-300
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 140 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py \
    tests/ops/test_attention_op.py tests/fusion/test_attention_quant.py tests/kernels/test_stem.py \
    tests/kernels/test_quantize.py tests/kernels/test_fast_epilogue.py \
    tests/kernels/test_activations.py tests/ops/test_layernorm.py > $L/gpu_tests.txt 2>&1
  echo "== [gpu0] tests exit $? at $((SECONDS - t0)) s"; grep -B2 -A14 "^___" $L/gpu_tests.txt | head -40; tail -3 $L/gpu_tests.txt
  timeout $((385 - SECONDS)) python3 bench/conv_networks.py --nets resnet50,resnet18 --batches 32 \
    --dtypes int8,fp8 --profile-batch 32 --layers int8 --out "$OUT/conv_networks.json" \
    > $L/conv_log.txt 2>&1
  echo "== [gpu0] conv networks exit $? at $((SECONDS - t0)) s"; grep "qfuse.*compile/b32\|bf16_compile/b32" $L/conv_log.txt | head -8
  timeout $((480 - SECONDS)) python3 bench/encoder_gemms.py --M 4096 --models bert-base,minilm \
    --out "$OUT/encoder_gemms_m4096.json" > $L/encoder_gemms_log.txt 2>&1
  echo "== [gpu0] encoder gemms 4096 exit $? at $((SECONDS - t0)) s"; grep -A8 "^| model" $L/encoder_gemms_log.txt
  timeout $((540 - SECONDS)) python3 bench/encoder_gemms.py --M 128 --models minilm,bert-base \
    --out "$OUT/encoder_gemms_m128.json" > $L/encoder_gemms128_log.txt 2>&1
  echo "== [gpu0] encoder gemms 128 exit $? at $((SECONDS - t0)) s"; grep -A8 "^| model" $L/encoder_gemms128_log.txt
) &
wait
cp $L/gpu_tests.txt "$OUT/"
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
