#!/bin/bash
# Issue 31's opt-in candidates for the 26B-A4B step, timed on one GPU beside the step without them
# (BENCHMARKS.md, "DiffusionGemma 26B-A4B: the MoE block's end in one pass"), plus the two
# measurements that waited with them. Every step has its own time limit, cut to what is left of
# TOTAL seconds (default 560), and the results are tarred to $OUT/results.tgz after each step:
#   call 1: bash scripts/gpu/diffusion_gemma_candidates.sh                  (STEPS="moe_alone off moe all")
#   call 2: STEPS="scatter dots sampler fp8" bash scripts/gpu/diffusion_gemma_candidates.sh
# Steps:
#   moe_alone  pallas_kernels/norm/moe_residual.py against XLA's passes at 32, 8 and 1 slots' rows
#   off        the step at 1, 8 and 32 slots as backend auto runs it (the baseline of this call)
#   moe        the same with --kernel moe_output=true, and the 32-slot step's profile
#   scatter    the same with --kernel canvas_scatter=true
#   dots       the same with --merged-dots-max-rows 256
#   all        the three candidates together
#   sampler    the canvas sampler kernel's ablations on this tree, then on the tree in OLD_TREE
#              (soft_cap's float32 reciprocal against its division: 340d824, exported there with
#              git archive 340d824 dllm_jax pallas_kernels | tar x -C .old)
#   fp8        issue 30: LLaDA-8B's flash_cache step at 8 and 1 slots, bf16 and fp8
# Results: $R/<step>/ and $R/<step>.log (R=/tmp/r). The step's time is only comparable within
# one call (each process measures its own ceilings; cards of one kind differ by 10%).
#   SMOKE=1 PYTHON=.venv/bin/python STEPS="moe_alone off moe" bash scripts/gpu/diffusion_gemma_candidates.sh
#                                          # CPU check of the script itself at tiny shapes
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TOTAL=${TOTAL:-560}
STEPS=${STEPS:-"moe_alone off moe all"}
OUT=${OUT:-/tmp/out}
OLD_TREE=${OLD_TREE:-$PWD/.old}
start=$(date +%s); R=${R:-/tmp/r}; mkdir -p "$R" "$OUT"
left() { echo $(( TOTAL - ($(date +%s) - start) )); }
pack() { tar czf "$OUT/results.tgz" -C "$(dirname "$R")" "$(basename "$R")"; }
step() {
    local name=$1 limit=$2 tree=$3; shift 3
    [[ " $STEPS " == *" $name "* ]] || return 0
    local l; l=$(left); (( limit > l - 5 )) && limit=$(( l - 5 ))
    if (( limit < 20 )); then echo "=== $name SKIPPED: the time budget is spent"; return 0; fi
    echo "=== $name (limit $limit s, $l s left of $TOTAL)"
    PYTHONPATH=$tree timeout "$limit" "$@" > "$R/$name.log" 2>&1
    local rc=$?
    (( rc == 124 )) && echo "rc=124: TIMED OUT after $limit s" || echo "rc=$rc"
    grep "^|" "$R/$name.log" | tail -"${TAIL:-8}"
    pack
}
ENGINE="$PY scripts/gpu/diffusion_gemma_engine.py --transformers-s 0 --slots 1 8 32 --budget-s 90 --hard-limit-s 112"
MOE="--slots 32 8 1 --repeats 5"; ABL="--ablations --groups 8 --calls 5 --repeats 5 --budget-s 35"
FP8="--parts steps --slots 8 1 --budget-s 150"; PROFILE="--profile-slots 32"
if [[ -n "${SMOKE:-}" ]]; then
    ENGINE="$PY scripts/gpu/diffusion_gemma_engine.py --tiny --transformers-s 0 --slots 2 --budget-s 90 --hard-limit-s 112"
    MOE="--tiny --slots 1 --repeats 1"; ABL="--tiny --ablations --groups 1 --calls 1 --repeats 1"
    FP8="--tiny --parts steps --slots 1"; PROFILE=""
fi
step moe_alone 70 "$PWD" $PY scripts/gpu/moe_residual.py $MOE --out "$R/moe_alone"
step off 120 "$PWD" $ENGINE --out "$R/off"
step moe 150 "$PWD" $ENGINE --kernel moe_output=true $PROFILE --out "$R/moe"
step scatter 120 "$PWD" $ENGINE --kernel canvas_scatter=true --out "$R/scatter"
step dots 120 "$PWD" $ENGINE --merged-dots-max-rows 256 --out "$R/dots"
step all 120 "$PWD" $ENGINE --kernel moe_output=true --kernel canvas_scatter=true --merged-dots-max-rows 256 --out "$R/all"
step sampler 60 "$PWD" $PY scripts/gpu/canvas_sampler_kernel.py $ABL --out "$R/sampler"
if [[ " $STEPS " == *" sampler "* && -d "$OLD_TREE/pallas_kernels" ]]; then
    STEPS="$STEPS sampler_old" step sampler_old 60 "$OLD_TREE" $PY scripts/gpu/canvas_sampler_kernel.py $ABL --out "$R/sampler_old"
fi
step fp8 180 "$PWD" $PY scripts/gpu/fp8_step.py $FP8 --out "$R/fp8"
pack
echo "total $(( $(date +%s) - start )) s"
