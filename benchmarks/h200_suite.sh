#!/usr/bin/env bash
# The GPU numbers of issue 6, each part under its own timeout so one failure (an OOM, a hang) cannot
# take the others with it. One device call per part; every call from the repository root.
#
#   bash benchmarks/h200_suite.sh dpo      # verlaudit plan + run suites/llama7b_h200.yaml (all variants, ~6 min)
#   bash benchmarks/h200_suite.sh grpo     # verlaudit run suites/llama7b_h200_grpo.yaml (~5 min)
#   bash benchmarks/h200_suite.sh bench    # MFU cases + matmul peak, audit overhead (none/off/boundary/full), rollout (~8 min)
#   bash benchmarks/h200_suite.sh trl      # TRL 1.16 DPO + GRPO (beta 0); needs carry: [".whl"] (see benchmarks/trl_bench.py)
#   bash benchmarks/h200_suite.sh fused    # GPU tests of the fused decode, rollout bench (static vs fused), GRPO fast variants (~6 min)
#   bash benchmarks/h200_suite.sh fast     # DPO fast variants + audit overhead per level (~6 min)
#
# Everything lands in $OUT (at most 8 files, two folders down). Then, here:
#   python benchmarks/planner_vs_runs.py SUITE.yaml <unpacked run dir>   # planner vs measured, per run
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

suite() {  # suite NAME YAML SECONDS [VARIANTS]
  $PY -m verlaudit plan "$2" --json > "$OUT/$1_plan.json" 2>>"$OUT/log.txt"
  run "$1" "$3" $PY -m verlaudit run "$2" --device cuda --out "/tmp/$1" --no-progress ${4:+--variants "$4"}
  cp "/tmp/$1/report.md" "$OUT/$1_report.md" 2>/dev/null
  tar czf "$OUT/$1_runs.tgz" -C /tmp "$1" 2>>"$OUT/log.txt"
}

case "$part" in
  dpo) suite dpo suites/llama7b_h200.yaml 560 ;;
  grpo) suite grpo suites/llama7b_h200_grpo.yaml 560 ;;
  bench)
    run update 200 $PY benchmarks/bench_update.py --out "$OUT/update.json" --cases \
      "bf16:ckpt:chunked,bf16:ckptauto:chunked:compile,bf16-pure:ckptauto:chunked:compile"
    run audit 150 $PY benchmarks/bench_audit.py --out "$OUT/audit.json" --passes 1
    run rollout 200 $PY benchmarks/rollout_bench.py --out "$OUT" --engines ours_static_graphs,ours_static_graphs_compiled,hf_dynamic
    ;;
  trl)
    # beta 0: with a KL reference TRL's GRPO keeps an fp32 copy and runs out of memory on one H200
    run trl 500 $PY benchmarks/trl_bench.py --which dpo,grpo --grpo-beta 0 --out "$OUT" --steps 5 --timeout 240
    ;;
  fused)
    run gpu_tests 150 $PY -m pytest -q -m gpu tests/test_fused_decode.py
    run rollout 200 $PY benchmarks/rollout_bench.py --out "$OUT" --engines ours_static_graphs_compiled,ours_fused_graphs_compiled,hf_dynamic
    suite grpo_fused suites/llama7b_h200_grpo.yaml 300 grpo-bf16-fast,grpo-bf16-pure-fast
    ;;
  fast)
    suite dpo_fast suites/llama7b_h200.yaml 330 bf16-fast,bf16-pure-fast
    run audit 150 $PY benchmarks/bench_audit.py --out "$OUT/audit.json" --passes 1
    ;;
  *) echo "usage: $0 dpo|grpo|bench|trl|fused|fast" >&2; exit 2 ;;
esac
ls -la "$OUT"
