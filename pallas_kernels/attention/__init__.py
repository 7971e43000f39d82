"""Attention over the flat K/V cache: the Triton kernel (cache_attention.py with
cache_attention_kernel.py), the TPU Mosaic kernel (cache_attention_tpu.py), the online-softmax
update they share and the dense jnp reference (reference.py).
"""
