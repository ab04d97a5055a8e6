#!/usr/bin/env bash
# Session 14, call 2 (nvidia-h100-x2 kind): PDL for the TMA GEMMs too; decode schedules tuned inside
# the step's chain; Inductor's own PDL (TORCHINDUCTOR_ENABLE_PDL=1) as an A/B for every model.
# GPU 0: decode_chain --tune (each role's schedule timed inside the graphed 88-GEMM chain), then the
# compiled decode step (bench_llm) with Inductor's PDL on, bf16 and qfuse.
# GPU 1: GPU tests (decode PDL chain, TMA route), then BERT-base 32x128 compiled+graphed: qfuse PDL on
# (default), off (QFUSE_PDL=0), and with Inductor's PDL on for bf16 and qfuse; each in its own
# Inductor cache (the FX cache does not key on these switches).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_decode_gemm.py \
    tests/kernels/test_tma_gemm.py > $L/gpu_tests.txt 2>&1
  echo "== [gpu1] tests exit $? at $((SECONDS - t0)) s"; tail -2 $L/gpu_tests.txt
  for v in pdl:1:0 nopdl:0:0 indpdl:1:1; do
    IFS=: read name q ind <<< "$v"
    impls=bf16,qfuse_int8,qfuse_fp8; [ $name = nopdl ] && impls=qfuse_int8,qfuse_fp8
    QFUSE_PDL=$q TORCHINDUCTOR_ENABLE_PDL=$ind TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$name \
      timeout $((560 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 32 \
      --impls $impls --modes graph --out "$OUT/bert_b32_$name.json" > $L/bert_$name.txt 2>&1
    echo "== [gpu1] bert $name exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/bert_$name.txt | head -4
  done
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 330 python3 bench/decode_chain.py --ms 1 --tune --out "$OUT/decode_chain_tune.json" > $L/chain_log.txt 2>&1
  echo "== [gpu0] chain exit $? at $((SECONDS - t0)) s"; grep -v "^{" $L/chain_log.txt | tail -14
  TORCHINDUCTOR_ENABLE_PDL=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_llm timeout $((565 - SECONDS)) \
    python3 bench/bench_llm.py --plan generate --modes compile --impls bf16,qfuse_int8,qfuse_fp8 \
    --budget-s $((540 - SECONDS)) --out "$OUT/llm_decode_indpdl.json" > $L/llm_log.txt 2>&1
  echo "== [gpu0] llm exit $? at $((SECONDS - t0)) s"; grep "^| " $L/llm_log.txt | cut -c1-200 | tail -5
) &
wait
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
