#!/bin/bash
# device call 1: the step with the full layers' 32x32 tiling against XLA there; the sampler's ablations (cvt rounding);
# the sliding layers' attention tilings at 32 and 8 slots
set -u
mkdir -p $OUT/r
save() { tar czf $OUT/all.tar.gz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt 2>&1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/r/timeline.txt; }
E="python3 scripts/gpu/diffusion_gemma_engine.py --transformers-s 0"
el start
PYTHONPATH=$PWD timeout 120 $E --slots 1 32 --profile-slots 32 --budget-s 90 --hard-limit-s 110 --out $OUT/r/k32x32 > $OUT/r/k32x32.log 2>&1; el k32x32 $?; save
PYTHONPATH=$PWD timeout 100 $E --slots 1 32 --canvas-attention-max-head-dim 256 --budget-s 75 --hard-limit-s 95 --out $OUT/r/xla_full > $OUT/r/xla_full.log 2>&1; el xla_full $?; save
PYTHONPATH=$PWD timeout 80 python3 scripts/gpu/canvas_sampler_kernel.py --ablations --groups 8 --calls 5 --repeats 3 --budget-s 60 --out $OUT/r/ablation > $OUT/r/ablation.log 2>&1; el ablation $?; save
PYTHONPATH=$PWD timeout 90 python3 scripts/gpu/canvas_attention.py --kinds sliding --modes canvas --slots 32 8 --cached 256 --budget-s 70 --out $OUT/r/attn_sliding > $OUT/r/attn_sliding.log 2>&1; el attn_sliding $?; save
el done
