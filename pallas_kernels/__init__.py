"""Pallas kernels by operation (attention/, projection/, matmul/, norm/, sampling/), each beside a
pure-jnp reference of the same signature; common.py holds the tile helpers they share. Stands on
jax alone: nothing here imports dllm_jax.
"""
