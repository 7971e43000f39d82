#!/bin/bash
# Issue 18 on one H200 (one call, ~8 min): the xla backend's memory with the full pass's MLP in unrolled chunks
# (against one piece, same tree), its step at 32 slots beside auto; issue 17 fp8 at 32 slots beside bf16.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s); R=/tmp/r; mkdir -p $R
TOTAL=${TOTAL:-545}
SHAPE=${SHAPE:-llada-8b}; S32=${S32:-32}; EXTRA=${EXTRA:-}
left() { echo $(( TOTAL - ($(date +%s) - start) )); }
pack() { tar czf $OUT/results.tgz -C /tmp r; }
step() { local name=$1 t=$2; shift 2; local l=$(left); (( t > l - 5 )) && t=$(( l - 5 )); (( t < 15 )) && { echo "=== $name SKIPPED"; return; }
  echo "=== $name (limit $t s, $l s left)"; timeout $t "$@" > $R/$name.log 2>&1; echo "rc=$?"; grep -v "^WARNING\|^W[0-9]\|^I[0-9]\|^E[0-9]\|Warning\|warn(" $R/$name.log | grep "^|\|rc=\|Error" | tail -${TAIL:-14}; grep -m ${HEADS:-0} "^- " $R/$name.log; pack; }
HEADS=12 TAIL=40 step mem_chunk 260 python3 scripts/memory_profile.py --model-shape $SHAPE --slots $S32 8 --backend xla --peak-buffers --out $R/mem_chunk
HEADS=12 TAIL=20 step mem_nochunk 60 python3 scripts/mlp_in_one_piece.py scripts/memory_profile.py --model-shape $SHAPE --slots $S32 --backend xla --methods flash_cache --peak-buffers --out $R/mem_nochunk
TAIL=20 step xla_auto 110 python3 scripts/bench.py $EXTRA --preset steps --backends xla auto --slots $S32 --gen-lengths 256 --ceiling-repeats 1 --out $R/xla_auto
#TAIL=20 step fp8_32 240 python3 scripts/bench.py $EXTRA --preset steps --backends auto --slots $S32 --quantizations none fp8 --gen-lengths 256 --iterations 4 --repeats 2 --ceiling-repeats 1 --out $R/fp8_32
echo "total $(( $(date +%s) - start )) s"
