#!/usr/bin/env bash
# Session 10, call 3 (nvidia-h100-x2 kind; both GPUs). #26 first while both GPUs are idle: QAT
# DDP over NCCL (LSQ scales now follow the model to its GPU), 8 7B-shape layers calibrated +
# GPTQ'd on 2 GPUs and on 1 (calib_large's per-phase split). Then in parallel: GPU 0 the
# calibrate GPU tests (shards included) and TinyLlama-shape generate() / decode; GPU 1 the
# whole encoders graphed after the NaN marks went where float inputs reach, and digits.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
QFUSE_CACHE_DIR=/tmp/qc0 timeout 90 torchrun --nproc_per_node 2 bench/qat_ddp_nccl.py \
  > $L/qat_ddp_nccl_log.txt 2>&1
echo "== qat ddp nccl exit $? at $((SECONDS - t0)) s"
grep -v "Warn\|^W1" $L/qat_ddp_nccl_log.txt | grep -B2 -A1 "Error\|error:" | head -8
grep -v "Warn\|^W1" $L/qat_ddp_nccl_log.txt | tail -4
QFUSE_CACHE_DIR=/tmp/qc0 timeout 110 torchrun --nproc_per_node 2 bench/calib_large.py \
  --mode sequential --layers 8 > $L/calib_2gpu_log.txt 2>&1
echo "== calib 2 GPUs exit $? at $((SECONDS - t0)) s"; grep -v "Warn\|^stage\|^W1" $L/calib_2gpu_log.txt | tail -8
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout $((300 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 32 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b32.json" \
    > $L/models_b32_log.txt 2>&1
  echo "== [gpu1] bert b32 exit $? at $((SECONDS - t0)) s"; grep "^| bert" $L/models_b32_log.txt
  timeout $((410 - SECONDS)) python3 bench/bench_models.py --models minilm-l6 --batches 32,1 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_minilm.json" \
    > $L/models_minilm_log.txt 2>&1
  echo "== [gpu1] minilm exit $? at $((SECONDS - t0)) s"; grep "^| minilm" $L/models_minilm_log.txt
  timeout $((500 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 8 --seq 512 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out $L/models_bert_b8_s512.json \
    > $L/models_s512_log.txt 2>&1
  echo "== [gpu1] bert 8x512 exit $? at $((SECONDS - t0)) s"; grep "^| bert" $L/models_s512_log.txt
  timeout $((560 - SECONDS)) python3 bench/digits_speed.py --out $L/digits_h200.json \
    > $L/digits_log.txt 2>&1
  echo "== [gpu1] digits exit $? at $((SECONDS - t0)) s"; grep -v Warn $L/digits_log.txt | tail -8
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 100 python3 bench/calib_large.py --mode sequential --layers 8 > $L/calib_1gpu_log.txt 2>&1
  echo "== [gpu0] calib 1 GPU exit $? at $((SECONDS - t0)) s"; grep -v "Warn\|^stage" $L/calib_1gpu_log.txt | tail -8
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/calibrate/test_sequential_gpu.py \
    > $L/gpu_tests_calibrate.txt 2>&1
  echo "== [gpu0] calibrate gpu tests exit $? at $((SECONDS - t0)) s"; tail -1 $L/gpu_tests_calibrate.txt
  timeout $((575 - SECONDS)) python3 bench/bench_llm.py --plan generate --modes generate,graph,compile \
    --impls bf16,qfuse_int8,qfuse_fp8 --budget-s $((545 - SECONDS)) --out "$OUT/llm_generate.json" \
    > $L/llm_log.txt 2>&1
  echo "== [gpu0] llm exit $? at $((SECONDS - t0)) s"; grep "^| \|target" $L/llm_log.txt | tail -14
) &
wait
tar czf "$OUT/logs.tgz" -C /tmp logs
ls "$OUT"
