#!/usr/bin/env bash
# Issue 29's GPU numbers on one H200, in one call, each part under its own timeout (one failure cannot
# take the others with it), from the repository root, everything in $OUT (8 files at most):
#
#   OUT=/path bash benchmarks/h200_audit_price.sh
#
#   1. audit (timeout 170 s): benchmarks/profile_audit_gpu.py, the 7B DPO bf16 step with no observer and
#      with the full audit level, two passes in one process (none, full, full, none), 6 steps each, no
#      profiler step: full vs none by the mean and the median of the steady steps -> audit.json
#      (target: the mean at most 1.05x).
#   2. shadow (timeout 110 s): benchmarks/profile_shadow.py, the shadow on steps 0, 2, 4 (step 4 under
#      cProfile), the boundary level on 1, 3, 5: the shadowed step's extra time against the plain steps
#      of the same run (target: at most one plain step) and the profile -> shadow.txt; then (timeout
#      80 s) the same without cProfile, 4 steps, the fp32 products as split TF32 ones (audit.shadow_matmul:
#      tf32x3), rows 2 and rows 1 -> shadow_tf32x3.txt (the per-step lines of both).
#   3. recommend (timeout 190 s): `verlaudit recommend` on the 7B DPO suite, fp16, bf16, bf16-pure, 3
#      steps each (the candidates share one worker process), timed end to end (target: under 80 s, bf16
#      recommended as before) -> recommend.md, recommend.json (the ranking), recommend_steps.txt (each
#      candidate's step times, shadow seconds and wall time).
#   gpu.txt: the machine; log.txt: each part's command, log tail, exit code and seconds. The parts' timeouts
#   add up to 610 s, but each is cut to what is left of BUDGET (490 s from the start; a part with less
#   than 20 s left is skipped): the whole stays under 9 minutes. Expected ~ 90 + 50 + 35 + 30 + 80 s.
#
# The same at a tiny size on CPU (how it was checked before it went to the GPU; about 4 minutes there):
#   OUT=/tmp/p SUITE=suites/dpo_tiny_cpu.yaml DEVICE=cpu bash benchmarks/h200_audit_price.sh
set -u
OUT=${OUT:?set OUT to the output directory}
SUITE=${SUITE:-suites/llama7b_h200.yaml}
DEVICE=${DEVICE:-cuda}
RECIPES=${RECIPES:-fp16,bf16,bf16-pure}
PY=${PY:-python3}
WORK=${WORK:-/tmp/h200_audit_price}
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
else
  echo "no GPU: $(nproc) CPUs" | tee "$OUT/gpu.txt"
fi

BUDGET=${BUDGET:-490}
run() {  # run NAME SECONDS CMD...: a part under a timeout (at most what is left of BUDGET); log tail to $OUT/log.txt
  local name=$1 secs=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, ${left}s left of the ${BUDGET}s budget" | tee -a "$OUT/log.txt"
    return
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "== $name (timeout ${secs}s): $*" | tee -a "$OUT/log.txt"
  local t0
  t0=$(date +%s.%N)
  timeout --signal=INT --kill-after=10 "$secs" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$WORK/$name.log" | tee -a "$OUT/log.txt"
  # awk, not bc: the GPU machine has no bc (the first run's times came back empty)
  echo "== $name: exit $rc after $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s" \
    | tee -a "$OUT/log.txt"
}

run audit 170 $PY benchmarks/profile_audit_gpu.py --suite "$SUITE" --device "$DEVICE" --steps 6 \
  --levels none,full,full,none --profile-step -1 --out "$OUT/audit.json"
run shadow 110 $PY benchmarks/profile_shadow.py --suite "$SUITE" --device "$DEVICE" --out "$OUT/shadow.txt"
run shadow_tf32x3 80 $PY benchmarks/profile_shadow.py --suite "$SUITE" --device "$DEVICE" --steps 4 \
  --profile-step -1 --matmul tf32x3 --out "$WORK/tf32x3_rows2.txt"
run shadow_tf32x3_rows1 70 $PY benchmarks/profile_shadow.py --suite "$SUITE" --device "$DEVICE" --steps 4 \
  --profile-step -1 --matmul tf32x3 --rows 1 --out "$WORK/tf32x3_rows1.txt"
cat "$WORK"/tf32x3_rows2.txt "$WORK"/tf32x3_rows1.txt > "$OUT/shadow_tf32x3.txt" 2>>"$OUT/log.txt"
run recommend 190 $PY -m verlaudit recommend "$SUITE" --recipes "$RECIPES" --steps 3 --device "$DEVICE" \
  --out "$WORK/recommend" --no-progress --json
cp "$WORK/recommend/recommend.md" "$OUT/" 2>>"$OUT/log.txt"
# the --json ranking is what follows the table on stdout: from the first line that opens the list
sed -n '/^\[/,$p' "$WORK/recommend.log" > "$OUT/recommend.json"
for m in "$WORK"/recommend/*/metrics.jsonl; do
  $PY - "$m" <<'PY'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1]).parent
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = ", ".join(
    f"step {r['step']}: {r['perf/step_time_s']:.2f} s"
    + (f" (shadow {r['timing_s/shadow']:.2f} s)" if "timing_s/shadow" in r else "")
    for r in rows
)
wall = json.loads((run / "runner.json").read_text()).get("wall_s")
print(f"{run.name}: wall {wall} s; {steps}")
PY
done | tee "$OUT/recommend_steps.txt"
ls -la "$OUT"
