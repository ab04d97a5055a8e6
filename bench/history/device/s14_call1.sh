#!/usr/bin/env bash
# Session 14, call 1 (nvidia-h100-x2 kind): programmatic dependent launch (PDL) for the decode GEMMs.
# GPU 1: GPU tests of the decode kernel (PDL chain in a CUDA graph, traced route), the TMA route
# (renamed opaque op) and tests/integrations.
# GPU 0, alone for the timed part: the 88 decode GEMMs of a TinyLlama step back to back in one graph
# (bench/decode_chain.py, PDL off/on, bf16 cuBLAS beside); then the decode step, graphed and
# compiled (bench_llm), PDL on, and the compiled int8 row with QFUSE_PDL=0 in a fresh Inductor cache.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_decode_gemm.py \
    tests/kernels/test_tma_gemm.py tests/integrations > $L/gpu_tests_pdl.txt 2>&1
  echo "== [gpu1] tests exit $? at $((SECONDS - t0)) s"; tail -8 $L/gpu_tests_pdl.txt
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 200 python3 bench/decode_chain.py --ms 1 --out "$OUT/decode_chain.json" > $L/chain_log.txt 2>&1
  echo "== [gpu0] chain exit $? at $((SECONDS - t0)) s"; tail -8 $L/chain_log.txt
  export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_pdl
  timeout $((470 - SECONDS)) python3 bench/bench_llm.py --plan generate --modes graph,compile \
    --impls bf16,qfuse_int8,qfuse_fp8 --budget-s $((440 - SECONDS)) \
    --out "$OUT/llm_decode_pdl.json" > $L/llm_log.txt 2>&1
  echo "== [gpu0] llm exit $? at $((SECONDS - t0)) s"; grep "^| " $L/llm_log.txt | cut -c1-300 | tail -10
  export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_nopdl QFUSE_PDL=0
  timeout $((570 - SECONDS)) python3 bench/bench_llm.py --plan generate --modes compile \
    --impls qfuse_int8 --budget-s $((545 - SECONDS)) \
    --out "$OUT/llm_decode_nopdl.json" > $L/llm_nopdl_log.txt 2>&1
  echo "== [gpu0] llm nopdl exit $? at $((SECONDS - t0)) s"; grep "^| " $L/llm_nopdl_log.txt | cut -c1-300 | tail -6
) &
wait
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
