#!/usr/bin/env bash
# Issue #10's GPU work in as few device calls as possible; run from the repo root on the GPU
# machine, each call the same command (later calls pick up where the last one stopped):
#   QFUSE_COMMIT=$(cat .commit) OUT=$OUT bash bench/models/gpu_encoders.sh [tests] [models] [diag]
# tests:  the GPU tests of the encoder paths (compiled vs eager, fullgraph, fast epilogue,
#         LayerNorm/QKV fusion, export) on the CUDA kernels;
# models: bench.models.bench_models --resume into $OUT/models_h200.json (copy the previous call's
#         file there first when its commit is this one), a 420 s budget so the call ends with
#         whole rows;
# diag:   per-kernel GEMM times inside BERT-base 32x128 (bench.diag.diag_model_gemms).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0  # python -m from the repo root finds qfuse, bench
phases=${*:-tests models}
for phase in $phases; do
  t0=$SECONDS
  case $phase in
    tests)
      timeout 240 python3 -m pytest -q -x -m gpu tests/ops/test_qlinear_compile.py \
        tests/kernels/test_fast_epilogue.py tests/kernels/test_tuning.py \
        > "$OUT/gpu_tests.txt" 2>&1
      echo "== tests: exit $? in $((SECONDS - t0)) s"; tail -3 "$OUT/gpu_tests.txt"
      timeout 180 python3 -m pytest -q -x tests/nn tests/ops/test_layernorm.py \
        tests/fusion/test_norm_quant.py tests/fusion/test_siblings.py tests/export \
        tests/kernels/test_qgemm.py >> "$OUT/gpu_tests.txt" 2>&1
      echo "== CUDA runs of the CPU suites: exit $? in $((SECONDS - t0)) s"
      tail -3 "$OUT/gpu_tests.txt" ;;
    models)
      python3 -m bench.models.bench_models --resume --budget-s 420 --out "$OUT/models_h200.json" \
        2>&1 | grep -v Warning | tail -40
      echo "== models: $((SECONDS - t0)) s" ;;
    diag)
      timeout 150 python3 -m bench.diag.diag_model_gemms --out "$OUT/diag_model_gemms.json" 2>&1 \
        | grep -v Warn | tail -30
      echo "== diag: $((SECONDS - t0)) s" ;;
    *) echo "unknown phase $phase (tests, models, diag)"; exit 2 ;;
  esac
done
