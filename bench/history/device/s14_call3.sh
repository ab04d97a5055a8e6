#!/usr/bin/env bash
# Session 14, call 3 (nvidia-h100-x2 kind): qfuse's decode attention (GQA flash-decoding over the
# static cache, installed on converted models) with the PDL decode GEMMs and tuned decode rows.
# GPU 0, alone for the timed part: generate() per-token time, every decode machinery (bench_llm
# --plan generate, generate modes; no Inductor switch set: the rows are what a user gets).
# GPU 1: GPU tests (decode attention, integrations, generate parity, decode GEMM PDL), the
# attention A/B (bench/decode_attention_ab.py --sweep), then the compiled decode step with
# Inductor's PDL on for every model (TORCHINDUCTOR_ENABLE_PDL=1), and qfuse int8's step without
# qfuse's attention (QFUSE_DECODE_ATTENTION=0), each in its own Inductor cache.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_decode_attention.py \
    tests/integrations tests/test_generate.py tests/kernels/test_decode_gemm.py > $L/gpu_tests.txt 2>&1
  echo "== [gpu1] tests exit $? at $((SECONDS - t0)) s"; grep -E "passed|failed|Error" $L/gpu_tests.txt | tail -4
  timeout 90 python3 bench/decode_attention_ab.py --sweep --out "$OUT/decode_attention_ab.json" > $L/attn_ab.txt 2>&1
  echo "== [gpu1] attention ab exit $? at $((SECONDS - t0)) s"; tail -12 $L/attn_ab.txt
  TORCHINDUCTOR_ENABLE_PDL=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_step timeout $((470 - SECONDS)) \
    python3 bench/bench_llm.py --plan generate --modes compile --impls bf16,qfuse_int8,qfuse_fp8 \
    --budget-s $((450 - SECONDS)) --out "$OUT/llm_step_indpdl.json" > $L/llm_step.txt 2>&1
  echo "== [gpu1] step exit $? at $((SECONDS - t0)) s"; grep "^| " $L/llm_step.txt | cut -c1-200 | tail -4
  QFUSE_DECODE_ATTENTION=0 TORCHINDUCTOR_ENABLE_PDL=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_step_sdpa \
    timeout $((570 - SECONDS)) python3 bench/bench_llm.py --plan generate --modes compile \
    --impls qfuse_int8 --budget-s $((550 - SECONDS)) --out "$OUT/llm_step_sdpa.json" > $L/llm_step_sdpa.txt 2>&1
  echo "== [gpu1] step sdpa exit $? at $((SECONDS - t0)) s"; grep "^| " $L/llm_step_sdpa.txt | cut -c1-200 | tail -2
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 570 python3 bench/bench_llm.py --plan generate \
    --modes generate,generate-decodegraphs-attn,generate-decodegraphs,generate-sdpa,generate-trees \
    --impls bf16,qfuse_int8,qfuse_fp8 --budget-s 520 --out "$OUT/llm_generate.json" > $L/llm_log.txt 2>&1
  echo "== [gpu0] llm exit $? at $((SECONDS - t0)) s"; grep "^| \|target" $L/llm_log.txt | cut -c1-250 | tail -14
) &
wait
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
