"""The pure-jnp math the model and the kernels share: dense attention, rotary embeddings and RMSNorm.

Each Pallas kernel in pallas_kernels/ is checked against a reference built from these; the
model (dllm_jax) calls them directly on its XLA path. This package stands on jax alone.
"""
