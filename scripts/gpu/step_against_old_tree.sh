#!/usr/bin/env bash
# Issue 12/18 check on one H200 (about 4 minutes), from the repository root, with the previous
# commit's files (fc50b2b) in .old/:
#   bash scripts/gpu/step_against_old_tree.sh            # writes $OUT/perf12/ (OUT defaults to ./out)
# 1. this tree and .old: flash_cache steady step (auto backend) at 1, 8, 32 slots, the first
#    full pass of a fresh executable and of a warm one, the loop's conditionals (step_against_old_tree.py);
# 2. the xla backend's compiled memory at 32 slots, flash_cache (memory_profile.py, target: temporaries
#    within 2 GiB over weights + cache).
# SMOKE=1 runs the same on the CPU at tiny size.
set -u
OUT=${OUT:-out}
DIR="$OUT/perf12"
mkdir -p "$DIR"
status=0
SMOKE_ARGS=() MEM_ARGS=(--model-shape llada-8b --slots 32)
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_ARGS=(--smoke) MEM_ARGS=(--model-shape tiny --slots 2); fi
PYTHONPATH="$PWD" python3 scripts/gpu/step_against_old_tree.py "${SMOKE_ARGS[@]}" --out "$DIR/new.json" || status=1
PYTHONPATH="$PWD/.old" python3 scripts/gpu/step_against_old_tree.py "${SMOKE_ARGS[@]}" --tree .old --out "$DIR/old.json" || status=1
PYTHONPATH="$PWD" python3 scripts/gpu/step_against_old_tree.py --compare "$DIR/new.json" "$DIR/old.json" | tee "$DIR/steps.md" || status=1
PYTHONPATH="$PWD" python3 scripts/memory_profile.py "${MEM_ARGS[@]}" --backend xla --methods flash_cache --peak-buffers --out "$DIR/mem" || status=1
exit $status
