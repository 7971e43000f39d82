"""The number formats a converted checkpoint may store (importable without jax, for the command line)."""

DTYPES = ("bfloat16", "float16", "float32")
# 8-bit weights a checkpoint may store (dllm_jax.models.quantization says what they are)
QUANTIZATIONS = ("none", "fp8", "int8-weights")


def quantizes_embedding(mode: str, weight_tying: bool) -> bool:
    """Whether params of this quantization store the embedding in int8: yes unless "none" or
    the table is also the LM head (weight_tying), which stays in the model dtype."""
    return mode != "none" and not weight_tying
