#!/usr/bin/env bash
# The GPU tests on a CUDA machine, from the installed package: installs qfuse into the Python that
# holds the machine's own torch (offline, keeping that torch), then runs every test that can use
# the GPU, split over the visible GPUs (one pytest process per GPU, a share of the files each).
#   bash tests/gpu.sh [seconds per GPU]        (default 540; logs: $OUT or /tmp/gpu-tests)
#   GPUS=3 bash tests/gpu.sh                    (the first 3 GPUs only)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
unset PYTHONPATH
LIMIT=${1:-540}
LOGS=${OUT:-/tmp/gpu-tests}; mkdir -p "$LOGS"
before=$(python3 -c "import torch; print(torch.__version__)")
python3 -m pip install -q --no-index --no-build-isolation -e . > "$LOGS/install.txt" 2>&1 \
  || { echo "install failed:"; tail -5 "$LOGS/install.txt"; exit 1; }
after=$(python3 -c "import torch; print(torch.__version__)")
echo "torch before install: $before, after: $after"
[ "$before" = "$after" ] || { echo "the install replaced torch"; exit 1; }
(cd /tmp && python3 -c "import qfuse, qfuse.recipes; print('qfuse from', qfuse.__file__)")

# Files with CUDA paths: every gpu-marked module, and the kernel suites (which run on CUDA when
# it is there, in the interpreter otherwise).
mapfile -t FILES < <( (grep -rlE "mark\.gpu|pytestmark = .*gpu" tests --include='test_*.py';
  ls tests/kernels/test_*.py tests/ops/test_*.py) | sort -u)
GPUS=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)}
for g in $(seq 0 $((GPUS - 1))); do
  share=()
  for i in "${!FILES[@]}"; do
    if [ $((i % GPUS)) -eq "$g" ]; then share+=("${FILES[$i]}"); fi
  done
  (
    CUDA_VISIBLE_DEVICES=$g QFUSE_CACHE_DIR=/tmp/qc$g timeout "$LIMIT" python3 -m pytest -q \
      -p no:cacheprovider -rfE "${share[@]}" > "$LOGS/gpu_tests_gpu$g.txt" 2>&1
    echo "== gpu$g exit $?: $(tail -1 "$LOGS/gpu_tests_gpu$g.txt")"
  ) &
done
wait
grep -hE "^(FAILED|ERROR)" "$LOGS"/gpu_tests_gpu*.txt | head -40
