#!/usr/bin/env bash
# Device call 3: MMA vs TMA vs warp-specialized TMA on BERT-base's GEMMs (+ the FFN-up epilogue's
# share), then MiniLM-L6 32x128 / 1x128 and BERT-base 8x512 whole models with every candidate.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD QFUSE_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
timeout 200 python3 bench/tma_ab.py --M 4096 --models bert-base --out "$OUT/tma_ab.json" 2>&1 \
  | grep -v Warn | tail -16
echo "== tma_ab: $((SECONDS - t0)) s"
timeout $((555 - SECONDS)) python3 bench/bench_models.py --models minilm-l6 --batches 32,1 \
  --impls bf16,qfuse_int8,qfuse_fp8 --out "$OUT/models_minilm_tma.json" 2>&1 | grep -v Warn | tail -8
echo "== models: $((SECONDS - t0)) s"
