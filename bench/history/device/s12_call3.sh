#!/usr/bin/env bash
# Session 12, call 3 (nvidia-h100-x2 kind; one benchmark per GPU):
# GPU 0: whole encoders graphed on the call-2 tree's GEMM schedules: MiniLM-L6 32x128 / 1x128,
# BERT-base 8x512.
# GPU 1: generate()'s host time, bf16 against qfuse int8: per-token wall from a long minus a
# short call, the same with Dynamo's guards skipped, Python's own and cumulative profiles.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 230 python3 bench/diag_generate.py --impls bf16,qfuse_int8 --tokens 24 \
    --out "$OUT/diag_generate.json" > $L/diag_generate_log.txt 2>&1
  echo "== [gpu1] diag generate exit $? at $((SECONDS - t0)) s"; grep "^{\|cumulative\|own" $L/diag_generate_log.txt | cut -c1-300
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 120 python3 bench/bench_models.py --models minilm-l6 --batches 32,1 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_minilm.json" \
    > $L/models_minilm_log.txt 2>&1
  echo "== [gpu0] minilm exit $? at $((SECONDS - t0)) s"; grep "^| minilm\|Error" $L/models_minilm_log.txt | head -8
  timeout $((235 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 8 --seq 512 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b8_s512.json" \
    > $L/models_s512_log.txt 2>&1
  echo "== [gpu0] bert 8x512 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_s512_log.txt | head -6
) &
wait
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
