#!/usr/bin/env bash
# Device call: TMA family GPU tests, encoder GEMMs at M=4096 with every candidate, BERT-base 32x128.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD QFUSE_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 200 python3 -m pytest -q -x tests/kernels/test_tma_gemm.py > "$OUT/gpu_tma_tests.txt" 2>&1
echo "== tma tests: exit $? in $((SECONDS - t0)) s"; tail -3 "$OUT/gpu_tma_tests.txt"
timeout 280 python3 bench/encoder_gemms.py --M 4096 --out "$OUT/encoder_gemms_tma_h100.json" 2>&1 \
  | grep -v Warn | tail -24
echo "== encoder gemms: $((SECONDS - t0)) s"
timeout $((560 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 32 \
  --impls bf16,qfuse_int8,qfuse_fp8 --out "$OUT/models_bert_b32_tma_h100.json" 2>&1 \
  | grep -v Warn | tail -14
echo "== models: $((SECONDS - t0)) s"
