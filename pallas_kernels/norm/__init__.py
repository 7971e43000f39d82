"""RMSNorm: the jnp formula the model uses (rms_norm.py) and the batch-invariant kernel
(invariant_rms_norm.py).
"""
