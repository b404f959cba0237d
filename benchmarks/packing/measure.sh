#!/usr/bin/env bash
# Packed and padding-free SFTTrainer points on one GPU each, every point the first of its own process: every line of
# the points file is `python -m pipeline.measure measure` options. $ONLY (default every line) lists the line numbers
# to run, in order; the GPUs in $GPUS (default "0") are lanes, dealt the listed points in turn, one point at a time per
# lane, so that a point has its GPU to itself (its verdict at the GPU's edge is its own). A lane starts no point after
# $DEADLINE seconds (default none). Line N's row lands in $OUT/rows/N.json; a process that outlives
# ${POINT_SECONDS:-300} s is stopped and its point left out.
set -u
out=${OUT:-/tmp/packing}/rows
mkdir -p "$out"
read -r -a gpus <<< "${GPUS:-0}"
points=${1:-benchmarks/packing/points.txt}
mapfile -t lines < <(grep -v '^$' "$points")
read -r -a only <<< "${ONLY:-$(seq -s ' ' 1 ${#lines[@]})}"
for n in "${only[@]}"; do
  if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt ${#lines[@]} ]; then
    echo "ONLY: $n is not a line number of $points (1 to ${#lines[@]})" >&2
    exit 2
  fi
done
lane() {
  local index=$1 turn n
  for turn in "${!only[@]}"; do
    [ $((turn % ${#gpus[@]})) -ne "$index" ] && continue
    [ -n "${DEADLINE:-}" ] && [ "$SECONDS" -gt "$DEADLINE" ] && break
    n=${only[$turn]}
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=${gpus[$index]} timeout -k 5 "${POINT_SECONDS:-300}" python3 -m pipeline.measure measure \
      ${lines[$((n - 1))]} --client sft --json > "$out/$n.json" 2> "$out/$n.log"
  done
}
for index in "${!gpus[@]}"; do
  lane "$index" &
done
wait
