"""Matrix products: the int8 weight GEMM (int8_matmul.py) and the batch-invariant matmul
(invariant_matmul.py), each beside its jnp reference.
"""
