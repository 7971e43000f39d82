#!/bin/bash
# Issue 17 on one H200. Two calls of about 5-6 minutes each; every step has its own time limit,
# cut to what is left of TOTAL seconds (default 540), so a slow compile cannot eat the call:
#   call 1: bash scripts/gpu/quantization.sh                                  (STEPS="gemm steps fp8")
#   call 2: STEPS="profile sweep fp8gemm fp8_triton" bash scripts/gpu/quantization.sh
# Steps:
#   gemm       the projection GEMMs at LLaDA-8B shapes, rows 128/1024/4096: bf16 cuBLAS, XLA's
#              int8 fusion ("int8 xla") and the new Pallas int8 kernel ("int8 pallas")
#   steps      flash_cache decode step (128 rows per slot) at 1/8/32 slots, bf16 and int8-weights,
#              one process (int8 runs its GEMMs through the Pallas kernel up to 1024 rows)
#   fp8        the same for fp8, compiled with XLA's Triton GEMM autotuner off (the Engine's new
#              default for 8-bit models; before, the 32-slot fp8 compile ran past 180 s)
#   profile    per-kernel device time of one 1-slot step, fp8 and int8-weights (scripts/profile_step.py)
#   sweep      the int8 kernel at each tiling of bench_gemm.SWEEP (split-K included), rows 128
#   fp8gemm    fp8 GEMM with its activation quantization ("fp8", bf16 product; "fp8 f32 product",
#              the engine's previous float32 product) vs the bare FP8 GEMM ("fp8 dot")
#   fp8_triton fp8 at 1 slot compiled with XLA's defaults (Triton GEMM autotuner on), for the
#              compile time against the fp8 step's
#   fp8_32     bf16 and fp8 at 32 slots in one process (fp8 with the Triton GEMM autotuner off)
#   fp8_1_8    bf16 and fp8 at 1 and 8 slots in one process
#   q_steps    bf16 and fp8 at 1, 8 and 32 slots in one process (fp8 with the Engine's default options)
#   int8_nomerge bf16 and int8-weights at 1 and 8 slots with XLA's DotMerger off (both)
#   profile32  per-kernel device time of one fp8 step at 32 slots and at 1 slot
#   compare    end to end at 8 slots: flash_cache and flash_cache + verify, schedules one and window,
#              one process per quantization (none, fp8, int8-weights)
#   fp8_level1 (only when named in STEPS: if call 1's fp8 step did not reach 32 slots) fp8 at
#              32 slots with the Triton GEMM autotuner off and xla_gpu_autotune_level=1
# Results: $R/<step>/ (bench.json/.md, bench_gemm.json/.md, profile_*.json) and $R/<step>.log,
# R=/tmp/r, tarred to $OUT/results.tgz after every step; a summary is printed at the end.
#   SMOKE=1 STEPS="gemm steps fp8 profile sweep fp8gemm fp8_triton" bash scripts/gpu/quantization.sh
#                                          # CPU check of the script itself at tiny shapes
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
TOTAL=${TOTAL:-540}
STEPS=${STEPS:-"gemm steps fp8"}
OUT=${OUT:-/tmp/out}
start=$(date +%s); R=${R:-/tmp/r}; mkdir -p "$R" "$OUT"
left() { echo $(( TOTAL - ($(date +%s) - start) )); }
pack() { tar czf "$OUT/results.tgz" -C "$(dirname "$R")" "$(basename "$R")"; }
step() {
    local name=$1 limit=$2; shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    local l; l=$(left); (( limit > l - 5 )) && limit=$(( l - 5 ))
    if (( limit < 20 )); then echo "=== $name SKIPPED: the time budget is spent"; return 0; fi
    echo "=== $name (limit $limit s, $l s left of $TOTAL)"
    timeout "$limit" "$@" > "$R/$name.log" 2>&1
    local rc=$?
    (( rc == 124 )) && echo "rc=124: TIMED OUT after $limit s (what finished is in $R/$name/)" || echo "rc=$rc"
    grep -v "^WARNING\|^W[0-9]\|^I[0-9]\|^E[0-9]\|Warning\|warnings.warn" "$R/$name.log" | grep -v "^|" | tail -"${TAIL:-6}"
    pack
}
STEP_ARGS="--preset steps --backends auto --slots 1 8 32 --gen-lengths 256 --iterations 4 --repeats 2 --ceiling-repeats 2"
COMPARE_ARGS="--preset compare --backends auto --compare-slots 8 --methods flash_cache flash_verify --schedules one window --gen-lengths 256 --ceiling-repeats 1"
ROWS="128 1024 4096"; SWEEP_ROWS="128"; GEMM=""; PROFILE=""; ONE="--slots 1"; FIRST="--slots 1 8"; LAST="--slots 32"
if [[ -n "${SMOKE:-}" ]]; then
    COMPARE_ARGS="--tiny --preset compare --backends auto --compare-slots 2 --methods flash_cache flash_verify --schedules one window --ceiling-repeats 1"
    STEP_ARGS="--tiny --preset steps --backends auto --slots 1 2 --iterations 2 --repeats 1"; ROWS="8 32"; SWEEP_ROWS="8"; GEMM="--tiny"; PROFILE="--tiny"; LAST="--slots 2"; FIRST="--slots 1"
