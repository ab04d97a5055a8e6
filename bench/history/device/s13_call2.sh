#!/usr/bin/env bash
# Session 13, call 2 (nvidia-h100-x2 kind): qfuse's DecodeGraphs for generate()'s decode steps.
# GPU 1: the GPU tests of DecodeGraphs and of generate() parity (tokens equal to the CPU's).
# (DecodeGraphs with a cheaper per-call path; diag_generate times the compiled decode call alone)
# GPU 0, alone for the timed part: generate() per-token time, bf16 and qfuse int8/fp8, each with
# the decode machinery a user gets and with the other one (bench_llm decode_machinery); then
# where the time goes (diag_generate), both machineries.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/integrations/test_decode_graphs.py \
    tests/test_generate.py > $L/gpu_tests_decode_graphs.txt 2>&1
  echo "== [gpu1] tests exit $? at $((SECONDS - t0)) s"; tail -5 $L/gpu_tests_decode_graphs.txt
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 330 python3 bench/bench_llm.py --plan generate \
    --modes generate,generate-trees,generate-decodegraphs --impls bf16,qfuse_int8,qfuse_fp8 --budget-s 300 \
    --out "$OUT/llm_generate.json" > $L/llm_log.txt 2>&1
  echo "== [gpu0] llm exit $? at $((SECONDS - t0)) s"; grep "^| \|target\|decode_graphs" $L/llm_log.txt | cut -c1-400 | tail -16
  timeout $((575 - SECONDS)) python3 bench/diag_generate.py --impls qfuse_int8,bf16,bf16:decodegraphs \
    --tokens 24 --out "$OUT/diag_generate.json" > $L/diag_generate_log.txt 2>&1
  echo "== [gpu0] diag generate exit $? at $((SECONDS - t0)) s"; grep "^{" $L/diag_generate_log.txt | cut -c1-600
) &
wait
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
