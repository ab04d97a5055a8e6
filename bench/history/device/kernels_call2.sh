#!/usr/bin/env bash
# Device call 2: the TMA/WS A/B on the encoder GEMMs (+ the FFN-up epilogue's share), then where
# BERT-base 32x128's quantized GEMM time goes inside the graphed model.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD QFUSE_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
timeout 120 python3 -m pytest -q -x tests/kernels/test_tma_gemm.py > "$OUT/gpu_tma_tests2.txt" 2>&1
echo "== tma tests: exit $? in $((SECONDS - t0)) s"; tail -2 "$OUT/gpu_tma_tests2.txt"
timeout 300 python3 bench/tma_ab.py --M 4096 --out "$OUT/tma_ab.json" 2>&1 | grep -v Warn | tail -30
echo "== tma_ab: $((SECONDS - t0)) s"
timeout $((560 - SECONDS)) python3 bench/diag_model_gemms.py --model bert-base --batch 32 \
  --out "$OUT/diag_bert_gemms.json" 2>&1 | grep -v Warn | tail -24
echo "== diag: $((SECONDS - t0)) s"
