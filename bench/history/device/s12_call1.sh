#!/usr/bin/env bash
# Session 12, call 1 (nvidia-h100-x2 kind; one benchmark per GPU): the TMA family's descriptor
# epilogue (output tile stored, residual tile read by the copy engine).
# GPU 0: the GEMM kernel tests on the GPU; encoder GEMMs at M=4096 (descriptor epilogue), BERT's
# again with the pointer epilogue (QFUSE_TMA_POINTER_EPILOGUE=1, the A/B in one run), M=16384.
# GPU 1: BERT-base 32x128 graphed; TinyLlama-shape decode step and generate() (bench_llm
# --plan generate); where generate()'s time goes (diag_generate: GPU vs wall, CUDA-graph skips).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 120 python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > $L/models_b32_log.txt 2>&1
  echo "== [gpu1] bert b32 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models_b32_log.txt | head -6
  timeout $((430 - SECONDS)) python3 bench/bench_llm.py --plan generate --modes generate,graph,compile \
    --impls bf16,qfuse_int8,qfuse_fp8 --budget-s $((400 - SECONDS)) --out "$OUT/llm_generate.json" \
    > $L/llm_log.txt 2>&1
  echo "== [gpu1] llm exit $? at $((SECONDS - t0)) s"; grep "^| \|target" $L/llm_log.txt | tail -14
  timeout $((570 - SECONDS)) python3 bench/diag_generate.py --impls bf16,qfuse_int8 --tokens 32 \
    --out $L/diag_generate.json > $L/diag_generate_log.txt 2>&1
  echo "== [gpu1] diag generate exit $? at $((SECONDS - t0)) s"; grep "^{" $L/diag_generate_log.txt | cut -c1-900
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tma_gemm.py \
    tests/kernels/test_gated_epilogue.py tests/kernels/test_fast_epilogue.py > $L/gpu_tests_tma.txt 2>&1
  echo "== [gpu0] tests exit $? at $((SECONDS - t0)) s"; grep -B2 -A14 "^___" $L/gpu_tests_tma.txt | head -30; tail -2 $L/gpu_tests_tma.txt
  timeout $((250 - SECONDS)) python3 bench/encoder_gemms.py --M 4096 --models bert-base,minilm \
    --out "$OUT/encoder_gemms_m4096.json" > $L/encoder_gemms_log.txt 2>&1
  echo "== [gpu0] encoder gemms 4096 exit $? at $((SECONDS - t0)) s"; grep -A8 "^| model" $L/encoder_gemms_log.txt
  QFUSE_TMA_POINTER_EPILOGUE=1 QFUSE_CACHE_DIR=/tmp/qc0p timeout $((340 - SECONDS)) python3 bench/encoder_gemms.py \
    --M 4096 --models bert-base --out $L/encoder_gemms_m4096_pointer.json > $L/encoder_gemms_ptr_log.txt 2>&1
  echo "== [gpu0] encoder gemms 4096 pointer epilogue exit $? at $((SECONDS - t0)) s"; grep -A5 "^| model" $L/encoder_gemms_ptr_log.txt
  timeout $((570 - SECONDS)) python3 bench/encoder_gemms.py --M 16384 --models bert-base,minilm \
    --out "$OUT/encoder_gemms_m16384.json" > $L/encoder_gemms16k_log.txt 2>&1
  echo "== [gpu0] encoder gemms 16384 exit $? at $((SECONDS - t0)) s"; grep -A8 "^| model" $L/encoder_gemms16k_log.txt
) &
wait
cp $L/gpu_tests_tma.txt "$OUT/"
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
