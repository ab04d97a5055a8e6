#!/usr/bin/env bash
# Session 12, call 2 (nvidia-h100-x2 kind; one benchmark per GPU), back on the pointer epilogue
# with the two-stage TMA schedules:
# GPU 0: encoder GEMMs at M=4096 (BERT-base, MiniLM); BERT-base 32x128 graphed.
# GPU 1: where generate()'s host time goes, bf16 against qfuse int8 (diag_generate with
# Python's own profile per token).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 200 python3 bench/diag_generate.py --impls bf16,qfuse_int8 --tokens 32 \
    --out "$OUT/diag_generate.json" > $L/diag_generate_log.txt 2>&1
  echo "== [gpu1] diag generate exit $? at $((SECONDS - t0)) s"; grep "^{\|host " $L/diag_generate_log.txt | cut -c1-400
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 110 python3 bench/encoder_gemms.py --M 4096 --models bert-base,minilm \
    --out "$OUT/encoder_gemms_m4096.json" > $L/encoder_gemms_log.txt 2>&1
  echo "== [gpu0] encoder gemms 4096 exit $? at $((SECONDS - t0)) s"; grep -A8 "^| model" $L/encoder_gemms_log.txt
  timeout $((200 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > $L/models_b32_log.txt 2>&1
  echo "== [gpu0] bert b32 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_b32_log.txt | head -6
) &
wait
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
