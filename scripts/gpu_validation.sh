#!/usr/bin/env bash
# One device call that validates HEAD on the GPU and times it (logs under $OUT, summary last).
#   bash .gpu_wheels/install.sh && export PYTHONPATH=/tmp/site:$PWD/src && bash scripts/gpu_validation.sh [parts]
# parts (default: all): tests, draft, batched, moe.  On nvidia-h200-x2 the two-GPU tests and the
# split-target benchmark run too; on one GPU they skip / use that GPU.
set -u
OUT=${OUT:-/tmp/gpu_validation}
mkdir -p "$OUT"
parts=${*:-tests draft batched moe}
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-110)")")
}
nvidia-smi -L | tee "$OUT/gpus.txt"
for part in $parts; do
  case $part in
    tests)   run tests python3 -m pytest tests -q -m gpu -p no:cacheprovider ;;
    draft)   run draft python3 benchmarks/draft_step.py --iters 30 --out "$OUT" ;;
    batched) run batched python3 benchmarks/batched_generate.py --out "$OUT" ;;
    moe)     run moe python3 benchmarks/moe_op.py --out "$OUT" --iters 20 ;;
    *) echo "unknown part $part (tests, draft, batched, moe)"; exit 2 ;;
  esac
done
for name in draft batched moe; do  # each benchmark's own table
  [ -f "$OUT/$name.log" ] && { echo "== $name"; tail -n 16 "$OUT/$name.log"; }
done
echo "== summary"
printf '%s\n' "${summary[@]}"
