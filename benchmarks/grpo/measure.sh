#!/usr/bin/env bash
# GRPO / RLOO points on one GPU, each the first of its own process, side by side (each process's peak counters are
# its own): every line of points.txt is `python -m pipeline.measure measure` options (bf16 weights under autocast,
# checkpointing, as GRPOConfig's defaults); each row lands in $OUT/rows/N.json. A process that outlives
# ${POINT_SECONDS:-150} s is stopped and its point left out.
set -u
out=${OUT:-/tmp/grpo}/rows
mkdir -p "$out"
n=0
while IFS= read -r line; do
  [ -z "$line" ] && continue
  n=$((n + 1))
  rollout=${line##*--rollout }
  options=${line% --rollout *}
  # shellcheck disable=SC2086
  timeout -k 5 "${POINT_SECONDS:-150}" python3 -m pipeline.measure measure $options --rollout "$rollout" \
    --precision bf16-autocast --checkpointing --json > "$out/$n.json" 2> "$out/$n.log" &
done < "${1:-benchmarks/grpo/points.txt}"
wait
