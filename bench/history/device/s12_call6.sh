#!/usr/bin/env bash
# Session 12, call 6 (nvidia-h100-x2 kind; one benchmark per GPU): whole encoders graphed after
# the tuned table's BERT/MiniLM rows moved to the current kernels' measured schedules.
# GPU 0: BERT-base 32x128, then 8x512. GPU 1: MiniLM-L6 32x128 / 1x128.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 150 python3 bench/bench_models.py --models minilm-l6 --batches 32,1 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_minilm.json" \
    > $L/models_minilm_log.txt 2>&1
  echo "== [gpu1] minilm exit $? at $((SECONDS - t0)) s"; grep "^| minilm\|Error" $L/models_minilm_log.txt | head -8
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 110 python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > $L/models_b32_log.txt 2>&1
  echo "== [gpu0] bert b32 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_b32_log.txt | head -6
  timeout $((215 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 8 --seq 512 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b8_s512.json" \
    > $L/models_s512_log.txt 2>&1
  echo "== [gpu0] bert 8x512 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_s512_log.txt | head -6
) &
wait
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
