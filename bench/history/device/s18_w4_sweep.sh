#!/usr/bin/env bash
# 4-bit kernels on the GPU from the commit's snapshot: tests, the decode chain with the schedule
# sweep (per role at M = 1), W4A8, then generate() in int8 and W4A16.
set -uo pipefail
W=$(pwd)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
mkdir -p /tmp/src && tar -xJf $W/.gpu/s/src.tar.xz -C /tmp/src && cd /tmp/src
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . > /tmp/inst.txt 2>&1 || tail -3 /tmp/inst.txt
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 QFUSE_COMMIT=$(cat .commit) QFUSE_CACHE_DIR=/tmp/qc HF_HUB_OFFLINE=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
timeout ${T_TEST:-70} python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_w4a16.py > $OUT/w4_tests.txt 2>&1; tail -4 $OUT/w4_tests.txt; el
timeout ${T_SWEEP:-260} python3 -m bench.kernels.w4_chain --sweep --a8 --ms 1 --out $OUT/w4_sweep.json > $OUT/w4_sweep.log 2>&1; grep -v "^{" $OUT/w4_sweep.log | grep -v -i warn | tail -12; el
timeout ${T_16:-150} python3 -m bench.kernels.w4_chain --a8 --ms 16 --out $OUT/w4_m16.json > $OUT/w4_m16.log 2>&1; grep -v "^{" $OUT/w4_m16.log | grep -v -i warn | tail -8; el
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/w4_sweep.log") if l.startswith("{")]
for r in rows:
    if r.get("impl", "").startswith("role"):
        c = r.get("config", {})
        print(f"{r['impl']:14} bn{c.get('block_n')} bk{c.get('block_k')} pf{c.get('prefetch')} xp{int(bool(c.get('x_pairs')))} w{c.get('num_warps')} sk{c.get('split_k')}  {r.get('role_us', float('nan')):8.1f} us {r.get('tb_s', 0):5.2f} TB/s {r.get('error', '')[:80]}")
PY
timeout ${T_GEN:-230} python3 -m bench.models.bench_llm --plan w4 --impls qfuse_int8,qfuse_w4a16 --modes graph,generate --budget-s 200 --out $OUT/llm_w4.json > $OUT/llm_w4.log 2>&1; grep -v "^W11" $OUT/llm_w4.log | grep -E "impl|built|Error|us" | cut -c1-300 | tail -14; el
