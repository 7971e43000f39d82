"""The ground floor: errors, argument checks, atomic output files, quiet logs and the platform
probe that every other part of dllm_jax may use. Nothing here imports another dllm_jax floor.
"""
