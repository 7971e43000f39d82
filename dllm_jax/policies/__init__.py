"""The policy floor: what each method recomputes and commits, per slot (the loop runs them).

block.py (llada and fast_dllm: semi-autoregressive blocks), flash_cache.py (the sliding window
with selective refresh) and flash_verify.py (its verification stage), dream_sampler.py with
dream_unmasking.py (Dream's own sampler), commit_rules.py (threshold and count commits) and
factory.py (make_policy: DecodeConfig -> policy). Each policy implements
dllm_jax.runtime.policy.DecodePolicy.
"""
