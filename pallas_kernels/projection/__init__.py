"""Projection into the cache: the fused q/k/v projection + RoPE + cache write
(qkv_rope_cache.py), the K/V row scatter alone (scatter_rows.py) and the RoPE reference
(rope.py) the model shares.
"""
