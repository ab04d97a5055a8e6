#!/bin/bash
# One device call of the LLM work (issue #14), run from the worktree root on the GPU machine:
#   bash bench/llm_device_call.sh 1|2      (outputs under $OUT)
# Call 1: the gated kernel and generate() on the GPU (tests, bench/generate_parity.py), then
# bench_llm's "graph" plan. Call 2: bench_llm's "compile" plan, with call 1's autotune picks
# (QFUSE_CACHE_DIR carried in bench/results/qcache_h200) so compiled rows use tuned schedules.
set -o pipefail
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
export QFUSE_COMMIT=$(cat .commit) HF_HUB_OFFLINE=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
if [ "$1" = 1 ]; then
  export QFUSE_CACHE_DIR=$OUT/qcache
  timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_gated_epilogue.py \
    tests/fusion/test_gated.py tests/kernels/test_tuning.py 2>&1 | tee $OUT/gpu_tests_call1.txt | tail -4
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_generate.py 2>&1 \
    | tee -a $OUT/gpu_tests_call1.txt | tail -4
  timeout 90 python3 bench/generate_parity.py 2>&1 | grep -v "^W11" | tail -14
  cp bench/results/generate_parity_h200.json $OUT/ 2>/dev/null
  python3 bench/bench_llm.py --plan graph --budget-s $(left 370) \
    --out $OUT/llm_h200_graph.json 2>&1 | grep -v "^W11" | tee $OUT/llm_graph.log | tail -40
else
  mkdir -p /tmp/qcache && cp bench/results/qcache_h200/tuning.json /tmp/qcache/ 2>/dev/null
  export QFUSE_CACHE_DIR=/tmp/qcache
  python3 bench/bench_llm.py --plan compile --budget-s $(left 360) \
    --out $OUT/llm_h200_compile.json 2>&1 | grep -v "^W11" | tee $OUT/llm_compile.log | tail -40
  cp /tmp/qcache/tuning.json $OUT/tuning_call2.json
fi
