#!/bin/bash
# one device call: the step with the full layers' attention on XLA and on the kernel (value blocks), the attention sweeps,
# the sampler's ablations, DotMerger off, and e87f4ca (.old) last
set -u
mkdir -p $OUT/r
save() { tar czf $OUT/all.tar.gz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt 2>&1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/r/timeline.txt; }
E="python3 scripts/gpu/diffusion_gemma_engine.py --transformers-s 0"
el start
PYTHONPATH=$PWD timeout 100 python3 scripts/gpu/canvas_attention.py --kinds full --modes canvas --slots 32 8 --cached 256 --budget-s 80 --out $OUT/r/attn_full > $OUT/r/attn_full.log 2>&1; el attn_full $?; save
PYTHONPATH=$PWD timeout 120 $E --slots 1 8 32 --budget-s 95 --hard-limit-s 110 --out $OUT/r/xla_full > $OUT/r/xla_full.log 2>&1; el xla_full $?; save
PYTHONPATH=$PWD timeout 130 $E --slots 1 8 32 --canvas-attention-max-head-dim 512 --profile-slots 32 --budget-s 100 --hard-limit-s 120 --out $OUT/r/kernel_full > $OUT/r/kernel_full.log 2>&1; el kernel_full $?; save
PYTHONPATH=$PWD timeout 80 python3 scripts/gpu/canvas_sampler_kernel.py --ablations --groups 8 --calls 5 --repeats 3 --budget-s 60 --out $OUT/r/ablation > $OUT/r/ablation.log 2>&1; el ablation $?; save
PYTHONPATH=$PWD timeout 100 $E --slots 32 --xla-option xla_gpu_dot_merger_threshold_mb=0 --budget-s 80 --hard-limit-s 95 --out $OUT/r/nomerge > $OUT/r/nomerge.log 2>&1; el nomerge $?; save
el done
