#!/usr/bin/env bash
# Session 14, call 5 (nvidia-h100-x2 kind): generate() per token alone on the host. In calls 3 and 4
# GPU 1 compiled at the same time (tests, Inductor, a 12-process Triton precompile), and the
# host-bound generate rows moved with it (qfuse fp8: 1952 us in call 3, 2835 in call 4). Here
# nothing else runs: GPU 0 only.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=0
L=/tmp/logs; mkdir -p $L
t0=$SECONDS
timeout 280 python3 bench/bench_llm.py --plan generate --modes generate,generate-decodegraphs-attn \
  --impls bf16,qfuse_int8,qfuse_fp8 --budget-s 230 --out "$OUT/llm_generate.json" > $L/llm_log.txt 2>&1
echo "== llm exit $? at $((SECONDS - t0)) s"; grep "^| \|target\|not registered" $L/llm_log.txt | cut -c1-250 | tail -8
tar czf "$OUT/logs.tgz" -C $L .
