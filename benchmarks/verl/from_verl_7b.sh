#!/usr/bin/env bash
# Issue 16's GPU run: a 7B GRPO job from a verl launch script (benchmarks/verl/run_grpo_llama2_7b.sh),
# synthetic GSM8K-style parquet, random-init Llama-2-7B architecture, through `verlaudit from-verl`, with
# the audit on (boundary level), on one GPU. From the repository root:
#
#   bash benchmarks/verl/from_verl_7b.sh                      # the H200 run (writes $OUT)
#   DEVICE=cpu TARGET=cpu MODEL_PATH=tiny-llama STEPS=1 VARIANTS=verl ROWS=32 \
#     MAX_PROMPT=320 MAX_RESPONSE=8 bash benchmarks/verl/from_verl_7b.sh     # the same path, tiny, on a CPU
#
# $OUT gets: the generated suite, from-verl's output (every unmapped key with its reason), the memory plan,
# the run's log tail and report.md, and the run directories (tar).
set -eu
OUT=${OUT:-/tmp/from_verl_7b}
PY=${PY:-python3}
RUNS=${RUNS:-/tmp/from_verl_7b_runs}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export DATA_DIR=${DATA_DIR:-data/gsm8k_synth}
mkdir -p "$OUT"
rm -rf "$RUNS"
$PY benchmarks/make_gsm8k_parquet.py --rows "${ROWS:-512}" --out "$DATA_DIR/train.parquet"
$PY -m verlaudit from-verl benchmarks/verl/run_grpo_llama2_7b.sh -o "$OUT/verl_grpo_7b.yaml" --force \
  --target "${TARGET:-h200}" | tee "$OUT/from_verl.txt"
$PY -m verlaudit plan "$OUT/verl_grpo_7b.yaml" --json > "$OUT/plan.json" || true
timeout --signal=INT --kill-after=20 "${SECONDS_LIMIT:-560}" \
  $PY -m verlaudit run "$OUT/verl_grpo_7b.yaml" --device "${DEVICE:-cuda}" --steps "${STEPS:-3}" \
  --variants "${VARIANTS:-verl,fp16,bf16-pure}" --out "$RUNS" --no-progress 2>&1 | tail -n 40 | tee "$OUT/run_log.txt"
cp "$RUNS/report.md" "$OUT/report.md" 2>/dev/null || true
tar czf "$OUT/runs.tgz" -C "$(dirname "$RUNS")" "$(basename "$RUNS")" 2>/dev/null || true
