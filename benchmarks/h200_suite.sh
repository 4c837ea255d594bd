#!/usr/bin/env bash
# The GPU numbers of issue 6 in two device calls of under ~9 minutes each, every part in its own
# process under its own timeout so one failure (an OOM, a hang) cannot take the others with it.
#
#   bash benchmarks/h200_suite.sh suite   # call 1: verlaudit plan + verlaudit run suites/llama7b_h200.yaml
#   bash benchmarks/h200_suite.sh bench   # call 2: MFU + matmul peak, audit overhead, rollout tokens/s
#
# Everything lands in $OUT (at most 8 files, two folders deep): *.json, suite_report.md, suite_runs.tgz.
# Then, here: python benchmarks/render_gpu_report.py <fetched OUT dir(s)> -> reports/gpu/h200_results.md
set -u
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PY:-python3}
part=${1:-bench}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

run() {  # run NAME SECONDS CMD...: a part under a timeout, its log tail kept in $OUT/log.txt
  local name=$1 secs=$2; shift 2
  echo "== $name (timeout ${secs}s): $*" | tee -a "$OUT/log.txt"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$secs" "$@" > "/tmp/$name.log" 2>&1
  local rc=$?
  tail -n 25 "/tmp/$name.log" | tee -a "$OUT/log.txt"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
}

if [ "$part" = suite ]; then
  $PY -m verlaudit plan suites/llama7b_h200.yaml --json > "$OUT/plan.json" 2>>"$OUT/log.txt"
  run suite 500 $PY -m verlaudit run suites/llama7b_h200.yaml --device cuda --out /tmp/suite --no-progress
  cp /tmp/suite/report.md "$OUT/suite_report.md" 2>/dev/null
  tar czf "$OUT/suite_runs.tgz" -C /tmp suite 2>>"$OUT/log.txt"
else
  run update 210 $PY benchmarks/bench_update.py --out "$OUT/update.json"
  run audit 200 $PY benchmarks/bench_audit.py --out "$OUT/audit.json" --passes 1
  run rollout 130 $PY benchmarks/rollout_bench.py --out "$OUT"
fi
ls -la "$OUT"
