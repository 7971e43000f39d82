"""The number formats a converted checkpoint may store (importable without jax, for the command line)."""

DTYPES = ("bfloat16", "float16", "float32")
# 8-bit weights a checkpoint may store (dllm_jax.models.quantization says what they are)
QUANTIZATIONS = ("none", "fp8", "int8-weights")
