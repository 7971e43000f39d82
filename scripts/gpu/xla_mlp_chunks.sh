#!/bin/bash
# Issue 18 on one H200 (one call, ~8 min): the xla backend's compiled temporaries at 32 slots with the full
# pass's attention output and MLP in unrolled chunks, against one piece (same tree); the xla step beside auto;
# auto's full pass (prefill_s) and step in chunks against one piece, so the chunks do not slow the engine.
#   smoke on the CPU: OUT=/tmp/x SHAPE=tiny S32=4 EXTRA=--tiny TOTAL=200 bash scripts/gpu/xla_mlp_chunks.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s); R=/tmp/r; mkdir -p $R $OUT
TOTAL=${TOTAL:-545}
SHAPE=${SHAPE:-llada-8b}; S32=${S32:-32}; EXTRA=${EXTRA:-}
left() { echo $(( TOTAL - ($(date +%s) - start) )); }
pack() { tar czf $OUT/results.tgz -C /tmp r; }
step() { local name=$1 t=$2; shift 2; local l=$(left); (( t > l - 5 )) && t=$(( l - 5 )); (( t < 15 )) && { echo "=== $name SKIPPED"; return; }
  echo "=== $name (limit $t s, $l s left)"; timeout $t "$@" > $R/$name.log 2>&1; echo "rc=$?"; grep -v "^WARNING\|^W[0-9]\|^I[0-9]\|^E[0-9]\|Warning\|warn(" $R/$name.log | grep "^|\|rc=\|Error" | tail -${TAIL:-14}; grep -m ${HEADS:-0} "^- " $R/$name.log; pack; }
HEADS=12 TAIL=30 step mem_chunk 200 python3 scripts/memory_profile.py --model-shape $SHAPE --slots $S32 --backend xla --peak-buffers --out $R/mem_chunk
HEADS=12 TAIL=20 step mem_nochunk 60 python3 scripts/gpu/mlp_in_one_piece.py scripts/memory_profile.py --model-shape $SHAPE --slots $S32 --backend xla --methods flash_cache --peak-buffers --out $R/mem_nochunk
TAIL=20 step xla_auto 120 python3 scripts/bench.py $EXTRA --preset steps --backends xla auto --slots $S32 --gen-lengths 256 --ceiling-repeats 1 --out $R/xla_auto
TAIL=20 step auto_nochunk 90 python3 scripts/gpu/mlp_in_one_piece.py scripts/bench.py $EXTRA --preset steps --backends auto --slots $S32 --gen-lengths 256 --ceiling-repeats 1 --out $R/auto_nochunk
python3 - $R <<'PY'
import json, sys
from pathlib import Path
r = Path(sys.argv[1])
print("=== SUMMARY: backend mlp slots step_ms full_pass_s (prefill_s) peak_GiB")
for name in ("xla_auto", "auto_nochunk"):
    f = r / name / "bench.json"
    for x in json.loads(f.read_text())["runs"] if f.exists() else ():
        print(f"  {x['backend']:5s} {'one piece' if name == 'auto_nochunk' else 'chunks':9s} {x['slots']:3d} {1e3 * x['step_s']:8.2f} {x['prefill_s']:7.3f} {(x['peak_bytes'] or 0) / 2**30:6.2f}")
PY
echo "total $(( $(date +%s) - start )) s"
