#!/usr/bin/env bash
# Fourth call: qfuse best --recipe llm on the GPU (SmolLM2 from the third call's folder).
set -uo pipefail
cd /tmp/src
export PYTHONPATH=/tmp/site:/tmp/smol QFUSE_CACHE_DIR=/tmp/qc HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export QFUSE_COMMIT=$(cat .commit)
timeout ${LIMIT:-560} python3 -m qfuse best --recipe llm --device cuda --repeats 5 --out $OUT/best > $OUT/best.log 2>&1
echo rc $?
grep -vE "Warning|warn\(" $OUT/best.log | grep -E "search \[|picked|Error|error" | cut -c1-260 | tail -30
