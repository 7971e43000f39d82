#!/usr/bin/env bash
# Issue 21 on one GPU (H200; every part capped, at most 575 s of time limits in all): where the batch leaks
# into a request's result in the default mode, whether the batch-invariant mode removes it, and
# what the mode costs.
#
#   bash scripts/gpu/batch_invariance.sh              # everything, results under ${OUT:-results}/batch_invariance
#   bash scripts/gpu/batch_invariance.sh leak bench   # only some parts (flags gemm leak rerun problems bench)
#
# Parts (each capped by `timeout`; a part that runs out still leaves what it wrote):
#   flags  XLA accepts the deterministic flags (dllm_jax.runtime.batch_invariance.DETERMINISTIC_XLA_FLAGS)
#   gemm   XLA's dot vs the invariant matmul at LLaDA-8B GEMM shapes: time, and whether one slot's
#          rows come out bit-identical inside a 1/8/32-slot GEMM (scripts/bench_invariant_matmul.py)
#   leak   per mode (default, batch-invariant): a request alone vs among 7 and 31 others at
#          LLaDA-8B widths (4 of 32 layers, random bf16 weights, flash_cache): bit identity of
#          logits and committed tokens, and the first layer and op whose activations differ
#          (scripts/batch_invariance.py --what leak; answers: the problems part)
#   rerun  the batch-invariant leak probe (1 layer, 8 slots) twice, in two processes: are the
#          logits and tokens' digests the same from run to run?
#   problems  per mode: 240 held-out problems of the embedded tiny model (bf16) at batch 1, 5,
#          16 per method: answers identical to batch 1 (scripts/batch_invariance.py --what problems)
#   bench  step time of flash_cache at 32/8/1 slots (most important first), LLaDA-8B, backend auto, default vs
#          batch-invariant (scripts/bench.py --preset steps)
# Every part writes a .md next to its .json; SUMMARY.md concatenates them with the run log.
# TIME_SCALE=N multiplies every time limit; PYTHON picks the interpreter (default: python).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
R=${OUT:-results}/batch_invariance
mkdir -p "$R"
PARTS=${*:-flags gemm leak rerun problems bench}
PY=${PYTHON:-python}

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$R/run.log"; }
part() {  # part NAME LIMIT_S COMMAND...
    local name=$1 limit=$(( $2 * ${TIME_SCALE:-1} )); shift 2
    log "start $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$R/$name.log" 2>&1
    local rc=$?
    log "end   $name: exit $rc after $((SECONDS - start)) s$([ $rc = 124 ] && echo ' (TIMED OUT: partial results)') -> $name.log"
}
wants() { [[ " $PARTS " == *" $1 "* ]]; }

log "parts: $PARTS; $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); git $(git rev-parse --short HEAD 2>/dev/null)"
if wants flags; then
    part flags 15 env XLA_FLAGS="$($PY -c 'from dllm_jax.runtime.batch_invariance import deterministic_xla_flags as f; print(f({}))')" \
        $PY -c 'import jax, jax.numpy as jnp, os; print(os.environ["XLA_FLAGS"], "->", float(jnp.arange(8.0).sum()), jax.devices())'
fi
if wants gemm; then
    part gemm 60 $PY scripts/bench_invariant_matmul.py --out "$R/gemm"
fi
if wants leak; then
    part leak_default 60 $PY scripts/batch_invariance.py --what leak --others 7 31 --layers 4 --steps 3 --no-answers --out "$R/leak"
    part leak_invariant 60 $PY scripts/batch_invariance.py --what leak --batch-invariant --others 7 31 --layers 4 --steps 3 --no-answers --out "$R/leak"
fi
if wants rerun; then
    for i in 1 2; do
        part rerun_$i 30 $PY scripts/batch_invariance.py --what leak --batch-invariant --others 7 --layers 1 --steps 2 --no-answers --out "$R/rerun_$i"
    done
    $PY - "$R" <<'PYEOF' | tee -a "$R/run.log"
import json, sys
from pathlib import Path
runs = [Path(sys.argv[1]) / f"rerun_{i}" / "batch_invariance_batch-invariant.json" for i in (1, 2)]
if not all(p.is_file() for p in runs):
    print("run-to-run: a rerun did not finish (see rerun_*.log)")
else:
    digests = [[s["sha256"] for r in json.loads(p.read_text())["leak"].values() for s in r["steps"]] for p in runs]
    print("run-to-run (batch-invariant, two processes): logits and tokens " + ("IDENTICAL" if digests[0] == digests[1] else "DIFFER") + f" over {len(digests[0])} steps")
PYEOF
fi
if wants problems; then
    METHODS="flash_cache flash_verify fast_dllm llada"
    part problems_default 60 $PY scripts/batch_invariance.py --what problems --problems 240 --batches 1 5 16 --methods $METHODS --out "$R/problems"
    part problems_invariant 60 $PY scripts/batch_invariance.py --what problems --batch-invariant --problems 240 --batches 1 5 16 --methods $METHODS --out "$R/problems"
fi
if wants bench; then
    part bench_default 100 $PY scripts/bench.py --preset steps --backends auto --slots 32 8 1 --budget-s 75 --ceiling-repeats 3 --out "$R/bench_default"
    part bench_invariant 100 $PY scripts/bench.py --preset steps --backends auto --slots 32 8 1 --budget-s 75 --ceiling-repeats 3 --batch-invariant --out "$R/bench_invariant"
fi
{
    echo "# Issue 21 GPU run ($(date -u +%Y-%m-%d))"; echo; echo '```'; cat "$R/run.log"; echo '```'
    for f in "$R"/gemm/*.md "$R"/leak/*.md "$R"/problems/*.md "$R"/bench_default/bench.md "$R"/bench_invariant/bench.md; do
        [ -f "$f" ] && { echo; echo "---- ${f#$R/}"; cat "$f"; }
    done
    for f in "$R"/*.log; do
        grep -l -E "Traceback|Error" "$f" >/dev/null 2>&1 && { echo; echo "---- errors in ${f#$R/} (tail)"; echo '```'; tail -25 "$f"; echo '```'; }
    done
} > "$R/SUMMARY.md"
log "summary: $R/SUMMARY.md"