fi
step gemm 180 python3 scripts/bench_gemm.py $GEMM --variants bf16 "int8 xla" "int8 pallas" --rows $ROWS --repeats 3 --out $R/gemm
step steps 200 python3 scripts/bench.py $STEP_ARGS --quantizations none int8-weights --out $R/steps
step fp8_32 260 python3 scripts/bench.py $STEP_ARGS $LAST --quantizations none fp8 --out $R/fp8_32
step fp8_1_8 200 python3 scripts/bench.py $STEP_ARGS $FIRST --quantizations none fp8 --out $R/fp8_1_8
step q_steps 250 python3 scripts/bench.py $STEP_ARGS --quantizations none fp8 --out $R/q_steps
step int8_nomerge 130 python3 scripts/bench.py $STEP_ARGS $FIRST --quantizations none int8-weights \
    --compiler-options '{"xla_gpu_dot_merger_threshold_mb": 0}' --out $R/int8_nomerge
step profile32 150 bash -c "python3 scripts/profile_step.py $PROFILE $LAST --quantization fp8 --out $R/profile && python3 scripts/profile_step.py $PROFILE --slots 1 --quantization fp8 --out $R/profile"
[[ " $STEPS " == *" compare "* ]] && STEPS="$STEPS compare_none compare_fp8 compare_int8-weights"
for q in none fp8 int8-weights; do
    step compare_$q 175 python3 scripts/bench.py $COMPARE_ARGS --quantizations $q --out $R/compare_$q
done
step fp8 150 python3 scripts/bench.py $STEP_ARGS --quantizations fp8 --out $R/fp8
step profile 150 bash -c "python3 scripts/profile_step.py $PROFILE --slots 1 --quantization fp8 --out $R/profile && python3 scripts/profile_step.py $PROFILE --slots 1 --quantization int8-weights --out $R/profile"
step sweep 180 python3 scripts/bench_gemm.py $GEMM --sweep --variants bf16 --rows $SWEEP_ROWS --repeats 3 --out $R/sweep
step fp8gemm 90 python3 scripts/bench_gemm.py $GEMM --variants bf16 fp8 "fp8 f32 product" "fp8 dot" --rows $ROWS --repeats 3 --out $R/fp8gemm
step fp8_triton 120 python3 scripts/bench.py $STEP_ARGS $ONE --quantizations fp8 --compiler-options '{}' --out $R/fp8_triton
step fp8_level1 240 python3 scripts/bench.py $STEP_ARGS $LAST --quantizations fp8 \
    --compiler-options '{"xla_gpu_enable_triton_gemm": false, "xla_gpu_autotune_level": 1}' --out $R/fp8_level1
python3 - "$R" <<'EOF'
import json, sys
from pathlib import Path
r = Path(sys.argv[1])
print("\n=== SUMMARY (issue 17; targets: 8-bit at 1 slot <= 0.65x bf16 step, fp8 at 32 slots <= 0.6x)")
runs = []
for name in ("steps", "fp8", "fp8_32", "fp8_1_8", "q_steps", "int8_nomerge", "fp8_triton", "fp8_level1"):
    f = r / name / "bench.json"
    if f.exists():
        report = json.loads(f.read_text())
        runs += report["runs"]
        for e in report["errors"]:
            print(f"  {name} ERROR {e['run']}: {e['error'][:200]}")
        print(f"  {name}: compiler options {report.get('compiler_options')}")
        for x in report["runs"]:
            x["quantization"] += {"fp8_triton": " (XLA defaults)", "fp8_level1": " (autotune level 1)", "int8_nomerge": " (dot merger off)"}.get(name, "")
