"""Sampling kernels: the top-p/top-k cutoff (top_p_top_k.py) beside its jnp reference."""
