set -x
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv
git log --oneline -1
PYTHONPATH=. timeout 200 python3 scripts/gpu/one_request.py --parts steps --variants bf16 --budget-s 100 --repeats 3 --out $OUT/one_request 2>&1 | tail -40
