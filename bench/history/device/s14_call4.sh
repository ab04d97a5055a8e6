#!/usr/bin/env bash
# Session 14, call 4 (nvidia-h100-x2 kind): the final tree, second samples and the rows the README
# needs. GPU 0, alone for the timed part: generate() per token (second sample of call 3's rows).
# GPU 1: the decode attention's parity inside a bf16 greedy decode; the compiled decode step with
# no Inductor switch (as torch.compile gives it to every model); the decode GEMM chain; BERT-base
# 32x128 and 8x512, MiniLM-L6 32x128 and 1x128, compiled and graphed (TMA GEMMs now PDL launches).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=index,name --format=csv,noheader
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1 QFUSE_CACHE_DIR=/tmp/qc1
  timeout 90 python3 bench/attention_parity.py --out "$OUT/attention_parity.json" > $L/parity.txt 2>&1
  echo "== [gpu1] parity exit $? at $((SECONDS - t0)) s"; tail -1 $L/parity.txt
  timeout 150 python3 bench/bench_llm.py --plan generate --modes compile --impls bf16,qfuse_int8,qfuse_fp8 \
    --budget-s 130 --out "$OUT/llm_step.json" > $L/llm_step.txt 2>&1
  echo "== [gpu1] step exit $? at $((SECONDS - t0)) s"; grep "^| " $L/llm_step.txt | cut -c1-200 | tail -4
  timeout 100 python3 bench/decode_chain.py --ms 1 --out "$OUT/decode_chain.json" > $L/chain.txt 2>&1
  echo "== [gpu1] chain exit $? at $((SECONDS - t0)) s"; tail -6 $L/chain.txt
  timeout $((520 - SECONDS)) python3 bench/bench_models.py --models minilm-l6,bert-base --batches 32,1 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_b32_b1.json" > $L/models.txt 2>&1
  echo "== [gpu1] models exit $? at $((SECONDS - t0)) s"; grep "^| bert\|^| minilm\|Error" $L/models.txt | head -12
  timeout $((570 - SECONDS)) python3 bench/bench_models.py --models bert-base --batches 8 --seq 512 \
    --impls bf16,qfuse_int8,qfuse_fp8 --modes graph --out "$OUT/models_bert_b8_s512.json" > $L/models512.txt 2>&1
  echo "== [gpu1] bert 512 exit $? at $((SECONDS - t0)) s"; grep "^| bert\|Error" $L/models512.txt | head -4
) &
(
  export CUDA_VISIBLE_DEVICES=0 QFUSE_CACHE_DIR=/tmp/qc0
  timeout 500 python3 bench/bench_llm.py --plan generate \
    --modes generate,generate-decodegraphs-attn,generate-decodegraphs,generate-sdpa \
    --impls bf16,qfuse_int8,qfuse_fp8 --budget-s 450 --out "$OUT/llm_generate.json" > $L/llm_log.txt 2>&1
  echo "== [gpu0] llm exit $? at $((SECONDS - t0)) s"; grep "^| \|target" $L/llm_log.txt | cut -c1-250 | tail -10
) &
wait
tar czf "$OUT/logs.tgz" -C $L .
ls "$OUT"
