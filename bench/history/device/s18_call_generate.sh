#!/usr/bin/env bash
# generate() and the graphed decode step of the TinyLlama-shape model: int8 against W4A16.
set -uo pipefail
W=$(pwd)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
mkdir -p /tmp/src && tar -xJf $W/.gpu/s/src.tar.xz -C /tmp/src && cd /tmp/src
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . > /tmp/inst.txt 2>&1 || tail -3 /tmp/inst.txt
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 QFUSE_COMMIT=$(cat .commit) QFUSE_CACHE_DIR=/tmp/qc HF_HUB_OFFLINE=1
timeout 260 python3 -m bench.models.bench_llm --plan w4 --impls qfuse_int8,qfuse_w4a16 --modes graph,generate --budget-s 230 --out $OUT/llm_w4.json > $OUT/llm_w4.log 2>&1; grep -E "^\|" $OUT/llm_w4.log | tail -8