bf16 = {}  # the first bf16 run at each slot count (fp8_32/fp8_1_8 run theirs beside fp8)
for x in runs:
    if x["quantization"] == "none":
        bf16.setdefault(x["slots"], x["step_s"])
print("decode step (flash_cache, 128 rows/slot): quantization slots step_ms x_bf16 compile_s")
for x in runs:
    ratio = x["step_s"] / bf16[x["slots"]] if x["slots"] in bf16 else float("nan")
    print(f"  {x['quantization']:28s} {x['slots']:3d} {1e3 * x['step_s']:8.2f} {ratio:6.2f} {x['compile_s']:7.1f}")
def verdict(what, quantization, slots, target):
    found = [x for x in runs if x["quantization"].split(" (")[0] == quantization and x["slots"] == slots]
    if not found or slots not in bf16:
        print(f"TARGET {what}: not measured")
    for run in found if slots in bf16 else ():
        ratio = run["step_s"] / bf16[slots]
        print(f"TARGET {what} [{run['quantization']}]: {ratio:.2f}x bf16 ({1e3 * run['step_s']:.2f} vs {1e3 * bf16[slots]:.2f} ms), "
              f"target <= {target}: {'MET' if ratio <= target else 'MISSED'}; compile {run['compile_s']:.0f} s")
verdict("int8-weights at 1 slot", "int8-weights", 1, 0.65)
verdict("fp8 at 1 slot", "fp8", 1, 0.65)
verdict("fp8 at 32 slots", "fp8", 32, 0.6)
compare = []
for q in ("none", "fp8", "int8-weights"):
    f = r / f"compare_{q}" / "bench.json"
    if f.exists():
        report = json.loads(f.read_text())
        compare += report["runs"]
        for e in report["errors"]:
            print(f"  compare_{q} ERROR {e['run']}: {e['error'][:200]}")
if compare:
    base = {(x["method"], x["schedule"]): x["tokens_per_s"] for x in compare if x["quantization"] == "none"}
    print("end to end (compare, 8 slots): method schedule quantization tokens/s x_bf16 tokens/step compile_s")
    for x in compare:
        b = base.get((x["method"], x["schedule"]))
        print(f"  {x['method']:12s} {x['schedule']:6s} {x['quantization']:12s} {x['tokens_per_s']:8.1f} "
              f"{x['tokens_per_s'] / b if b else float('nan'):5.2f} {x.get('tokens_per_step', float('nan')):6.2f} {x['compile_s']:6.1f}")
for name in ("gemm", "sweep", "fp8gemm"):
    f = r / name / "bench_gemm.json"
    if not f.exists():
        continue
    print(f"GEMM ({name}{', the 3 fastest tilings' if name == 'sweep' else ''}): shape rows variant us TFLOP/s weight_GB/s x_bf16 gemm")
    results = json.loads(f.read_text())["results"]
    if name == "sweep":
        ok = [x for x in results if "seconds" in x and x["variant"] != "bf16"]
        keep = {id(x) for key in {(x["shape"], x["rows"]) for x in ok}
                for x in sorted((y for y in ok if (y["shape"], y["rows"]) == key), key=lambda y: y["seconds"])[:3]}
        results = [x for x in results if x["variant"] == "bf16" or id(x) in keep or "seconds" not in x]
    for x in results:
        if "seconds" not in x:
            print(f"  {x['shape']} {x['rows']} {x['variant']}: FAILED {x['error'][:150]}")
        else:
            print(f"  {x['shape']:19s} {x['rows']:5d} {x['variant']:28s} {1e6 * x['seconds']:8.1f} {x['tflops']:5.0f} "
                  f"{x['weight_gbps']:6.0f} {x['time_over_bf16'] or 1:5.2f} {','.join(x['gemm'])[:40]}")
for f in sorted((r / "profile").glob("profile_*.json")):
    p = json.loads(f.read_text())
    print(f"PROFILE {f.stem}: wall {p['wall_ms_per_step_profiled']:.2f} ms/step, device busy {p['device_busy_ms_per_step']:.2f}, "
          f"{p['kernels_per_step']:.0f} kernels/step; top kernels (ms/step, calls/step):")
    for k in p["top"][:12]:
        print(f"  {k['ms_per_step']:7.3f} {k['calls_per_step']:5.0f}  {k['name'][:100]}")
EOF
pack
echo "total $(( $(date +%s) - start )) s"
