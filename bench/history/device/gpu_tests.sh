#!/usr/bin/env bash
# The kernel suites on the GPU, split over the GPUs of one device call so that a call's time
# limit does not cut them (session 11's single-process runs stopped at 24-63%): one pytest
# process per GPU, each over its share of the files, logs to $OUT (or /tmp/logs).
#   bash bench/device/gpu_tests.sh [seconds]        (default 540)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
LIMIT=${1:-540}
OUTDIR=${OUT:-/tmp/logs}; mkdir -p "$OUTDIR"
FILES=(tests/kernels/test_qgemm.py tests/kernels/test_conv.py tests/kernels/test_stem.py
       tests/kernels/test_attention.py tests/ops/test_attention_op.py
       tests/fusion/test_attention_quant.py tests/kernels/test_tma_gemm.py
       tests/kernels/test_decode_gemm.py tests/kernels/test_gated_epilogue.py
       tests/kernels/test_quantize.py tests/kernels/test_fast_epilogue.py
       tests/kernels/test_activations.py tests/ops/test_layernorm.py tests/kernels/test_conv_sm90.py)
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
for g in $(seq 0 $((GPUS - 1))); do
  share=()
  for i in "${!FILES[@]}"; do
    if [ $((i % GPUS)) -eq "$g" ]; then share+=("${FILES[$i]}"); fi
  done
  (
    CUDA_VISIBLE_DEVICES=$g QFUSE_CACHE_DIR=/tmp/qc$g timeout "$LIMIT" python3 -m pytest -q \
      -p no:cacheprovider -rf "${share[@]}" > "$OUTDIR/gpu_tests_gpu$g.txt" 2>&1
    echo "== gpu$g exit $?: $(tail -1 "$OUTDIR/gpu_tests_gpu$g.txt")"
  ) &
done
wait
