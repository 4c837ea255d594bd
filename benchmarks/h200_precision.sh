#!/usr/bin/env bash
# Issue 19's GPU numbers on one H200, each part under its own timeout (one failure cannot take the
# others with it), from the repository root, everything in $OUT (9 files):
#
#   OUT=/path bash benchmarks/h200_precision.sh
#
#   1. audit  (~170 s): benchmarks/bench_audit.py, the 7B DPO bf16 step with no observer and with the
#      full audit level on every step, two passes (none, full, full, none): step time of full vs none
#      (issue 19 item 5: at most 1.10x; it was 1.26x). Ops are counted on step 0 only, the shadow is off.
#   2. recommend (~330 s): `verlaudit recommend` on the 7B DPO suite, recipes fp16, bf16, bf16-pure, 3
#      steps each: step 0 runs the full audit with the fp32 shadow (its cost is timing_s/shadow and the
#      report's "shadowed step s"), steps 1-2 are timed; the ranking, the report with the Precision
#      section (error vs depth: shadow_depth.png) and the run directories come back.
#      memory_by_step.txt: each candidate's max allocated GiB per step; step 0 (shadow + op count)
#      should exceed steps 1-2 by no more than the planned shadow share (recommend.md: "+ 4.9 shadow").
#   plan.json: the planner's view of the suite first (seconds).
#
# The same at a tiny size on CPU (how it was checked before it went to the GPU; about 3 minutes):
#   OUT=/tmp/p SUITE=suites/dpo_tiny_cpu.yaml DEVICE=cpu bash benchmarks/h200_precision.sh
set -u
OUT=${OUT:?set OUT to the output directory}
SUITE=${SUITE:-suites/llama7b_h200.yaml}
DEVICE=${DEVICE:-cuda}
RECIPES=${RECIPES:-fp16,bf16,bf16-pure}
STEPS=${STEPS:-3}
PY=${PY:-python3}
WORK=${WORK:-/tmp/h200_precision}
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
else
  echo "no GPU: $(nproc) CPUs" | tee "$OUT/gpu.txt"
fi

run() {  # run NAME SECONDS CMD...: a part under a timeout; its log tail goes to $OUT/log.txt
  local name=$1 secs=$2; shift 2
  echo "== $name (timeout ${secs}s): $*" | tee -a "$OUT/log.txt"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$secs" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  tail -n 60 "$WORK/$name.log" | tee -a "$OUT/log.txt"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
}

$PY -m verlaudit plan "$SUITE" --json > "$OUT/plan.json" 2>>"$OUT/log.txt"
run audit 170 $PY benchmarks/bench_audit.py --suite "$SUITE" --device "$DEVICE" --variant bf16 \
  --levels none,full --passes 2 --steps 5 --out "$OUT/audit.json"
run recommend 330 $PY -m verlaudit recommend "$SUITE" --recipes "$RECIPES" --steps "$STEPS" --device "$DEVICE" \
  --out "$WORK/recommend" --no-progress --json
for f in recommend.md report.md shadow_depth.png; do cp "$WORK/recommend/$f" "$OUT/" 2>>"$OUT/log.txt"; done
# memory per step of each candidate: step 0 (shadow + op count) vs the plain steps after it
for m in "$WORK"/recommend/*/metrics.jsonl; do
  $PY - "$m" <<'PY'
import json, pathlib, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
gib = [f"step {r['step']}: {r.get('perf/max_memory_allocated_gb', float('nan')):.1f} GiB" for r in rows]
print(pathlib.Path(sys.argv[1]).parent.name + ": " + ", ".join(gib))
PY
done | tee "$OUT/memory_by_step.txt"
tar czf "$OUT/recommend_runs.tgz" -C "$WORK" recommend 2>>"$OUT/log.txt"
ls -la "$OUT"
