#!/bin/bash
# The LLM work of issue #14 on the GPU machine, from the worktree root, outputs under $OUT:
#   bash bench/models/llm_device_call.sh tests graph     # one 420 s call: the phases in order
#   bash bench/models/llm_device_call.sh compile         # a second call
# tests:   the gated GEMM kernel and generate() on the GPU (pytest), bench.models.generate_parity
# graph:   bench_llm's "graph" plan (CUDA-graphed eager steps, every batch); autotune picks land
#          in $OUT/qcache/tuning.json: copy it to bench/results/qcache_h200/ for "compile"
# compile: bench_llm's "compile" plan (torch.compile per decoder layer + CUDA graph); with
#          those picks no qfuse row autotunes again (each runs one eager step first otherwise)
# A bench phase starts no row after 370 s of the call (its --budget-s), so a call ends in time.
set -o pipefail
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
export QFUSE_COMMIT=$(cat .commit) HF_HUB_OFFLINE=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
mkdir -p $OUT/qcache && cp bench/results/qcache_h200/tuning.json $OUT/qcache/ 2>/dev/null
export QFUSE_CACHE_DIR=$OUT/qcache
for phase in "$@"; do
  case $phase in
    tests)
      timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_gated_epilogue.py \
        tests/fusion/test_gated.py tests/kernels/test_tuning.py 2>&1 | tee $OUT/gpu_tests.txt | tail -4
      timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_generate.py 2>&1 \
        | tee -a $OUT/gpu_tests.txt | tail -4
      timeout 90 python3 -m bench.models.generate_parity 2>&1 | grep -v "^W11" | tail -16
      cp bench/results/generate_parity_h200.json $OUT/ 2>/dev/null ;;
    graph|compile)
      python3 -m bench.models.bench_llm --plan $phase --budget-s $(left 370) \
        --out $OUT/llm_h200_$phase.json 2>&1 | grep -v "^W11" | tee $OUT/llm_$phase.log | tail -45 ;;
    *) echo "unknown phase $phase" ;;
  esac
done
