"""RMSNorm: the jnp formulas the models use (rms_norm.py), the batch-invariant kernel
(invariant_rms_norm.py), and DiffusionGemma's per-head norm followed by RoPE in one pass
(head_norm_rope.py).
"""
